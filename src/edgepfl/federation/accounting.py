"""What a client's work costs is the runtime's business; which part of it is not a cost of
the round is the algorithm's: ``not_counted`` marks evaluation-only work inside an update
(FedBABU's fine-tuning), and the runtime's FLOP meter leaves it out. ``counted_once`` marks
work that repeats with the same shapes (a training step per batch shape), so that the meter
counts it once and lets the repeats run at full speed; ``counter_aside`` keeps the counter
off for the FLOP-free glue between such blocks.
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
    repeats: dict[Hashable, tuple[int, int]] = field(default_factory=dict)
    offset: int = 0  # the counter's total before it was last re-entered (which clears it)
    aside: bool = False  # inside ``counter_aside``: the counter is off but for new blocks
    replaying: int = 0  # of open replayed blocks: their first count holds what they nest

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
def counted_once(key: Hashable, store: dict[Hashable, tuple[int, int]] | None = None
                 ) -> Iterator[None]:
    """Run a block whose FLOPs are a function of ``key`` (shapes, not values): the first
    time within the enclosing ``FlopMeter.measure`` it is counted, every later time it runs
    with the counter off and its first count is added instead.

    The counter is a dispatch mode that sees every operator (a counted training step takes
    about 2.5x a plain one); a client's hundreds of steps repeat a handful of batch shapes.
    Outside a measured block it simply runs the block. The caller makes ``key`` unique to
    the work's code path (e.g. one object per ``Trainer.fit`` call plus the batch shape).
    With ``store`` (a dict the caller keeps, e.g. one per module skeleton) the count
    outlives the measured block: every client of an architecture then shares the counts
    of its batch shapes, so only the federation's first step of each shape is counted.
    A count is kept with the part of it that nested ``not_counted`` blocks left out, and a
    repeat leaves that part out again.
    """
    active = ACTIVE.get()
    if active is None or active.replaying:
        yield
        return
    counts = active.repeats if store is None else store
    known = counts.get(key)
    counter = active.counter
    if active.aside:
        if known is None:  # the counter comes back for this block only
            with _counter_on(active), _first_count(active, key, counts):
                yield
            return
        with _replaying(active):
            yield
    elif known is None or counter.mode is None or _get_current_dispatch_mode() is not counter.mode:
        # first time, or another dispatch mode sits above the counter: count it
        with _first_count(active, key, counts):
            yield
        return
    else:
        with _counter_off(active), _replaying(active):
            yield
    flops, left_out = known
    active.replayed += flops
    # inside ``not_counted`` all of it is left out, as its counted first time was
    active.excluded += flops if active.depth else left_out


@contextmanager
def _first_count(active: ActiveCount, key: Hashable,
                 counts: dict[Hashable, tuple[int, int]]) -> Iterator[None]:
    """Count a block and keep (its FLOPs, the part nested ``not_counted`` blocks left out).

    Inside an enclosing ``not_counted`` the nested ones are measured all the same (so that a
    repeat outside it knows its part), and the enclosing one then leaves the whole out."""
    before, excluded, depth = active.total(), active.excluded, active.depth
    active.depth = 0
    try:
        yield
    finally:
        active.depth = depth
    left_out = active.excluded - excluded
    if depth:
        active.excluded = excluded
    counts.setdefault(key, (active.total() - before, left_out))


@contextmanager
def counter_aside() -> Iterator[None]:
    """Run a loop of ``counted_once`` blocks with the counter off between them.

    For the glue of a repeated step that does no counted arithmetic (drawing a batch by
    index, normalising it): under the counter each of its operators would be a dispatch
    through Python, in every step of a counted update. Inside, only a ``counted_once``
    block whose key is new runs under the counter; so everything with FLOPs in the block
    must be in one. Outside a measured block, or where another dispatch mode sits above
    the counter, it simply runs the block.
    """
    active = ACTIVE.get()
    if (active is None or active.aside or active.replaying or active.counter.mode is None
            or _get_current_dispatch_mode() is not active.counter.mode):
        yield
        return
    with _counter_off(active):
        active.aside = True
        try:
            yield
        finally:
            active.aside = False


@contextmanager
def _replaying(active: ActiveCount) -> Iterator[None]:
    """A block whose first count is being added instead of counted: what it nests was in
    that count already."""
    active.replaying += 1
    try:
        yield
    finally:
        active.replaying -= 1


@contextmanager
def _counter_off(active: ActiveCount) -> Iterator[None]:
    """The whole counter steps aside, its module tracker too (whose hooks on every module
    call and output would otherwise cost a tenth of a step); re-entering clears its tally,
    which ``offset`` keeps."""
    active.counter.__exit__(None, None, None)
    try:
        yield
    finally:
        seen = active.total()  # blocks counted meanwhile (``counter_aside``) included
        active.counter.__enter__()
        active.offset = seen


@contextmanager
def _counter_on(active: ActiveCount) -> Iterator[None]:
    """The counter back for one block inside ``counter_aside`` (its tally, cleared on
    entering, is kept in ``offset``); blocks nested in it count as outside the loop."""
    seen = active.total()
    active.counter.__enter__()
    active.offset = seen
    active.aside = False
    try:
        yield
    finally:
        active.aside = True
        active.counter.__exit__(None, None, None)
