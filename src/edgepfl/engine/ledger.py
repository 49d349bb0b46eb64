"""A run's counters as one value, and the run's figures as plain functions of them.

``Ledger`` holds everything a run accumulates besides the algorithm's own state: the
round reached, the metric rows, bytes per client and per edge link, failures, each
client's best accuracy. It writes itself into a checkpoint's metadata and reads itself
back, checked. The summary and the papers' protocol figures are computed from
(metrics, ledger) alone, so a checkpoint or a finished run directory yields them too.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepfl.engine.transport import Delivery, Figures
from edgepfl.errors import EdgepflError
from edgepfl.federation.messages import Message
from edgepfl.system import COST_COLUMNS, FlopMeter
from edgepfl.system.cost import EdgeStep

LINK_COLUMNS = ["bytes_up_client", "bytes_down_client", "bytes_up_edge", "bytes_down_edge"]
METRIC_COLUMNS = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss",
                  "train_loss", "bytes_up", "bytes_down", "clients", "clients_failed", "wall_s",
                  *COST_COLUMNS, *LINK_COLUMNS]
VAL_BEST = ("val_all", "test_all", "val_selected", "test_selected")
NO_EVAL = {"acc_mean": math.nan, "acc_weighted": math.nan, "acc_std": math.nan,
           "acc_min": math.nan, "loss": math.nan, "acc_mean_selected": math.nan,
           "clients_diverged": math.nan}


@dataclass
class Ledger:
    """What a run has counted so far. Byte counts are per client (to and from its parent,
    edge or server) and per edge (to and from the cloud)."""

    num_clients: int
    num_edges: int
    server_state_bytes: int = 0
    round: int = 0
    metrics: list[dict] = field(default_factory=list)
    client_acc: list[float] = field(default_factory=list)
    bytes_up: np.ndarray = None  # type: ignore[assignment]
    bytes_down: np.ndarray = None  # type: ignore[assignment]
    edge_bytes_up: np.ndarray = None  # type: ignore[assignment]
    edge_bytes_down: np.ndarray = None  # type: ignore[assignment]
    wall_time: float = 0.0
    # each client's best accuracy so far, over every evaluated round and over the
    # evaluated rounds it was selected in (the papers' protocols, eval.statistic)
    client_best: list[float] = None  # type: ignore[assignment]
    client_best_selected: list[float] = None  # type: ignore[assignment]
    # each edge's mean edge-round time in its last period (None: not measured yet)
    edge_times: list[float | None] = None  # type: ignore[assignment]
    failures: np.ndarray = None  # type: ignore[assignment]  # client steps each client failed in
    failure_log: list[dict] = field(default_factory=list)  # round, step, client, reason
    # with eval.validation: each client's best validation accuracy so far and its test
    # accuracy in that round, over every evaluated round and over the rounds it was
    # selected in
    val_best: dict[str, list[float]] = field(default_factory=dict)
    # privacy.level = sample: each client's DP-SGD steps per sampling rate and its sample
    # count (edgepfl.privacy.per_round), JSON values
    privacy: dict[str, list] = field(default_factory=dict)
    # asynchronous edges: each edge's simulated work in hand beyond the periods elapsed
    # (edgepfl.engine.schedule.async_debt)
    edge_debt: list[float] = None  # type: ignore[assignment]
    # rounds in which at least one reply was aggregated (None: a checkpoint from before
    # they were counted, so unknown)
    rounds_aggregated: int | None = 0

    def __post_init__(self) -> None:
        n, e = self.num_clients, self.num_edges
        for name, size in (("bytes_up", n), ("bytes_down", n), ("failures", n),
                           ("edge_bytes_up", e), ("edge_bytes_down", e)):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(size, dtype=np.int64))
        for name in ("client_best", "client_best_selected"):
            if getattr(self, name) is None:
                setattr(self, name, [math.nan] * n)
        if self.edge_times is None:
            self.edge_times = [None] * e
        if self.edge_debt is None:
            self.edge_debt = [0.0] * e
        for name in VAL_BEST:
            self.val_best.setdefault(name, [math.nan] * n)

    # -- what a round adds ----------------------------------------------------------------
    def count_clients(self, down: Mapping[int, int], up: Mapping[int, int]) -> None:
        for cid, b in down.items():
            self.bytes_down[cid] += b
        for cid, b in up.items():
            self.bytes_up[cid] += b

    def count_edges(self, down: Mapping[int, int], up: Mapping[int, int]) -> None:
        for k, b in down.items():
            self.edge_bytes_down[k] += b
        for k, b in up.items():
            self.edge_bytes_up[k] += b

    def record_failures(self, rnd: int, step: object, reasons: Mapping[int, str]) -> None:
        for cid in sorted(reasons):
            self.failures[cid] += 1
            self.failure_log.append({"round": rnd, "step": str(step), "client": cid,
                                     "reason": reasons[cid]})

    def record_accuracy(self, accs: list[float], selected: list[int],
                        val_accs: list[float] | None = None) -> None:
        self.client_acc = accs
        for cid, acc in enumerate(accs):
            if not math.isnan(acc):
                self.client_best[cid] = _max(self.client_best[cid], acc)
                if cid in selected:
                    self.client_best_selected[cid] = _max(self.client_best_selected[cid], acc)
        for cid, (acc, val) in enumerate(zip(accs, val_accs or [], strict=False)):
            if math.isnan(acc) or math.isnan(val):
                continue
            for scope in ("all", "selected") if cid in selected else ("all",):
                best, at = self.val_best[f"val_{scope}"], self.val_best[f"test_{scope}"]
                if math.isnan(best[cid]) or val > best[cid]:  # the first best round keeps it
                    best[cid], at[cid] = val, acc

    def add_row(self, row: dict) -> None:
        self.wall_time += row["wall_s"]
        self.round = row["round"]
        self.metrics.append(row)

    # -- checkpoints ----------------------------------------------------------------------
    def to_meta(self) -> dict[str, Any]:
        """The counters as a checkpoint's JSON metadata."""
        return {"round": self.round, "metrics": self.metrics, "client_acc": self.client_acc,
                "bytes_up": self.bytes_up.tolist(), "bytes_down": self.bytes_down.tolist(),
                "edge_bytes_up": self.edge_bytes_up.tolist(),
                "edge_bytes_down": self.edge_bytes_down.tolist(),
                "wall_time_s": self.wall_time, "server_state_bytes": self.server_state_bytes,
                "client_best": _nulls(self.client_best),
                "edge_times": self.edge_times, "edge_debt": self.edge_debt,
                "failures": self.failures.tolist(),
                "failure_log": self.failure_log,
                "client_best_selected": _nulls(self.client_best_selected),
                "val_best": {k: _nulls(v) for k, v in self.val_best.items()},
                **({"privacy": self.privacy} if self.privacy else {}),
                **({} if self.rounds_aggregated is None
                   else {"rounds_aggregated": self.rounds_aggregated})}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], num_clients: int, num_edges: int,
                  server_state_bytes: int, path: Path) -> Ledger:
        """The counters ``to_meta`` wrote, for a federation of ``num_clients`` clients on
        ``num_edges`` edges; anything malformed is refused naming ``path``. Keys that a
        checkpoint from before they existed lacks start as a new run's."""
        n, edges = num_clients, num_edges
        try:
            rnd = int(meta["round"])
            metrics = [{k: (math.nan if v is None else v) for k, v in row.items()}
                       for row in meta["metrics"]]
            ledger = cls(
                n, edges, int(meta.get("server_state_bytes", server_state_bytes)), rnd, metrics,
                [math.nan if v is None else float(v) for v in meta["client_acc"]],
                np.array(meta["bytes_up"], dtype=np.int64),
                np.array(meta["bytes_down"], dtype=np.int64),
                np.array(meta.get("edge_bytes_up", []), dtype=np.int64).reshape(-1),
                np.array(meta.get("edge_bytes_down", []), dtype=np.int64).reshape(-1),
                float(meta["wall_time_s"]),
                [math.nan if v is None else float(v) for v in meta.get("client_best", [None] * n)],
                [math.nan if v is None else float(v)
                 for v in meta.get("client_best_selected", [None] * n)],
                [None if t is None else float(t) for t in meta.get("edge_times", [None] * edges)],
                np.asarray(meta.get("failures", [0] * n), dtype=np.int64),
                list(meta.get("failure_log", [])),
                {k: [math.nan if v is None else float(v) for v in meta["val_best"][k]]
                 for k in VAL_BEST if k in meta.get("val_best", {})},
                dict(meta.get("privacy", {})),
                [float(v) for v in meta.get("edge_debt", [0.0] * edges)],
                meta.get("rounds_aggregated"))
            if ledger.rounds_aggregated is not None and (
                    isinstance(ledger.rounds_aggregated, bool)
                    or not isinstance(ledger.rounds_aggregated, int)
                    or not 0 <= ledger.rounds_aggregated <= rnd):
                raise ValueError(f"rounds_aggregated = {ledger.rounds_aggregated!r} of {rnd} "
                                 "rounds")
            if len(metrics) != rnd or ledger.bytes_up.shape != (n,) or \
                    ledger.bytes_down.shape != (n,) or ledger.edge_bytes_up.shape != (edges,) or \
                    ledger.edge_bytes_down.shape != (edges,) or \
                    ledger.failures.shape != (n,) or len(ledger.edge_times) != edges or \
                    len(ledger.edge_debt) != edges or \
                    not all(math.isfinite(d) and d >= 0 for d in ledger.edge_debt) or \
                    not all(_failure_entry(e, n) for e in ledger.failure_log) or \
                    any(len(v) != n for v in ledger.val_best.values()) or \
                    any(len(v) != n for v in ledger.privacy.values()):
                raise ValueError(f"round {rnd}, {len(metrics)} metric rows, byte counts for "
                                 f"{ledger.bytes_up.shape} / {ledger.bytes_down.shape} clients "
                                 f"and {ledger.edge_bytes_up.shape} / "
                                 f"{ledger.edge_bytes_down.shape} edges, failure counts for "
                                 f"{ledger.failures.shape} clients, or a failure log entry "
                                 "not of the form a run writes")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EdgepflError(f"{path} is not a valid edgepfl checkpoint: its metadata is "
                               f"malformed ({type(exc).__name__}: {exc})") from None
        return ledger


def _failure_entry(entry: Any, num_clients: int) -> bool:
    """One ``failure_log`` entry as ``record_failures`` writes it."""
    return (isinstance(entry, dict) and set(entry) == {"round", "step", "client", "reason"}
            and isinstance(entry["round"], int) and isinstance(entry["client"], int)
            and 0 <= entry["client"] < num_clients
            and isinstance(entry["step"], str) and isinstance(entry["reason"], str))


# -- figures ------------------------------------------------------------------------------
def metric_columns(metrics: list[dict], base: list[str] = METRIC_COLUMNS) -> list[str]:
    """``base`` and then every other key the rows have (an algorithm's own figures)."""
    return base + list(dict.fromkeys(k for row in metrics for k in row if k not in base))


def accuracy_row(accs: list[float], losses: list[float], test_sizes: np.ndarray) -> dict:
    """A round's evaluation figures from every client's accuracy and mean loss (NaN for a
    client without test samples): unweighted mean, weighted mean, spread, worst."""
    acc = np.array(accs)
    ok = ~np.isnan(acc)
    if not ok.any():  # nobody could be evaluated (every evaluation failed)
        return {"acc_mean": math.nan, "acc_weighted": math.nan, "acc_std": math.nan,
                "acc_min": math.nan, "loss": math.nan}
    return {"acc_mean": float(acc[ok].mean()),
            "acc_weighted": float(np.average(acc[ok], weights=test_sizes[ok])),
            "acc_std": float(acc[ok].std()),
            "acc_min": float(acc[ok].min()),
            "loss": _nanmean(losses)}


def _nanmean(values: list[float]) -> float:
    """``np.nanmean``, NaN without numpy's warning where every value is NaN."""
    v = np.asarray(values, dtype=float)
    return math.nan if np.isnan(v).all() else float(np.nanmean(v))


def diverged(accs: list[float], losses: list[float]) -> list[int]:
    """The clients evaluated (an accuracy) whose test loss is not finite: a model whose
    weights blew up. Their accuracy counts in ``acc_mean``; ``loss`` (a mean of finite
    values) leaves them out, so this is where they show."""
    return [c for c, (a, v) in enumerate(zip(accs, losses, strict=True))
            if not math.isnan(a) and not math.isfinite(v)]


def mean_over(accs: list[float], clients: list[int]) -> float:
    """The mean accuracy of ``clients`` (those evaluated)."""
    chosen = [accs[c] for c in clients if not math.isnan(accs[c])]
    return float(np.mean(chosen)) if chosen else math.nan


def named_rows(figures: list[Figures], counts: np.ndarray) -> dict:
    """The ``acc_<name>_*`` figures of every extra named prediction (``Client.predictive``);
    a client without one (an algorithm's per-tier figure) is left out of it."""
    row = {}
    names = list(dict.fromkeys(k for f in figures for k in f.extra))
    for name in names:
        got = [f.extra.get(name, (math.nan, math.nan)) for f in figures]
        extra = accuracy_row([c / f.count if f.count else math.nan
                              for (c, _), f in zip(got, figures, strict=True)],
                             [v / f.count if f.count else math.nan
                              for (_, v), f in zip(got, figures, strict=True)],
                             counts)
        row.update({f"acc_{name}_{k[4:]}" if k.startswith("acc_") else f"{k}_{name}": v
                    for k, v in extra.items()})
    return row


def validation_row(figures: list[Figures], selected: list[int]) -> tuple[dict, list[float]]:
    """The ``val_*`` figures of a round (``eval.validation``) and each client's validation
    accuracy (NaN without validation samples)."""
    val = [f.val or (0, 0, math.nan) for f in figures]
    accs = [c / n if n else math.nan for c, n, _ in val]
    row = {f"val_{k}": v for k, v in accuracy_row(
        accs, [loss / n if n else math.nan for _, n, loss in val],
        np.array([n for _, n, _ in val])).items()}
    row["val_acc_mean_selected"] = mean_over(accs, selected)
    return row, accs


def accuracy_summary(metrics: list[dict], client_acc: list[float]) -> dict:
    """Best round (the papers' figure), final round and its spread, from evaluated rows."""
    evaluated = [r for r in metrics if not math.isnan(r["acc_mean"])]
    best = max(evaluated, key=lambda r: r["acc_mean"]) if evaluated else None
    final = evaluated[-1] if evaluated else None
    return {
        "acc_mean_best": best["acc_mean"] if best else None,
        "best_round": best["round"] if best else None,
        "acc_mean_final": final["acc_mean"] if final else None,
        "acc_weighted_final": final["acc_weighted"] if final else None,
        "acc_std_final": final["acc_std"] if final else None,
        "acc_min_final": final["acc_min"] if final else None,
        "clients_diverged_final": int(final.get("clients_diverged", 0)) if final else None,
        "final_round": final["round"] if final else None,
        "acc_clients_final": client_acc,
    }


def named_summary(metrics: list[dict]) -> dict:
    """Best and final figures of every extra named prediction (``acc_global_mean``...)."""
    out = {}
    names = [k[len("acc_"):-len("_mean")] for k in (metrics[-1] if metrics else {})
             if k.startswith("acc_") and k.endswith("_mean")]
    for name in names:
        rows = [r for r in metrics if not math.isnan(r.get(f"acc_{name}_mean", math.nan))]
        if rows:
            best = max(rows, key=lambda r: r[f"acc_{name}_mean"])
            out.update({f"acc_{name}_mean_best": best[f"acc_{name}_mean"],
                        f"{name}_best_round": best["round"],
                        f"acc_{name}_mean_final": rows[-1][f"acc_{name}_mean"],
                        f"acc_{name}_weighted_final": rows[-1][f"acc_{name}_weighted"],
                        f"acc_{name}_std_final": rows[-1][f"acc_{name}_std"]})
    return out


def new_client_summary(metrics: list[dict], held_out: tuple[int, ...], refused: str) -> dict:
    """The held-out clients (``eval.new_clients``) and, beside ``named_summary``'s
    ``acc_new_mean_best`` / ``_final``, the worst one's final accuracy; ``refused``: why
    the method cannot serve a new client (its figures are then absent)."""
    if not held_out:
        return {}
    rows = [r for r in metrics if not math.isnan(r.get("acc_new_mean", math.nan))]
    return {"new_clients": list(held_out),
            "acc_new_min_final": rows[-1]["acc_new_min"] if rows else None,
            "new_clients_refused": refused or None}


def protocol_summary(ledger: Ledger, statistic: str, clients: str,
                     validation: bool = False) -> dict:
    """The papers' protocols beside ours: each client's own best round averaged, and the
    mean over each round's selected clients; ``protocol`` is the figure that
    ``eval.statistic`` and ``eval.clients`` name (ours: best round, all clients). With
    ``validation`` every round (a run's, or a client's own) is picked on validation and
    ``protocol`` is the test figure of the picked rounds, so no choice sees the test set."""
    def mean(values: list[float]) -> float | None:
        ok = [v for v in values if not math.isnan(v)]
        return float(np.mean(ok)) if ok else None

    metrics = ledger.metrics
    rows = [r for r in metrics if not math.isnan(r.get("acc_mean_selected", math.nan))]
    figures = {
        ("best_round", "all"): max((r["acc_mean"] for r in metrics
                                    if not math.isnan(r["acc_mean"])), default=None),
        ("best_round", "selected"): max((r["acc_mean_selected"] for r in rows), default=None),
        ("client_best", "all"): mean(ledger.client_best),
        ("client_best", "selected"): mean(ledger.client_best_selected),
    }
    out = {"acc_client_best_mean": figures["client_best", "all"],
           "acc_mean_selected_best": figures["best_round", "selected"],
           "acc_client_best_selected_mean": figures["client_best", "selected"]}
    if validation:
        figures = {
            ("best_round", "all"): _at_best(metrics, "val_acc_mean", "acc_mean"),
            ("best_round", "selected"): _at_best(metrics, "val_acc_mean_selected",
                                                 "acc_mean_selected"),
            ("client_best", "all"): mean(ledger.val_best["test_all"]),
            ("client_best", "selected"): mean(ledger.val_best["test_selected"]),
        }
        out.update({"acc_client_at_val_best_mean": figures["client_best", "all"],
                    "acc_mean_selected_at_val_best": figures["best_round", "selected"],
                    "acc_client_at_val_best_selected_mean": figures["client_best", "selected"]})
    out["protocol"] = {"statistic": statistic, "clients": clients,
                       "selection": "validation" if validation else "test",
                       "acc": figures[statistic, clients]}
    return out


def validation_summary(metrics: list[dict]) -> dict:
    """The round with the best mean validation accuracy, and the test figures of that
    round: what a run reports when no choice may look at the test set."""
    rows = [r for r in metrics if not math.isnan(r.get("val_acc_mean", math.nan))]
    if not rows:
        return {}
    best = max(rows, key=lambda r: r["val_acc_mean"])
    return {"val_acc_mean_best": best["val_acc_mean"], "val_best_round": best["round"],
            "acc_mean_at_val_best": best["acc_mean"], "acc_std_at_val_best": best["acc_std"],
            "acc_min_at_val_best": best["acc_min"],
            "val_acc_mean_final": rows[-1]["val_acc_mean"]}


def _at_best(metrics: list[dict], select: str, report: str) -> float | None:
    """``report`` in the first row whose ``select`` is highest."""
    rows = [r for r in metrics if not math.isnan(r.get(select, math.nan))]
    return max(rows, key=lambda r: r[select])[report] if rows else None


def stop_summary(rounds_planned: int, stop: dict | None) -> dict:
    return {"rounds_planned": rounds_planned,
            "stopped_early": stop is not None,
            "stopped_round": stop["round"] if stop else None,
            "stop_reason": stop["reason"] if stop else None}


def traffic_summary(ledger: Ledger) -> dict:
    """Bytes over the run: in all, per client link and per edge link, and failures."""
    up, down = ledger.bytes_up, ledger.bytes_down
    e_up, e_down = ledger.edge_bytes_up, ledger.edge_bytes_down
    return {
        "bytes_up_total": int(up.sum() + e_up.sum()),
        "bytes_down_total": int(down.sum() + e_down.sum()),
        "bytes_up_per_client": up.tolist(),
        "bytes_down_per_client": down.tolist(),
        "bytes_up_client_total": int(up.sum()),
        "bytes_down_client_total": int(down.sum()),
        "bytes_up_edge_total": int(e_up.sum()),
        "bytes_down_edge_total": int(e_down.sum()),
        "bytes_up_per_edge": e_up.tolist(),
        "bytes_down_per_edge": e_down.tolist(),
    }


def _max(a: float, b: float) -> float:
    return b if math.isnan(a) else max(a, b)


def _nulls(values: list[float]) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values]


class EdgeBook:
    """The accounts of one hierarchical round, kept beside its protocol: the FLOPs of the
    cloud's and each edge's work, the bytes on every client link and backhaul, and each
    edge's steps as the system model prices them (``EdgeStep``). An edge's work counts
    towards the edge step it precedes (receiving the cloud's model: its first), its
    report towards its last."""

    def __init__(self, meter: FlopMeter, counting: bool, ledger: Ledger, edges: range):
        self.meter, self.counting, self.ledger = meter, counting, ledger
        self.cloud_flops = 0
        self.pending = dict.fromkeys(edges, 0)  # an edge's FLOPs not yet in one of its steps
        self.steps: dict[int, list[EdgeStep]] = {k: [] for k in edges}
        self.backhaul_down: dict[int, int] = {}
        self.backhaul_up: dict[int, int] = {}
        self.client_down = self.client_up = self.failed = self.replied = 0

    @contextmanager
    def cloud(self) -> Iterator[None]:
        with self.meter.measure() as f:
            yield
        self.cloud_flops += f.flops or 0

    @contextmanager
    def edge(self, k: int) -> Iterator[None]:
        with self.meter.measure() as f:
            yield
        self.pending[k] += f.flops or 0

    def sent_to_edges(self, down: Mapping[int, Message]) -> None:
        self.backhaul_down = {k: m.nbytes for k, m in down.items()}

    def delivered(self, delivery: Delivery) -> None:
        self.failed += len(delivery.failed)
        self.replied += len(delivery.arrived)

    def edge_step(self, k: int, clients: list[int], down: Mapping[int, Message],
                  delivery: Delivery) -> None:
        """Edge ``k``'s step over its ``clients``, once it has aggregated their replies."""
        sent_down = delivery.bytes_down(down, clients)
        sent_up = delivery.bytes_up(clients)
        self.ledger.count_clients(sent_down, sent_up)
        self.client_down += sum(sent_down.values())
        self.client_up += sum(sent_up.values())
        received = [c for c in clients if c in delivery.replies]
        flops = self.pending[k]
        self.pending[k] = 0
        self.steps[k].append(EdgeStep(
            received, sent_down, delivery.priced_up(received),
            delivery.flops(received) if self.counting else None,
            flops if self.counting else None,
            {c: v for c, v in delivery.slowdown.items() if c in received},
            delivery.late & set(received), delivery.deadline))

    def reported(self, k: int, report: Message, sent: bool = True) -> None:
        """Edge ``k``'s report to the cloud; ``sent`` False: the cloud holds it already (a
        busy edge's last upload), so no bytes cross the backhaul."""
        self.backhaul_up[k] = report.nbytes if sent else 0
        flops, self.pending[k] = self.pending[k], 0
        if self.counting and self.steps[k]:
            last = self.steps[k][-1]
            last.flops_edge = (last.flops_edge or 0) + flops

    def close(self) -> None:
        """The backhaul's bytes into the ledger, once every edge has reported."""
        self.ledger.count_edges(self.backhaul_down, self.backhaul_up)

    def row(self, rnd: int, clients: int) -> dict:
        e_up, e_down = sum(self.backhaul_up.values()), sum(self.backhaul_down.values())
        return {"round": rnd, "bytes_up": self.client_up + e_up,
                "bytes_down": self.client_down + e_down,
                "clients": clients, "clients_failed": self.failed,
                "bytes_up_client": self.client_up, "bytes_down_client": self.client_down,
                "bytes_up_edge": e_up, "bytes_down_edge": e_down}
