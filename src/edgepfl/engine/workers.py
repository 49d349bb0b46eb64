"""Clients of a step trained at the same time, each in a worker process (``train.workers``).

The workers are forked from the simulation once its data and client parts are built, so
they share the data set's memory (copy-on-write pages that nobody writes) instead of
holding copies, and each runs PyTorch on one thread: the small batches of federated
clients keep one core busy, not many. A task is one client's work: its delivered
message and its state go out, its new state, its reply and the FLOPs it ran come back.
Seeds are derived from (run seed, step, client) as in the sequential loop, so a client
draws the same batches wherever it runs and the metrics are the sequential run's.

The module-level ``_job`` is how a forked worker finds the transport: a fork copies the
parent's memory, so the object set here before the pool starts is the workers' too.
"""

from __future__ import annotations

import multiprocessing as mp
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from edgepfl.engine.threads import free_cores
from edgepfl.errors import ConfigError

_job: Callable[[Any], Any] | None = None


def worker_count(setting: int | str, device: torch.device) -> int:
    """``train.workers`` as a number of processes (1: train in this process); ``auto``:
    the cores no other process keeps busy (``engine.threads``), on the CPU."""
    if setting == "auto":
        return free_cores() if device.type == "cpu" else 1
    count = int(setting)
    if count > 1 and device.type != "cpu":
        raise ConfigError(
            f"train.workers = {setting} trains clients in CPU worker processes, but "
            f"train.device resolves to {device.type!r}; on a GPU clients train one after "
            f"another in this process: set train.workers = 1 (or train.device = 'cpu')")
    return max(1, count)


def _start() -> None:
    torch.set_num_threads(1)


def _run(task: Any) -> Any:
    assert _job is not None, "a worker started without its job"
    return _job(task)


class WorkerPool:
    """A pool of ``count`` forked processes running ``job`` on tasks, results in task order."""

    def __init__(self, count: int, job: Callable[[Any], Any]):
        self.count = count
        self._job = job
        self._pool: Any = None

    def map(self, tasks: Iterable[Any]) -> Iterator[Any]:
        global _job
        if self._pool is None:
            if "fork" not in mp.get_all_start_methods():
                raise ConfigError("train.workers > 1 needs processes started by fork (Linux, "
                                  "macOS); this platform has none: set train.workers = 1")
            _job = self._job
            self._pool = torch.multiprocessing.get_context("fork").Pool(self.count, _start)
            # a simulation stepped by hand and dropped still stops its workers
            self._finalizer = weakref.finalize(self, _stop, self._pool)
        return self._pool.imap(_run, tasks)

    def close(self) -> None:
        if self._pool is not None:
            self._finalizer()
            self._pool = None


def _stop(pool: Any) -> None:
    pool.terminate()
    pool.join()
