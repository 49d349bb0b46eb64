"""Does a kept run have the settings a grid line asks for? Exit 0 if so, 1 with the
differences if not (bench/grid/run_one.sh asks before it skips a run as kept).

    python bench/grid/kept_matches.py KEPT_RUN --set key=value [--set key=value ...]

A run is named by the settings its grid line gives; the rest are the defaults of the day
it ran. When a default has changed since, a kept run of the same name is another method,
and skipping the new run would put the old one in its place.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from grid_runs import settings_of

from edgepfl.config import build_config
from edgepfl.engine.parts import resolve
from edgepfl.engine.rundir import config_diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--set", action="append", default=[], dest="sets")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        asked = resolve(build_config({}, args.sets)).model_dump()
    stored = json.loads((args.run / "config.json").read_text())
    diff = config_diff(settings_of(stored), settings_of(asked))
    if stored.get("seed") != asked["seed"]:
        diff.append(f"seed: run has {stored.get('seed')!r}, given {asked['seed']!r}")
    rounds = asked["train"]["rounds"]
    if stored["train"]["rounds"] != rounds:
        diff.append(f"train.rounds: run has {stored['train']['rounds']!r}, given {rounds!r}")
    if diff:
        print(f"{args.run} is kept under this name but differs from what is asked:\n  "
              + "\n  ".join(diff), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
