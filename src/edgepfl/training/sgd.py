"""The SGD step every training path takes, and one client's local training as data.

The optimizer is a hand-written SGD over ``torch._foreach_*`` so that algorithm-specific
gradient terms (proximal pulls, KAPC's coaching term) are added to the gradient in place
instead of being built as autograd graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from edgepfl.training.client_data import ClientData

if TYPE_CHECKING:
    from edgepfl.training.trainer import Trainer

State = dict[str, torch.Tensor]
GradHook = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None]
LossHook = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# the model's loss as a function of its weights and a batch: loss(weights, x, y)
LossFn = Callable[[Mapping[str, torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor]
# a local step of an algorithm's own: (loss, weights, x1, y1, x2, y2, ...) -> (the gradient
# that SGD applies, the loss to report); a pure function, so one client's step and a
# vmapped step of many are the same code
StepFn = Callable[..., tuple[Mapping[str, torch.Tensor], torch.Tensor]]


@torch.no_grad()
def sgd_step(params: Sequence[torch.Tensor], lr: float, momentum: float, weight_decay: float,
             bufs: list[torch.Tensor] | None, grad_hook: GradHook | None = None
             ) -> list[torch.Tensor] | None:
    """One step of plain SGD on ``params``' gradients (a missing one counts as zero), with
    weight decay, ``grad_hook``'s in-place terms and heavy-ball momentum; returns the
    momentum buffers to pass to the next step (None without momentum)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return sgd_update(params, grads, lr, momentum, weight_decay, bufs, grad_hook)


@torch.no_grad()
def sgd_update(params: Sequence[torch.Tensor], grads: list[torch.Tensor], lr: float,
               momentum: float, weight_decay: float, bufs: list[torch.Tensor] | None,
               grad_hook: GradHook | None = None) -> list[torch.Tensor] | None:
    """``sgd_step`` with the gradients given (changed in place)."""
    if weight_decay:
        torch._foreach_add_(grads, params, alpha=weight_decay)
    if grad_hook is not None:
        grad_hook(params, grads)
    if momentum:
        if bufs is None:
            bufs = [g.clone() for g in grads]
        else:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads)
        grads = bufs
    torch._foreach_add_(params, grads, alpha=-lr)
    return bufs


@dataclass
class FitRequest:
    """One client's local training as data: the weights it starts from and ``Trainer.fit``'s
    arguments. A client part that states its training this way (``Client.fit_request``)
    lets the engine train a step's clients together (``train.batch_clients``)."""

    weights: Mapping[str, torch.Tensor]
    data: ClientData
    epochs: int
    batch_size: int
    lr: float
    gen: torch.Generator
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_hook: GradHook | None = None
    # steps on each batch before the next is drawn, the last one's loss reported (pFedMe's
    # K inner steps on the personalized model)
    repeat: int = 1
    # a step of its own on each group of batches ``draw`` yields, with the samples it counts
    # (Per-FedAvg's MAML step on two or three batches); None: one gradient step a batch.
    # Requests batch together when their steps are equal (a dataclass of the settings)
    step: StepFn | None = None
    draw: Callable[[FitRequest], Iterator[tuple[tuple[torch.Tensor, ...], int]]] | None = None
    # the skeleton it trains on, where not the client's own (``Client.trainer``): a part
    # whose clients hold models of several shapes (HMPL's tiers) keeps one per shape, and
    # the engine batches requests of one skeleton together
    trainer: Trainer | None = None

    def epochs_of_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches ``fit`` draws, in its order, from the request's own generator."""
        for _ in range(self.epochs):
            yield from self.data.batches(self.batch_size, self.gen)


def fit_stats(loss_sum: float, seen: int, steps: int) -> dict[str, float]:
    """What a fit returns: the mean training loss over its samples, its steps and samples."""
    return {"train_loss": loss_sum / max(seen, 1), "steps": float(steps), "samples": float(seen)}

