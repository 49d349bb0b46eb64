"""Memory figures: bytes of tensors a party holds, and the process's peak resident set."""

from __future__ import annotations

import os
import platform
import resource
import sys
from collections.abc import Iterable, Mapping

import torch


def state_bytes(tensors: Mapping[str, torch.Tensor] | Iterable[torch.Tensor]) -> int:
    """Bytes of memory held by ``tensors`` (a mapping or an iterable).

    Counted per distinct storage, not per tensor: a view shares its base's memory, so a
    state dict holding a stacked tensor and views of its rows costs the stack once.
    """
    values = tensors.values() if isinstance(tensors, Mapping) else tensors
    seen: dict[tuple[str, int], int] = {}
    for t in values:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_bytes expects tensors, got {type(t).__name__}")
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())


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


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far, bytes (``getrusage``).

    Linux reports kilobytes and macOS bytes. It is the peak of the whole process (data
    set, interpreter, every simulated client), not of the server alone.
    """
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def host_info() -> dict[str, object]:
    """What machine and library computed a run: float results on a CPU can differ in the
    last bits from one processor model (its vector kernels) or torch version to another,
    which is enough to flip a near-tie prediction or a threshold decision, so a kept run
    says where it came from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "os": platform.system()}
