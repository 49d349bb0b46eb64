"""LG-FedAvg (Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov and Morency, *Think
Locally, Act Globally: Federated Learning with Local and Global Representations*,
arXiv:2001.01523, 2020): local representations, a global head.

The model is split into a local representation (the body: every layer before the last
``global_layers``), one per client, which never leaves it, and global layers (the head),
shared by all clients. FedPer's split from the other side: FedPer shares the body and
keeps the head. Each round:

* server: send the global head to the selected clients; head <- sum_i n_i head_i /
  sum_i n_i over the replies (FedAvg restricted to the head);
* client i: load the received head beside its own body, run SGD on both for
  ``train.local_epochs``, keep the body, send head_i and n_i.

A client predicts with its own body and the latest global head. ``global_layers`` counts
layers as ``LayerSpec`` does (parameterised modules from the output end, a BatchNorm
module is a layer of its own and its running statistics go with it), through FedPer's
``personal_names``; the default, 1, is the classifier (PFLlib's ``head``); all of the
model's layers global is FedAvg bit for bit (tested). See docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pydantic import Field

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.algorithms.fedper import KeptLayersClient, personal_names
from edgepfl.contract.algorithm import (
    Algorithm,
    ClientContext,
    Hyperparameters,
    IntRange,
    PrivacySupport,
    SearchRange,
    ServerContext,
)
from edgepfl.errors import ConfigError
from edgepfl.models.layers import LayerSpec

LOCAL = "local."  # the client's local representation in its state


class LGFedAvgHyperparameters(Hyperparameters):
    # how much of the model is global: the split the paper's ablations vary
    search_space: ClassVar[dict[str, SearchRange]] = {"global_layers": IntRange(1, 2)}
    global_layers: int = Field(
        1, ge=1, description="global layers: the last global_layers parameterised layers "
        "(LayerSpec's layers, a BatchNorm module counts as one) are averaged by the server; "
        "the layers before them, the local representation, never leave the client; 1 = the "
        "classifier, as PFLlib; all of the model's layers = FedAvg")


def global_names(layers: LayerSpec, names: Sequence[str], count: int) -> list[str]:
    """Parameters and buffers of the last ``count`` layers (FedPer's split), every one of
    the model's ``names`` when ``count`` is all its layers; refused unless 1 <= count <=
    the number of layers."""
    total = len(layers)
    if not 1 <= count <= total:
        raise ConfigError(
            f"algorithm.global_layers = {count}: the model has {total} layers "
            f"({', '.join(layers.names)}); valid: 1 to {total} (no global layer is "
            "algorithm.name=local, all of them FedAvg)")
    if count == total:
        return list(names)
    return personal_names(layers, count)


class LGFedAvgServer(FedAvgServer):
    """FedAvg over the global layers; the server never holds a local layer."""

    def __init__(self, ctx: ServerContext, hp: LGFedAvgHyperparameters):
        super().__init__(ctx, hp)
        shared = set(global_names(ctx.layers, list(ctx.init_model), hp.global_layers))
        self.global_model = {k: v for k, v in self.global_model.items() if k in shared}


class LGFedAvgClient(KeptLayersClient):
    """FedPer's client with the split turned round: the body is kept, the head shared."""

    prefix = LOCAL
    method, shared_part, kept_part = "LG-FedAvg", "global layers", "local layers"

    def __init__(self, ctx: ClientContext, hp: LGFedAvgHyperparameters):
        super().__init__(ctx, hp, kept=())  # the split is taken from the trainer's names
        names = self.trainer.state_names
        shared = set(global_names(ctx.layers, names, hp.global_layers))
        self.kept = [n for n in names if n not in shared]
        self.shared = [n for n in names if n in shared]


ALGORITHM = Algorithm(
    name="lgfedavg",
    summary="LG-FedAvg: local representation (the body) kept on each client, the last "
            "global_layers layers FedAvg-averaged",
    hyperparameters=LGFedAvgHyperparameters,
    server=LGFedAvgServer,
    client=LGFedAvgClient,
    paper="Liang, Liu, Ziyin, Allen, Auerbach, Brent, Salakhutdinov and Morency, Think "
          "Locally, Act Globally: Federated Learning with Local and Global Representations, "
          "arXiv:2001.01523, 2020",
    privacy=PrivacySupport(client="mean", sample=True),
)
