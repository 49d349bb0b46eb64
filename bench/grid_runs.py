"""Finished runs of a benchmark grid, merged over several roots.

A grid root holds ``<grid>/<run>-seed<k>/`` folders (bench/run_one.sh); kept runs from
earlier sessions (bench/keep_results.py) and new ones are read together, merged by grid
folder name; a run present in more than one root is taken from the first root.
"""

from __future__ import annotations

import json
import re
from pathlib import Path


def is_finished(run: Path) -> bool:
    """summary.json exists and covers the configured rounds, or says the run stopped early
    on its way there (train.early_stopping); a run being extended to more rounds,
    bench/extend.sh, still holds the summary of its shorter self."""
    try:
        summary = json.loads((run / "summary.json").read_text())
        config = json.loads((run / "config.json").read_text())
    except (OSError, ValueError):
        return False
    rounds = config.get("train", {}).get("rounds")
    return summary.get("rounds") == rounds or (
        bool(summary.get("stopped_early")) and summary.get("rounds_planned") == rounds)


def finished_runs(roots: list[Path]) -> dict[str, dict[str, list[Path]]]:
    """{grid folder: {run name without the seed: [run folders, one per seed]}}, sorted."""
    grids: dict[str, dict[str, Path]] = {}
    for root in roots:
        if not root.is_dir():
            raise SystemExit(f"no such results folder: {root}")
        for folder in (p for p in root.iterdir() if p.is_dir()):
            found = grids.setdefault(folder.name, {})
            for run in folder.iterdir():
                if is_finished(run):
                    found.setdefault(run.name, run)
    merged: dict[str, dict[str, list[Path]]] = {}
    for name in sorted(grids):
        runs = merged.setdefault(name, {})
        for run_name, run in sorted(grids[name].items()):
            m = re.fullmatch(r"(.+)-seed(\d+)", run_name)
            if m:
                runs.setdefault(m.group(1), []).append(run)
    return merged
