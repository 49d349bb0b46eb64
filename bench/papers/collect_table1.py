"""Collect Table 1 runs (bench/papers/kapc_table1.sh, edgepfl compare) into one markdown table.

    python bench/papers/collect_table1.py runs/table1 > table.md
    python bench/papers/collect_table1.py bench/results/table1 runs/table1 > table.md
    python bench/papers/collect_table1.py --methods bench/results/table1p bench/results/ablation

Several roots are merged by grid folder name (bench/grid/grid_runs.py): runs kept from earlier
machines (bench/grid/keep_results.py) and new ones are collected together.

One row per (folder, run name): best and final mean accuracy (mean ± std over the seeds found),
final std and worst client, each client's own best round averaged (the paper's protocol for
Local and FedAvg; runs kept before it was recorded show '-'), MB up/down, BLS layer counts where recorded, and the paper's
Table 1 value for the same data set and alpha where it has one.

``--methods`` prints one compact table per grid folder instead, with runs grouped by what
they ran in today's terms (``grid_runs.method_label``: ``kapc`` is today's default lambda
whatever the run was named, ``kapc+lam=1.0`` the paper's), both protocols' statistics, the
spread across clients and each seed's figure.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grid"))  # grid_runs
from grid_runs import finished_runs, runs_by_method, unnamed_settings  # noqa: E402

# KAPC journal paper, Table 1 (10 clients, best mean accuracy, %)
PAPER = {
    ("mnist", "0.1"): {"local": 95.91, "fedavg": 60.06, "fedprox": 97.93, "fedamp": 97.10,
                       "moon": 97.77, "fedbabu": 92.69, "fedbn": 83.99, "pfedla": 97.80,
                       "kapc": 97.97, "kapc_bls": 98.00},
    ("mnist", "0.3"): {"local": 93.13, "fedavg": 64.78, "fedprox": 95.19, "fedamp": 95.45,
                       "moon": 97.43, "fedbabu": 90.39, "fedbn": 95.16, "pfedla": 96.35,
                       "kapc": 97.66, "kapc_bls": 96.83},
    ("fmnist", "0.1"): {"local": 88.33, "fedavg": 57.85, "fedprox": 96.24, "fedamp": 94.43,
                        "moon": 96.61, "fedbabu": 93.66, "fedbn": 75.14, "pfedla": 91.23,
                        "kapc": 96.71, "kapc_bls": 96.57},
    ("fmnist", "0.3"): {"local": 84.77, "fedavg": 76.47, "fedprox": 87.81, "fedamp": 84.28,
                        "moon": 86.77, "fedbabu": 85.54, "fedbn": 82.96, "pfedla": 85.74,
                        "kapc": 88.04, "kapc_bls": 88.78},
}


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def pm(values: list[float], scale: float = 100.0) -> str:
    """Mean over seeds, with the standard deviation across seeds when there are several."""
    m = f"{scale * mean(values):.2f}"
    return m + (f" ± {scale * statistics.stdev(values):.2f}" if len(values) > 1 else "")


def column_mean(rows: list[dict], col: str) -> str:
    vals = [float(r[col]) for r in rows if r.get(col)]
    return f"{mean(vals):.2f}" if vals else "-"


def client_best(sums: list[dict]) -> str:
    """KAPC's protocol for Local and FedAvg: each client's own best round, averaged ('-' for
    runs kept from before summaries recorded it)."""
    values = [s["acc_client_best_mean"] for s in sums if s.get("acc_client_best_mean") is not None]
    return pm(values) if len(values) == len(sums) else "-"


def main(roots: list[Path]) -> None:
    print("| runs | algorithm | seeds | rounds | best mean acc | final mean acc | final std | "
          "final worst | each client's best | MB up | MB down | layers up / down | paper (best) "
          "| ours - paper |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in finished_runs(roots).items():
        for label, dirs in runs.items():
            sums = [json.loads((d / "summary.json").read_text()) for d in dirs]
            cfg = json.loads((dirs[0] / "config.json").read_text())
            key = (cfg["dataset"]["name"], str(cfg["partition"]["alpha"]))
            layers = ""
            rows = []  # every seed's rounds: the layer counts are a mean over all of them
            for d in dirs:
                with open(d / "metrics.csv") as f:
                    rows += list(csv.DictReader(f))
            if rows and "layers_up_mean" in rows[0]:
                layers = f"{column_mean(rows, 'layers_up_mean')} / " \
                         f"{column_mean(rows, 'layers_down_mean')}"
            algo = cfg["algorithm"]["name"]
            paper = PAPER.get(key, {}).get(algo)  # variants are compared with their method
            if (cfg["partition"]["clients"], cfg["dataset"]["fraction"]) != (10, 0.1) or \
                    cfg["partition"].get("scheme", "dirichlet") != "dirichlet":
                # Table 1 is the 10-client, 10%-of-the-data Dirichlet scenario only (an IID
                # run's config still carries the default alpha)
                paper = None
            # a setting the run's name does not say, e.g. FedAvg's evaluate=local, or a
            # default that has changed since the run was made
            label += unnamed_settings(cfg, label)
            best = 100 * mean([s["acc_mean_best"] for s in sums])
            print(f"| {name} | {label} | {len(sums)} | {sums[0]['rounds']} | "
                  f"{pm([s['acc_mean_best'] for s in sums])} | "
                  f"{pm([s['acc_mean_final'] for s in sums])} | "
                  f"{100 * mean([s['acc_std_final'] for s in sums]):.2f} | "
                  f"{100 * mean([s['acc_min_final'] for s in sums]):.2f} | "
                  f"{client_best(sums)} | "
                  f"{mean([s['bytes_up_total'] for s in sums]) / 1e6:.1f} | "
                  f"{mean([s['bytes_down_total'] for s in sums]) / 1e6:.1f} | {layers} | "
                  f"{'' if paper is None else f'{paper:.2f}'} | "
                  f"{'' if paper is None else f'{best - paper:+.2f}'} |")


ORDER = ["kapc", "kapc_bls", "local", "fedavg", "fedprox", "fedamp"]


def by_method(roots: list[Path]) -> None:
    for grid, methods in runs_by_method(roots).items():
        all_seeds = sorted({seed for seeds in methods.values() for seed in seeds})
        print(f"\n{grid}\n")
        print("| algorithm | seeds | best round of the mean (ours) | final round | each client's "
              "best (paper's) | final std / worst client | best of the mean per seed "
              f"{' / '.join(map(str, all_seeds))} | paper |")
        print("|---|---|---|---|---|---|---|---|")

        def order(label: str) -> tuple:
            algo = label.split("+")[0]
            return (ORDER.index(algo) if algo in ORDER else len(ORDER), algo, len(label), label)

        for label in sorted(methods, key=order):
            seeds = methods[label]
            sums = [json.loads((d / "summary.json").read_text()) for d in seeds.values()]
            cfg = json.loads((next(iter(seeds.values())) / "config.json").read_text())
            paper = PAPER.get((cfg["dataset"]["name"], str(cfg["partition"]["alpha"])), {}) \
                .get(cfg["algorithm"]["name"])
            per_seed = {seed: 100 * s["acc_mean_best"] for seed, s in zip(seeds, sums, strict=True)}
            print(f"| {label} | {','.join(map(str, seeds))} | "
                  f"{pm([s['acc_mean_best'] for s in sums])} | "
                  f"{pm([s['acc_mean_final'] for s in sums])} | {client_best(sums)} | "
                  f"{100 * mean([s['acc_std_final'] for s in sums]):.2f} / "
                  f"{100 * mean([s['acc_min_final'] for s in sums]):.2f} | "
                  + " / ".join(f"{per_seed[k]:.2f}" if k in per_seed else "-" for k in all_seeds)
                  + f" | {'' if paper is None else f'{paper:.2f}'} |")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--methods"]:
        by_method([Path(a) for a in args[1:]] or [Path("runs/table1")])
    else:
        main([Path(a) for a in args] or [Path("runs/table1")])
