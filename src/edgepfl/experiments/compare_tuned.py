"""``compare --tuned``: what studies chose, brought into a comparison.

Apart from running a study (``experiments.tune``) because a comparison reads only what a study
left behind (its best.json), long after and without Optuna; and the notes printed here
are about whether the methods compared were treated alike, which is the comparison's
question, not the study's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from edgepfl.config import Config, parse_value
from edgepfl.engine.rundir import config_diff
from edgepfl.errors import ConfigError
from edgepfl.experiments.tune import BEST, DB_NAME, pct, settings_of
from edgepfl.io import read_json


def load_best(path: Path) -> tuple[dict, Path]:
    """A study's best.json from the study's folder, its study.db or the file itself, and
    the study's folder."""
    path = Path(path)
    if path.is_dir():
        folder, file = path, path / BEST
    elif path.suffix == ".db":
        folder, file = path.parent, path.parent / BEST
    else:
        folder, file = path.parent, path
    if not file.exists():
        hint = (" (the study has not finished a trial yet, or its tune was interrupted: the "
                "same edgepfl tune command again finishes it and writes best.json)"
                if (folder / DB_NAME).exists() else "")
        raise ConfigError(f"--tuned {str(path)!r}: no {file} found{hint}; give a study "
                          "folder, its study.db or its best.json")
    best = read_json(file)
    settings = best.get("settings") if isinstance(best, dict) else None
    if (not isinstance(best, dict) or not isinstance(best.get("algorithm"), str)
            or not isinstance(settings, list)
            or not all(isinstance(s, str) and "=" in s for s in settings)):
        raise ConfigError(f"--tuned {str(path)!r}: {file} is not a best.json written by "
                          "edgepfl tune (it needs \"algorithm\" and \"settings\", a list of "
                          "KEY=VALUE)")
    return best, folder


def tuned_settings(paths: Iterable[Path], algorithms: list[str], base: Config,
                   echo: Callable[[str], None] = print) -> tuple[dict[str, dict], dict[str, str]]:
    """From ``--tuned`` studies: each tuned algorithm's settings as {dotted key: value}
    and a line saying what it was tuned with, for the comparison table. A study of an
    algorithm not compared, or two of one, is an error; a study run in another setting
    than the comparison's is noted."""
    settings: dict[str, dict] = {}
    notes: dict[str, str] = {}
    source: dict[str, Path] = {}
    counted: dict[str, int] = {}
    pruners: dict[str, Any] = {}
    given = base.model_dump()
    for path in paths:
        best, folder = load_best(path)
        name = best["algorithm"]
        _check_wanted(path, name, algorithms, source)
        source[name] = Path(path)
        values = settings[name] = _values(best)
        counted[name] = _trials_counted(best)
        pruners[name] = best.get("pruner")
        notes[name] = _tuned_line(folder, best, counted[name], pruners[name])
        _note_overridden(name, values, base, echo)
        _note_other_setting(name, values, best.get("config"), given, echo)
    _note_unequal_tuning(algorithms, settings, counted, pruners, echo)
    return settings, notes


def _check_wanted(path: Path, name: str, algorithms: list[str],
                  source: dict[str, Path]) -> None:
    """A study is refused rather than ignored where it would not be used, or where which
    of two studies of one method wins would depend on the order they were given in."""
    if name not in algorithms:
        raise ConfigError(f"--tuned {str(path)!r} tuned {name}, which is not among "
                          f"--algorithms {','.join(algorithms)}")
    if name in source:
        raise ConfigError(f"--tuned names two studies of {name} ({source[name]} and "
                          f"{path}); give one")


def _values(best: dict) -> dict[str, Any]:
    """best.json's KEY=VALUE settings, each value read as --set reads it, so that a tuned
    setting and the same one given by hand are the same value."""
    values = {}
    for item in best["settings"]:
        key, _, raw = item.partition("=")
        values[key.strip()] = parse_value(raw.strip())
    return values


def _trials_counted(best: dict) -> int:
    """The trials the study spent: not those it plans, nor those interrupted or still
    running (they did not judge their point), so that budgets compare."""
    trials = best.get("trials")
    if not isinstance(trials, dict):
        trials = {}
    return sum(v for k, v in trials.items() if k not in ("planned", "interrupted", "running"))


def _tuned_line(folder: Path, best: dict, counted: int, pruner: Any) -> str:
    return (f"tuned: {folder} (trial {best.get('trial')} of "
            f"{counted or '?'}"
            + (f", pruner {pruner}" if pruner else "") + ", "
            f"best validation {pct(best.get('value'))}): "
            + (", ".join(best["settings"]) or "(nothing searched)"))


def _note_overridden(name: str, values: dict[str, Any], base: Config,
                     echo: Callable[[str], None]) -> None:
    """A value given for the comparison that the study's replaces would otherwise be
    silently dropped."""
    overridden = [k for k in values if k.startswith("algorithm.") and (
        k.split(".", 1)[1] in base.algorithm.hyperparameters()
        or k.split(".", 1)[1] in (base.algorithm.hyperparameters().get(name) or {}))]
    overridden += [k for k in values if k.startswith("train.")
                   and k.split(".", 1)[1] in base.train.model_fields_set]
    if overridden:
        echo(f"note: {name}'s tuned {', '.join(overridden)} replace"
             f"{'s' if len(overridden) == 1 else ''} the value given for the comparison")


def _note_other_setting(name: str, values: dict[str, Any], study_cfg: Any, given: dict,
                        echo: Callable[[str], None]) -> None:
    """Values tuned in one setting (data, partition, rounds) need not be good in another.
    The seed, the output and the tuned settings themselves are left out of the
    difference: they are meant to differ."""
    if not isinstance(study_cfg, dict):
        return
    here = copy.deepcopy(given)
    here["algorithm"] = {"name": name}
    there = copy.deepcopy(study_cfg)
    there["algorithm"] = {"name": name}
    for cfg in (here, there):
        cfg.pop("seed", None)
        cfg.pop("output", None)
        for key in values:
            section, _, field = key.partition(".")
            if isinstance(cfg.get(section), dict):
                cfg[section].pop(field, None)
    diff = config_diff(settings_of(there), settings_of(here))
    if diff:
        echo(f"note: {name} was tuned in another setting than this comparison's "
             "(its tuned values may not carry over):\n  "
             + "\n  ".join(d.replace("run has", "study has") for d in diff))


def _note_unequal_tuning(algorithms: list[str], settings: dict[str, dict],
                         counted: dict[str, int], pruners: dict[str, Any],
                         echo: Callable[[str], None]) -> None:
    """Methods tuned with more care than others look better for it: said, so that the
    difference is not read as the methods'."""
    untuned = [a for a in algorithms if a not in settings]
    if settings and untuned:
        echo(f"note: {', '.join(untuned)} run at their defaults while "
             f"{', '.join(settings)} were tuned: a difference between them is partly tuning, "
             "not the method (tune each with the same budget for a fair comparison)")
    if len(set(counted.values())) > 1 or len({str(v) for v in pruners.values()}) > 1:
        echo("note: the studies had different budgets (" + ", ".join(
            f"{n}: {counted[n]} trials, pruner {pruners[n]}" for n in settings)
            + "): a difference between the tuned methods is partly the budget")
