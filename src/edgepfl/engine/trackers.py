"""Experiment trackers: a run reported to TensorBoard, MLflow or Weights & Biases.

``output.trackers`` names them. Each is a ``Hook`` of the run driver: at set-up it
opens one tracker run per edgepfl run (the resolved configuration as its parameters;
the algorithm, data set and seed as tags), after every round it logs the metrics rows
not logged yet (each at its round, NaN left out), and once the run is finished it logs
the summary's figures and the run directory's files (summary.json, config.json, the
plots). Trackers only report: a run computes the same with or without them, so a run
may be resumed with trackers added or dropped (``rundir.without_rounds``).

A resumed run goes on in the same tracker run. What that takes is kept in the run
directory's trackers.json: the MLflow run id and tracking URI, the W&B run id, and for
each tracker the last round it logged, so that no round is logged twice and rows from
rounds it missed (the tracker added on resume) are logged first.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import numbers
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from edgepfl.config import Config
from edgepfl.engine.hooks import Hook
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.io import read_json, write_json

if TYPE_CHECKING:
    from edgepfl.engine.rounds import Rounds

log = logging.getLogger("edgepfl")

STATE = "trackers.json"
# the run directory's files a finished run hands to its trackers, plots besides
FILES = ("summary.json", "config.json")


# -- what is logged -----------------------------------------------------------------------
def flatten(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested configuration as dotted keys (``train.lr``); lists stay values."""
    out: dict[str, Any] = {}
    for key, value in cfg.items():
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def as_text(value: Any) -> str:
    """A parameter's value as text: strings as they are, the rest as in config.json."""
    return value if isinstance(value, str) else json.dumps(value)


def figures(values: Mapping[str, Any]) -> dict[str, float]:
    """The numbers among ``values`` (a metrics row, a summary), NaN (a round not
    evaluated) and nested values left out."""
    return {k: float(v) for k, v in values.items()
            if isinstance(v, numbers.Real) and not isinstance(v, bool) and not math.isnan(v)}


def row_figures(row: Mapping[str, Any]) -> dict[str, float]:
    return {k: v for k, v in figures(row).items() if k != "round"}


def tags(cfg: Config) -> dict[str, str]:
    return {"algorithm": cfg.algorithm.name, "dataset": cfg.dataset.name, "seed": str(cfg.seed)}


def run_files(out: Path) -> list[Path]:
    """The finished run's files for the trackers: summary.json, config.json, the plots."""
    return [p for p in (out / f for f in FILES) if p.is_file()] + sorted(out.glob("*.png"))


def chunks(items: Sequence, size: int) -> Iterator[Sequence]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


# -- trackers.json ------------------------------------------------------------------------
def read_state(out: Path) -> dict[str, dict]:
    path = out / STATE
    if not path.exists():
        return {}
    state = read_json(path)
    if not isinstance(state, dict) or not all(isinstance(v, dict) for v in state.values()):
        raise EdgepflError(f"{path} is not what edgepfl writes there (an object per tracker); "
                           "delete it to have the trackers start new runs")
    return state


def write_state(out: Path, name: str, entry: dict) -> None:
    state = read_state(out)
    state[name] = entry
    write_json(out / STATE, state)


# -- the trackers -------------------------------------------------------------------------
class Tracker(Hook):
    """One tracker run for one edgepfl run. A subclass opens or resumes its tracker run in
    ``__init__`` and implements ``log_rows``, ``log_end`` and ``stop``; this class decides
    what is logged when, and keeps ``state`` (saved in trackers.json) up to date."""

    name: ClassVar[str]
    module: ClassVar[str]  # what must import for the tracker to work
    extra: ClassVar[str]  # the edgepfl extra that installs it

    @classmethod
    def check(cls) -> None:
        """Refuse at set-up, before any round, a tracker whose package is missing."""
        try:
            importlib.import_module(cls.module)
        except ImportError as exc:
            raise ConfigError(f"output.trackers has {cls.name!r}, which needs the {cls.module} "
                              f"package ({exc}); install it with "
                              f"pip install 'edgepfl[{cls.extra}]'") from None

    def __init__(self, cfg: Config, out: Path):
        self.cfg, self.out = cfg, out
        self.state: dict[str, Any] = read_state(out).get(self.name, {})
        self.done = False  # the last round is done: after_summary() ends the tracker run
        self.ended = False
        self.broken = False  # it failed mid-run: the run goes on without it

    @property
    def logged(self) -> int:
        """The last round whose row this tracker run has."""
        return int(self.state.get("logged", 0))

    def save(self) -> None:
        write_state(self.out, self.name, self.state)

    # -- what the driver calls ------------------------------------------------------------
    def after_round(self, rounds: Rounds, row: dict) -> None:
        self._guarded(rounds, lambda: self.catch_up(rounds.metrics))

    def after_run(self, rounds: Rounds) -> None:
        self._guarded(rounds, lambda: self.catch_up(rounds.metrics))  # a resumed run with no round left
        self.done = True

    def _guarded(self, rounds: Rounds, log_it: Callable[[], None]) -> None:
        """A tracker reports a run, it does not stop it: a tracker that fails (its server
        gone) is left for the rest of the run; the rounds it lacks are logged when the
        run is resumed (``logged`` stays at the last round it stored)."""
        if self.broken:
            return
        try:
            log_it()
        except Exception as exc:
            self.broken = True
            log.warning("output.trackers: %s failed after round %d (%s: %s); the run goes on "
                        "without it, and edgepfl run --resume logs the rounds it missed",
                        self.name, rounds.round, type(exc).__name__, exc)

    def close(self) -> None:
        if not self.done and not self.broken:
            self.end(ok=False)

    def after_summary(self, summary: dict, out: Path | None) -> None:
        if self.broken:
            return
        ok = False
        try:
            self.log_end(int(summary["rounds"]), figures(summary), run_files(self.out))
            ok = True
        finally:
            self.end(ok)

    def catch_up(self, metrics: list[dict]) -> None:
        """Log the rows past the last logged round: the round's own, and before it any the
        tracker run lacks (the tracker was added on resume). A round that a resumed run
        computes again (the process died after logging it, before its checkpoint) is
        logged once, by the process that first ran it."""
        rows = [(int(r["round"]), row_figures(r)) for r in metrics if int(r["round"]) > self.logged]
        if rows:
            self.log_rows(rows)
            # only once the rows are written out: a crash in between logs them again rather
            # than not at all
            self.state["logged"] = rows[-1][0]
            self.save()

    def end(self, ok: bool) -> None:
        """End the tracker run (once), as finished or as failed."""
        if not self.ended:
            self.ended = True
            self.stop(ok)

    # -- what a tracker implements --------------------------------------------------------
    def log_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Log each (round, figures) and make sure it is stored before returning."""
        raise NotImplementedError

    def log_end(self, step: int, summary: dict[str, float], files: list[Path]) -> None:
        raise NotImplementedError

    def stop(self, ok: bool) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    """Event files in ``<run dir>/tensorboard``: each metric a scalar by round, the
    configuration in the HParams dashboard, the tags as text, the summary's figures as
    ``summary/...`` scalars at the last round, the plots as images."""

    name = module = extra = "tensorboard"

    def __init__(self, cfg: Config, out: Path):
        super().__init__(cfg, out)
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.hparams = hparams
        self.params = {k: v if isinstance(v, str | int | float | bool) else as_text(v)
                       for k, v in flatten(cfg.model_dump()).items()}
        fresh = not self.state
        # events written past the last round saved as logged (a process cut off between
        # the two) are hidden: the resumed run logs those rounds again
        self.writer = SummaryWriter(str(out / "tensorboard"),
                                    purge_step=self.logged + 1 if self.logged else None)
        _, session_start, _ = hparams(self.params, {})
        self.writer.file_writer.add_summary(session_start, self.logged)
        if fresh:
            self.writer.add_text("tags", "  \n".join(f"{k}: {v}" for k, v in tags(cfg).items()))
        self.writer.flush()
        self.state.setdefault("logged", 0)
        self.save()  # a run cut off before its first round still has its tags text

    def log_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_end(self, step: int, summary: dict[str, float], files: list[Path]) -> None:
        from matplotlib.image import imread

        for key, value in summary.items():
            self.writer.add_scalar(f"summary/{key}", value, step)
        for path in files:
            if path.suffix == ".png":
                self.writer.add_image(f"plots/{path.stem}", imread(path), step,
                                      dataformats="HWC")
        experiment, _, session_end = self.hparams(
            self.params, {f"summary/{key}": value for key, value in summary.items()})
        self.writer.file_writer.add_summary(experiment, step)
        self.writer.file_writer.add_summary(session_end, step)

    def stop(self, ok: bool) -> None:
        self.writer.close()


def default_mlflow_uri(out: Path) -> str:
    """An SQLite tracking store beside the run directories, shared by the runs there."""
    return "sqlite:///" + (out.resolve().parent / "mlflow.db").as_posix()


def prepare_mlflow_stores(runs: Iterable[tuple[Config, Path]]) -> None:
    """Open, once, each SQLite MLflow store that runs in worker processes will share:
    opening a new store creates its schema, and processes doing that at the same moment
    collide in MLflow's migrations (duplicate columns, a migration that finds no row).
    A tracking server migrates itself; a store that cannot be opened is left for each run
    to report."""
    uris = {cfg.output.mlflow_uri or default_mlflow_uri(out)
            for cfg, out in runs if "mlflow" in cfg.output.trackers}
    for uri in sorted(u for u in uris if u.startswith("sqlite:///")):
        try:
            from mlflow.tracking import MlflowClient

            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception as exc:  # the runs say what is wrong, each with its own error
            log.debug("MLflow store %s not prepared: %s", uri, exc)


def mlflow_artifacts(uri: str) -> str | None:
    """Where an experiment created in an SQLite store keeps its artifacts: beside the
    database (MLflow's own default is the current directory, wherever the run started);
    elsewhere what the tracking server says."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    return (Path(uri[len(prefix):]).resolve().parent / "mlartifacts").as_uri()


class MLflowTracker(Tracker):
    """An MLflow run in the experiment ``output.experiment`` of ``output.mlflow_uri``: the
    configuration as parameters, each metric by round, the summary's figures as
    ``summary/...`` metrics at the last round, the run directory's files as artifacts
    (the plots under plots/). A setting changed on resume (a raised ``train.rounds``)
    cannot change the parameter, which MLflow keeps as first logged: it is the tag
    ``resumed.<setting>``."""

    name = module = extra = "mlflow"

    def __init__(self, cfg: Config, out: Path):
        super().__init__(cfg, out)
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.MlflowException = MlflowException
        uri = cfg.output.mlflow_uri or default_mlflow_uri(out)
        if uri.startswith(("http://", "https://")):
            # MLflow's own defaults (7 retries, 120 s each) keep a run silent for minutes
            # when the server is down; the user's environment still decides if it is set
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
            log.info("connecting to the MLflow server at %s", uri)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            self._open(cfg, out, uri)
        except ImportError as exc:  # mlflow-skinny without SQLAlchemy, say
            raise ConfigError(f"MLflow cannot open the tracking store {uri}: {exc}; install "
                              "MLflow whole with pip install 'edgepfl[mlflow]'") from None
        except MlflowException as exc:
            raise ConfigError(f"MLflow cannot open the tracking store {uri} "
                              f"(output.mlflow_uri): {exc.message.strip()}") from None
        log.info("MLflow run %s in %s", self.run_id, uri)

    def _open(self, cfg: Config, out: Path, uri: str) -> None:
        params = {k: as_text(v) for k, v in flatten(cfg.model_dump()).items()}
        run_id = self.state.get("run_id") if self.state.get("tracking_uri") == uri else None
        if run_id is not None and not self._exists(run_id):
            log.warning("MLflow run %s of %s is no longer in %s: a new run gets all its rounds",
                        run_id, out, uri)
            run_id = None
        if run_id is None:
            experiment = self._experiment(cfg.output.experiment, uri)
            run_id = self.client.create_run(experiment, run_name=out.name,
                                            tags=tags(cfg)).info.run_id
            self.state = {"tracking_uri": uri, "run_id": run_id}
            self.save()
            self.run_id = run_id
            self._batch(params=params)
        else:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            had = self.client.get_run(run_id).data.params
            self._batch(params={k: v for k, v in params.items() if k not in had},
                        tags={f"resumed.{k}": v for k, v in params.items()
                              if k in had and had[k] != v})

    def _exists(self, run_id: str) -> bool:
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except self.MlflowException:
            return False

    def _experiment(self, name: str, uri: str) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is None:
            try:
                return self.client.create_experiment(name, artifact_location=mlflow_artifacts(uri))
            except self.MlflowException:
                # another run made it meanwhile (runs of a grid share the store)
                found = self.client.get_experiment_by_name(name)
                if found is None:
                    raise
        if found.lifecycle_stage != "active":
            raise ConfigError(f"the MLflow experiment {name!r} in {uri} is deleted: restore it "
                              f"(mlflow experiments restore --experiment-id "
                              f"{found.experiment_id}) or set another output.experiment")
        return found.experiment_id

    def _batch(self, metrics: Sequence = (), params: Mapping[str, str] | None = None,
               tags: Mapping[str, str] | None = None) -> None:
        from mlflow.entities import Param, RunTag

        # MLflow takes at most 1000 metrics, 100 parameters and 100 tags a batch
        for part in chunks(list(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=part)
        for part in chunks([Param(k, v) for k, v in (params or {}).items()], 100):
            self.client.log_batch(self.run_id, params=part)
        for part in chunks([RunTag(k, v) for k, v in (tags or {}).items()], 100):
            self.client.log_batch(self.run_id, tags=part)

    def _metrics(self, step: int, values: dict[str, float]) -> list:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        return [Metric(k, v, now, step) for k, v in values.items()]

    def log_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        self._batch([m for step, values in rows for m in self._metrics(step, values)])

    def log_end(self, step: int, summary: dict[str, float], files: list[Path]) -> None:
        self._batch(self._metrics(step, {f"summary/{k}": v for k, v in summary.items()}))
        for path in files:
            self.client.log_artifact(self.run_id, str(path),
                                     "plots" if path.suffix == ".png" else None)

    def stop(self, ok: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


class WandbTracker(Tracker):
    """A W&B run in the project ``output.experiment``, its files in ``<run dir>/wandb``:
    offline (``wandb sync`` uploads it later) unless WANDB_MODE says otherwise. The
    configuration as its config, each metric by round (the W&B step is the round), the
    summary's figures as ``summary/...`` in its summary, the run directory's files as an
    artifact."""

    name = module = extra = "wandb"

    def __init__(self, cfg: Config, out: Path):
        super().__init__(cfg, out)
        import wandb

        self.wandb = wandb
        run_id = self.state.get("id")
        if not isinstance(run_id, str):
            run_id = uuid.uuid4().hex[:12]
            self.state = {"id": run_id}
        try:
            self.run = wandb.init(
                project=cfg.output.experiment, dir=str(out), id=run_id, resume="allow",
                name=out.name, config=flatten(cfg.model_dump()), allow_val_change=True,
                tags=[f"{k}={v}" if k == "seed" else v for k, v in tags(cfg).items()],
                mode=None if os.environ.get("WANDB_MODE") else "offline",
                # edgepfl's own output (the progress line) stays on the terminal as it is
                settings=wandb.Settings(console="off"))
        except wandb.errors.Error as exc:  # online without a login, say
            raise ConfigError(f"W&B cannot start the run's W&B run: {exc}") from None
        self.save()

    def log_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        for step, values in rows:
            self.run.log(values, step=step)

    def log_end(self, step: int, summary: dict[str, float], files: list[Path]) -> None:
        self.run.summary.update({f"summary/{k}": v for k, v in summary.items()})
        if files:
            artifact = self.wandb.Artifact(f"run-{self.run.id}-files", type="run-files")
            for path in files:
                artifact.add_file(str(path), f"plots/{path.name}" if path.suffix == ".png"
                                  else path.name)
            self.run.log_artifact(artifact)

    def stop(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)


TRACKERS: dict[str, type[Tracker]] = {
    t.name: t for t in (TensorBoardTracker, MLflowTracker, WandbTracker)}


def check_trackers(cfg: Config, out: Path | None) -> None:
    """Refuse the trackers of ``output.trackers`` that cannot work (a missing package, no
    run directory) before anything of a run is written."""
    names = cfg.output.trackers
    if names and out is None:
        raise ConfigError(f"output.trackers = {names!r} needs a run directory (to write the "
                          "trackers' files to, and to resume their runs from); give the run "
                          "one, or set output.trackers = []")
    for name in names:
        TRACKERS[name].check()


def tracker_hooks(cfg: Config, out: Path | None) -> list[Tracker]:
    """The hooks of ``output.trackers``, their tracker runs opened (or resumed); a missing
    package is refused before any is opened."""
    names = cfg.output.trackers
    if not names:
        return []
    check_trackers(cfg, out)
    assert out is not None
    made: list[Tracker] = []
    try:
        for name in names:
            made.append(TRACKERS[name](cfg, out))
    except BaseException:
        for tracker in made:
            tracker.end(ok=False)
        raise
    return made
