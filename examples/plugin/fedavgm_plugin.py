"""An edgepfl plug-in: an algorithm, a model and a data set of one's own, in one file.

    edgepfl list --plugin examples/plugin/fedavgm_plugin.py fedavgm
    edgepfl run --plugin examples/plugin/fedavgm_plugin.py --set algorithm.name=fedavgm \\
                --set model.name=tiny_mlp --set dataset.name=blobs --set train.rounds=10

* ``fedavgm``: FedAvg with server momentum (Hsu, Qi and Brown, "Measuring the Effects of
  Non-Identical Data Distribution for Federated Visual Classification", 2019). The server
  treats the change the average makes to the global model as a gradient and takes a
  momentum step with it; with ``momentum = 0`` and ``server_lr = 1`` it is FedAvg.
* ``tiny_mlp``: one hidden layer of 32 units, for inputs of any shape.
* ``blobs``: 600 samples of 16 features in 4 Gaussian classes, each sample's writer one of
  6 clients (so ``partition.scheme = natural`` works too); no files needed.
"""

from __future__ import annotations

import numpy as np
import torch
from pydantic import Field
from torch import nn

from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    Hyperparameters,
    Server,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import average_models, check_model_reply, sgd_request
from edgepfl.federation.messages import Message
from edgepfl.plugins import DataSource, register_algorithm, register_dataset, register_model


# -- the algorithm ------------------------------------------------------------------------
class FedAvgMHyperparameters(Hyperparameters):
    server_lr: float = Field(1.0, gt=0, description="the server's step on the averaged change")
    momentum: float = Field(0.9, ge=0, lt=1, description="the server's momentum (0: FedAvg's "
                            "averaging, with server_lr = 1)")


class FedAvgMServer(Server):
    state = ("global_model", "velocity")  # what a checkpoint keeps

    def __init__(self, ctx: ServerContext, hp: FedAvgMHyperparameters):
        super().__init__(ctx, hp)
        self.global_model: State = {k: v.clone() for k, v in ctx.init_model.items()}
        self.velocity: State = {k: torch.zeros_like(v) for k, v in self.global_model.items()
                                if v.is_floating_point()}

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        msg = Message(self.global_model)
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        # the sample-weighted average of the replies, as FedAvg forms it
        average = average_models(self.ctx, None, self.global_model, replies)
        for name, weights in self.global_model.items():
            if name not in self.velocity:  # integer buffers are taken as averaged
                self.global_model[name] = average[name]
                continue
            # the pseudo-gradient w - avg, with momentum
            self.velocity[name] = self.hp.momentum * self.velocity[name] + (weights - average[name])
            self.global_model[name] = weights - self.hp.server_lr * self.velocity[name]

    def check_reply(self, cid: int, reply: Message) -> None:
        check_model_reply(cid, reply, self.global_model)

    def eval_message(self, cid: int) -> Message | None:
        return Message(self.global_model)


class FedAvgMClient(Client):
    batchable = True  # its update is the plain fit: train the global model, reply with it

    def fit_request(self, cid, msg, state, data, gen):
        return sgd_request(self, msg.tensors, data, gen)

    def finish(self, cid, msg, state, data, trained, stats) -> UpdateResult:
        return UpdateResult(Message(trained, {"num_samples": data.n}), state, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        assert eval_msg is not None  # the server's eval_message: the global model, always
        return eval_msg.tensors


register_algorithm(Algorithm(
    name="fedavgm",
    summary="FedAvgM: FedAvg with server momentum on the averaged change",
    hyperparameters=FedAvgMHyperparameters,
    server=FedAvgMServer,
    client=FedAvgMClient,
    paper="Hsu, Qi and Brown, Measuring the Effects of Non-Identical Data Distribution for "
          "Federated Visual Classification, 2019",
))


# -- the model ----------------------------------------------------------------------------
class TinyMLP(nn.Module):
    def __init__(self, channels: int, num_classes: int, image_size: int):
        super().__init__()
        self.hidden = nn.Linear(channels * image_size * image_size, 32)
        self.out = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x.flatten(1))))


register_model("tiny_mlp", TinyMLP, "one hidden layer of 32 units (plug-in example)")


# -- the data set -------------------------------------------------------------------------
def load_blobs(source: DataSource) -> dict[str, np.ndarray]:
    # a fixed seed, not the run's: every run sees the same data, as with a data set on disk
    rng = np.random.default_rng(2019)
    centres = rng.normal(0.0, 2.0, size=(4, 16))
    y = rng.integers(0, 4, size=600)
    x = centres[y] + rng.normal(0.0, 1.5, size=(600, 16))
    return {"x": x.astype(np.float32), "y": y, "client": rng.integers(0, 6, size=600),
            "classes": np.array(["north", "east", "south", "west"])}


register_dataset("blobs", load_blobs, "600 samples of 16 features in 4 Gaussian classes, "
                 "written by 6 clients (plug-in example)", default_model="tiny_mlp")
