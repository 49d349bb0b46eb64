"""FedProx (Li et al., MLSys 2020): FedAvg plus a proximal pull towards the global model.

The client minimises CE + mu/2 ||w - w_global||^2. Its gradient, mu (w - w_global), is
added to the CE gradient directly, so no autograd graph is built for it and mu = 0 adds
an exact zero (FedProx with mu = 0 is FedAvg bit for bit, which a test checks).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from edgepfl.algorithms.fedavg import PRIVACY, FedAvgClient, FedAvgHyperparameters, FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    LogUniform,
    SearchRange,
)
from edgepfl.contract.kit import proximal_hook
from edgepfl.federation.messages import Message


class FedProxHyperparameters(FedAvgHyperparameters):
    # the FedProx paper picks mu per data set from {0.001, 0.01, 0.1, 1}
    search_space: ClassVar[dict[str, SearchRange]] = {"mu": LogUniform(0.001, 1.0)}
    mu: float = Field(0.01, ge=0, description="proximal coefficient (FedProx paper tunes over 0.001-1)")


class FedProxClient(FedAvgClient):
    def grad_hook(self, msg: Message):
        anchor = self.trainer.place([msg.tensors[n] for n in self.trainer.param_names])
        return proximal_hook(self.hp.mu, anchor)


ALGORITHM = Algorithm(
    name="fedprox",
    summary="FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2 in the client loss",
    hyperparameters=FedProxHyperparameters,
    server=FedAvgServer,
    client=FedProxClient,
    heterogeneous=True,
    paper="Li et al., Federated Optimization in Heterogeneous Networks, MLSys 2020",
    privacy=PRIVACY,
)
