"""What training a model costs in memory: a property of the model, read by algorithms that
place models on devices by their memory (HMPL's tiers) and by the system model."""

from __future__ import annotations

import torch


def training_step_bytes(model: torch.nn.Module, input_shape: tuple[int, ...], batch: int) -> dict[str, int]:
    """The memory one SGD step of ``model`` on a batch of ``batch`` inputs of ``input_shape``
    (C, H, W) needs: the weights, their gradients (which persist between steps; plain SGD
    keeps no other state) and the activations autograd saves for the backward pass
    (counted per storage as they are saved, on a zero batch), all as if live at once, as
    they are when the backward pass starts. A device's model memory, without the
    framework's own or the data's."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    params_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        model(torch.zeros(batch, *input_shape)).sum()
    activations = sum(n for ptr, n in saved.items() if ptr not in params_ptrs)
    return {"weights": params, "gradients": params, "activations": activations,
            "total": 2 * params + activations}
