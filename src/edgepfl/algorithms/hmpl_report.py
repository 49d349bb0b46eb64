"""What HMPL reports of its tiers, apart from its protocol (``edgepfl.algorithms.hmpl``):
``TierReports``, the server's observer side (per-tier bytes, clients, times and accuracy in
metrics.csv, the tiers' summary figures), and ``tiers.json`` / ``accuracy_tiers.png``,
written after a run from the server's records and the run's files."""

from __future__ import annotations

import csv
import math
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import torch

from edgepfl.contract.algorithm import Reporter, ServerContext
from edgepfl.io import read_json, write_json
from edgepfl.models.hmpl_nets import SUP_MAX_DEPTH
from edgepfl.models.hmpl_tiers import COM, ORD, stage_model, tier_module, tier_name, tier_params
from edgepfl.models.step_memory import training_step_bytes

TIER_NAMES = ("com", "ord", "sup")
BYTE_COLUMNS = tuple(f"bytes_{d}_{t}" for d in ("up", "down") for t in TIER_NAMES)
# per round, per tier, over the clients that trained their tier's model: how many, their
# mean round time (s) and mean counted local-training FLOPs
COST_COLUMNS = tuple(f"{k}_{t}" for t in TIER_NAMES for k in ("trained", "time", "flops"))


class TierReports(Reporter):
    """HMPL's server as an observer: what it reports of its tiers each round and at the
    end. Reads the server's records (tiers, depths, the round's bytes per tier, costs)."""

    reduced: ClassVar[bool]
    hp: Any
    ctx: ServerContext
    dims: tuple[int, int]
    tiers: list[str | None]
    depths: list[int]
    thresholds: dict[str, float] | None
    _bytes: dict[str, int]
    _costs: dict[str, float]
    _trained_depth: int

    def kept(self, cid: int) -> tuple[int | None, float | None]:
        raise NotImplementedError  # the server's: a Sup client's kept stage and its time

    def round_metrics(self) -> dict[str, float]:
        if self.reduced:
            return {}
        counts = {f"clients_{t}": 0 for t in TIER_NAMES}
        for tier in self.tiers:  # a client not ranked yet trains the Ord model
            counts[f"clients_{tier or 'ord'}"] += 1
        costs = self._costs or tier_costs({}, None, self.tiers, {})
        return {**self._bytes, **counts, "sup_depth_max": self.sup_depth_max(),
                "sup_depth_trained": self._trained_depth, **costs}

    def sup_depth_max(self) -> int:
        """The deepest stage a Sup client is told to hold next (0: no Sup client); one
        above what it trained where it grew in its last round (``sup_depth_trained`` is the
        deepest stage a reply was trained on)."""
        return max((d for t, d in zip(self.tiers, self.depths, strict=True) if t == "sup"),
                   default=0)

    def evaluation_metrics(self, rnd: int, client_acc: list[float]) -> dict[str, float]:
        """``acc_mean_com``, ``acc_mean_ord``, ``acc_mean_sup``: the unweighted mean
        accuracy over the clients the server has put in each tier (one not ranked yet
        counts as Ord, as ``clients_ord`` counts it); NaN for a tier without an evaluated
        client (before the ranking, Com and Sup)."""
        if self.reduced:
            return {}
        out = {}
        for tier in TIER_NAMES:
            mine = [a for a, t in zip(client_acc, self.tiers, strict=True)
                    if (t or "ord") == tier and not math.isnan(a)]
            out[f"acc_mean_{tier}"] = sum(mine) / len(mine) if mine else math.nan
        return out

    def summary_figures(self, metrics: list[dict]) -> dict[str, Any]:
        if self.reduced:
            return {}
        out: dict[str, Any] = {f"{k}_total": int(sum(r.get(k, 0) for r in metrics))
                               for k in BYTE_COLUMNS}
        out["tiers"] = {t: sum(1 for x in self.tiers if (x or "ord") == t) for t in TIER_NAMES}
        out["tier_thresholds"] = self.thresholds
        # each tier's mean accuracy in the last evaluated round (None: no client in it)
        last: dict[str, Any] = next((r for r in reversed(metrics) if "acc_mean_ord" in r
                     and not math.isnan(r.get("acc_mean", math.nan))), {})
        out["acc_mean_tier_final"] = {t: _finite(last.get(f"acc_mean_{t}")) for t in TIER_NAMES}
        out["tier_costs"] = self.tier_summary(metrics)
        return out

    def tier_summary(self, metrics: list[dict]) -> dict[str, dict[str, Any]]:
        """Per tier, over the run: client-rounds trained on the tier's model, their mean round
        time and counted FLOPs (None where none was timed or counted), and what one SGD step
        of the tier's model holds (weights, gradients, saved activations) on a batch of
        ``train.batch_size`` whole images; a Sup model at the deepest stage a client trained
        (runs from before ``sup_depth_trained``: the deepest it was told to hold)."""
        out: dict[str, dict[str, Any]] = {}
        trained = [r["sup_depth_trained"] for r in metrics if "sup_depth_trained" in r]
        sup = max(trained, default=0) if trained else self.sup_depth_max()
        kept = [d for d, _ in map(self.kept, range(len(self.tiers))) if d is not None]
        if self.hp.growth_revert and kept:
            sup = max(kept)  # a reverted model's dropped stage is not the model it keeps
        for tier, stage in (("com", COM), ("ord", ORD), ("sup", max(sup, 1))):
            n = sum(r.get(f"trained_{tier}", 0) for r in metrics)
            figures: dict[str, Any] = {"client_rounds": n, "stage_model": stage_model(stage)}
            for key in ("time", "flops"):
                rows = [(r[f"trained_{tier}"], r[f"{key}_{tier}"]) for r in metrics
                        if r.get(f"trained_{tier}") and math.isfinite(r.get(f"{key}_{tier}", math.nan))]
                total = sum(k for k, _ in rows)
                figures[f"{key}_mean"] = sum(k * v for k, v in rows) / total if total else None
            figures["params"] = sum(v.numel() for v in tier_params(stage, self.dims).values())
            if self.ctx.input_shape is not None:
                figures["step_memory_bytes"] = step_memory(stage, self.ctx.input_shape,
                                                           self.dims[1], self.ctx.train.batch_size)
            out[tier] = figures
        return out

    def write_artifacts(self, out_dir: Path, plots: bool) -> None:
        write_tiers(self, out_dir, plots)


def tier_costs(times: dict[int, float], flops: dict[int, int] | None,
               tiers: list[str | None], sent: dict[int, int]) -> dict[str, float]:
    """One round's ``COST_COLUMNS``: per tier, the timed clients that trained their own
    tier's model (not a ranked client's round-1 Ord model), their mean time and FLOPs
    (NaN: none; FLOPs NaN where not counted, as on Flower)."""
    out: dict[str, float] = {}
    for tier in TIER_NAMES:
        mine = [c for c in sorted(times)
                if tiers[c] == tier and tier_name(sent.get(c, ORD)) == tier]
        out[f"trained_{tier}"] = len(mine)
        out[f"time_{tier}"] = sum(times[c] for c in mine) / len(mine) if mine else math.nan
        out[f"flops_{tier}"] = (sum(flops[c] for c in mine) / len(mine)
                                if mine and flops is not None and all(c in flops for c in mine)
                                else math.nan)
    return out


@cache
def step_memory(stage: int, input_shape: tuple[int, int, int], classes: int,
                batch: int) -> dict[str, int]:
    """``models.step_memory.training_step_bytes`` of the tier model of ``stage``."""
    with torch.random.fork_rng(devices=[]):  # the run's generator is left as it was
        model = tier_module(stage, input_shape[0], classes)
    return training_step_bytes(model, input_shape, batch)


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
