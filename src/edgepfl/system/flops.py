"""FLOPs of real code, counted by PyTorch's ``FlopCounterMode`` (no hand-written formulas).

What is counted is what ``torch.utils.flop_counter`` has formulas for: matrix products and
convolutions, forward and backward (2 FLOPs per multiply-add), the bulk of training and
of matrix-style aggregation. Element-wise work (activations, pooling, optimizer updates,
``mean`` over a stack) counts zero, as in the ``thop`` counts of KAPC's Table 6.

Counting costs time: the counter is a dispatch mode that sees every operator. Training
``cnn2`` (batch 32, plain SGD, CPU) measured 1.27-1.31x slower under it. Local training
is a function of shapes, not values (the client's sample count, the shapes of the message
and state, the config), so ``FlopMeter`` counts a piece of work once per caller-given key
(e.g. client id plus the shapes of what it received) and reuses the count on later
rounds; the caller chooses what goes into the key, and ``work_signature`` builds one.

Work a client does only so that it can be evaluated (FedBABU fine-tunes a personal model
each round because evaluation here has no client data; the paper does it once, at test
time) is not a cost of the round: the client wraps it in ``not_counted()``, and the meter
leaves it out of the count and hence out of the simulated compute time.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from edgepfl.federation.accounting import ACTIVE, ActiveCount


@dataclass
class FlopCount:
    """Result of one measured block; ``flops`` is set when the block exits."""

    flops: int | None = None
    cached: bool = False
    excluded: int = 0  # FLOPs of ``not_counted`` blocks, left out of ``flops``


class FlopMeter:
    """Counts FLOPs of code blocks; with ``cache`` it reuses counts of repeated work.

    >>> meter = FlopMeter()
    >>> with meter.measure(key=("client", arch, work_shape, work_signature(msg, state))) as m:
    ...     result = client.update(cid, msg, state, data, gen)
    >>> m.flops  # counted the first time this key is seen, reused afterwards

    ``key=None`` always counts (use it for server work, whose cost may depend on values,
    such as cluster sizes). A disabled meter runs the block and reports ``None``.
    """

    def __init__(self, enabled: bool = True, cache: bool = True):
        self.enabled = enabled
        self.cache = cache
        if enabled:
            _load_counter()
        self._counts: dict[Hashable, int] = {}
        self.hits = 0
        self.misses = 0

    @contextmanager
    def measure(self, key: Hashable | None = None) -> Iterator[FlopCount]:
        result = FlopCount()
        if not self.enabled:
            yield result
            return
        if self.cache and key is not None and key in self._counts:
            self.hits += 1
            yield result
            result.flops, result.cached = self._counts[key], True
            return
        counter = FlopCounterMode(display=False)
        active = ActiveCount(counter)
        token = ACTIVE.set(active)
        try:
            with counter:
                yield result
        finally:
            ACTIVE.reset(token)
        # Only reached when the block completed: a failed block caches nothing.
        result.excluded = active.excluded
        result.flops = active.total() + active.replayed - result.excluded
        self.misses += 1
        if self.cache and key is not None:
            self._counts[key] = result.flops

    def cached(self, key: Hashable) -> int | None:
        """The count kept for ``key`` (None: not counted yet, or no cache)."""
        return self._counts.get(key) if self.cache else None

    def record(self, key: Hashable, flops: int) -> int:
        """Keep a count made outside ``measure`` (a worker process) as if it had made it."""
        self.misses += 1
        if self.cache:
            self._counts[key] = flops
        return flops

    def reuse(self, key: Hashable) -> int | None:
        """The count kept for ``key``, as a hit of ``measure`` would give it (None: none)."""
        flops = self.cached(key)
        if flops is not None:
            self.hits += 1
        return flops

    def clear(self) -> None:
        self._counts.clear()


def _load_counter() -> None:
    """The counter's first operator imports ``torch._dynamo`` (about 3 s on the project
    machine, once per process): done when a meter is made, at a run's set-up, so that
    it is not charged to the first round's timings."""
    import torch._dynamo  # noqa: F401


def count_flops(fn, *args, **kwargs) -> tuple[Any, int]:
    """``(fn(*args, **kwargs), FLOPs it ran)``, counted without a cache."""
    with FlopCounterMode(display=False) as counter:
        out = fn(*args, **kwargs)
    return out, int(counter.get_total_flops())


def work_signature(*parts: Any) -> Hashable:
    """A hashable description of the work's inputs: tensor shapes and dtypes, not values.

    Accepts tensors, mappings of them, messages (anything with ``tensors`` and ``meta``),
    scalars, None and lists/tuples of these. Message metadata is included by value, because
    an algorithm may steer its local work with it (which layers to train, how many steps);
    a value that changes every round then simply means the work is counted every round.
    """
    return tuple(_sig(p) for p in parts)


def _sig(obj: Any) -> Hashable:
    if isinstance(obj, torch.Tensor):
        return ("T", tuple(obj.shape), str(obj.dtype), obj.requires_grad)
    if hasattr(obj, "tensors") and hasattr(obj, "meta"):  # a Message (no import: avoids a cycle)
        return ("M", _sig(obj.tensors), _sig(obj.meta))
    if isinstance(obj, Mapping):
        return ("D", tuple(sorted((str(k), _sig(v)) for k, v in obj.items())))
    if isinstance(obj, list | tuple):
        return ("L", tuple(_sig(v) for v in obj))
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"work_signature cannot describe a {type(obj).__name__}; pass tensors, "
                    "mappings, messages or scalars")
