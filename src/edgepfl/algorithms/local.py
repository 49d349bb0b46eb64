"""Local (standalone) training: every client trains alone; nothing is sent.

The floor every personalized method must beat on non-IID data, and the reference for
properties such as "KAPC with lambda = 0 trains exactly as local".
"""

from __future__ import annotations

import torch

from edgepfl.algorithms.base import (
    Algorithm,
    Client,
    Hyperparameters,
    PersonalModelClient,
    Server,
    State,
    UpdateResult,
    model_to_state,
)
from edgepfl.algorithms.training import ClientData
from edgepfl.federation.messages import Message


class LocalHyperparameters(Hyperparameters):
    pass


class LocalServer(Server):
    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        return {cid: Message() for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        pass


class LocalClient(PersonalModelClient):
    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        self.trainer.load(self.personal_model(state, None))
        stats = fit(self, data, gen)
        return UpdateResult(Message(), model_to_state(self.trainer.export()), stats)


def fit(client: Client, data: ClientData, gen: torch.Generator, **hooks) -> dict[str, float]:
    """The run's SGD settings applied to the trainer's loaded weights."""
    t = client.ctx.train
    return client.trainer.fit(data, t.local_epochs, t.batch_size, t.lr, gen,
                              momentum=t.momentum, weight_decay=t.weight_decay, **hooks)


ALGORITHM = Algorithm(
    name="local",
    summary="each client trains alone on its own data; no communication",
    hyperparameters=LocalHyperparameters,
    server=LocalServer,
    client=LocalClient,
    heterogeneous=True,
)
