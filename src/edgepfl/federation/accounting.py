"""What a client's work costs is the runtime's business; which part of it is not a cost of
the round is the algorithm's: ``not_counted`` marks evaluation-only work inside an update
(FedBABU's fine-tuning), and the runtime's FLOP meter leaves it out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from torch.utils.flop_counter import FlopCounterMode


@dataclass
class ActiveCount:
    counter: FlopCounterMode
    excluded: int = 0
    depth: int = 0  # of open ``not_counted`` blocks: only the outermost one is measured


ACTIVE: ContextVar[ActiveCount | None] = ContextVar("edgepfl_flop_meter", default=None)


@contextmanager
def not_counted() -> Iterator[None]:
    """Run a block whose FLOPs the enclosing ``FlopMeter.measure`` leaves out.

    For evaluation-only work inside a client's update; outside a measured block (or under
    a cached count) it simply runs the block.
    """
    active = ACTIVE.get()
    if active is None or active.depth:
        yield
        return
    before = active.counter.get_total_flops()
    active.depth += 1
    try:
        yield
    finally:
        active.depth -= 1
        active.excluded += active.counter.get_total_flops() - before
