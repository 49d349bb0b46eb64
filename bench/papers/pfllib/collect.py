"""Side-by-side table of PFLlib's and edgepfl's runs made by run_all.sh (issue 58).

    .venv/bin/python bench/papers/pfllib/collect.py --runs /work/pfllib-runs --rounds 15

Both columns are the test accuracy weighted by samples over all clients (PFLlib's
``evaluate``: total correct / total test samples; edgepfl's ``acc_weighted``), at each
round r = 1..R after r aggregations; "best" is the best round of a run, "final" round R;
each cell is the mean ± sample std (ddof 1) over the three runs. PFLlib's entry 0 (before
any training) is left out. PFLlib's Ditto appends two entries a round to ``rs_test_acc``
(the global model's, then the personal models'): they are told apart here and the
personal models' figures are compared (edgepfl's Ditto evaluates the personal models).
edgepfl's unweighted client mean (``acc_mean``) is given beside for reference. The gap
column compares the best-round means with the seeds' spread, sqrt(sd_PFLlib^2 +
sd_edgepfl^2), and gives Welch's two-sided t-test p over the three pairs of runs (scipy).
"""
from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from statistics import mean, stdev

from scipy.stats import ttest_ind

METHODS = {"FedAvg": "fedavg", "FedPer": "fedper", "Ditto": "ditto", "FedRep": "fedrep",
           "APFL": "apfl", "SCAFFOLD": "scaffold", "FedDyn": "feddyn", "FedALA": "fedala"}


def read(path: Path, column: str) -> list[float]:
    with open(path, newline="") as f:
        return [float(row[column]) for row in csv.DictReader(f)]


def pfllib_curve(runs: Path, method: str, seed: int, rounds: int) -> list[float] | None:
    path = runs / f"{method}_{seed}.csv"
    if not path.is_file():
        return None
    acc = read(path, "acc_weighted")
    if len(acc) == 2 * (rounds + 1):  # Ditto: global, personal, global, personal, ...
        acc = acc[1::2]
    if len(acc) != rounds + 1:
        raise SystemExit(f"{path}: {len(acc)} entries, expected {rounds + 1}")
    return acc[1:]


def edgepfl_curve(runs: Path, method: str, seed: int, column: str) -> list[float] | None:
    path = runs / "edgepfl" / f"{method}_{seed}" / "metrics.csv"
    return read(path, column) if path.is_file() else None


def stat(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    return mean(values), stdev(values) if len(values) > 1 else math.nan


def cell(values: list[float]) -> str:
    m, s = stat(values)
    return "n/a" if math.isnan(m) else f"{100 * m:.2f} ± {100 * s:.2f} (n={len(values)})"


def row(method: str, runs: Path, rounds: int, seeds: list[int], pfl: str) -> list[str]:
    p = [c for s in seeds if (c := pfllib_curve(runs / pfl, method, s, rounds))]
    e = [c for s in seeds if (c := edgepfl_curve(runs, method, s, "acc_weighted"))]
    u = [c for s in seeds if (c := edgepfl_curve(runs, method, s, "acc_mean"))]
    pb, eb = [max(c) for c in p], [max(c) for c in e]
    (mp, sp), (me, se) = stat(pb), stat(eb)
    spread = math.hypot(sp, se)
    flag = "n/a" if math.isnan(spread) else (
        f"{100 * (me - mp):+.2f} ({'beyond' if abs(me - mp) > spread else 'within'} "
        f"{100 * spread:.2f}; p = {ttest_ind(pb, eb, equal_var=False).pvalue:.2f})")
    pf, ef = [c[-1] for c in p], [c[-1] for c in e]
    final = "n/a" if len(pf) < 2 or len(ef) < 2 else (
        f"{100 * (mean(ef) - mean(pf)):+.2f} (p = "
        f"{ttest_ind(pf, ef, equal_var=False).pvalue:.2f})")
    return [method, cell(pb), cell(eb), cell(pf), cell(ef), flag, final,
            cell([max(c) for c in u]), cell([c[-1] for c in u])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="/work/pfllib-runs")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--pfllib-dir", default="pfllib", help="PFLlib's CSVs under --runs "
                    "(a diagnostic run's folder, e.g. pfllib_keeplast)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    args = ap.parse_args()
    runs = Path(args.runs)
    print("| method | PFLlib best | edgepfl best | PFLlib final | edgepfl final | "
          "edgepfl - PFLlib, best (vs seed spread; Welch p) | edgepfl - PFLlib, final "
          "(Welch p) | edgepfl unweighted best | edgepfl unweighted final |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method in args.methods:
        print("| " + " | ".join(row(method, runs, args.rounds, args.seeds, args.pfllib_dir))
              + " |")


if __name__ == "__main__":
    main()
