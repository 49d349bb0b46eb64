"""A finished run's last round evaluated again under another evaluation protocol.

Some algorithms predict either with the shared model or with each client's own, locally
trained one (``algorithm.evaluate``: global / local for FedAvg, FedProx and MOON, local /
aggregate for pFedLA); hierbayes and pfedbayes fit and sample at test time
(``personalize``, ``personal_epochs``, ``mc_samples``, hierbayes' ``global_level``). The
choice changes nothing in training, and the clients' and
server's state at the last round is in the run's checkpoint, so the other protocol's
figure for the last round can be had without training again. Best-over-rounds figures
cannot: they would need the state of every round.

    python bench/grid/reevaluate.py RUN_DIR --set algorithm.evaluate=local

Prints the run's own last-round figures and the re-evaluated ones as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from edgepfl.config import build_config
from edgepfl.engine.simulation import CHECKPOINT, Simulation
from edgepfl.io import read_tensors

# settings read only when a client is scored: hierbayes' and pfedbayes' test-time fits
# and Monte Carlo draws are evaluation, not training
EVALUATION_ONLY = {"algorithm.evaluate", "algorithm.finetune_epochs", "algorithm.personalize",
                   "algorithm.personal_epochs", "algorithm.mc_samples", "algorithm.global_level"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--set", action="append", default=[], dest="sets",
                        help=f"an evaluation-only setting: {', '.join(sorted(EVALUATION_ONLY))}")
    args = parser.parse_args()
    torch.set_num_threads(1)  # like the grid's runs: two side by side beat one on two threads
    for kv in args.sets:
        if kv.split("=", 1)[0] not in EVALUATION_ONLY:
            parser.error(f"--set {kv}: only {', '.join(sorted(EVALUATION_ONLY))} may change; "
                         "anything else would change the training the checkpoint holds")
    summary = json.loads((args.run / "summary.json").read_text())
    tensors, meta = read_tensors(args.run / CHECKPOINT)
    if meta["round"] != summary["rounds"]:
        parser.error(f"{args.run}: the checkpoint is at round {meta['round']}, "
                     f"the run has {summary['rounds']}")
    cfg = build_config(json.loads((args.run / "config.json").read_text()), args.sets)
    sim = Simulation(cfg, progress=False)
    sim.load_state(tensors, meta)  # not load_checkpoint: it refuses the changed evaluation setting
    try:
        again = sim.evaluate()
    except KeyError as exc:
        parser.error(f"{args.run}: its checkpoint lacks what {' '.join(args.sets)} predicts "
                     f"with ({exc}); the run kept no such state (FedAvg keeps local models "
                     "only when run with evaluate=local)")
    last = meta["metrics"][-1]
    keys = ["acc_mean", "acc_std", "acc_min", "acc_global_mean", "acc_psi_mean"]
    print(json.dumps({"run": str(args.run), "round": meta["round"],
                      "as_run": {k: last[k] for k in keys if k in last}}))
    print(json.dumps({"run": str(args.run), "round": meta["round"], "settings": args.sets,
                      "reevaluated": {k: v for k, v in again.items() if k in keys}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
