"""Hierarchical Bayesian cloud-edge-client pFL (Wen et al., "Hierarchical Asynchronous
Federated Learning Algorithm for Edge Computing Networks"), with FedHB's choices for what
the paper leaves open (Kim and Hospedales, "FedHB: Hierarchical Bayesian Federated
Learning", 2023).

The model (Eq. 6-17), per weight coordinate, with a diagonal-Gaussian family:

    psi            ~ N(0, psi_prior_var)                           the cloud
    phi_k | psi    ~ N(psi, sigma_e^2),    sigma_e^2   ~ IG(a_p, b_p)    edge k
    theta_i | phi_k ~ N(phi_k, sigma_ck^2), sigma_ck^2 ~ IG(a_p, b_p)    client i of edge k

and the mean-field posterior (Eq. 18-20) q_i(theta_i) = N(m_i, eps^2) with a small fixed
spread eps (FedHB's client family), q(phi_k) = N(m_k, v_k), q(sigma_ck^2) = IG(a_k, b_k),
q(psi) = N(m_0, v_0), q(sigma_e^2) = IG(a_e, b_e). Blocks (Eq. 23-28, Algorithm 2):

* client (Eq. 24): the expected KL to p(theta_i | phi_k) is, up to constants,
  lambda_k / 2 * ||m_i - m_k||^2 with lambda_k = E[1 / sigma_ck^2] = a_k / b_k, so local
  training on the data term gets a prior pull towards the edge mean whose strength is the
  edge posterior's expected precision (learned, not a hand-set mu). The data term is the
  whole data set's negative log-likelihood, i.e. n_i times the mean loss SGD sees, so the
  pull per mean-loss step is lambda_k / n_i; it is taken as an implicit (proximal) step,
  which stays stable however large the learned precision becomes.
* edge (Eq. 25): closed-form coordinate ascent over q(phi_k) and q(sigma_ck^2) from its
  clients' m_i and the cloud's (m_0, E[1/sigma_e^2]);
* cloud (Eq. 28): closed-form coordinate ascent over q(psi) and q(sigma_e^2) from the
  edges' (m_k, v_k).

Prediction: global (Algorithm 3, Eq. 29-30) samples theta ~ N(m_0, v_0 + E[sigma_e^2] +
E[sigma_c^2]) from the hierarchy and averages the predictive over ``mc_samples`` draws;
personalized (Eq. 31-34) fits f(theta) = N(m_f, eps^2) to the client's own data under the
prior p(theta | psi*) = N(m_0, E[sigma_e^2] + E[sigma_ck^2]) (Eq. 32-33) and averages the
predictive over draws from f (Eq. 34); ``personalize = "edge"`` predicts with q_i itself
(Eq. 31, no extra bytes). docs/algorithms.md has the derivation of every update.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from edgepfl.algorithms.base import (
    Algorithm,
    Client,
    ClientContext,
    Edge,
    EdgeContext,
    Hyperparameters,
    Server,
    ServerContext,
    State,
    UpdateResult,
    model_from_state,
    model_to_state,
)
from edgepfl.algorithms.fedavg import check_model_reply
from edgepfl.algorithms.hierfavg import STALENESS, staleness
from edgepfl.algorithms.training import ClientData
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.rng import generator

MEAN, PREC, PSI, PRIOR, VAR = "mean.", "prec.", "psi.", "prior.", "var."


class HierBayesHyperparameters(Hyperparameters):
    client_std: float = Field(
        1e-3, ge=0, description="eps: the fixed spread of each client's Gaussian posterior "
        "q_i = N(m_i, eps^2) (FedHB: small and fixed)")
    prior_var: float = Field(
        0.1, gt=0, description="prior mean of the client and edge variances sigma^2 (the "
        "inverse-gamma priors' b_p / a_p): the pull strength 1/prior_var before data")
    prior_strength: float = Field(
        1.0, gt=0, description="a_p: pseudo-observations behind prior_var (small = the "
        "variances are learned from the spread of the models)")
    psi_prior_var: float = Field(1e4, gt=0, description="p(psi) = N(0, psi_prior_var): "
                                 "effectively flat by default (a unit variance shrinks the "
                                 "global mean towards 0 by 20% a round on small federations)")
    inner_iters: int = Field(5, ge=1, description="coordinate-ascent sweeps of each closed-form "
                             "block (mean <-> variance) per aggregation")
    mc_samples: int = Field(4, ge=1, description="Monte Carlo draws of the predictive (the "
                            "paper's Fig. 3 uses 100)")
    personalize: Literal["cloud", "edge"] = Field(
        "cloud", description="cloud: fit f(theta) ~ p(theta | D_i, psi*) (Eq. 32-33) on the "
        "client's own training data at test time; edge: predict with its own q_i (Eq. 31)")
    personal_epochs: int = Field(1, ge=1, description="epochs of the Eq. 33 fit (part of the "
                                 "evaluation protocol, like the test itself: not round work)")
    staleness_exponent: float = Field(
        0.5, ge=0, description="topology.mode = async: an edge posterior s cloud periods old "
        "enters the cloud block with weight (1 + s)^-a, as (1 + s)^-a observations")
    client_init: Literal["edge", "local"] = Field(
        "edge", description="where a client's m_i starts each round: the edge mean m_k, or its "
        "own last m_i (Algorithm 2, step 7 allows both)")


# -- the closed-form blocks (pure functions of per-coordinate tensors) ---------------------
def expected_var(a: float, b: torch.Tensor) -> torch.Tensor:
    """E[sigma^2] under IG(a, b) (its mode b / (a + 1) while the mean is infinite)."""
    return b / (a - 1) if a > 1 else b / (a + 1)


def gaussian_block(means: torch.Tensor, count: float, lam: torch.Tensor, prior_mean: torch.Tensor,
                   prior_prec: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin over q = N(m, v) of  lam/2 sum_i E[(x_i - z)^2] + E[KL(q || N(prior_mean,
    1/prior_prec))]: the posterior of z given ``count`` Gaussian observations with mean
    ``means.mean(0)`` and expected precision ``lam``. Returns (m, v)."""
    prec = count * lam + prior_prec
    m = (lam * count * means.mean(0) + prior_prec * prior_mean) / prec
    return m, 1.0 / prec


def gamma_block(sq: torch.Tensor, count: float, a_p: float, b_p: float) -> tuple[float, torch.Tensor]:
    """argmin over q = IG(a, b) of sigma^2 of -sum_i E[log N(x_i; z, sigma^2)] +
    KL(q || IG(a_p, b_p)), where ``sq`` is the mean over observations of E[(x_i - z)^2]."""
    return a_p + count / 2, b_p + 0.5 * count * sq


def edge_update(uploads: torch.Tensor, size: float, eps: float, m0: torch.Tensor,
                lam_e: torch.Tensor, a: float, b: torch.Tensor, a_p: float, b_p: float,
                iters: int) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """Eq. 25: q(phi_k) and q(sigma_ck^2) from the uploaded client means (rows of
    ``uploads``) standing for the edge's ``size`` clients. Returns (m_k, v_k, a_k, b_k)."""
    for _ in range(iters):
        m, v = gaussian_block(uploads, size, a / b, m0, lam_e)
        sq = ((uploads - m) ** 2).mean(0) + eps ** 2 + v
        a, b = gamma_block(sq, size, a_p, b_p)
    return m, v, a, b


def cloud_update(means: torch.Tensor, variances: torch.Tensor, psi_prior_var: float,
                 a: float, b: torch.Tensor, a_p: float, b_p: float, iters: int,
                 weights: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """Eq. 28: q(psi) and q(sigma_e^2) from the edges' posteriors N(m_k, v_k) (rows).
    ``weights`` (asynchronous edges: stale ones count as fractions of an observation)
    scale each edge's term in the objective. Returns (m_0, v_0, a_e, b_e)."""
    count = means.shape[0] if weights is None else float(weights.sum())
    if weights is not None:
        w = (weights / weights.sum()).view(-1, *([1] * (means.dim() - 1))).to(means.dtype)
    for _ in range(iters):
        centre = means if weights is None else (w * means).sum(0, keepdim=True)
        m, v = gaussian_block(centre, count, a / b, torch.zeros_like(means[0]), 1.0 / psi_prior_var)
        spread = (means - m) ** 2 + variances
        sq = (spread.mean(0) if weights is None else (w * spread).sum(0)) + v
        a, b = gamma_block(sq, count, a_p, b_p)
    return m, v, a, b


def proximal_pull(lr: float, coef: list[torch.Tensor], anchor: list[torch.Tensor]):
    """Gradient hook for  mean loss + sum coef/2 (w - anchor)^2, stepped implicitly:
    w' = (w - lr g + lr coef anchor) / (1 + lr coef), written as the gradient
    (g + coef (w - anchor)) / (1 + lr coef) for the trainer's SGD step."""
    scale = [1.0 / (1.0 + lr * c) for c in coef]

    def hook(params, grads):
        diffs = torch._foreach_sub(list(params), anchor)
        torch._foreach_mul_(diffs, coef)
        torch._foreach_add_(grads, diffs)
        torch._foreach_mul_(grads, scale)
    return hook


def _split(msg: Message, prefix: str) -> State:
    return {k[len(prefix):]: v for k, v in msg.tensors.items() if k.startswith(prefix)}


def _flat(model: State, names: list[str]) -> torch.Tensor:
    return torch.cat([model[n].reshape(-1).double() for n in names])


def _unflat(flat: torch.Tensor, like: State, names: list[str]) -> State:
    out, i = {}, 0
    for n in names:
        t = like[n]
        out[n] = flat[i:i + t.numel()].reshape(t.shape).to(t.dtype)
        i += t.numel()
    return out


def _prior(init: State, names: list[str], hp: HierBayesHyperparameters,
           ) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """A level's posterior before any data: mean at the initial model, variance prior_var,
    and the inverse-gamma prior IG(a_p, b_p) of its children's variance."""
    m = _flat(init, names)
    return (m, torch.full_like(m, hp.prior_var), hp.prior_strength,
            torch.full_like(m, hp.prior_strength * hp.prior_var))


# -- the three parts -------------------------------------------------------------------------
class _Flat:
    """A level's per-coordinate vectors as named tensors of the model's shapes."""

    ctx: ServerContext
    names: list[str]

    def _model(self, flat: torch.Tensor, prefix: str) -> State:
        return {prefix + k: v for k, v in _unflat(flat, self.ctx.init_model, self.names).items()}


class HierBayesCloud(_Flat, Server):
    state = ("m0", "v0", "a_e", "b_e", "var_c", "round")

    def __init__(self, ctx: ServerContext, hp: HierBayesHyperparameters):
        super().__init__(ctx, hp)
        if ctx.layers.buffers:
            raise ConfigError(f"hierbayes puts a Gaussian on every weight; model buffers "
                              f"{list(ctx.layers.buffers)} (BatchNorm) have no place in it: "
                              "choose a model without BatchNorm")
        self.names = list(ctx.init_model)
        self.m0, self.v0, self.a_e, self.b_e = _prior(ctx.init_model, self.names, hp)
        self.var_c = self.v0.clone()
        self.round = 0


    def configure(self, rnd: int, edges: list[int]) -> dict[int, Message]:
        msg = Message({**self._model(self.m0, PSI), **self._model(self.a_e / self.b_e, PREC)})
        return {k: msg for k in edges}

    def aggregate(self, rnd: int, reports: dict[int, Message]) -> None:
        self.round = rnd
        if not reports:
            return
        means, variances, var_c, ages = [], [], [], []
        for k, report in reports.items():
            ages.append(staleness(k, report))
            parts = [_split(report, p) for p in (MEAN, VAR, PRIOR)]
            if any(set(part) != set(self.names) for part in parts):
                raise MessageError(f"edge {k}'s report needs {MEAN}, {VAR} and {PRIOR} entries "
                                   f"for every parameter")
            means.append(_flat(parts[0], self.names))
            variances.append(_flat(parts[1], self.names))
            var_c.append(_flat(parts[2], self.names))
        hp = self.hp
        weights = None
        if any(ages):
            weights = torch.tensor([(1 + s) ** -hp.staleness_exponent for s in ages],
                                   dtype=torch.float64)
        self.m0, self.v0, self.a_e, self.b_e = cloud_update(
            torch.stack(means), torch.stack(variances), hp.psi_prior_var, self.a_e, self.b_e,
            hp.prior_strength, hp.prior_strength * hp.prior_var, hp.inner_iters, weights)
        self.var_c = torch.stack(var_c).mean(0)

    def eval_message(self, cid: int) -> Message | None:
        # the global predictive of Algorithm 3: theta ~ N(m_0, v_0 + E sigma_e^2 + E sigma_c^2)
        var_e = expected_var(self.a_e, self.b_e)
        spread = self.v0 + var_e + self.var_c
        # p(theta | psi*) = N(m_0, E sigma_e^2 + E sigma_c^2): Eq. 32's prior for a client's
        # personalization (sigma_c^2 averaged over the edges: the client is judged as a new one)
        return Message({**self._model(self.m0, PSI), **self._model(spread, VAR),
                        **self._model(1.0 / (var_e + self.var_c), PRIOR)}, {"round": self.round})

    def round_metrics(self) -> dict[str, float]:
        return {"edge_std": float(expected_var(self.a_e, self.b_e).sqrt().mean()),
                "client_std": float(self.var_c.sqrt().mean())}


class HierBayesEdge(_Flat, Edge):
    state = ("m", "v", "a", "b", "refreshed")

    def __init__(self, ctx: EdgeContext, hp: HierBayesHyperparameters):
        super().__init__(ctx, hp)
        self.names = list(ctx.init_model)
        self.m, self.v, self.a, self.b = _prior(ctx.init_model, self.names, hp)
        self.m0, self.lam_e = self.m.clone(), 1.0 / self.v
        self.refreshed = 0  # the cloud round of its last aggregation of its clients


    def receive(self, rnd: int, msg: Message) -> None:
        self.m0, self.lam_e = (_flat(_split(msg, p), self.names) for p in (PSI, PREC))

    def configure(self, rnd: int, step: int, selected: list[int]) -> dict[int, Message]:
        msg = Message({**self._model(self.m, MEAN), **self._model(self.a / self.b, PREC)})
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, step: int, replies: dict[int, Message]) -> None:
        uploads = [_flat(reply.tensors, self.names) for reply in replies.values()]
        if not uploads:
            return
        hp = self.hp
        # the replies stand for all the edge's clients (Algorithm 2, step 10: N / N_f)
        self.m, self.v, self.a, self.b = edge_update(
            torch.stack(uploads), len(self.ctx.members), hp.client_std, self.m0, self.lam_e,
            self.a, self.b, hp.prior_strength, hp.prior_strength * hp.prior_var, hp.inner_iters)
        self.refreshed = rnd

    def check_reply(self, cid: int, reply: Message) -> None:
        check_model_reply(cid, reply, self.ctx.init_model)  # its posterior mean m_i

    def report(self, rnd: int) -> Message:
        meta = {STALENESS: rnd - self.refreshed} if rnd > self.refreshed else {}
        return Message({**self._model(self.m, MEAN), **self._model(self.v, VAR),
                        **self._model(expected_var(self.a, self.b), PRIOR)}, meta)


class HierBayesClient(Client):
    def __init__(self, ctx: ClientContext, hp: HierBayesHyperparameters):
        super().__init__(ctx, hp)
        self.names = list(ctx.trainer.param_names)

    def init_state(self, cid: int, init_model: State) -> State:
        return model_to_state(init_model)

    def _pulled_fit(self, data: ClientData, gen: torch.Generator, start: State, anchor: State,
                    prec: State, epochs: int) -> tuple[State, dict[str, float]]:
        """SGD from ``start`` on the mean loss + prec / (2 n) ||w - anchor||^2 (Eq. 24, 33)."""
        n = max(data.n, 1)
        t = self.ctx.train
        self.trainer.load(start)
        place = self.trainer.place
        hook = proximal_pull(t.lr, place([prec[k] / n for k in self.names]),
                             place([anchor[k] for k in self.names]))
        stats = self.trainer.fit(data, epochs, t.batch_size, t.lr, gen, momentum=t.momentum,
                                 weight_decay=t.weight_decay, grad_hook=hook)
        return self.trainer.export(), stats

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        edge_mean, prec = _split(msg, MEAN), _split(msg, PREC)
        if set(edge_mean) != set(self.names) or set(prec) != set(self.names):
            raise MessageError(f"hierbayes message lacks {MEAN} / {PREC} for the model's parameters")
        start = model_from_state(state) if self.hp.client_init == "local" else edge_mean
        m_i, stats = self._pulled_fit(data, gen, start, edge_mean, prec, self.ctx.train.local_epochs)
        return UpdateResult(Message(m_i, {"num_samples": data.n}), model_to_state(m_i), stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        """q_i's mean, the client's own posterior (Eq. 31)."""
        return model_from_state(state)

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        hp = self.hp
        rnd = eval_msg.meta.get("round", 0) if eval_msg is not None else 0
        mean = self.personal_model(state, eval_msg)
        if hp.personalize == "cloud" and eval_msg is not None and rnd > 0:
            # Eq. 32-33: f(theta) ~ p(theta | D_i, psi*), fitted on the client's own data at
            # test time from the current psi* (so a client not selected lately is not
            # judged by a stale fit), starting at m_0 under the marginal prior
            psi, prior = _split(eval_msg, PSI), _split(eval_msg, PRIOR)
            mean, _ = self._pulled_fit(data, generator(self.ctx.seed, "personalize", rnd, cid),
                                       psi, psi, prior, hp.personal_epochs)
        out = {"": self._draws(mean, None, hp.client_std, generator(self.ctx.seed, "mc", rnd))}
        if eval_msg is not None:
            psi, var = _split(eval_msg, PSI), _split(eval_msg, VAR)
            # one global predictive for every client: the same draws everywhere
            out["global"] = self._draws(psi, var, 0.0, generator(self.ctx.seed, "mc-global", rnd))
            # and the posterior mean psi* alone, to show what the sampling spread costs
            out["psi"] = [psi]
        return out

    def _draws(self, mean: State, var: State | None, std: float,
               gen: torch.Generator) -> list[State]:
        if var is None and std == 0:
            return [mean]
        draws = []
        for _ in range(self.hp.mc_samples):
            draw = {}
            for k in self.names:  # a fixed order: a restored state may list its entries otherwise
                m = mean[k]
                scale = var[k].sqrt() if var is not None else std
                draw[k] = m + scale * torch.randn(m.shape, generator=gen, dtype=m.dtype)
            draws.append(draw)
        return draws


ALGORITHM = Algorithm(
    name="hierbayes",
    summary="hierarchical Bayesian client -> edge -> cloud pFL (Wen et al., FedHB's family): "
            "learned prior pulls, closed-form edge and cloud posteriors, MC prediction",
    hyperparameters=HierBayesHyperparameters,
    server=HierBayesCloud,
    client=HierBayesClient,
    edge=HierBayesEdge,
    paper="Wen et al., Hierarchical Asynchronous Federated Learning Algorithm for Edge "
          "Computing Networks; Kim and Hospedales, FedHB: Hierarchical Bayesian Federated "
          "Learning, 2023",
)
