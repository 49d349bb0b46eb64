"""Copy the small result files of finished benchmark runs into the repository.

    python bench/keep_results.py runs/table1 bench/results/table1

Run folders (``<grid>/<run>/`` with a summary.json) keep config.json, summary.json,
metrics.csv, partition.json and system.json, plus relation_cube.safetensors and the relation heatmap
where a KAPC run wrote them; checkpoints and other plots stay behind. A session's finished runs are thereby
kept for the next, which adds seeds or settings and collects everything together:
``python bench/collect_table1.py bench/results/table1 runs/table1``. Unfinished runs are
skipped; a run already kept is overwritten only by a finished one.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

KEEP = ("config.json", "summary.json", "metrics.csv", "partition.json", "system.json",
        "relation_cube.safetensors")


def keep(src_root: Path, dst_root: Path) -> int:
    kept = 0
    for summary in sorted(src_root.glob("*/*/summary.json")):
        run = summary.parent
        dst = dst_root / run.parent.name / run.name
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in KEEP + tuple(p.name for p in run.glob("relation_client*.png")):
            if (run / name).is_file():
                shutil.copy2(run / name, tmp / name)
        shutil.rmtree(dst, ignore_errors=True)
        tmp.rename(dst)  # a kept run is whole or absent, never half-copied
        kept += 1
    return kept


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(f"kept {keep(Path(sys.argv[1]), Path(sys.argv[2]))} finished runs in {sys.argv[2]}")
