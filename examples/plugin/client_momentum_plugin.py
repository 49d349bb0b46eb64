"""A stateful plug-in algorithm: FedAvg whose clients carry a momentum of their updates
from one round to the next (docs/plugins.md walks through it).

    edgepfl run --plugin examples/plugin/client_momentum_plugin.py \\
                --set algorithm.name=clientmom --set algorithm.beta=0.5 \\
                --set dataset.name=synthetic --set train.rounds=10

Each client keeps, between the rounds it is selected in, a velocity per floating-point
entry of the model and a count of the rounds it trained (its state). In a round it trains
the global model as FedAvg does, and with ``delta`` the change training made and ``v`` its
velocity, replies with ``sent + v`` where ``v = beta * v + delta``; the server averages the
replies as FedAvg does. With ``beta = 0`` it is FedAvg. One ``Client`` object serves every
simulated client, so what a client remembers lives in the ``state`` mapping the engine
keeps for it (checkpointed, resumed, and on Flower kept by the real client), never on
``self``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    Hyperparameters,
    PrivacySupport,
    SearchRange,
    State,
    Uniform,
    UpdateResult,
)
from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.kit import sgd_request
from edgepfl.federation.messages import Message
from edgepfl.plugins import register_algorithm

VELOCITY = "velocity."  # state entries: velocity.<model entry>, and ROUNDS
ROUNDS = "rounds"


class ClientMomentumHyperparameters(Hyperparameters):
    search_space: ClassVar[dict[str, SearchRange]] = {"beta": Uniform(0.0, 0.9)}
    beta: float = Field(0.5, ge=0, lt=1, description="the clients' momentum over rounds "
                        "(0: FedAvg)")


class ClientMomentumClient(Client):
    # its update is the plain fit (fit_request, then finish): the engine may train a
    # step's clients together (train.batch_clients) and call finish for each
    batchable = True

    def init_state(self, cid: int, init_model: State) -> State:
        # every entry a client will ever hold, of fixed shape and dtype: the engine stacks
        # them over the clients ([num_clients, *shape]) and checkpoints the stacks
        state = {VELOCITY + k: torch.zeros_like(v) for k, v in init_model.items()
                 if v.is_floating_point()}
        state[ROUNDS] = torch.zeros((), dtype=torch.int64)
        return state

    def fit_request(self, cid, msg, state, data, gen):
        # train the global model with the run's SGD settings (train.lr, batch_size, ...)
        return sgd_request(self, msg.tensors, data, gen)

    def finish(self, cid, msg, state, data, trained, stats) -> UpdateResult:
        sent = msg.tensors
        new: State = {ROUNDS: state[ROUNDS] + 1}  # new tensors: never write into ``state``
        reply: State = {}
        for name, weights in trained.items():
            key = VELOCITY + name
            if key not in state:  # an integer buffer goes back as trained
                reply[name] = weights
                continue
            new[key] = self.hp.beta * state[key] + (weights - sent[name])
            reply[name] = sent[name] + new[key]
        # FedAvg's reply (every model entry, and the sample count), so the default
        # Server.check_reply and FedAvg's average take it
        return UpdateResult(Message(reply, {"num_samples": data.n}), new, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        return eval_msg.tensors  # the global model, as FedAvg's clients predict with


register_algorithm(Algorithm(
    name="clientmom",
    summary="FedAvg whose clients carry a momentum of their updates across rounds "
            "(plug-in example)",
    hyperparameters=ClientMomentumHyperparameters,
    server=FedAvgServer,  # a built-in part may be reused: the sample-weighted average
    client=ClientMomentumClient,
    # the server's aggregate is a sample-weighted mean of the replies, each a function of
    # what the client was sent and of its own training (client level); all it computes
    # from its data is SGD on its trainer, the rest is arithmetic on the weights that
    # training gave (sample level)
    privacy=PrivacySupport(client="mean", sample=True),
))
