"""SCAFFOLD (Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, *SCAFFOLD: Stochastic
Controlled Averaging for Federated Learning*, ICML 2020), Algorithm 1 with option II.

Control variates correct each client's drift: the server keeps c, client i keeps c_i (both
start at zero). Each round:

* server: send (x, c) to the selected clients S;
* client i: y_i <- x; for each of the K local steps (one per mini-batch of
  ``train.local_epochs`` epochs)  y_i <- y_i - eta_l (g_i(y_i) + c - c_i);
  option II:  c_i+ <- c_i - c + (x - y_i) / (K eta_l);
  send (y_i, Delta c_i = c_i+ - c_i), keep c_i <- c_i+;
* server:  x <- x + eta_g * mean_S (y_i - x)   (``weighting``: sample-weighted, as our
  FedAvg, or the paper's uniform mean), c <- c + 1/N sum_S Delta c_i.

The correction c - c_i is a gradient hook (added to the gradient after weight decay, so
with c = c_i = 0 it adds an exact zero and the round is FedAvg's bit for bit, which a test
checks). The client's rate eta_l is ``train.lr`` (the schedule's rate of the round). Every
client predicts with the global model x: SCAFFOLD is not a personalized method, it is the
drift-corrected FedAvg that pFL papers compare against. See docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, cast

import torch
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    SearchRange,
    Server,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import num_samples, sgd_request
from edgepfl.federation.aggregate import weighted_average
from edgepfl.federation.messages import COUNT, Message, MessageError, check_message
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest

CONTROL = "control."   # c in the server's message, c_i in the client's state
DELTA = "delta_c."     # Delta c_i in the reply


class ScaffoldHyperparameters(Hyperparameters):
    # the paper's experiments take eta_g = 1 and tune the local rate; a global step of
    # its own is the one knob SCAFFOLD adds to FedAvg's
    search_space: ClassVar[dict[str, SearchRange]] = {"eta_g": LogUniform(0.5, 2.0)}
    eta_g: float = Field(1.0, gt=0, description="global step size eta_g: x <- x + eta_g * "
                         "mean(y_i - x); > 0, the paper's experiments use 1 (then the new "
                         "global model is the clients' mean, FedAvg's)")
    weighting: Literal["samples", "uniform"] = Field(
        "samples", description="how the clients' models are averaged: samples = by sample "
        "count, as edgepfl's FedAvg; uniform = Algorithm 1's plain mean over S; the "
        "control variate c is always Algorithm 1's c + 1/N sum Delta c_i")


@dataclass(frozen=True)
class Correction:
    """SCAFFOLD's drift correction as a gradient hook: g <- g + (c - c_i)."""

    correction: Sequence[torch.Tensor]

    def __call__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        torch._foreach_add_(list(grads), list(self.correction))


class ScaffoldServer(Server):
    state = ("global_model", "control")

    def __init__(self, ctx: ServerContext, hp: ScaffoldHyperparameters):
        super().__init__(ctx, hp)
        self.global_model: State = {k: v.clone() for k, v in ctx.init_model.items()}
        self.params = list(ctx.layers.param_names)
        # c = 1/N sum_i c_i, zero while every c_i is
        self.control: State = {n: torch.zeros_like(ctx.init_model[n]) for n in self.params}

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        msg = Message({**self.global_model, **{CONTROL + n: c for n, c in self.control.items()}})
        return {cid: msg for cid in selected}

    def check_reply(self, cid: int, reply: Message) -> None:
        expected = {**self.global_model, **{DELTA + n: c for n, c in self.control.items()}}
        check_message(f"client {cid}", reply, expected, {"num_samples": COUNT})
        if cast(int, reply.meta["num_samples"]) < 1:  # an integer: check_message
            raise MessageError(f"client {cid} sent num_samples = 0; expected a positive "
                               "integer (the samples it trained on)")

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        models = [{k: r.tensors[k] for k in self.global_model} for r in replies.values()]
        weights = ([num_samples(cid, r) for cid, r in replies.items()]
                   if self.hp.weighting == "samples" else [1] * len(replies))
        mean = weighted_average(models, weights)
        eta = self.hp.eta_g
        if eta == 1.0:  # x + (mean - x) is the mean itself, without its rounding
            self.global_model = mean
        else:
            self.global_model = {k: x + eta * (mean[k] - x) if k in self.control else mean[k]
                                 for k, x in self.global_model.items()}
        # c <- c + 1/N sum_{i in S} Delta c_i: c stays the mean of all N clients' c_i
        n = self.ctx.num_clients
        for name, c in self.control.items():
            total = torch.stack([r.tensors[DELTA + name] for r in replies.values()]).sum(0)
            self.control[name] = c + total / n

    def eval_message(self, cid: int) -> Message | None:
        return Message(self.global_model)


class ScaffoldClient(Client):
    batchable = True  # the update is one fit with a gradient hook: run_update

    def __init__(self, ctx: ClientContext, hp: ScaffoldHyperparameters) -> None:
        super().__init__(ctx, hp)
        # eta_l of a fit between its request and its finish: the engine may finish a
        # batched fit after the round's rate was lent (train.lr_decay)
        self._lr: dict[int, float] = {}

    def init_state(self, cid: int, init_model: State) -> State:
        return {CONTROL + n: torch.zeros_like(init_model[n]) for n in self.trainer.param_names}

    def _model(self, msg: Message) -> State:
        names = self.trainer.state_names
        missing = [n for n in names if n not in msg.tensors]
        missing += [CONTROL + n for n in self.trainer.param_names if CONTROL + n not in msg.tensors]
        if missing:
            raise MessageError(f"SCAFFOLD message lacks {missing}")
        return {n: msg.tensors[n] for n in names}

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        names = self.trainer.param_names
        correction = [msg.tensors[CONTROL + n] - state[CONTROL + n] for n in names]
        request = sgd_request(self, self._model(msg), data, gen,
                              grad_hook=Correction(self.trainer.place(correction)))
        self._lr[cid] = request.lr
        return request

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        steps, lr = int(stats.get("steps", 0)), self._lr.pop(cid, self.ctx.train.lr)
        new_state, delta = {}, {}
        for n in self.trainer.param_names:
            c_i, c = state[CONTROL + n], msg.tensors[CONTROL + n]
            if steps:  # option II: c_i+ = c_i - c + (x - y_i) / (K eta_l)
                c_new = c_i - c + (msg.tensors[n] - trained[n]) / (steps * lr)
            else:
                c_new = c_i.clone()
            new_state[CONTROL + n] = c_new
            delta[DELTA + n] = c_new - c_i
        reply = Message({**trained, **delta}, {"num_samples": data.n})
        return UpdateResult(reply, new_state, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError("SCAFFOLD clients predict with the global model, but none was "
                               "given")
        return {n: eval_msg.tensors[n] for n in self.trainer.state_names}


ALGORITHM = Algorithm(
    name="scaffold",
    summary="SCAFFOLD: FedAvg with server and client control variates correcting client drift "
            "(option II)",
    hyperparameters=ScaffoldHyperparameters,
    server=ScaffoldServer,
    client=ScaffoldClient,
    paper="Karimireddy, Kale, Mohri, Reddi, Stich and Suresh, SCAFFOLD: Stochastic "
          "Controlled Averaging for Federated Learning, ICML 2020",
    privacy=PrivacySupport(
        sample=True, refused="client level: a reply carries the change of the client's "
        "control variate (Delta c_i), which it was not sent; DP-FedAvg clips and noises only "
        "the model update, so Delta c_i would leave the client unprotected"),
)
