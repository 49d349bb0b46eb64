"""ClusterFL (Ouyang et al., MobiSys 2021): similarity-aware clustering of clients, then
cluster-wise multi-task training coupled by ADMM.

Phases of a run (the server drives them; the client only follows the message):

* warm-up, rounds 1..warmup_rounds: every client trains its own model alone (as ``local``);
  only in the last warm-up round does it upload its weights, because the server needs them
  once, to cluster. Nothing else travels during warm-up.
* clustering (at the end of round ``warmup_rounds``): cosine similarity S of the clients'
  flattened weights; the cluster indicator matrix F maximises tr(F^T S F) subject to
  F^T F = I (the K-means objective written on the similarity, as in the paper). Its
  relaxation is solved exactly by the top-K eigenvectors of S; the discrete indicator is
  recovered by K-means on the row-normalised eigenvector rows (spectral clustering).
* cluster-wise training by scaled consensus ADMM, one ADMM iteration per round:
  client i minimises loss_i(w) + rho/2 ||w - z_c + u_i||^2 by local SGD starting from its
  own model (the pull rho (w - (z_c - u_i)) is added to the gradient, as FedProx does, so
  rho = 0 adds an exact zero and the clients train exactly as ``local``); the server sets
  z_c = mean_{i in c} (w_i + u_i) and then u_i <- u_i + w_i - z_c. Only the anchor
  z_c - u_i goes down (one model), only w_i comes up (one model).

Clients predict with their own w_i (the multi-task, personalised model). The clusters
stay fixed once formed, as in the paper. Clients that missed the clustering round (partial
participation) upload once when next selected and join the cluster whose consensus is most
cosine-similar to their weights.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import ClassVar

import torch
from pydantic import Field

from edgepfl.contract.algorithm import (
    Algorithm,
    Hyperparameters,
    IntRange,
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
from edgepfl.federation.messages import Message, MessageError, check_message
from edgepfl.federation.store import StackedStore
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest

_KMEANS_ITERS = 100  # Lloyd iterations cap; K-means on N <= a few hundred rows converges fast


class ClusterFLHyperparameters(Hyperparameters):
    # K and the ADMM pull, both our choices where the paper is silent
    search_space: ClassVar[dict[str, SearchRange]] = {
        "num_clusters": IntRange(2, 5),
        "rho": LogUniform(0.01, 1.0),
    }
    num_clusters: int = Field(3, ge=1, description="K, the number of clusters (columns of the "
                                                   "indicator matrix F); our choice, the DC-PFL "
                                                   "paper does not state it; capped at the "
                                                   "number of clients clustered")
    warmup_rounds: int = Field(1, ge=1, description="rounds of purely local training before the "
                                                    "clients' weights are clustered (ClusterFL: "
                                                    "cluster after an initial local training; "
                                                    "1 round is our choice)")
    rho: float = Field(0.1, ge=0, description="ADMM penalty rho of rho/2 ||w_i - z_c + u_i||^2, "
                                              "the pull towards the cluster consensus; our "
                                              "choice (0 = local training)")


# -- clustering ----------------------------------------------------------------------------
def cosine_similarity(flat: torch.Tensor) -> torch.Tensor:
    """S_ij = <w_i, w_j> / (|w_i| |w_j|) for the rows of ``flat`` [n, dim] (float64)."""
    w = flat.to(torch.float64)
    w = w / w.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return w @ w.T


def kmeans(points: torch.Tensor, k: int) -> list[int]:
    """Deterministic K-means: farthest-first initialisation from row 0, then Lloyd steps.

    Determinism matters more than a random restart here: the clustering must be a function
    of the uploaded weights alone, so that a resumed run clusters exactly as the full run.
    """
    n = points.shape[0]
    k = min(k, n)
    centres = [0]
    dist = torch.cdist(points, points[:1]).squeeze(1)
    while len(centres) < k:
        nxt = int(torch.argmax(dist))
        centres.append(nxt)
        dist = torch.minimum(dist, torch.cdist(points, points[nxt:nxt + 1]).squeeze(1))
    c = points[centres].clone()
    labels = torch.cdist(points, c).argmin(dim=1)
    for _ in range(_KMEANS_ITERS):
        for j in range(k):
            members = labels == j
            if members.any():  # an emptied cluster keeps its old centre
                c[j] = points[members].mean(dim=0)
        new = torch.cdist(points, c).argmin(dim=1)
        if torch.equal(new, labels):
            break
        labels = new
    return canonical(labels.tolist())


def canonical(labels: list[int]) -> list[int]:
    """Relabel by first appearance so equal partitions compare equal."""
    seen: dict[int, int] = {}
    return [seen.setdefault(int(x), len(seen)) for x in labels]


def spectral_clusters(sim: torch.Tensor, k: int) -> list[int]:
    """Cluster indicator from the similarity: max tr(F^T S F) s.t. F^T F = I is solved by the
    top-k eigenvectors of S (Ky Fan); K-means on their normalised rows makes it discrete."""
    n = sim.shape[0]
    k = min(k, n)
    if k <= 1:
        return [0] * n
    sym = (sim + sim.T) / 2
    _, vecs = torch.linalg.eigh(sym)          # ascending eigenvalues
    f = vecs[:, -k:]
    f = f / f.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return kmeans(f, k)


# -- server ----------------------------------------------------------------------------------
class ClusterFLServer(Server, Reporter):
    state: ClassVar[tuple[str, ...]] = ("w", "u", "z", "labels", "similarity", "clustered_ids",
                                        "clustered_at", "_residual")

    def __init__(self, ctx: ServerContext, hp: ClusterFLHyperparameters):
        super().__init__(ctx, hp)
        n = ctx.num_clients
        self.params = list(ctx.layers.param_names)
        self.w = StackedStore(n, ctx.stacks)  # each client's latest uploaded weights w_i
        self.u = StackedStore(n, ctx.stacks)  # scaled dual variables u_i
        self.z = StackedStore(n, ctx.stacks)  # row i: the consensus z_c of i's cluster
        zero = {p: torch.zeros_like(ctx.init_model[p]) for p in self.params}
        for cid in range(n):  # every row exists from the start, so checkpoints have fixed keys
            self.w.set_row(cid, zero)
            self.u.set_row(cid, zero)
            self.z.set_row(cid, zero)
        self.labels = [-1] * n  # -1: not yet in a cluster
        self.clustered_at = 0   # round the clusters were formed (0: not yet)
        self.similarity = torch.zeros(n, n, dtype=torch.float64)
        self.clustered_ids: list[int] = []  # rows/columns of ``similarity`` that were filled
        self._residual = math.nan
        self._asked: set[int] = set()  # who must upload its weights this round (configure)
        if hp.warmup_rounds >= ctx.train.rounds:
            # the clusters are formed at the end of the last warm-up round; nothing follows
            warnings.warn(f"clusterfl: algorithm.warmup_rounds={hp.warmup_rounds} is not below "
                          f"train.rounds={ctx.train.rounds}, so no cluster-wise round ever runs "
                          "and the run is local training", stacklevel=2)

    # -- protocol -----------------------------------------------------------------------------
    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        out = {}
        for cid in selected:
            if self.labels[cid] >= 0:
                anchor = {p: self.z.tensors[p][cid] - self.u.tensors[p][cid] for p in self.params}
                out[cid] = Message(anchor)
            elif rnd >= self.hp.warmup_rounds:
                out[cid] = Message(meta={"upload": True})
            else:
                out[cid] = Message()  # warm-up: train locally, send nothing
        self._asked = {cid for cid, msg in out.items() if not msg.is_empty()}
        return out

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        uploads = {cid: r for cid, r in replies.items() if r.tensors}
        for cid, reply in uploads.items():
            self.w.set_row(cid, {p: reply.tensors[p] for p in self.params})
        new = sorted(c for c in uploads if self.labels[c] < 0)
        if new and not self.clustered_at:
            self._cluster(rnd, new)
        elif new:
            self._join(new)
        stepped = [c for c in uploads if self.labels[c] >= 0]
        self._admm_step(stepped)

    def check_reply(self, cid: int, reply: Message) -> None:
        # an upload nobody asked for would cluster (or step) a client still warming up
        model = self.ctx.init_model
        expected = {p: model[p] for p in self.params} if cid in self._asked else {}
        check_message(f"client {cid}", reply, expected)

    def _flat(self, store: StackedStore, cids: list[int]) -> torch.Tensor:
        return torch.cat([store.tensors[p][cids].flatten(1).to(torch.float64)
                          for p in self.params], dim=1)

    def _cluster(self, rnd: int, cids: list[int]) -> None:
        if len(cids) < self.hp.num_clusters:
            # with few clients in the clustering round K is capped: singleton clusters train
            # as local with a pull to their own last weights (logged as `clusters`)
            warnings.warn(f"clusterfl: only {len(cids)} clients uploaded in the clustering "
                          f"round {rnd}, fewer than algorithm.num_clusters="
                          f"{self.hp.num_clusters}; the clusters are formed from them and "
                          "later clients join the nearest", stacklevel=2)
        sim = cosine_similarity(self._flat(self.w, cids))
        labels = spectral_clusters(sim, self.hp.num_clusters)
        for cid, lab in zip(cids, labels, strict=True):
            self.labels[cid] = lab
        idx = torch.tensor(cids)
        self.similarity[idx.unsqueeze(1), idx] = sim
        self.clustered_ids = list(cids)
        self.clustered_at = rnd

    def _join(self, cids: list[int]) -> None:
        """A late client joins the cluster whose consensus is most similar to its weights."""
        reps = {}
        for cid, lab in enumerate(self.labels):
            if lab >= 0 and lab not in reps:
                reps[lab] = cid
        order = sorted(reps)
        centres = self._flat(self.z, [reps[lab] for lab in order])
        for cid in cids:
            sim = cosine_similarity(torch.cat([self._flat(self.w, [cid]), centres]))[0, 1:]
            self.labels[cid] = order[int(torch.argmax(sim))]

    def _admm_step(self, stepped: list[int]) -> None:
        """z_c = mean over members of (w_i + u_i); u_i <- u_i + w_i - z_c for the clients that
        uploaded (an absent client's w_i did not move, so its dual is not advanced)."""
        if not stepped:
            self._residual = math.nan
            return
        sq = 0.0
        for lab in sorted({self.labels[c] for c in stepped}):
            members = [c for c, lb in enumerate(self.labels) if lb == lab]
            here = [c for c in stepped if self.labels[c] == lab]
            for p in self.params:
                w, u, z = self.w.tensors[p], self.u.tensors[p], self.z.tensors[p]
                zc = (w[members] + u[members]).mean(dim=0)
                z[members] = zc
                u[here] += w[here] - zc
                sq += float(((w[here] - zc) ** 2).sum())
        self._residual = math.sqrt(sq / len(stepped))

    def round_metrics(self) -> dict[str, float]:
        clusters = len({lab for lab in self.labels if lab >= 0})
        # primal residual: RMS over uploading clients of ||w_i - z_c|| (how far from consensus)
        return {"clusters": float(clusters), "primal_residual": self._residual}

    def write_artifacts(self, out_dir: Path, plots: bool) -> None:
        from edgepfl.io import write_json

        ids = self.clustered_ids
        sim = self.similarity[ids][:, ids].tolist() if ids else []
        write_json(Path(out_dir) / "clusterfl_clusters.json", {
            "clustered_at_round": self.clustered_at,
            "labels": self.labels,
            "clustered_clients": ids,
            "cosine_similarity": sim,
        })


# -- client ----------------------------------------------------------------------------------
class ClusterFLClient(PersonalModelClient):
    batchable = True

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        names = self.trainer.param_names
        hook = None
        if msg.tensors:  # ADMM round: the message is the anchor z_c - u_i
            missing = set(names) - set(msg.tensors)
            if missing:
                raise MessageError(f"ClusterFL anchor lacks {sorted(missing)}")
            hook = proximal_hook(self.hp.rho, self.trainer.place([msg.tensors[n] for n in names]))
        # warm-up (no anchor): plain local training
        return sgd_request(self, self.personal_model(state, None), data, gen, grad_hook=hook)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        # an ADMM round uploads; a warm-up round only when asked (for clustering)
        upload = bool(msg.tensors) or bool(msg.meta.get("upload", False))
        reply = Message({n: trained[n] for n in self.trainer.param_names}) if upload else Message()
        return UpdateResult(reply, model_to_state(trained), stats)


ALGORITHM = Algorithm(
    name="clusterfl",
    summary="ClusterFL: spectral clustering of clients by cosine similarity of their weights, "
            "then cluster-wise consensus ADMM (personal models pulled to the cluster consensus)",
    hyperparameters=ClusterFLHyperparameters,
    server=ClusterFLServer,
    client=ClusterFLClient,
    paper="Ouyang, Xie, Zhou, Huang, Xing, ClusterFL: a similarity-aware federated learning "
          "system for human activity recognition, MobiSys 2021",
    privacy=PrivacySupport(
        sample=True, refused="client level: it clusters clients by the similarity of their "
        "individual weights"),
    no_new_clients="its server places a client in a cluster by the models it uploaded, and a "
                   "newcomer has uploaded none",
)
