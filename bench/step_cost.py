"""Each algorithm's local training and whole round against FedAvg's, on PFLlib's MNIST
setting (20 clients, Dirichlet 0.1, batch 10, lr 0.005, 1 local epoch, every client's test
split evaluated each round), all in one process on one thread.

    python bench/step_cost.py [--algorithms fedavg fedamp ...] [--fraction 0.3] [--rounds 2]
                              [--set key=value ...]

The first round (it counts FLOPs and warms caches) is timed apart; then ``--rounds`` rounds
are timed, and within them the time the clients' updates took (``InProcess.train``).
Ratios are against FedAvg measured in the same run, and the first round's against the
later ones' mean (issue 21: under 1.1x with FLOP counting on); record results in
bench/README.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation


def measure(algorithm: str, args) -> tuple[float, float, float, float]:
    """(updates s, round s) of the first round, then the mean of the later rounds'."""
    cfg = build_config({}, [f"algorithm.name={algorithm}", "dataset.name=mnist",
                            f"dataset.fraction={args.fraction}", "partition.clients=20",
                            "partition.scheme=dirichlet", "partition.alpha=0.1",
                            "train.batch_size=10", "train.lr=0.005", "train.local_epochs=1",
                            f"train.rounds={args.rounds + 1}", "model.name=cnn2",
                            "train.device=cpu", "output.plots=false", *args.sets])
    sim = Simulation(cfg, progress=False)
    spent = [0.0]
    train = sim.transport.train

    def timed(step, messages):
        start = time.perf_counter()
        out = train(step, messages)
        spent[0] += time.perf_counter() - start
        return out

    sim.transport.train = timed
    start = time.perf_counter()
    sim.step()
    first = spent[0], time.perf_counter() - start
    spent[0] = 0.0
    start = time.perf_counter()
    for _ in range(args.rounds):
        sim.step()
    return (*first, spent[0] / args.rounds, (time.perf_counter() - start) / args.rounds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", nargs="+",
                   default=["fedavg", "fedprox", "fedamp", "kapc", "dcpfl", "moon", "fedproto",
                            "pfedme", "local"])
    p.add_argument("--fraction", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--set", nargs="*", default=[], dest="sets",
                   help="further key=value settings (system.count_flops=false: no FLOP counting)")
    args = p.parse_args()
    torch.set_num_threads(1)
    names = ["fedavg", *[a for a in args.algorithms if a != "fedavg"]]
    rows = {}
    for name in names:
        rows[name] = measure(name, args)
        print(name, [round(v, 3) for v in rows[name]], flush=True)
    train0, round0 = rows["fedavg"][2:]
    print("\n| algorithm | clients' updates s per round | vs FedAvg | whole round s | vs FedAvg "
          "| first round s | first / later |\n|---|---|---|---|---|---|---|")
    for name, (_tr1, rd1, tr, rd) in rows.items():
        print(f"| {name} | {tr:.2f} | {tr / train0:.2f}x | {rd:.2f} | {rd / round0:.2f}x "
              f"| {rd1:.2f} | {rd1 / rd:.2f}x |")


if __name__ == "__main__":
    main()
