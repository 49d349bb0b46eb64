"""Finished runs of a benchmark grid, merged over several roots.

A grid root holds ``<grid>/<run>-seed<k>/`` folders (bench/grid/run_one.sh); kept runs from
earlier machines (bench/grid/keep_results.py) and new ones are read together, merged by grid
folder name; a run present in more than one root is taken from the first root.

A run's name says only the settings its grid line gave; the rest are the defaults of the
day it ran. So the seeds of one name are checked to share every setting but the seed
(a default changed between two runs must not average two methods into one row), and
``unnamed_settings`` tells a collector which of a run's algorithm settings differ from
today's defaults without being in its name. ``runs_by_method`` regroups them by what they
ran rather than by name (``method_label``), so that runs named under another day's defaults
(``kapc+lam=0.1`` before lambda's default became 0.1, ``kapc`` at the old lambda = 1) meet
the runs of the same method named today.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def is_finished(run: Path) -> bool:
    """summary.json exists and covers the configured rounds, or says the run stopped early
    on its way there (train.early_stopping); a run being extended to more rounds,
    bench/grid/extend.sh, still holds the summary of its shorter self."""
    try:
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        return False
    rounds = config.get("train", {}).get("rounds")
    return summary.get("rounds") == rounds or (
        bool(summary.get("stopped_early")) and summary.get("rounds_planned") == rounds)


def finished_runs(roots: list[Path]) -> dict[str, dict[str, list[Path]]]:
    """{grid folder: {run name without the seed: [run folders, one per seed]}}, sorted."""
    grids: dict[str, dict[str, Path]] = {}
    for root in roots:
        if not root.is_dir():
            raise SystemExit(f"no such results folder: {root}")
        for folder in (p for p in root.iterdir() if p.is_dir()):
            found = grids.setdefault(folder.name, {})
            for run in folder.iterdir():
                if is_finished(run):
                    found.setdefault(run.name, run)
    merged: dict[str, dict[str, list[Path]]] = {}
    for name in sorted(grids):
        runs = merged.setdefault(name, {})
        for run_name, run in sorted(grids[name].items()):
            m = re.fullmatch(r"(.+)-seed(\d+)", run_name)
            if m:
                runs.setdefault(m.group(1), []).append(run)
        for label, dirs in runs.items():
            check_same_settings(f"{name}/{label}", dirs)
    return merged


def settings(run: Path) -> dict:
    """A run's configuration with today's defaults for settings added since it ran, without
    its seed, how it executed (rounds, device, workers) and what it wrote (output.*)."""
    return settings_of(json.loads((run / "config.json").read_text()))


def settings_of(cfg: dict) -> dict:
    """``settings`` of a configuration given as a dict (stored or asked for)."""
    import warnings

    from edgepfl.engine.rundir import comparable

    with warnings.catch_warnings():  # an ablation's settings warn each time they are read
        warnings.simplefilter("ignore")
        cfg = comparable(cfg)
    for key in ("seed", "output"):
        cfg.pop(key, None)
    return cfg


def check_same_settings(what: str, dirs: list[Path]) -> None:
    from edgepfl.engine.rundir import config_diff

    first = settings(dirs[0])
    for other in dirs[1:]:
        diff = config_diff(first, settings(other))
        if diff:
            raise SystemExit(f"{what}: {dirs[0]} and {other} differ in more than the seed, so "
                             f"they are not seeds of one method:\n  " + "\n  ".join(diff)
                             + "\nrename one of them (bench/grid/run_one.sh names a run by the "
                             "settings its grid line gives) or collect them apart")


def unnamed_settings(cfg: dict, label: str) -> str:
    """' (lam=1.0)' for the algorithm settings of ``cfg`` that differ from today's defaults
    and are not spelled in the run's ``label``; '' when there are none."""
    from edgepfl.algorithms import ALGORITHMS
    from edgepfl.engine.rundir import with_before
    from edgepfl.errors import ConfigError

    stored = dict(with_before(cfg).get("algorithm", {}))  # what a run from before a setting did
    algo = ALGORITHMS.get(stored.pop("name", None))
    if algo is None:
        return ""
    try:
        defaults = algo.parse_hyperparameters({}).model_dump()  # today's defaults
    except ConfigError:
        return ""
    named = {part.split("=")[0] for part in label.split("+")[1:]}
    notes = [f"{k}={v}" for k, v in stored.items()
             if k in defaults and v != defaults[k] and k not in named]
    return f" ({', '.join(notes)})" if notes else ""


def method_label(cfg: dict, run_name: str) -> str:
    """What a run ran, in today's terms: the algorithm, the full config keys its name gives
    (``model.name=cnn2_bn``) and every algorithm setting that differs from today's
    defaults, e.g. ``kapc+lam=1.0`` for a run named ``kapc`` before lambda's default
    changed, and ``kapc`` for one named ``kapc+lam=0.1`` since."""
    algo = cfg.get("algorithm", {}).get("name", run_name.split("+")[0])
    dotted = [part for part in run_name.split("+")[1:] if "." in part.split("=")[0]]
    notes = unnamed_settings(cfg, algo)[2:-1]  # ' (lam=1.0, mu=0.1)' -> 'lam=1.0, mu=0.1'
    return "+".join([algo, *dotted, *(notes.split(", ") if notes else [])])


def runs_by_method(roots: list[Path]) -> dict[str, dict[str, dict[int, Path]]]:
    """{grid folder: {method_label: {seed: run folder}}}: the finished runs of
    ``finished_runs`` regrouped by what they ran. Two runs of one method and seed (under two
    names) must have the same settings; the first found is taken."""
    grouped: dict[str, dict[str, dict[int, Path]]] = {}
    for grid, found in finished_runs(roots).items():
        methods = grouped.setdefault(grid, {})
        for name, dirs in found.items():
            for run in dirs:
                cfg = json.loads((run / "config.json").read_text())
                seeds = methods.setdefault(method_label(cfg, name), {})
                seed = int(cfg["seed"])
                if seed in seeds:
                    check_same_settings(f"{grid}/{method_label(cfg, name)}", [seeds[seed], run])
                else:
                    seeds[seed] = run
        for label, seeds in methods.items():
            methods[label] = dict(sorted(seeds.items()))
            check_same_settings(f"{grid}/{label}", list(methods[label].values()))
    return grouped
