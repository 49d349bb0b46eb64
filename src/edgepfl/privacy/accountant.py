"""Privacy accounting, by Google's dp-accounting (``pip install 'edgepfl[privacy]'``): the
events below are handed to its accountants, never turned into epsilon by a formula here.

Client level (``privacy.level = "client"``). Every round an aggregator (the server; each
edge in a hierarchy) takes a uniformly random set of exactly K of its N clients, without
replacement (``federation.rng.select_clients``), and releases the sum of their clipped
updates plus Gaussian noise. That is dp-accounting's ``SampledWithoutReplacementDpEvent``
(Wang, Balle and Kasiviswanathan, AISTATS 2019, Theorem 27, in its RDP accountant), which
holds for the replace-one relation (a client's data replaced by another's; N is public).
Under replace-one a sum of updates of norm at most ``clip`` moves by up to 2 ``clip``, so
the library's noise multiplier (noise std / sensitivity) is ``noise_multiplier / 2``. In a
hierarchy an edge's clients train k2 edge rounds on one sample per cloud round: the event
samples once and applies k2 Gaussian mechanisms to the sample. A client's data reaches its
own edge's mechanism only, so its epsilon is its edge's, and the run's the largest.

Sample level (``privacy.level = "sample"``). Each DP-SGD step takes every sample of a
client independently with probability q = batch / n (Poisson) and adds noise to the sum of
clipped per-sample gradients: ``PoissonSampledDpEvent(q, GaussianDpEvent(noise))`` under
add-or-remove-one, as DP-SGD's analyses (Abadi et al. 2016; Mironov, Talwar and Zhang 2019)
and Opacus have it. A client's epsilon composes the steps it has run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

from edgepfl.errors import ConfigError

INSTALL = "pip install 'edgepfl[privacy]' (or pip install dp-accounting)"


def library() -> Any:
    """dp-accounting, or an error saying how to install it."""
    try:
        import dp_accounting
    except ImportError:
        raise ConfigError(f"privacy.level needs Google's dp-accounting for its privacy "
                          f"accounting: {INSTALL}") from None
    return dp_accounting


@contextmanager
def _quiet() -> Iterator[None]:
    # the RDP accountant logs each order it leaves out of a bound (a series that did not
    # converge) through absl: correct and expected at small noise, but a line per order
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


def client_event(num_clients: int, sample_size: int, noise_multiplier: float,
                 edge_rounds: int = 1) -> Any:
    """One round of client-level DP at an aggregator of ``num_clients`` that samples
    ``sample_size`` of them without replacement and releases ``edge_rounds`` noised sums
    of that sample."""
    dp = library()
    gaussian: Any = dp.GaussianDpEvent(noise_multiplier / 2)  # replace-one: sensitivity 2 clip
    if edge_rounds > 1:
        gaussian = dp.SelfComposedDpEvent(gaussian, edge_rounds)
    return dp.SampledWithoutReplacementDpEvent(num_clients, sample_size, gaussian)


@lru_cache(maxsize=4096)
def client_epsilon(groups: tuple[tuple[int, int], ...], noise_multiplier: float,
                   edge_rounds: int, rounds: int, delta: float) -> float:
    """Epsilon after ``rounds`` rounds of client-level DP, the largest over ``groups``
    (each aggregator's (clients, sample size): one in a star, one per edge)."""
    if rounds <= 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    dp = library()
    worst = 0.0
    for num_clients, sample_size in groups:
        accountant = dp.rdp.RdpAccountant(
            neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
        with _quiet():  # the RDP orders are computed as the events are composed
            accountant.compose(client_event(num_clients, sample_size, noise_multiplier,
                                            edge_rounds), rounds)
            worst = max(worst, float(accountant.get_epsilon(delta)))
    return worst


def sample_event(rate: float, noise_multiplier: float) -> Any:
    """One DP-SGD step: Poisson sampling at ``rate``, Gaussian noise on the clipped sum."""
    dp = library()
    return dp.PoissonSampledDpEvent(rate, dp.GaussianDpEvent(noise_multiplier))


def accountant_of(kind: str, relation: str = "add_remove") -> Any:
    """A fresh accountant of ``privacy.accountant`` for ``privacy.relation`` (replace_one:
    PLD only, dp-accounting's RDP has no Poisson sampling under it)."""
    dp = library()
    neighbours = {"add_remove": dp.NeighboringRelation.ADD_OR_REMOVE_ONE,
                  "replace_one": dp.NeighboringRelation.REPLACE_ONE}[relation]
    if kind == "pld":
        return dp.pld.PLDAccountant(neighbours)
    if relation != "add_remove":
        raise ValueError(f"the rdp accountant takes Poisson sampling under add_remove only, "
                         f"not {relation!r}")
    return dp.rdp.RdpAccountant(neighboring_relation=neighbours)


@lru_cache(maxsize=65536)
def sample_epsilon(events: tuple[tuple[float, int], ...], noise_multiplier: float,
                   delta: float, kind: str = "rdp", relation: str = "add_remove") -> float:
    """A client's epsilon after its DP-SGD steps: ``events`` is (sampling rate, steps) per
    rate it trained at (one, unless its data or batch size changed)."""
    events = tuple((rate, steps) for rate, steps in events if steps > 0 and rate > 0)
    if not events:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    accountant = accountant_of(kind, relation)
    with _quiet():  # the RDP orders are computed as the events are composed
        for rate, steps in events:
            accountant.compose(sample_event(rate, noise_multiplier), steps)
        return float(accountant.get_epsilon(delta))


def calibrate(epsilon_of: Callable[[float], float], target_epsilon: float,
              tol: float = 1e-2) -> float:
    """The smallest noise multiplier (within ``tol``) whose ``epsilon_of(noise)`` is at most
    ``target_epsilon``: dp-accounting's ``calibrate_dp_mechanism`` search, which returns a
    value on the budget's side of the root. ``epsilon_of`` is this module's accounting of a
    whole run (a run's epsilon is a maximum over aggregators or clients, which no single
    library event states), handed to the search as its accountant."""
    dp = library()
    mc = dp.mechanism_calibration

    class Run:
        ledger = dp.NoOpDpEvent()  # the search checks that each accountant starts empty

        def __init__(self) -> None:
            self.noise = math.nan

        def compose(self, noise: float, count: int = 1) -> Run:
            self.noise = noise
            return self

        def get_epsilon(self, delta: float) -> float:
            # the search brackets the root by signs: an infinite epsilon is only large
            return min(epsilon_of(self.noise), 1e12)

    with _quiet():
        return float(mc.calibrate_dp_mechanism(
            Run, lambda noise: noise, target_epsilon, 0.0,
            bracket_interval=mc.LowerEndpointAndGuess(0.05, 1.0), tol=tol))


def groups_of(sizes: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """(clients, sample size) of each aggregator, each kind once (their epsilon is one)."""
    return tuple(sorted(set(sizes)))
