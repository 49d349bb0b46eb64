"""FedBN (Li et al., ICLR 2021): BatchNorm layers stay local, everything else is averaged.

Feature shift between clients (different scanners, styles, lighting) shows up in the
normalisation statistics; keeping each client's BatchNorm affine parameters and running
statistics private lets one shared backbone serve differently distributed inputs. The
server is FedAvg restricted to the non-BatchNorm tensors, so BatchNorm tensors never
travel in either direction. On a model without BatchNorm FedBN is FedAvg exactly, so with
``model.name`` unset FedBN takes the BatchNorm variant of the data set's default model
(``cnn2_bn`` for MNIST, ``cnn_small_bn`` for digits).
"""

from __future__ import annotations

import warnings
from typing import ClassVar

import torch

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    PrivacySupport,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import sgd_request
from edgepfl.federation.messages import Message, MessageError
from edgepfl.models.layers import LayerSpec
from edgepfl.models.zoo import MODELS
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest


class FedBNHyperparameters(Hyperparameters):
    """FedBN has no hyperparameters of its own (the paper uses plain FedAvg training)."""


def batchnorm_names(layers: LayerSpec) -> list[str]:
    """Parameters and buffers of the BatchNorm layers of a model.

    Derived from the LayerSpec both sides hold: a BatchNorm module is the module that owns
    a ``running_mean`` buffer, and its tensors are its parameters plus all its buffers.
    (A BatchNorm without running statistics is not recognised; none of our models has one.)
    """
    modules = {b.rsplit(".", 1)[0] for b in layers.buffers if b.endswith("running_mean")}

    def owner(name: str) -> str:
        return name.rsplit(".", 1)[0] if "." in name else ""

    params = [p for p in layers.param_names if owner(p) in modules]
    buffers = [b for b in layers.buffers if owner(b) in modules]
    return params + buffers


class FedBNServer(FedAvgServer):
    """FedAvg over the shared (non-BatchNorm) tensors only."""

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        local = set(batchnorm_names(ctx.layers))
        if not local:
            # allowed (FedBN is then FedAvg, which tests rely on) but rarely what a user meant
            models = ", ".join(m for m in MODELS if m.endswith("_bn"))
            warnings.warn("fedbn: the model has no BatchNorm layers, so FedBN is plain FedAvg; "
                          f"choose a BatchNorm model (model.name: {models})", stacklevel=2)
        self.global_model = {k: v for k, v in self.global_model.items() if k not in local}


class FedBNClient(Client):
    # each client's BatchNorm statistics are stacked with its weights when batched
    batchable: ClassVar[bool] = True

    def __init__(self, ctx: ClientContext, hp):
        super().__init__(ctx, hp)
        self.local_names = batchnorm_names(ctx.layers)
        local = set(self.local_names)
        self.shared_names = [n for n in self.trainer.state_names if n not in local]

    def init_state(self, cid: int, init_model: State) -> State:
        # every client starts from the same BatchNorm initialisation, then they diverge
        return {f"bn.{n}": init_model[n].clone() for n in self.local_names}

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        return sgd_request(self, self.personal_model(state, msg), data, gen)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        reply = Message({n: trained[n] for n in self.shared_names}, {"num_samples": data.n})
        return UpdateResult(reply, {f"bn.{n}": trained[n] for n in self.local_names}, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError("FedBN clients need the shared model, but none was given")
        unexpected = set(eval_msg.tensors) & set(self.local_names)
        if unexpected:
            raise MessageError(f"FedBN server sent BatchNorm tensors {sorted(unexpected)}")
        model = dict(eval_msg.tensors)
        model.update({n: state[f"bn.{n}"] for n in self.local_names})
        return model


ALGORITHM = Algorithm(
    name="fedbn",
    summary="FedBN: BatchNorm layers stay on each client, all other layers FedAvg-averaged",
    hyperparameters=FedBNHyperparameters,
    server=FedBNServer,
    client=FedBNClient,
    paper="Li et al., FedBN: Federated Learning on Non-IID Features via Local Batch Normalization, ICLR 2021",
    model_variant="_bn",
    privacy=PrivacySupport(
        client="mean", refused="sample level: its BatchNorm layers, the method's point, give a "
        "sample no gradient of its own, and their running statistics would leave the client "
        "un-noised"),
)
