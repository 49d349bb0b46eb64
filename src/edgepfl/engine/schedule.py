"""What changes over a run's rounds: the clients' learning rate (``train.lr_decay``) and
whether the run stops early (``train.early_stopping``).

Both are pure functions of the configuration and of what a run already records (the
client step, the metrics rows), never of hidden state: the simulation, its worker
processes, a Flower node that sees only a message's step, and a resumed run all arrive at
the same rate and the same last round.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepfl.config import Config, TrainConfig

if TYPE_CHECKING:
    from edgepfl.contract.algorithm import Client


# -- learning rate --------------------------------------------------------------------------
def client_lr(train: TrainConfig, step: int, total: int) -> float:
    """The rate of client step ``step`` of ``total`` (1-based): ``train.lr`` at the first,
    ``train.lr_final`` at the last, monotone between; ``train.lr`` itself without decay.
    A step past ``total`` keeps the last rate."""
    if train.lr_decay == "none" or train.lr_final is None or total <= 1:
        return train.lr
    start, end = train.lr, train.lr_final
    if step >= total:
        return end
    frac = (max(step, 1) - 1) / (total - 1)
    if train.lr_decay == "linear":
        rate = start * (1 - frac) + end * frac
    elif train.lr_decay == "cosine":
        rate = end + (start - end) * (1 + math.cos(math.pi * frac)) / 2
    else:  # exponential: the same factor every step
        rate = start * (end / start) ** frac
    # float rounding must not carry a rate past either end
    return min(start, max(end, rate))


def total_steps(cfg: Config) -> int:
    """Client steps the decay spreads over: ``train.lr_decay_rounds`` (default the run's
    rounds), times k2 in a hierarchy."""
    rounds = cfg.train.lr_decay_rounds or cfg.train.rounds
    return rounds * cfg.topology.edge_rounds


def step_number(cfg: Config, step: object) -> int:
    """A transport's client step as a number: a star's round, (round - 1) * k2 + s in a
    hierarchy; an asynchronous edge's extra edge round (``("async", round, s)``, s > k2)
    trains at the rate of its cloud round's last synchronous step."""
    if isinstance(step, tuple):
        return int(step[1]) * cfg.topology.edge_rounds
    return int(step)  # type: ignore[call-overload]


def step_lr(cfg: Config, step: object) -> float:
    """The learning rate clients train at in client step ``step`` of a run of ``cfg``."""
    return client_lr(cfg.train, step_number(cfg, step), total_steps(cfg))


def round_lr(cfg: Config, rnd: int) -> float:
    """The rate of round ``rnd``'s first client step (its only one in a star)."""
    return client_lr(cfg.train, (rnd - 1) * cfg.topology.edge_rounds + 1, total_steps(cfg))


@contextmanager
def training_rate(part: Client, lr: float) -> Iterator[None]:
    """``part`` sees ``ctx.train.lr = lr`` for the duration: the one client part of an
    architecture serves every client, so the step's rate is lent to it per update rather
    than written into any algorithm. Everything an algorithm derives from ``train.lr``
    inside ``update`` follows; rates of its own (``algorithm.*_lr``) do not."""
    ctx = part.ctx
    if lr == ctx.train.lr:
        yield
        return
    part.ctx = replace(ctx, train=ctx.train.model_copy(update={"lr": lr}))
    try:
        yield
    finally:
        part.ctx = ctx


# -- early stopping -------------------------------------------------------------------------
def early_stop(metrics: Sequence[dict], patience: int, delta: float = 0.0,
               key: str = "acc_mean") -> dict[str, Any] | None:
    """The round a run with ``train.early_stopping = patience`` stops at, from its metrics
    rows alone, or None while it goes on (and always with ``patience = 0``).

    Over the evaluated rows (``key`` not NaN: ``acc_mean``, or ``val_acc_mean`` with a
    validation split), in order: the first sets the reference;
    a later one that beats it by more than ``delta`` becomes the reference; any other
    counts one evaluation without improvement, and the ``patience``-th in a row stops the
    run at its round. The reference is the last accuracy that improved by more than
    ``delta``, so a run of gains each at most ``delta`` still stops."""
    if patience <= 0:
        return None
    best: float | None = None
    best_round, waited = 0, 0
    for row in metrics:
        acc = row.get(key)
        if acc is None or math.isnan(acc):
            continue
        if best is None or acc > best + delta:
            best, best_round, waited = acc, int(row["round"]), 0
            continue
        waited += 1
        if waited >= patience:
            gain = f"by more than {delta:g} " if delta else ""
            what = "validation accuracy" if key.startswith("val_") else "accuracy"
            return {"round": int(row["round"]), "best_round": best_round, key: best,
                    "reason": f"the mean client {what} did not improve {gain}on "
                              f"{best:.4f} (round {best_round}) in {patience} evaluated "
                              f"round{'s' if patience > 1 else ''} (train.early_stopping = "
                              f"{patience})"}
    return None


def can_stop_early(rounds: int, every: int, patience: int) -> bool:
    """Whether a run of ``rounds`` evaluated every ``every`` rounds has the ``patience`` + 1
    evaluated rounds before its last that an early stop needs (one at the last round ends
    the run anyway)."""
    return patience > 0 and (rounds - 1) // every > patience


def async_edge_rounds(times: list[float | None], k2: int,
                      debt: list[float] | None = None) -> list[int]:
    """Edge rounds of each edge in the next cloud period of an asynchronous hierarchy.

    The cloud period is P = k2 times the median edge's edge-round time t. An edge's
    ``debt`` is the work it still has in hand beyond the periods elapsed (``async_debt``);
    it runs the edge rounds that fit in what is left of the period, to the nearest whole
    round: round((P - debt) / t). So edges of equal speed run k2, as the synchronous
    schedule does (and so does one without debt within a factor 1 +- 1/(2 k2) of the
    median), and a faster one more. An edge with
    debt that earns no round is still busy: it takes no new model, and the cloud aggregates
    the model it last reported, stale. A free edge (no debt) always starts at least one
    round, so an edge too slow for one round in a period starts one that takes several
    periods and is busy in those after it, rather than never running again. Before any edge
    has been timed (the first period) every edge runs k2."""
    timing = _period(times, k2)
    if timing is None:
        return [k2] * len(times)
    period, timed = timing
    debt = debt or [0.0] * len(times)
    plan = []
    for t, d in zip(timed, debt, strict=True):
        n = max(0, int(math.floor((period - d) / t + 0.5)))
        plan.append(1 if n == 0 and d <= 0 else n)
    return plan


def async_debt(times: list[float | None], k2: int, plan: list[int],
               debt: list[float]) -> list[float]:
    """Each edge's work in hand after a cloud period of ``plan``'s edge rounds at the
    ``times`` measured: its debt, plus its rounds' time, less the period (k2 times the
    median time), never below 0 (an edge that finishes early waits; it banks no time)."""
    timing = _period(times, k2)
    if timing is None:
        return list(debt)
    period, timed = timing
    return [max(0.0, d + n * t - period) for t, n, d in zip(timed, plan, debt, strict=True)]


def _period(times: list[float | None], k2: int) -> tuple[float, list[float]] | None:
    """The cloud period, k2 times the median edge-round time, and the times it is of; None
    until every edge has a time (positive and finite)."""
    timed = [t for t in times if t is not None and math.isfinite(t) and t > 0]
    if len(timed) < len(times):
        return None
    return k2 * float(np.median(timed)), timed
