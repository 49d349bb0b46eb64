"""HMPL's server-side Sup model, from a finished run's checkpoint (the Fig. 6-7 ablation).

A Sup client predicts with the server's BS and CP layers and its own IP laterals. The run
reports that (client side, ``acc_mean``) and the Ord model of the server's BS layers
(``acc_global_mean``), which skips the CP layer every Sup client trained through. What the
server itself holds of the Sup model is the BS and CP layers: with the laterals at their
generation start (zero, ``algorithm.generation = preserve``) that model is the server's Sup
model, the one a client newly made Sup would start from. This script scores it on every
client's test split, and the Sup model with the laterals averaged over the Sup clients that
hold them (what averaging them, which the paper does not do, would give):

    python bench/papers/hmpl_server_side.py RUN [RUN ...]

Each run's last round, as JSON lines: the run's own figures evaluated again (they must
equal metrics.csv's last row: a check that the checkpoint is the run's), then
``laterals_zero`` and ``laterals_mean``. Clients of other tiers keep their models.
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

KEYS = ("acc_mean", "acc_std", "acc_min", "acc_mean_sup", "acc_global_mean")
LATERAL = "client/ip_lateral"


def with_laterals(tensors: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    """The checkpoint with every Sup client's laterals zero, or their mean over the clients
    that hold them (a present-mask per name says which do)."""
    out = dict(tensors)
    for name, value in tensors.items():
        if not name.startswith(LATERAL) or name.endswith(".__present__"):
            continue
        held = tensors[f"{name}.__present__"].bool()
        new = value.clone()
        if how == "zero":
            new[held] = 0
        else:
            new[held] = value[held].mean(0)
        out[name] = new
    return out


def evaluate(sim: Simulation, tensors: dict[str, torch.Tensor], meta: dict,
             how: str | None) -> dict[str, float]:
    sim.load_state(tensors if how is None else with_laterals(tensors, how), meta)
    figures = sim.evaluate()
    return {k: figures[k] for k in KEYS if k in figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for run in args.runs:
        summary = json.loads((run / "summary.json").read_text())
        tensors, meta = read_tensors(run / CHECKPOINT)
        if meta["round"] != summary["rounds"] or summary["algorithm"] != "hmpl":
            parser.error(f"{run}: not a finished hmpl run with its last round's checkpoint")
        cfg = build_config(json.loads((run / "config.json").read_text()), [])
        sim = Simulation(cfg, progress=False)
        last = {k: meta["metrics"][-1][k] for k in KEYS if k in meta["metrics"][-1]}
        again = evaluate(sim, tensors, meta, None)
        if any(abs(again[k] - last[k]) > 1e-9 for k in last if k in again):
            parser.error(f"{run}: evaluated again {again}, the run said {last}")
        row = {"run": str(run), "round": meta["round"], "as_run": again}
        for how in ("zero", "mean"):
            row[f"laterals_{how}"] = evaluate(sim, tensors, meta, how)
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
