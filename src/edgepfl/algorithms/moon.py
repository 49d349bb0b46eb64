"""MOON (Li, He and Song, CVPR 2021): model-contrastive federated learning.

FedAvg whose client loss adds ``mu * l_con``: the representation of a sample under the
model being trained is pulled towards its representation under the received global
model and pushed away from its representation under the client's previous local model,

    l_con = -log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}) )

with cosine similarity ``sim``. Representations come from a projection head (a 2-layer
MLP) on the model's features; the head is part of the federated model (averaged with it).
The previous local model lives in the client's state. The loss term is built with autograd
on the live features, read from the forward pass that computed the logits (only
``z_glob`` and ``z_prev`` are constants), and with mu = 0 the training is FedAvg's bit for
bit (tested).
"""

from __future__ import annotations

import copy
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    SearchRange,
    ServerContext,
    State,
    UpdateResult,
    fine_tuned,
)
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.rng import derive_seed
from edgepfl.models.layers import LayerSpec
from edgepfl.training.client_data import ClientData
from edgepfl.training.features import classifier_module, tap_features
from edgepfl.training.trainer import Trainer

PROJ = "proj."


class MOONHyperparameters(Hyperparameters):
    # the MOON paper tunes the contrastive weight mu over {0.1, 1, 5, 10}
    search_space: ClassVar[dict[str, SearchRange]] = {"mu": LogUniform(0.1, 10.0)}
    mu: float = Field(5.0, ge=0, description="weight of the model-contrastive loss "
                      "(MOON paper: 5 for CIFAR-10, 1 for CIFAR-100 / Tiny-ImageNet)")
    temperature: float = Field(0.5, gt=0, description="temperature tau of the contrastive "
                               "loss (MOON paper: 0.5)")
    proj_dim: int = Field(256, ge=1, description="output size of the 2-layer MLP projection "
                          "head (MOON paper: 256)")
    evaluate: Literal["global", "local"] = Field(
        "global", description="predict with the global model (MOON as published) or with the "
        "client's own model after its latest local training (how the KAPC tables appear to "
        "report it; see docs/algorithms.md)")


def feature_dim(layers: LayerSpec, model: State) -> int:
    """Input size of the classifier (the last layer's weight matrix), i.e. of ``features``."""
    weights = [model[p] for p in layers.params_of(len(layers) - 1) if model[p].dim() == 2]
    if not weights:
        raise ValueError("MOON needs a model whose last layer is linear")
    return int(weights[0].shape[1])


def projection_head(in_dim: int, out_dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_dim, in_dim), nn.ReLU(), nn.Linear(in_dim, out_dim))


def init_projection(in_dim: int, out_dim: int, seed: int) -> State:
    """The projection head's initial weights, the same on server and client (own seed,
    global RNG untouched, so the backbone's initialisation and data order are unchanged)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "moon", "projection"))
        head = projection_head(in_dim, out_dim)
    return {f"{PROJ}{k}": v.detach().clone() for k, v in head.state_dict().items()}


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    """MOON's l_con, averaged over the batch (the global representation is the positive)."""
    pos = F.cosine_similarity(z, z_glob, dim=-1) / temperature
    neg = F.cosine_similarity(z, z_prev, dim=-1) / temperature
    logits = torch.stack([pos, neg], dim=1)
    return F.cross_entropy(logits, torch.zeros(z.shape[0], dtype=torch.long, device=z.device))


class MOONNet(nn.Module):
    """The run's model plus the projection head; predicts with the model alone."""

    def __init__(self, net: nn.Module, proj: nn.Module):
        super().__init__()
        self.net = net
        self.proj = proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def represent(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.net.features(x))


class MOONServer(FedAvgServer):
    """FedAvg over the model and the projection head."""

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        self.model_names = list(ctx.init_model)
        dim = feature_dim(ctx.layers, ctx.init_model)
        self.global_model.update(init_projection(dim, hp.proj_dim, ctx.seed))

    def eval_message(self, cid: int) -> Message | None:
        # MOON's clients predict with the global model; the projection head is training-only
        return Message({n: self.global_model[n] for n in self.model_names})


class MOONClient(Client):
    def __init__(self, ctx: ClientContext, hp):
        super().__init__(ctx, hp)
        model = ctx.trainer.model
        self.model_names = list(ctx.trainer.state_names)
        dim = feature_dim(ctx.layers, dict(model.named_parameters()))
        self.classifier = classifier_module(ctx.layers)
        self.proj_init = init_projection(dim, hp.proj_dim, ctx.seed)
        # one skeleton sharing the run model's parameters, so the SGD on the model is the
        # trainer's own; two more for the constant global and previous representations. All
        # on the run trainer's device and layout, which the shared parameters must keep
        self.net = MOONNet(model, projection_head(dim, hp.proj_dim))
        where = {"device": ctx.trainer.device, "channels_last": ctx.trainer.channels_last}
        self.moon = Trainer(self.net, **where)
        self.glob = Trainer(copy.deepcopy(self.net), **where)
        self.prev = Trainer(copy.deepcopy(self.net), **where)
        for fixed in (self.glob, self.prev):
            fixed.model.eval()
            fixed.model.requires_grad_(False)

    @staticmethod
    def _inner(tensors: State) -> State:
        """Names of the run model / head -> names inside ``MOONNet``."""
        return {(k if k.startswith(PROJ) else f"net.{k}"): v for k, v in tensors.items()}

    @staticmethod
    def _outer(tensors: State) -> State:
        return {(k[len("net."):] if k.startswith("net.") else k): v for k, v in tensors.items()}

    def init_state(self, cid: int, init_model: State) -> State:
        # before its first round a client's "previous model" is the initial global model,
        # as in the MOON code (which starts every old_net from the initial global net)
        model = {**{k: v.clone() for k, v in init_model.items()}, **self.proj_init}
        return {f"prev.{k}": v for k, v in model.items()}

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        expected = set(self.model_names) | set(self.proj_init)
        if set(msg.tensors) != expected:
            raise MessageError(f"MOON message has {sorted(msg.tensors)}, expected {sorted(expected)}")
        inner = self._inner(msg.tensors)
        self.trainer.forget()  # the run's skeleton is overwritten through the shared modules
        self.moon.load(inner)
        self.glob.load(inner)
        self.prev.load(self._inner({k[len("prev."):]: v for k, v in state.items()}))
        mu, tau = self.hp.mu, self.hp.temperature
        glob, prev = self.glob.model, self.prev.model

        proj = self.net.proj
        with tap_features(self.net, f"net.{self.classifier}") as features:
            def loss_hook(model, logits, x, y):
                z = proj(features.take())
                with torch.no_grad():
                    z_glob, z_prev = glob.represent(x), prev.represent(x)
                return mu * contrastive_loss(z, z_glob, z_prev, tau)

            # the run's SGD settings, applied to the model and the projection head together
            t = self.ctx.train
            stats = self.moon.fit(data, t.local_epochs, t.batch_size, t.lr, gen,
                                  momentum=t.momentum, weight_decay=t.weight_decay,
                                  loss_hook=loss_hook)
        trained = self._outer(self.moon.export())
        reply = Message(trained, {"num_samples": data.n})
        return UpdateResult(reply, {f"prev.{k}": v for k, v in trained.items()}, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if self.hp.evaluate == "local":
            # the previous local model MOON keeps anyway (the initial model before round 1)
            return {k: state[f"prev.{k}"] for k in self.model_names}
        if eval_msg is None:
            raise MessageError("MOON clients predict with the global model, but none was given")
        return eval_msg.tensors

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """A newcomer has no previous local model: the global one, fine-tuned (the
        contrastive term needs a previous model, so plain SGD)."""
        if msg is None:
            raise MessageError("a new MOON client adapts the global model, but none was given")
        return [fine_tuned(self, msg.tensors, data, epochs, gen)]


ALGORITHM = Algorithm(
    name="moon",
    summary="MOON: FedAvg plus a model-contrastive loss (global vs previous local representation)",
    hyperparameters=MOONHyperparameters,
    server=MOONServer,
    client=MOONClient,
    paper="Li, He and Song, Model-Contrastive Federated Learning, CVPR 2021",
    privacy=PrivacySupport(
        client="mean", refused="sample level: its model-contrastive loss compares each batch with "
        "two other models through the module, a loss term whose per-sample gradients DP-SGD here "
        "does not clip"),
)
