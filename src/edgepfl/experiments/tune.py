"""Hyperparameter search on the validation split: ``edgepfl tune``.

One Optuna study per algorithm, kept in SQLite (``<study dir>/study.db``). Each trial is
a run of the base configuration at one point of the search space, in a run directory of
its own under the study's folder (``trial-0007``), scored by the best mean validation
accuracy over its rounds (``val_acc_mean_best``). The test split is never looked at: a
choice made on test accuracy is fitted to the test set, and the comparison on it
afterwards (``compare --tuned``) would then flatter whichever method was tuned hardest.

The search space (``experiments.search_space``) is the common one (``TRAIN_SPACE``, the
learning rate) with the algorithm's own (``Hyperparameters.search_space``), less the
settings ``--set`` fixes, with ``--space`` on top. What a study chose is read back for a
comparison by ``experiments.compare_tuned``.

Resuming and sharing. The study is the record: the same command again counts the trials
that are done (complete, pruned, or failed because of their configuration) and runs the
rest up to ``--trials``. Several processes (``--jobs``, or the command in several shells)
draw trials from the same study; each one draws under a file lock, counting the trials
others are running, so that together they run no more than asked. A trial cut off
(Ctrl-C, a killed process) is marked interrupted and not counted; its point is tried
once more, as the next trial (a point that is interrupted again is left, so that a point
which kills its process cannot stall the study).

Reproducibility. The sampler (TPE) of each trial is seeded from ``--seed`` and the
trial's number, so one process with the same seed draws the same points; a study
resumed after an interruption has an extra trial number (the retried point), so the
points drawn after it differ from a straight run's. With several processes the points
depend on which trials finished first, as in any parallel search.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import copy
import math
import multiprocessing as mp
import os
import socket
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from edgepfl.algorithms import get_algorithm
from edgepfl.config import Config, build_config, set_dotted
from edgepfl.contract.algorithm import IntRange, LogUniform, SearchRange, Uniform
from edgepfl.engine.rundir import Hook, config_diff, without_rounds
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.experiments.runs import check_jobs, threads_per_job
from edgepfl.experiments.search_space import (
    parse_space,
    parse_space_item,
    search_space,
    spec_text,
    value_text,
)
from edgepfl.io import write_bytes_atomic, write_csv, write_json
from edgepfl.plotting import partition_words

if TYPE_CHECKING:
    from edgepfl.engine.rounds import Rounds

OBJECTIVE = "val_acc_mean_best"
DB_NAME = "study.db"
BEST = "best.json"
STUDY_NAME = "edgepfl"
ATTRS = "edgepfl"
PRUNERS = ("median", "none")


def _optuna():
    try:
        import optuna
    except ImportError:
        raise EdgepflError("edgepfl tune needs Optuna: pip install 'edgepfl[tune]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


# -- where a study lives ------------------------------------------------------------------
def study_location(study: Path | None, algorithm: str) -> tuple[Path, Path]:
    """(the study's folder, its SQLite file) from ``--study``: a folder, or a ``.db``
    file whose folder holds the trials; default runs/tune-<algorithm>, so that the same
    command run again goes on with its study (another configuration is refused there)."""
    if study is None:
        folder = Path("runs") / f"tune-{algorithm}"
        return folder, folder / DB_NAME
    if study.suffix == ".db":
        return study.parent, study
    return study, study / DB_NAME


def _storage(db: Path):
    optuna = _optuna()
    # SQLite waits for a lock this long before an error: processes sharing a study write
    # one at a time
    return optuna.storages.RDBStorage(f"sqlite:///{db.resolve()}",
                                      engine_kwargs={"connect_args": {"timeout": 60}})


def _pruner(pruner: Any, rounds: int):
    optuna = _optuna()
    if pruner is None or pruner == "median":
        # a trial is stopped once its best validation accuracy so far is under the median of
        # the earlier trials' at the same round; not before 5 trials are done (no median to
        # judge by) nor in the first quarter of the rounds (early rounds rank methods badly)
        # (Optuna judges from step == n_warmup_steps, the rounds being 1-based steps)
        return optuna.pruners.MedianPruner(n_startup_trials=5, n_warmup_steps=rounds // 4 + 1)
    if pruner == "none":
        return optuna.pruners.NopPruner()
    if isinstance(pruner, str):
        raise ConfigError(f"pruner {pruner!r} is unknown; valid: {', '.join(PRUNERS)}")
    return pruner


def _open_study(db: Path, pruner: Any, rounds: int):
    """The study in ``db`` (made if new) and its storage."""
    optuna = _optuna()
    storage = _storage(db)
    study = optuna.create_study(storage=storage, study_name=STUDY_NAME, direction="maximize",
                                load_if_exists=True, pruner=_pruner(pruner, rounds))
    return study, storage


def _record(algorithm: str, base: dict, space: dict[str, SearchRange], seed: int) -> dict:
    return {"algorithm": algorithm, "config": base, "objective": OBJECTIVE, "seed": seed,
            "space": {k: spec_text(v) for k, v in space.items()}}


def _same_study(stored: dict, given: dict, db: Path) -> None:
    """A study resumes only with what it was started with: its trials would otherwise
    score points of different problems against each other."""
    diff = []
    for key in ("algorithm", "objective", "seed"):
        if stored.get(key) != given[key]:
            diff.append(f"{'sampler seed' if key == 'seed' else key}: study has "
                        f"{stored.get(key)!r}, given {given[key]!r}")
    if stored.get("space") != given["space"]:
        diff.append(f"search space: study has {_space_line(stored.get('space') or {})}, given "
                    f"{_space_line(given['space'])}")
    a, b = stored.get("config") or {}, given["config"]
    diff += [d.replace(": run has ", ": study has ")
             for d in config_diff(settings_of(a), settings_of(b))]
    if diff:
        raise ConfigError(f"{db} holds a study of another search:\n  " + "\n  ".join(diff)
                          + "\nrun the command it was started with, or choose another --study")


def settings_of(cfg: dict) -> dict:
    """What a configuration computes, its length included: without where it runs and
    where it is reported."""
    out = without_rounds(cfg)
    train = cfg.get("train")
    if not isinstance(train, dict):
        train = {}
    out["train"] = {**out.get("train", {}), "rounds": train.get("rounds")}
    return out


def _space_line(space: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in space.items()) or "(none)"


# -- trials -------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Held by one process at a time (where the system has fcntl; elsewhere processes
    sharing a study may together run a trial or two more than asked)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _counts(trial) -> bool:
    """Whether a trial counts towards ``--trials``: done, or being run by a process."""
    from optuna.trial import TrialState

    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING):
        return True
    # failed because of its point (a refused combination, a run that failed): drawing
    # again would fail again; an interrupted trial's point was never judged
    return trial.state == TrialState.FAIL and "error" in trial.user_attrs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _release_stale(study, storage) -> None:
    """Trials left running by a process of this machine that has ended (killed, out of
    memory) are marked interrupted, so that they stop counting."""
    from optuna.trial import TrialState

    host = socket.gethostname()
    study_id = storage.get_study_id_from_name(STUDY_NAME)
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        pid = t.user_attrs.get("pid")
        if t.user_attrs.get("host") != host or not isinstance(pid, int) or _alive(pid):
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, t.number)
        storage.set_trial_user_attr(trial_id, "interrupted",
                                    f"its process ({pid}) ended before the trial did")
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)


def _sampler(seed: int, number: int):
    import numpy as np

    optuna = _optuna()
    trial_seed = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    with warnings.catch_warnings():
        # constant_liar is experimental in some Optuna versions: it makes workers sharing
        # a study draw away from the points others are running
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(seed=trial_seed, constant_liar=True)


def _suggest(trial, key: str, rng: SearchRange) -> Any:
    if isinstance(rng, LogUniform):
        return trial.suggest_float(key, rng.low, rng.high, log=True)
    if isinstance(rng, Uniform):
        return trial.suggest_float(key, rng.low, rng.high)
    if isinstance(rng, IntRange):
        return trial.suggest_int(key, rng.low, rng.high)
    return trial.suggest_categorical(key, list(rng.options))


def _next_trial(study, storage, lock: Path, trials: int, seed: int,
                space: dict[str, SearchRange]) -> tuple[Any, dict[str, Any]] | None:
    """The next trial and its point, or None once ``trials`` count."""
    with _locked(lock):
        _release_stale(study, storage)
        every = study.get_trials(deepcopy=False)
        if sum(map(_counts, every)) >= trials:
            return None
        retried = {t.user_attrs.get("retry_of") for t in every}
        retry = next((t for t in every if "interrupted" in t.user_attrs
                      and "retry_of" not in t.user_attrs and t.number not in retried), None)
        if retry is not None:
            # its point was never judged: the next trial is that point again (a finished
            # trial cannot be marked, so the retry names the trial it repeats)
            study.enqueue_trial(retry.params, user_attrs={"retry_of": retry.number})
        # trial numbers follow the trials in the study, and only this lock's holder adds one
        study.sampler = _sampler(seed, len(every))
        trial = study.ask()
        trial.set_user_attr("host", socket.gethostname())
        trial.set_user_attr("pid", os.getpid())
        params = {key: _suggest(trial, key, rng) for key, rng in space.items()}
    return trial, params


class PruningHook(Hook):
    """Reports each evaluated round's best validation accuracy so far to the trial (the
    objective is the best over the rounds) and stops the run, by raising
    ``optuna.TrialPruned``, once the pruner finds the trial behind."""

    def __init__(self, trial):
        self.trial = trial
        self.best = -math.inf
        self.round = 0

    def after_round(self, rounds: Rounds, row: dict) -> None:
        self.round = rounds.round
        value = row.get("val_acc_mean")
        if value is None or math.isnan(value):
            return
        self.best = max(self.best, value)
        self.trial.report(self.best, rounds.round)
        if self.trial.should_prune():
            raise _optuna().TrialPruned(f"pruned after round {rounds.round}")


def _run_trial(study, trial, params: dict, base: dict, folder: Path,
               progress: bool | None, echo: Callable[[str], None]) -> None:
    optuna = _optuna()
    from optuna.trial import TrialState

    from edgepfl.engine.simulation import resolve, start_run
    from edgepfl.experiments.runs import federation_of

    name = f"trial-{trial.number:04d}"
    trial.set_user_attr("run_dir", name)
    point = ", ".join(f"{k}={value_text(v)}" for k, v in params.items())
    hook = PruningHook(trial)
    try:
        data = copy.deepcopy(base)
        for key, value in params.items():
            set_dotted(data, key, value, f"trial {trial.number}'s {key}")
        cfg = resolve(build_config(data))
        run_dir = folder / name
        if (run_dir / "config.json").exists():
            raise EdgepflError(f"{run_dir} already holds a run, not one of this study's trials; "
                               "choose another --study")
        # as edgepfl run: the folder locked and its config.json created exclusively, so
        # that another process writing there (a worker, a shell) is refused, not mixed in
        result = start_run(cfg, run_dir, progress=progress, hooks=[hook], **federation_of(cfg))
    except optuna.TrialPruned:
        trial.set_user_attr("rounds", hook.round)
        study.tell(trial, state=TrialState.PRUNED)
        echo(f"trial {trial.number} pruned after round {hook.round} (best validation "
             f"{pct(hook.best)}): {point}")
        return
    except (KeyboardInterrupt, SystemExit):
        trial.set_user_attr("interrupted", "stopped by the user")
        study.tell(trial, state=TrialState.FAIL)
        raise
    except (EdgepflError, OSError) as exc:
        _failed(study, trial, str(exc), point, echo)
        return
    except Exception as exc:  # not bad input: keep where it happened
        _failed(study, trial, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                point, echo)
        return
    s = result.summary
    value = s.get(OBJECTIVE)
    if value is None or not math.isfinite(value):
        _failed(study, trial, "no evaluated round had validation accuracy (do the clients "
                "have validation samples? raise eval.validation)", point, echo)
        return
    trial.set_user_attr("rounds", s.get("rounds"))
    trial.set_user_attr("val_best_round", s.get("val_best_round"))
    study.tell(trial, value)
    echo(f"trial {trial.number} complete: best validation {pct(value)} (round "
         f"{s.get('val_best_round')}): {point}")


def _failed(study, trial, text: str, point: str, echo: Callable[[str], None]) -> None:
    from optuna.trial import TrialState

    trial.set_user_attr("error", text)
    study.tell(trial, state=TrialState.FAIL)
    echo(f"trial {trial.number} failed: {text.splitlines()[0] if text else ''} ({point})")


def pct(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{100 * value:.2f}%"


def _work(db: Path, folder: Path, base: dict, space: dict[str, SearchRange], trials: int,
          seed: int, pruner: Any, progress: bool | None, echo: Callable[[str], None]) -> None:
    """Trials of the study, one after another, until ``trials`` count."""
    study, storage = _open_study(db, pruner, base["train"]["rounds"])
    while True:
        nxt = _next_trial(study, storage, folder / "study.lock", trials, seed, space)
        if nxt is None:
            return
        _run_trial(study, *nxt, base, folder, progress, echo)


def _worker(args: dict) -> None:
    import logging

    import torch

    torch.set_num_threads(args.pop("threads"))
    level = args.pop("log_level")
    if level is not None:
        from edgepfl.engine.progress import configure_logging

        configure_logging(level)
    logging.getLogger("optuna").setLevel(logging.WARNING)
    space = {k: parse_space_item(f"{k}={v}")[1] for k, v in args.pop("space").items()}
    _work(Path(args.pop("db")), Path(args.pop("folder")), space=space,
          echo=lambda text: print(text, flush=True), progress=False, **args)


# -- the command --------------------------------------------------------------------------
def _check_request(base: Config, algorithm: str, trials: int, seed: int, jobs: int,
                   pruner: Any) -> None:
    get_algorithm(algorithm)
    if not base.eval.validation:
        raise ConfigError(
            "edgepfl tune chooses on a validation split and this configuration has none: "
            "set eval.validation to the share of each client's training data to hold out, "
            "e.g. --set eval.validation=0.2. Choosing on test accuracy would fit the choice "
            "to the test set, and a comparison on that test set would then favour the method "
            "tuned hardest")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ConfigError(f"--trials {trials!r} must be a whole number of trials, at least 1 "
                          "(the study's total: trials already done count)")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConfigError(f"--seed {seed!r} must be a whole number >= 0 (the sampler's seed)")
    check_jobs(jobs)
    _optuna()
    if jobs > 1 and not (pruner is None or isinstance(pruner, str)):
        raise ConfigError("a pruner object works in one process only; with --jobs give "
                          f"one of {', '.join(PRUNERS)}")


def tune(base: Config, algorithm: str, trials: int, study: Path | None = None, *,
         space: Iterable[str] = (), fixed: Iterable[str] = (), seed: int = 0, jobs: int = 1,
         threads: int | None = None, pruner: Any = "median", progress: bool | None = None,
         echo: Callable[[str], None] = print) -> dict:
    """Run the study's missing trials (up to ``trials`` in all), then write tune.csv,
    tune.md and, once a trial has completed, best.json into its folder. ``space``:
    --space values; ``fixed``: the keys --set gave, which the search leaves alone;
    ``pruner``: "median", "none" or an Optuna pruner (one process only). Returns
    best.json's content."""
    _check_request(base, algorithm, trials, seed, jobs, pruner)
    from edgepfl.engine.parts import resolve
    from edgepfl.experiments.runs import federation_of

    if "name" in base.algorithm.model_fields_set and base.algorithm.name != algorithm:
        raise ConfigError(f"the configuration names algorithm.name = {base.algorithm.name!r} "
                          f"and --algorithm {algorithm!r}; name one algorithm")
    data = base.model_dump()
    data["algorithm"] = {**data["algorithm"], "name": algorithm}
    # the base itself first, so that its mistakes are not blamed on a range of the space;
    # and its data, which every trial loads (a missing data set fails here, not N times)
    federation_of(resolve(build_config(data)))
    searched = search_space(data, algorithm, parse_space(space), fixed)
    folder, db = study_location(study, algorithm)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EdgepflError(f"cannot create the study folder {folder}: {exc}") from None
    record = _record(algorithm, data, searched, seed)
    with _locked(folder / "study.lock"):
        opened, _ = _open_study(db, pruner, data["train"]["rounds"])
        stored = opened.user_attrs.get(ATTRS)
        if stored is None:
            opened.set_user_attr(ATTRS, record)
        else:
            _same_study(stored, record, db)
        # which pruners judged the study's trials: part of its budget, for compare --tuned
        used = list(opened.user_attrs.get("pruners", []))
        name = ("median" if pruner is None else pruner if isinstance(pruner, str)
                else type(pruner).__name__)
        if name not in used:
            opened.set_user_attr("pruners", [*used, name])
    done = sum(map(_counts, opened.get_trials(deepcopy=False)))
    echo(f"study {db}: {algorithm}, {done} of {trials} trials done; searching "
         f"{_space_line(record['space'])}")
    if jobs == 1:
        _work(db, folder, data, searched, trials, seed, pruner, progress, echo)
    else:
        _in_workers(db, folder, data, record["space"], trials, seed, pruner, jobs,
                    threads_per_job(jobs, threads), echo)
    return write_results(_open_study(db, pruner, data["train"]["rounds"])[0], folder, db, trials)


def _in_workers(db: Path, folder: Path, base: dict, space: dict[str, str], trials: int,
                seed: int, pruner: Any, jobs: int, threads: int,
                echo: Callable[[str], None]) -> None:
    import logging

    echo(f"{jobs} worker processes ({threads} torch thread{'s' if threads > 1 else ''} each) "
         "share the study")
    log = logging.getLogger("edgepfl")
    level = (logging.getLevelName(log.level).lower()
             if any(getattr(h, "_edgepfl", False) for h in log.handlers) else None)
    args = {"db": str(db), "folder": str(folder), "base": base, "space": space,
            "trials": trials, "seed": seed, "pruner": pruner, "threads": threads,
            "log_level": level}
    errors = []
    from edgepfl.engine.trackers import prepare_mlflow_stores

    # the trials' runs share one store: made once here, not by the workers at once
    prepare_mlflow_stores([(build_config(base), folder / "trial-0000")])
    # spawn, not fork: a fork copies torch's thread pools in whatever state they are
    with cf.ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
        futures = [pool.submit(_worker, dict(args)) for _ in range(jobs)]
        for future in cf.as_completed(futures):
            try:
                future.result()
            except cf.process.BrokenProcessPool:
                errors.append("a worker process died (killed, or out of memory); its trial "
                              "is marked interrupted when the study is next run")
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    if errors:
        raise EdgepflError("a worker failed (the same command again goes on with the study):"
                           "\n  " + "\n  ".join(errors))


# -- results ------------------------------------------------------------------------------
def _state(trial) -> str:
    from optuna.trial import TrialState

    if trial.state == TrialState.FAIL:
        return "failed" if "error" in trial.user_attrs else "interrupted"
    return trial.state.name.lower()


def write_results(study, folder: Path, db: Path, trials: int) -> dict:
    """tune.csv and tune.md of every trial, and best.json (the best complete trial's
    settings, ready for --set) once one has completed; returns best.json's content (empty
    without a complete trial)."""
    from optuna.trial import TrialState

    record = study.user_attrs.get(ATTRS) or {}
    space: dict[str, str] = record.get("space", {})
    every = sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)
    rows = []
    for t in every:
        error = t.user_attrs.get("error") or t.user_attrs.get("interrupted") or ""
        rows.append({"trial": t.number, "state": _state(t), OBJECTIVE: t.value,
                     "val_best_round": t.user_attrs.get("val_best_round"),
                     "rounds": t.user_attrs.get("rounds"),
                     **{k: t.params.get(k) for k in space},
                     "run_dir": t.user_attrs.get("run_dir"),
                     "error": error.splitlines()[0] if error else ""})
    columns = ["trial", "state", OBJECTIVE, "val_best_round", "rounds", *space, "run_dir",
               "error"]
    write_csv(folder / "tune.csv", columns, rows)
    complete = [t for t in every if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value) if complete else None  # ties: the earliest
    counts = {s: sum(r["state"] == s for r in rows)
              for s in ("complete", "pruned", "failed", "interrupted", "running")}
    out: dict = {}
    if best is not None:
        settings = [f"{k}={value_text(best.params[k])}" for k in space if k in best.params]
        out = {"algorithm": record.get("algorithm"), "objective": OBJECTIVE,
               "value": best.value, "trial": best.number,
               "run_dir": best.user_attrs.get("run_dir"), "settings": settings,
               "params": {k: best.params[k] for k in space if k in best.params},
               "trials": {"planned": trials, **counts}, "space": space,
               "pruner": ", ".join(study.user_attrs.get("pruners", [])) or None,
               "sampler_seed": record.get("seed"), "study": db.name,
               "config": record.get("config")}
        write_json(folder / BEST, out)
    write_bytes_atomic(folder / "tune.md",
                       tune_markdown(rows, record, space, out, folder, trials, counts).encode())
    return out


def compare_command(folder: Path, algorithm: str, study_cfg: dict) -> str:
    """The comparison the study was made for: its setting (what it changed from the
    defaults, but the algorithm's own settings, which --tuned brings, and where it is
    reported) and five seeds after the study's own, so that no seed the point was picked
    on scores it."""
    from edgepfl.config import build_config
    from edgepfl.engine.trackers import flatten

    default = flatten(build_config({"algorithm": {"name": algorithm}}).model_dump())
    sets = [f"--set {key}={value_text(value)}" for key, value in flatten(study_cfg).items()
            if not key.startswith(("algorithm.", "output.")) and key != "seed"
            and not isinstance(value, list | type(None)) and default.get(key) != value]
    seed = study_cfg.get("seed", 0) if isinstance(study_cfg.get("seed"), int) else 0
    seeds = ",".join(str(seed + k) for k in range(1, 6))
    # the plug-ins the study loaded: a plug-in's algorithm is known only with them
    plugins = study_cfg.get("plugins")
    loads = [f"--plugin {p}" for p in (plugins if isinstance(plugins, list) else [])
             if isinstance(p, str)]
    return " ".join([f"edgepfl compare --tuned {folder} --algorithms {algorithm},...",
                     *loads, *sets, f"--seeds {seeds}"])


def tune_markdown(rows: list[dict], record: dict, space: dict[str, str], best: dict,
                  folder: Path, trials: int, counts: dict[str, int]) -> str:
    cfg = record.get("config") or {}
    part, train, ev = cfg.get("partition", {}), cfg.get("train", {}), cfg.get("eval", {})
    algorithm = cast(str, record.get("algorithm"))  # written by _record
    lines = [
        f"# Tuning {algorithm} on {cfg.get('dataset', {}).get('name')}",
        "",
        f"{part.get('clients')} clients, partition {partition_words(part)}, "
        f"{train.get('rounds')} rounds, seed {cfg.get('seed')}; "
        f"{ev.get('validation')} of each client's training data held out for validation. "
        f"Optuna study {folder / DB_NAME}, TPE sampler seed {record.get('seed')}.",
        "",
        "Each trial is scored by its best mean validation accuracy over the rounds "
        f"({OBJECTIVE}); the test split plays no part in the choice. A pruned trial was "
        "stopped when its best validation accuracy so far fell under the median of the "
        "earlier trials' at the same round (its figure is that best so far).",
        "",
        f"Trials: {sum(n for s, n in counts.items() if s != 'interrupted')} of {trials} ("
        + ", ".join(f"{n} {s}" for s, n in counts.items() if n and s != "interrupted") + ")"
        + (f"; {counts['interrupted']} interrupted, not counted"
           if counts.get("interrupted") else "")
        + ". Search space: " + ", ".join(f"`{k}` {v}" for k, v in space.items()) + ".",
        "",
        "| trial | state | best val acc | at round | rounds run | "
        + " | ".join(space) + " | run directory |",
        "|---|---|---|---|---|" + "---|" * len(space) + "---|",
    ]
    for r in rows:
        mark = "**" if best and r["trial"] == best["trial"] else ""
        cells = [f"{mark}{r['trial']}{mark}", r["state"], pct(r[OBJECTIVE]),
                 _cell(r["val_best_round"]), _cell(r["rounds"]),
                 *(_param(r[k]) for k in space), _cell(r["run_dir"])]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r["error"]]
    if failed:
        lines += ["", "Not complete:", ""]
        lines += [f"* trial {r['trial']} ({r['state']}): {r['error']}" for r in failed]
    lines.append("")
    if best:
        sets = " ".join(f"--set {s}" for s in best["settings"])
        lines += [f"Best: trial {best['trial']}, {pct(best['value'])} on validation "
                  f"(in bold above): `{sets}`. On test, over seeds other than the study's, "
                  "in its setting, beside the others (tuned with the same budget):",
                  "",
                  "    " + compare_command(folder, algorithm, record.get("config") or {})]
    else:
        lines.append("No trial has completed yet: no best setting (best.json is not written).")
    return "\n".join(lines) + "\n"


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _param(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return _cell(value)
