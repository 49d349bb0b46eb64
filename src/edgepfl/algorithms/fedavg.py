"""FedAvg (McMahan et al., AISTATS 2017): one global model, sample-weighted averaging.

Every client predicts with the global model, so this is the non-personalized reference.
On a federation of several architectures (``model.tiers``) each parameter is averaged over
exactly the clients whose architecture holds it (``ParamIndex.average_over_holders``): the
layers the architectures share form one model, the rest stay per architecture.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    Hyperparameters,
    PrivacySupport,
    Server,
    ServerContext,
    State,
    UpdateResult,
    fine_tuned,
    model_from_state,
    model_to_state,
)
from edgepfl.contract.kit import average_models, check_model_reply, sgd_request
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.rng import generator
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest


class FedAvgHyperparameters(Hyperparameters):
    evaluate: Literal["global", "local", "finetune"] = Field(
        "global", description="global = predict with the global model (FedAvg as "
        "published); local = with the client's model after its latest local training (as "
        "several pFL papers report FedAvg); finetune = with the global model fine-tuned at "
        "test time for finetune_epochs on the client's training data (hierbayes' "
        "personalize = fit protocol)")
    finetune_epochs: int = Field(1, ge=1, description="epochs of the test-time fine-tuning "
                                 "under evaluate = finetune (part of the evaluation protocol)")


def finetune_unaccounted(hp: FedAvgHyperparameters) -> str | None:
    """The test-time fine-tuning trains on each client's data outside the privacy accounting."""
    if hp.evaluate != "finetune":
        return None
    return ("algorithm.evaluate = 'finetune': the test-time fine-tuning trains on each "
            "client's data outside the accounting; set algorithm.evaluate to global or local")


PRIVACY = PrivacySupport(client="mean", sample=True, unaccounted=finetune_unaccounted)


class FedAvgServer(Server):
    state: ClassVar[tuple[str, ...]] = ("global_model",)

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        self.index = ctx.param_index()
        init = self.index.union(ctx.init_models()) if self.index else ctx.init_model
        # with several architectures the global model is keyed by parameter identity
        self.global_model: State = {k: v.clone() for k, v in init.items()}

    def model_for(self, cid: int) -> State:
        if self.index is None:
            return self.global_model
        return self.index.model(self.ctx.arch_of[cid], self.global_model)

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        if self.index is None:
            msg = Message(self.global_model)
            return {cid: msg for cid in selected}
        return {cid: Message(self.model_for(cid)) for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        self.global_model = average_models(self.ctx, self.index, self.global_model, replies)

    def check_reply(self, cid: int, reply: Message) -> None:
        # what the client was sent: FedBN, FedBABU and FedPer's shared part, MOON's with
        # its projection head
        check_model_reply(cid, reply, self.model_for(cid))

    def eval_message(self, cid: int) -> Message | None:
        return Message(self.model_for(cid))


def finetuned(client: Client, start: State, data: ClientData, epochs: int, cid: int,
              stream: str) -> State:
    """``start`` fine-tuned on the client's own data at test time: ``epochs`` of the run's
    SGD at train.lr, with a batch order of the client's own (named ``stream``: the
    evaluation message carries no round, and the rounds' batch orders stay untouched)."""
    t = client.ctx.train
    client.trainer.load(start)
    client.trainer.fit(data, epochs, t.batch_size, t.lr, generator(client.ctx.seed, stream, cid),
                       momentum=t.momentum, weight_decay=t.weight_decay)
    tuned = client.trainer.export()
    client.trainer.forget()
    return tuned


class FedAvgClient(Client):
    batchable = True

    def init_state(self, cid: int, init_model: State) -> State:
        if self.hp.evaluate == "local":
            return model_to_state(init_model)
        return {}

    def grad_hook(self, msg: Message):
        """Extra gradient term for subclasses (FedProx); FedAvg has none."""
        return None

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        return sgd_request(self, msg.tensors, data, gen, grad_hook=self.grad_hook(msg))

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        if self.hp.evaluate == "local":
            state = model_to_state(trained)
        # the global model, trained on the client's data, goes back with its sample count
        return UpdateResult(Message(trained, {"num_samples": data.n}), state, stats)

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        if self.hp.evaluate != "finetune":
            return super().predictive(cid, state, eval_msg, data)
        start = self.personal_model(state, eval_msg)
        return {"": [finetuned(self, start, data, self.hp.finetune_epochs, cid, "finetune")]}

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if self.hp.evaluate == "local":
            # a client never selected yet still holds the initial model
            return model_from_state(state)
        if eval_msg is None:
            raise MessageError("FedAvg clients predict with the global model, but none was given")
        return eval_msg.tensors

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """A newcomer holds no model of its own, whatever ``evaluate`` says of the trained
        clients: the global model, fine-tuned for ``epochs`` (``finetune_epochs`` is the
        trained clients' figure)."""
        if msg is None:
            raise MessageError("a new FedAvg client adapts the global model, but none was given")
        return [fine_tuned(self, msg.tensors, data, epochs, gen)]


ALGORITHM = Algorithm(
    name="fedavg",
    summary="FedAvg: one global model, sample-weighted average of client models",
    hyperparameters=FedAvgHyperparameters,
    server=FedAvgServer,
    client=FedAvgClient,
    heterogeneous=True,
    paper="McMahan et al., Communication-Efficient Learning of Deep Networks from Decentralized Data, AISTATS 2017",
    privacy=PRIVACY,
)
