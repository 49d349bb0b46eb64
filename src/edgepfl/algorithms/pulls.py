"""Proximal pulls: the gradient terms that draw a client's weights towards an anchor."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgepfl.algorithms.sgd import GradHook


@dataclass(frozen=True)
class Pull:
    """The gradient of coef/2 ||w - anchor||^2, coef (w - anchor), added in place: the
    proximal pull of FedProx, FedAMP, ClusterFL and KAPC's squared coaching loss. A
    ``GradHook`` like any other; ``fit_many`` applies the pulls of a step's clients as one
    operation on their stacked weights instead of one per client."""

    coef: float
    anchor: Sequence[torch.Tensor]

    def __call__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        diffs = torch._foreach_sub(list(params), list(self.anchor))
        torch._foreach_add_(list(grads), diffs, alpha=self.coef)

    @staticmethod
    def stacked(hooks: Sequence[GradHook | None]) -> Pull | None:
        """The clients' pulls as one on their stacked weights (``[clients, ...]`` anchors),
        elementwise as each client's own, so the same bits; None unless every hook is a
        pull of one coefficient."""
        pulls = [h for h in hooks if isinstance(h, Pull)]
        if len(pulls) != len(hooks) or len({p.coef for p in pulls}) != 1:
            return None
        return Pull(pulls[0].coef, [torch.stack(a) for a in zip(*(p.anchor for p in pulls),
                                                                   strict=True)])

    def rows(self, rows: torch.Tensor) -> Pull:
        """A stacked pull for the clients at ``rows`` alone."""
        return Pull(self.coef, [a[rows] for a in self.anchor])
