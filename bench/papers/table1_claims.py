"""KAPC's Table 1 claims, checked on our runs under both statistics: for each claim "KAPC
beats X", the paper's margin beside ours, as the best round of the mean over all clients
(our protocol) and as each client's own best round averaged (the paper's statistic).

    python bench/papers/table1_claims.py bench/results/table1p bench/results/ablation

Runs are grouped by what they ran (bench/grid/grid_runs.py ``runs_by_method``); a margin is the
difference of the two methods' means over the seeds both have, with the number of seeds.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grid"))  # grid_runs
from collect_table1 import PAPER  # noqa: E402
from grid_runs import runs_by_method  # noqa: E402

GRIDS = {"mnist-a0.3-r50": ("mnist", "0.3"), "fmnist-a0.3-r50": ("fmnist", "0.3"),
         "fmnist-a0.1-r50": ("fmnist", "0.1")}
# (ours, theirs, the paper's row for theirs)
CLAIMS = [("kapc", "local", "local"), ("kapc", "local+total_epochs=5", "local"),
          ("kapc", "fedavg", "fedavg"), ("kapc", "fedavg+evaluate=local", "fedavg"),
          ("kapc", "fedprox", "fedprox"),
          ("kapc", "fedprox+evaluate=local", "fedprox"), ("kapc", "fedamp", "fedamp"),
          ("kapc+lam=1.0", "local", "local"), ("kapc_bls+lam=1.0", "kapc+lam=1.0", "kapc"),
          ("kapc_bls", "kapc", "kapc")]


def margin(a: dict[int, Path], b: dict[int, Path], key: str) -> str:
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return "-"
    diffs = []
    for s in seeds:
        sa = json.loads((a[s] / "summary.json").read_text())
        sb = json.loads((b[s] / "summary.json").read_text())
        if sa.get(key) is None or sb.get(key) is None:
            return "-"
        diffs.append(100 * (sa[key] - sb[key]))
    return f"{statistics.fmean(diffs):+.2f} ({len(seeds)})"


def main(roots: list[Path]) -> None:
    grids = runs_by_method(roots)
    print("| claim | " + " | ".join(f"{g}: paper / ours / paper's statistic" for g in GRIDS)
          + " |")
    print("|---|" + "---|" * len(GRIDS))
    for ours, theirs, paper_row in CLAIMS:
        cells = []
        for grid, key in GRIDS.items():
            methods = grids.get(grid, {})
            paper = PAPER[key]
            base = ours.split("+")[0]
            p = paper[base] - paper[paper_row]
            if ours not in methods or theirs not in methods:
                cells.append(f"{p:+.2f} / - / -")
                continue
            cells.append(f"{p:+.2f} / {margin(methods[ours], methods[theirs], 'acc_mean_best')}"
                         f" / {margin(methods[ours], methods[theirs], 'acc_client_best_mean')}")
        print(f"| {ours} - {theirs} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]] or [Path("bench/results/table1p")])
