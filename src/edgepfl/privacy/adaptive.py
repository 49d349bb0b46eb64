"""Adaptive clipping for client-level DP (``privacy.clip = "adaptive"``): Andrew, Thakkar,
McMahan and Ramaswamy, 'Differentially Private Learning with Adaptive Clipping', NeurIPS
2021 (Algorithm 1, the geometric update).

Each aggregation of m replies, each aggregator with its own clip C (the server; each edge
in a hierarchy), also releases how many updates the clip left whole:

    b_i = [||update_i|| <= C],   b~ = (sum_i b_i + N(0, sigma_b^2)) / m,
    C <- C exp(-clip_lr (b~ - target_quantile))

so C moves towards the ``target_quantile`` of the update norms. The update sum is noised
with the multiplier z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), z = ``noise_multiplier``: the
two Gaussian queries (the clipped sum, sensitivity 2 C under replace-one, and the count,
sensitivity 1) together are one Gaussian mechanism of multiplier z (the paper's Section 3),
so the accountant keeps accounting z, and epsilon is the fixed clip's.

The clips are run state: each client's entry in ``ledger.privacy["clip"]`` is its
aggregator's clip, so a checkpoint keeps them and a resumed run goes on from them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from edgepfl.errors import ConfigError
from edgepfl.federation.topology import CLOUD, Federation

KEY = "clip"


def delta_multiplier(z: float, count_stddev: float) -> float:
    """The update sum's noise multiplier that, with noise ``count_stddev`` on the count of
    unclipped updates, spends what one Gaussian query of multiplier ``z`` spends; z = 0
    (no guarantee) gives 0. ValueError when the count's noise alone spends more."""
    if z == 0:
        return 0.0
    if 2 * count_stddev <= z:
        raise ValueError(f"the count's noise std {count_stddev:g} is at most "
                         f"privacy.noise_multiplier / 2 = {z / 2:g}")
    return float((z ** -2 - (2 * count_stddev) ** -2) ** -0.5)


def next_clip(clip: float, fraction: float, target: float, lr: float) -> float:
    """The geometric update: C exp(-lr (fraction unclipped - target))."""
    return clip * math.exp(-lr * (fraction - target))


class AdaptiveClip:
    """Each aggregator's clip, kept in the ledger; ``sampled``: how many clients each
    aggregator samples (one for the server; one per edge)."""

    def __init__(self, p: Any, federation: Federation, sampled: list[int]):
        self.p = p
        self.federation = federation
        self.stddev = [p.clip_count_stddev if p.clip_count_stddev is not None else k / 20
                       for k in sampled]
        self.multiplier: list[float] = []
        for k, std in zip(sampled, self.stddev, strict=True):
            try:
                self.multiplier.append(delta_multiplier(p.noise_multiplier, std))
            except ValueError as exc:
                given = ("privacy.clip_count_stddev" if p.clip_count_stddev is not None
                         else f"its default, {k} sampled clients / 20")
                raise ConfigError(
                    f"privacy.clip = 'adaptive': {exc} ({given}), so no noise on the update "
                    f"sum keeps the total at privacy.noise_multiplier = {p.noise_multiplier:g}; "
                    f"set privacy.clip_count_stddev above {p.noise_multiplier / 2:g} (e.g. "
                    f"{p.noise_multiplier:g}) or lower privacy.noise_multiplier") from None
        self.ledger: Any = None
        self.used: list[tuple[float, float]] = []  # this round's (clip, b~) per aggregation

    def _index(self, aggregator: int) -> int:
        return 0 if aggregator == CLOUD else aggregator

    def _members(self, aggregator: int) -> list[int]:
        if aggregator == CLOUD:
            return list(range(self.federation.num_clients))
        return list(self.federation.members(aggregator))

    def _first(self, aggregator: int) -> int:
        """A client of ``aggregator``: each holds its aggregator's clip."""
        return 0 if aggregator == CLOUD else self.federation.members(aggregator)[0]

    def bind(self, ledger: Any) -> None:
        """Keep the clips in ``ledger`` (a new run's start at ``privacy.clip_initial``)."""
        self.ledger = ledger
        if KEY not in ledger.privacy:
            ledger.privacy[KEY] = [float(self.p.clip_initial)] * ledger.num_clients

    def clip(self, aggregator: int) -> float:
        return float(self.ledger.privacy[KEY][self._first(aggregator)])

    def noise_multiplier(self, aggregator: int) -> float:
        return self.multiplier[self._index(aggregator)]

    def update(self, aggregator: int, replies: int, unclipped: int,
               gen: torch.Generator) -> None:
        """The clip after an aggregation of ``replies`` replies, ``unclipped`` of which the
        clip left whole; the count's noise is drawn from ``gen``."""
        clip = self.clip(aggregator)
        std = self.stddev[self._index(aggregator)]
        noise = float(torch.randn((), generator=gen, dtype=torch.float64)) * std if std else 0.0
        fraction = (unclipped + noise) / replies
        new = next_clip(clip, fraction, self.p.target_quantile, self.p.clip_lr)
        clips = self.ledger.privacy[KEY]
        for cid in self._members(aggregator):
            clips[cid] = new
        self.used.append((clip, fraction))

    def row(self) -> dict[str, float]:
        """The round's clip and noised fraction unclipped (means over its aggregations)."""
        used, self.used = self.used, []
        if not used:
            return {"clip": math.nan, "clip_quantile_est": math.nan}
        return {"clip": sum(c for c, _ in used) / len(used),
                "clip_quantile_est": sum(b for _, b in used) / len(used)}

    def final(self, ledger: Any) -> float | list[float]:
        """Each aggregator's clip after the run: the server's, or a list of the edges'."""
        if ledger is not None:
            self.bind(ledger)
        else:
            return float(self.p.clip_initial)
        if self.federation.hierarchical:
            return [self.clip(k) for k in range(self.federation.edges)]
        return self.clip(CLOUD)
