"""The engine's observers of a round's record (``engine.record``): the simulated system
costs, the run's health (diverged clients, a run that trained nothing), evaluation and
the run's summary. Each reads what ``Rounds.play`` recorded; none changes the protocol.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl import __version__
from edgepfl.engine.ledger import (
    Ledger,
    accuracy_row,
    accuracy_summary,
    diverged,
    mean_over,
    named_rows,
    named_summary,
    new_client_summary,
    protocol_summary,
    stop_summary,
    traffic_summary,
    validation_row,
    validation_summary,
)
from edgepfl.engine.record import RoundRecord
from edgepfl.engine.schedule import async_debt
from edgepfl.engine.transport import Delivery, Figures, NothingTrained
from edgepfl.federation.messages import Message
from edgepfl.federation.topology import CLOUD
from edgepfl.system import SystemModel, cost_totals, host_info

if TYPE_CHECKING:
    from edgepfl.engine.rounds import Rounds

log = logging.getLogger("edgepfl")
# a round's training loss this many times a uniform guess's cross-entropy, log(classes),
# or not finite, is taken as a diverged client: an initial classifier is near log(classes)
# and training that works lowers it (regularizers add little on top)
DIVERGED = 10.0


# -- system costs ---------------------------------------------------------------------------
def round_costs(system: SystemModel | None, record: RoundRecord, ledger: Ledger,
                edge_rounds: int) -> dict:
    """The round's simulated costs (``system``: none without a system model). In an
    asynchronous hierarchy also each edge's speed (its mean edge-round time this period)
    and work in hand, the next plan's inputs, into ``ledger``."""
    if system is None:
        return {}
    if record.book is None:
        d, counting = record.delivery, record.counting
        assert d is not None
        received = sorted(d.replies)
        return system.round_costs(received, record.bytes_down, d.priced_up(received),
                                  d.flops(received) if counting else None,
                                  record.server_flops, d.slowdown, d.late, d.deadline)
    book, plan = record.book, record.plan
    costs = system.hierarchical_costs(
        {k: st for k, st in book.steps.items() if st}, book.backhaul_down, book.backhaul_up,
        book.cloud_flops if record.counting else None)
    if plan is None:  # synchronous
        return costs
    for k in (k for k in range(len(plan)) if plan[k] > 0):
        times = [system.round_costs(st.selected, st.bytes_down, st.bytes_up, st.flops_client,
                                    0, st.slowdown, st.late, st.deadline)["t_round"]
                 for st in book.steps[k]]
        if times:
            ledger.edge_times[k] = float(np.mean(times))
    ledger.edge_debt = async_debt(ledger.edge_times, edge_rounds, plan, ledger.edge_debt)
    return costs


# -- failures and the run's health -------------------------------------------------------------------------
def log_failures(ledger: Ledger, rnd: int, step: object, delivery: Delivery) -> None:
    """Every client of a client step that failed, with why, into ``ledger`` (failures.csv);
    a lost or refused reply said at once (a drop or a late one is the fault model's)."""
    reasons = {**dict.fromkeys(delivery.dropped, "dropped (faults.drop_rate)"),
               **dict.fromkeys(delivery.late, f"late (past faults.deadline = "
                                              f"{delivery.deadline} s)"),
               **{c: f"no reply: {r}" for c, r in delivery.lost.items()},
               **{c: f"rejected: {r}" for c, r in delivery.rejected.items()}}
    ledger.record_failures(rnd, step, reasons)
    for cid in sorted(reasons):
        if cid in delivery.lost or cid in delivery.rejected:
            log.warning("round %d: client %d failed: %s", rnd, cid, reasons[cid])


class Health:
    """What a run says once of its clients' training going wrong (a diverged loss, NaN or
    Inf replies, a model whose test loss is not finite), and its refusal to report a run
    that never aggregated a reply."""

    def __init__(self, num_classes: int):
        self.guess = math.log(max(num_classes, 2))  # a uniform guess's cross-entropy
        self.divergence_warned = self.nonfinite_warned = False

    def observe(self, record: RoundRecord, loss: float) -> None:
        if record.losses and not (math.isfinite(loss) and loss <= DIVERGED * self.guess):
            self._once(f"round {record.round}: training loss {loss:.4g}, over {DIVERGED:g} "
                       f"times a uniform guess's {self.guess:.3g}: a client's local training "
                       "has diverged (lower train.lr, or check the data)")
        if record.nonfinite:  # their clients diverged, though no loss reached train_loss
            self._once(f"round {record.round}: {record.nonfinite} of the {record.asked} "
                       "replies asked for had NaN or Inf values and were rejected: those "
                       "clients' local training has diverged (lower train.lr, or check the data)")

    def _once(self, message: str) -> None:
        if not self.divergence_warned:
            self.divergence_warned = True
            log.warning("%s", message)

    def evaluated(self, rnd: int, accs: list[float], losses: list[float]) -> float:
        """The number of clients whose model's test loss is not finite; said once a run."""
        blown = diverged(accs, losses)
        if blown and not self.nonfinite_warned:
            self.nonfinite_warned = True
            log.warning("round %d: %d client(s) hold a model whose test loss is not finite "
                        "(clients %s%s): their accuracy counts in acc_mean, their loss is left "
                        "out of `loss`; metrics.csv counts them in clients_diverged", rnd,
                        len(blown), ", ".join(map(str, blown[:8])),
                        ", ..." if len(blown) > 8 else "")
        return float(len(blown))

    @staticmethod
    def note(record: RoundRecord | None) -> str:
        """What the progress line says of a round beside its figures: that it aggregated
        nothing (every reply asked for failed or was rejected)."""
        if record is None or record.aggregated or not record.asked:
            return ""
        return f"nothing aggregated: all {record.asked} replies failed"

    @staticmethod
    def check_trained(ledger: Ledger) -> None:
        """Refuse to report a run in which no reply was ever aggregated: its model is the
        untrained initial one, and its figures would read as a result (``NothingTrained``,
        with the reasons the clients failed)."""
        if ledger.round == 0 or ledger.rounds_aggregated != 0:
            return
        reasons: dict[str, int] = {}
        example: dict[str, str] = {}
        for entry in ledger.failure_log:
            reason = entry["reason"]
            kind = ("rejected: NaN or Inf values" if "NaN or Inf" in reason
                    else reason.split(":")[0] if reason.startswith(("no reply", "rejected"))
                    else reason)
            reasons[kind] = reasons.get(kind, 0) + 1
            example.setdefault(kind, f"client {entry['client']}: {reason}")
        told = "; ".join(
            f"{n} {kind}" + (f" (first, {example[kind]})" if kind in ("no reply", "rejected")
                             else "")
            for kind, n in sorted(reasons.items(), key=lambda kv: -kv[1]))
        blown = bool(reasons) and set(reasons) == {"rejected: NaN or Inf values"}
        raise NothingTrained(
            f"no client's reply was aggregated in any of the run's {ledger.round} round(s) "
            f"({told or 'no replies'})"
            + ("; the clients' local training diverged: lower train.lr, or check the data"
               if blown else "")
            + ". The model was never trained, so the run has no result to report; its "
            "metrics.csv and failures.csv say what happened")


# -- evaluation -----------------------------------------------------------------------------
def eval_message(rounds: Rounds, cid: int, stranger: bool = False) -> Message | None:
    """The cloud's evaluation message (``stranger``: what it gives a client that never
    trained, ``Server.new_client_message``), with what the client's edge adds to it (an
    edge's entries win where both name one)."""
    msg = (rounds.server.new_client_message if stranger else rounds.server.eval_message)(cid)
    parent = rounds.federation.parent[cid]
    edge = rounds.edges[parent].eval_message(cid) if parent != CLOUD else None
    if edge is None:
        return msg
    if msg is None:
        return edge
    return Message({**msg.tensors, **edge.tensors}, {**msg.meta, **edge.meta})


def evaluate(rounds: Rounds, rnd: int, selected: list[int]) -> dict:
    """Every client's personalized model on its own test split; the held-out clients
    (``eval.new_clients``) apart, in ``acc_new_*`` (``evaluate_new``). ``selected``: the
    round's participants, for ``acc_mean_selected``."""
    fed = rounds.federation
    figures = rounds.transport.evaluate(rnd, {cid: eval_message(rounds, cid)
                                              for cid in fed.trained})
    if rounds.held_out:  # not evaluated: out of every acc_* figure, as without test samples
        figures = {cid: figures.get(cid, Figures(0, 0, math.nan))
                   for cid in range(fed.num_clients)}
    counts = np.array([f.count for f in figures.values()])
    accs = [f.correct / f.count if f.count else math.nan for f in figures.values()]
    losses = [f.loss / f.count if f.count else math.nan for f in figures.values()]
    row = accuracy_row(accs, losses, counts)
    row["clients_diverged"] = rounds.health.evaluated(rnd, accs, losses)
    for reporter in rounds.reporters:
        row.update(reporter.evaluation_metrics(rnd, list(accs)))
    row["acc_mean_selected"] = mean_over(accs, selected)
    val_accs = None
    if rounds.cfg.eval.validation:
        val_row, val_accs = validation_row(list(figures.values()), selected)
        row.update(val_row)
    rounds.ledger.record_accuracy(accs, selected, val_accs)
    row.update(named_rows(list(figures.values()), counts))
    if rounds.held_out:
        row.update(evaluate_new(rounds, rnd))
    return row


def evaluate_new(rounds: Rounds, rnd: int) -> dict:
    """The held-out clients, each served what the server gives a stranger (with its
    edge's evaluation message in a hierarchy) and adapted as its method would:
    ``acc_new_mean``, ``_weighted``, ``_std``, ``_min`` and ``loss_new``; NaN where the
    method cannot serve one."""
    if rounds.no_new_clients:
        return {"acc_new_mean": math.nan, "acc_new_min": math.nan}
    figures = rounds.transport.evaluate_new(
        rnd, {cid: eval_message(rounds, cid, stranger=True) for cid in rounds.held_out})
    got = [figures[cid] for cid in rounds.held_out]
    row = accuracy_row([f.correct / f.count if f.count else math.nan for f in got],
                       [f.loss / f.count if f.count else math.nan for f in got],
                       np.array([f.count for f in got]))
    return {f"acc_new_{k[4:]}" if k.startswith("acc_") else f"{k}_new": v
            for k, v in row.items()}


# -- the run's figures ----------------------------------------------------------------------
def run_summary(rounds: Rounds, **extra: Any) -> dict:
    """summary.json: the run's settings, accuracy (best, final, spread), protocol, traffic,
    privacy and system figures and what the algorithm reports; ``extra`` the runtime's."""
    cfg, fed, ledger, metrics = rounds.cfg, rounds.federation, rounds.ledger, rounds.metrics
    out = {
        "algorithm": cfg.algorithm.name, "dataset": cfg.dataset.name, "model": cfg.model.name,
        "clients": fed.num_clients, "rounds": rounds.round, "seed": cfg.seed,
        "participation": cfg.train.participation,
        **accuracy_summary(metrics, rounds.client_acc),
        **stop_summary(cfg.train.rounds, rounds.stopped),
        **named_summary(metrics),
        **new_client_summary(metrics, rounds.held_out, rounds.no_new_clients),
        **validation_summary(metrics),
        **protocol_summary(ledger, cfg.eval.statistic, cfg.eval.clients,
                           validation=bool(cfg.eval.validation)),
    }
    for reporter in rounds.reporters:
        out.update(reporter.summary_figures(metrics))
    out.update({
        **traffic_summary(ledger),
        **rounds.privacy.summary(ledger, rounds.round),
        "edges": fed.edges, "edge_rounds": fed.edge_rounds,
        "clients_failed_total": int(ledger.failures.sum()),
        "clients_failed_per_client": ledger.failures.tolist(),
        "architectures": {a: fed.arch.count(a) for a in fed.architectures},
        "wall_time_s": ledger.wall_time,
    })
    if rounds.system is not None:
        out.update(cost_totals(metrics))
    out["server_state_bytes"] = ledger.server_state_bytes
    out.update(extra)
    out.update({"model_params": rounds.parts.layers.numel, "layers": rounds.parts.layers.names,
                "edgepfl_version": __version__, "host": host_info()})
    return out
