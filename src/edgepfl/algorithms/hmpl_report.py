"""HMPL's report of its tiers (``tiers.json``, ``accuracy_tiers.png``), written after a run
from the server's records and the run's files; kept apart from the algorithm's server and
client (``edgepfl.algorithms.hmpl``)."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from edgepfl.io import read_json, write_json
from edgepfl.models.hmpl import SUP_MAX_DEPTH

TIER_NAMES = ("com", "ord", "sup")


def write_tiers(server: Any, out_dir: Path, plots: bool) -> None:
    """``tiers.json``: each client's tier, Sup depth, the round time that ranked it and
    its final accuracy, each tier's mean accuracy, and the thresholds. The accuracies
    are summary.json's ``acc_clients_final``, which a finished run writes first.
    ``accuracy_tiers.png``: metrics.csv's ``acc_mean_<tier>`` per evaluated round,
    beside all clients' mean and the aggregated Ord model's."""
    if server.reduced:
        return
    path = out_dir / "summary.json"
    summary = read_json(path) if path.exists() else {}
    acc = summary.get("acc_clients_final")
    if not isinstance(acc, list) or len(acc) != len(server.tiers):
        acc = [None] * len(server.tiers)
    acc = [a if isinstance(a, int | float) and math.isfinite(a) else None for a in acc]
    bound = server.bound() if server.thresholds is not None else None
    clients = []
    for c, (t, d, s, g, a) in enumerate(zip(server.tiers, server.depths, server.times,
                                            server.stopped, acc, strict=True)):
        row = {"client": c, "tier": t, "depth": d if t == "sup" else 0, "time_s": s,
               "growth_stopped": g}
        if t == "sup":
            # the stage it keeps and its time there, against the bound
            depth, time = server.kept(c)
            dropped = [k for k in range(d + 1, SUP_MAX_DEPTH + 1)
                       if server.sup_times[c][k - 1] is not None]
            row.update({"kept_depth": depth, "kept_time_s": time,
                        "within_bound": None if time is None or bound is None
                        else time <= bound,
                        "reverted_from": dropped[-1] if dropped else None})
        clients.append({**row, "acc_final": a})
    means = {}
    for tier in TIER_NAMES:  # a client not ranked (never timed) trained the Ord model
        mine = [r["acc_final"] for r in clients
                if (r["tier"] or "ord") == tier and r["acc_final"] is not None]
        means[tier] = sum(mine) / len(mine) if mine else None
    write_json(out_dir / "tiers.json", {
        "tier_ratio": server.hp.tier_ratio, "first_round": server.hp.first_round,
        "growth_bound": server.hp.growth_bound, "bound_s": bound,
        "growth_revert": server.hp.growth_revert, "thresholds": server.thresholds,
        "acc_final_mean": means, "costs": summary.get("tier_costs"), "clients": clients})
    rows = _read_metrics(out_dir / "metrics.csv")
    if plots and rows:
        from edgepfl.plotting import plot_accuracy_series
        series = {f"{t.capitalize()} clients": f"acc_mean_{t}" for t in TIER_NAMES}
        series.update({"all clients": "acc_mean", "aggregated Ord model": "acc_global_mean"})
        plot_accuracy_series(rows, series, out_dir / "accuracy_tiers.png",
                             "hmpl: personal models' accuracy per tier",
                             dashed=("all clients", "aggregated Ord model"))


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _read_metrics(path: Path) -> list[dict[str, float]]:
    """The run's metrics.csv as numbers (an empty cell is NaN); [] without one."""
    if not path.exists():
        return []
    def number(text: str | None) -> float:
        try:
            return float(text) if text else math.nan
        except ValueError:
            return math.nan

    with path.open(newline="") as f:
        return [{k: number(v) for k, v in row.items()} for row in csv.DictReader(f)]
