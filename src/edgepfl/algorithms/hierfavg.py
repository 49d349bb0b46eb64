"""HierFAVG (Liu et al., "Client-Edge-Cloud Hierarchical Federated Learning", ICC 2020).

Algorithm 1 of the paper, with k1 = ``train.local_epochs`` and k2 = ``topology.edge_rounds``:

    cloud:  send the global model to every edge
    edge:   k2 times: send its model to its clients; each trains k1 local epochs;
            the edge model <- sample-weighted mean of its clients' models
    cloud:  global model <- sample-weighted mean of the edge models (weight: the samples
            behind each edge model)

With one edge and k2 = 1 this is FedAvg exactly (the edge's average is FedAvg's and the
cloud's mean of one model is that model); with K edges and k2 = 1 it is FedAvg up to
floating-point rounding, since sum_k (n_k/n) sum_{i in k} (n_i/n_k) w_i = sum_i (n_i/n) w_i.
Edge <-> cloud traffic is one model per edge per cloud round, i.e. per k2 client rounds.

On clients of several architectures (``model.tiers``) each parameter is averaged over the
clients that hold it at the edge, and over the edges whose clients hold it at the cloud,
weighted by those clients' samples.
"""

from __future__ import annotations

from typing import cast

from pydantic import Field

from edgepfl.algorithms.fedavg import PRIVACY, FedAvgClient, FedAvgHyperparameters, FedAvgServer
from edgepfl.contract.algorithm import (
    Algorithm,
    Edge,
    EdgeContext,
    State,
)
from edgepfl.contract.kit import (
    STALENESS,
    average_models,
    check_model_reply,
    num_samples,
    staleness,
)
from edgepfl.federation.aggregate import weighted_average
from edgepfl.federation.messages import Message, MessageError

KEY_SAMPLES = "key_samples"


class HierFAVGHyperparameters(FedAvgHyperparameters):
    staleness_exponent: float = Field(
        0.5, ge=0, description="topology.mode = async: an edge model s cloud periods old is "
        "weighted by its samples times (1 + s)^-a (FedAsync's polynomial rule); 0 ignores age")


class HierFAVGCloud(FedAvgServer):
    """FedAvg's server (global model, one per architecture's layers) whose peers are edges."""

    def configure(self, rnd: int, edges: list[int]) -> dict[int, Message]:
        msg = Message(self.global_model)
        return {k: msg for k in edges}

    def aggregate(self, rnd: int, reports: dict[int, Message]) -> None:
        weights = {k: num_samples(k, m) for k, m in reports.items()}
        ages = {k: staleness(k, m) for k, m in reports.items()}
        if any(ages.values()):  # asynchronous edges: older models count for less
            a = self.hp.staleness_exponent
            weights = {k: w * (1 + ages[k]) ** -a for k, w in weights.items()}
        if not reports or sum(weights.values()) == 0:
            return
        for k, m in reports.items():
            missing = set(self.global_model) - set(m.tensors)
            if missing:
                raise MessageError(f"edge {k}'s model lacks {sorted(missing)}")
        if self.index is None:
            self.global_model = weighted_average([m.tensors for m in reports.values()],
                                                 list(weights.values()))
            return
        # per parameter: the edges whose clients hold it, weighted by those clients' samples
        keys = list(self.global_model)
        per_key = {k: _key_samples(k, m, len(keys)) for k, m in reports.items()}
        out = {}
        for j, key in enumerate(keys):
            holders = [k for k in reports if per_key[k][j] > 0]
            if not holders:
                out[key] = self.global_model[key]
                continue
            out[key] = weighted_average([{key: reports[k].tensors[key]} for k in holders],
                                        [per_key[k][j] for k in holders])[key]
        self.global_model = out



def _key_samples(edge: int, report: Message, count: int) -> list[int]:
    value = report.meta.get(KEY_SAMPLES)
    if not isinstance(value, list) or len(value) != count or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value):
        raise MessageError(f"edge {edge}'s report needs {KEY_SAMPLES}: {count} sample counts "
                           f"(integers >= 0), one per parameter; it has {value!r}")
    return cast(list[int], value)


class HierFAVGEdge(Edge):
    # what an asynchronous edge still holds when a cloud period ends before it finishes
    state = ("model", "samples", "refreshed")

    def __init__(self, ctx: EdgeContext, hp):
        super().__init__(ctx, hp)
        self.index = ctx.param_index()
        self.model: State = {}
        self.samples: dict[str, int] = {}  # client id (as text: JSON keys) -> samples
        self.refreshed = 0  # the cloud round of the edge's last aggregation of its clients

    def receive(self, rnd: int, msg: Message) -> None:
        # nobody has trained on the new model yet: if none of the edge's clients replies this
        # cloud round, it reports the cloud's own model with no samples (weight 0), not with
        # the last round's samples and an age, which would pull the cloud back to it
        self.model = dict(msg.tensors)
        self.samples = {}

    def configure(self, rnd: int, step: int, selected: list[int]) -> dict[int, Message]:
        if self.index is None:
            msg = Message(self.model)
            return {cid: msg for cid in selected}
        return {cid: Message(self.index.model(self.ctx.arch_of[cid], self.model))
                for cid in selected}

    def check_reply(self, cid: int, reply: Message) -> None:
        check_model_reply(cid, reply, self.ctx.model_of(cid))

    def aggregate(self, rnd: int, step: int, replies: dict[int, Message]) -> None:
        self.model = average_models(self.ctx, self.index, self.model, replies)
        self.samples = {str(cid): num_samples(cid, r) for cid, r in replies.items()}
        self.refreshed = rnd

    def report(self, rnd: int) -> Message:
        meta: dict = {"num_samples": sum(self.samples.values())}
        if rnd - self.refreshed > 0:  # still busy (asynchronous): what it holds is older
            meta[STALENESS] = rnd - self.refreshed
        if self.index is not None:
            arch_of = self.ctx.arch_of
            meta[KEY_SAMPLES] = [
                sum(n for cid, n in self.samples.items()
                    if arch_of[int(cid)] in self.index.holders(key))
                for key in self.model]
        return Message(self.model, meta)


ALGORITHM = Algorithm(
    name="hierfavg",
    summary="HierFAVG: client -> edge -> cloud FedAvg; k2 edge aggregations per cloud round",
    hyperparameters=HierFAVGHyperparameters,
    server=HierFAVGCloud,
    client=FedAvgClient,
    edge=HierFAVGEdge,
    heterogeneous=True,
    paper="Liu et al., Client-Edge-Cloud Hierarchical Federated Learning, ICC 2020",
    privacy=PRIVACY,
)
