"""Evaluation on the trainer's skeleton: a model's (or a Monte Carlo predictive's) correct
predictions and summed loss on a test split."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from edgepfl.training.device import to_device


class Evaluation:
    """``Trainer``'s evaluation, on the skeleton and device that ``Trainer`` holds."""

    model: nn.Module
    device: torch.device
    eval_batch_size: int
    # the state last loaded for evaluation: loading it again is skipped
    _loaded: object | None
    load: Callable[[Mapping[str, torch.Tensor]], None]
    layout: Callable[[torch.Tensor], torch.Tensor]

    @torch.inference_mode()
    def evaluate(self, state: Mapping[str, torch.Tensor], x: torch.Tensor,
                 y: torch.Tensor) -> tuple[int, float]:
        """(correct predictions, summed cross-entropy) of ``state`` on ``(x, y)``.

        Loading is skipped when the same state object was just evaluated, which makes
        evaluating one global model on N clients cost one copy instead of N. Call
        ``forget()`` before an evaluation pass if states may have changed in place.
        """
        if self._loaded is not state:
            self.load(state)
            self._loaded = state  # a held reference, so identity cannot be recycled
        self.model.eval()
        # summed on the device (in float64, as Python's floats would), read once: reading
        # per batch would wait for the GPU every batch
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for start in range(0, y.numel(), self.eval_batch_size):
            xb = self.layout(x[start:start + self.eval_batch_size])
            yb = to_device(y[start:start + self.eval_batch_size], self.device)
            logits = self.model(xb)
            correct += (logits.argmax(1) == yb).sum()
            loss += F.cross_entropy(logits, yb, reduction="sum").double()
        return int(correct), float(loss)

    @torch.inference_mode()
    def evaluate_predictive(self, states: Sequence[Mapping[str, torch.Tensor]], x: torch.Tensor,
                            y: torch.Tensor) -> tuple[int, float]:
        """(correct, summed negative log-likelihood) of the Monte Carlo predictive
        ``mean_s softmax(f(x; states[s]))``; one state is ``evaluate`` itself."""
        if len(states) == 1:
            return self.evaluate(states[0], x, y)
        self._loaded = None
        self.model.eval()
        probs = torch.zeros(y.numel(), 0, device=self.device)
        for state in states:
            self.load(state)
            chunks = [torch.softmax(self.model(self.layout(x[s:s + self.eval_batch_size])), 1)
                      for s in range(0, y.numel(), self.eval_batch_size)]
            p = torch.cat(chunks) if chunks else torch.zeros(0, 0, device=self.device)
            probs = p if probs.numel() == 0 else probs + p
        self._loaded = None
        probs = (probs / len(states)).cpu()
        correct = int((probs.argmax(1) == y).sum())
        picked = probs.gather(1, y.view(-1, 1)).clamp_min(1e-12)
        return correct, float(-picked.log().sum())
