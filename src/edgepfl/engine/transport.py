"""What passes between the round loop and a runtime: a ``Transport`` carries the client
messages (``InProcess`` in the simulation, ``FlowerTransport`` over a Flower ``Grid``)
and returns each client's ``ClientReply`` or the ``ClientFailure`` that took its place;
``Delivery`` is what came of one client step (``deliver``, with the injected faults),
``Figures`` a client's evaluation.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from edgepfl.config import Config, FaultsConfig
from edgepfl.engine.schedule import can_stop_early
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.federation.faults import draw_faults
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.topology import Federation
from edgepfl.system import SystemModel, late_clients

log = logging.getLogger("edgepfl")


@dataclass
class ClientReply:
    message: Message
    num_samples: int
    stats: dict[str, float] = field(default_factory=dict)
    flops: int | None = None  # counted local-training FLOPs (None: not measured)
    # the bytes the client sent where ``message`` is not what it sent (a secure sum's
    # share); None: ``message``'s
    sent_bytes: int | None = None

    @property
    def nbytes(self) -> int:
        return self.message.nbytes if self.sent_bytes is None else self.sent_bytes


class TooFewReplies(EdgepflError):
    """Fewer usable replies than ``faults.min_replies`` asks: the round cannot go on."""


class NothingTrained(EdgepflError):
    """No reply was aggregated in any round of a run: its model is the initial one."""


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
    # the replies are shares of a sum the transport computed (secure aggregation): each
    # is its aggregator's mean with weight 1, already private where DP is on
    summed: bool = False

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
        return {c: self.replies[c].nbytes for c in clients
                if c in self.replies and c not in self.late}

    def priced_up(self, clients: list[int]) -> dict[int, int]:
        """Uploads as sent, late ones too: they occupy the link until the deadline."""
        return {c: self.replies[c].nbytes for c in clients if c in self.replies}

    def flops(self, clients: list[int]) -> dict[int, int]:
        return {c: self.replies[c].flops or 0 for c in clients if c in self.replies}


@dataclass
class Figures:
    """A client's evaluation: correct predictions, test samples, summed loss; ``extra``
    the (correct, summed loss) of its other named predictions (``Client.predictive``);
    ``val`` the personalized prediction's (correct, samples, summed loss) on its
    validation split (``eval.validation``)."""

    correct: int
    count: int
    loss: float
    extra: dict[str, tuple[int, float]] = field(default_factory=dict)
    val: tuple[int, int, float] | None = None


class Transport(ABC):
    """How the round's messages reach the clients and their replies come back."""

    #: whether ``train`` reports each client's FLOPs (the simulation counts them)
    counts_flops: bool = False
    #: whether it serves held-out clients (``eval.new_clients``, ``evaluate_new``)
    serves_new_clients: bool = False
    #: whether ``train`` returns, in place of each reply, its aggregator's securely summed
    #: mean (``privacy.secure_aggregation`` on Flower; ``privacy.secure_sum``)
    secure_sum: bool = False

    @abstractmethod
    def train(self, step: object, messages: dict[int, Message]
              ) -> dict[int, ClientReply | ClientFailure]:
        """Deliver ``messages`` (client -> what it receives) for client step ``step`` (the
        round in a star; (round - 1) * k2 + edge round in a hierarchy, which seeds the
        clients' work) and return each client's reply in the order of ``messages``, or
        the ``ClientFailure`` that took its place."""

    @abstractmethod
    def evaluate(self, rnd: int, messages: dict[int, Message | None]) -> dict[int, Figures]:
        """Each client's personalized model on its own test split."""

    def evaluate_new(self, rnd: int, messages: dict[int, Message | None]) -> dict[int, Figures]:
        """Each held-out client (``eval.new_clients``) served its message, adapted as its
        method would (``Client.new_client_model``) and scored on its own test split."""
        raise NotImplementedError(f"{type(self).__name__} does not serve new clients")

    def close(self) -> None:
        """Release what the transport holds between rounds (worker processes)."""
        return None


def check_runtime(cfg: Config, system: SystemModel | None, flops: bool, counts_flops: bool,
                  transport_serves_new: bool = False) -> None:
    """Refuse the settings a runtime cannot honour: ``flops``, FLOPs are counted;
    ``counts_flops``, the transport's clients report theirs (the simulation's do);
    ``transport_serves_new``, it serves held-out clients (``eval.new_clients``)."""
    if cfg.topology.mode == "async" and (system is None or not (flops and counts_flops)):
        raise ConfigError("topology.mode = 'async' schedules each edge by its clients' "
                          "simulated time, which needs the simulation's system model with "
                          "system.count_flops = true (and is not available on Flower, "
                          "whose time is real)")
    if cfg.eval.new_clients and not transport_serves_new:
        raise ConfigError(f"eval.new_clients = {cfg.eval.new_clients} serves held-out clients "
                          "at evaluation, which only the simulation does (a Flower "
                          "SuperNode cannot be held out and served); set eval.new_clients = 0")
    t, every = cfg.train, cfg.eval.every
    if t.early_stopping and not can_stop_early(t.rounds, every, t.early_stopping):
        log.warning("train.early_stopping = %d needs %d evaluated rounds before the last "
                    "to stop a run early, and train.rounds = %d with eval.every = %d has "
                    "%d: this run will not stop early", t.early_stopping,
                    t.early_stopping + 1, t.rounds, every, (t.rounds - 1) // every)
    f = cfg.faults
    if f.client_timeout is not None and not counts_flops:
        raise ConfigError("faults.client_timeout bounds a simulated client's step in a worker "
                          "process; on Flower the server's wait for replies is bounded by the "
                          "run config's timeout: set faults.client_timeout = none")
    if f.drop_rate or f.straggler_rate or f.deadline is not None:
        if not counts_flops:
            raise ConfigError("faults.drop_rate, faults.straggler_rate and faults.deadline "
                              "inject failures into the simulation; on Flower clients fail "
                              "for real (faults.min_replies says how many replies a round "
                              "needs); set them to 0 / none")
        timed = system is not None and (flops or system.compute_s is not None)
        if (f.straggler_rate or f.deadline is not None) and not timed:
            raise ConfigError("faults.straggler_rate and faults.deadline act on the clients' "
                              "simulated time, which needs system.count_flops = true (or "
                              "system.profile = 'wen_table2')")


def deliver(transport: Transport, f: FaultsConfig, seed: int, system: SystemModel | None,
            step: object, down: dict[int, Message],
            cells: list[list[int]] | None = None) -> Delivery:
    """Send ``down`` over ``transport``, less the clients the fault model drops (``f``,
    drawn from the run seed and the step), and mark the replies later than
    ``faults.deadline`` by the system model's clock (``late_clients``, under the round's
    timing). ``cells``: the groups of clients that share a band and wait for each other's
    phases (each edge's clients in a hierarchy; default: all of ``down``)."""
    faults = draw_faults(seed, step, list(down), f.drop_rate, f.straggler_rate)
    got = transport.train(step, {c: m for c, m in down.items() if c not in faults.dropped})
    replies = {c: r for c, r in got.items() if isinstance(r, ClientReply)}
    delivery = Delivery(replies, faults.dropped,
                        slowdown=dict.fromkeys(faults.stragglers, f.straggler_delay),
                        deadline=f.deadline,
                        lost={c: str(r) for c, r in got.items() if isinstance(r, ClientFailure)},
                        summed=transport.secure_sum)
    if f.deadline is not None:
        assert system is not None  # check_runtime: a deadline needs the system model's clock
        late: set[int] = set()
        for cell in (cells if cells is not None else [list(down)]):
            mine = [c for c in cell if c in replies]
            times = system.client_times(
                mine, delivery.bytes_down(down, mine), delivery.priced_up(mine),
                delivery.flops(mine), delivery.slowdown)
            late |= late_clients(times, f.deadline, system.cfg.round_timing)
        delivery.late = frozenset(late)
    return delivery


def client_times(delivery: Delivery, sent_down: dict[int, int], system: SystemModel | None,
                 ) -> tuple[dict[int, float], dict[int, float]]:
    """Each timed client's round time (download, training, upload) and its training time
    alone: every client that trained and replied, the late ones too (their time is what
    made them late: leaving them out would rank the slowest devices nowhere), not the
    refused ones. Simulated by ``system`` (given where FLOPs are counted) as the round is
    priced (the downlink shared among every reply), else as the client measured its
    training (``train_s``, on Flower: both are that time); clients with neither are left
    out."""
    timed = sorted(c for c in delivery.replies if c not in delivery.rejected)
    if system is not None:
        received = sorted(delivery.replies)
        times = system.client_times(received, sent_down, delivery.priced_up(received),
                                    delivery.flops(received), delivery.slowdown)
        finite = {c: times[c] for c in timed if c in times and math.isfinite(sum(times[c]))}
        return ({c: d + t + u for c, (d, t, u) in finite.items()},
                {c: t for c, (_, t, _) in finite.items()})
    measured = {c: float(delivery.replies[c].stats["train_s"]) for c in timed
                if math.isfinite(delivery.replies[c].stats.get("train_s", math.nan))}
    return measured, dict(measured)


def participants(down: Mapping[int, Message], sampled: list[int], fed: Federation,
                  rnd: int) -> list[int]:
    """The star round's participants: the clients the server configured, which must
    include every sampled one and may add only clients that train."""
    ids = list(down)
    if (not ids or not all(isinstance(c, int) and not isinstance(c, bool) for c in ids)
            or not set(sampled) <= set(ids) or not set(ids) <= set(fed.trained)):
        raise MessageError(
            f"round {rnd}: the algorithm configured clients {sorted(ids, key=str)[:20]} but "
            f"the round selected {sampled}; a server messages every selected client and may "
            f"add only clients that train (ids 0..{fed.num_clients - 1}, not held out by "
            "eval.new_clients)")
    return sorted(ids)


def check_keys(messages: Mapping[int, Message], expected: list[int], where: str, what: str) -> None:
    if set(messages) != set(expected):
        raise MessageError(f"{where}: the algorithm configured {what} {sorted(messages)} but the "
                           f"round selected {expected}")
