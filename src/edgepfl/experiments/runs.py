"""Many runs into one folder, one after another or several at once, resumable.

``compare`` and ``sweep`` both plan a list of runs (a directory name and a validated
configuration each) and hand it here. Every run goes into ``<out>/<name>``: a run whose
directory already holds a config.json is resumed (a finished one is read back, an
interrupted one goes on from its checkpoint, a changed configuration is refused), any other
is started. So the same command again, after Ctrl-C or a failure, redoes only what is not
done.

With ``jobs`` above 1 the runs go to worker processes started by spawn (a fork would copy
torch's thread pools and locks in whatever state the parent's threads left them), each
with ``threads`` torch threads. A run computes the same in a worker as in this process:
everything it draws follows from its seed.

A run that fails is reported with its name and the others go on; the failures are raised
together, as one ``RunsFailed``, once every other run has finished.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgepfl.config import Config, build_config
from edgepfl.errors import EdgepflError


@dataclass(frozen=True)
class PlannedRun:
    name: str  # the run directory inside the output folder
    config: Config  # resolved, seed included


@dataclass
class Finished:
    summary: dict
    curve: list[tuple[int, float]]  # (round, mean accuracy) at every evaluated round


class RunsFailed(EdgepflError):
    """Some runs failed; ``finished`` holds the others (all of them ran to their end)."""

    def __init__(self, failures: dict[str, str], finished: dict[str, Finished], total: int):
        self.failures, self.finished = failures, finished
        lines = [f"{name}: {text}".replace("\n", "\n    ") for name, text in failures.items()]
        super().__init__(
            f"{len(failures)} of {total} runs failed (the others finished; the same command "
            "again keeps the finished runs and retries these):\n  " + "\n  ".join(lines))


def cpu_count() -> int:
    """Cores this process may run on (a batch job's share, not the whole machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


def threads_per_job(jobs: int, threads: int | None) -> int:
    """Torch threads in each of ``jobs`` workers: the user's ``--threads``, else the cores
    shared out, so that the workers together do not oversubscribe the machine."""
    return threads if threads is not None else max(1, cpu_count() // jobs)


def check_jobs(jobs: int) -> None:
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise EdgepflError(f"--jobs {jobs!r} must be a whole number of runs at once, at least 1 "
                           f"(this machine has {cpu_count()} cores)")


def run_all(runs: list[PlannedRun], out: Path, *, jobs: int = 1, threads: int | None = None,
            progress: bool | None = None,
            on_finished: Callable[[PlannedRun, Finished], None] | None = None,
            echo: Callable[[str], None] = print) -> dict[str, Finished]:
    """Every planned run into ``out/<name>``, ``jobs`` at a time; {name: Finished} in plan
    order. ``on_finished`` sees each run as it ends; a failure is echoed at once with the
    run's name and raised at the end (``RunsFailed``). With ``jobs`` above 1 the runs
    show no per-round progress (lines of several runs at once would interleave)."""
    check_jobs(jobs)
    names = [r.name for r in runs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise EdgepflError(f"two planned runs share the directory name {repeated[0]!r}")
    finished: dict[str, Finished] = {}
    failures: dict[str, str] = {}

    def record(run: PlannedRun, outcome: Finished | str) -> None:
        if isinstance(outcome, Finished):
            finished[run.name] = outcome
            if on_finished is not None:
                on_finished(run, outcome)
        else:
            failures[run.name] = outcome
            echo(f"{run.name}: failed: {outcome.splitlines()[0] if outcome else ''}")

    jobs = min(jobs, len(runs)) if runs else 1
    if jobs == 1:
        for run in runs:
            record(run, _attempt(str(out / run.name), run.config.model_dump(), progress))
    else:
        from edgepfl.engine.trackers import prepare_mlflow_stores

        prepare_mlflow_stores((run.config, out / run.name) for run in runs)
        _run_in_workers(runs, out, jobs, threads_per_job(jobs, threads), record, echo)
    if failures:
        raise RunsFailed({n: failures[n] for n in names if n in failures},
                         {n: finished[n] for n in names if n in finished}, len(runs))
    return {n: finished[n] for n in names}


def _run_in_workers(runs: list[PlannedRun], out: Path, jobs: int, threads: int,
                    record: Callable[[PlannedRun, Finished | str], None],
                    echo: Callable[[str], None]) -> None:
    echo(f"{len(runs)} runs, {jobs} at a time ({threads} torch thread"
         f"{'s' if threads > 1 else ''} each)")
    log = logging.getLogger("edgepfl")
    # the command line's log set-up, again in each worker (a spawned process starts bare)
    level = (logging.getLevelName(log.level).lower()
             if any(getattr(h, "_edgepfl", False) for h in log.handlers) else None)
    pool = cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn"),
                                  initializer=_start_worker,
                                  initargs=(threads, level, os.getpid()))
    waiting = iter(runs)
    running: dict[cf.Future, PlannedRun] = {}
    broken = ""

    def start_next() -> None:
        # one run per free worker, never more: a run handed to the pool cannot be taken
        # back, and after Ctrl-C it would still run to its end
        for run in waiting:
            if broken:
                record(run, f"not started: {broken}")
                continue
            running[pool.submit(_attempt, str(out / run.name), run.config.model_dump(),
                                False)] = run
            return

    try:
        for _ in range(jobs):
            start_next()
        while running:
            done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for future in done:
                run = running.pop(future)
                try:
                    outcome = future.result()
                except cf.process.BrokenProcessPool:
                    broken = ("a worker process died (killed, or out of memory); its run "
                              "directory keeps its last checkpoint")
                    outcome = broken
                except Exception as exc:  # e.g. a result that could not be sent back
                    outcome = f"{type(exc).__name__}: {exc}"
                record(run, outcome)
                start_next()
    except BaseException:
        # Ctrl-C reaches the workers too: each leaves its run at its last checkpoint
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def exit_with_parent(parent: int) -> None:
    """End this process when ``parent`` ends, however it ends (SIGKILL too): on Linux the
    kernel sends it SIGTERM then (``PR_SET_PDEATHSIG``); elsewhere a thread watches
    for the parent's going. A worker whose parent is gone would otherwise finish its
    run and then wait forever for the next one, holding its memory."""
    import signal
    import sys
    import threading
    import time

    if sys.platform.startswith("linux"):
        import ctypes

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(1, signal.SIGTERM, 0, 0, 0) == 0:  # 1: PR_SET_PDEATHSIG
                if os.getppid() != parent:  # it went before the call took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="edgepfl-parent-watch", daemon=True).start()


def _start_worker(threads: int, log_level: str | None, parent: int | None = None) -> None:
    if parent is not None:
        exit_with_parent(parent)
    import torch

    torch.set_num_threads(threads)
    if log_level is not None:
        from edgepfl.engine.progress import configure_logging

        configure_logging(log_level)


# the data set and its partition of the last runs in this process: the runs of one seed
# share them, and a worker keeps them for the next run it gets
_federation: dict = {}


def federation_of(cfg: Config) -> dict:
    """The data set and partition a run of ``cfg`` trains on, as ``Simulation`` keyword
    arguments; kept for the next call with the same data settings and seed, so that the
    runs of a comparison or a search load and split the data once."""
    from edgepfl.data import dataset_of, partition_of

    d, p = cfg.dataset, cfg.partition
    # every dataset setting: runs on other files (dataset.path) must not share a data set
    data_key = (repr(sorted(d.model_dump().items())), cfg.seed)
    if _federation.get("key") != data_key:
        _federation.clear()
        _federation.update(key=data_key, partitions={}, dataset=dataset_of(d, cfg.seed))
    dataset, partitions = _federation["dataset"], _federation["partitions"]
    # a hierarchical split draws a class mix per edge: topology.edges is part of it
    part_key = (tuple(sorted(p.model_dump().items())), cfg.topology.edges)
    if part_key not in partitions:
        partitions[part_key] = partition_of(p, dataset, cfg.seed, cfg.topology.edges)
    return {"dataset": dataset, "partition": partitions[part_key]}


def _attempt(run_dir: str, config: dict, progress: bool | None) -> Finished | str:
    """One run, started or resumed: its ``Finished``, or why it failed as text (an
    unforeseen error with its traceback). Ctrl-C is not a failure: it goes up."""
    from edgepfl.engine.simulation import resume_run, start_run

    path = Path(run_dir)
    try:
        cfg = build_config(config)
        data = federation_of(cfg)
        # the progress lines say which of the planned runs they are (seed, grid point)
        label = f"{path.name}: {cfg.algorithm.name} on {cfg.dataset.name}"
        if (path / "config.json").exists():
            # the command's own plug-ins (--plugin, its configuration's): no others
            result = resume_run(path, cfg, progress=progress, label=label,
                                plugins=cfg.plugins, **data)
        else:
            result = start_run(cfg, path, progress=progress, label=label, **data)
    except (EdgepflError, OSError) as exc:
        return str(exc)
    except Exception as exc:  # a bug, not bad input: keep where it happened
        return f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exc())
    curve = [(int(r["round"]), float(r["acc_mean"])) for r in result.metrics
             if r.get("acc_mean") is not None and r["acc_mean"] == r["acc_mean"]]
    return Finished(dict(result.summary), curve)
