"""What a client's work costs is the runtime's business; which part of it is not a cost of
the round is the algorithm's: ``not_counted`` marks evaluation-only work inside an update
(FedBABU's fine-tuning), and the runtime's FLOP meter leaves it out. ``counted_once`` marks
work that repeats with the same shapes (a training step per batch shape), so that the meter
counts it once and lets the repeats run at full speed.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils.flop_counter import FlopCounterMode


@dataclass
class ActiveCount:
    counter: FlopCounterMode
    excluded: int = 0
    depth: int = 0  # of open ``not_counted`` blocks: only the outermost one is measured
    replayed: int = 0  # FLOPs of ``counted_once`` repeats, which ran outside the counter
    repeats: dict[Hashable, int] = field(default_factory=dict)
    offset: int = 0  # the counter's total before it was last re-entered (which clears it)

    def total(self) -> int:
        """FLOPs the counter has seen in this measured block."""
        return self.offset + int(self.counter.get_total_flops())


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
    before = active.total()
    active.depth += 1
    try:
        yield
    finally:
        active.depth -= 1
        active.excluded += active.total() - before


@contextmanager
def counted_once(key: Hashable) -> Iterator[None]:
    """Run a block whose FLOPs are a function of ``key`` (shapes, not values): the first
    time within the enclosing ``FlopMeter.measure`` it is counted, every later time it runs
    with the counter off and its first count is added instead.

    The counter is a dispatch mode that sees every operator (a counted training step takes
    about 2.5x a plain one); a client's hundreds of steps repeat a handful of batch shapes.
    Outside a measured block it simply runs the block. The caller makes ``key`` unique to
    the work's code path (e.g. one object per ``Trainer.fit`` call plus the batch shape).
    """
    active = ACTIVE.get()
    if active is None:
        yield
        return
    known = active.repeats.get(key)
    counter = active.counter
    if known is None or counter.mode is None or _get_current_dispatch_mode() is not counter.mode:
        # first time, or another dispatch mode sits above the counter: count it
        before = active.total()
        yield
        active.repeats.setdefault(key, active.total() - before)
        return
    # The whole counter steps aside, its module tracker too (whose hooks on every module
    # call and output would otherwise cost a tenth of a step); re-entering clears its
    # tally, which ``offset`` keeps.
    seen = active.total()
    counter.__exit__(None, None, None)
    try:
        yield
    finally:
        counter.__enter__()
        active.offset = seen
    active.replayed += known
    if active.depth:  # inside ``not_counted``: left out, as its counted first time was
        active.excluded += known
