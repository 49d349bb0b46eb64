"""How close DC-PFL's layers come to Eq. 6's low-discrepancy test under each reading of
"layer" and of the mean it is compared against, measured on a real run.

    python bench/papers/dcpfl_layer_readings.py [--set key=value ...]

Runs DC-PFL (defaults: Fashion-MNIST 10%, primary/secondary, 20 clients, lenet5, 30 rounds)
and, at every classification of Eq. 5-6 (every alpha*tau rounds, on the clients' fresh
uploads against their group's model), prints each unit's discrepancy over the mean of the
units for two readings: a layer as a module (weight and bias together) and as a tensor
(weight and bias apart, as a model's state_dict lists them).
"""

from __future__ import annotations

import sys

import torch
from click.testing import CliRunner

from edgepfl.algorithms import dcpfl
from edgepfl.cli import main

RECORDS: list[dict] = []
_orig = dcpfl.DCPFLServer._classify


def _model_scaled(rows: list[torch.Tensor]) -> torch.Tensor:
    """S of Eq. 3 over a whole model: one min and range for all its weights."""
    flat = torch.cat([r.flatten() for r in rows]).to(torch.float64)
    span = flat.max() - flat.min()
    return (flat - flat.min()) / (span if span > 0 else 1.0)


def _measure(self, labels):
    _orig(self, labels)
    params = self.ctx.layers.param_names
    for members in self._members(labels).values():
        if len(members) < 2:
            continue
        units = {"module": [self.ctx.layers.params_of(i) for i in range(len(self.ctx.layers))],
                 "tensor": [[p] for p in params]}
        for reading, groups in units.items():
            # S per unit (Eq. 5 as printed): each unit's own min and range
            disc = []
            for names in groups:
                w = (torch.cat([self.uploads.tensors[n][c].flatten() for n in names]) for c in members)
                g = torch.cat([self.group.tensors[n][members[0]].flatten() for n in names])
                disc.append(dcpfl.layer_discrepancy(w, g))
            mean = sum(disc) / len(disc)
            RECORDS.append({"round": self.phase_start, "reading": f"{reading}/S-unit/mean",
                            "size": len(members), "ratios": [d / mean for d in disc],
                            "names": ["+".join(n) for n in groups]})
            # S over the whole model (Eq. 3's), sliced per unit; D_g the model discrepancy
            # (every weight counted once) or the plain mean of the units
            g_s = _model_scaled([self.group.tensors[n][members[0]] for n in params])
            sums = torch.zeros(len(groups), dtype=torch.float64)
            for c in members:
                w_s = _model_scaled([self.uploads.tensors[n][c] for n in params])
                diff = (w_s - g_s).abs()
                off, per = 0, {}
                for n in params:
                    k = self.uploads.tensors[n][c].numel()
                    per[n] = diff[off:off + k]
                    off += k
                for u, names in enumerate(groups):
                    sums[u] += float(torch.cat([per[n] for n in names]).mean())
            disc = (sums / len(members)).tolist()
            dims = [sum(self.uploads.tensors[n][members[0]].numel() for n in names) for names in groups]
            model = sum(d * k for d, k in zip(disc, dims, strict=True)) / sum(dims)
            plain = sum(disc) / len(disc)
            RECORDS.append({"round": self.phase_start, "reading": f"{reading}/S-model/model",
                            "size": len(members), "ratios": [d / model for d in disc],
                            "names": ["+".join(n) for n in groups]})
            RECORDS.append({"round": self.phase_start, "reading": f"{reading}/S-model/mean",
                            "size": len(members), "ratios": [d / plain for d in disc],
                            "names": ["+".join(n) for n in groups]})


dcpfl.DCPFLServer._classify = _measure
defaults = ["algorithm.name=dcpfl", "dataset.name=fmnist", "dataset.fraction=0.1",
            "partition.scheme=primary_secondary", "partition.clients=20", "train.rounds=30",
            "model.name=lenet5"]
args = ["run", "--threads", "1", "--quiet"]
for kv in defaults + [a for a in sys.argv[1:] if a != "--set"]:
    args += ["--set", kv]
res = CliRunner().invoke(main, args, catch_exceptions=False)
names_done = set()
for r in RECORDS:
    if r["reading"] not in names_done:
        print(r["reading"], "units:", ", ".join(r["names"]))
        names_done.add(r["reading"])
    print(f"round {r['round']:3d} {r['reading']:20s} group of {r['size']:2d}: " +
          " ".join(f"{x:.3f}" for x in r["ratios"]) + f"   min {min(r['ratios']):.3f}")
