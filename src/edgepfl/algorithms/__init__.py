"""Algorithm registry: one module per algorithm, each exporting ``ALGORITHM``."""

from __future__ import annotations

from edgepfl.algorithms import fedavg, fedprox, kapc, local
from edgepfl.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    Server,
    ServerContext,
    UpdateResult,
)
from edgepfl.errors import ConfigError

ALGORITHMS: dict[str, Algorithm] = {m.ALGORITHM.name: m.ALGORITHM for m in (local, fedavg, fedprox, kapc)}
ALGORITHMS.update({a.name: a for a in kapc.ALGORITHMS})


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ConfigError(f"algorithm.name = {name!r} is not a known algorithm; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "Algorithm", "Client", "ClientContext", "Hyperparameters", "Server",
           "ServerContext", "UpdateResult", "get_algorithm"]
