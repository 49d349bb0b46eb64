"""pFedMe (Dinh, Tran, Nguyen, *Personalized Federated Learning with Moreau Envelopes*,
NeurIPS 2020).

A client's personalized model is the proximal point of its loss at its local model w,
theta_i(w) = argmin_theta f_i(theta) + lamda/2 ||theta - w||^2, and the federation
minimises the clients' Moreau envelopes, whose gradient at w is lamda (w - theta_i(w)).
Algorithm 1, as implemented:

* server: send the global model w; then, over the clients that replied,
  w <- (1 - beta) w + beta * mean_i w_i  (sample-weighted mean, as the authors' code);
* client, one local step per mini-batch D of ``train.local_epochs`` epochs, starting from
  w_i = w and theta = w:
    - K times: theta <- theta - personal_lr * (grad f_i(theta; D) + lamda (theta - w_i))
      (the inner problem solved approximately, warm-started from the previous theta);
    - w_i <- w_i - eta * lamda * (w_i - theta), eta = ``train.lr``;
  reply w_i; keep theta, the model the client predicts with.

Defaults (HMPL's setting for pFedMe): ``K = 5`` and ``beta = 1`` (also the pFedMe paper's
main experiments), ``lamda = 20`` (the pFedMe paper's Synthetic setting; MNIST used 15);
``personal_lr = 0.01`` (our choice: the pFedMe paper's value at lamda = 20, its Synthetic
runs). See docs/algorithms.md.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field, ValidationInfo, field_validator

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
    model_from_state,
    model_to_state,
)
from edgepfl.contract.kit import average_models
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.training.client_data import ClientData
from edgepfl.training.pulls import Pull
from edgepfl.training.sgd import FitRequest


class PFedMeHyperparameters(Hyperparameters):
    # the paper's lambda (15-20) and inner rates (0.01-0.1), bounded so that
    # personal_lr * lamda stays below 2 (1.8 at most); the outer step moves w_i by
    # train.lr * lamda of its distance to theta, kept at 1.5 at most (theta follows w_i,
    # so larger products need not diverge, but a trial there tunes a different regime)
    search_space: ClassVar[dict[str, SearchRange]] = {
        "lamda": LogUniform(5.0, 30.0),
        "personal_lr": LogUniform(0.003, 0.06),
        "train.lr": LogUniform(0.001, 0.05),
    }
    lamda: float = Field(20.0, gt=0, description="Moreau-envelope regularization lambda "
                         "(HMPL's setting and pFedMe's Synthetic runs: 20; pFedMe's MNIST: 15)")
    K: int = Field(5, ge=1, description="gradient steps per inner (personalized) problem "
                   "(HMPL and the pFedMe paper: 5)")
    personal_lr: float = Field(0.01, gt=0, description="step size of the inner steps (pFedMe "
                               "paper with lamda = 20: 0.01; MNIST with lamda = 15: 0.1)")
    beta: float = Field(1.0, ge=0, description="server mix w <- (1-beta) w + beta mean(w_i) "
                        "(HMPL and the pFedMe paper: 1; beta = 0 never moves the global model)")

    @field_validator("personal_lr")
    @classmethod
    def _inner_steps_contract(cls, value: float, info: ValidationInfo) -> float:
        # the proximal term alone has curvature lamda: gradient steps on it diverge (or
        # oscillate for ever) once personal_lr * lamda reaches 2
        lamda = info.data.get("lamda")
        if lamda is not None and value * lamda >= 2:
            raise ValueError(f"personal_lr * lamda = {value * lamda:.4g} makes the inner steps "
                             f"diverge; valid: personal_lr < 2 / lamda = {2 / lamda:.4g}")
        return value


class PFedMeServer(FedAvgServer):
    def __init__(self, ctx: ServerContext, hp: PFedMeHyperparameters):
        super().__init__(ctx, hp)
        if ctx.train.momentum:
            # Algorithm 1 takes plain gradient steps; dropping momentum quietly would make
            # a run differ from its config
            raise ConfigError(f"pFedMe takes plain gradient steps (Algorithm 1): "
                              f"train.momentum = {ctx.train.momentum} must be 0")

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        mean = average_models(self.ctx, self.index, self.global_model, replies)
        if mean is self.global_model:  # nobody replied with samples: nothing to mix
            return
        b = self.hp.beta
        self.global_model = {k: (1 - b) * v + b * mean[k] if v.is_floating_point() else mean[k]
                             for k, v in self.global_model.items()}


class PFedMeClient(Client):
    """Algorithm 1's client: for each batch, K steps of the personalized model theta on
    f_i(theta) + lamda/2 ||theta - w_i||^2 (at ``personal_lr``), then w_i's step towards
    theta, w_i -= lr lamda (w_i - theta). As a fit: theta is the trained model, w_i the
    anchor of its pull, moved after each batch (``Pull.follow``), so clients batch."""

    batchable: ClassVar[bool] = True

    def __init__(self, ctx: ClientContext, hp: PFedMeHyperparameters):
        super().__init__(ctx, hp)
        self._local: dict[int, list[torch.Tensor]] = {}  # w_i of a fit between request and finish

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        hp, t, tr = self.hp, self.ctx.train, self.trainer
        # theta starts at the global model, as w_i does
        local = [msg.tensors[n].to(tr.device, copy=True) for n in tr.param_names]
        self._local[cid] = local
        # weight decay is part of f_i (the authors' code has such a term); no momentum
        return FitRequest(msg.tensors, data, t.local_epochs, t.batch_size, hp.personal_lr, gen,
                          weight_decay=t.weight_decay, repeat=hp.K,
                          grad_hook=Pull(hp.lamda, local, follow=t.lr * hp.lamda))

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        local = self._local.pop(cid)
        # buffers (BatchNorm statistics) are only ever updated by theta's forward passes;
        # w_i carries them as they are
        reply = dict(trained)
        reply.update(zip(self.trainer.param_names, (w.cpu() for w in local), strict=True))
        return UpdateResult(Message(reply, {"num_samples": data.n}), model_to_state(trained),
                            stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        theta = model_from_state(state)
        if theta:
            return theta
        # never trained: no personalized model has been solved yet, and the one pFedMe
        # would give is the prox of f_i at w, which takes training to compute
        if eval_msg is None:
            raise MessageError("pFedMe: a client that never trained predicts with the global "
                               "model, but none was given")
        return eval_msg.tensors


ALGORITHM = Algorithm(
    name="pfedme",
    summary="pFedMe: personalized model = approximate prox of the client loss at its local "
            "model (K inner steps), Moreau-envelope steps on the local model, beta-mixed server",
    hyperparameters=PFedMeHyperparameters,
    server=PFedMeServer,
    client=PFedMeClient,
    paper="Dinh, Tran, Nguyen, Personalized Federated Learning with Moreau Envelopes, "
          "NeurIPS 2020",
    privacy=PrivacySupport(
        client="mean", refused="sample level: its inner personalization loop trains outside the "
        "engine's DP-SGD trainer"),
)
