"""The round protocol, written once for every runtime: a round is played, and what
happened is a value, its ``RoundRecord`` (``engine.record``), which the round's
observers read: the ledger, the system costs, the metrics row, evaluation, the summary
(``engine.observers``) and the algorithm's ``Reporter``.

    star:       select -> server.configure -> clients -> server.aggregate -> evaluate
    hierarchy:  ``engine.hierarchy`` (select per edge -> cloud -> k2 x edges -> cloud)

A ``Transport`` (``engine.transport``) carries the client messages: ``InProcess`` (the
simulation) calls the client parts directly on stacked state, ``FlowerTransport`` sends
them over a Flower ``Grid``; both produce the same record, so the same figures. Privacy
(``edgepfl.privacy``) post-processes the replies between delivery and aggregation. The
loop that runs rounds to the end, with its side work as hooks, is ``engine.rundir.drive``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from edgepfl.config import Config
from edgepfl.contract.algorithm import Edge, Reporter, Server
from edgepfl.engine.hierarchy import hierarchical_round
from edgepfl.engine.ledger import NO_EVAL, Ledger
from edgepfl.engine.observers import (
    Health,
    eval_message,
    evaluate,
    log_failures,
    round_costs,
    run_summary,
)
from edgepfl.engine.parts import Parts
from edgepfl.engine.record import RoundRecord
from edgepfl.engine.schedule import early_stop, round_lr
from edgepfl.engine.transport import (
    ClientReply,
    Delivery,
    TooFewReplies,
    Transport,
    check_runtime,
    deliver,
    participants,
)
from edgepfl.federation.messages import Message, MessageError, NonFiniteError, check_finite
from edgepfl.federation.topology import CLOUD
from edgepfl.privacy import round_privacy
from edgepfl.system import FlopMeter, SystemModel, state_bytes

log = logging.getLogger("edgepfl")


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
        # the parts that report beside the protocol: observers of every round's record
        self.reporters = [p for p in (self.server, *self.edges) if isinstance(p, Reporter)]
        self.health = Health(parts.num_classes)
        self.last_record: RoundRecord | None = None
        # the transport's clients report the FLOPs of their work (the simulation's do)
        self.counting = self.flops.enabled and transport.counts_flops
        self.asynchronous = self.cfg.topology.mode == "async"
        self.privacy = round_privacy(parts, getattr(transport, "train_sizes", None))
        if self.cfg.privacy.secure_aggregation and not transport.secure_sum:
            log.info("privacy.secure_aggregation: this runtime has no server to hide the "
                     "updates from; it computes each aggregate SecAgg+ would hand a Flower "
                     "server, in one process (with client-level DP, with its noise)")
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

    @property
    def round_note(self) -> str:
        """What the progress line says of the last round beside its figures."""
        return self.health.note(self.last_record)

    def check_trained(self) -> None:
        """Refuse to report a run that never aggregated a reply (``Health.check_trained``)."""
        self.health.check_trained(self.ledger)

    def evaluate(self, rnd: int) -> dict:
        """Every client's personalized model on its own test split (``observers.evaluate``)."""
        selected = self.last_record.selected if self.last_record is not None else []
        return evaluate(self, rnd, selected)

    def eval_message(self, cid: int) -> Message | None:
        return eval_message(self, cid)

    def summary(self, **extra: Any) -> dict:
        return run_summary(self, **extra)

    def _state_bytes(self) -> int:
        return state_bytes(self.server.state_dict()) + sum(
            state_bytes(e.state_dict()) for e in self.edges)

    # -- one round ------------------------------------------------------------------------
    def step(self) -> dict:
        """Play the next round and hand its record to the observers; returns the round's
        metrics row (also in the ledger)."""
        cfg, ledger = self.cfg, self.ledger
        rnd = self.round + 1
        record = self.play(rnd)
        self.last_record = record
        row = dict(record.traffic)
        losses = record.losses
        row["train_loss"] = (float(np.average([v for v, _ in losses], weights=[w for _, w in losses]))
                             if losses else math.nan)
        self.health.observe(record, row["train_loss"])
        if record.aggregated and ledger.rounds_aggregated is not None:
            ledger.rounds_aggregated += 1
        row["lr"] = round_lr(cfg, rnd)
        ledger.server_state_bytes = max(ledger.server_state_bytes, self._state_bytes())
        if (rnd % cfg.eval.every == 0 or rnd == cfg.train.rounds
                or self.privacy.stop(ledger, rnd) is not None):  # the last round
            row.update(evaluate(self, rnd, record.selected))
        else:
            row.update(NO_EVAL)
        row.update(round_costs(self.system, record, ledger, self.federation.edge_rounds))
        for reporter in self.reporters:
            row.update(reporter.round_metrics())
        row.update(self.privacy.row(ledger, rnd))
        row["wall_s"] = time.perf_counter() - record.started
        ledger.add_row(row)
        return row

    def play(self, rnd: int) -> RoundRecord:
        """Round ``rnd`` of the protocol, star or hierarchy; its ``RoundRecord``, which the
        algorithm's reporters have seen."""
        record = RoundRecord(rnd, self.federation.select(self.cfg.seed, rnd,
                                                         self.cfg.train.participation),
                             time.perf_counter(), system=self.system, counting=self.counting)
        if self.federation.hierarchical:
            hierarchical_round(self, record)
        else:
            self._star_round(record)
            self.ledger.count_clients(record.bytes_down, record.bytes_up)
        for reporter in self.reporters:
            reporter.observe(record)
        return record

    def train(self, record: RoundRecord, step: object, down: dict[int, Message]) -> Delivery:
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
                    record.nonfinite += isinstance(exc, NonFiniteError)
        record.asked += len(down)
        log_failures(self.ledger, self.round + 1, step, delivery)
        self.privacy.trained(self.ledger, delivery)
        need = math.ceil(f.min_replies * len(down) - 1e-9)
        if len(delivery.arrived) < need:
            raise TooFewReplies(
                f"round {self.round + 1}: {len(delivery.arrived)} of the {len(down)} clients "
                f"asked replied usably, faults.min_replies = {f.min_replies} needs {need} "
                f"(failed: {delivery.failed[:20]}); the run stops before this round changes "
                "anything on disk: resume it from its last checkpoint")
        record.aggregated += len(delivery.arrived)
        record.losses += [(r.stats["train_loss"], r.num_samples)
                          for r in delivery.arrived.values() if "train_loss" in r.stats]
        return delivery

    def aggregated(self, step: object, aggregator: int, down: dict[int, Message],
                   delivery: Delivery, clients: list[int]) -> dict[int, Message]:
        """What ``aggregator`` aggregates of its sampled ``clients``' replies that arrived:
        privacy's post-processed replies, or a secure sum's, which its clients made
        private themselves."""
        mine = {c: delivery.arrived[c].message for c in clients if c in delivery.arrived}
        if delivery.summed:
            return mine
        return self.privacy.replies(step, aggregator, down, mine, len(clients))

    def check_reply(self, cid: int, reply: ClientReply) -> None:
        """What every reply must pass before it reaches an aggregate: a size cap, finite
        tensors, a sample count, then the algorithm's own check by the part that
        aggregates it (the client's edge, or the server)."""
        msg, who = reply.message, f"client {cid}"
        cap = self.cfg.faults.max_message_bytes
        if cap is not None and reply.nbytes > cap:
            raise MessageError(f"{who}'s reply is {reply.nbytes} bytes, above "
                               f"faults.max_message_bytes = {cap}")
        check_finite(who, msg)
        n = reply.num_samples
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise MessageError(f"{who} reported num_samples = {n!r}; expected an integer >= 0")
        parent = self.federation.parent[cid]
        (self.server if parent == CLOUD else self.edges[parent]).check_reply(cid, msg)

    def _star_round(self, record: RoundRecord) -> None:
        """The star's box: the server configures its participants, they train, the server
        aggregates what arrived."""
        rnd = record.round
        with self.flops.measure() as configure_flops:
            down = self.server.configure(rnd, record.selected)
        record.selected = selected = participants(down, record.selected, self.federation, rnd)
        delivery = record.delivery = self.train(record, rnd, {cid: down[cid] for cid in selected})
        with self.flops.measure() as aggregate_flops:
            if delivery.arrived:  # a round nobody replied in leaves the server as it was
                self.server.aggregate(rnd, self.aggregated(rnd, CLOUD, down, delivery,
                                                           selected))
        if self.counting:
            record.server_flops = (configure_flops.flops or 0) + (aggregate_flops.flops or 0)
        record.bytes_down = down_ = delivery.bytes_down(down, selected)
        record.bytes_up = up_ = delivery.bytes_up(selected)
        up, dn = sum(up_.values()), sum(down_.values())
        record.traffic = {"round": rnd, "bytes_up": up, "bytes_down": dn, "clients": len(selected),
                          "clients_failed": len(delivery.failed), "bytes_up_client": up,
                          "bytes_down_client": dn, "bytes_up_edge": 0, "bytes_down_edge": 0}

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
