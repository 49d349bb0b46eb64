"""Hierarchical Bayesian cloud-edge-client pFL (Wen et al., "Hierarchical Asynchronous
Federated Learning Algorithm for Edge Computing Networks"), with FedHB's choices for what
the paper leaves open (Kim and Hospedales, "FedHB: Hierarchical Bayesian Federated
Learning", 2023).

The model (Eq. 6-17) with a diagonal-Gaussian family; each variance is shared by a layer's
coordinates (``variance = "layer"``, the default) or held per coordinate:

    psi            ~ N(0, psi_prior_var)                           the cloud
    phi_k | psi    ~ N(psi, sigma_e^2),    sigma_e^2   ~ IG(a_p, b_p)    edge k
    theta_i | phi_k ~ N(phi_k, sigma_ck^2), sigma_ck^2 ~ IG(a_p, b_p)    client i of edge k

with a_p = ``prior_strength`` (0.01: a weak regulariser), b_p / a_p = ``prior_scale`` times
the layer's initial mean square, and the
mean-field posterior (Eq. 18-20) q_i(theta_i) = N(m_i, s_i^2) with s_i^2 Eq. 24's optimum
(``client_var = "learned"``; FedHB's small fixed spread eps with ``"fixed"``, under which
learned variances collapse), q(phi_k) = N(m_k, v_k), q(sigma_ck^2) = IG(a_k, b_k),
q(psi) = N(m_0, v_0), q(sigma_e^2) = IG(a_e, b_e). Blocks (Eq. 23-28, Algorithm 2):

* client (Eq. 24): the expected KL to p(theta_i | phi_k) is, up to constants,
  lambda_k / 2 * ||m_i - m_k||^2 with lambda_k = E[1 / sigma_ck^2] = a_k / b_k, so local
  training on the data term gets a prior pull towards the edge mean whose strength is the
  edge posterior's expected precision. The data term is the whole data set's negative
  log-likelihood, n_i times the mean loss SGD sees, so the pull per mean-loss step is
  lambda_k / n_i, taken as an implicit (proximal) step.
* edge (Eq. 25, and Eq. 27 with its data term E[-log p(U_k | phi_k)] replaced by the bound
  the clients' blocks give it: docs/algorithms.md): closed-form coordinate ascent over
  q(phi_k) and q(sigma_ck^2) from its clients' m_i and the cloud's (m_0, E[1/sigma_e^2]);
* cloud (Eq. 28): closed-form coordinate ascent over q(psi) and q(sigma_e^2) from the
  edges' (m_k, v_k); with ``upper_blocks = "joint"`` (default) from the edges' client means
  and precisions, the edges' Gaussian blocks and the cloud's solved together at their
  common fixed point, which each edge re-solves when the cloud posterior arrives. There
  q(sigma_e^2) takes E[(phi_k - psi)^2] under the joint Gaussian optimum of the edges and
  psi (``edge_spread = "joint"``, issue 55): the product of q(phi_k) and q(psi) adds
  v_k + v_0 and drops their covariance, and its fixed point held sigma_e^2 at
  w / (K - 1), w = 1 / (S_k lambda_k) the edges' own uncertainty, however close the edges
  agreed (MNIST: 1e4-1e6 x the edges' spread), which made q(psi) too wide to draw from; the
  joint form's fixed point, solved directly, is the random-effects REML estimate
  K / (K - 1) x spread - w (``"product"`` keeps the old form). With one edge sigma_e^2 is
  not identifiable (one observation of a spread): psi is phi_1 and the model is the flat
  two-level one.

The precisions are learned from the data (empirical Bayes, ``precision_start = "data"``):
the blocks are coordinate ascent (EM) on the paper's objective, which fixes the updates but
not where they start. Started at the prior's mean precision (``"prior"``, the second pass),
they barely left it: a client's data constrain a weight so little (n_i h well under
lambda_k) that Eq. 24's s_i^2 = 1 / (n_i h + lambda_k) hands the edge back its own
1 / lambda_k, EM's rate lambda_k / (n_i h + lambda_k) is about 1, and the pull on every
client stayed ``prior_scale``'s (issue 55: 2,530.6 vs 25.9 for prior_scale 1 vs 100). It
was not the IG prior's weight (one pseudo-observation per tensor against S_k d / 2). Now a
level assumes nothing before it has seen its children: the clients' first fit runs
without a pull (E[1/sigma^2] = 0, the limit a_p -> 0, the maximum-likelihood start) and the
cloud's first joint sweep without a pull towards psi; from then every precision is Eq. 25 /
28's update from the spread of the models the level sees, and a_p = 0.01 keeps the prior
from holding the small tensors (biases). 100x prior_scale then moves the learned client
precision by well under 2x (tests/test_hier_split.py). ``weighting``: the equations sum
over clients (edges) once each, so ``"equal"`` is the default; ``"samples"`` weights each
term by training samples, as HierFAVG does, the count of observations unchanged.

Prediction: global averages the predictive over ``mc_samples`` draws of the global model
psi ~ q(psi) (default), of a new edge's phi (Eq. 30) or of a new client's theta (Algorithm
3's sampling line), ``global_level``. Personalized
(Algorithm 3, Eq. 31-34) fits f(theta) = N(m_f, eps^2) to the client's own data at test
time under a prior and averages the predictive over draws from f: ``edge_posterior`` (the
default) under its edge's N(m_k, E[sigma_ck^2]) as Algorithm 3 writes it, ``cloud`` under
p(theta | psi*) = N(m_0, E[sigma_e^2] + E[sigma_c^2]) (Eq. 32-33); ``edge`` predicts with
q_i itself (Eq. 31, no fit). docs/algorithms.md has the derivation of every update.
"""

from __future__ import annotations

from typing import ClassVar, Literal, cast

import torch
from pydantic import Field

from edgepfl.algorithms.hierbayes_blocks import (  # noqa: F401  (tests import them from here)
    JOINT_SWEEPS,
    Layout,
    _broadcast,
    _column,
    _edge_spread,
    _fixed_point,
    _moments,
    _split,
    cloud_update,
    edge_level_fixed_point,
    edge_posteriors,
    edge_update,
    expected_var,
    gamma_block,
    gaussian_block,
)
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Edge,
    EdgeContext,
    Hyperparameters,
    LogUniform,
    PrivacySupport,
    Reporter,
    SearchRange,
    Server,
    ServerContext,
    State,
    UpdateResult,
    model_from_state,
    model_to_state,
)
from edgepfl.contract.kit import STALENESS, check_model_reply, num_samples, staleness
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError, MetaValue
from edgepfl.federation.rng import generator
from edgepfl.training.client_data import ClientData
from edgepfl.training.pulls import AdamDirection

MEAN, PREC, PSI, PRIOR, VAR = "mean.", "prec.", "psi.", "prior.", "var."
EDGE_MEAN, EDGE_PRIOR = "edge_mean.", "edge_prior."
YBAR, MEAS = "ybar.", "meas."


class HierBayesHyperparameters(Hyperparameters):
    # the variance priors' scale: how far clients and edges may stray from their parents'
    # means (prior_strength is left out: a weak regulariser by design, its pseudo-observations
    # against a tensor's coordinates x clients; docs/algorithms.md)
    search_space: ClassVar[dict[str, SearchRange]] = {
        "prior_scale": LogUniform(0.1, 10.0),
    }
    client_std: float = Field(
        1e-3, ge=0, description="eps: the fixed spread of each client's Gaussian posterior "
        "q_i = N(m_i, eps^2) under client_var = fixed (FedHB: small and fixed), and the spread "
        "of the test-time fit's draws f(theta) = N(m_f, eps^2) (Eq. 33-34) under either")
    variance: Literal["layer", "coordinate"] = Field(
        "layer", description="layer: one client and one edge variance per tensor, learned from "
        "the spread of all its coordinates; coordinate: one per weight coordinate (the prior "
        "then dominates: a coordinate's evidence is a handful of models)")
    prior_scale: float = Field(
        1.0, gt=0, description="the variance priors' scale, per tensor, as a multiple of that "
        "tensor's initial mean square (a zero-initialised tensor takes the model's): "
        "b_p / a_p = prior_scale * mean(w_init^2), i.e. 1 / E[1/sigma^2] under the prior")
    prior_strength: float = Field(
        0.01, gt=0, description="a_p: pseudo-observations behind the prior variance (per "
        "tensor under variance = layer, against its coordinates x models); small, so that "
        "the prior is a weak regulariser and the models' spread sets the precisions")
    psi_prior_var: float = Field(1e4, gt=0, description="p(psi) = N(0, psi_prior_var): "
                                 "effectively flat by default (a unit variance shrinks the "
                                 "global mean towards 0 by 20% a round on small federations)")
    inner_iters: int = Field(5, ge=1, description="coordinate-ascent sweeps of each closed-form "
                             "block (mean <-> variance) per aggregation")
    mc_samples: int = Field(4, ge=1, description="Monte Carlo draws of the predictive (the "
                            "paper's Fig. 3 uses 100)")
    personalize: Literal["edge_posterior", "cloud", "edge"] = Field(
        "edge_posterior", description="edge_posterior: fit f(theta) ~ p(theta | D_i, phi_k*) "
        "under the client's edge posterior N(m_k, E[sigma_ck^2]) at test time (Algorithm 3); "
        "cloud: the same fit under p(theta | psi*) (Eq. 32-33); edge: predict with the "
        "client's own q_i (Eq. 31)")
    global_level: Literal["cloud", "edge", "client"] = Field(
        "cloud", description="what the global predictive samples: cloud, the global model psi ~ "
        "q(psi) = N(m_0, v_0) (the Bayesian model average of psi*); edge, a new edge's model "
        "phi ~ N(m_0, v_0 + E[sigma_e^2]) (Eq. 30); client, a new client's theta, adding "
        "E[sigma_c^2] (Algorithm 3's sampling line)")
    optimizer: Literal["sgd", "adam"] = Field(
        "sgd", description="how clients fit m_i (and the test-time fit): sgd = train.lr, "
        "the pull stepped implicitly (the paper's gradient steps); adam = torch Adam at "
        "train.lr on the mean loss plus the pull, moments fresh each fit (pFedBayes' "
        "optimizer; train.momentum must be 0)")
    personal_epochs: int = Field(1, ge=1, description="epochs of the test-time fit (part of "
                                 "the evaluation protocol, like the test itself: not round work)")
    staleness_exponent: float = Field(
        0.5, ge=0, description="topology.mode = async (an extension beyond the paper), and any "
        "edge none of whose clients' replies arrived in a cloud round (faults): an edge "
        "posterior s cloud periods old enters the cloud block with weight (1 + s)^-a")
    client_var: Literal["learned", "fixed"] = Field(
        "learned", description="learned: q_i's variance is Eq. 24's Gaussian optimum, "
        "s_i^2 = 1 / (n_i h + lambda_k) per tensor, h the empirical Fisher of the fit's "
        "batches, sent with m_i; fixed: s_i = client_std (FedHB's choice; "
        "docs/algorithms.md)")
    upper_blocks: Literal["joint", "sweep"] = Field(
        "joint", description="joint: an edge reports its clients' mean and precision, the "
        "cloud solves the edge and cloud blocks (Eq. 25, 28) together to their fixed "
        "point, and an edge re-solves its block when the cloud's posterior arrives; sweep: "
        "one pass, each edge against the last cloud posterior (slower)")
    client_init: Literal["edge", "local"] = Field(
        "edge", description="where a client's m_i starts each round: the edge mean m_k, or its "
        "own last m_i (Algorithm 2, step 7 allows both)")
    precision_start: Literal["data", "prior"] = Field(
        "data", description="data (empirical Bayes): the first fits run without a pull "
        "(E[1/sigma^2] = 0, the maximum-likelihood start), each later precision is Eq. 25 "
        "/ 28's update from the spread of the models the level sees; prior: every level "
        "starts at the prior's mean precision 1 / (prior_scale x mean square) "
        "(docs/algorithms.md)")
    weighting: Literal["equal", "samples"] = Field(
        "equal", description="how an edge's clients (the cloud's edges) enter the mean and "
        "spread of Eq. 25 (Eq. 28): equal = one observation each, as the equations' sums "
        "have it (the hierarchy models clients, not samples); samples = weighted by "
        "training samples (HierFAVG's), the count of observations still the number of "
        "clients (edges)")
    edge_spread: Literal["joint", "product"] = Field(
        "joint", description="upper_blocks = joint: how Eq. 28's q(sigma_e^2) takes the "
        "edges' spread E[(phi_k - psi)^2]: joint = under the joint Gaussian optimum of "
        "edges and psi, covariance kept (random-effects REML); product = under q(phi_k) "
        "q(psi), adding v_k + v_0, which holds sigma_e^2 near the edges' uncertainty / (K "
        "- 1) (docs/algorithms.md)")


def _one_edge(ctx: ServerContext) -> bool:
    """One edge: a spread of one observation identifies no sigma_e^2, so psi is phi_1."""
    return ctx.federation is not None and ctx.federation.edges == 1


def _joint(hp: HierBayesHyperparameters, ctx: ServerContext) -> bool:
    """Whether the edge and cloud blocks are solved together (with one edge there is no
    cloud block to couple)."""
    return hp.upper_blocks == "joint" and not _one_edge(ctx)


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


def adam_pull(coef: list[torch.Tensor], anchor: list[torch.Tensor],
              betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
    """Gradient hook for  mean loss + sum coef/2 (w - anchor)^2  under Adam: the pull's
    gradient added explicitly, then the gradient replaced by Adam's direction, which the
    trainer's plain SGD step at lr (no momentum) turns into torch.optim.Adam's step. Its
    moments live in the hook: one hook, one fit."""
    direction = AdamDirection(betas, eps)

    def hook(params, grads):
        diffs = torch._foreach_sub(list(params), anchor)
        torch._foreach_mul_(diffs, coef)
        torch._foreach_add_(grads, diffs)
        direction(grads)
    return hook




class _Level:
    """What the cloud and an edge share: the layout of their vectors and the variance prior."""

    ctx: ServerContext
    hp: HierBayesHyperparameters

    def _setup(self) -> None:
        names = list(self.ctx.init_model)
        self.layout = Layout(self.ctx.init_model, names, self.hp.variance == "layer")
        self.a_p = self.hp.prior_strength
        self.prior_var = self.layout.prior_var(self.hp.prior_scale)
        self.b_p = self.a_p * self.prior_var

    def _prior(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A level's posterior before any data: mean at the initial model, variance the
        prior's, and the inverse-gamma prior IG(a_p, b_p) of its children's variance."""
        m = self.layout.flat(self.ctx.init_model)
        return m, self.prior_var.clone(), torch.full_like(m, self.a_p), self.b_p.clone()


# -- the three parts -------------------------------------------------------------------------
class HierBayesCloud(_Level, Server, Reporter):
    state = ("m0", "v0", "a_e", "b_e", "var_c", "round", "client_precision")

    def __init__(self, ctx: ServerContext, hp: HierBayesHyperparameters):
        super().__init__(ctx, hp)
        if ctx.layers.buffers:
            raise ConfigError(f"hierbayes puts a Gaussian on every weight; model buffers "
                              f"{list(ctx.layers.buffers)} (BatchNorm) have no place in it: "
                              "choose a model without BatchNorm")
        if hp.optimizer == "adam" and ctx.train.momentum:
            raise ConfigError(f"hierbayes with algorithm.optimizer = 'adam' keeps Adam's own "
                              f"moments; train.momentum = {ctx.train.momentum} would add a "
                              "second: set train.momentum to 0, or algorithm.optimizer = 'sgd'")
        self._setup()
        self.m0, self.v0, self.a_e, self.b_e = self._prior()
        self.var_c = self.v0.clone()
        self.round = 0
        self.client_precision = float("nan")  # none learned before the edges report
        self.single = _one_edge(ctx)

    def edge_level(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(E[1/sigma_e^2], E[sigma_e^2]); with one edge, or before any edge has reported
        under precision_start = data, the flat prior and no spread."""
        if self.single or (self.hp.precision_start == "data" and self.round == 0):
            return torch.full_like(self.m0, 1.0 / self.hp.psi_prior_var), torch.zeros_like(self.m0)
        return self.a_e / self.b_e, expected_var(self.a_e, self.b_e)

    def configure(self, rnd: int, edges: list[int]) -> dict[int, Message]:
        lam_e, _ = self.edge_level()
        msg = Message({**self.layout.model(self.m0, PSI), **self.layout.shared(lam_e, PREC)})
        return {k: msg for k in edges}

    def aggregate(self, rnd: int, reports: dict[int, Message]) -> None:
        vague = self.hp.precision_start == "data" and self.round == 0
        self.round = rnd
        if not reports:
            return
        hp = self.hp
        joint = _joint(hp, self.ctx)
        first, second = (YBAR, MEAS) if joint else (MEAN, VAR)
        firsts, seconds, var_c, ages, sizes = [], [], [], [], []
        for k, report in reports.items():
            ages.append(staleness(k, report))
            if hp.weighting == "samples":
                sizes.append(float(num_samples(k, report)))
            firsts.append(self.layout.read(report, first))
            seconds.append(self.layout.read(report, second))
            var_c.append(self.layout.read(report, PRIOR))
        self.var_c = torch.stack(var_c).mean(0)
        # what the edges learned: 1 / E[sigma_ck^2], median over edges and tensors
        self.client_precision = float(torch.stack(
            [self.layout.tensor_means(1.0 / v) for v in var_c]).median())
        if self.single:
            self.m0, self.v0 = firsts[0], seconds[0]
            return
        weights = None
        if any(ages):
            weights = torch.tensor([(1 + s) ** -hp.staleness_exponent for s in ages],
                                   dtype=torch.float64)
        if sizes and sum(sizes) > 0:  # weighting = samples: each edge by its data, mean 1
            share = torch.tensor(sizes, dtype=torch.float64) * len(sizes) / sum(sizes)
            weights = share if weights is None else weights * share
        if not joint:
            self.m0, self.v0, self.a_e, self.b_e = cloud_update(
                torch.stack(firsts), torch.stack(seconds), hp.psi_prior_var, self.a_e, self.b_e,
                self.a_p, self.b_p, hp.inner_iters, weights, self.layout)
            return
        ybar, meas = torch.stack(firsts), torch.stack(seconds)
        if hp.edge_spread == "joint":
            self.m0, self.v0, self.a_e, self.b_e = edge_level_fixed_point(
                ybar, meas, hp.psi_prior_var, self.a_p, self.b_p, self.layout, weights)
            return
        weighted = meas * ybar
        buffers = (torch.empty_like(ybar), torch.empty_like(ybar))
        scratch = torch.empty_like(ybar)
        for sweep in range(JOINT_SWEEPS):
            # the edges' block (Eq. 25's Gaussian part) against the current cloud posterior,
            # then the cloud's (Eq. 28): block coordinate ascent over both levels
            lam_e = self.a_e / self.b_e
            if vague and sweep == 0:  # no pull towards psi before the edges' spread is seen
                lam_e = torch.full_like(lam_e, 1.0 / hp.psi_prior_var)
            means, variances = edge_posteriors(ybar, meas, self.m0, lam_e, weighted, buffers)
            self.m0, self.v0, self.a_e, self.b_e = cloud_update(
                means, variances, hp.psi_prior_var, self.a_e, self.b_e, self.a_p, self.b_p,
                hp.inner_iters, weights, self.layout, scratch)

    def eval_message(self, cid: int) -> Message | None:
        # the global predictive: psi ~ q(psi), a new edge's phi (Eq. 30) or a new client's
        # theta (Algorithm 3's sampling line)
        _, var_e = self.edge_level()
        level = self.hp.global_level
        spread = (self.v0 + (var_e if level != "cloud" else 0.0)
                  + (self.var_c if level == "client" else 0.0))
        # p(theta | psi*) = N(m_0, E sigma_e^2 + E sigma_c^2): Eq. 32's prior for a client's
        # personalization (sigma_c^2 averaged over the edges: the client is judged as a new one)
        return Message({**self.layout.model(self.m0, PSI), **self.layout.shared(spread, VAR),
                        **self.layout.shared(1.0 / (var_e + self.var_c), PRIOR)},
                       {"round": self.round})

    def round_metrics(self) -> dict[str, float]:
        _, var_e = self.edge_level()
        return {"edge_std": float(var_e.sqrt().mean()),
                "client_std": float(self.var_c.sqrt().mean()),
                # 1 / E[s_k^2], averaged over tensors and edges (the pull a client's data
                # meets is lambda_k = a_k / b_k, per sample lambda_k / n_i)
                "client_prec": float((1.0 / self.var_c).mean()),
                # medians over edges and tensors of 1 / E[sigma^2] (summary.json's figures)
                "client_prec_median": self.client_precision,
                "edge_prec_median": self.edge_precision()}

    def edge_precision(self) -> float:
        """1 / E[sigma_e^2], the median over tensors (NaN with one edge or none learned)."""
        if self.single or (self.hp.precision_start == "data" and self.round == 0):
            return float("nan")
        return float(self.layout.tensor_means(1.0 / expected_var(self.a_e, self.b_e)).median())

    def summary_figures(self, metrics: list[dict]) -> dict[str, float]:
        """The hierarchy's learned strength at the final round: the client-level and the
        edge-level precision 1 / E[sigma^2], medians over edges and tensors."""
        last = metrics[-1] if metrics else {}
        return {"hier_client_precision": last.get("client_prec_median", float("nan")),
                "hier_edge_precision": last.get("edge_prec_median", float("nan"))}


class HierBayesEdge(_Level, Edge):
    ctx: EdgeContext
    state = ("m", "v", "a", "b", "ybar", "meas", "refreshed", "samples")

    def __init__(self, ctx: EdgeContext, hp: HierBayesHyperparameters):
        super().__init__(ctx, hp)
        self._setup()
        self.m, self.v, self.a, self.b = self._prior()
        self.m0, self.lam_e = self.m.clone(), 1.0 / self.v
        # its clients' mean and that mean's precision S_k lambda_k (none yet)
        self.ybar, self.meas = self.m.clone(), torch.zeros_like(self.m)
        self.refreshed = 0  # the cloud round of its last aggregation of its clients
        self.samples = 0  # weighting = samples: its clients' training samples (scaled to all)
        self.joint = _joint(hp, ctx)

    def _vague(self) -> bool:
        """Whether its clients' variance is still unknown: precision_start = data and no
        client reply aggregated yet (E[1/sigma_ck^2] = 0, the maximum-likelihood start)."""
        return self.hp.precision_start == "data" and not self.refreshed

    def receive(self, rnd: int, msg: Message) -> None:
        self.m0, self.lam_e = self.layout.read(msg, PSI), self.layout.read(msg, PREC)
        if self.joint:  # its block again, under the cloud posterior that its report moved
            self.m, self.v = edge_posteriors(self.ybar, self.meas, self.m0, self.lam_e)

    def configure(self, rnd: int, step: int, selected: list[int]) -> dict[int, Message]:
        lam = torch.zeros_like(self.m) if self._vague() else self.a / self.b
        msg = Message({**self.layout.model(self.m, MEAN), **self.layout.shared(lam, PREC)})
        return {cid: msg for cid in selected}

    def aggregate(self, rnd: int, step: int, replies: dict[int, Message]) -> None:
        if not replies:
            return
        hp = self.hp
        uploads = torch.stack([self.layout.flat(r.tensors) for r in replies.values()])
        weights = None
        if hp.weighting == "samples":
            sizes = torch.tensor([float(num_samples(cid, r)) for cid, r in replies.items()],
                                 dtype=torch.float64)
            weights = sizes if float(sizes.sum()) > 0 else None
            self.samples = round(float(sizes.sum()) * len(self.ctx.members) / len(replies))
        eps: float | torch.Tensor = hp.client_std
        if hp.client_var == "learned":
            var = torch.stack([self.layout.read(r, VAR) for r in replies.values()])
            eps = (var.mean(0) if weights is None else (_column(weights, var) * var).sum(0)).sqrt()
        b = torch.full_like(self.b, torch.inf) if self._vague() else self.b
        # the replies stand for all the edge's clients (Algorithm 2, step 10: N / N_f)
        size = len(self.ctx.members)
        self.m, self.v, self.a, self.b = edge_update(
            uploads, size, eps, self.m0, self.lam_e,
            self.a, b, self.a_p, self.b_p, hp.inner_iters, self.layout, weights)
        self.ybar = (uploads.mean(0) if weights is None
                     else (_column(weights, uploads) * uploads).sum(0))
        self.meas = size * self.a / self.b
        self.refreshed = rnd

    def check_reply(self, cid: int, reply: Message) -> None:
        # its posterior mean m_i, and with learned variances s_i^2 (positive, finite)
        model = {k: v for k, v in reply.tensors.items() if not k.startswith(VAR)}
        check_model_reply(cid, Message(model, reply.meta), self.ctx.init_model)
        if self.hp.client_var == "learned":
            for name, like in self.layout.like.items():
                t = reply.tensors.get(VAR + name)
                shape = (1,) if self.layout.per_layer else tuple(like.shape)
                if t is None or tuple(t.shape) != shape or t.dtype != like.dtype:
                    got = "none" if t is None else f"{tuple(t.shape)} {t.dtype}"
                    raise MessageError(f"client {cid}'s posterior variance {VAR + name!r}: "
                                       f"expected {shape} {like.dtype}, got {got}")
            var = self.layout.read(reply, VAR)
            if not bool((var > 0).all()):
                raise MessageError(f"client {cid}'s posterior variances {VAR!r} must be positive")

    def report(self, rnd: int) -> Message:
        meta: dict[str, MetaValue] = ({STALENESS: rnd - self.refreshed}
                                      if rnd > self.refreshed else {})
        if self.hp.weighting == "samples":
            meta["num_samples"] = self.samples
        first = (self.layout.model(self.ybar, YBAR) | self.layout.shared(self.meas, MEAS)
                 if self.joint else
                 self.layout.model(self.m, MEAN) | self.layout.shared(self.v, VAR))
        return Message({**first, **self.layout.shared(expected_var(self.a, self.b), PRIOR)}, meta)

    def eval_message(self, cid: int) -> Message | None:
        """Algorithm 3's personalization prior, p(theta | phi_k*) = N(m_k, E[sigma_ck^2]),
        beside the cloud's evaluation message."""
        if self.hp.personalize != "edge_posterior":
            return None
        return Message({**self.layout.model(self.m, EDGE_MEAN),
                        **self.layout.shared(1.0 / expected_var(self.a, self.b), EDGE_PRIOR)})


class HierBayesClient(Client):
    def __init__(self, ctx: ClientContext, hp: HierBayesHyperparameters):
        super().__init__(ctx, hp)
        self.names = list(ctx.trainer.param_names)

    def init_state(self, cid: int, init_model: State) -> State:
        return model_to_state(init_model)

    def _entries(self, msg: Message, prefix: str, like: State) -> State:
        part = _split(msg, prefix)
        if set(part) != set(self.names):
            raise MessageError(f"hierbayes message lacks {prefix!r} entries for the model's "
                               "parameters")
        return {k: _broadcast(k, part[k], like[k]) for k in self.names}

    def _pulled_fit(self, data: ClientData, gen: torch.Generator, start: State, anchor: State,
                    prec: State, epochs: int, curvature: list[torch.Tensor] | None = None,
                    ) -> tuple[State, dict[str, float]]:
        """SGD from ``start`` on the mean loss + prec / (2 n) ||w - anchor||^2 (Eq. 24, 33).
        ``curvature`` collects each step's squared gradient norm per tensor, before the pull."""
        n = max(data.n, 1)
        t = self.ctx.train
        self.trainer.load(start)
        place = self.trainer.place
        coef = place([(prec[k] / n).contiguous() for k in self.names])
        anchors = place([anchor[k] for k in self.names])
        adam = self.hp.optimizer == "adam"
        pull = adam_pull(coef, anchors) if adam else proximal_pull(t.lr, coef, anchors)
        hook = pull
        if curvature is not None:
            def hook(params, grads):
                # kept where the step runs: one copy to the host after the fit, not one a step
                curvature.append(torch.stack(torch._foreach_norm(grads)).double() ** 2)
                pull(params, grads)
        stats = self.trainer.fit(data, epochs, t.batch_size, t.lr, gen,
                                 momentum=0.0 if adam else t.momentum,
                                 weight_decay=t.weight_decay, grad_hook=hook)
        return self.trainer.export(), stats

    def _posterior_var(self, data: ClientData, curvature: list[torch.Tensor], prec: State,
                       like: State) -> State:
        """Eq. 24's optimal variance of q_i = N(m_i, s^2) per tensor under the delta method:
        s^2 = 1 / (n h + lambda), h the mean loss's mean diagonal curvature over the tensor,
        estimated by the empirical Fisher: batch size x the mean squared batch gradient."""
        n = max(data.n, 1)
        sq = (torch.stack(curvature).mean(0).cpu() if curvature
              else torch.zeros(len(self.names), dtype=torch.float64))
        out = {}
        for j, k in enumerate(self.names):
            h = float(sq[j]) * min(self.ctx.train.batch_size, n) / like[k].numel()
            out[VAR + k] = (1.0 / (n * h + prec[k].double())).to(like[k].dtype)
        return out

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        edge_mean = _split(msg, MEAN)
        if set(edge_mean) != set(self.names):
            raise MessageError(f"hierbayes message lacks {MEAN!r} entries for the model's parameters")
        prec = self._entries(msg, PREC, edge_mean)
        start = model_from_state(state) if self.hp.client_init == "local" else edge_mean
        curvature: list[torch.Tensor] | None = [] if self.hp.client_var == "learned" else None
        m_i, stats = self._pulled_fit(data, gen, start, edge_mean, prec,
                                      self.ctx.train.local_epochs, curvature)
        reply = dict(m_i)
        if curvature is not None:
            reply.update(self._posterior_var(data, curvature, _split(msg, PREC), edge_mean))
        return UpdateResult(Message(reply, {"num_samples": data.n}), model_to_state(m_i), stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        """q_i's mean, the client's own posterior (Eq. 31)."""
        return model_from_state(state)

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        hp = self.hp
        rnd = cast(int, eval_msg.meta.get("round", 0)) if eval_msg is not None else 0
        mean = self.personal_model(state, eval_msg)
        if hp.personalize != "edge" and eval_msg is not None and rnd > 0:
            # Algorithm 3 / Eq. 33: f(theta) ~ p(theta | D_i, prior), fitted on the client's own
            # data at test time from the current prior (so a client not selected lately is not
            # judged by a stale fit), starting at the prior's mean
            mean_key, prior_key = ((EDGE_MEAN, EDGE_PRIOR) if hp.personalize == "edge_posterior"
                                   else (PSI, PRIOR))
            anchor = _split(eval_msg, mean_key)
            if set(anchor) != set(self.names):
                raise MessageError(f"hierbayes evaluation message lacks {mean_key!r} entries")
            prior = self._entries(eval_msg, prior_key, anchor)
            mean, _ = self._pulled_fit(data, generator(self.ctx.seed, "personalize", rnd, cid),
                                       anchor, anchor, prior, hp.personal_epochs)
        out = {"": self._draws(mean, None, hp.client_std, generator(self.ctx.seed, "mc", rnd))}
        if eval_msg is not None:
            psi = _split(eval_msg, PSI)
            var = self._entries(eval_msg, VAR, psi)
            # one global predictive for every client: the same draws everywhere
            out["global"] = self._draws(psi, var, 0.0, generator(self.ctx.seed, "mc-global", rnd))
            # and the posterior mean psi* alone, to show what the sampling spread costs
            out["psi"] = [psi]
        return out

    def new_client_model(self, cid: int, state: State, msg: Message | None, data: ClientData,
                         epochs: int, gen: torch.Generator) -> list[State]:
        """Algorithm 3's new client: theta fitted at test time (Eq. 33) from its edge's
        posterior (personalize = edge_posterior) or else the cloud's, which a newcomer
        without a posterior of its own takes for personalize = edge too; personal_epochs,
        then the MC draws (``eval.new_client_epochs`` does not apply)."""
        if msg is None:
            raise MessageError("a new hierbayes client is fitted from a prior, but none was given")
        rnd = msg.meta.get("round", 0)
        mean_key, prior_key = ((EDGE_MEAN, EDGE_PRIOR) if self.hp.personalize == "edge_posterior"
                               else (PSI, PRIOR))
        anchor = _split(msg, mean_key)
        if set(anchor) != set(self.names):
            raise MessageError(f"hierbayes new-client message lacks {mean_key!r} entries")
        prior = self._entries(msg, prior_key, anchor)
        mean, _ = self._pulled_fit(data, generator(self.ctx.seed, "new-client", rnd, cid),
                                   anchor, anchor, prior, self.hp.personal_epochs)
        return self._draws(mean, None, self.hp.client_std, generator(self.ctx.seed, "mc", rnd))

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
    privacy=PrivacySupport(
        refused="client level: edges and cloud combine precision-weighted posteriors, not means "
        "of updates; sample level: clients personalize on their training data at evaluation"),
)
