"""Two runs of a grid compared seed by seed (same split, same initial model): what one
setting changes against another, without the spread between seeds in the way.

    python bench/papers/collect_pairs.py A B ROOT [ROOT ...]
    python bench/papers/collect_pairs.py kapc kapc+lam=0.1 bench/results/table1p bench/results/ablation
    python bench/papers/collect_pairs.py --methods local kapc bench/results/table1p bench/results/ablation

A and B are run names without the seed (bench/grid/run_one.sh names); every grid folder and seed
where both finished gives a row: best mean accuracy, final mean accuracy and each client's
own best (the paper's statistic), A -> B and the difference.
With ``--methods``, A and B are what the runs ran in today's terms rather than their names
(bench/grid/grid_runs.py ``method_label``: ``kapc`` at today's default lambda, ``kapc+lam=1.0``).
Roots are merged as by the collectors (bench/grid/grid_runs.py): the first root holding a run wins.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grid"))  # grid_runs
from grid_runs import finished_runs, runs_by_method  # noqa: E402


def runs(grids: dict[str, dict[str, list[Path]]], name: str) -> dict[tuple[str, str], Path]:
    """{(grid folder, seed): run folder} of run name ``name``."""
    return {(grid, run.name.rsplit("-seed", 1)[1]): run
            for grid, found in grids.items() for run in found.get(name, [])}


def pct(summary: dict, key: str) -> float | None:
    value = summary.get(key)
    return None if value is None else 100 * value


def cell(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return f"{'-' if a is None else f'{a:.2f}'} -> {'-' if b is None else f'{b:.2f}'}"
    return f"{a:.2f} -> {b:.2f} ({b - a:+.2f})"


def method_runs(roots: list[Path], label: str) -> dict[tuple[str, str], Path]:
    return {(grid, str(seed)): run for grid, methods in runs_by_method(roots).items()
            for seed, run in methods.get(label, {}).items()}


def main(a: str, b: str, roots: list[Path], methods: bool = False) -> None:
    if methods:
        left, right = method_runs(roots, a), method_runs(roots, b)
    else:
        grids = finished_runs(roots)
        left, right = runs(grids, a), runs(grids, b)
    keys = sorted(set(left) & set(right))
    if not keys:
        raise SystemExit(f"no grid folder and seed has both {a!r} and {b!r} finished")
    print(f"| grid | seed | best mean: {a} -> {b} | final mean | each client's best |")
    print("|---|---|---|---|---|")
    gains = []
    for grid, seed in keys:
        sa = json.loads((left[grid, seed] / "summary.json").read_text())
        sb = json.loads((right[grid, seed] / "summary.json").read_text())
        gains.append(100 * (sb["acc_mean_best"] - sa["acc_mean_best"]))
        print(f"| {grid} | {seed} | {cell(pct(sa, 'acc_mean_best'), pct(sb, 'acc_mean_best'))} | "
              f"{cell(pct(sa, 'acc_mean_final'), pct(sb, 'acc_mean_final'))} | "
              f"{cell(pct(sa, 'acc_client_best_mean'), pct(sb, 'acc_client_best_mean'))} |")
    print(f"\n{len(gains)} pairs; best mean {b} - {a}: mean {statistics.fmean(gains):+.2f}, "
          f"min {min(gains):+.2f}, max {max(gains):+.2f}; {sum(g > 0 for g in gains)} up, "
          f"{sum(g < 0 for g in gains)} down")


if __name__ == "__main__":
    args = sys.argv[1:]
    by_method = args[:1] == ["--methods"]
    args = args[1:] if by_method else args
    if len(args) < 3:
        raise SystemExit(__doc__)
    main(args[0], args[1], [Path(p) for p in args[2:]], by_method)
