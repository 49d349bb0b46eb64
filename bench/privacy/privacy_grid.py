"""Accuracy against privacy: FedAvg and two personalized methods on Fashion-MNIST at
epsilon 1, 4 and 8 and without privacy, at client level (DP-FedAvg) and at sample level
(DP-SGD), over seeds.

For every (algorithm, level, epsilon, seed) the noise multiplier is calibrated, with
dp-accounting's ``calibrate_dp_mechanism`` over the engine's own accounting
(``edgepfl.privacy.accountant``), to the smallest that keeps the run's planned epsilon
(after ``--rounds``) within the target at delta = 1 / clients (client level) or 1 / each
client's samples (sample level; the largest client epsilon is held to the target, from
each client's seeded selections and its Poisson steps). The run then carries
``privacy.target_epsilon`` too, so the engine stops it rather than pass the budget.

    EDGEPFL_DATA=/work/shared/data .venv/bin/python bench/privacy/privacy_grid.py \\
        --out /tmp/privacy_grid            # the full grid (see README.md)

writes one run directory per point and seed under ``--out``, ``grid.csv`` with one row
per run and ``table.md`` with the mean and sample std over seeds of the final round's mean
client accuracy (and the epsilon reached).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
from pathlib import Path

import torch

from edgepfl.config import build_config
from edgepfl.engine.parts import Parts, load_federation, resolve
from edgepfl.engine.simulation import Simulation
from edgepfl.federation.rng import select_clients
from edgepfl.privacy.accountant import calibrate, client_epsilon, sample_epsilon
from edgepfl.privacy.dpsgd import poisson_plan


def settings(args: argparse.Namespace, algorithm: str, seed: int) -> list[str]:
    extra = [kv.split(":", 1)[1] for kv in args.algo_set if kv.split(":", 1)[0] == algorithm]
    return [f"algorithm.name={algorithm}", "dataset.name=fmnist",
            f"dataset.fraction={args.fraction}", f"partition.clients={args.clients}",
            f"partition.alpha={args.alpha}", f"train.rounds={args.rounds}",
            f"train.local_epochs={args.local_epochs}", f"train.lr={args.lr}",
            f"train.batch_size={args.batch_size}", f"train.participation={args.participation}",
            f"seed={seed}", "output.plots=false", "system.count_flops=false", *extra]


def planned_epsilon(over: list[str], level: str):
    """noise multiplier -> the run's epsilon after its planned rounds."""
    cfg = resolve(build_config({}, over))
    rounds, share, n = cfg.train.rounds, cfg.train.participation, cfg.partition.clients
    if level == "client":
        groups = ((n, len(select_clients(0, 1, n, share))),)
        return lambda noise: client_epsilon(groups, noise, 1, rounds, 1.0 / n)
    dataset, partition = load_federation(cfg)
    parts = Parts.build(cfg, dataset, partition.num_clients)
    fed = parts.federation
    declared = parts.algorithm.privacy.epochs
    epochs = cfg.train.local_epochs if declared is None else declared(cfg.train, parts.hp)
    times = [0] * n
    for r in range(1, rounds + 1):
        for c in fed.select(cfg.seed, r, share):
            times[c] += fed.edge_rounds
    plans = []
    for c in range(n):
        size = int(partition.train[c].numel())
        rate, steps = poisson_plan(size, cfg.train.batch_size, epochs)
        plans.append((((rate, steps * times[c]),), 1.0 / size))
    return lambda noise: max(sample_epsilon(ev, noise, delta) for ev, delta in plans)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--algorithms", nargs="+", default=["fedavg", "fedper", "fedbabu"])
    ap.add_argument("--levels", nargs="+", default=["client", "sample"])
    ap.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 4.0, 8.0])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--fraction", type=float, default=1.0)
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--participation", type=float, default=0.1)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--client-clip", default="0.3",
                    help="privacy.clip at client level (the L2 bound of a model update), or "
                    "adaptive (Andrew et al. 2021)")
    ap.add_argument("--count-stddev", type=float, default=1.0,
                    help="with --client-clip adaptive: privacy.clip_count_stddev in multiples "
                    "of the calibrated noise multiplier (1: the update's noise is raised by "
                    "(1 - 1/4)^-1/2, 15%%)")
    ap.add_argument("--sample-clip", type=float, default=1.0,
                    help="privacy.clip at sample level (the L2 bound of a sample's gradient)")
    ap.add_argument("--algo-set", action="append", default=[], metavar="ALGO:KEY=VALUE",
                    help="a setting for one algorithm's runs, e.g. "
                    "fedbabu:algorithm.finetune_epochs=1")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    points = [(a, "none", math.inf) for a in args.algorithms] + [
        (a, level, eps) for a in args.algorithms for level in args.levels
        for eps in args.epsilons]
    for algorithm, level, eps in points:
        for seed in args.seeds:
            over = settings(args, algorithm, seed)
            name = f"{algorithm}-{level}" + ("" if level == "none" else f"-eps{eps:g}")
            run_dir = args.out / name / f"seed{seed}"
            summary_file = run_dir / "summary.json"
            if summary_file.exists():  # a grid that was interrupted goes on where it stopped
                summary = json.loads(summary_file.read_text())
            else:
                if level != "none":
                    t0 = time.perf_counter()
                    noise = calibrate(planned_epsilon(over, level), eps)
                    clip = args.client_clip if level == "client" else args.sample_clip
                    over += [f"privacy.level={level}", f"privacy.noise_multiplier={noise}",
                             f"privacy.clip={clip}", f"privacy.target_epsilon={eps}"]
                    if clip == "adaptive":
                        over.append(f"privacy.clip_count_stddev={args.count_stddev * noise}")
                    print(f"{name} seed {seed}: noise {noise:.4g} "
                          f"({time.perf_counter() - t0:.0f} s to calibrate)", flush=True)
                t0 = time.perf_counter()
                summary = Simulation(build_config({}, over), run_dir, progress=False).run().summary
                print(f"  {name} seed {seed}: accuracy {summary['acc_mean_final']:.4f}, epsilon "
                      f"{summary.get('epsilon', math.inf)}, {time.perf_counter() - t0:.0f} s",
                      flush=True)
            rows.append({"algorithm": algorithm, "level": level, "target_epsilon": eps,
                         "seed": seed,
                         "noise_multiplier": summary.get("privacy", {}).get("noise_multiplier",
                                                                            math.nan),
                         "epsilon": summary.get("epsilon", math.inf),
                         "rounds": summary["rounds"],
                         "acc_mean_final": summary["acc_mean_final"],
                         "acc_mean_best": summary["acc_mean_best"]})
    with (args.out / "grid.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    table = table_of(rows, args)
    (args.out / "table.md").write_text(table)
    print(table)


def table_of(rows: list[dict], args: argparse.Namespace) -> str:
    def cell(algorithm: str, level: str, eps: float) -> str:
        got = [r for r in rows if r["algorithm"] == algorithm and r["level"] == level
               and r["target_epsilon"] == eps]
        if not got:
            return "-"
        accs = [100 * r["acc_mean_final"] for r in got]
        spread = f" ± {statistics.stdev(accs):.1f}" if len(accs) > 1 else ""
        if level == "none":
            return f"{statistics.mean(accs):.1f}{spread}"
        noise = statistics.mean(r["noise_multiplier"] for r in got)
        reached = max(r["epsilon"] for r in got)
        return f"{statistics.mean(accs):.1f}{spread} (σ {noise:.2f}, ε {reached:.2f})"

    head = ["algorithm", "no privacy"] + [f"{level} ε={eps:g}" for level in args.levels
                                          for eps in args.epsilons]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for a in args.algorithms:
        cells = [a, cell(a, "none", math.inf)] + [cell(a, level, eps) for level in args.levels
                                                  for eps in args.epsilons]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
