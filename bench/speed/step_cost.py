"""Each algorithm's local training and whole round against FedAvg's, on PFLlib's MNIST
setting (20 clients, Dirichlet 0.1, batch 10, lr 0.005, 1 local epoch, every client's test
split evaluated each round), all in one process on one thread.

    python bench/speed/step_cost.py [--algorithms fedavg fedamp ...] [--fraction 0.3] [--rounds 2]
                                    [--repeats 1] [--set key=value ...]

The first round (it counts FLOPs and warms caches) is timed apart; then ``--rounds`` rounds
are timed, and within them the time the clients' updates took (``InProcess.train``).
Ratios are against FedAvg measured in the same run, and the first round's against the
later ones' mean (the goal: under 1.1x with FLOP counting on); record results in
bench/speed/README.md and bench/LOG.md. With ``--repeats N`` every algorithm runs N times from a fresh
simulation, the algorithms taking turns (so that a drifting load hits them alike), and
each figure is the median of the N runs, the first round's ratio the median of the runs'
ratios: one run's first round alone moves by 10% on a shared machine. The last column
counts the operators that ran under the FLOP counter (each one a dispatch through
Python, the first round's extra cost), which is exact where the times are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation


class CountedOps:
    """Operators that ran under the FLOP counter: what the first round's extra cost is made
    of (each costs a dispatch through Python), counted exactly where its time is noisy."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import _FlopCounterMode

        self.n = 0
        inner = _FlopCounterMode.__torch_dispatch__

        def dispatch(mode, *a, **kw):
            self.n += 1
            return inner(mode, *a, **kw)

        _FlopCounterMode.__torch_dispatch__ = dispatch

    def take(self) -> int:
        n, self.n = self.n, 0
        return n


OPS = CountedOps()


def measure(algorithm: str, args) -> tuple[float, float, float, float]:
    """(updates s, round s) of the first round, then the mean of the later rounds'; the
    operators under the counter in the first round and per later round go to ``OPS_SEEN``."""
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
    OPS.take()
    start = time.perf_counter()
    sim.step()
    first = spent[0], time.perf_counter() - start
    ops_first = OPS.take()
    spent[0] = 0.0
    start = time.perf_counter()
    for _ in range(args.rounds):
        sim.step()
    OPS_SEEN[algorithm] = (ops_first, OPS.take() / args.rounds)
    return (*first, spent[0] / args.rounds, (time.perf_counter() - start) / args.rounds)


OPS_SEEN: dict[str, tuple[int, float]] = {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", nargs="+",
                   default=["fedavg", "fedprox", "fedamp", "kapc", "dcpfl", "moon", "fedproto",
                            "pfedme", "local"])
    p.add_argument("--fraction", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--set", nargs="*", default=[], dest="sets",
                   help="further key=value settings (system.count_flops=false: no FLOP counting)")
    args = p.parse_args()
    torch.set_num_threads(1)
    names = ["fedavg", *[a for a in args.algorithms if a != "fedavg"]]
    runs: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            runs[name].append(measure(name, args))
            print(name, [round(v, 3) for v in runs[name][-1]], flush=True)
    rows = {n: (*(statistics.median(col) for col in zip(*r, strict=True)),
                statistics.median(rd1 / rd for _, rd1, _, rd in r)) for n, r in runs.items()}
    train0, round0 = rows["fedavg"][2:4]
    print(f"\n| algorithm | clients' updates s per round | vs FedAvg | whole round s | vs FedAvg "
          f"| first round s | first / later (median of {args.repeats}) "
          "| operators under the FLOP counter, first round / a later one |"
          "\n|---|---|---|---|---|---|---|---|")
    for name, (_tr1, rd1, tr, rd, first) in rows.items():
        ops1, ops = OPS_SEEN[name]
        print(f"| {name} | {tr:.2f} | {tr / train0:.2f}x | {rd:.2f} | {rd / round0:.2f}x "
              f"| {rd1:.2f} | {first:.2f}x | {ops1:,} / {ops:,.0f} |")


if __name__ == "__main__":
    main()
