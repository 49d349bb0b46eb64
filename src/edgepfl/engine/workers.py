"""Clients of a step trained at the same time, each in a worker process (``train.workers``).

The workers are forked from the simulation once its data and client parts are built, so
they share the data set's memory (copy-on-write pages that nobody writes) instead of
holding copies, and each runs PyTorch on one thread: the small batches of federated
clients keep one core busy, not many. A task is one client's work: its delivered
message and its state go out, its new state, its reply and the FLOPs it ran come back.
Seeds are derived from (run seed, step, client) as in the sequential loop, so a client
draws the same batches wherever it runs and the metrics are the sequential run's.

With ``faults.client_timeout`` the workers are a ``TimedPool``: one pipe per worker, so
the worker still busy with a client step when its time is up is known, killed and
replaced by a fresh fork, and the step becomes a failed client (``InProcess._timed_out``).

The module-level ``_job`` is how a forked worker finds the transport: a fork copies the
parent's memory, so the object set here before the pool starts is the workers' too.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from multiprocessing import connection
from typing import Any

import torch

from edgepfl.engine.threads import free_cores
from edgepfl.errors import ConfigError, EdgepflError

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


def _serve(conn: Any) -> None:
    """A ``TimedPool`` worker: tasks in on ``conn``, ``("done", result)`` or
    ``("raised", exception)`` out, until ``None`` or the pipe closes. Ctrl-C is the
    parent's to handle: it stops the workers."""
    _start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if task is None:
            return
        try:
            out: tuple = ("done", _run(task))
        except Exception as exc:  # noqa: BLE001 - raised again in the parent
            out = ("raised", exc)
        try:
            conn.send(out)
        except Exception as exc:  # noqa: BLE001 - a result or exception that cannot pickle
            conn.send(("raised", RuntimeError(f"a worker's result could not be sent back: "
                                              f"{type(exc).__name__}: {exc}")))


class _Worker:
    """One forked process of a ``TimedPool`` with its pipe and the task it runs."""

    def __init__(self) -> None:
        ctx = torch.multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()
        self.index, self.task, self.started = -1, None, 0.0

    def give(self, index: int, task: Any) -> None:
        self.conn.send(task)
        self.index, self.task, self.started = index, task, time.monotonic()

    def result(self) -> Any:
        try:
            kind, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise EdgepflError(f"a worker process (pid {self.proc.pid}) ended without "
                               f"its result (exit code {self.proc.exitcode})") from exc
        if kind == "raised":
            raise value
        return value

    def stop(self) -> None:
        self.proc.kill()  # idle, or hung in a task: nothing of it is kept
        self.proc.join()
        self.conn.close()


class TimedPool:
    """``WorkerPool`` whose tasks may have a time limit (``faults.client_timeout``): each
    worker has a pipe of its own, so the one still busy with a task when its time is up
    is known; it is killed and replaced, and the task's result is ``on_timeout(task)``."""

    def __init__(self, count: int, job: Callable[[Any], Any]):
        self.count = count
        self._job = job
        self._workers: list[_Worker] = []

    def _start_workers(self) -> None:
        global _job
        if not self._workers:
            if "fork" not in mp.get_all_start_methods():
                raise ConfigError("train.workers > 1 needs processes started by fork (Linux, "
                                  "macOS); this platform has none: set train.workers = 1")
            _job = self._job
            self._workers = [_Worker() for _ in range(self.count)]
            self._finalizer = weakref.finalize(self, _stop_workers, self._workers)

    def map(self, tasks: Iterable[Any], timeout: float | None = None,
            on_timeout: Callable[[Any], Any] | None = None) -> Iterator[Any]:
        """The results of ``tasks`` in task order; a task running longer than ``timeout``
        seconds gets ``on_timeout(task)`` as its result and its worker is replaced."""
        self._start_workers()
        todo = list(enumerate(tasks))[::-1]
        count, out = len(todo), {}
        idle = list(self._workers)
        busy: list[_Worker] = []
        try:
            while todo or busy:
                while todo and idle:
                    worker = idle.pop()
                    worker.give(*todo.pop())
                    busy.append(worker)
                wait_s = (None if timeout is None else
                          max(0.0, min(w.started for w in busy) + timeout - time.monotonic()))
                ready = connection.wait([w.conn for w in busy], wait_s)
                for worker in list(busy):
                    done = worker.conn in ready
                    if not done and (timeout is None
                                     or time.monotonic() - worker.started < timeout):
                        continue
                    busy.remove(worker)
                    if done:
                        out[worker.index] = worker.result()
                        idle.append(worker)
                    else:
                        assert on_timeout is not None, "a time limit without on_timeout"
                        out[worker.index] = on_timeout(worker.task)
                        idle.append(self._replace(worker))
        except BaseException:
            self.close()  # workers may be busy still: a later map starts fresh ones
            raise
        return iter([out[i] for i in range(count)])

    def _replace(self, hung: _Worker) -> _Worker:
        hung.stop()
        fresh = _Worker()
        self._workers[self._workers.index(hung)] = fresh
        return fresh

    def close(self) -> None:
        if self._workers:
            self._finalizer()
            self._workers = []


def _stop_workers(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.stop()
