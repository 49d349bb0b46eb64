"""Where a round's time goes: cProfile of rounds after the first (which pays one-time
imports and kernel loading), the functions with the most cumulative time.

    python bench/speed/profile_round.py [--rounds 2] [--top 25] --set key=value ...

On a GPU the queue is synchronised after each round, so the time a kernel takes is
charged to the round it ran in (to whichever call waited for it).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import torch

from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="profiled rounds after the first")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--set", nargs="*", default=[], dest="sets")
    args = p.parse_args()
    cfg = build_config({}, [f"train.rounds={args.rounds + 1}",
                            f"eval.every={args.rounds + 2}", "output.plots=false", *args.sets])
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with tempfile.TemporaryDirectory() as out:
        sim = Simulation(cfg, Path(out), progress=False)
        t = time.perf_counter()
        sim.step()
        sync()
        print(f"round 1: {time.perf_counter() - t:.3f} s")
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(args.rounds):
            sim.step()
            sync()
        prof.disable()
        print(f"rounds 2-{args.rounds + 1}: {(time.perf_counter() - t) / args.rounds:.3f} s "
              f"a round (under the profiler)")
        sim.transport.close()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
