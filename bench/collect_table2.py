"""Collect DC-PFL Table II runs (bench/dcpfl_table2.sh) into one markdown table.

    python bench/collect_table2.py runs/table2 > table.md

The paper reports, "when training converges", the final accuracy, the communication rounds,
the communication time and the total time (Table II). Its convergence point is not
defined; here it is the first round from which the mean accuracy stays within
``TOLERANCE`` of the run's final mean accuracy. Communication rounds count the rounds up
to that point in which any byte crossed a link (DC-PFL and Per-FedAvg have rounds
without); times are the simulated ones of the system model (2 Mbit/s per client), summed
over those rounds, each round taking its slowest client's time (docs/system.md).
"""

from __future__ import annotations

import csv
import json
import re
import statistics
import sys
from pathlib import Path

TOLERANCE = 0.01

# DC-PFL paper, Table II (FMNIST, "Low" heterogeneity; final accuracy, communication rounds,
# communication time s, total time s)
PAPER = {"local": (0.810, None, None, 114), "fedavg": (0.876, 79, 268, 506),
         "perfedavg": (0.890, 58, 197, 431), "clusterfl": (0.901, 61, 207, 391),
         "dcpfl": (0.925, 57, 73, 265)}


def converged_round(acc: list[float], tolerance: float = TOLERANCE) -> int:
    """Index (0-based) of the first round from which accuracy stays within tolerance of the last."""
    final = acc[-1]
    k = len(acc) - 1
    while k > 0 and abs(acc[k - 1] - final) <= tolerance:
        k -= 1
    return k


def one_run(run: Path) -> dict:
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    acc = [float(r["acc_mean"]) for r in rows]
    k = converged_round(acc)
    upto = rows[:k + 1]
    summary = json.loads((run / "summary.json").read_text())
    return {
        "final": summary["acc_mean_final"], "best": summary["acc_mean_best"],
        "worst": summary["acc_min_final"], "converged": k + 1,
        "comm_rounds": sum(1 for r in upto if int(r["bytes_up"]) + int(r["bytes_down"]) > 0),
        "comm_time": sum(float(r["t_down"]) + float(r["t_up"]) for r in upto),
        "total_time": sum(float(r["t_round"]) for r in upto),
        "mb": (summary["bytes_up_total"] + summary["bytes_down_total"]) / 1e6,
    }


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


def main(root: Path) -> None:
    print("| runs | method | seeds | rounds | final acc | best acc | final worst | converged at "
          "| comm. rounds | comm. time (s) | total time (s) | MB up+down (whole run) | "
          "paper: final acc, comm. rounds, comm. time, total time |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        groups: dict[str, list[Path]] = {}
        for run in sorted(folder.iterdir()):
            m = re.fullmatch(r"(.+)-seed(\d+)", run.name)
            if m and (run / "summary.json").is_file():
                groups.setdefault(m.group(1), []).append(run)
        results = {name: [one_run(d) for d in dirs] for name, dirs in groups.items()}
        ref = mean([r["total_time"] for r in results["dcpfl"]]) if "dcpfl" in results else None
        for name, runs in results.items():
            rounds = json.loads((groups[name][0] / "summary.json").read_text())["rounds"]
            total = mean([r["total_time"] for r in runs])
            ratio = f" (x {total / ref:.2f})" if ref else ""
            paper = PAPER.get(name)
            ptxt = "" if paper is None else ", ".join("-" if v is None else str(v) for v in paper)
            print(f"| {folder.name} | {name} | {len(runs)} | {rounds} | "
                  f"{100 * mean([r['final'] for r in runs]):.2f} | "
                  f"{100 * mean([r['best'] for r in runs]):.2f} | "
                  f"{100 * mean([r['worst'] for r in runs]):.2f} | "
                  f"{mean([r['converged'] for r in runs]):.0f} | "
                  f"{mean([r['comm_rounds'] for r in runs]):.0f} | "
                  f"{mean([r['comm_time'] for r in runs]):.0f} | {total:.0f}{ratio} | "
                  f"{mean([r['mb'] for r in runs]):.0f} | {ptxt} |")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/table2"))
