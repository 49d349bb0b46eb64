"""FedAvg (McMahan et al., AISTATS 2017): one global model, sample-weighted averaging.

Every client predicts with the global model, so this is the non-personalized reference.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from edgepfl.algorithms.base import (
    Algorithm,
    Client,
    Hyperparameters,
    Server,
    ServerContext,
    State,
    UpdateResult,
    model_from_state,
    model_to_state,
)
from edgepfl.algorithms.local import fit
from edgepfl.algorithms.training import ClientData, weighted_average
from edgepfl.federation.messages import Message, MessageError


class FedAvgHyperparameters(Hyperparameters):
    evaluate: Literal["global", "local"] = Field(
        "global", description="predict with the global model (FedAvg as published) or with the "
        "client's own model after its latest local training (how several pFL papers report "
        "FedAvg/FedProx)")


class FedAvgServer(Server):
    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        self.global_model: State = {k: v.clone() for k, v in ctx.init_model.items()}

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        msg = Message(self.global_model)
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        states, weights = [], []
        for cid, reply in replies.items():
            reply.require("num_samples")
            n = reply.meta["num_samples"]
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise MessageError(f"client {cid} sent num_samples = {n!r}; expected an integer >= 0")
            missing = set(self.global_model) - set(reply.tensors)
            if missing:
                raise MessageError(f"client {cid}'s model lacks {sorted(missing)}")
            states.append(reply.tensors)
            weights.append(n)
        if sum(weights) == 0:
            return
        self.global_model = weighted_average(states, weights)

    def eval_message(self, cid: int) -> Message | None:
        return Message(self.global_model)

    def state_dict(self) -> State:
        return {f"global.{k}": v for k, v in self.global_model.items()}

    def load_state_dict(self, state: State) -> None:
        self.global_model = {k[len("global."):]: v.clone() for k, v in state.items()}


class FedAvgClient(Client):
    def init_state(self, cid: int, init_model: State) -> State:
        if self.hp.evaluate == "local":
            return model_to_state(init_model)
        return {}

    def grad_hook(self, msg: Message):
        """Extra gradient term for subclasses (FedProx); FedAvg has none."""
        return None

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        self.trainer.load(msg.tensors)
        stats = fit(self, data, gen, grad_hook=self.grad_hook(msg))
        trained = self.trainer.export()
        if self.hp.evaluate == "local":
            state = model_to_state(trained)
        return UpdateResult(Message(trained, {"num_samples": data.n}), state, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if self.hp.evaluate == "local":
            # a client never selected yet still holds the initial model
            return model_from_state(state)
        if eval_msg is None:
            raise MessageError("FedAvg clients predict with the global model, but none was given")
        return eval_msg.tensors


ALGORITHM = Algorithm(
    name="fedavg",
    summary="FedAvg: one global model, sample-weighted average of client models",
    hyperparameters=FedAvgHyperparameters,
    server=FedAvgServer,
    client=FedAvgClient,
    paper="McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017",
)
