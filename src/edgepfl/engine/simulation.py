"""The in-process simulation: the round protocol (``engine.rounds``) over an in-process
transport, driven by the run driver (``engine.rundir``), with the set-up files only a
simulated run writes, and starting and resuming runs.

The transport delivers each message as a private copy, runs the client part on that
client's row of the stacked state, counts the FLOPs of its work and copies the reply back;
the round loop, the byte counts and the figures are the ones every runtime shares.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np
import torch

from edgepfl.config import Config, build_config
from edgepfl.contract.algorithm import states_fit
from edgepfl.data.datasets import Dataset
from edgepfl.data.partition import Partition
from edgepfl.engine.client_step import (
    as_client,
    client_split,
    client_step,
    client_views,
    evaluate_client,
    evaluate_new_client,
)
from edgepfl.engine.ledger import METRIC_COLUMNS, accuracy_row, accuracy_summary, metric_columns
from edgepfl.engine.parts import (
    Parts,
    image_crops,
    load_federation,
    natural_clients,
    resolve,
)
from edgepfl.engine.progress import setting_up
from edgepfl.engine.rounds import Rounds
from edgepfl.engine.rundir import (
    CHECKPOINT,
    Hook,
    absolute_data_path,
    claim_new_run,
    comparable,
    config_diff,
    data_path_as_run,
    default_run_dir,
    execution_changes,
    load_checkpoint,
    load_run_plugins,
    run_dir_lock,
    run_rounds,
    save_checkpoint,
    with_before,
)
from edgepfl.engine.threads import ThreadGovernor, step_flops
from edgepfl.engine.transport import ClientFailure, ClientReply, Figures, Transport
from edgepfl.engine.workers import TimedPool, WorkerPool, worker_count
from edgepfl.errors import ConfigError, DataError, EdgepflError
from edgepfl.federation.messages import Message
from edgepfl.federation.store import StackedStore, sendable
from edgepfl.io import read_json, write_json
from edgepfl.system import FlopMeter, SystemModel, peak_rss_bytes, work_signature
from edgepfl.training.client_data import ClientData, TestData, sample_count

log = logging.getLogger("edgepfl")

__all__ = ["CHECKPOINT", "METRIC_COLUMNS", "InProcess", "Parts", "RunResult", "Simulation",
           "accuracy_row", "accuracy_summary", "client_split", "load_federation",
           "metric_columns", "resolve", "resume_run", "start_run"]


@dataclass
class RunResult:
    summary: dict
    metrics: list[dict]
    out_dir: Path | None
    client_accuracy: list[float] = field(default_factory=list)


class InProcess(Transport):
    """Clients as calls in this process: one client part per architecture, every client's
    state a row of one stacked store, each message delivered as a private copy."""

    counts_flops = True
    serves_new_clients = True

    def __init__(self, parts: Parts, train_data: list[ClientData],
                 test_data: list[TestData], flops: FlopMeter,
                 val_data: list[TestData | None] | None = None):
        fed = parts.federation
        self.cfg = parts.cfg
        self.seed = parts.cfg.seed
        self.arch = fed.arch
        self.parts = parts.clients()
        self.trainers = parts.trainers
        self.train_data, self.test_data = train_data, test_data
        # what privacy.level = sample forecasts a round's spending from
        self.train_sizes = [d.n for d in train_data]
        self.val_data = val_data or [None] * len(train_data)
        self.flops = flops
        # DP-SGD's work is not a function of shapes (each step's batch is Poisson-sampled,
        # of a random size): every update is counted, its repeated batch shapes once
        # (counted_once), never an earlier round's count reused, which a resumed run's
        # empty meter would not have
        self.recount = parts.cfg.privacy.level == "sample"
        self.store = StackedStore(fed.num_clients, parts.stacks)
        # what a held-out client starts from (eval.new_clients): its architecture's model
        self.init_models = {name: a.init_model for name, a in parts.architectures.items()}
        self._work_shapes: dict[int, tuple] = {}
        train = parts.cfg.train
        self.batch_clients = train.batch_clients
        if self.batch_clients and train.workers not in (1, "auto"):
            raise ConfigError(
                f"train.batch_clients = true trains a step's clients together in this process, "
                f"train.workers = {train.workers} in worker processes: choose one "
                f"(train.workers = 1, or train.batch_clients = false)")
        workers = 1 if self.batch_clients else worker_count(train.workers, parts.trainer.device)
        self.timeout = _client_timeout(parts.cfg, workers)
        pool = WorkerPool if self.timeout is None else TimedPool
        self.pool = pool(workers, self._worker_task) if workers > 1 else None
        for cid in range(fed.num_clients):
            arch = parts.architectures[fed.arch[cid]]
            state = self.parts[arch.name].init_state(cid, arch.init_model)
            if cid == 0:  # before the first row allocates every stack for all clients
                row = sum(t.numel() * t.element_size() for t in state.values())
                self.store.stacks.refuse_beyond_memory(
                    row * fed.num_clients,
                    f"the clients' state ({fed.num_clients} clients x {row / 1e6:.2f} MB)")
            self.store.set_row(cid, state)

    def train(self, step: object,
              messages: dict[int, Message]) -> dict[int, ClientReply | ClientFailure]:
        keys: dict[int, tuple] = {}
        # with a time limit even one client trains in a worker, where it can be stopped
        parallel = self.pool is not None and (len(messages) > 1 or self.timeout is not None)

        def tasks() -> Iterator[tuple]:
            # local training cost depends on shapes, not values: counted once per
            # architecture, data shape and message/state signature, not once per client.
            # Only the first client of a key in a step is counted; the others take its
            # count, which is kept before theirs is asked for, as replies come in task
            # order. So with worker processes or batched clients too (all tasks are made
            # before the first reply) a round's clients alike in work are counted once,
            # and the rest train uncounted: in workers, or batched.
            counting: set[tuple] = set()
            for cid, down in messages.items():
                msg, state = down.delivered(), self.store.row(cid)
                key = keys[cid] = ("client", self.arch[cid], self._work_shape(cid),
                                   work_signature(msg, state))
                count = self.flops.enabled and (self.recount or (
                    self.flops.cached(key) is None and key not in counting))
                if count and self.flops.cache and not self.recount:
                    counting.add(key)
                yield "train", step, cid, msg, sendable(state) if parallel else state, count

        replies: dict[int, ClientReply | ClientFailure] = {}
        # in parallel every task is made before a reply is stored: the pool draws tasks in
        # a thread of its own, and a reply that adds entries to the store (an HMPL client
        # growing IP layers) must not change it under a task being read from it
        pool = self.pool if parallel else None
        done: Iterable[tuple]
        if isinstance(pool, TimedPool):  # the pool of a run with a time limit
            done = pool.map(list(tasks()), self.timeout, self._timed_out)
        elif pool is not None:
            done = pool.map(list(tasks()))
        elif self.batch_clients:
            done = self._train_batched(list(tasks()))
        else:
            done = map(self._worker_task, tasks())
        for cid, new_state, reply, stats, flops in done:
            if isinstance(reply, ClientFailure):  # its update raised: a failed client
                replies[cid] = reply
                continue
            counted = (self.flops.record(keys[cid], flops) if flops is not None
                       else self.flops.reuse(keys[cid]))
            self.store.set_row(cid, new_state)
            replies[cid] = ClientReply(reply.delivered(), self.train_data[cid].n, stats,
                                       counted or 0)
        return replies

    def _timed_out(self, task: tuple) -> tuple:
        """The result of a client step that ran past ``faults.client_timeout``."""
        log.warning("client %d's step ran past faults.client_timeout = %g s: it fails this "
                    "round and its worker process is replaced", task[2], self.timeout)
        return task[2], None, ClientFailure(
            f"its step ran past faults.client_timeout = {self.timeout:g} s"), None, None

    def _worker_task(self, task: tuple):
        """One client's step, or with ``("eval", task)`` its evaluation, in this process or
        a worker's (``engine.workers``)."""
        if task[0] == "eval":
            return self._evaluate_task(task[1])
        _, step, cid, msg, state, count = task
        part = self.parts[self.arch[cid]]
        try:
            with FlopMeter(enabled=count, cache=False).measure() as counted:
                result = client_step(self.cfg, part, step, cid, msg, state, self.train_data[cid])
        except _SETTINGS:  # a setting or the data is wrong: every client would fail alike
            raise
        except Exception as exc:  # the client fails, not the run; its state stays as it was
            return cid, None, _raised(exc), None, None
        return cid, result.state, result.reply, result.stats, counted.flops

    def _train_batched(self, tasks: list[tuple]) -> list[tuple]:
        """``_worker_task`` of every task, the fits of clients that state them
        (``Client.fit_request``) batched per skeleton (``Trainer.fit_many``). A client
        whose FLOPs are to be counted (the first of its kind in the step) trains alone
        under the meter, so that counts stay those of one client's training."""
        out: dict[int, tuple] = {}
        waiting: dict[tuple[str, int], list[tuple]] = {}
        for task in tasks:
            _, step, cid, msg, state, count = task
            request = None
            part = self.parts[self.arch[cid]]
            if not count and states_fit(part):
                try:
                    with as_client(self.cfg, part, step, cid) as gen:
                        request = part.fit_request(cid, msg, state, self.train_data[cid], gen)
                except _SETTINGS:
                    raise
                except Exception as exc:
                    out[cid] = (cid, None, _raised(exc), None, None)
                    continue
            if request is None:
                out[cid] = self._worker_task(task)
            else:
                # one group per skeleton: a part may train models of several shapes
                trainer = request.trainer or part.trainer
                waiting.setdefault((self.arch[cid], id(trainer)), []).append(
                    (cid, msg, state, request, trainer))
        for (arch, _), jobs in waiting.items():
            part, trainer = self.parts[arch], jobs[0][-1]
            trained = trainer.fit_many([job[3] for job in jobs])
            for (cid, msg, state, *_), (weights, stats) in zip(jobs, trained, strict=True):
                try:
                    result = part.finish(cid, msg, state, self.train_data[cid], weights, stats)
                except _SETTINGS:
                    raise
                except Exception as exc:
                    out[cid] = (cid, None, _raised(exc), None, None)
                    continue
                out[cid] = (cid, result.state, result.reply, result.stats, None)
        return [out[task[2]] for task in tasks]

    def close(self) -> None:
        """Stop the worker processes (a transport is usable again afterwards)."""
        if self.pool is not None:
            self.pool.close()

    def _work_shape(self, cid: int) -> tuple:
        if cid not in self._work_shapes:
            self._work_shapes[cid] = self.train_data[cid].work_shape()
        return self._work_shapes[cid]

    def evaluate(self, rnd: int, messages: dict[int, Message | None]) -> dict[int, Figures]:
        for trainer in self.trainers.values():
            trainer.forget()
        out = {cid: Figures(0, 0, math.nan) for cid in messages
               if sample_count(self.test_data[cid]) == 0}
        tasks = [(cid, self.store.row(cid), msg) for cid, msg in messages.items() if cid not in out]
        if self.pool is None or len(tasks) < 2:
            out.update(self._evaluate_task(task) for task in tasks)
        else:
            out.update(self.pool.map(
                ("eval", (cid, sendable(state), msg and Message(sendable(msg.tensors), msg.meta)))
                for cid, state, msg in tasks))
        return {cid: out[cid] for cid in messages}

    def evaluate_new(self, rnd: int, messages: dict[int, Message | None]) -> dict[int, Figures]:
        """Each held-out client served in this process from a fresh initial state (its
        row of the store, never written, is not read)."""
        out = {}
        for cid, msg in messages.items():
            test = self.test_data[cid]
            if sample_count(test) == 0:
                out[cid] = Figures(0, 0, math.nan)
                continue
            arch = self.arch[cid]
            part, trainer = self.parts[arch], self.trainers[arch]
            state = part.init_state(cid, self.init_models[arch])
            out[cid] = evaluate_new_client(self.cfg, part, trainer, rnd, cid, state,
                                           msg and msg.delivered(), self.train_data[cid], test)
        return out

    def _evaluate_task(self, task: tuple) -> tuple[int, Figures]:
        cid, state, eval_msg = task
        arch = self.arch[cid]
        return cid, evaluate_client(self.parts[arch], self.trainers[arch], cid, state, eval_msg,
                                    self.train_data[cid], self.test_data[cid], self.val_data[cid])


def _warn_of_silent_figures(dataset: Dataset, partition: Partition, test_sizes: np.ndarray,
                            fraction: float = 1.0) -> None:
    """Say at set-up what the accuracy figures would leave unsaid: test samples no client
    holds, clients without test samples (left out of every mean; none at all is refused)
    and a data set of one class (every prediction right)."""
    _warn_of_unheld_tests(dataset, partition)
    empty = [int(c) for c in np.flatnonzero(test_sizes == 0)]
    shrunk = (f"; dataset.fraction = {fraction:g} kept none of their test samples"
              if fraction < 1 else "")
    if empty and len(empty) == len(test_sizes):
        raise DataError(f"no client has a test sample ({len(dataset.y_test)} in the data set"
                        f"{shrunk}), so no accuracy could be reported: give test samples of "
                        "the classes the clients train on, or a larger dataset.fraction")
    if empty:
        names = [dataset.clients[c] if c < len(dataset.clients) else str(c) for c in empty]
        log.warning("%d of %d clients have no test samples (clients %s%s%s): they are left out "
                    "of every accuracy figure, whose means are over the other clients",
                    len(empty), len(test_sizes), ", ".join(names[:8]),
                    ", ..." if len(empty) > 8 else "", shrunk)
    classes = torch.unique(torch.as_tensor(dataset.y_train)).numel()
    if classes < 2:
        log.warning("the training data holds %d class: every prediction is right, so its "
                    "accuracy (100%%) says nothing of the model", classes)


def _warn_of_unheld_tests(dataset: Dataset, partition: Partition) -> None:
    """Test samples the partition gave no client (those of a class without training
    samples: no client's share of it) are scored nowhere: say how many, and of which
    classes."""
    y_test = torch.as_tensor(dataset.y_test)
    unheld = torch.ones(y_test.numel(), dtype=torch.bool)
    for idx in partition.test:
        unheld[idx] = False
    if not bool(unheld.any()):
        return
    counts = np.bincount(y_test[unheld].numpy(), minlength=partition.num_classes)
    trained = np.bincount(torch.as_tensor(dataset.y_train).numpy(),
                          minlength=partition.num_classes)
    listed = [f"{dataset.classes[c] if c < len(dataset.classes) else c} ({int(counts[c])}"
              f"{', never in training' if trained[c] == 0 else ''})"
              for c in np.flatnonzero(counts)]
    log.warning("%d of %d test samples are in no client's test data and are scored nowhere "
                "(by class: %s%s): a client is given test samples of the classes it trains on",
                int(unheld.sum()), y_test.numel(), ", ".join(listed[:8]),
                ", ..." if len(listed) > 8 else "")


def _client_timeout(cfg: Config, workers: int) -> float | None:
    """``faults.client_timeout``, refused where clients train in this process: a step
    there cannot be stopped without leaving the process in an unknown state."""
    timeout = cfg.faults.client_timeout
    if timeout is not None and workers < 2:
        how = ("train.batch_clients = true trains them" if cfg.train.batch_clients else
               "train.workers = auto (1 on this machine) trains them"
               if cfg.train.workers == "auto" else "train.workers = 1 trains them")
        raise ConfigError(
            f"faults.client_timeout = {timeout:g} stops a client's step that runs too long "
            f"by replacing the worker process it runs in, and needs train.workers > 1: {how} "
            "in this process, where a step cannot be stopped safely; set train.workers = 2 "
            "or more (train.batch_clients = false), or faults.client_timeout = none")
    return timeout


# what a client step may raise that stops the run: the user's to fix, not the client's
_SETTINGS = (ConfigError, DataError)


def _raised(exc: Exception) -> ClientFailure:
    """A client whose update raised ``exc``: a failed client, the exception its reason."""
    log.debug("a client's update raised", exc_info=exc)
    return ClientFailure(f"its update raised {type(exc).__name__}: {exc}")


class Simulation:
    """One run of one algorithm on one federation. ``run()`` executes the rounds."""

    def __init__(self, cfg: Config, out_dir: str | Path | None = None, *,
                 progress: bool | None = None, dataset: Dataset | None = None,
                 partition: Partition | None = None):
        cfg, dataset = natural_clients(cfg, dataset)  # a natural split's data, loaded once
        self.cfg = cfg = resolve(cfg)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress = progress
        self.dataset, self.partition = load_federation(cfg, dataset, partition)
        n = self.num_clients = self.partition.num_clients

        self.parts = parts = Parts.build(cfg, self.dataset, n, self.out_dir)
        self.algorithm, self.federation = parts.algorithm, parts.federation
        self.layers, self.trainer = parts.layers, parts.trainer
        views = [client_views(self.dataset, self.partition, cid, cfg) for cid in range(n)]
        self.train_data = [v.train for v in views]
        self.test_data = [v.test for v in views]
        self.val_data = [v.val for v in views]
        self.test_sizes = np.array([sample_count(test) for test in self.test_data])
        _warn_of_silent_figures(self.dataset, self.partition, self.test_sizes,
                                cfg.dataset.fraction)
        self.system = SystemModel.build(cfg.system, n, cfg.seed, epochs=cfg.train.local_epochs)
        self.flops = FlopMeter(enabled=cfg.system.count_flops, cache=cfg.system.cache_flops)
        self.transport = InProcess(parts, self.train_data, self.test_data, self.flops,
                                   self.val_data)
        self.rounds = Rounds(parts, self.transport, self.system, self.flops)
        self.server, self.edges = self.rounds.server, self.rounds.edges
        self.client = self.transport.parts[parts.first.name]
        self.clients = self.transport.store
        self.threads = ThreadGovernor(cfg.train.threads, self._step_flops)

    def _step_flops(self) -> float | None:
        """The largest architecture's training step, for ``train.threads = auto``."""
        sample = torch.zeros(self.dataset.input_shape)
        counts = [step_flops(t.model, sample, self.cfg.train.batch_size)
                  for t in self.parts.trainers.values()]
        known = [c for c in counts if c is not None]
        return None if len(known) < len(counts) else max(known, default=None)

    # the run's progress lives in the round protocol
    @property
    def round(self) -> int:
        return self.rounds.round

    @property
    def metrics(self) -> list[dict]:
        return self.rounds.metrics

    @property
    def client_acc(self) -> list[float]:
        return self.rounds.client_acc

    @property
    def bytes_up(self) -> np.ndarray:
        return self.rounds.ledger.bytes_up

    @property
    def bytes_down(self) -> np.ndarray:
        return self.rounds.ledger.bytes_down

    def step(self) -> dict:
        return self.rounds.step()

    def evaluate(self) -> dict:
        return self.rounds.evaluate(self.round)

    # -- whole run ---------------------------------------------------------------------
    def run(self, hooks: Sequence[Hook] = (), label: str | None = None) -> RunResult:
        """Every round left, into the run directory if there is one; ``hooks`` are called
        after each round (``engine.hooks.Hook``). ``label`` names the run on its progress
        lines (a comparison's runs: which seed or grid point)."""
        if self.out_dir is None:
            return self._run(hooks, label)
        with run_dir_lock(self.out_dir):  # held already when start_run or resume_run ran
            return self._run(hooks, label)

    def _run(self, hooks: Sequence[Hook], label: str | None) -> RunResult:
        cfg = self.cfg
        if self.out_dir is not None and self.round == 0:
            self._write_setup()
        summary = run_rounds(self.rounds, self.out_dir,
                             label=label or f"{cfg.algorithm.name} on {cfg.dataset.name}",
                             progress=self.progress, hooks=[*hooks, self.threads],
                             clients=lambda: self.clients.state_dict("client/"),
                             extra=self._summary_extra)
        return RunResult(summary, self.metrics, self.out_dir, list(self.client_acc))

    def metric_columns(self) -> list[str]:
        return metric_columns(self.metrics)

    def summary(self) -> dict:
        return self.rounds.summary(**self._summary_extra())

    def _summary_extra(self) -> dict:
        """What only the simulation knows: its clients' state and its process's memory."""
        return {"client_state_bytes": self.clients.nbytes(), "peak_rss_bytes": peak_rss_bytes()}

    # -- files ---------------------------------------------------------------------------
    def _write_setup(self) -> None:
        out = self.out_dir
        assert out is not None
        write_json(out / "config.json", self.cfg.model_dump())
        part = self.partition.to_json(self.dataset.y_train, self.dataset.y_test)
        part["layers"] = self.layers.to_json()
        if self.cfg.partition.scheme == "natural" and self.dataset.clients:
            # client i is the data's i-th client name (sorted): a report can say whose it is
            for row, name in zip(part["clients"], self.dataset.clients, strict=True):
                row["name"] = name
        if self.cfg.eval.validation:
            part["validation"] = self.cfg.eval.validation
            for row, val in zip(part["clients"], self.val_data, strict=True):
                assert val is not None  # eval.validation holds samples out of every client
                row["val_samples"] = sample_count(val)
        crops = image_crops(self.cfg, self.dataset)
        if crops is not None:
            part["aspect"] = {"mode": self.cfg.dataset.aspect_mode, **crops.describe()}
            for row, train, test in zip(part["clients"], self.train_data, self.test_data,
                                        strict=True):
                row["train_ratio_counts"] = crops.counts(train.boxes)
                row["test_ratio_counts"] = crops.counts(cast(ClientData, test).boxes)  # a crop
        if len(self.parts.architectures) > 1:
            part["architectures"] = {name: a.layers.to_json()
                                     for name, a in self.parts.architectures.items()}
        write_json(out / "partition.json", part)
        write_json(out / "federation.json", self.federation.to_json())
        write_json(out / "system.json", self.system.describe())
        if self.cfg.output.plots:
            from edgepfl.plotting import plot_partition
            counts, _ = self.partition.class_counts(self.dataset.y_train, self.dataset.y_test)
            named = self.cfg.partition.scheme == "natural" and self.dataset.clients
            fed = self.federation
            plot_partition(counts, out / "partition.png", self.dataset.classes,
                           edges=list(fed.parent) if fed.hierarchical else None,
                           names=self.dataset.clients if named else None)

    def save_checkpoint(self) -> None:
        assert self.out_dir is not None
        save_checkpoint(self.out_dir, self.cfg, self.rounds, self.clients.state_dict("client/"))

    def load_state(self, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
        """Clients', edges' and server's state from a checkpoint (no config check: the
        caller vouches that they belong to this configuration)."""
        self.clients.load_state_dict(tensors, "client/")
        self.rounds.load_parts(tensors, (meta or {}).get("state", {}))

    def load_checkpoint(self, path: Path) -> None:
        self._check_same_data(Path(path).parent / "partition.json")
        tensors = load_checkpoint(path, self.rounds,
                                  client_state=bool(self.clients.state_dict("client/")))
        self.clients.load_state_dict(tensors, "client/")

    def _check_same_data(self, stored_path: Path) -> None:
        """A resumed run must read the data it started on: the clients' sample and class
        counts of its partition.json against this run's (a data file replaced in place,
        or a relative dataset.path resolved in another folder, changes them)."""
        if not stored_path.exists():
            return
        stored = read_json(stored_path)
        now = self.partition.to_json(self.dataset.y_train, self.dataset.y_test)
        rows = stored.get("clients") if isinstance(stored, dict) else None
        if not isinstance(rows, list):
            return  # not a partition.json edgepfl wrote; the checkpoint's checks still apply
        diffs = []
        if stored.get("num_classes") != now["num_classes"] or len(rows) != len(now["clients"]):
            diffs.append(f"{stored.get('num_classes')} classes and {len(rows)} clients, now "
                         f"{now['num_classes']} and {len(now['clients'])}")
        else:
            for cid, (was, is_) in enumerate(zip(rows, now["clients"], strict=True)):
                for key in ("train_size", "test_size", "train_class_counts", "test_class_counts"):
                    if isinstance(was, dict) and key in was and was[key] != is_.get(key):
                        diffs.append(f"client {cid}'s {key}: run has {was[key]}, now {is_.get(key)}")
        if diffs:
            raise EdgepflError(
                f"{stored_path.parent} was run on other data than {self.cfg.dataset.name} "
                f"(dataset.path = {self.cfg.dataset.path!r}) gives now:\n  "
                + "\n  ".join(diffs[:3]) + ("\n  ..." if len(diffs) > 3 else "")
                + "\nresume it on the data it started on (a relative dataset.path is read "
                "from the working directory), or start a new run")


def start_run(cfg: Config, out_dir: str | Path | None = None, progress: bool | None = None,
              label: str | None = None, hooks: Sequence[Hook] = (), **kwargs) -> RunResult:
    """Run a configuration into a fresh run directory (refuses to overwrite a run). The
    directory is held for this process from before its config.json is written to the
    end of the run (``rundir.run_dir_lock``); a run that cannot start (its data missing,
    a tracker's package not installed) leaves no trace of itself. ``hooks`` are called
    after every round as ``Simulation.run``'s."""
    from edgepfl.engine.trackers import check_trackers

    cfg, dataset = natural_clients(cfg, kwargs.pop("dataset", None))
    cfg = absolute_data_path(resolve(cfg))  # config.json names the files from anywhere
    out = Path(out_dir) if out_dir is not None else default_run_dir(cfg)
    check_trackers(cfg, out)
    with run_dir_lock(out):  # a run in progress there is refused as such, first
        claim_new_run(out, cfg.model_dump())
        try:
            with setting_up(f"{cfg.algorithm.name} on {cfg.dataset.name}", progress):
                sim = Simulation(cfg, out, progress=progress, dataset=dataset, **kwargs)
        except BaseException:
            # e.g. a data set that is not there: leave no run behind (the directory goes
            # with the lock if this call made it and nothing else is in it)
            (out / "config.json").unlink(missing_ok=True)
            raise
        return sim.run(hooks, label=label)


def resume_run(run_dir: str | Path, cfg: Config | None = None,
               progress: bool | None = None, overrides: list[str] | None = None,
               label: str | None = None, *, plugins: Sequence[str] = (),
               trust_plugins: bool = False, **kwargs) -> RunResult:
    """Continue ``run_dir`` from its last checkpoint.

    ``cfg`` (a whole configuration) or ``overrides`` (``key=value`` applied to the run's
    own configuration) must match the run, except that ``train.rounds`` may be raised: the
    run then goes on to the new last round, exactly as a run started with that many rounds
    would have (nothing in a round depends on the total), and its config.json says so.
    ``kwargs`` go to ``Simulation`` (an already loaded ``dataset`` / ``partition``).
    The plug-ins the run's config.json names are imported only if this process has them
    already, ``plugins`` (the caller's own, e.g. --plugin) names them, or ``trust_plugins``;
    else the resume is refused before anything is imported (``load_run_plugins``).
    """
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").exists():
        raise EdgepflError(f"{run_dir} holds no run to resume: it has no config.json (a run "
                           "directory is made by edgepfl run --out DIR)")
    with run_dir_lock(run_dir):  # another process running it is refused before any check
        return _resume_run(run_dir, cfg, progress, overrides, label, plugins=plugins,
                           trust_plugins=trust_plugins, **kwargs)


def _resume_run(run_dir: Path, cfg: Config | None, progress: bool | None,
                overrides: list[str] | None, label: str | None, *,
                plugins: Sequence[str] = (), trust_plugins: bool = False,
                **kwargs) -> RunResult:
    from edgepfl.engine.trackers import check_trackers

    if not (run_dir / "config.json").exists():
        raise EdgepflError(f"{run_dir} holds no run to resume: it has no config.json")
    stored = read_json(run_dir / "config.json")
    if not isinstance(stored, dict) or not isinstance(stored.get("train"), dict):
        raise ConfigError(f"{run_dir / 'config.json'} is not an edgepfl run configuration")
    # its algorithm, model or data set may be one; refused unless trusted
    load_run_plugins(stored, run_dir / "config.json", trusted=plugins, trust=trust_plugins)
    stored = with_before(stored)  # a run from before a setting existed goes on as it ran
    if cfg is None and overrides:
        cfg = build_config(stored, overrides)
    run_cfg = build_config(stored)
    if cfg is not None:
        given = absolute_data_path(resolve(cfg)).model_dump()
        path = data_path_as_run(stored, given["dataset"]["path"])
        if path is not None:  # the run's files: one path on both sides
            given["dataset"]["path"] = path
        compared = stored if path is None else {
            **stored, "dataset": {**stored["dataset"], "path": path}}
        diff = config_diff(comparable(compared), comparable(given))
        if diff:
            raise ConfigError(f"cannot resume {run_dir} with a different configuration:\n  "
                              + "\n  ".join(diff))
        rounds = given["train"]["rounds"]
        if rounds < stored["train"]["rounds"]:
            raise ConfigError(f"cannot resume {run_dir} with train.rounds={rounds}: the run has "
                              f"{stored['train']['rounds']}; a run can be extended, not shortened")
        if rounds > stored["train"]["rounds"] and not (run_dir / CHECKPOINT).exists():
            raise ConfigError(f"cannot extend {run_dir}: it has no checkpoint to go on from")
        # how the run goes on (its length, where it runs, its trackers) is the resuming
        # command's; what it computes has just been checked to be the run's
        run_cfg = build_config(given)
    check_trackers(run_cfg, run_dir)
    ckpt = run_dir / CHECKPOINT
    if not ckpt.exists() and (run_dir / "summary.json").exists():
        raise EdgepflError(f"{run_dir} holds a finished run without its checkpoint (kept "
                           "results); there is nothing to go on from")
    with setting_up(f"{run_cfg.algorithm.name} on {run_cfg.dataset.name}", progress):
        sim = Simulation(run_cfg, run_dir, progress=progress, **kwargs)
    if ckpt.exists():
        sim.load_checkpoint(ckpt)
    # only once the checkpoint has loaded: a refused resume leaves the run as it was
    if (execution_changes(stored, run_cfg.model_dump())
            or run_cfg.dataset.path != stored["dataset"].get("path")):
        write_json(run_dir / "config.json", run_cfg.model_dump())
    if run_cfg.train.rounds != stored["train"]["rounds"]:
        # the old summary goes, so that an interrupted extension does not look finished
        (run_dir / "summary.json").unlink(missing_ok=True)
    if sim.round:
        log.info("%s: resuming from round %d of %d", label or run_dir, sim.round,
                 run_cfg.train.rounds)
    return sim.run(label=label)
