"""The run driver, written once for every runtime, and the run directory it fills.

``drive`` runs the rounds of a ``Rounds`` to the end and calls each ``Hook`` after every
round: the metrics file, the checkpoint policy, the progress line and the experiment
trackers (``engine.trackers``) are hooks, and so is any side work a caller adds.
``run_rounds`` is what both runtimes call: the driver, then the summary and the files a
finished run leaves.

The run directory holds config.json, metrics.csv, failures.csv, checkpoint.safetensors
(tensors in safetensors, everything else in its JSON metadata) and, once the run is
done, summary.json. A checkpoint is refused unless it belongs to the run's
configuration, compared by ``comparable``: the settings that change what a run computes.

One process writes a run directory at a time: ``run_dir_lock`` holds an exclusive lock
(``flock``) on its lock file for the life of the run, taken before anything is written,
and a new run creates its config.json exclusively before its set-up (``claim_new_run``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from edgepfl import __version__
from edgepfl.algorithms import ALGORITHMS
from edgepfl.config import Config, build_config
from edgepfl.contract.algorithm import Reporter
from edgepfl.engine.hooks import Hook
from edgepfl.engine.ledger import METRIC_COLUMNS, Ledger, metric_columns
from edgepfl.engine.progress import RoundProgress
from edgepfl.engine.trackers import tracker_hooks
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.io import read_tensors, write_csv, write_json, write_tensors
from edgepfl.plugins import load_plugins, not_trusted

try:
    import fcntl
except ImportError:  # not POSIX: config.json's exclusive creation is the only guard
    fcntl = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from edgepfl.engine.rounds import Rounds

CHECKPOINT = "checkpoint.safetensors"
# held (flock) by the one process writing the directory; removed when it lets go
LOCK = ".edgepfl.lock"


# -- one writer per run directory ---------------------------------------------------------
class _Held:
    def __init__(self, fd: int, path: Path, created: bool):
        self.fd, self.path, self.created, self.depth = fd, path, created, 1


_held: dict[str, _Held] = {}  # the directories this process holds, by real path


def _acquire(out: Path, what: str) -> _Held:
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EdgepflError(f"cannot create the {what} directory {out}: {exc}") from None
    path = out / LOCK
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as exc:
            raise EdgepflError(f"cannot lock the {what} directory {out}: {exc}") from None
        if fcntl is None:
            return _Held(fd, path, created)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise EdgepflError(
                f"{out} is in use: another process holds its lock ({path}) and is writing "
                f"a {what} there; nothing was changed. Wait for that process to end (then "
                f"--resume {out} goes on with it), or choose another --out") from None
        except OSError as exc:
            os.close(fd)
            raise EdgepflError(f"cannot lock the {what} directory {out}: {exc}") from None
        # the process that held it may have removed the file before we locked it: then
        # ours is a lock on a file nobody else sees; take the one in the directory
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                return _Held(fd, path, created)
        except FileNotFoundError:
            pass
        os.close(fd)


def _release(held: _Held) -> None:
    try:
        held.path.unlink(missing_ok=True)  # while still held: see _acquire
    finally:
        os.close(held.fd)
    if held.created:  # a directory made for a run that wrote nothing goes again
        try:
            held.path.parent.rmdir()
        except OSError:
            pass


@contextmanager
def run_dir_lock(out: Path, what: str = "run") -> Iterator[None]:
    """Hold the directory ``out`` (made if missing) for this process until the block ends:
    another process that asks is refused at once, naming the directory, and changes
    nothing. Re-entrant within a process (``start_run`` holds it over set-up, the run
    driver over the rounds). A directory this call made is removed again if it is left
    empty."""
    key = os.path.realpath(out)
    held = _held.get(key)
    if held is not None:
        held.depth += 1
    else:
        held = _held[key] = _acquire(Path(out), what)
    try:
        yield
    finally:
        held.depth -= 1
        if held.depth == 0:
            del _held[key]
            _release(held)


def claim_new_run(out: Path, config: dict) -> None:
    """Create ``out``/config.json exclusively (the caller holds ``run_dir_lock``): a
    directory that holds a run already is refused, unchanged."""
    from edgepfl.io import write_json_exclusive

    if not write_json_exclusive(out / "config.json", config):
        raise EdgepflError(f"{out} already holds a run; use --resume {out} to continue it "
                           "or choose another --out")


# -- side work after each round -----------------------------------------------------------
class MetricsFile(Hook):
    """metrics.csv rewritten whole after each round (so that a run cut off mid-write
    leaves the previous one), and failures.csv once a client has failed."""

    def __init__(self, out: Path, columns: list[str] = METRIC_COLUMNS):
        self.out, self.columns = out, columns

    def after_round(self, rounds: Rounds, row: dict) -> None:
        metrics = rounds.metrics
        write_csv(self.out / "metrics.csv", metric_columns(metrics, self.columns), metrics)
        if rounds.ledger.failure_log:
            write_csv(self.out / "failures.csv", ["round", "step", "client", "reason"],
                      rounds.ledger.failure_log)


class CheckpointPolicy:
    """When to write a checkpoint (``output.checkpoint_every``): every k rounds, or under
    ``auto`` once the rounds since the last one took ``RATIO`` times as long as writing it,
    so that checkpoints cost at most about 1 / RATIO of a run whatever the state's size."""

    RATIO = 10.0

    def __init__(self, every: int | str):
        self.every = every
        self.cost = 0.0  # seconds the last checkpoint took to write
        self.since = time.perf_counter()

    def due(self, rnd: int, last: int) -> bool:
        if self.every == "never":
            return False
        if rnd == last:
            return True
        if self.every == "auto":
            return time.perf_counter() - self.since >= self.RATIO * self.cost
        return rnd % int(self.every) == 0

    @contextmanager
    def writing(self) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.since = time.perf_counter()
        self.cost = self.since - start


class Checkpoints(Hook):
    """A checkpoint whenever ``output.checkpoint_every`` says one is due, and after the
    last round. ``clients`` adds the state the runtime keeps of its clients (the
    simulation's; Flower's clients keep their own)."""

    def __init__(self, out: Path, cfg: Config,
                 clients: Callable[[], dict[str, torch.Tensor]] | None = None):
        self.out, self.cfg, self.clients = out, cfg, clients
        self.policy = CheckpointPolicy(cfg.output.checkpoint_every)

    def after_round(self, rounds: Rounds, row: dict) -> None:
        if self.policy.due(rounds.round, rounds.last_round):
            with self.policy.writing():
                save_checkpoint(self.out, self.cfg, rounds,
                                self.clients() if self.clients is not None else None,
                                runtime="simulation" if self.clients is not None else "flower")


class ProgressLine(Hook):
    """The live line on a terminal (``engine.progress``)."""

    def __init__(self, rounds: Rounds, label: str, enabled: bool | None):
        self.bar = RoundProgress(rounds.cfg.train.rounds, rounds.round, label, enabled)

    def after_round(self, rounds: Rounds, row: dict) -> None:
        self.bar.update(rounds.round, row, rounds.round_note)

    def after_run(self, rounds: Rounds) -> None:
        self.bar.stopped(rounds.stopped)

    def close(self) -> None:
        self.bar.close()


# -- the driver ---------------------------------------------------------------------------
def drive(rounds: Rounds, hooks: Sequence[Hook]) -> None:
    """Run ``rounds`` to its last round (or its early stop), every hook after each round."""
    failed: list[Exception] = []
    try:
        while not rounds.done:
            row = rounds.step()
            for hook in hooks:
                hook.after_round(rounds, row)
        for hook in hooks:
            hook.after_run(rounds)
    finally:
        # every hook is closed (the progress line, a tracker's writer) even if one fails
        for hook in hooks:
            try:
                hook.close()
            except Exception as exc:
                failed.append(exc)
        rounds.transport.close()
    if failed:  # reached only when the rounds ended well: their error goes first
        raise failed[0]


def run_rounds(rounds: Rounds, out: Path | None, *, label: str, progress: bool | None,
               columns: list[str] = METRIC_COLUMNS,
               clients: Callable[[], dict[str, torch.Tensor]] | None = None,
               extra: Callable[[], dict[str, Any]] = dict,
               hooks: Sequence[Hook] = ()) -> dict:
    """What a runtime does with its ``Rounds``: drive it with the run directory's hooks
    (``out``: none without one) and ``hooks`` after them, then write the finished run's
    files. The experiment trackers of ``output.trackers`` are hooks too, set up before
    the first round. Returns the summary, with ``extra()`` taken once the rounds are
    done. The run directory is held (``run_dir_lock``) until the run ends."""
    if out is None:
        return _run_rounds(rounds, out, label, progress, columns, clients, extra, hooks)
    with run_dir_lock(out):
        return _run_rounds(rounds, out, label, progress, columns, clients, extra, hooks)


def _run_rounds(rounds: Rounds, out: Path | None, label: str, progress: bool | None,
                columns: list[str], clients: Callable[[], dict[str, torch.Tensor]] | None,
                extra: Callable[[], dict[str, Any]], hooks: Sequence[Hook]) -> dict:
    own: list[Hook] = []
    if out is not None:
        own += [MetricsFile(out, columns), Checkpoints(out, rounds.cfg, clients)]
    trackers = tracker_hooks(rounds.cfg, out)
    every = [*own, *hooks, *trackers]
    drive(rounds, [*every, ProgressLine(rounds, label, progress)])
    try:
        rounds.check_trained()  # a run that aggregated nothing has no result to report
        summary = rounds.summary(**extra())
        if out is not None:
            finish_run_dir(out, rounds.cfg, summary, rounds.reporters, rounds.metrics)
    except BaseException:
        # the trackers wait for after_summary() to end their runs: they would stay open
        for tracker in trackers:
            tracker.end(ok=False)
        raise
    failures = []
    for hook in every:
        # a failing hook (a tracker's server gone) must not keep the others from ending
        try:
            hook.after_summary(summary, out)
        except Exception as exc:
            failures.append(exc)
    if failures:
        raise failures[0]
    return summary


# -- the run directory --------------------------------------------------------------------
def default_run_dir(cfg: Config, base: Path = Path("runs")) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = base / f"{cfg.algorithm.name}-{cfg.dataset.name}-{stamp}"
    k = 1
    while path.exists():
        k += 1
        path = base / f"{cfg.algorithm.name}-{cfg.dataset.name}-{stamp}-{k}"
    return path


def finish_run_dir(out: Path, cfg: Config, summary: dict, reporters: Sequence[Reporter],
                   metrics: list[dict]) -> None:
    """What a finished run writes: its summary, the algorithm's artifacts, the plot."""
    write_json(out / "summary.json", summary)
    for reporter in reporters:
        reporter.write_artifacts(out, cfg.output.plots)
    if cfg.output.plots:
        from edgepfl.plotting import plot_accuracy
        plot_accuracy(metrics, out / "accuracy.png", f"{cfg.algorithm.name} on {cfg.dataset.name}")


RUNTIMES = ("simulation", "flower")


def save_checkpoint(out: Path, cfg: Config, rounds: Rounds,
                    clients: Mapping[str, torch.Tensor] | None = None,
                    runtime: str = "simulation") -> None:
    """The server's and edges' state, the ledger, and ``clients`` (tensors named
    ``client/...``) in ``out``/checkpoint.safetensors, replaced whole. ``runtime`` says
    where the clients' state is: in the checkpoint (the simulation) or on the nodes
    (Flower), so that neither resumes the other's run."""
    tensors, meta = rounds.save_state()
    tensors.update(clients or {})
    meta.update(config=cfg.model_dump(), edgepfl_version=__version__, runtime=runtime)
    write_tensors(out / CHECKPOINT, tensors, meta)


def load_checkpoint(path: Path, rounds: Rounds, runtime: str = "simulation",
                    client_state: bool = False) -> dict[str, torch.Tensor]:
    """Put ``rounds`` where the checkpoint at ``path`` left its run, and return the
    checkpoint's tensors (the runtime takes its clients' state from them). A checkpoint
    that is malformed, belongs to another configuration or was written by the other
    ``runtime`` is refused before a thing is changed. ``client_state``: the algorithm's
    clients keep state, so that a checkpoint from before runtimes were named can be told
    apart (the simulation's holds the clients' state, Flower's none)."""
    tensors, meta = read_tensors(path)
    written = meta.get("runtime") if isinstance(meta, dict) else runtime  # else: refused below
    if written is None:  # checkpoints from before 2026-11-28 say none
        held = any(k.startswith("client/") for k in tensors)
        written = "simulation" if held else "flower" if client_state else runtime
    if written != runtime:
        where = {"simulation": "in the checkpoint", "flower": "on the Flower nodes"}
        raise EdgepflError(
            f"{path} is a {written} run's checkpoint (its clients' state is "
            f"{where.get(written, '?')}); the {runtime} runtime cannot go on from it: resume "
            + ("it with flwr run ... --run-config 'resume=true'" if written == "flower"
               else "it with edgepfl run --resume") + ", or start a new run")
    fed, cfg = rounds.federation, rounds.cfg
    ledger = Ledger.from_meta(meta, fed.num_clients, fed.edges,
                              rounds.ledger.server_state_bytes, path)
    config = meta.get("config")
    if not isinstance(config, dict):
        raise EdgepflError(f"{path} is not a valid edgepfl checkpoint: its metadata is "
                           f"malformed (config is {type(config).__name__}, not an object)")
    # train.rounds may have grown (an extended run): nothing in a round depends on it
    diff = config_diff(comparable(_with_run_path(config, cfg)), comparable(cfg.model_dump()))
    if diff:
        raise EdgepflError(f"{path} belongs to a different configuration than this "
                           "run's:\n  " + "\n  ".join(diff))
    if ledger.round > cfg.train.rounds:
        raise EdgepflError(f"{path} is at round {ledger.round}, past train.rounds={cfg.train.rounds}")
    t, stored = cfg.train, config.get("train", {})
    # a horizon of its own (train.lr_decay_rounds) does not move with train.rounds
    if t.lr_decay != "none" and t.lr_decay_rounds is None \
            and stored.get("rounds", t.rounds) != t.rounds:
        raise ConfigError(f"{path} was run with train.rounds = {stored.get('rounds')} and "
                          f"train.lr_decay = {t.lr_decay!r}, whose rates are spread over "
                          f"those rounds; with train.rounds = {t.rounds} its rounds so far "
                          "would have trained at other rates, so it cannot be extended: "
                          "start a new run (one with train.lr_decay_rounds set can be)")
    rounds.load(ledger, tensors, meta.get("state", {}))
    return tensors


# -- which runs are the same run ----------------------------------------------------------
def absolute_data_path(cfg: Config) -> Config:
    """``cfg`` with ``dataset.path`` absolute: a relative one is read from the working
    directory, and a run's config.json names the files wherever it is resumed from."""
    path = cfg.dataset.path
    if path is None:
        return cfg
    absolute = str(Path(path).expanduser().absolute())
    if absolute == path:
        return cfg
    return cfg.model_copy(update={"dataset": cfg.dataset.model_copy(update={"path": absolute})})


def _with_run_path(config: dict, cfg: Config) -> dict:
    """A checkpoint's configuration with the run's ``dataset.path`` where the checkpoint's
    is relative (a run from before config.json held absolute paths), which a resume from
    another folder has replaced (``data_path_as_run``); partition.json checks the data."""
    data = config.get("dataset")
    was = data.get("path") if isinstance(data, dict) else None
    if (not isinstance(data, dict) or not isinstance(was, str)
            or Path(was).expanduser().is_absolute()):
        return config
    return {**config, "dataset": {**data, "path": cfg.dataset.path}}


def data_path_as_run(stored: dict, given: str | None) -> str | None:
    """The ``dataset.path`` a resume given ``given`` (absolute) goes on with, where it
    names the run's files: the run's own where both name the same files; ``given`` where
    the run's is relative (from before config.json held absolute paths, read from the
    working directory) and finds nothing from here, so that the clients' sample and class
    counts (partition.json, ``Simulation.load_checkpoint``) are the check. None: a change."""
    data = stored.get("dataset")
    was = data.get("path") if isinstance(data, dict) else None
    if not isinstance(was, str) or given is None:
        return None
    here = Path(was).expanduser()
    if str(here.absolute()) == given or (here.exists() and Path(given).exists()
                                         and os.path.samefile(here, given)):
        return was
    return given if not here.is_absolute() and not here.exists() else None


def config_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Every dotted key whose value differs between two configurations, as
    ``key: run has A, given B``."""
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: run has {va!r}, given {vb!r}")
    return out


# how a run executes, not what it computes: a run may be resumed with other values
EXECUTION = (
    "rounds", "device", "threads", "workers", "batch_clients", "store", "store_dir", "compile")
# where a run is reported, not what it computes: trackers may be added or dropped
TRACKING = ("trackers", "mlflow_uri", "experiment")


def without_rounds(cfg: dict) -> dict:
    """``cfg`` without the train settings of ``EXECUTION`` (the run's length and where it
    runs) and the output settings of ``TRACKING`` (the experiment trackers), which a
    resumed or extended run may change."""
    # where a plug-in is loaded from is not what it computes: its names are compared
    out = {**{k: v for k, v in cfg.items() if k != "plugins"},
           "train": {k: v for k, v in cfg.get("train", {}).items() if k not in EXECUTION}}
    if isinstance(cfg.get("output"), dict):
        out["output"] = {k: v for k, v in cfg["output"].items() if k not in TRACKING}
    return out


def execution_changes(stored: dict, new: dict) -> list[str]:
    """The settings of how a run executes (``EXECUTION``, ``TRACKING``) whose values differ
    between two configurations, as dotted keys."""
    def value(cfg: dict, section: str, key: str) -> Any:
        part = cfg.get(section)
        return part.get(key) if isinstance(part, dict) else None

    keys = [("train", k) for k in EXECUTION] + [("output", k) for k in TRACKING]
    changed = [f"{s}.{k}" for s, k in keys if value(stored, s, k) != value(new, s, k)]
    return changed + (["plugins"] if stored.get("plugins", []) != new.get("plugins", []) else [])


def with_before(cfg: dict) -> dict:
    """A stored configuration with ``Hyperparameters.before`` filled in for the algorithm
    settings it lacks: what a run written before those settings existed did, so that it
    resumes doing that (``cfg["algorithm"]`` then holds at least those keys).

    It loads no plug-in: a stored configuration is data (a checkpoint's metadata, a
    config.json read back), and data must not name code to run. An algorithm of a
    plug-in is known here only if the command loaded that plug-in itself
    (``load_run_plugins`` when resuming its own run)."""
    stored = cfg.get("algorithm")
    stored = stored if isinstance(stored, dict) else {}
    algo = ALGORITHMS.get(stored.get("name"))  # type: ignore[arg-type]
    before = algo.hyperparameters.before if algo is not None else {}
    missing = {k: v for k, v in before.items() if k not in stored}
    return {**cfg, "algorithm": {**stored, **missing}} if missing else cfg


def load_run_plugins(stored: dict, where: Path | str = "the run", *,
                     trusted: Iterable[str] = (), trust: bool = False) -> None:
    """Load the plug-ins a run's own config.json names, to resume that run. A run directory
    may come from someone else, and its config.json is then code to run: a plug-in not
    loaded in this process already and not among ``trusted`` (given with --plugin) is
    refused, naming them all and importing none, unless ``trust`` (--trust-plugins).
    Never called on a checkpoint's metadata."""
    plugins = stored.get("plugins")
    plugins = [str(p) for p in plugins] if isinstance(plugins, list) else []
    unknown = [] if trust else not_trusted(plugins, trusted)
    if unknown:
        raise ConfigError(
            f"{where} names plug-ins that resuming would import, running their code: "
            + ", ".join(repr(p) for p in unknown)
            + "\nnothing was imported. If you trust them (read them first: a run directory "
            "from someone else can hold any code), resume with --trust-plugins (edgepfl run), "
            "or give each with --plugin")
    load_plugins(plugins)


def comparable(cfg: dict) -> dict:
    """A stored configuration with the defaults of settings added since it was written
    (a run from before ``topology`` existed was a star; a run of ``kapc`` from before
    ``algorithm.allow_plain_norm`` existed did not lift the refusal; where such a run did
    what is no longer the default, ``Hyperparameters.before`` says what it did: an
    ``hmpl`` run from before ``algorithm.first_round`` trained round 1's sample), without
    the settings ``without_rounds`` drops (``train.rounds``, the trackers)."""
    try:
        built = build_config(with_before(cfg))
    except ConfigError:
        return without_rounds(cfg)
    full = built.model_dump()
    # the algorithm's own settings are free keys in the configuration; its
    # hyperparameter model has their defaults
    algo = ALGORITHMS.get(built.algorithm.name)
    if algo is not None:
        try:
            hp = algo.parse_hyperparameters(built.algorithm.hyperparameters())
        except ConfigError:
            pass
        else:
            full["algorithm"] = {"name": built.algorithm.name, **hp.model_dump()}
    return without_rounds(full)
