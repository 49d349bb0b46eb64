"""Round-by-round figures of HMPL runs (or any runs) side by side, and HMPL's pace against a
reference run: the per-round tables of bench/papers/README.md's HMPL section.

    python bench/papers/hmpl_rounds.py RUN [RUN ...] [--pace REF] [--every K]

For every evaluated round (every K-th of them with --every), each run's clients' mean
accuracy / the Com, Ord and Sup tiers' means (runs with tiers) / the worst client, the
aggregated Ord model over every client's test split (hmpl's ``acc_global_weighted``; for
HMPL_S, FedAvg and FedProx, whose clients predict with the server's model, their weighted
accuracy; for other methods, nothing), and the round's training loss (the mean over the clients that
trained in it: one round's sample, so noisy).

``--pace REF`` adds, for each run and evaluated round r, the round at which REF's training
loss first came down to the run's loss at r (linearly between REF's rounds), and that
round's share of r: 0.75 says the run's loss at r is REF's at three quarters of r. A run
whose loss at r is above REF's at round 1 reads "< 1"; one below REF's lowest reads
"> R", R being REF's last round.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from itertools import pairwise
from pathlib import Path

from collect_hmpl import GLOBAL_ONLY


def read_metrics(run: Path) -> list[dict[str, float]]:
    """metrics.csv as numbers; an empty cell (a round without evaluation) is NaN."""
    path = run / "metrics.csv"
    if not path.is_file():
        raise SystemExit(f"{run}: no metrics.csv (is it a run folder?)")
    with path.open() as f:
        return [{k: float(v) if v not in ("", None) else math.nan for k, v in row.items()}
                for row in csv.DictReader(f)]


def pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{100 * value:.1f}"


def accuracy_cell(row: dict[str, float]) -> str:
    parts = [row.get("acc_mean")]
    if "acc_mean_com" in row:
        parts += [row.get(f"acc_mean_{t}") for t in ("com", "ord", "sup")]
    parts.append(row.get("acc_min"))
    return " / ".join(pct(p) for p in parts)


def equivalent_round(loss: float, reference: list[dict[str, float]]) -> str:
    """The round at which ``reference``'s training loss first reached ``loss``."""
    points = [(r["round"], r["train_loss"]) for r in reference if not math.isnan(r["train_loss"])]
    if not points or math.isnan(loss):
        return "-"
    if loss >= points[0][1]:
        return "< 1" if loss > points[0][1] else f"{points[0][0]:.0f}"
    for (r0, l0), (r1, l1) in pairwise(points):
        if l1 <= loss:
            return f"{r0 + (l0 - loss) / (l0 - l1) * (r1 - r0):.1f}"
    return f"> {points[-1][0]:.0f}"


def aggregated_column(run: Path) -> str:
    """The metrics column that holds the aggregated Ord model's accuracy for ``run``."""
    try:
        algorithm = json.loads((run / "config.json").read_text())["algorithm"]["name"]
    except (OSError, ValueError, KeyError):
        algorithm = None
    return "acc_weighted" if algorithm in GLOBAL_ONLY else "acc_global_weighted"


def label(run: Path) -> str:
    return f"{run.parent.name}/{run.name}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (with metrics.csv)")
    parser.add_argument("--pace", type=Path, help="reference run for the training-loss pace")
    parser.add_argument("--every", type=int, default=1,
                        help="show every K-th evaluated round (default 1: all)")
    args = parser.parse_args(argv)
    if args.every < 1:
        parser.error(f"--every = {args.every}; it must be a positive integer")
    metrics = {run: read_metrics(run) for run in args.runs}
    reference = read_metrics(args.pace) if args.pace else None
    evaluated = sorted({int(r["round"]) for rows in metrics.values() for r in rows
                        if not math.isnan(r.get("acc_mean", math.nan))})[args.every - 1::args.every]

    head = ["round"]
    for run, rows in metrics.items():
        tiers = "Com / Ord / Sup / " if rows and "acc_mean_com" in rows[0] else ""
        head += [f"{label(run)}: mean / {tiers}worst", "aggregated Ord model", "train loss"]
        if reference is not None and run != args.pace:
            head += [f"round of {label(args.pace)} at that loss (share)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for rnd in evaluated:
        cells = [str(rnd)]
        for run, rows in metrics.items():
            paced = reference is not None and run != args.pace
            row = next((r for r in rows if int(r["round"]) == rnd), None)
            if row is None:
                cells += ["-"] * (3 + paced)
                continue
            cells += [accuracy_cell(row), pct(row.get(aggregated_column(run))),
                      f"{row['train_loss']:.3f}"]
            if paced:
                eq = equivalent_round(row["train_loss"], reference)
                share = f" ({float(eq) / rnd:.2f})" if eq[0].isdigit() else ""
                cells.append(eq + share)
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
