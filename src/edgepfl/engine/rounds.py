"""The round protocol, written once for every runtime.

    star:       select -> server.configure -> clients -> server.aggregate -> evaluate
    hierarchy:  select (per edge) -> cloud.configure -> edges.receive
                -> k2 x (edge.configure -> clients -> edge.aggregate)
                -> edges.report -> cloud.aggregate -> evaluate

A ``Transport`` (``engine.transport``) carries the client messages: ``InProcess`` (the
simulation) calls the client parts directly on stacked state, ``FlowerTransport`` sends
them over a Flower ``Grid``. Everything else (sampling, the algorithm's server and edge
parts, checking replies, evaluation) happens here, and every figure goes into the run's
``Ledger`` (``engine.ledger``), so both runtimes produce the same figures. Messages
between an edge and the cloud are delivered here too (copied, counted on the backhaul);
on Flower the edges are logical parts of the ServerApp process. The loop that runs
rounds to the end, with checkpoints and metrics files, is ``engine.rundir.drive``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from edgepfl import __version__
from edgepfl.algorithms.base import Edge, Server
from edgepfl.config import Config
from edgepfl.engine.ledger import (
    NO_EVAL,
    EdgeBook,
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
from edgepfl.engine.parts import Parts
from edgepfl.engine.schedule import async_debt, async_edge_rounds, early_stop, round_lr
from edgepfl.engine.transport import (
    ClientReply,
    Delivery,
    Figures,
    NothingTrained,
    TooFewReplies,
    Transport,
    check_runtime,
    client_times,
    deliver,
)
from edgepfl.federation.messages import Message, MessageError, NonFiniteError, check_finite
from edgepfl.federation.topology import CLOUD
from edgepfl.privacy import round_privacy
from edgepfl.system import FlopMeter, SystemModel, cost_totals, host_info, state_bytes

log = logging.getLogger("edgepfl")
# a round's training loss this many times a uniform guess's cross-entropy, log(classes),
# or not finite, is taken as a diverged client: an initial classifier is near log(classes)
# and training that works lowers it (regularizers add little on top)
DIVERGED = 10.0


class Rounds:
    """One run's federation state and its round loop, over any transport; what the run
    has counted is its ``ledger``."""

    def __init__(self, parts: Parts, transport: Transport, system: SystemModel | None = None,
                 flops: FlopMeter | None = None):
        self.parts = parts
        self.cfg: Config = parts.cfg
        self.federation = fed = parts.federation
        self.transport = transport
        self.system = system
        self.flops = flops or FlopMeter(enabled=False)
        self.server: Server = parts.server()
        self.edges: list[Edge] = [parts.edge(k) for k in range(fed.edges)]
        self.ledger = Ledger(fed.num_clients, fed.edges, self._state_bytes())
        self._divergence_warned = False
        self._nonfinite_warned = False
        self._selected: list[int] = []
        # this round's client replies: asked for, aggregated, rejected for NaN / Inf
        self.round_asked = self.round_aggregated = self.round_nonfinite = 0
        # the transport's clients report the FLOPs of their work (the simulation's do)
        self.counting = self.flops.enabled and transport.counts_flops
        self.asynchronous = self.cfg.topology.mode == "async"
        self.privacy = round_privacy(parts, getattr(transport, "train_sizes", None))
        check_runtime(self.cfg, system, self.flops.enabled, transport.counts_flops,
                      transport.serves_new_clients)
        # eval.new_clients: the clients held out of training, and why the method cannot
        # serve them if it cannot (said once, here; their figures are then NaN)
        self.held_out = fed.held_out
        self.no_new_clients = parts.algorithm.no_new_clients if fed.held_out else ""
        if self.no_new_clients:
            log.warning("eval.new_clients: %s cannot serve a new client (%s); the %d "
                        "held-out clients are left out of training and acc_new_* is n/a",
                        parts.algorithm.name, self.no_new_clients, len(fed.held_out))

    # -- how far the run goes ---------------------------------------------------------------
    @property
    def round(self) -> int:
        return self.ledger.round

    @property
    def metrics(self) -> list[dict]:
        return self.ledger.metrics

    @property
    def client_acc(self) -> list[float]:
        return self.ledger.client_acc

    @property
    def stopped(self) -> dict | None:
        """Where ``train.early_stopping`` stopped the run before ``train.rounds``
        (``schedule.early_stop``: round, reason, ...), from the metrics rows alone; None
        while it goes on, and for a run whose rule fires only at its last round. One pass
        over the rows, a few times a round: cheaper than keeping it in step with them."""
        t = self.cfg.train
        stop = early_stop(self.metrics, t.early_stopping, t.early_stopping_delta,
                          "val_acc_mean" if self.cfg.eval.validation else "acc_mean")
        # else the privacy budget, which a round would pass (privacy.target_epsilon)
        return (stop if stop is not None and stop["round"] < t.rounds
                else self.privacy.stop(self.ledger, self.round))

    @property
    def done(self) -> bool:
        """No round is left: ``train.rounds`` are done, or the run stopped early."""
        return self.round >= self.cfg.train.rounds or self.stopped is not None

    @property
    def last_round(self) -> int:
        """The run's last round: where it stopped early, else ``train.rounds``."""
        stop = self.stopped
        return stop["round"] if stop is not None else self.cfg.train.rounds

    def _state_bytes(self) -> int:
        return state_bytes(self.server.state_dict()) + sum(
            state_bytes(e.state_dict()) for e in self.edges)

    # -- one round ------------------------------------------------------------------------
    def step(self) -> dict:
        cfg = self.cfg
        rnd = self.round + 1
        t0 = time.perf_counter()
        selected = self.federation.select(cfg.seed, rnd, cfg.train.participation)
        if not self.federation.hierarchical:
            chosen = self.server.participants(rnd, selected)
            if self.held_out:  # a protocol that asks for every client gets the others
                chosen = [c for c in chosen if c not in self.held_out]
            selected = _check_participants(chosen, self.federation.num_clients, rnd)
        self._selected = selected
        self.round_asked = self.round_aggregated = self.round_nonfinite = 0
        if self.federation.hierarchical:
            row, losses = self._hierarchical_round(rnd, selected)
        else:
            row, losses = self._star_round(rnd, selected)
        row["train_loss"] = (float(np.average([v for v, _ in losses], weights=[w for _, w in losses]))
                             if losses else math.nan)
        if losses:
            self._warn_if_diverged(rnd, row["train_loss"])
        if self.round_nonfinite:
            self._warn_nonfinite(rnd)
        if self.round_aggregated and self.ledger.rounds_aggregated is not None:
            self.ledger.rounds_aggregated += 1
        row["lr"] = round_lr(cfg, rnd)
        self.ledger.server_state_bytes = max(self.ledger.server_state_bytes, self._state_bytes())
        if (rnd % cfg.eval.every == 0 or rnd == cfg.train.rounds
                or self.privacy.stop(self.ledger, rnd) is not None):  # the last round
            row.update(self.evaluate(rnd))
        else:
            row.update(NO_EVAL)
        row.update(row.pop("_costs"))
        row.update(self.server.round_metrics())
        row.update(self.privacy.row(self.ledger, rnd))
        row["wall_s"] = time.perf_counter() - t0
        self.ledger.add_row(row)
        return row

    def _warn_if_diverged(self, rnd: int, loss: float) -> None:
        """Once a run, say that a client's training blew up (too high a rate for it): the
        accuracy columns show it only later, as a collapse that can look like the method's."""
        guess = math.log(max(self.parts.num_classes, 2))
        if self._divergence_warned or (math.isfinite(loss) and loss <= DIVERGED * guess):
            return
        self._divergence_warned = True
        log.warning("round %d: training loss %.4g, over %g times a uniform guess's %.3g: a "
                    "client's local training has diverged (lower train.lr, or check the data)",
                    rnd, loss, DIVERGED, guess)

    def _warn_nonfinite(self, rnd: int) -> None:
        """Once a run, say that replies came back with NaN or Inf values: their clients'
        training diverged, though no loss of theirs reached ``train_loss``."""
        if self._divergence_warned:
            return
        self._divergence_warned = True
        log.warning("round %d: %d of the %d replies asked for had NaN or Inf values and were "
                    "rejected: those clients' local training has diverged (lower train.lr, "
                    "or check the data)", rnd, self.round_nonfinite, self.round_asked)

    @property
    def round_note(self) -> str:
        """What the progress line says of the last round beside its figures: that it
        aggregated nothing (every reply asked for failed or was rejected)."""
        if self.round_aggregated or not self.round_asked:
            return ""
        return f"nothing aggregated: all {self.round_asked} replies failed"

    def check_trained(self) -> None:
        """Refuse to report a run in which no reply was ever aggregated: its model is the
        untrained initial one, and its figures would read as a result (``NothingTrained``,
        with the reasons the clients failed)."""
        if self.round == 0 or self.ledger.rounds_aggregated != 0:
            return
        reasons: dict[str, int] = {}
        example: dict[str, str] = {}
        for entry in self.ledger.failure_log:
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
        diverged = bool(reasons) and set(reasons) == {"rejected: NaN or Inf values"}
        raise NothingTrained(
            f"no client's reply was aggregated in any of the run's {self.round} round(s) "
            f"({told or 'no replies'})"
            + ("; the clients' local training diverged: lower train.lr, or check the data"
               if diverged else "")
            + ". The model was never trained, so the run has no result to report; its "
            "metrics.csv and failures.csv say what happened")

    def _train(self, step: object, down: dict[int, Message], losses: list) -> Delivery:
        """Deliver ``down`` to its clients, less the ones the fault model drops, and collect
        the replies. A reply later than ``faults.deadline``, a malformed one and a client
        that did not reply are failures: logged, counted, never aggregated. In a hierarchy
        each edge's clients meet the deadline of their own edge round."""
        f = self.cfg.faults
        cells = None
        if self.federation.hierarchical and f.deadline is not None:
            by_edge: dict[int, list[int]] = {}
            for c in down:
                by_edge.setdefault(self.federation.parent[c], []).append(c)
            cells = list(by_edge.values())
        delivery = deliver(self.transport, f, self.cfg.seed, self.system, step, down, cells)
        for cid, reply in delivery.replies.items():
            if cid not in delivery.late:
                try:
                    self.check_reply(cid, reply)
                except MessageError as exc:
                    delivery.rejected[cid] = str(exc)
                    self.round_nonfinite += isinstance(exc, NonFiniteError)
        self.round_asked += len(down)
        self._log_failures(step, delivery)
        self.privacy.trained(self.ledger, delivery)
        need = math.ceil(f.min_replies * len(down) - 1e-9)
        if len(delivery.arrived) < need:
            raise TooFewReplies(
                f"round {self.round + 1}: {len(delivery.arrived)} of the {len(down)} clients "
                f"asked replied usably, faults.min_replies = {f.min_replies} needs {need} "
                f"(failed: {delivery.failed[:20]}); the run stops before this round changes "
                "anything on disk: resume it from its last checkpoint")
        self.round_aggregated += len(delivery.arrived)
        for reply in delivery.arrived.values():
            if "train_loss" in reply.stats:
                losses.append((reply.stats["train_loss"], reply.num_samples))
        return delivery

    def check_reply(self, cid: int, reply: ClientReply) -> None:
        """What every reply must pass before it reaches an aggregate: a size cap, finite
        tensors, a sample count, then the algorithm's own check by the part that
        aggregates it (the client's edge, or the server)."""
        msg, who = reply.message, f"client {cid}"
        cap = self.cfg.faults.max_message_bytes
        if cap is not None and msg.nbytes > cap:
            raise MessageError(f"{who}'s reply is {msg.nbytes} bytes, above "
                               f"faults.max_message_bytes = {cap}")
        check_finite(who, msg)
        n = reply.num_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise MessageError(f"{who} reported num_samples = {n!r}; expected an integer >= 0")
        parent = self.federation.parent[cid]
        (self.server if parent == CLOUD else self.edges[parent]).check_reply(cid, msg)

    def _log_failures(self, step: object, delivery: Delivery) -> None:
        reasons = {**dict.fromkeys(delivery.dropped, "dropped (faults.drop_rate)"),
                   **dict.fromkeys(delivery.late, f"late (past faults.deadline = "
                                                  f"{delivery.deadline} s)"),
                   **{c: f"no reply: {r}" for c, r in delivery.lost.items()},
                   **{c: f"rejected: {r}" for c, r in delivery.rejected.items()}}
        self.ledger.record_failures(self.round + 1, step, reasons)
        for cid in sorted(reasons):
            if cid in delivery.lost or cid in delivery.rejected:
                log.warning("round %d: client %d failed: %s", self.round + 1, cid, reasons[cid])

    def _star_round(self, rnd: int, selected: list[int]) -> tuple[dict, list]:
        with self.flops.measure() as configure_flops:
            down = self.server.configure(rnd, selected)
        _check_keys(down, selected, f"round {rnd}", "clients")
        losses: list = []
        delivery = self._train(rnd, {cid: down[cid] for cid in selected}, losses)
        with self.flops.measure() as aggregate_flops:
            if delivery.arrived:  # a round nobody replied in leaves the server as it was
                self.server.aggregate(rnd, self.privacy.replies(
                    rnd, CLOUD, down, {c: r.message for c, r in delivery.arrived.items()},
                    len(selected)))
        sent_down = delivery.bytes_down(down, selected)
        sent_up = delivery.bytes_up(selected)
        self.ledger.count_clients(sent_down, sent_up)
        if type(self.server).observe_traffic is not Server.observe_traffic:
            self.server.observe_traffic(rnd, sent_down, sent_up)
        costs = {}
        if self.system is not None:
            counting = self.counting
            received = sorted(delivery.replies)
            costs = self.system.round_costs(
                received, sent_down, delivery.priced_up(received),
                delivery.flops(received) if counting else None,
                (configure_flops.flops or 0) + (aggregate_flops.flops or 0) if counting else None,
                delivery.slowdown, delivery.late, delivery.deadline)
        # only an algorithm that adapts to its devices' speed pays for the per-client times
        if type(self.server).observe_times is not Server.observe_times:
            times, compute = client_times(delivery, sent_down,
                                          self.system if self.counting else None)
            if times:
                self.server.observe_times(rnd, times,
                                          delivery.flops(sorted(times)) if self.counting else None,
                                          compute=compute)
        up, dn = sum(sent_up.values()), sum(sent_down.values())
        row = {"round": rnd, "bytes_up": up, "bytes_down": dn, "clients": len(selected),
               "clients_failed": len(delivery.failed),
               "bytes_up_client": up, "bytes_down_client": dn,
               "bytes_up_edge": 0, "bytes_down_edge": 0, "_costs": costs}
        return row, losses

    def _hierarchical_round(self, rnd: int, selected: list[int]) -> tuple[dict, list]:
        """The hierarchy's box: the cloud configures its edges, each edge runs its edge
        rounds over its clients, reports, and the cloud aggregates. ``book`` keeps the
        accounts beside it (``EdgeBook``)."""
        fed = self.federation
        k2, edges = fed.edge_rounds, range(fed.edges)
        # synchronous: every edge k2 edge rounds; asynchronous: as many as its speed allows
        plan = (async_edge_rounds(self.ledger.edge_times, k2, self.ledger.edge_debt)
                if self.asynchronous else [k2] * fed.edges)
        active = [k for k in edges if plan[k] > 0]
        # a busy edge's clients do not take part this period
        selected = self._selected = [c for c in selected if plan[fed.parent[c]] > 0]
        by_edge = {k: [c for c in selected if fed.parent[c] == k] for k in edges}
        book = EdgeBook(self.flops, self.counting, self.ledger, edges)
        with book.cloud():
            down_e = self.server.configure(rnd, active)
        _check_keys(down_e, active, f"round {rnd}", "edges")
        book.sent_to_edges(down_e)
        for k in active:  # an edge still busy with its last period takes no new model
            with book.edge(k):
                self.edges[k].receive(rnd, down_e[k].delivered())
        losses: list = []
        for s in range(1, max(plan, default=0) + 1):
            working = [k for k in active if plan[k] >= s]
            down: dict[int, Message] = {}
            for k in working:
                with book.edge(k):
                    msgs = self.edges[k].configure(rnd, s, by_edge[k])
                _check_keys(msgs, by_edge[k], f"round {rnd}, edge {k}, edge round {s}", "clients")
                down.update(msgs)
            # the client step seeds the clients' work: the same in both schedules up to k2
            step = (rnd - 1) * k2 + s if s <= k2 else ("async", rnd, s)
            clients = sorted(c for k in working for c in by_edge[k])
            delivery = self._train(step, {c: down[c] for c in clients}, losses)
            book.delivered(delivery)
            for k in working:
                mine = {c: delivery.arrived[c].message for c in by_edge[k] if c in delivery.arrived}
                with book.edge(k):
                    if mine:  # an edge none of whose clients replied stays as it was
                        self.edges[k].aggregate(rnd, s, self.privacy.replies(
                            step, k, down, mine, len(by_edge[k])))
                book.edge_step(k, by_edge[k], down, delivery)
        up_e: dict[int, Message] = {}
        for k in edges:  # every edge reports what it holds; a busy one, its last model
            with book.edge(k):
                report = self.edges[k].report(rnd)
            # a busy edge's model is the one it last uploaded: the cloud holds it already
            book.reported(k, report, sent=plan[k] > 0)
            up_e[k] = report.delivered()
        with book.cloud():
            if book.replied:  # a round nobody replied in leaves the cloud as it was
                self.server.aggregate(rnd, up_e)
        book.close()
        row = {**book.row(rnd, len(selected)), "_costs": self._hierarchical_costs(book, plan)}
        if self.asynchronous:
            row["edge_rounds_min"], row["edge_rounds_max"] = min(plan), max(plan)
            row["edges_busy"] = fed.edges - len(active)
        return row, losses

    def _hierarchical_costs(self, book: EdgeBook, plan: list[int]) -> dict:
        """The round's simulated costs, and each edge's speed (its mean edge-round time
        this period) and work in hand: the asynchronous plan's inputs."""
        if self.system is None:
            return {}
        costs = self.system.hierarchical_costs(
            {k: st for k, st in book.steps.items() if st}, book.backhaul_down, book.backhaul_up,
            book.cloud_flops if self.counting else None)
        if not self.asynchronous:
            return costs
        for k in (k for k in range(len(plan)) if plan[k] > 0):
            times = [self.system.round_costs(st.selected, st.bytes_down, st.bytes_up,
                                             st.flops_client, 0, st.slowdown, st.late,
                                             st.deadline)["t_round"] for st in book.steps[k]]
            if times:
                self.ledger.edge_times[k] = float(np.mean(times))
        self.ledger.edge_debt = async_debt(self.ledger.edge_times, self.federation.edge_rounds,
                                           plan, self.ledger.edge_debt)
        return costs

    def eval_message(self, cid: int) -> Message | None:
        """The cloud's evaluation message, with what the client's edge adds to it (an edge's
        entries win where both name one)."""
        msg = self.server.eval_message(cid)
        parent = self.federation.parent[cid]
        edge = self.edges[parent].eval_message(cid) if parent != CLOUD else None
        if edge is None:
            return msg
        if msg is None:
            return edge
        return Message({**msg.tensors, **edge.tensors}, {**msg.meta, **edge.meta})

    def evaluate(self, rnd: int) -> dict:
        """Every client's personalized model on its own test split; the held-out clients
        (``eval.new_clients``) apart, in ``acc_new_*`` (``evaluate_new``)."""
        n = self.federation.num_clients
        trained = self.federation.trained
        figures = self.transport.evaluate(rnd, {cid: self.eval_message(cid) for cid in trained})
        if self.held_out:  # not evaluated: out of every acc_* figure, as without test samples
            figures = {cid: figures.get(cid, Figures(0, 0, math.nan)) for cid in range(n)}
        counts = np.array([f.count for f in figures.values()])
        accs = [f.correct / f.count if f.count else math.nan for f in figures.values()]
        losses = [f.loss / f.count if f.count else math.nan for f in figures.values()]
        row = accuracy_row(accs, losses, counts)
        blown = diverged(accs, losses)
        row["clients_diverged"] = float(len(blown))
        if blown and not self._nonfinite_warned:
            self._nonfinite_warned = True
            log.warning("round %d: %d client(s) hold a model whose test loss is not finite "
                        "(clients %s%s): their accuracy counts in acc_mean, their loss is left "
                        "out of `loss`; metrics.csv counts them in clients_diverged", rnd,
                        len(blown), ", ".join(map(str, blown[:8])),
                        ", ..." if len(blown) > 8 else "")
        row.update(self.server.evaluation_metrics(rnd, list(accs)))
        row["acc_mean_selected"] = mean_over(accs, self._selected)
        val_accs = None
        if self.cfg.eval.validation:
            val_row, val_accs = validation_row(list(figures.values()), self._selected)
            row.update(val_row)
        self.ledger.record_accuracy(accs, self._selected, val_accs)
        row.update(named_rows(list(figures.values()), counts))
        if self.held_out:
            row.update(self.evaluate_new(rnd))
        return row

    def evaluate_new(self, rnd: int) -> dict:
        """The held-out clients, each served what the server gives a stranger
        (``Server.new_client_message``, with its edge's evaluation message in a hierarchy)
        and adapted as its method would: ``acc_new_mean``, ``_weighted``, ``_std``,
        ``_min`` and ``loss_new``; NaN where the method cannot serve one."""
        if self.no_new_clients:
            return {"acc_new_mean": math.nan, "acc_new_min": math.nan}
        figures = self.transport.evaluate_new(
            rnd, {cid: self._new_client_message(cid) for cid in self.held_out})
        got = [figures[cid] for cid in self.held_out]
        row = accuracy_row([f.correct / f.count if f.count else math.nan for f in got],
                           [f.loss / f.count if f.count else math.nan for f in got],
                           np.array([f.count for f in got]))
        return {f"acc_new_{k[4:]}" if k.startswith("acc_") else f"{k}_new": v
                for k, v in row.items()}

    def _new_client_message(self, cid: int) -> Message | None:
        """``eval_message``'s merge, with what the server gives a stranger."""
        msg = self.server.new_client_message(cid)
        parent = self.federation.parent[cid]
        edge = self.edges[parent].eval_message(cid) if parent != CLOUD else None
        if edge is None or msg is None:
            return msg if edge is None else edge
        return Message({**msg.tensors, **edge.tensors}, {**msg.meta, **edge.meta})

    # -- the run's figures ----------------------------------------------------------------
    def summary(self, **extra: Any) -> dict:
        cfg, fed, ledger = self.cfg, self.federation, self.ledger
        out = {
            "algorithm": cfg.algorithm.name, "dataset": cfg.dataset.name, "model": cfg.model.name,
            "clients": fed.num_clients, "rounds": self.round, "seed": cfg.seed,
            "participation": cfg.train.participation,
            **accuracy_summary(self.metrics, self.client_acc),
            **stop_summary(cfg.train.rounds, self.stopped),
            **named_summary(self.metrics),
            **new_client_summary(self.metrics, self.held_out, self.no_new_clients),
            **validation_summary(self.metrics),
            **protocol_summary(ledger, cfg.eval.statistic, cfg.eval.clients,
                               validation=bool(cfg.eval.validation)),
            **self.server.summary_figures(self.metrics),
            **traffic_summary(ledger),
            **self.privacy.summary(ledger, self.round),
            "edges": fed.edges, "edge_rounds": fed.edge_rounds,
            "clients_failed_total": int(ledger.failures.sum()),
            "clients_failed_per_client": ledger.failures.tolist(),
            "architectures": {a: fed.arch.count(a) for a in fed.architectures},
            "wall_time_s": ledger.wall_time,
        }
        if self.system is not None:
            out.update(cost_totals(self.metrics))
        out["server_state_bytes"] = ledger.server_state_bytes
        out.update(extra)
        out.update({"model_params": self.parts.layers.numel, "layers": self.parts.layers.names,
                    "edgepfl_version": __version__, "host": host_info()})
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def save_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The server's and edges' declared state (``state`` in the metadata) and the
        ledger."""
        tensors, meta = self.server.save_state()
        tensors = {f"server/{k}": v for k, v in tensors.items()}
        parts_meta: dict[str, Any] = {"server": meta}
        for k, edge in enumerate(self.edges):
            t, m = edge.save_state()
            tensors.update({f"edge{k}/{name}": v for name, v in t.items()})
            parts_meta[f"edge{k}"] = m
        return tensors, {**self.ledger.to_meta(), "state": parts_meta}

    def load(self, ledger: Ledger, tensors: Mapping[str, torch.Tensor],
             meta: Mapping[str, Any]) -> None:
        """Go on from a checkpoint: its ledger, and its server's and edges' state
        (``engine.rundir.load_checkpoint`` checks that they belong to this run)."""
        self.load_parts(tensors, meta)
        self.ledger = ledger

    def load_parts(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        def under(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

        self.server.load_state(under("server/"), meta.get("server", {}))
        for k, edge in enumerate(self.edges):
            edge.load_state(under(f"edge{k}/"), meta.get(f"edge{k}", {}))


def _check_participants(chosen: list[int], num_clients: int, rnd: int) -> list[int]:
    ids = list(chosen)
    if (not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= num_clients
            or not all(isinstance(c, int) for c in ids)):
        raise ValueError(f"round {rnd}: the server chose participants {ids!r}; they must be "
                         f"sorted, distinct client ids in 0..{num_clients - 1}, at least one")
    return ids


def _check_keys(messages: Mapping[int, Message], expected: list[int], where: str, what: str) -> None:
    if set(messages) != set(expected):
        raise MessageError(f"{where}: the algorithm configured {what} {sorted(messages)} but the "
                           f"round selected {expected}")
