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

import torch
from pydantic import Field

from edgepfl.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    IntRange,
    PrivacySupport,
    SearchRange,
    ServerContext,
    State,
    UpdateResult,
    fine_tuned,
)
from edgepfl.algorithms.client_data import ClientData
from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.algorithms.fedper import personal_names
from edgepfl.algorithms.kit import sgd_request
from edgepfl.algorithms.sgd import FitRequest
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
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


class LGFedAvgClient(Client):
    batchable = True  # the update is one plain fit: run_update of the two below

    def __init__(self, ctx: ClientContext, hp: LGFedAvgHyperparameters):
        super().__init__(ctx, hp)
        names = self.trainer.state_names
        shared = set(global_names(ctx.layers, names, hp.global_layers))
        self.shared = [n for n in names if n in shared]
        self.local = [n for n in names if n not in shared]

    def init_state(self, cid: int, init_model: State) -> State:
        # every client's local representation starts from the one seeded initial model
        return {LOCAL + n: init_model[n].clone() for n in self.local}

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        # the whole model trains: the client's own body under the received head
        return sgd_request(self, self.personal_model(state, msg), data, gen)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        reply = Message({n: trained[n] for n in self.shared}, {"num_samples": data.n})
        kept = {LOCAL + n: trained[n] for n in self.local}
        return UpdateResult(reply, kept, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError("LG-FedAvg clients need the global layers, but none were given")
        missing = set(self.shared) - set(eval_msg.tensors)
        if missing:
            raise MessageError(f"LG-FedAvg global layers lack {sorted(missing)}")
        unexpected = set(eval_msg.tensors) & set(self.local)
        if unexpected:
            raise MessageError(f"LG-FedAvg server sent local layers {sorted(unexpected)}")
        own = set(self.local)
        return {n: state[LOCAL + n] if n in own else eval_msg.tensors[n]
                for n in self.trainer.state_names}

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """A newcomer: a local representation from the initial model trained for
        ``epochs`` under the global layers, which stay as received (the paper's new
        devices learn their own local model against the global one)."""
        local = [n for n in self.local if n in self.trainer.params]
        return [fine_tuned(self, self.personal_model(state, msg), data, epochs, gen,
                           local or None)]


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
