"""Local (standalone) training: every client trains alone; nothing is sent.

The floor every personalized method must beat on non-IID data, and the reference for
properties such as "KAPC with lambda = 0 trains exactly as local".
"""

from __future__ import annotations

import torch
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    Hyperparameters,
    PersonalModelClient,
    PrivacySupport,
    Server,
    State,
    UpdateResult,
    model_to_state,
)
from edgepfl.contract.kit import sgd_request
from edgepfl.federation.messages import Message, MessageError, check_message
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest

EPOCHS = "epochs"


class LocalHyperparameters(Hyperparameters):
    total_epochs: int | None = Field(
        None, ge=1, description="a client stops training after this many local epochs in "
        "total (KAPC Sec. 7.1: Local trains 5 epochs on MNIST/FMNIST); None: every round it "
        "is selected, train.local_epochs each time")


class LocalServer(Server):
    # epochs each client has been told to train so far (only with a total_epochs budget)
    state = ("epochs",)

    def __init__(self, ctx, hp):
        super().__init__(ctx, hp)
        self.epochs = [0] * ctx.num_clients

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        if self.hp.total_epochs is None:
            return {cid: Message() for cid in selected}
        out = {}
        for cid in selected:
            # the coordinator says how many epochs are left, so that a spent budget is
            # visible in the message (and the FLOP count of an idle round is zero)
            e = max(0, min(self.ctx.train.local_epochs, self.hp.total_epochs - self.epochs[cid]))
            self.epochs[cid] += e
            out[cid] = Message(meta={EPOCHS: e})
        return out

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        pass

    def check_reply(self, cid: int, reply: Message) -> None:
        check_message(f"client {cid}", reply, {})  # nothing is ever sent back


class LocalClient(PersonalModelClient):
    batchable = True

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest | None:
        epochs = self.ctx.train.local_epochs
        if EPOCHS in msg.meta:
            sent = msg.meta[EPOCHS]
            if isinstance(sent, bool) or not isinstance(sent, int) or sent < 0:
                raise MessageError(f"local: {EPOCHS} = {sent!r}; expected an integer >= 0")
            epochs = sent
            if epochs == 0:  # the budget is spent: the model stays as it is
                return None
        return sgd_request(self, self.personal_model(state, None), data, gen, epochs=epochs)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        return UpdateResult(Message(), model_to_state(trained), stats)

    def idle(self, cid: int, msg: Message, state: State) -> UpdateResult:
        # the budget is spent: nothing to send, and no state entry is rewritten
        return UpdateResult(Message(), {}, {})


ALGORITHM = Algorithm(
    name="local",
    summary="each client trains alone on its own data; no communication",
    hyperparameters=LocalHyperparameters,
    server=LocalServer,
    client=LocalClient,
    heterogeneous=True,
    privacy=PrivacySupport(
        sample=True, refused="client level: nothing leaves a client, so there is no aggregate to "
        "noise (use privacy.level = sample to protect each client's samples in its own model)"),
    no_new_clients="its clients never share a model: there is nothing to give a stranger",
)
