"""Algorithm registry: one module per algorithm, each exporting ``ALGORITHM`` (or
``ALGORITHMS`` for a family). The order below is the order every listing shows."""

from __future__ import annotations

from edgepfl.algorithms import (
    apfl,
    clusterfl,
    dcpfl,
    ditto,
    fedala,
    fedamp,
    fedavg,
    fedbabu,
    fedbn,
    feddyn,
    fedmd,
    fedper,
    fedproto,
    fedprox,
    fedrep,
    fedrod,
    heterofl,
    hierbayes,
    hierfavg,
    hmpl,
    hypcluster,
    kapc,
    l2sgd,
    lgfedavg,
    local,
    moon,
    perfedavg,
    pfedbayes,
    pfedla,
    pfedme,
    scaffold,
)
from edgepfl.config import did_you_mean
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    Server,
    ServerContext,
    UpdateResult,
)
from edgepfl.errors import ConfigError

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    local.ALGORITHM,
    fedavg.ALGORITHM,
    fedprox.ALGORITHM,
    *kapc.ALGORITHMS,
    dcpfl.ALGORITHM,
    *perfedavg.ALGORITHMS,
    fedbn.ALGORITHM,
    fedbabu.ALGORITHM,
    moon.ALGORITHM,
    fedamp.ALGORITHM,
    fedproto.ALGORITHM,
    fedmd.ALGORITHM,
    pfedla.ALGORITHM,
    clusterfl.ALGORITHM,
    hierfavg.ALGORITHM,
    hierbayes.ALGORITHM,
    pfedbayes.ALGORITHM,
    heterofl.ALGORITHM,
    fedper.ALGORITHM,
    hypcluster.ALGORITHM,
    pfedme.ALGORITHM,
    l2sgd.ALGORITHM,
    *hmpl.ALGORITHMS,
    scaffold.ALGORITHM,
    ditto.ALGORITHM,
    fedrep.ALGORITHM,
    apfl.ALGORITHM,
    feddyn.ALGORITHM,
    lgfedavg.ALGORITHM,
    fedrod.ALGORITHM,
    fedala.ALGORITHM,
)}


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise ConfigError(f"algorithm.name = {name!r} is not a known algorithm"
                          f"{did_you_mean(str(name), ALGORITHMS)}; valid: {', '.join(ALGORITHMS)}")
    return ALGORITHMS[name]


__all__ = ["ALGORITHMS", "Algorithm", "Client", "ClientContext", "Hyperparameters", "Server",
           "ServerContext", "UpdateResult", "get_algorithm"]
