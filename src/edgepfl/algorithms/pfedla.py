"""pFedLA (Ma et al., CVPR 2022): layer-wise personalized aggregation by hypernetworks.

The server keeps every client's latest model ``theta_j`` and, for each client ``i``, a
hypernetwork ``HN_i(v_i; phi_i)`` (a learnable embedding ``v_i`` through an MLP) that
outputs, for every layer ``l``, non-negative weights ``alpha_i^l`` over the clients that
sum to one. Client ``i`` receives the personalized aggregate
``bar theta_i^l = sum_j alpha_i^{l,j} theta_j^l``, trains it locally to ``theta_i`` and
returns it. The update ``delta = theta_i - bar theta_i`` approximates ``-eta grad L``, so
the hypernetwork is moved along the chain rule *in the descent direction*:

    phi_i <- phi_i - hn_lr * (d bar theta_i / d phi_i)^T (-delta)

(the sign is what a faulty implementation gets wrong; a test checks the loss goes down).
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from edgepfl.contract.algorithm import (
    Algorithm,
    Hyperparameters,
    LogUniform,
    PersonalModelClient,
    PrivacySupport,
    Reporter,
    SearchRange,
    Server,
    ServerContext,
    State,
    UpdateResult,
    model_to_state,
)
from edgepfl.contract.kit import sgd_request
from edgepfl.federation.messages import Message, MessageError, check_message
from edgepfl.federation.rng import derive_seed
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest


class PFedLAHyperparameters(Hyperparameters):
    # the hypernetwork's rate decides whether the layer weights move off uniform at all
    # (docs/algorithms.md)
    search_space: ClassVar[dict[str, SearchRange]] = {"hn_lr": LogUniform(0.01, 10.0)}
    hn_lr: float = Field(1.0, gt=0, description="hypernetwork SGD learning rate (our choice: "
                         "the public implementation's 5e-3 leaves the weights uniform; "
                         "docs/algorithms.md)")
    embedding_dim: int = Field(100, ge=1, description="client embedding size (pFedLA "
                               "public implementation: 100)")
    hidden_dim: int = Field(100, ge=1, description="hypernetwork MLP width (pFedLA public "
                            "implementation: 100)")
    evaluate: Literal["local", "aggregate"] = Field(
        "local", description="model a client predicts with: 'local' = its locally trained "
        "theta_i, 'aggregate' = its current hypernetwork aggregate bar theta_i (the public "
        "implementation's test routine)")


class HyperNetwork(nn.Module):
    """Embedding -> 3-layer MLP -> one head per model layer giving N aggregation weights.

    Heads start at weight 0, bias 1, so every client starts from uniform weights (the
    FedAvg-like average); weights are ReLU outputs normalised to sum to one per layer.
    """

    def __init__(self, num_clients: int, num_layers: int, embedding_dim: int, hidden_dim: int):
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(embedding_dim))
        self.mlp = nn.Sequential(
            nn.Linear(embedding_dim, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim), nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim), nn.ReLU())
        self.heads = nn.Linear(hidden_dim, num_layers * num_clients)  # all layer heads at once
        nn.init.zeros_(self.heads.weight)
        nn.init.ones_(self.heads.bias)
        self.num_layers, self.num_clients = num_layers, num_clients

    def forward(self, self_index: int) -> torch.Tensor:
        """``[L, N]`` aggregation weights, rows non-negative and summing to one."""
        raw = F.relu(self.heads(self.mlp(self.embedding))).view(self.num_layers, self.num_clients)
        total = raw.sum(1, keepdim=True)
        # a row the ReLU switched off entirely falls back to the client's own layer
        own = F.one_hot(torch.tensor(self_index), self.num_clients).to(raw.dtype).expand_as(raw)
        return torch.where(total > 0, raw / total.clamp_min(1e-12), own)


class PFedLAServer(Server, Reporter):
    # the clients' latest models and every client's hypernetwork parameters (stacked)
    state: ClassVar[tuple[str, ...]] = ("models", "hn_params")

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        n = ctx.num_clients
        self.models: State = {k: ctx.stacks.repeat(v, n) for k, v in ctx.init_model.items()}
        # which layer's weights combine each tensor (buffers follow their module's layer)
        self.layer_of: dict[str, int | None] = {}
        layer_index = {layer.name: i for i, layer in enumerate(ctx.layers.layers)}
        for name in ctx.init_model:
            try:
                self.layer_of[name] = ctx.layers.layer_of(name)
            except KeyError:
                self.layer_of[name] = layer_index.get(name.rsplit(".", 1)[0])
        with torch.random.fork_rng(devices=[]):  # a skeleton; its own values are never used
            self.hn = HyperNetwork(n, len(ctx.layers), hp.embedding_dim, hp.hidden_dim)
        self.hn_names = [k for k, _ in self.hn.named_parameters()]
        self.hn_params: State = {}
        for cid in range(n):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(ctx.seed, "pfedla", "hypernetwork", cid))
                fresh = HyperNetwork(n, len(ctx.layers), hp.embedding_dim, hp.hidden_dim)
            for k, v in fresh.named_parameters():
                if k not in self.hn_params:
                    self.hn_params[k] = torch.zeros(n, *v.shape)
                self.hn_params[k][cid] = v.detach()

    # -- the hypernetwork of one client -----------------------------------------------
    def _load(self, cid: int) -> None:
        with torch.no_grad():
            for k, p in self.hn.named_parameters():
                p.copy_(self.hn_params[k][cid])

    def alpha(self, cid: int) -> torch.Tensor:
        """Client ``cid``'s current layer-wise weights ``[L, N]`` (no graph)."""
        self._load(cid)
        with torch.no_grad():
            return self.hn(cid)

    def aggregate_for(self, cid: int, alpha: torch.Tensor) -> State:
        """``bar theta_i``: per tensor, the weights of its layer over the stored models."""
        out: State = {}
        for name, stack in self.models.items():
            layer = self.layer_of[name]
            if not stack.is_floating_point() or layer is None:
                out[name] = stack[cid].clone()
            else:
                out[name] = torch.tensordot(alpha[layer].to(stack.dtype), stack, dims=1)
        return out

    def update_hypernetwork(self, cid: int, delta: State) -> None:
        """One SGD step of ``HN_cid`` with gradient ``(d bar theta / d phi)^T (-delta)``."""
        self._load(cid)
        params = list(self.hn.parameters())
        bar = self.aggregate_for(cid, self.hn(cid))
        # trainable parameters only: BatchNorm running statistics are mixed with the same
        # weights but are not what the hypernetwork is trained to aggregate well
        trainable = set(self.ctx.layers.param_names)
        names = [n for n in delta if bar[n].requires_grad and n in trainable]
        # the vector-Jacobian product as the gradient of <bar theta, -delta> (backward()
        # rather than autograd.grad: the engine's FLOP counter hooks support only the former)
        for p in params:
            p.grad = None
        surrogate = sum((bar[n] * -delta[n]).sum() for n in names)
        if isinstance(surrogate, torch.Tensor):
            surrogate.backward()
        with torch.no_grad():
            for k, p in zip(self.hn_names, params, strict=True):
                if p.grad is not None:
                    self.hn_params[k][cid] -= self.hp.hn_lr * p.grad
                p.grad = None

    # -- protocol ----------------------------------------------------------------------
    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        return {cid: Message(self.aggregate_for(cid, self.alpha(cid))) for cid in selected}

    def eval_message(self, cid: int) -> Message | None:
        if self.hp.evaluate == "aggregate":
            return Message(self.aggregate_for(cid, self.alpha(cid)))
        return None

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        # every hypernetwork step uses the models the aggregates were built from, so the
        # replies are stored only after all steps
        for cid, reply in replies.items():
            sent = self.aggregate_for(cid, self.alpha(cid))
            delta = {n: reply.tensors[n] - sent[n] for n in sent if sent[n].is_floating_point()}
            self.update_hypernetwork(cid, delta)
        for cid, reply in replies.items():
            for name, stack in self.models.items():
                stack[cid].copy_(reply.tensors[name])

    def check_reply(self, cid: int, reply: Message) -> None:
        check_message(f"client {cid}", reply, self.ctx.init_model)  # its whole model

    def round_metrics(self) -> dict[str, float]:
        # whether the hypernetworks moved off their uniform start at all: with too small an
        # hn_lr pFedLA is an unweighted average of all clients' models, and only this shows it
        n = self.ctx.num_clients
        alphas = torch.stack([self.alpha(cid) for cid in range(n)])  # [N, L, N]
        own = torch.diagonal(alphas, dim1=0, dim2=2)                 # [L, N]
        return {"la_self_weight_mean": float(own.mean()),
                "la_weight_dev_max": float((alphas - 1.0 / n).abs().max())}


class PFedLAClient(PersonalModelClient):
    batchable = True  # the update is one plain fit from the server's aggregate

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if self.hp.evaluate == "aggregate":
            if eval_msg is None:
                raise MessageError("pFedLA with evaluate=aggregate needs the server's aggregate")
            return eval_msg.tensors
        return super().personal_model(state, eval_msg)

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        return sgd_request(self, msg.tensors, data, gen)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        return UpdateResult(Message(trained), model_to_state(trained), stats)


ALGORITHM = Algorithm(
    name="pfedla",
    summary="pFedLA: per-client hypernetworks give layer-wise aggregation weights",
    hyperparameters=PFedLAHyperparameters,
    server=PFedLAServer,
    client=PFedLAClient,
    paper="Ma et al., Layer-wised Model Aggregation for Personalized Federated Learning, CVPR 2022",
    privacy=PrivacySupport(
        sample=True, refused="client level: per-client hypernetworks weight each client's "
        "individual layers"),
    no_new_clients="its hypernetwork aggregates per client, from an embedding learned in the "
                   "client's rounds: a stranger has none",
)
