"""The round protocol, written once for every runtime.

    star:       select -> server.configure -> clients -> server.aggregate -> evaluate
    hierarchy:  select (per edge) -> cloud.configure -> edges.receive
                -> k2 x (edge.configure -> clients -> edge.aggregate)
                -> edges.report -> cloud.aggregate -> evaluate

A ``Transport`` carries the client messages: ``InProcess`` (the simulation) calls the
client parts directly on stacked state, ``FlowerTransport`` sends them over a Flower
``Grid``. Everything else (sampling, the algorithm's server and edge parts, the byte count
of every message on its own link, the FLOPs of server and edge work, evaluation figures,
the metrics row, the summary) happens here, so both runtimes produce the same figures.
Messages between an edge and the cloud are delivered here too (copied, counted on the
backhaul); on Flower the edges are logical parts of the ServerApp process.
"""

from __future__ import annotations

import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgepfl import __version__
from edgepfl.algorithms.base import Edge, Server
from edgepfl.config import Config, comparable, config_diff
from edgepfl.engine.parts import Parts
from edgepfl.engine.schedule import can_stop_early, early_stop, round_lr
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.federation.faults import draw_faults
from edgepfl.federation.messages import Message, MessageError, check_finite
from edgepfl.federation.topology import CLOUD
from edgepfl.io import write_csv
from edgepfl.system import (
    COST_COLUMNS,
    FlopMeter,
    SystemModel,
    cost_totals,
    host_info,
    state_bytes,
)
from edgepfl.system.cost import EdgeStep

log = logging.getLogger("edgepfl")
# a round's training loss this many times a uniform guess's cross-entropy, log(classes),
# or not finite, is taken as a diverged client: an initial classifier is near log(classes)
# and training that works lowers it (regularizers add little on top)
DIVERGED = 10.0

LINK_COLUMNS = ["bytes_up_client", "bytes_down_client", "bytes_up_edge", "bytes_down_edge"]
METRIC_COLUMNS = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss",
                  "train_loss", "bytes_up", "bytes_down", "clients", "clients_failed", "wall_s",
                  *COST_COLUMNS, *LINK_COLUMNS]
NO_EVAL = {"acc_mean": math.nan, "acc_weighted": math.nan, "acc_std": math.nan,
           "acc_min": math.nan, "loss": math.nan, "acc_mean_selected": math.nan}


@dataclass
class ClientReply:
    message: Message
    num_samples: int
    stats: dict[str, float] = field(default_factory=dict)
    flops: int | None = None  # counted local-training FLOPs (None: not measured)


class TooFewReplies(EdgepflError):
    """Fewer usable replies than ``faults.min_replies`` asks: the round cannot go on."""


class ClientFailure(Exception):
    """A client that was sent its message and did not reply usably (an error reply, no
    reply within the timeout, records that are not a message): what a transport returns
    in place of its ``ClientReply``."""


@dataclass
class Delivery:
    """What came of one client step: ``replies`` of every client that received its message
    and trained, of which the ``late`` ones missed the deadline; ``dropped`` never replied."""

    replies: dict[int, ClientReply]
    dropped: frozenset[int] = frozenset()
    late: frozenset[int] = frozenset()
    slowdown: dict[int, float] = field(default_factory=dict)
    deadline: float | None = None
    rejected: dict[int, str] = field(default_factory=dict)  # client -> why its reply was refused
    lost: dict[int, str] = field(default_factory=dict)  # sent, but no reply came back

    @property
    def arrived(self) -> dict[int, ClientReply]:
        """The replies the server aggregates."""
        return {c: r for c, r in self.replies.items()
                if c not in self.late and c not in self.rejected}

    @property
    def failed(self) -> list[int]:
        return sorted(self.dropped | self.late | set(self.rejected) | set(self.lost))

    def bytes_down(self, down: Mapping[int, Message], clients: list[int]) -> dict[int, int]:
        """Downloads of ``clients`` that were sent (a dropped client received nothing)."""
        return {c: down[c].nbytes for c in clients
                if c in self.replies or c in self.lost}

    def bytes_up(self, clients: list[int]) -> dict[int, int]:
        """Uploads of ``clients`` that reached the server in time, refused ones too (they
        crossed the link); the server stops listening at the deadline."""
        return {c: self.replies[c].message.nbytes for c in clients
                if c in self.replies and c not in self.late}

    def priced_up(self, clients: list[int]) -> dict[int, int]:
        """Uploads as sent, late ones too: they occupy the link until the deadline."""
        return {c: self.replies[c].message.nbytes for c in clients if c in self.replies}

    def flops(self, clients: list[int]) -> dict[int, int]:
        return {c: self.replies[c].flops or 0 for c in clients if c in self.replies}


@dataclass
class Figures:
    """A client's evaluation: correct predictions, test samples, summed loss; ``extra``
    the (correct, summed loss) of its other named predictions (``Client.predictive``)."""

    correct: int
    count: int
    loss: float
    extra: dict[str, tuple[int, float]] = field(default_factory=dict)


class Transport(ABC):
    """How the round's messages reach the clients and their replies come back."""

    #: whether ``train`` reports each client's FLOPs (the simulation counts them)
    counts_flops: bool = False

    @abstractmethod
    def train(self, step: int, messages: dict[int, Message]
              ) -> dict[int, ClientReply | ClientFailure]:
        """Deliver ``messages`` (client -> what it receives) for client step ``step`` (the
        round in a star; (round - 1) * k2 + edge round in a hierarchy, which seeds the
        clients' work) and return each client's reply in the order of ``messages``, or
        the ``ClientFailure`` that took its place."""

    @abstractmethod
    def evaluate(self, rnd: int, messages: dict[int, Message | None]) -> dict[int, Figures]:
        """Each client's personalized model on its own test split."""

    def close(self) -> None:
        """Release what the transport holds between rounds (worker processes)."""
        return None


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
            "loss": float(np.nanmean(losses))}


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
        "final_round": final["round"] if final else None,
        "acc_clients_final": client_acc,
    }


class Rounds:
    """One run's federation state and its round loop, over any transport."""

    def __init__(self, parts: Parts, transport: Transport, system: SystemModel | None = None,
                 flops: FlopMeter | None = None):
        self.parts = parts
        self.cfg: Config = parts.cfg
        self.federation = fed = parts.federation
        self.transport = transport
        self.system = system
        self.flops = flops or FlopMeter(enabled=False)
        n = fed.num_clients
        self.server: Server = parts.server()
        self.edges: list[Edge] = [parts.edge(k) for k in range(fed.edges)]
        self.round = 0
        self.metrics: list[dict] = []
        self._divergence_warned = False
        self.client_acc: list[float] = []
        self.bytes_up = np.zeros(n, dtype=np.int64)  # client -> its parent
        self.bytes_down = np.zeros(n, dtype=np.int64)
        self.edge_bytes_up = np.zeros(fed.edges, dtype=np.int64)  # edge -> cloud
        self.edge_bytes_down = np.zeros(fed.edges, dtype=np.int64)
        self.wall_time = 0.0
        self.server_state_bytes = self._state_bytes()
        # each client's best accuracy so far, over every evaluated round and over the
        # evaluated rounds it was selected in (the papers' protocols, eval.statistic)
        self.client_best = [math.nan] * n
        self.client_best_selected = [math.nan] * n
        self._selected: list[int] = []
        self.asynchronous = self.cfg.topology.mode == "async"
        if self.asynchronous and (system is None or not self.flops.enabled
                                  or not transport.counts_flops):
            raise ConfigError("topology.mode = 'async' schedules each edge by its clients' "
                              "simulated time, which needs the simulation's system model with "
                              "system.count_flops = true (and is not available on Flower, "
                              "whose time is real)")
        # each edge's mean edge-round time in its last period (None: not measured yet)
        self.edge_times: list[float | None] = [None] * fed.edges
        t, every = self.cfg.train, self.cfg.eval.every
        if t.early_stopping and not can_stop_early(t.rounds, every, t.early_stopping):
            log.warning("train.early_stopping = %d needs %d evaluated rounds before the last "
                        "to stop a run early, and train.rounds = %d with eval.every = %d has "
                        "%d: this run will not stop early", t.early_stopping,
                        t.early_stopping + 1, t.rounds, every, (t.rounds - 1) // every)
        self.failures = np.zeros(n, dtype=np.int64)  # client steps each client failed in
        self.failure_log: list[dict] = []  # round, step, client, reason of every failure
        f = self.cfg.faults
        if f.drop_rate or f.straggler_rate or f.deadline is not None:
            if not transport.counts_flops:
                raise ConfigError("faults.drop_rate, faults.straggler_rate and faults.deadline "
                                  "inject failures into the simulation; on Flower clients fail "
                                  "for real (see flower.min_replies); set them to 0 / none")
            timed = system is not None and (self.flops.enabled or system.compute_s is not None)
            if (f.straggler_rate or f.deadline is not None) and not timed:
                raise ConfigError("faults.straggler_rate and faults.deadline act on the clients' "
                                  "simulated time, which needs system.count_flops = true (or "
                                  "system.profile = 'wen_table2')")

    # -- how far the run goes ---------------------------------------------------------------
    @property
    def stopped(self) -> dict | None:
        """Where ``train.early_stopping`` stopped the run before ``train.rounds``
        (``schedule.early_stop``: round, reason, ...), from the metrics rows alone; None
        while it goes on, and for a run whose rule fires only at its last round. One pass
        over the rows, a few times a round: cheaper than keeping it in step with them."""
        t = self.cfg.train
        stop = early_stop(self.metrics, t.early_stopping, t.early_stopping_delta)
        return stop if stop is not None and stop["round"] < t.rounds else None

    @property
    def done(self) -> bool:
        """No round is left: ``train.rounds`` are done, or the run stopped early."""
        return self.round >= self.cfg.train.rounds or self.stopped is not None

    @property
    def last_round(self) -> int:
        """The run's last round: where it stopped early, else ``train.rounds``."""
        stop = self.stopped
        return stop["round"] if stop is not None else self.cfg.train.rounds

    def stop_summary(self) -> dict:
        stop = self.stopped
        return {"rounds_planned": self.cfg.train.rounds,
                "stopped_early": stop is not None,
                "stopped_round": stop["round"] if stop else None,
                "stop_reason": stop["reason"] if stop else None}

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
            selected = _check_participants(self.server.participants(rnd, selected),
                                           self.federation.num_clients, rnd)
        self._selected = selected
        if self.federation.hierarchical:
            row, losses = self._hierarchical_round(rnd, selected)
        else:
            row, losses = self._star_round(rnd, selected)
        row["train_loss"] = (float(np.average([v for v, _ in losses], weights=[w for _, w in losses]))
                             if losses else math.nan)
        if losses:
            self._warn_if_diverged(rnd, row["train_loss"])
        row["lr"] = round_lr(cfg, rnd)
        self.server_state_bytes = max(self.server_state_bytes, self._state_bytes())
        if rnd % cfg.eval.every == 0 or rnd == cfg.train.rounds:
            row.update(self.evaluate(rnd))
        else:
            row.update(NO_EVAL)
        row.update(row.pop("_costs"))
        row.update(self.server.round_metrics())
        row["wall_s"] = time.perf_counter() - t0
        self.wall_time += row["wall_s"]
        self.round = rnd
        self.metrics.append(row)
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

    def _train(self, step: object, down: dict[int, Message], losses: list) -> Delivery:
        """Deliver ``down`` to its clients, less the ones the fault model drops, and collect
        the replies. A reply later than ``faults.deadline``, a malformed one and a client
        that did not reply are failures: logged, counted, never aggregated."""
        f = self.cfg.faults
        faults = draw_faults(self.cfg.seed, step, list(down), f.drop_rate, f.straggler_rate)
        got = self.transport.train(
            step, {c: m for c, m in down.items() if c not in faults.dropped})
        replies = {c: r for c, r in got.items() if isinstance(r, ClientReply)}
        delivery = Delivery(replies, faults.dropped,
                            slowdown=dict.fromkeys(faults.stragglers, f.straggler_delay),
                            deadline=f.deadline,
                            lost={c: str(r) for c, r in got.items() if isinstance(r, ClientFailure)})
        if f.deadline is not None:
            times = self.system.client_times(
                list(replies), delivery.bytes_down(down, list(replies)),
                delivery.priced_up(list(replies)), delivery.flops(list(replies)),
                delivery.slowdown)
            delivery.late = frozenset(c for c, (d, t, u) in times.items() if d + t + u > f.deadline)
        for cid, reply in replies.items():
            if cid not in delivery.late:
                try:
                    self.check_reply(cid, reply)
                except MessageError as exc:
                    delivery.rejected[cid] = str(exc)
        self._log_failures(step, delivery)
        need = math.ceil(f.min_replies * len(down) - 1e-9)
        if len(delivery.arrived) < need:
            raise TooFewReplies(
                f"round {self.round + 1}: {len(delivery.arrived)} of the {len(down)} clients "
                f"asked replied usably, faults.min_replies = {f.min_replies} needs {need} "
                f"(failed: {delivery.failed[:20]}); the run stops before this round changes "
                "anything on disk: resume it from its last checkpoint")
        for reply in delivery.arrived.values():
            if "train_loss" in reply.stats:
                losses.append((reply.stats["train_loss"], reply.num_samples))
        return delivery

    def _client_times(self, delivery: Delivery, sent_down: dict[int, int],
                      ) -> tuple[dict[int, float], dict[int, float]]:
        """Each arrived client's round time (download, training, upload) and its training
        time alone: simulated by the system model where FLOPs are counted, else as the
        client measured its training (``train_s``, on Flower: both are that time); clients
        with neither are left out."""
        arrived = sorted(delivery.arrived)
        if self.system is not None and self.flops.enabled and self.transport.counts_flops:
            times = self.system.client_times(arrived, sent_down, delivery.bytes_up(arrived),
                                             delivery.flops(arrived), delivery.slowdown)
            finite = {c: p for c, p in times.items() if math.isfinite(sum(p))}
            return ({c: d + t + u for c, (d, t, u) in finite.items()},
                    {c: t for c, (_, t, _) in finite.items()})
        measured = {c: float(r.stats["train_s"]) for c, r in delivery.arrived.items()
                    if math.isfinite(r.stats.get("train_s", math.nan))}
        return measured, dict(measured)

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
        for cid in sorted(reasons):
            self.failures[cid] += 1
            self.failure_log.append({"round": self.round + 1, "step": str(step), "client": cid,
                                     "reason": reasons[cid]})
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
                self.server.aggregate(rnd, {c: r.message for c, r in delivery.arrived.items()})
        sent_down = delivery.bytes_down(down, selected)
        sent_up = delivery.bytes_up(selected)
        for cid, b in sent_down.items():
            self.bytes_down[cid] += b
        for cid, b in sent_up.items():
            self.bytes_up[cid] += b
        costs = {}
        if self.system is not None:
            counting = self.flops.enabled and self.transport.counts_flops
            received = sorted(delivery.replies)
            costs = self.system.round_costs(
                received, sent_down, delivery.priced_up(received),
                delivery.flops(received) if counting else None,
                (configure_flops.flops or 0) + (aggregate_flops.flops or 0) if counting else None,
                delivery.slowdown, delivery.late, delivery.deadline)
        # only an algorithm that adapts to its devices' speed pays for the per-client times
        if type(self.server).observe_times is not Server.observe_times:
            times, compute = self._client_times(delivery, sent_down)
            if times:
                counted = self.flops.enabled and self.transport.counts_flops
                self.server.observe_times(rnd, times,
                                          delivery.flops(sorted(times)) if counted else None,
                                          compute=compute)
        up, dn = sum(sent_up.values()), sum(sent_down.values())
        row = {"round": rnd, "bytes_up": up, "bytes_down": dn, "clients": len(selected),
               "clients_failed": len(delivery.failed),
               "bytes_up_client": up, "bytes_down_client": dn,
               "bytes_up_edge": 0, "bytes_down_edge": 0, "_costs": costs}
        return row, losses

    def _hierarchical_round(self, rnd: int, selected: list[int]) -> tuple[dict, list]:
        fed = self.federation
        k2, edges = fed.edge_rounds, range(fed.edges)
        # synchronous: every edge k2 edge rounds; asynchronous: as many as its speed allows
        plan = async_edge_rounds(self.edge_times, k2) if self.asynchronous else [k2] * fed.edges
        active = [k for k in edges if plan[k] > 0]
        selected = [c for c in selected if plan[fed.parent[c]] > 0]
        self._selected = selected  # a busy edge's clients do not take part this period
        by_edge = {k: [c for c in selected if fed.parent[c] == k] for k in edges}
        counting = self.flops.enabled and self.transport.counts_flops
        with self.flops.measure() as cloud_configure:
            down_e = self.server.configure(rnd, active)
        _check_keys(down_e, active, f"round {rnd}", "edges")
        edge_flops = dict.fromkeys(edges, 0)
        bh_down = {k: down_e[k].nbytes for k in active}
        for k in active:  # an edge still busy with its last period takes no new model
            with self.flops.measure() as f:
                self.edges[k].receive(rnd, down_e[k].delivered())
            edge_flops[k] += f.flops or 0
        steps: dict[int, list[EdgeStep]] = {k: [] for k in edges}
        losses: list = []
        client_down = client_up = failed = replied = 0
        for s in range(1, max(plan, default=0) + 1):
            working = [k for k in active if plan[k] >= s]
            clients = [c for k in working for c in by_edge[k]]
            down: dict[int, Message] = {}
            step_flops = dict.fromkeys(working, 0)
            for k in working:
                with self.flops.measure() as f:
                    msgs = self.edges[k].configure(rnd, s, by_edge[k])
                step_flops[k] += f.flops or 0
                _check_keys(msgs, by_edge[k], f"round {rnd}, edge {k}, edge round {s}", "clients")
                down.update(msgs)
            # the client step seeds the clients' work: the same in both schedules up to k2
            step = (rnd - 1) * k2 + s if s <= k2 else ("async", rnd, s)
            delivery = self._train(step, {c: down[c] for c in sorted(clients)}, losses)
            failed += len(delivery.failed)
            arrived = delivery.arrived
            replied += len(arrived)
            for k in working:
                mine = {c: arrived[c].message for c in by_edge[k] if c in arrived}
                with self.flops.measure() as f:
                    if mine:  # an edge none of whose clients replied stays as it was
                        self.edges[k].aggregate(rnd, s, mine)
                step_flops[k] += f.flops or 0
                sent_down = delivery.bytes_down(down, by_edge[k])
                sent_up = delivery.bytes_up(by_edge[k])
                for c, b in sent_down.items():
                    self.bytes_down[c] += b
                for c, b in sent_up.items():
                    self.bytes_up[c] += b
                client_down += sum(sent_down.values())
                client_up += sum(sent_up.values())
                received = [c for c in by_edge[k] if c in delivery.replies]
                steps[k].append(EdgeStep(
                    received, sent_down, delivery.priced_up(received),
                    delivery.flops(received) if counting else None,
                    step_flops[k] + (edge_flops.pop(k, 0) if s == 1 else 0) if counting else None,
                    {c: v for c, v in delivery.slowdown.items() if c in received},
                    delivery.late & set(received), delivery.deadline))
        up_e: dict[int, Message] = {}
        bh_up = {}
        for k in edges:  # every edge reports what it holds; a busy one, its last model
            with self.flops.measure() as f:
                report = self.edges[k].report(rnd)
            if counting and steps[k]:
                steps[k][-1].flops_edge = (steps[k][-1].flops_edge or 0) + (f.flops or 0)
            bh_up[k] = report.nbytes
            up_e[k] = report.delivered()
        with self.flops.measure() as cloud_aggregate:
            if replied:  # a round nobody replied in leaves the cloud as it was
                self.server.aggregate(rnd, up_e)
        for k in edges:
            self.edge_bytes_down[k] += bh_down.get(k, 0)
            self.edge_bytes_up[k] += bh_up[k]
        costs = {}
        if self.system is not None:
            costs = self.system.hierarchical_costs(
                {k: st for k, st in steps.items() if st}, bh_down, bh_up,
                (cloud_configure.flops or 0) + (cloud_aggregate.flops or 0) if counting else None)
            # each edge's speed, its mean edge-round time this period: the async plan's input
            for k in (active if self.asynchronous else ()):
                times = [self.system.round_costs(st.selected, st.bytes_down, st.bytes_up,
                                                 st.flops_client, 0, st.slowdown, st.late,
                                                 st.deadline)["t_round"] for st in steps[k]]
                self.edge_times[k] = float(np.mean(times)) if times else self.edge_times[k]
        e_up, e_down = sum(bh_up.values()), sum(bh_down.values())
        row = {"round": rnd, "bytes_up": client_up + e_up, "bytes_down": client_down + e_down,
               "clients": len(selected), "clients_failed": failed,
               "bytes_up_client": client_up,
               "bytes_down_client": client_down, "bytes_up_edge": e_up, "bytes_down_edge": e_down,
               "_costs": costs}
        if self.asynchronous:
            row["edge_rounds_min"], row["edge_rounds_max"] = min(plan), max(plan)
            row["edges_busy"] = fed.edges - len(active)
        return row, losses

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
        """Every client's personalized model on its own test split."""
        n = self.federation.num_clients
        figures = self.transport.evaluate(rnd, {cid: self.eval_message(cid) for cid in range(n)})
        counts = np.array([f.count for f in figures.values()])
        accs = [f.correct / f.count if f.count else math.nan for f in figures.values()]
        losses = [f.loss / f.count if f.count else math.nan for f in figures.values()]
        self.client_acc = accs
        row = accuracy_row(accs, losses, counts)
        row.update(self.server.evaluation_metrics(rnd, list(accs)))
        chosen = [accs[c] for c in self._selected if not math.isnan(accs[c])]
        row["acc_mean_selected"] = float(np.mean(chosen)) if chosen else math.nan
        for cid, acc in enumerate(accs):
            if not math.isnan(acc):
                self.client_best[cid] = _max(self.client_best[cid], acc)
                if cid in self._selected:
                    self.client_best_selected[cid] = _max(self.client_best_selected[cid], acc)
        names = list(dict.fromkeys(k for f in figures.values() for k in f.extra))
        for name in names:
            # a client without this prediction (an algorithm's per-tier figure) is left out
            got = [f.extra.get(name, (math.nan, math.nan)) for f in figures.values()]
            extra = accuracy_row([c / f.count if f.count else math.nan
                                  for (c, _), f in zip(got, figures.values(), strict=True)],
                                 [v / f.count if f.count else math.nan
                                  for (_, v), f in zip(got, figures.values(), strict=True)],
                                 counts)
            row.update({f"acc_{name}_{k[4:]}" if k.startswith("acc_") else f"{k}_{name}": v
                        for k, v in extra.items()})
        return row

    # -- the run's figures ----------------------------------------------------------------
    def _named_summary(self) -> dict:
        """Best and final figures of every extra named prediction (``acc_global_mean``...)."""
        out = {}
        names = [k[len("acc_"):-len("_mean")] for k in (self.metrics[-1] if self.metrics else {})
                 if k.startswith("acc_") and k.endswith("_mean")]
        for name in names:
            rows = [r for r in self.metrics if not math.isnan(r.get(f"acc_{name}_mean", math.nan))]
            if rows:
                best = max(rows, key=lambda r: r[f"acc_{name}_mean"])
                out.update({f"acc_{name}_mean_best": best[f"acc_{name}_mean"],
                            f"{name}_best_round": best["round"],
                            f"acc_{name}_mean_final": rows[-1][f"acc_{name}_mean"],
                            f"acc_{name}_weighted_final": rows[-1][f"acc_{name}_weighted"],
                            f"acc_{name}_std_final": rows[-1][f"acc_{name}_std"]})
        return out

    def protocol_summary(self) -> dict:
        """The papers' protocols beside ours: each client's own best round averaged, and the
        mean over each round's selected clients; ``protocol`` is the figure that
        ``eval.statistic`` and ``eval.clients`` name (ours: best round, all clients)."""
        def mean(values: list[float]) -> float | None:
            ok = [v for v in values if not math.isnan(v)]
            return float(np.mean(ok)) if ok else None

        rows = [r for r in self.metrics if not math.isnan(r.get("acc_mean_selected", math.nan))]
        figures = {
            ("best_round", "all"): max((r["acc_mean"] for r in self.metrics
                                        if not math.isnan(r["acc_mean"])), default=None),
            ("best_round", "selected"): max((r["acc_mean_selected"] for r in rows), default=None),
            ("client_best", "all"): mean(self.client_best),
            ("client_best", "selected"): mean(self.client_best_selected),
        }
        e = self.cfg.eval
        return {"acc_client_best_mean": figures["client_best", "all"],
                "acc_mean_selected_best": figures["best_round", "selected"],
                "acc_client_best_selected_mean": figures["client_best", "selected"],
                "protocol": {"statistic": e.statistic, "clients": e.clients,
                             "acc": figures[e.statistic, e.clients]}}

    def summary(self, **extra: Any) -> dict:
        cfg, fed = self.cfg, self.federation
        out = {
            "algorithm": cfg.algorithm.name, "dataset": cfg.dataset.name, "model": cfg.model.name,
            "clients": fed.num_clients, "rounds": self.round, "seed": cfg.seed,
            "participation": cfg.train.participation,
            **accuracy_summary(self.metrics, self.client_acc),
            **self.stop_summary(),
            **self._named_summary(),
            **self.protocol_summary(),
            **self.server.summary_figures(self.metrics),
            "bytes_up_total": int(self.bytes_up.sum() + self.edge_bytes_up.sum()),
            "bytes_down_total": int(self.bytes_down.sum() + self.edge_bytes_down.sum()),
            "bytes_up_per_client": self.bytes_up.tolist(),
            "bytes_down_per_client": self.bytes_down.tolist(),
            "bytes_up_client_total": int(self.bytes_up.sum()),
            "bytes_down_client_total": int(self.bytes_down.sum()),
            "bytes_up_edge_total": int(self.edge_bytes_up.sum()),
            "bytes_down_edge_total": int(self.edge_bytes_down.sum()),
            "bytes_up_per_edge": self.edge_bytes_up.tolist(),
            "bytes_down_per_edge": self.edge_bytes_down.tolist(),
            "edges": fed.edges, "edge_rounds": fed.edge_rounds,
            "clients_failed_total": int(self.failures.sum()),
            "clients_failed_per_client": self.failures.tolist(),
            "architectures": {a: fed.arch.count(a) for a in fed.architectures},
            "wall_time_s": self.wall_time,
        }
        if self.system is not None:
            out.update(cost_totals(self.metrics))
        out["server_state_bytes"] = self.server_state_bytes
        out.update(extra)
        out.update({"model_params": self.parts.layers.numel, "layers": self.parts.layers.names,
                    "edgepfl_version": __version__, "host": host_info()})
        return out

    def write_failures(self, out_dir: Path) -> None:
        """``failures.csv``: every client that failed, when, and why (once there is one)."""
        if self.failure_log:
            write_csv(out_dir / "failures.csv", ["round", "step", "client", "reason"],
                      self.failure_log)

    # -- checkpoints ----------------------------------------------------------------------
    def save_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The server's and edges' declared state and the run's counters."""
        tensors, meta = self.server.save_state()
        tensors = {f"server/{k}": v for k, v in tensors.items()}
        parts_meta: dict[str, Any] = {"server": meta}
        for k, edge in enumerate(self.edges):
            t, m = edge.save_state()
            tensors.update({f"edge{k}/{name}": v for name, v in t.items()})
            parts_meta[f"edge{k}"] = m
        counters = {"round": self.round, "metrics": self.metrics, "client_acc": self.client_acc,
                    "bytes_up": self.bytes_up.tolist(), "bytes_down": self.bytes_down.tolist(),
                    "edge_bytes_up": self.edge_bytes_up.tolist(),
                    "edge_bytes_down": self.edge_bytes_down.tolist(),
                    "wall_time_s": self.wall_time, "server_state_bytes": self.server_state_bytes,
                    "client_best": [None if math.isnan(v) else v for v in self.client_best],
                    "edge_times": self.edge_times, "failures": self.failures.tolist(),
                    "failure_log": self.failure_log,
                    "client_best_selected": [None if math.isnan(v) else v
                                             for v in self.client_best_selected],
                    "state": parts_meta}
        return tensors, counters

    def restore(self, path: Path, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        """The server's and edges' state and the run's counters from a checkpoint
        (``save_state``) of this configuration; anything malformed or belonging to another
        configuration is refused before a thing is changed."""
        n, edges = self.federation.num_clients, self.federation.edges
        try:
            config = meta["config"]
            rnd = int(meta["round"])
            metrics = [{k: (math.nan if v is None else v) for k, v in row.items()}
                       for row in meta["metrics"]]
            client_acc = [math.nan if v is None else float(v) for v in meta["client_acc"]]
            bytes_up = np.array(meta["bytes_up"], dtype=np.int64)
            bytes_down = np.array(meta["bytes_down"], dtype=np.int64)
            edge_up = np.array(meta.get("edge_bytes_up", []), dtype=np.int64).reshape(-1)
            edge_down = np.array(meta.get("edge_bytes_down", []), dtype=np.int64).reshape(-1)
            wall_time = float(meta["wall_time_s"])
            best = [math.nan if v is None else float(v)
                    for v in meta.get("client_best", [None] * n)]
            best_sel = [math.nan if v is None else float(v)
                        for v in meta.get("client_best_selected", [None] * n)]
            server_bytes = int(meta.get("server_state_bytes", self.server_state_bytes))
            edge_times = [None if t is None else float(t)
                          for t in meta.get("edge_times", [None] * edges)]
            failures = np.asarray(meta.get("failures", [0] * n), dtype=np.int64)
            failure_log = list(meta.get("failure_log", []))
            if not isinstance(config, dict) or len(metrics) != rnd or \
                    bytes_up.shape != (n,) or bytes_down.shape != (n,) or \
                    edge_up.shape != (edges,) or edge_down.shape != (edges,) or \
                    failures.shape != (n,) or len(edge_times) != edges:
                raise ValueError(f"round {rnd}, {len(metrics)} metric rows, byte counts for "
                                 f"{bytes_up.shape} / {bytes_down.shape} clients and "
                                 f"{edge_up.shape} / {edge_down.shape} edges, failure counts "
                                 f"for {failures.shape} clients")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EdgepflError(f"{path} is not a valid edgepfl checkpoint: its metadata is "
                               f"malformed ({type(exc).__name__}: {exc})") from None
        # train.rounds may have grown (an extended run): nothing in a round depends on it
        diff = config_diff(comparable(config), comparable(self.cfg.model_dump()))
        if diff:
            raise EdgepflError(f"{path} belongs to a different configuration than this "
                               "run's:\n  " + "\n  ".join(diff))
        if rnd > self.cfg.train.rounds:
            raise EdgepflError(f"{path} is at round {rnd}, past train.rounds={self.cfg.train.rounds}")
        t, stored = self.cfg.train, config.get("train", {})
        # a horizon of its own (train.lr_decay_rounds) does not move with train.rounds
        if t.lr_decay != "none" and t.lr_decay_rounds is None \
                and stored.get("rounds", t.rounds) != t.rounds:
            raise ConfigError(f"{path} was run with train.rounds = {stored.get('rounds')} and "
                              f"train.lr_decay = {t.lr_decay!r}, whose rates are spread over "
                              f"those rounds; with train.rounds = {t.rounds} its rounds so far "
                              "would have trained at other rates, so it cannot be extended: "
                              "start a new run (one with train.lr_decay_rounds set can be)")
        self.load_parts(tensors, meta.get("state", {}))
        self.round, self.metrics, self.client_acc = rnd, metrics, client_acc
        self.bytes_up, self.bytes_down, self.wall_time = bytes_up, bytes_down, wall_time
        self.edge_bytes_up, self.edge_bytes_down = edge_up, edge_down
        self.client_best, self.client_best_selected = best, best_sel
        self.edge_times, self.failures, self.failure_log = edge_times, failures, failure_log
        self.server_state_bytes = server_bytes

    def load_parts(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> None:
        def under(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}

        self.server.load_state(under("server/"), meta.get("server", {}))
        for k, edge in enumerate(self.edges):
            edge.load_state(under(f"edge{k}/"), meta.get(f"edge{k}", {}))


def async_edge_rounds(times: list[float | None], k2: int) -> list[int]:
    """Edge rounds of each edge in the next cloud period of an asynchronous hierarchy.

    The cloud period is k2 times the median edge's edge-round time; an edge runs as many
    edge rounds as fit in it, to the nearest whole round (so edges of equal speed, or
    within a factor 1 +- 1/(2 k2) of it, run k2, as the synchronous schedule does), and an
    edge more than 2 k2 times slower than the median runs none: it is still busy, takes no
    new model, and the cloud aggregates the model it holds, stale. Before any edge has been
    timed (the first period) every edge runs k2."""
    known = [t for t in times if t is not None and math.isfinite(t) and t > 0]
    if len(known) < len(times):
        return [k2] * len(times)
    period = k2 * float(np.median(known))
    return [int(math.floor(period / t + 0.5)) for t in known]


def _max(a: float, b: float) -> float:
    return b if math.isnan(a) else max(a, b)


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
