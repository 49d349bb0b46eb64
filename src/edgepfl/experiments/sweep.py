"""A grid of settings: every combination of the given values, each over the same seeds.

``--grid train.lr=0.01,0.05 --grid partition.alpha=0.1,0.5`` plans four configurations;
each is checked whole (as ``--set`` would check it) before the first run starts, so a
misspelt key or a value out of range costs nothing. The runs go through ``experiments.runs``
(resumable, ``jobs`` at a time), one directory each, named from the varied values; the
table has the varied settings as columns and the figures over seeds (``report.stats``).
"""

from __future__ import annotations

import copy
import itertools
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edgepfl.config import Config, build_config, parse_value, set_dotted
from edgepfl.engine.rundir import run_dir_lock
from edgepfl.engine.simulation import resolve
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.experiments.runs import PlannedRun, check_jobs, run_all
from edgepfl.io import write_bytes_atomic, write_csv
from edgepfl.plotting import setting_line
from edgepfl.report import stats
from edgepfl.report.plots import plot_curves, seed_curves

Grid = list[tuple[str, list[Any]]]
# with eval.validation, acc_mean_at_val_best is the figure to pick a grid point by: the
# test accuracy at the round the validation split picked (empty without one)
FIGURES = ("acc_mean_best", "acc_mean_final", "acc_mean_at_val_best")


def parse_values(raw: str) -> list[Any]:
    """``0.01,0.05`` -> [0.01, 0.05]: each value read as ``--set`` reads one (TOML, else a
    bare string such as ``fedavg``); commas inside quotes or brackets belong to the value
    (``"a,b",c``, ``["16:9", "1:1"],["4:3"]``)."""
    return [parse_value(v.strip()) for v in _split_values(raw) if v.strip()]


def _split_values(raw: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth, quote = 0, ""
    for ch in raw:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return parts


def parse_grid(items: Sequence[str], overrides: Sequence[str] = ()) -> Grid:
    """``--grid KEY=V1,V2,...`` options as [(key, values)], in the order given."""
    if not items:
        raise EdgepflError("a sweep needs at least one --grid KEY=V1,V2 (e.g. --grid "
                           "train.lr=0.01,0.05)")
    fixed = {o.partition("=")[0].strip() for o in overrides}
    grid: Grid = []
    for item in items:
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise EdgepflError(f"--grid {item!r} is not of the form key=v1,v2,... "
                               "(e.g. train.lr=0.01,0.05)")
        if key == "seed":
            raise EdgepflError(f"--grid {item!r}: seeds are given with --seeds, e.g. --seeds 0,1,2")
        if key in fixed:
            raise EdgepflError(f"--grid {key} and --set {key} both set {key}; give its values "
                               "in one of them")
        if any(key == k for k, _ in grid):
            raise EdgepflError(f"--grid names {key} more than once; list all its values in one "
                               f"--grid {key}=v1,v2,...")
        values = parse_values(raw)
        if not values:
            raise EdgepflError(f"--grid {item!r} has no values; give them comma-separated, "
                               f"e.g. {key}=v1,v2")
        texts = [value_text(v) for v in values]
        repeated = sorted({t for t in texts if texts.count(t) > 1})
        if repeated:
            raise EdgepflError(f"--grid {key} lists {repeated[0]} more than once")
        grid.append((key, values))
    return grid


def value_text(value: Any) -> str:
    """A value as it is written on the command line and in the tables (TOML's spelling)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return value
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def _name_text(value: Any) -> str:
    text = ",".join(map(value_text, value)) if isinstance(value, list) else value_text(value)
    # a folder name: no separators, no characters a shell or another system would trip on
    return re.sub(r"[^A-Za-z0-9._,-]", "_", text)


def point_names(keys: list[str], points: list[tuple]) -> list[str]:
    """A folder name per grid point, ``lr=0.01+alpha=0.1``: a key by its last part unless
    two keys share it (``train.batch_size`` and ``eval.batch_size``)."""
    lasts = [k.split(".")[-1] for k in keys]
    short = [last if lasts.count(last) == 1 else key for key, last in zip(keys, lasts, strict=True)]
    names = ["+".join(f"{s}={_name_text(v)}" for s, v in zip(short, point, strict=True))
             for point in points]
    for i, name in enumerate(names):
        if names.index(name) != i:
            a, b = points[names.index(name)], points[i]
            raise EdgepflError(f"the grid points {_point_label(keys, a)} and {_point_label(keys, b)} "
                               f"would share the run directory {name!r}; give values that "
                               "differ in letters or digits")
    return names


def _point_label(keys: list[str], point: tuple) -> str:
    return ", ".join(f"{k}={value_text(v)}" for k, v in zip(keys, point, strict=True))


def plan_sweep(base: Config, grid: Grid,
               seeds: list[int]) -> tuple[list[PlannedRun], dict, list[tuple], list[str]]:
    """Every grid point with every seed, each configuration validated and resolved: the
    runs seed by seed (the runs of a seed share its data set), {run name: (point index,
    seed)}, the points and their names."""
    keys = [k for k, _ in grid]
    points = list(itertools.product(*[values for _, values in grid]))
    names = point_names(keys, points)
    data = base.model_dump()
    configs = []
    for point in points:
        point_data = copy.deepcopy(data)
        for key, value in zip(keys, point, strict=True):
            set_dotted(point_data, key, value, f"--grid {key}")
        try:
            configs.append(resolve(build_config(point_data)))
        except ConfigError as exc:
            raise ConfigError(f"{exc}\n  (at the grid point {_point_label(keys, point)})") from None
    plan, of = [], {}
    for seed in seeds:
        for i, cfg in enumerate(configs):
            run = PlannedRun(f"{names[i]}-seed{seed}", build_config({**cfg.model_dump(), "seed": seed}))
            plan.append(run)
            of[run.name] = (i, seed)
    return plan, of, points, names


def sweep(base: Config, grid: Grid, seeds: list[int], out: Path,
          progress: bool | None = None, echo: Callable[[str], None] = print, *,
          jobs: int = 1, threads: int | None = None) -> list[dict]:
    """Every grid point with every seed into ``out/<point>-seed<k>``, then sweep.csv,
    sweep.md and sweep.png. Returns the table's rows, one per grid point."""
    with run_dir_lock(out, "sweep"):  # one sweep writes its folder at a time
        return _sweep(base, grid, seeds, out, progress, echo, jobs=jobs, threads=threads)


def _sweep(base: Config, grid: Grid, seeds: list[int], out: Path, progress: bool | None,
           echo: Callable[[str], None], *, jobs: int, threads: int | None) -> list[dict]:
    check_jobs(jobs)
    if (out / "sweep.csv").exists():
        raise EdgepflError(f"{out} already holds a sweep; choose another --out")
    plan, of, points, names = plan_sweep(base, grid, seeds)
    keys = [k for k, _ in grid]
    echo(f"{len(points)} grid points x {len(seeds)} seed{'s' if len(seeds) > 1 else ''} = "
         f"{len(plan)} runs")

    def finished(run: PlannedRun, result) -> None:
        s = result.summary
        best, final = s.get("acc_mean_best"), s.get("acc_mean_final")
        echo(f"{run.name}: best {'-' if best is None else f'{100 * best:.2f}%'} (round "
             f"{s.get('best_round')}), final {'-' if final is None else f'{100 * final:.2f}%'}")

    results = run_all(plan, out, jobs=jobs, threads=threads, progress=progress,
                      on_finished=finished, echo=echo)
    rows = []
    for i, point in enumerate(points):
        runs = [run for run in plan if of[run.name][0] == i]
        summaries = [results[run.name].summary for run in runs]
        row: dict = {key: value_text(v) for key, v in zip(keys, point, strict=True)}
        row.update(point=names[i], n_seeds=len(runs),
                   seeds=" ".join(str(of[run.name][1]) for run in runs))
        row["estimates"] = {fig: stats.estimate(s.get(fig) for s in summaries)
                            for fig in FIGURES}
        for fig, est in row["estimates"].items():
            row.update(stats.columns(fig, est))
        for fig in ("bytes_up_total", "bytes_down_total"):
            row[f"{fig}_mean"] = stats.estimate(s.get(fig) for s in summaries).mean
        row["run_dirs"] = " ".join(run.name for run in runs)
        rows.append(row)
    columns = keys + ["point", "n_seeds", "seeds"] + [
        c for fig in FIGURES for c in stats.column_names(fig)] + [
        "bytes_up_total_mean", "bytes_down_total_mean", "run_dirs"]
    write_csv(out / "sweep.csv", columns, rows)
    write_bytes_atomic(out / "sweep.md", sweep_markdown(rows, grid, seeds, base).encode())
    plot_curves({names[i]: seed_curves([results[run.name].curve for run in plan
                                        if of[run.name][0] == i]) for i in range(len(points))},
                out / "sweep.png", "mean accuracy over the seeds (band: ± sample std over seeds)"
                if len(seeds) > 1 else "mean accuracy",
                setting=setting_line(base.model_dump(), skip=keys))
    return rows


def sweep_markdown(rows: list[dict], grid: Grid, seeds: list[int], base: Config) -> str:
    keys = [k for k, _ in grid]
    several = len(seeds) > 1
    validation = bool(base.eval.validation)
    fixed = setting_line(base.model_dump(), skip=keys)
    algorithm = "" if "algorithm.name" in keys else f"{base.algorithm.name}, "
    varied = "; ".join(f"`{k}` = {', '.join(value_text(v) for v in values)}" for k, values in grid)
    lines = [
        f"# Sweep on {base.dataset.name}",
        "",
        f"{algorithm}{fixed}, seeds {', '.join(map(str, seeds))}. Varied: {varied} "
        f"({len(rows)} combinations). "
        + ("Each cell is the mean ± the sample standard deviation (ddof = 1) over the seeds; "
           "*95% CI* is Student's t-interval for the mean over the seeds. "
           if several else
           "One seed, so no spread over seeds and no interval (n/a); more seeds with "
           "--seeds. ")
        + "Accuracy (%) is the unweighted mean over clients of each client's personalized "
        "model on its own test split; *best* is the best round, *final* the last"
        + ("; *at validation's best round* is the test accuracy of the round the clients' "
           "validation splits picked: choose a grid point by it, not by *best*, which the "
           "test split picked." if validation else "."),
        "",
        "| " + " | ".join(keys) + " | best mean acc | best 95% CI | final mean acc | "
        "final 95% CI | " + ("at validation's best round | its 95% CI | " if validation else "")
        + "MB up | MB down |",
        "|" + "---|" * (len(keys) + 6 + (2 if validation else 0)),
    ]
    for row in rows:
        cells = [str(row[k]).replace("|", "\\|") for k in keys]
        for fig in FIGURES:
            if fig == "acc_mean_at_val_best" and not validation:
                continue
            est = row["estimates"][fig]
            cells += [stats.mean_sd_text(est, 100), stats.interval_text(est, 100)]
        cells += [f"{row['bytes_up_total_mean'] / 1e6:.2f}",
                  f"{row['bytes_down_total_mean'] / 1e6:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
