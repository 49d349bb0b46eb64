"""HeteroFL (Diao, Ding and Tarokh, *HeteroFL: Computation and Communication Efficient
Federated Learning for Heterogeneous Clients*, ICLR 2021).

One global model; a client of width rate r trains the submodel made of the first
ceil(r * C) channels (units) of every hidden layer of it, the input of the first layer and
the classifier's classes kept whole (the paper's Sec. 3, "heterogeneous models"). Each round:

* server: send each selected client the leading slice of the global model for its rate;
* client: train it, with every hidden layer's output divided by r (the paper's scaler,
  Sec. 3) and BatchNorm normalising with the batch's statistics only (static
  BatchNorm, sBN, Sec. 3); return the slice;
* server: each entry of the global model becomes the mean of the returned slices that
  cover it (``average_width_slices``); an entry no reply covers keeps its value.

A client's rate comes from its device tier (``algorithm.rates``, default HMPL's tiers
weak / ordinary / superior at HeteroFL's levels c / b / a = 0.25 / 0.5 / 1); without
tiers every client has ``algorithm.rate`` (default 1, which is FedAvg exactly on a model
without BatchNorm). HeteroFL is not personalized in its parameters: a client predicts with
its own slice of the global model (with BatchNorm, on statistics of its own data), and
the global (full-width) parameters are reported beside it as ``acc_global_*``. docs/algorithms.md
lists the choices where the paper leaves room and the departures.
"""

from __future__ import annotations

from typing import ClassVar, Literal, cast

import torch
from pydantic import Field, field_validator
from torch import nn

from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    PrivacySupport,
    Server,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import check_model_reply, num_samples
from edgepfl.errors import ConfigError
from edgepfl.federation.aggregate import average_width_slices
from edgepfl.federation.messages import Message, MessageError, like
from edgepfl.models.width import (
    check_rate,
    check_sliceable,
    embed_state,
    fold_scaler,
    slice_state,
    width_model,
    width_shapes,
)
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import host
from edgepfl.training.sgd import FitRequest
from edgepfl.training.trainer import Trainer

RATE = "rate"

# HeteroFL's levels a-e are rates 1, 1/2, 1/4, 1/8, 1/16 (its experiments; model_split_rate
# in the authors' code); HMPL's three tiers
# (system_config.HMPL_TIERS) take a, b and c, the paper's "a-b-c" mix.
DEFAULT_RATES = {"weak": 0.25, "ordinary": 0.5, "superior": 1.0}


def _rate_ok(value: float) -> float:
    if not 0 < value <= 1:
        raise ValueError(f"{value!r} is not a width rate; valid: (0, 1], 1 the full model, "
                         "0.25 a quarter of every hidden layer's channels")
    return value


class HeteroFLHyperparameters(Hyperparameters):
    rates: dict[str, float] = Field(
        DEFAULT_RATES, description="device tier (system.tiers) -> width rate in (0, 1] with "
        "system.devices = 'tiers' (default: HMPL's tiers at HeteroFL's levels c, b, a); the "
        "mapping replaces the default whole, so name every tier")
    rate: float | None = Field(
        None, description="every client's width rate in (0, 1] without device tiers "
        "(None: 1, the full model, which is FedAvg)")
    weighting: Literal["samples", "clients"] = Field(
        "samples", description="weight of a reply in each entry's mean: its sample count "
        "(FedAvg's, so rate 1 everywhere is FedAvg exactly) or 1 per client (the paper's "
        "Sec. 3 rule and the authors' code)")

    @field_validator("rates")
    @classmethod
    def _rates(cls, rates: dict[str, float]) -> dict[str, float]:
        for value in rates.values():
            _rate_ok(value)
        return rates

    @field_validator("rate")
    @classmethod
    def _rate(cls, rate: float | None) -> float | None:
        return rate if rate is None else _rate_ok(rate)


def client_rates(ctx: ServerContext, hp: HeteroFLHyperparameters) -> tuple[float, ...]:
    """Each client's width rate, from its device tier (or ``rate`` for all)."""
    fed = ctx.federation
    tiers = fed.tier if fed is not None else (None,) * ctx.num_clients
    if all(t is None for t in tiers):
        return (1.0 if hp.rate is None else hp.rate,) * ctx.num_clients
    if hp.rate is not None:
        raise ConfigError(f"algorithm.rate = {hp.rate!r} gives every client one width, but "
                          "system.devices = 'tiers' gives each tier its own: set algorithm.rates "
                          "(tier -> rate) instead")
    missing = [t for t in dict.fromkeys(tiers) if t not in hp.rates]
    if missing:
        example = ", ".join(f"{t}=0.5" for t in dict.fromkeys(tiers))
        raise ConfigError(f"algorithm.rates = {hp.rates} has no rate for device tier(s) "
                          f"{missing}; give every tier of system.tiers a rate in (0, 1], e.g. "
                          f"--set 'algorithm.rates={{{example}}}'")
    return tuple(hp.rates[cast(str, t)] for t in tiers)  # no tier is None: it would be missing


def message_rate(msg: Message) -> float:
    msg.require(RATE)
    try:
        return check_rate(msg.meta[RATE], "heterofl: the server's rate")
    except ValueError as exc:
        raise MessageError(str(exc)) from None


class HeteroFLServer(Server):
    state = ("global_model",)

    def __init__(self, ctx: ServerContext, hp: HeteroFLHyperparameters):
        super().__init__(ctx, hp)
        for name in ctx.architectures:
            check_sliceable(name)
        self.rates = client_rates(ctx, hp)
        # sBN keeps no running statistics, so the global model is the parameters alone
        self.global_model: State = {p: ctx.init_model[p].clone() for p in ctx.layers.param_names}
        full = {p: t.shape for p, t in self.global_model.items()}
        self.shapes = {r: width_shapes(ctx.layers, full, r) for r in set(self.rates)}

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        by_rate: dict[float, Message] = {}
        for cid in selected:
            r = self.rates[cid]
            if r not in by_rate:
                by_rate[r] = Message(slice_state(self.global_model, self.shapes[r]), {RATE: r})
        return {cid: by_rate[self.rates[cid]] for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        models, weights = [], []
        for cid, reply in replies.items():
            n = num_samples(cid, reply)
            models.append(reply.tensors)
            weights.append(float(n) if self.hp.weighting == "samples" else float(n > 0))
        if sum(weights) > 0:  # no reply (or none with data): the model stays as it is
            self.global_model = average_width_slices(self.global_model, models, weights)

    def check_reply(self, cid: int, reply: Message) -> None:
        # the slice of its rate: a wider one would cover entries it never trained
        shapes = self.shapes[self.rates[cid]]
        check_model_reply(cid, reply, {k: like(s, self.global_model[k].dtype)
                                       for k, s in shapes.items()})

    def eval_message(self, cid: int) -> Message | None:
        # evaluation is a measurement (not counted): the client cuts its own slice, and the
        # full model gives the paper's global accuracy beside it
        return Message(self.global_model, {RATE: self.rates[cid]})


class HeteroFLClient(Client):
    """Serves clients of every rate: one skeleton per rate, built on first use."""

    batchable: ClassVar[bool] = True

    def __init__(self, ctx: ClientContext, hp: HeteroFLHyperparameters):
        super().__init__(ctx, hp)
        if ctx.arch:
            check_sliceable(ctx.arch)
        self.params = {n: tuple(p.shape) for n, p in ctx.trainer.params.items()}
        self.full = {**self.params, **{n: tuple(b.shape) for n, b in ctx.trainer.buffers.items()}}
        self.batchnorm = bool(ctx.trainer.buffers)
        self._trainers: dict[float, Trainer] = {}
        self._query: dict[float, nn.Module] = {}

    def trainer_at(self, rate: float) -> Trainer:
        if rate not in self._trainers:
            model = width_model(self.trainer.model, self.ctx.layers, rate)
            self._trainers[rate] = Trainer(model, self.trainer.eval_batch_size,
                                           self.trainer.channels_last, self.trainer.device,
                                           compile=self.trainer.compile)
        return self._trainers[rate]

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        """The rate-sized submodel trained on that rate's skeleton (requests of one rate
        batch together; static BatchNorm keeps no running statistics in training)."""
        rate = message_rate(msg)
        trainer = self.trainer_at(rate)
        expected = {n: tuple(p.shape) for n, p in trainer.params.items()}
        got = {k: tuple(t.shape) for k, t in msg.tensors.items()}
        if got != expected:
            raise MessageError(f"heterofl: a rate-{rate} model is {expected}; the server sent {got}")
        t = self.ctx.train
        return FitRequest(msg.tensors, data, t.local_epochs, t.batch_size, t.lr, gen,
                          momentum=t.momentum, weight_decay=t.weight_decay, trainer=trainer)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        return UpdateResult(Message(trained, {"num_samples": data.n}), state, stats)

    # -- prediction -----------------------------------------------------------------------
    def statistics(self, sub: State, rate: float, data: ClientData) -> State:
        """sBN's query: the BatchNorm statistics of the submodel ``sub`` over the client's
        training data (cumulative means of the batch statistics, as the authors' query
        pass), which evaluation normalises with."""
        model = self._query.get(rate)
        if model is None:
            model = width_model(self.trainer.model, self.ctx.layers, rate, track_running_stats=True)
            model = model.to(self.trainer.device)  # its rebuilt layers are made on the CPU
            if self.trainer.channels_last:
                model = model.to(memory_format=torch.channels_last)
            self._query[rate] = model
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(sub[name])
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.reset_running_stats()
            model.train()
            # shape by shape (crops of several sizes cannot share a batch); whole images
            # are one bucket in index order, cut into the same batches as before
            for x, _ in data.buckets():
                for batch in x.split(self.trainer.eval_batch_size):
                    model(self.trainer.layout(batch))
        return {n: host(b.detach()) for n, b in model.named_buffers()}

    def submodel(self, global_model: State, rate: float, data: ClientData | None) -> State:
        """The rate-``rate`` submodel as a state of the full-width module (zero-padded, the
        scaler folded into its weights), so evaluation runs it on the engine's skeleton."""
        sub = slice_state(global_model, width_shapes(self.ctx.layers, self.params, rate))
        if self.batchnorm:
            if data is None:
                raise ValueError("heterofl: a BatchNorm model predicts with statistics queried "
                                 "on the client's data (sBN); use predictive(), which has it")
            sub.update(self.statistics(sub, rate, data))
        return embed_state(fold_scaler(sub, self.ctx.layers, rate), self.full)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError("heterofl clients predict with the global model, but none was given")
        return self.submodel(eval_msg.tensors, message_rate(eval_msg), None)

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        if eval_msg is None:
            raise MessageError("heterofl clients predict with the global model, but none was given")
        rate = message_rate(eval_msg)
        own = self.submodel(eval_msg.tensors, rate, data)
        full = own if rate == 1 else self.submodel(eval_msg.tensors, 1.0, data)
        return {"": [own], "global": [full]}


ALGORITHM = Algorithm(
    name="heterofl",
    summary="HeteroFL: width-sliced submodels (rate per device tier), each entry averaged "
            "over the clients that hold it; static BatchNorm and scaler",
    hyperparameters=HeteroFLHyperparameters,
    server=HeteroFLServer,
    client=HeteroFLClient,
    # sBN is part of the method: with model.name unset, the BatchNorm variant (cnn2_bn)
    model_variant="_bn",
    paper="Diao, Ding and Tarokh, HeteroFL: Computation and Communication Efficient "
          "Federated Learning for Heterogeneous Clients, ICLR 2021",
    privacy=PrivacySupport(
        client="mean", refused="sample level: each width trains on a skeleton of its own, outside "
        "the engine's DP-SGD trainer, and static BatchNorm gives a sample no gradient of its own"),
    no_new_clients="its clients train width slices on skeletons of their rate; serving a "
                   "newcomer's slice is not implemented",
)
