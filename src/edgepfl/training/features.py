"""A model's features as its classifier sees them, read from the forward that made the logits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from edgepfl.models.layers import LayerSpec


class FeatureTap:
    """The input of a model's classifier in its latest forward pass, i.e. its features.

    A loss on the features (MOON's projection, FedProto's prototype distance) can read
    them from the forward that computed the logits instead of running the body twice: a
    second pass costs a third of a training step and, on a BatchNorm model, updates the
    running statistics twice per batch.
    """

    def __init__(self) -> None:
        self._value: torch.Tensor | None = None

    def _keep(self, module: nn.Module, args: tuple) -> None:
        self._value = args[0]

    def take(self) -> torch.Tensor:
        value, self._value = self._value, None
        if value is None:
            raise RuntimeError("the model's forward did not pass through its classifier")
        return value


def classifier_module(layers: LayerSpec) -> str:
    """Module name of a model's last layer, whose input is its ``features`` in our zoo."""
    return layers.names[-1]


@contextmanager
def tap_features(model: nn.Module, classifier: str) -> Iterator[FeatureTap]:
    """A FeatureTap on ``model``'s submodule ``classifier`` (e.g. "fc3") while in use."""
    tap = FeatureTap()
    handle = model.get_submodule(classifier).register_forward_pre_hook(tap._keep)
    try:
        yield tap
    finally:
        handle.remove()
