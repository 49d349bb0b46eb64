"""Collect the hierarchical Bayesian comparison (bench/papers/hier_table.sh) into one markdown table.

    python bench/papers/collect_hier.py runs/hier [bench/results/hier] > table.md

One row per method (mean ± std over the seeds found): personalized accuracy (each client's
model on its own test split: best round, final round, final spread across clients), the
global prediction where the method has one (hierbayes: the hierarchy's Monte Carlo
predictive and the posterior mean psi*; pfedbayes: the global distribution's predictive;
FedAvg and HierFAVG predict with their global model, so their personalized figure is it),
MB per link (client <-> its parent, edge <-> cloud), and simulated seconds per round and
in total (KAPC Table 4's links, counted FLOPs).
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grid"))  # grid_runs
from grid_runs import finished_runs  # noqa: E402


def pm(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "-"
    m = f"{scale * statistics.fmean(values):.{digits}f}"
    return m + (f" ± {scale * statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def label(run_name: str) -> str:
    name = run_name.replace("+topology.edges=2+topology.edge_rounds=2", " (2 edges, k2=2)")
    name = name.replace("+topology.edges=1+topology.edge_rounds=2", " flat (1 edge, k2=2)")
    name = name.replace("+topology.edge_rounds=1", "")  # a star's: no edges
    name = re.sub(r"\+topology\.edges=1(?!\d)", " flat (1 edge)", name)
    name = re.sub(r"\+topology\.edges=(\d+)", r" (K = \1 edges)", name)
    name = name.replace("+topology.mode=async", " async (extension beyond the paper)")
    name = name.replace("+personalize=cloud", ", fit under psi*")
    name = name.replace("+optimizer=adam+train.lr=0.001", ", Adam 0.001")
    name = name.replace("pfedbayes+optimizer=sgd+personal_lr=0.01+global_lr=0.01+train.local_epochs=2"
                        "+personalize=fit", "pfedbayes matched (SGD 0.01, 2 epochs, test-time fit)")
    name = name.replace("pfedbayes+train.local_epochs=2+personalize=fit",
                        "pfedbayes matched, Adam 0.001 (2 epochs, test-time fit)")
    return re.sub(r"^hierbayes$", "hierbayes (1 edge)", name)


def order(run_name: str) -> tuple:
    """Runs of one method together, K edges in numeric order (bench/papers/hier_fig3.sh)."""
    k = re.search(r"topology\.edges=(\d+)", run_name)
    return (re.sub(r"topology\.edges=\d+", "", run_name), int(k.group(1)) if k else 0)


def main(roots: list[Path]) -> None:
    grids = finished_runs(roots)
    many = len(grids) > 1  # bench/papers/hier_fig3.sh: one grid per data set and split
    print("| " + ("setting | " if many else "") + "method | seeds | best acc | final acc | "
          "final std | final worst | global best | global final | psi* best | psi* final | "
          "MB client links | MB edge-cloud | s per round | s total |")
    print("|" + "---|" * (15 if many else 14))
    for grid, runs in grids.items():
        for name in sorted(runs, key=order):
            folders = runs[name]
            s = [json.loads((f / "summary.json").read_text()) for f in folders]

            def col(key, scale=100.0, digits=2, s=s):
                return pm([x.get(key) for x in s], scale, digits)

            client_mb = [(x["bytes_up_client_total"] + x["bytes_down_client_total"]) / 1e6 for x in s]
            edge_mb = [(x["bytes_up_edge_total"] + x["bytes_down_edge_total"]) / 1e6 for x in s]
            per_round = [x["t_round_total"] / x["rounds"] for x in s]
            print(f"| {grid + ' | ' if many else ''}{label(name)} | {len(s)} | {col('acc_mean_best')} | {col('acc_mean_final')} | "
                  f"{col('acc_std_final')} | {col('acc_min_final')} | {col('acc_global_mean_best')} | "
                  f"{col('acc_global_mean_final')} | {col('acc_psi_mean_best')} | "
                  f"{col('acc_psi_mean_final')} | "
                  f"{pm(client_mb, 1, 1)} | {pm(edge_mb, 1, 1)} | {pm(per_round, 1, 1)} | "
                  f"{pm([x['t_round_total'] for x in s], 1, 0)} |")
    print()
    print("Accuracies in %; '-' where a method has no such prediction.")
    rescored(roots)


def rescored(roots: list[Path]) -> None:
    """The last round re-scored under another protocol (bench/papers/hier_reevaluate.sh:
    ROOT/reevaluated.jsonl), mean ± std over seeds."""
    rows: dict[tuple[str, str, str], dict[str, dict]] = {}
    for root in roots:
        path = root / "reevaluated.jsonl"
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            run = Path(r["run"])
            name = re.sub(r"-seed\d+$", "", run.name)
            # one figure per run and protocol: a run re-scored twice counts once (the last)
            rows.setdefault((run.parent.name, name, " ".join(r["settings"])), {})[run.name] = (
                r["reevaluated"])
    if not rows:
        return
    print()
    print("| setting | method | re-scored with | seeds | final acc | final worst |")
    print("|---|---|---|---|---|---|")
    for (grid, name, sets), by_run in sorted(rows.items(), key=lambda kv: (kv[0][0], order(kv[0][1]))):
        found = list(by_run.values())
        print(f"| {grid} | {label(name)} | {sets.replace('algorithm.', '')} | {len(found)} | "
              f"{pm([f['acc_mean'] for f in found])} | {pm([f['acc_min'] for f in found])} |")


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]] or [Path("runs/hier")])
