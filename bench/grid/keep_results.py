"""Copy the small text result files of finished benchmark runs into the repository.

    python bench/grid/keep_results.py runs/table1 bench/results/table1

Run folders (``<grid>/<run>/`` with a summary.json) keep config.json, summary.json,
metrics.csv, partition.json, system.json, federation.json, DC-PFL's grouping history
(dcpfl_groups.json) and HMPL's tiers (tiers.json). A KAPC run's relation cube is kept as text:
relation_self.json holds each layer's self-relation per client and its mean over clients
(the quantity of the paper's Fig. 7); checkpoints, tensors and plots stay behind. One
machine's finished runs are thereby kept for the next, which adds seeds or settings and
collects everything together:
``python bench/papers/collect_table1.py bench/results/table1 runs/table1``. Unfinished runs are
skipped; a kept run is replaced whole, never half-copied.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from grid_runs import is_finished

from edgepfl.io import read_tensors, write_json

KEEP = ("config.json", "summary.json", "metrics.csv", "partition.json", "system.json",
        "federation.json", "dcpfl_groups.json", "tiers.json")


def relation_summary(cube_file: Path) -> dict:
    """Per layer: r_ii^l of every client i and their mean, from relation_cube.safetensors."""
    tensors, meta = read_tensors(cube_file)
    self_rel = torch.diagonal(tensors["R"], dim1=0, dim2=2)  # [L, N]
    layers = meta.get("layers") or [str(i) for i in range(self_rel.shape[0])]
    return {"layers": layers,
            "self_relation_mean": [round(float(v), 6) for v in self_rel.mean(-1)],
            "self_relation": [[round(float(v), 6) for v in row] for row in self_rel]}


def keep(src_root: Path, dst_root: Path) -> int:
    kept = 0
    for summary in sorted(src_root.glob("*/*/summary.json")):
        run = summary.parent
        if not is_finished(run):
            continue
        dst = dst_root / run.parent.name / run.name
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in KEEP:
            if (run / name).is_file():
                shutil.copy2(run / name, tmp / name)
        if (run / "relation_cube.safetensors").is_file():
            write_json(tmp / "relation_self.json", relation_summary(run / "relation_cube.safetensors"))
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)
        kept += 1
    return kept


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"kept {keep(Path(sys.argv[1]), Path(sys.argv[2]))} finished runs in {sys.argv[2]}")
