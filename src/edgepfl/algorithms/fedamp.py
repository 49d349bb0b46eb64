"""FedAMP (Huang et al., AAAI 2021): federated attentive message passing.

The server keeps every client's latest model ``w_j`` and builds for each selected client
a personalized cloud model ``u_i = sum_j xi_ij w_j`` in which similar clients weigh more:

    xi_ij = alpha_k * A'(||w_i - w_j||^2)   (j != i),   xi_ii = 1 - sum_{j != i} xi_ij,
    A(x) = 1 - exp(-x / sigma),  so  A'(x) = exp(-x / sigma) / sigma.

The client then minimises ``F_i(w) + lamda / (2 alpha_k) ||w - u_i||^2`` starting from its
own personal model. The proximal gradient ``(lamda / alpha_k)(w - u_i)`` is added to the
cross-entropy gradient in closed form (a regularizer built from detached tensors would
have no gradient at all, a known fault of some implementations); with lamda = 0 FedAMP
trains exactly as local training (tested).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

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
from edgepfl.contract.kit import proximal_hook, sgd_request
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError, check_message
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest


class FedAMPHyperparameters(Hyperparameters):
    # the pull towards the cloud model and the attention's scale; sigma from 5 up, where
    # the weights on other clients were measured not to decay (docs/algorithms.md), and
    # where any explicit alpha_k valid at the default sigma stays valid
    search_space: ClassVar[dict[str, SearchRange]] = {
        "lamda": LogUniform(0.01, 1.0),
        "sigma": LogUniform(5.0, 50.0),
    }
    alphaK: float | None = Field(None, gt=0, description="message-passing step alpha_k; needs "
                                 "alpha_k (N - 1) / sigma <= 1 so that self-weights stay >= 0; "
                                 "default 0.25, or sigma / (N - 1) where N clients allow less "
                                 "(docs/algorithms.md: why 0.25)")
    lamda: float | None = Field(None, ge=0, description="regularization weight lambda; the "
                                "client's proximal gradient is (lambda / alpha_k)(w - u_i); "
                                "default alpha_k, 1 x")
    sigma: float = Field(5.0, gt=0, description="scale of the attention function "
                         "A(x) = 1 - exp(-x / sigma), in squared parameter distance")


def complete(cfg, hp: FedAMPHyperparameters) -> FedAMPHyperparameters:
    """The defaults that depend on the federation's size, made explicit: alpha_k as large as
    the self-weights allow up to 0.25, and lambda equal to it (a proximal pull of 1 x)."""
    n = cfg.partition.clients
    alpha = hp.alphaK if hp.alphaK is not None else min(0.25, hp.sigma / max(n - 1, 1))
    lamda = hp.lamda if hp.lamda is not None else alpha
    return hp.model_copy(update={"alphaK": alpha, "lamda": lamda})


def squared_distances(flat: torch.Tensor) -> torch.Tensor:
    """``[N, P]`` flattened models -> ``[N, N]`` matrix of ``||w_i - w_j||^2`` (float64)."""
    flat = flat.double()
    sq = (flat * flat).sum(1)
    d = sq[:, None] + sq[None, :] - 2.0 * flat @ flat.T
    d.fill_diagonal_(0.0)
    return d.clamp_min(0.0)


def attention_weights(dist: torch.Tensor, alpha_k: float, sigma: float) -> torch.Tensor:
    """FedAMP's message-passing weights ``xi`` (rows: receiving client; each row sums to 1).

    Off-diagonal ``alpha_k * exp(-d / sigma) / sigma``, diagonal the rest. The paper's
    convergence analysis assumes alpha_k small enough for ``xi_ii >= 0``; we do not clip,
    the server reports the smallest self-weight as ``amp_self_weight_min``.
    """
    xi = alpha_k * torch.exp(-dist / sigma) / sigma
    xi.fill_diagonal_(0.0)
    xi += torch.diag(1.0 - xi.sum(1))
    return xi


class FedAMPServer(Server, Reporter):
    state: ClassVar[tuple[str, ...]] = ("models",)  # every client's latest model, stacked

    def __init__(self, ctx: ServerContext, hp):
        super().__init__(ctx, hp)
        n = ctx.num_clients
        # two identical models get weight alpha_k / sigma each: with N - 1 of them the
        # self-weight 1 - (N - 1) alpha_k / sigma must not go negative (the paper's analysis
        # assumes xi_ii >= 0), else u_i extrapolates away from every client
        worst = hp.alphaK * (n - 1) / hp.sigma
        if worst > 1:
            raise ConfigError(
                f"FedAMP: alphaK = {hp.alphaK} with sigma = {hp.sigma} and {n} clients gives "
                f"self-weights down to {1 - worst:.3g}; valid: alphaK <= sigma / (N - 1) = "
                f"{hp.sigma / max(n - 1, 1):.4g}")
        # every client's latest model, stacked; before its first upload a client's model
        # is the common initial model
        self.models: State = {k: ctx.stacks.repeat(v, n) for k, v in ctx.init_model.items()}
        self.param_names = [p for p in ctx.layers.param_names if p in ctx.init_model]
        self._self_weight_min = 1.0

    def weights(self) -> torch.Tensor:
        flat = torch.cat([self.models[p].flatten(1) for p in self.param_names], dim=1)
        return attention_weights(squared_distances(flat), self.hp.alphaK, self.hp.sigma)

    def cloud_model(self, xi_row: torch.Tensor, cid: int) -> State:
        out: State = {}
        for name, stack in self.models.items():
            if stack.is_floating_point():
                out[name] = torch.tensordot(xi_row.to(stack.dtype), stack, dims=1)
            else:
                out[name] = stack[cid].clone()
        return out

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        xi = self.weights()
        self._self_weight_min = float(xi.diagonal()[selected].min()) if selected else 1.0
        return {cid: Message(self.cloud_model(xi[cid], cid)) for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        for cid, reply in replies.items():
            for name, stack in self.models.items():
                stack[cid].copy_(reply.tensors[name])

    def check_reply(self, cid: int, reply: Message) -> None:
        check_message(f"client {cid}", reply, self.ctx.init_model)  # its whole model

    def round_metrics(self) -> dict[str, float]:
        return {"amp_self_weight_min": self._self_weight_min}


class FedAMPClient(PersonalModelClient):
    batchable = True

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        missing = set(self.trainer.param_names) - set(msg.tensors)
        if missing:
            raise MessageError(f"FedAMP cloud model lacks {sorted(missing)}")
        # local training continues the client's own personal model, pulled towards u_i
        anchor = self.trainer.place([msg.tensors[n] for n in self.trainer.param_names])
        hook = proximal_hook(self.hp.lamda / self.hp.alphaK, anchor)
        return sgd_request(self, self.personal_model(state, None), data, gen, grad_hook=hook)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        return UpdateResult(Message(trained), model_to_state(trained), stats)


ALGORITHM = Algorithm(
    name="fedamp",
    summary="FedAMP: similarity-weighted cloud model per client, proximal pull towards it",
    hyperparameters=FedAMPHyperparameters,
    server=FedAMPServer,
    client=FedAMPClient,
    paper="Huang et al., Personalized Cross-Silo Federated Learning on Non-IID Data, AAAI 2021",
    complete=complete,
    privacy=PrivacySupport(
        sample=True, refused="client level: its server sends each client its own "
        "attention-weighted combination of the individual models"),
    no_new_clients="its server keeps a personalized cloud model per client, built from that "
                   "client's uploads: nothing for a stranger",
)
