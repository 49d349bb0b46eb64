"""Memory figures: bytes of tensors a party holds, and the process's peak resident set."""

from __future__ import annotations

import os
import platform
import resource
import sys
from collections.abc import Iterable, Mapping

import torch

from edgepfl.models.step_memory import training_step_bytes

__all__ = ["host_info", "peak_rss_bytes", "state_bytes", "training_step_bytes"]


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
