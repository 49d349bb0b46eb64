"""Each algorithm's round against FedAvg's at equal local work, on the CPU, eager and with
``train.compile``: the per-algorithm table of issue 43.

PFLlib's MNIST setting (20 clients, Dirichlet 0.1, batch 10, lr 0.005, one local epoch,
``cnn2``; HMPL on its own ``hmpl_tiers``, hierarchical algorithms with two edges), a small
share of MNIST, one torch thread, FLOP counting off (it only books work). Every algorithm
runs in a fresh simulation: an untimed first round (set-up, compiling), then ``--rounds``
timed rounds without evaluation, then one evaluation of every client's test split, timed
apart. With ``--repeats N`` the algorithms take turns N times (a drifting load hits them
alike) and each figure is the median. Times are the process's CPU time, which other jobs
on a shared machine do not inflate, and wall-clock beside it.

    python bench/speed/algorithm_rounds.py [--fraction 0.05] [--rounds 1] [--repeats 2]
        [--algorithms fedavg ...] [--compiled fedavg fedprox ...] [--mode default]
        [--set key=value ...]

``--compiled``: the algorithms also run with ``train.compile=<--mode>``, their round
compared with eager FedAvg's. Record results in bench/speed/README.md and bench/LOG.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgepfl.algorithms import ALGORITHMS
from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation

PLAIN_FIT = ["fedavg", "fedprox", "local", "kapc", "dcpfl", "fedamp", "clusterfl", "fedper"]


def settings(name: str, args) -> list[str]:
    algo = ALGORITHMS[name]
    extra = ["topology.edges=2"] if algo.edge is not None else []
    if name.startswith("hmpl"):  # it runs on HMPL's models only
        extra.append("model.name=hmpl_tiers")
    return [f"algorithm.name={name}", "dataset.name=mnist", f"dataset.fraction={args.fraction}",
            "partition.clients=20", "partition.scheme=dirichlet", "partition.alpha=0.1",
            "train.batch_size=10", "train.lr=0.005", "train.local_epochs=1",
            f"train.rounds={args.rounds + 1}", "train.device=cpu", "eval.every=100000",
            "output.plots=false", "system.count_flops=false", *extra, *args.sets]


def measure(name: str, args, compile_mode: str | None) -> tuple[float, float, float, float]:
    """(round CPU s, round wall s, evaluation CPU s, first round wall s)."""
    cfg = build_config({}, settings(name, args) + (
        [f"train.compile={compile_mode}"] if compile_mode else []))
    sim = Simulation(cfg, progress=False)
    for trainer in sim.parts.trainers.values():  # until the engine hands train.compile on itself
        trainer.compile = cfg.train.compile
    t0 = time.perf_counter()
    sim.step()
    first = time.perf_counter() - t0
    c0, t0 = time.process_time(), time.perf_counter()
    for _ in range(args.rounds):
        sim.step()
    cpu, wall = (time.process_time() - c0) / args.rounds, (time.perf_counter() - t0) / args.rounds
    c0 = time.process_time()
    sim.evaluate()
    return cpu, wall, time.process_time() - c0, first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS))
    p.add_argument("--compiled", nargs="*", default=PLAIN_FIT)
    p.add_argument("--mode", default="default", help="train.compile's mode for --compiled")
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], dest="sets")
    args = p.parse_args()
    torch.set_num_threads(1)
    names = ["fedavg", *[a for a in args.algorithms if a != "fedavg"]]
    runs: list[tuple[str, str | None]] = [(n, None) for n in names]
    runs += [(n, args.mode) for n in names if n in args.compiled]
    got: dict[tuple[str, str | None], list[tuple[float, float, float, float]]] = {r: [] for r in runs}
    for _ in range(args.repeats):
        for name, mode in runs:
            try:
                got[(name, mode)].append(measure(name, args, mode))
            except Exception as exc:  # noqa: BLE001 - a row says why it is missing
                print(f"{name} ({mode or 'eager'}): {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            print(name, mode or "eager", [round(v, 3) for v in got[(name, mode)][-1]], flush=True)
    med = {r: tuple(statistics.median(c) for c in zip(*v, strict=True)) for r, v in got.items() if v}
    cpu0, wall0 = med[("fedavg", None)][:2]
    print(f"\n| algorithm | model | round, CPU s | vs FedAvg | round, wall s | vs FedAvg, wall "
          f"| compiled ({args.mode}), CPU s | vs eager FedAvg | evaluation, CPU s |"
          "\n|---|---|---|---|---|---|---|---|---|")
    for name in names:
        if (name, None) not in med:
            print(f"| {name} | - | failed | | | | | | |")
            continue
        cpu, wall, ev, _ = med[(name, None)]
        comp = med.get((name, args.mode))
        cc = f"{comp[0]:.2f} | {comp[0] / cpu0:.2f}x" if comp else "- | -"
        model = "hmpl_tiers" if name.startswith("hmpl") else "cnn2"
        print(f"| {name} | {model} | {cpu:.2f} | {cpu / cpu0:.2f}x | {wall:.2f} | {wall / wall0:.2f}x "
              f"| {cc} | {ev:.2f} |")


if __name__ == "__main__":
    main()
