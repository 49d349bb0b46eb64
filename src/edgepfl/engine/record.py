"""A round as data: what ``Rounds.play`` returns, and what every observer of the round
reads (the ledger, the system costs, the metrics row, the algorithm's ``Reporter``).

A record holds what happened, not what it means: who was asked, what each link carried,
the client step's ``Delivery`` (replies, drops, late and refused ones), the losses the
replies reported and the server's FLOPs. What follows from it (a round's simulated time,
a client's round time, the metrics columns) is computed by the observer that wants it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from edgepfl.contract.algorithm import Timing
from edgepfl.engine.transport import Delivery, client_times

if TYPE_CHECKING:
    from edgepfl.engine.ledger import EdgeBook
    from edgepfl.system import SystemModel


@dataclass
class RoundRecord:
    """One round. ``selected``: the clients asked to train (a star's: the server's
    participants); ``bytes_down`` / ``bytes_up``: each client's link as counted (a star's;
    a hierarchy counts in its ``book``); ``traffic``: the metrics row's traffic and
    client columns; ``losses``: (training loss, samples) of every aggregated reply that
    reported one. A star round keeps its client step's ``delivery`` and the server's
    counted FLOPs (``server_flops``, None where FLOPs are not counted); a hierarchy its
    ``book`` of edge accounts and, when asynchronous, its ``plan`` (edge rounds per edge;
    None: every edge ran ``edge_rounds``)."""

    round: int
    selected: list[int]
    started: float
    losses: list[tuple[float, int]] = field(default_factory=list)
    asked: int = 0  # client replies asked for
    aggregated: int = 0  # of them, reached an aggregate
    nonfinite: int = 0  # of them, refused for NaN or Inf values
    bytes_down: dict[int, int] = field(default_factory=dict)
    bytes_up: dict[int, int] = field(default_factory=dict)
    traffic: dict[str, float] = field(default_factory=dict)
    delivery: Delivery | None = None
    server_flops: int | None = None
    book: EdgeBook | None = None
    plan: list[int] | None = None
    system: SystemModel | None = None
    counting: bool = False  # the clients' FLOPs are counted (the simulation's system model)
    _timing: Timing | None = field(default=None, repr=False)

    def timing(self) -> Timing | None:
        """Each replied client's round time (``contract.algorithm.Timing``), on first call:
        only a reporter that asks (HMPL's tiers) pays for it; None in a hierarchy."""
        if self.delivery is None:
            return None
        if self._timing is None:
            times, compute = client_times(self.delivery, self.bytes_down,
                                          self.system if self.counting else None)
            flops = self.delivery.flops(sorted(times)) if self.counting else None
            self._timing = Timing(times, compute, flops)
        return self._timing
