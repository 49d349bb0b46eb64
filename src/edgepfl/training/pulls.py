"""Proximal pulls (the gradient terms that draw a client's weights towards an anchor) and
Adam's direction, both transforms of a step's gradients in place."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from edgepfl.training.sgd import GradHook


@dataclass(frozen=True)
class Pull:
    """The gradient of coef/2 ||w - anchor||^2, coef (w - anchor), added in place: the
    proximal pull of FedProx, FedAMP, ClusterFL and KAPC's squared coaching loss. A
    ``GradHook`` like any other; ``fit_many`` applies the pulls of a step's clients as one
    operation on their stacked weights instead of one per client.

    ``follow`` > 0 moves the anchor towards the weights after each batch (``advance``),
    anchor -= follow (anchor - w): pFedMe's step on the local model w_i, whose pull the
    personalized model's inner steps feel."""

    coef: float
    anchor: Sequence[torch.Tensor]
    follow: float = 0.0

    def __call__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        diffs = torch._foreach_sub(list(params), list(self.anchor))
        torch._foreach_add_(list(grads), diffs, alpha=self.coef)

    @torch.no_grad()
    def advance(self, params: Sequence[torch.Tensor]) -> None:
        """The anchor's step after a batch (in place; nothing when ``follow`` is 0)."""
        if self.follow:
            anchor = list(self.anchor)
            torch._foreach_add_(anchor, torch._foreach_sub(anchor, list(params)),
                                alpha=-self.follow)

    @staticmethod
    def stacked(hooks: Sequence[GradHook | None]) -> Pull | None:
        """The clients' pulls as one on their stacked weights (``[clients, ...]`` anchors),
        elementwise as each client's own, so the same bits; None unless every hook is a
        pull of one coefficient and one ``follow``."""
        pulls = [h for h in hooks if isinstance(h, Pull)]
        if len(pulls) != len(hooks) or len({(p.coef, p.follow) for p in pulls}) != 1:
            return None
        return Pull(pulls[0].coef, [torch.stack(a) for a in zip(*(p.anchor for p in pulls),
                                                                   strict=True)],
                    pulls[0].follow)

    def rows(self, rows: torch.Tensor | slice) -> Pull:
        """A stacked pull for the clients at ``rows`` alone (a copy of their anchors
        unless ``rows`` is every row)."""
        if isinstance(rows, slice):
            return self
        return Pull(self.coef, [a[rows] for a in self.anchor], self.follow)

    def put(self, rows: torch.Tensor | slice, part: Pull) -> None:
        """Write ``part``'s anchors (``rows(rows)`` after it advanced) back to the stack."""
        if part is not self:
            with torch.no_grad():
                for a, b in zip(self.anchor, part.anchor, strict=True):
                    a[rows] = b

    def unstack(self, pulls: Sequence[Pull]) -> None:
        """Copy the stacked anchors back into each client's own ``pulls`` (where their
        anchors move, so that each ends as its own fit would leave it)."""
        if self.follow:
            with torch.no_grad():
                for i, pull in enumerate(pulls):
                    for own, stacked in zip(pull.anchor, self.anchor, strict=True):
                        own.copy_(stacked[i])


class AdamDirection:
    """torch.optim.Adam's bias-corrected direction m_hat / (sqrt(v_hat) + eps) (no weight
    decay), written over the gradients in place, so that a plain step x - lr * g is Adam's
    step. The moments live in the object: one object, one optimisation (pFedBayes' and
    hierbayes' clients start fresh ones every round; pFedBayes' reference code keeps one
    Adam per user across rounds, a departure docs/algorithms.md lists)."""

    def __init__(self, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.betas, self.eps = betas, eps
        self.m: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.t = 0

    def __call__(self, grads: Sequence[torch.Tensor]) -> None:
        b1, b2 = self.betas
        grads = list(grads)
        if not self.m:
            self.m = [torch.zeros_like(g) for g in grads]
            self.v = [torch.zeros_like(g) for g in grads]
        self.t += 1
        torch._foreach_lerp_(self.m, grads, 1 - b1)
        torch._foreach_mul_(self.v, b2)
        torch._foreach_addcmul_(self.v, grads, grads, value=1 - b2)
        denom = torch._foreach_sqrt(self.v)
        torch._foreach_div_(denom, (1 - b2 ** self.t) ** 0.5)
        torch._foreach_add_(denom, self.eps)
        step = torch._foreach_div(self.m, denom)
        torch._foreach_div_(step, 1 - b1 ** self.t)
        for g, d in zip(grads, step, strict=True):
            g.copy_(d)
