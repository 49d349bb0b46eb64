"""HypCluster (Mansour, Mohri, Ro and Suresh, *Three Approaches for Personalization with
Applications to Federated Learning*, arXiv:2002.10619, 2020, Sec. 3): k hypotheses; every
client belongs to the one with the lowest loss on its data.

One round (the paper's HypCluster algorithm, FedJAX's ``hyp_cluster.apply``):

* server: send all k hypotheses h_1..h_k to the selected clients (each must compare them);
* client p: f(p) = argmin_i L_p(h_i), the mean cross-entropy on its training data (ties:
  the lowest i); train h_f(p) for ``train.local_epochs``; reply the trained model, n_p and
  f(p);
* server: h_i <- sum_{p: f(p) = i} n_p w_p / sum n_p over the replies that joined i, a
  FedAvg step per cluster; a hypothesis no reply joined keeps its value.

A client predicts with the hypothesis of lowest loss on its training data, recomputed on the
current hypotheses whenever it is evaluated (FedJAX's ``HypClusterEvaluator``).

Initialisation (the paper takes the initial hypotheses as an input; FedJAX's ``kmeans_init``,
a k-means++ variant in loss): every client trains the shared initial model w_0; the first
hypothesis is one of these models chosen uniformly at random; each next one is the model of
the client whose best loss over the hypotheses chosen so far is the largest. Here that
greedy loop runs over the first k rounds that get replies, one hypothesis per round: the
selected clients receive w_0 and the hypotheses chosen so far, report their losses on those
and the model they trained from w_0, and the server picks among that round's replies. With
k = 1 there is nothing to choose, so the one hypothesis is w_0 and HypCluster is FedAvg.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import ClassVar, cast

import torch
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    Hyperparameters,
    IntRange,
    PrivacySupport,
    Reporter,
    SearchRange,
    Server,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import average_models, fit, num_samples
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import COUNT, Message, MessageError, check_message, int_in, like
from edgepfl.federation.rng import generator
from edgepfl.federation.store import StackedStore
from edgepfl.training.client_data import ClientData

INIT = "init."      # w_0, sent while the initial hypotheses are being chosen
LOSSES = "losses"   # a client's mean losses on the hypotheses it received (initialisation)
CLUSTER = "cluster"  # the hypothesis a client joined (sent when it had a choice)


class HypClusterHyperparameters(Hyperparameters):
    # k, the number of hypotheses (1 is FedAvg); more than the clients is refused
    search_space: ClassVar[dict[str, SearchRange]] = {"clusters": IntRange(1, 3)}
    clusters: int = Field(
        2, ge=1, description="k, the number of hypotheses; our choice (FedJAX's default, 1, is "
        "FedAvg); k > 1 spends the first k rounds choosing them (k-means++ variant of FedJAX)")


def hypothesis_key(c: int, name: str) -> str:
    return f"h{c}.{name}"


def split_hypotheses(msg: Message, names: list[str]) -> tuple[State | None, list[State]]:
    """(w_0 if the message carries it, the hypotheses h_0, h_1, ... in order)."""
    init = {n[len(INIT):]: v for n, v in msg.tensors.items() if n.startswith(INIT)}
    hyps: dict[int, State] = {}
    for key, value in msg.tensors.items():
        if key.startswith(INIT):
            continue
        head, _, name = key.partition(".")
        if not (head.startswith("h") and head[1:].isdigit() and name):
            raise MessageError(f"HypCluster message entry {key!r} is neither h<i>.<name> nor "
                               f"{INIT}<name>")
        hyps.setdefault(int(head[1:]), {})[name] = value
    if sorted(hyps) != list(range(len(hyps))):
        raise MessageError(f"HypCluster hypotheses {sorted(hyps)} are not 0..{len(hyps) - 1}")
    models = {f"h{c}": hyps[c] for c in sorted(hyps)}
    if init:
        models["w_0"] = init
    for label, model in models.items():
        missing = set(names) - set(model)
        if missing:
            raise MessageError(f"HypCluster {label} lacks {sorted(missing)}")
    return (init or None), [hyps[c] for c in range(len(hyps))]


class HypClusterServer(Server, Reporter):
    state: ClassVar[tuple[str, ...]] = ("hypotheses", "centers", "center_clients", "assignment")

    def __init__(self, ctx: ServerContext, hp: HypClusterHyperparameters):
        super().__init__(ctx, hp)
        k = hp.clusters
        if k > ctx.num_clients:
            raise ConfigError(f"algorithm.clusters = {k} exceeds the {ctx.num_clients} clients; "
                              f"valid: 1 to {ctx.num_clients}")
        if k > 1 and ctx.train.rounds <= k:
            warnings.warn(f"hypcluster: choosing algorithm.clusters={k} initial hypotheses takes "
                          f"the first {k} rounds, so train.rounds={ctx.train.rounds} leaves no "
                          "HypCluster round", stacklevel=2)
        self.init_model = ctx.init_model
        self.names = list(ctx.init_model)
        self.hypotheses = StackedStore(k)  # row i: h_i, present once chosen
        self.centers = 0                  # hypotheses chosen so far
        if k == 1:
            self.hypotheses.set_row(0, ctx.init_model)
            self.centers = 1
        self.center_clients: list[int] = []       # whose model became h_i (initialisation)
        self.assignment = [-1] * ctx.num_clients  # each client's latest f(p); -1: none yet
        self._joined: dict[int, int] = {}

    def model(self, c: int) -> State:
        return self.hypotheses.row(c, self.names)

    def _chosen(self) -> dict[str, torch.Tensor]:
        return {hypothesis_key(c, n): v for c in range(self.centers)
                for n, v in self.model(c).items()}

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        tensors = self._chosen()
        if self.centers < self.hp.clusters:
            tensors.update({INIT + n: v for n, v in self.init_model.items()})
        msg = Message(tensors)
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        self._joined = {}
        if self.centers < self.hp.clusters:
            self._choose_center(rnd, replies)
            return
        members: dict[int, dict[int, Message]] = {}
        for cid, reply in replies.items():
            c = cast(int, reply.meta.get(CLUSTER, 0))  # with k = 1 there is no choice to report
            members.setdefault(c, {})[cid] = reply
            self.assignment[cid] = c
        for c, group in sorted(members.items()):
            self.hypotheses.set_row(c, average_models(self.ctx, None, self.model(c), group))
            self._joined[c] = len(group)

    def check_reply(self, cid: int, reply: Message) -> None:
        """Its trained model and sample count; while the hypotheses are chosen, its losses
        on the ones chosen so far; after, with a choice, the hypothesis it joined."""
        k, chosen = self.hp.clusters, self.centers
        tensors, meta = dict(self.init_model), {"num_samples": COUNT}
        if 0 < chosen < k:
            tensors[LOSSES] = like((chosen,), torch.get_default_dtype())
        elif chosen == k > 1:
            meta[CLUSTER] = int_in(0, k)
        check_message(f"client {cid}", reply, tensors, meta)

    def _choose_center(self, rnd: int, replies: dict[int, Message]) -> None:
        """One step of FedJAX's kmeans_init over this round's replies: a uniformly random
        client's model first, then the model of the client worst served by the hypotheses
        chosen so far. A client without data trained nothing, so it is no candidate."""
        candidates = [cid for cid in sorted(replies) if num_samples(cid, replies[cid]) > 0]
        if not candidates:
            return
        if self.centers == 0:
            pick = int(torch.randint(len(candidates), (1,),
                                     generator=generator(self.ctx.seed, "hypcluster-init", rnd)))
            chosen = candidates[pick]
        else:
            best = []
            for cid in candidates:
                losses = replies[cid].tensors[LOSSES]
                # a hypothesis whose loss is not finite serves the client as badly as can be
                best.append(float(torch.nan_to_num(losses.double(), nan=float("inf")).min()))
            chosen = candidates[max(range(len(best)), key=best.__getitem__)]
        reply = replies[chosen]
        self.hypotheses.set_row(self.centers, {n: reply.tensors[n] for n in self.names})
        self.center_clients.append(chosen)
        self.centers += 1

    def eval_message(self, cid: int) -> Message | None:
        if self.centers == 0:  # nothing chosen yet: every client still holds w_0
            return Message({hypothesis_key(0, n): v for n, v in self.init_model.items()})
        return Message(self._chosen())

    def round_metrics(self) -> dict[str, float]:
        return {"hypotheses": float(self.centers), "clusters_joined": float(len(self._joined))}

    def write_artifacts(self, out_dir: Path, plots: bool) -> None:
        from edgepfl.io import write_json

        write_json(Path(out_dir) / "hypcluster_clusters.json", {
            "clusters": self.hp.clusters,
            "initial_hypotheses_from_clients": self.center_clients,
            "assignment": self.assignment,
        })


class HypClusterClient(Client):
    def losses(self, hyps: list[State], data: ClientData) -> torch.Tensor:
        """L_p(h_i): mean cross-entropy of each hypothesis on the client's training data."""
        if data.n == 0:
            return torch.zeros(len(hyps))
        parts = list(data.buckets())  # one per input shape (dataset.aspect_ratios)
        return torch.tensor([sum(self.trainer.evaluate(h, x, y)[1] for x, y in parts) / data.n
                             for h in hyps])

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        init, hyps = split_hypotheses(msg, self.trainer.state_names)
        meta: dict = {"num_samples": data.n}
        extra: State = {}
        if init is not None:
            # initialisation: report how well the chosen hypotheses serve this client, and
            # the model it trains from w_0 (a candidate for the next hypothesis)
            if hyps:
                extra[LOSSES] = self.losses(hyps, data)
            start = init
        elif len(hyps) == 1:  # nothing to choose (k = 1): FedAvg's client, bit for bit
            start = hyps[0]
        else:
            c = int(torch.argmin(self.losses(hyps, data)))
            meta[CLUSTER] = c
            start = hyps[c]
        self.trainer.load(start)
        stats = fit(self, data, gen)
        return UpdateResult(Message({**self.trainer.export(), **extra}, meta), {}, stats)

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        if eval_msg is None:
            raise MessageError("HypCluster clients choose among the hypotheses, but none were given")
        _, hyps = split_hypotheses(eval_msg, self.trainer.state_names)
        if len(hyps) == 1:
            return {"": hyps}
        return {"": [hyps[int(torch.argmin(self.losses(hyps, data)))]]}

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        if eval_msg is not None:
            _, hyps = split_hypotheses(eval_msg, self.trainer.state_names)
            if len(hyps) == 1:
                return hyps[0]
        # which hypothesis serves a client is decided on its training data (predictive)
        raise MessageError("a HypCluster client picks its hypothesis by its loss on its "
                           "training data: call predictive with the data")


ALGORITHM = Algorithm(
    name="hypcluster",
    summary="HypCluster: k hypotheses, each client joins (and trains) the one of lowest loss "
            "on its data; k-means++-style initialisation from client-trained models",
    hyperparameters=HypClusterHyperparameters,
    server=HypClusterServer,
    client=HypClusterClient,
    paper="Mansour, Mohri, Ro and Suresh, Three Approaches for Personalization with "
          "Applications to Federated Learning, arXiv:2002.10619, 2020",
    privacy=PrivacySupport(
        refused="client level: each client is assigned a hypothesis from its own losses; sample "
        "level: those losses on its training data go to the server un-noised"),
)
