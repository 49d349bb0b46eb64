"""FedBABU (Oh et al., ICLR 2022): federate the body only, with the head frozen at its
random initialisation; personalize by fine-tuning.

Training a shared head on non-IID clients pulls its class vectors towards each client's
labels and degrades the shared representation; freezing the head at one common random
initialisation during federated training makes the body learn features for a fixed,
client-independent classifier. Each client then fine-tunes the whole network on its own
data for ``finetune_epochs`` and predicts with that personal model.

The engine evaluates without client data, so the fine-tuning happens inside ``update``:
a selected client fine-tunes the global body it received (plus the frozen head) and keeps
the result as its personal model; it then trains the body for the federation. The
personal model thus lags the global model by one round (see docs/algorithms.md).
"""

from __future__ import annotations

import torch
from pydantic import Field

from edgepfl.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    PrivacySupport,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.algorithms.client_data import ClientData
from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.federation.accounting import not_counted
from edgepfl.federation.messages import Message, MessageError
from edgepfl.models.layers import LayerSpec


class FedBABUHyperparameters(Hyperparameters):
    finetune_epochs: int = Field(
        5, ge=0, description="epochs of whole-model fine-tuning for the personal model "
        "(FedBABU paper: tau = 5 in its main personalization results)")


def head_names(layers: LayerSpec) -> list[str]:
    """The head is the last layer (the classifier), as in the paper."""
    return layers.params_of(len(layers) - 1)


class FedBABUServer(FedAvgServer):
    """FedAvg over the body; the head is never sent, so it is not part of server state."""

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        head = set(head_names(ctx.layers))
        self.global_model = {k: v for k, v in self.global_model.items() if k not in head}

    def eval_message(self, cid: int) -> Message | None:
        return None  # clients predict with their fine-tuned personal model


class FedBABUClient(Client):
    def __init__(self, ctx: ClientContext, hp):
        super().__init__(ctx, hp)
        self.head = head_names(ctx.layers)
        self.body_params = [n for n in self.trainer.param_names if n not in set(self.head)]
        self.body_names = [n for n in self.trainer.state_names if n not in set(self.head)]

    def init_state(self, cid: int, init_model: State) -> State:
        # the head every client shares: the model's random initialisation, never trained
        # during federated rounds; the personal model starts as the initial model
        state = {f"head.{n}": init_model[n].clone() for n in self.head}
        state.update({f"personal.{k}": v.clone() for k, v in init_model.items()})
        return state

    def _global(self, msg: Message, state: State) -> State:
        missing = set(self.body_names) - set(msg.tensors)
        if missing:
            raise MessageError(f"FedBABU body lacks {sorted(missing)}")
        model = {n: msg.tensors[n] for n in self.body_names}
        model.update({n: state[f"head.{n}"] for n in self.head})
        return model

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        t = self.ctx.train
        global_model = self._global(msg, state)
        # personalization: fine-tune the whole received global model (body and head);
        # evaluation work the paper does once at test time, so not a cost of the round
        self.trainer.load(global_model)
        if self.hp.finetune_epochs:
            with not_counted():
                self.trainer.fit(data, self.hp.finetune_epochs, t.batch_size, t.lr, gen,
                                 momentum=t.momentum, weight_decay=t.weight_decay)
        personal = {f"personal.{k}": v for k, v in self.trainer.export().items()}
        # federated training: the body only, the head stays at its initialisation
        self.trainer.load(global_model)
        stats = self.trainer.fit(data, t.local_epochs, t.batch_size, t.lr, gen,
                                 momentum=t.momentum, weight_decay=t.weight_decay,
                                 trainable=self.body_params)
        reply = Message(self.trainer.export(self.body_names), {"num_samples": data.n})
        new_state = {f"head.{n}": state[f"head.{n}"].clone() for n in self.head}
        new_state.update(personal)
        return UpdateResult(reply, new_state, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        return {k[len("personal."):]: v for k, v in state.items() if k.startswith("personal.")}


ALGORITHM = Algorithm(
    name="fedbabu",
    summary="FedBABU: body averaged with the head frozen at random init; per-client fine-tuning",
    hyperparameters=FedBABUHyperparameters,
    server=FedBABUServer,
    client=FedBABUClient,
    paper="Oh, Kim and Yun, FedBABU: Toward Enhanced Representation for Federated Image "
          "Classification, ICLR 2022",
    privacy=PrivacySupport(
        client="mean", sample=True,
        # DP-SGD fine-tunes the personal model too: every step on the data counts
        epochs=lambda train, hp: train.local_epochs + hp.finetune_epochs),
)
