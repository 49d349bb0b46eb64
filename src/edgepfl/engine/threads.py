"""How many torch threads a run trains with (``train.threads``, ``--threads``).

What decides it was measured on the project machine (bench/speed/README.md, 'Threads'):
on idle cores every model we train, down to the 8x8 digits' CNN, ran its rounds faster on
all of them than on one; but a single process beside the run keeping one core busy made
two threads four times as slow as one, because OpenMP's threads wait for each other at
every operator and one of them waits for a core the other process holds. So ``auto``
trains on the cores that no other process keeps busy: counted from the kernel's CPU
counters at the start, and again after every round (``ThreadGovernor``), so that a run
gives cores back when a test suite starts beside it and takes them again when it ends.

A small step is not spread thinner than ``FLOPS_PER_THREAD`` a thread: hand-overs cost
more than such slices gain. (On the 2-core project machine this never binds; it keeps a
LeNet-sized step from being cut into 64 slivers on a large server.) Telling OpenMP to sleep
instead of spinning (``OMP_WAIT_POLICY=PASSIVE``) was measured too and is slower quiet and
busy alike (the sleeping threads take a system call to wake at every operator).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable

import torch

from edgepfl.engine.hooks import Hook

log = logging.getLogger(__name__)

# the least work (FLOPs of one training step) worth a thread of its own
FLOPS_PER_THREAD = 0.02e9


def usable_cores() -> int:
    """The cores this process may run on (its affinity, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_counters() -> tuple[int, int, int] | None:
    """(busy, total) jiffies over every CPU since boot, and this process's own CPU time in
    the same ticks; None where /proc is not (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            own = f.read().rpartition(")")[2].split()
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle and waiting for I/O
    total = sum(fields)
    return total - idle, total, int(own[11]) + int(own[12])  # utime + stime


def others_load(before: tuple[int, int, int], after: tuple[int, int, int]) -> float:
    """The cores other processes kept busy between two ``cpu_counters`` readings."""
    busy, total, own = (a - b for a, b in zip(after, before, strict=True))
    if total <= 0:
        return 0.0
    cpus = os.cpu_count() or 1
    return max(0.0, cpus * (busy - own) / total)


def auto_threads(step_flops: float | None, load: float, ceiling: int) -> int:
    """``auto``'s count: the cores ``load`` leaves free, at most ``ceiling``, no thread
    with less than ``FLOPS_PER_THREAD`` of a step (``step_flops`` None: not known)."""
    # a core counts as taken from half a core's load on: a shell or the kernel leaves it
    count = min(ceiling, usable_cores() - math.floor(load + 0.5))
    if step_flops is not None:
        count = min(count, math.ceil(step_flops / FLOPS_PER_THREAD))
    return max(1, count)


def free_cores(probe_s: float = 0.15) -> int:
    """The usable cores that no other process keeps busy over the next ``probe_s``
    seconds, at least one (``train.workers = auto``)."""
    before = cpu_counters()
    if before is None:
        return usable_cores()
    time.sleep(probe_s)
    return auto_threads(None, others_load(before, cpu_counters() or before), usable_cores())


def step_flops(model: torch.nn.Module, sample: torch.Tensor, batch_size: int) -> float | None:
    """One training step's FLOPs: a forward pass of one ``sample`` counted, times three
    (forward and backward) and the batch size; None if the model cannot be run on it
    alone (a model that needs more than an input tensor)."""
    from edgepfl.system.flops import count_flops

    was_training = model.training
    p = next(model.parameters(), None)
    try:
        model.eval()
        with torch.no_grad():
            _, flops = count_flops(model, sample.unsqueeze(0).to(
                p.device if p is not None else "cpu"))
    except Exception:  # noqa: BLE001 - a model this estimate cannot run is taken as large
        return None
    finally:
        model.train(was_training)
    return 3.0 * flops * batch_size


class ThreadGovernor(Hook):
    """``train.threads`` applied: a number is set once; ``auto`` is set at the start from
    the load measured over ``probe_s`` seconds, and again after each round from the load
    of that round. Never above the count the process had when the first governor was made
    (torch's choice, the physical cores, or what the caller set: a comparison's worker
    keeps to its share of the cores, a test process to its one thread)."""

    ceiling: int | None = None

    def __init__(self, setting: int | str, flops: Callable[[], float | None],
                 probe_s: float = 0.15):
        if ThreadGovernor.ceiling is None:
            ThreadGovernor.ceiling = torch.get_num_threads()
        # with one thread to give there is nothing to decide (nor to measure)
        self.setting = setting if ThreadGovernor.ceiling > 1 or setting != "auto" else 1
        self.flops = flops() if self.setting == "auto" else None
        self._last = cpu_counters() if self.setting == "auto" else None
        if self._last is not None and probe_s > 0:
            time.sleep(probe_s)
        self.count = self._set(self._decide())

    def _decide(self) -> int:
        if self.setting != "auto":
            return int(self.setting)
        now = cpu_counters()
        load = 0.0 if now is None or self._last is None else others_load(self._last, now)
        self._last = now
        return auto_threads(self.flops, load, ThreadGovernor.ceiling or 1)

    def _set(self, count: int) -> int:
        if count != torch.get_num_threads():
            torch.set_num_threads(count)
            log.debug("train.threads = %s: %d torch thread%s", self.setting, count,
                      "s" * (count > 1))
        return count

    def after_round(self, rounds, row: dict) -> None:
        if self.setting == "auto":
            self.count = self._set(self._decide())
