"""Does today's code still give a kept run's figures? Its first rounds run again, compared.

A kept run (bench/results/...) was measured by the code of its day. When a fix is said to
leave such runs unchanged (a setting the run did not exercise), this checks it: the run's
own config.json (today's defaults filled in for settings added since) is run again for the
first ROUNDS rounds, and every metric column both runs have is compared round by round.

    python bench/grid/recheck.py bench/results/table2/fmnist-f0.2-r60-lr0.05/dcpfl-seed0 20

Prints one line per differing column (its first differing round, both values) and a last
line saying how many columns and rounds were compared; exits 1 if any differs beyond
--tol (default 0: bit for bit, as a run of the same seed on the same machine is).
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import tempfile
from pathlib import Path

from edgepfl.config import build_config
from edgepfl.engine.simulation import start_run
from edgepfl.io import read_json

# what a run measures about the machine it ran on, not about the computation
MACHINE = {"wall_s"}


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _same(a: str, b: str, tol: float) -> bool:
    if a == b:
        return True
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    if math.isnan(x) and math.isnan(y):
        return True
    # runs kept before metrics.csv held floats at full precision have 6 significant
    # digits: today's value is the same when it is written that way
    if f"{y:.6g}" == a or f"{x:.6g}" == b:
        return True
    return abs(x - y) <= tol * max(1.0, abs(x), abs(y))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished run's directory")
    parser.add_argument("rounds", type=int, help="how many of its first rounds to run again")
    parser.add_argument("--tol", type=float, default=0.0, help="relative tolerance (default 0)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    stored = read_json(args.run / "config.json")
    kept = _rows(args.run / "metrics.csv")
    if not 1 <= args.rounds <= len(kept):
        parser.error(f"rounds = {args.rounds}: the run has {len(kept)} rounds")
    cfg = build_config(stored, [f"train.rounds={args.rounds}"])
    with tempfile.TemporaryDirectory() as tmp:
        start_run(cfg, Path(tmp) / "run", progress=False)
        again = _rows(Path(tmp) / "run" / "metrics.csv")
    columns = [c for c in kept[0] if c in again[0] and c not in MACHINE]
    differing = 0
    for col in columns:
        for k in range(args.rounds):
            if not _same(kept[k][col], again[k][col], args.tol):
                differing += 1
                print(f"{col}: round {k + 1}: kept {kept[k][col]}, today {again[k][col]}")
                break
    left_out = sorted(set(kept[0]) ^ set(again[0]))
    print(f"{len(columns) - differing} of {len(columns)} metric columns equal over rounds "
          f"1-{args.rounds} (tol {args.tol}); not in both runs: {', '.join(left_out) or 'none'}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
