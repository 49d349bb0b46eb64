"""FedPer (Arivazhagan, Aggarwal, Singh and Choudhary, *Federated Learning with
Personalization Layers*, arXiv:1912.00818, 2019): base layers federated, personalization
layers kept on each client.

The model is split into base layers W_B, shared by all clients, and personalization layers
W_P^j, one set per client j. Each round:

* server: send W_B to the selected clients; W_B <- sum_j n_j W_B^j / sum_j n_j over the
  replies (FedAvg restricted to the base layers);
* client j: load the received W_B beside its own W_P^j, run SGD on both for
  ``train.local_epochs``, keep W_P^j, send W_B^j and n_j.

A client predicts with the latest W_B and its own W_P^j. ``personal_layers`` counts layers
as ``LayerSpec`` does, i.e. parameterised modules from the output end (a BatchNorm module
is a layer of its own; its running statistics go with it). The default, 1, is the
classifier, the split PFLlib and FL-bench use; the paper reports several counts K_P.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from pydantic import Field

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import (
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
from edgepfl.contract.kit import sgd_request
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.models.layers import LayerSpec
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest

PERSONAL = "personal."


class FedPerHyperparameters(Hyperparameters):
    # K_P, the personalization layers the paper varies; 2 keeps a base layer on any model
    search_space: ClassVar[dict[str, SearchRange]] = {"personal_layers": IntRange(1, 2)}
    personal_layers: int = Field(
        1, ge=0, description="personalization layers K_P: the last K_P parameterised layers "
        "(LayerSpec's layers, a BatchNorm module counts as one) never leave the client; 1 = the "
        "classifier, as PFLlib and FL-bench; 0 = FedAvg")


def personal_names(layers: LayerSpec, count: int) -> list[str]:
    """Parameters and buffers of the last ``count`` layers, refused unless at least one base
    layer is left to federate."""
    total = len(layers)
    if not 0 <= count < total:
        raise ConfigError(
            f"algorithm.personal_layers = {count}: the model has {total} layers "
            f"({', '.join(layers.names)}); valid: 0 to {total - 1}, keeping at least one base "
            "layer to federate (all layers personal is algorithm.name=local)")
    modules = set(layers.names[total - count:])
    params = layers.params_of(list(range(total - count, total)))
    buffers = [b for b in layers.buffers if b.rsplit(".", 1)[0] in modules]
    return params + buffers


class FedPerServer(FedAvgServer):
    """FedAvg over the base layers; the server never holds a personalization layer."""

    def __init__(self, ctx: ServerContext, hp: FedPerHyperparameters):
        super().__init__(ctx, hp)
        personal = set(personal_names(ctx.layers, hp.personal_layers))
        self.global_model = {k: v for k, v in self.global_model.items() if k not in personal}


class KeptLayersClient(Client):
    """A client that keeps some layers of the model on the device (``kept``, in its state
    under ``prefix``) and federates the others (``shared``): FedPer keeps the head,
    LG-FedAvg the body. Each round it trains the whole model, the received shared layers
    under its own kept ones, and sends the shared layers back."""

    batchable = True  # the update is one plain fit: run_update of the two below
    prefix = PERSONAL
    # how its messages name the method and the two parts of the model
    method, shared_part, kept_part = "FedPer", "base layers", "personalization layers"

    def __init__(self, ctx: ClientContext, hp: Hyperparameters, kept: Sequence[str]):
        super().__init__(ctx, hp)
        self.kept = list(kept)
        own = set(self.kept)
        self.shared = [n for n in self.trainer.state_names if n not in own]

    def init_state(self, cid: int, init_model: State) -> State:
        # every client's kept layers start from the one seeded initial model
        return {self.prefix + n: init_model[n].clone() for n in self.kept}

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        return sgd_request(self, self.personal_model(state, msg), data, gen)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        reply = Message({n: trained[n] for n in self.shared}, {"num_samples": data.n})
        kept = {self.prefix + n: trained[n] for n in self.kept}
        return UpdateResult(reply, kept, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError(f"{self.method} clients need the {self.shared_part}, but none "
                               "were given")
        missing = set(self.shared) - set(eval_msg.tensors)
        if missing:
            raise MessageError(f"{self.method} {self.shared_part} lack {sorted(missing)}")
        unexpected = set(eval_msg.tensors) & set(self.kept)
        if unexpected:
            raise MessageError(f"{self.method} server sent {self.kept_part} "
                               f"{sorted(unexpected)}")
        model = {n: eval_msg.tensors[n] for n in self.shared}
        model.update({n: state[self.prefix + n] for n in self.kept})
        return model

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """A newcomer: the received shared layers under kept layers from the initial model,
        only the kept ones trained for ``epochs`` (the shared layers are what the
        federation learnt for it: FedRep's new-client protocol, LG-FedAvg's new devices
        learning their local model against the global one)."""
        trainable = [n for n in self.kept if n in self.trainer.params]
        return [fine_tuned(self, self.personal_model(state, msg), data, epochs, gen,
                           trainable or None)]


class FedPerClient(KeptLayersClient):
    def __init__(self, ctx: ClientContext, hp: FedPerHyperparameters):
        super().__init__(ctx, hp, personal_names(ctx.layers, hp.personal_layers))
        # FedPer's names for the two parts (W_P, W_B), which FedRep's client reads too
        self.personal, self.base = self.kept, self.shared


ALGORITHM = Algorithm(
    name="fedper",
    summary="FedPer: base layers FedAvg-averaged, the last personal_layers layers stay on "
            "each client",
    hyperparameters=FedPerHyperparameters,
    server=FedPerServer,
    client=FedPerClient,
    paper="Arivazhagan, Aggarwal, Singh and Choudhary, Federated Learning with "
          "Personalization Layers, arXiv:1912.00818, 2019",
    privacy=PrivacySupport(client="mean", sample=True),
)
