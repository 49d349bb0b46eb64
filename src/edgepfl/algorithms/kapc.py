"""KAPC and KAPC+BLS (Zhi et al., AAAI 2024 and its journal extension).

KAPC (Knowledge-Aware Parameter Coaching). The server keeps every client's latest upload
and a relation cube R (N x L x N): r_ij^l says how much client i's layer l should lean on
client j's layer l. Each round it takes E_r projected gradient steps on

    f(r_i) = lambda * f_s(r_i W, w_i) + beta/2 ||r_i - 1/N||^2            (Eq. 11-13)

for the selected clients, builds each one's personalized regularizer s_i^l = sum_j r_ij^l
w_j^l (Eq. 15) and sends it; the client trains E local epochs on CE + lambda f_s(s_i, w_i)
(Eq. 16-17) and uploads its model, which it also keeps as its personal model.

The R gradient is closed-form: with f_s = ||.||^2, d/dr_ij^l = 2 <s_i^l - w_i^l, w_j^l>, so
for all i, j of a layer at once it is 2 (r^l G^l - G^l) with G^l the Gram matrix of the
stacked layer parameters. One n x P product per layer and n x n arithmetic per step: no
loop over client pairs, and the server never materialises n personalized models to get
the gradient.

KAPC+BLS (Bidirectional Layer Selection, journal Sec. 5-6). Down: layer l of s_i is not
sent when client i's self-relation r_ii^l >= mu (Algorithm 3), nor past the prefix client i
uploaded last time (the server's copy of it is stale there); the client then coaches that
layer towards its own previous weights (Eq. 20). Up: after training the client uploads only
its first Omega_i layers, Omega_i chosen with the generalization-bound criterion (29) from
norm estimates B, tau (Eq. 30-31) by a neighbour search from the previous Omega
(Algorithm 4), raised by an optional staleness limit; the server fills the other layers
with the client's stale upload (Eq. 33) for R and for the other clients' regularizers.

Choices where the papers leave room are hyperparameters, documented in
docs/algorithms.md (section "kapc / kapc_bls").
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, Literal, cast

import torch
from pydantic import Field, model_validator

from edgepfl.contract.algorithm import (
    Algorithm,
    ClientContext,
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
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError, check_message, check_meta, ints
from edgepfl.federation.rng import derive_seed, generator
from edgepfl.models.layers import LayerSpec
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import server_device
from edgepfl.training.pulls import Pull
from edgepfl.training.sgd import FitRequest

PAPER = ("Zhi et al., Knowledge-Aware Parameter Coaching for Personalized Federated Learning, "
         "AAAI 2024; journal extension: Knowledge-Aware Parameter Coaching for "
         "Communication-Efficient Personalized Federated Learning in Mobile Edge Computing")

# Columns of the server Gram computation are processed in chunks of about this many
# float64 values, so that N x P never has to exist in float64 at once.
_GRAM_CHUNK = 1 << 22


# ---------------------------------------------------------------------------------------
# hyperparameters
# ---------------------------------------------------------------------------------------
class KAPCHyperparameters(Hyperparameters):
    # the two weights the paper's ablation (Fig. 6) varies: the coaching term's and the pull
    # of the relation vectors towards 1/N
    search_space: ClassVar[dict[str, SearchRange]] = {
        "lam": LogUniform(0.01, 1.0),
        "beta": LogUniform(0.001, 0.1),
    }
    lam: float = Field(0.1, ge=0, description=(
        "lambda: weight of the coaching term f_s in the client loss (Eq. 16) and in R's "
        "objective (Eq. 11); set 1 for the paper's ablation (Fig. 6), which is centred on "
        "it (bench/LOG.md, 'Lambda 0.1 against 1, seed by seed')"))
    beta: float = Field(0.01, ge=0, description=(
        "beta: pull of every relation vector towards 1/N (Eq. 11); Fig. 6's beta/(2 "
        "lambda) = 0.005 is beta = 0.01 at lambda = 1"))
    r_lr: float = Field(0.01, ge=0, description="eta_r: learning rate of R (Sec. 7.1: 0.01)")
    r_epochs: int = Field(1, ge=0, description=(
        "E_r: projected gradient steps on R per round (Sec. 7.1: 1); 0 keeps R fixed"))
    r_init: Literal["uniform", "random", "self"] = Field("uniform", description=(
        "initial R (the paper says only 'randomly'): uniform = 1/N (the minimiser of the "
        "beta term), random = uniform draw from the simplex per relation vector (seeded), "
        "self = one-hot on the client itself"))
    coaching_loss: Literal["squared", "l2"] = Field("squared", description=(
        "f_s per layer: squared = ||s - w||^2 (Sec. 5.2, as its smoothness assumption "
        "needs); l2 = ||s - w||, refused unless allow_plain_norm: an exact penalty that "
        "pins every client to its regularizer at lambda = 1"))
    allow_plain_norm: bool = Field(False, description=(
        "lift the refusal of coaching_loss = l2, for ablations of the f_s form only (it "
        "trains only when lambda is below every layer's gradient norm); a warning says so"))
    init: Literal["shared", "per_client"] = Field("shared", description=(
        "the clients' first models: shared = the run's one initial model (as FedAvg and "
        "the baselines); per_client = each client's own seeded random draw, known to the "
        "server (Algorithm 1)"))
    norm_layers: Literal["merged", "own"] = Field("merged", description=(
        "what a layer of R, of BLS's prefix and of the bound (29) is: merged = a weight "
        "layer with the normalisation layer after it (the paper's count: 21 on ResNet-18, "
        "Fig. 8); own = every module with parameters (41 on ResNet-18); the same on models "
        "without normalisation"))
    r_grad_scale: Literal["precondition", "sum", "spread"] = Field("precondition", description=(
        "how the R step is sized: precondition = eta_r divided per layer by the "
        "participants' mean squared distance to their mean, capped (Eq. 11's minimiser "
        "unchanged); sum = eta_r on the raw gradient (the paper's literal step); spread = "
        "f_s alone in spread units (moves the minimiser towards self-relations; "
        "docs/algorithms.md)"))

    @model_validator(mode="after")
    def _refuse_plain_norm(self) -> KAPCHyperparameters:
        if self.coaching_loss == "l2":
            if not self.allow_plain_norm:
                raise ValueError(L2_REFUSED)
            warnings.warn("coaching_loss = 'l2' with allow_plain_norm = true: " + L2_PINS,
                          stacklevel=2)
        return self


def initial_model(ctx: ServerContext | ClientContext, hp: KAPCHyperparameters, cid: int,
                  shared: State | None = None) -> State:
    """Client ``cid``'s first model: the run's shared one, or with ``init = per_client`` its
    own draw from a seed of the run seed and ``cid`` (the server and the client draw the
    same, so the server's copy is exact before the client's first upload)."""
    if hp.init == "shared":
        return shared if shared is not None else ctx.init_model  # type: ignore[union-attr]
    if ctx.fresh_model is None:
        raise ConfigError("algorithm.init = 'per_client' needs a runtime that can build "
                          "models (the simulation or Flower's engine parts)")
    return ctx.fresh_model(derive_seed(ctx.seed, "kapc", "init", cid))


# Why coaching_loss = l2 is refused (measured: docs/algorithms.md, "The plain norm is refused").
L2_PINS = (
    "the plain norm is an exact penalty; a layer whose cross-entropy gradient norm is "
    "below lambda stays at its regularizer and does not train")
L2_REFUSED = (
    "coaching_loss = 'l2' (the plain norm ||s^l - w^l||) is refused: it is an exact penalty. "
    "Its pull lambda (w - s)/||w - s|| has norm lambda at any distance, so a layer whose "
    "cross-entropy gradient is smaller than lambda (0.04-0.6 per layer against lambda = 1 on "
    "Fashion-MNIST) stays pinned to its regularizer, in round 1 the common initial model, "
    "and never trains (15% mean accuracy; 'squared' 58%). The paper's analysis needs f_s "
    "smooth (Assumption 2) and the journal writes lambda ||w - s||^2 (Sec. 5.2): its "
    "'L2-norm' is coaching_loss = 'squared' (the default); see docs/algorithms.md. An "
    "ablation of the f_s form may lift this with allow_plain_norm = true")


class KAPCBLSHyperparameters(KAPCHyperparameters):
    mu: float = Field(0.7, ge=0, description=(
        "self-relation threshold: layer l of s_i is not sent when r_ii^l >= mu "
        "(Algorithm 3); the journal's Tables 5-6 use 0.7, Table 3 sweeps 0.3-0.9"))
    select_layers: bool = Field(True, description=(
        "client-side layer selection (Algorithm 4); false uploads every layer (an ablation: "
        "server-side selection only)"))
    prefix_down: bool = Field(True, description=(
        "send client i regularizer layers only within the prefix it uploaded last time; "
        "past it Eq. 20's partial regularizer (tau^ = 0 past Omega, Eq. 25, as the bound "
        "(29) assumes) coaches them towards the client's own last weights; false = every "
        "layer of Eq. 34, the server's stale copies included"))
    refresh_every: int = Field(0, ge=0, description=(
        "staleness limit: a layer is uploaded at least every refresh_every selections of "
        "the client (with the layers before it), which bounds how stale the server's "
        "copies can be and refreshes the bound's estimates B, tau (Algorithm 4, lines "
        "3-9); 0 = no limit (the paper's Algorithm 4)"))


# ---------------------------------------------------------------------------------------
# the relation cube: projection, Gram matrices, closed-form gradient
# ---------------------------------------------------------------------------------------
def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of every vector along the last dim onto the probability simplex.

    The sort-based algorithm of Duchi et al. (ICML 2008). The paper only says R is
    "normalized by row"; projection keeps r >= 0 with rows summing to 1 (so s_i is a convex
    combination and ||s_i|| <= max_j ||w_j||, which BLS's bound relies on) and turns the
    gradient steps into projected gradient descent on the feasible set.
    """
    n = v.shape[-1]
    u, _ = torch.sort(v, dim=-1, descending=True)
    css = u.cumsum(-1) - 1
    k = torch.arange(1, n + 1, dtype=v.dtype, device=v.device)
    # u_k - css_k / k > 0 holds exactly for k <= rho; k = 1 always qualifies
    rho = (u - css / k > 0).sum(-1, keepdim=True)
    theta = css.gather(-1, rho - 1) / rho.to(v.dtype)
    return (v - theta).clamp_min(0)


def layer_gram(stacks: Sequence[torch.Tensor], center: bool = True,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """Gram matrix (float64, n x n) of the n stacked rows of one layer's parameters.

    ``stacks`` are that layer's parameter stacks ``[n, *shape]`` (weight and bias); the
    layer is their concatenation. Centering (subtracting the mean row per coordinate) does
    not change f_s for relation vectors on the simplex, since sum_j r_ij = 1 makes
    r_i (X - 1 xbar) - (x_i - xbar) = r_i X - x_i; it changes the gradient only by a
    constant along j, which the projection removes. What it removes is the cancellation
    of ||w||^2-sized terms that otherwise swamps the small differences between clients.

    How, cheaply: the centred Gram is H (X - 1 x_0) (X - 1 x_0)^T H with H = I - 11^T/n for
    any reference row x_0, so the rows are shifted by client 0's row in the stored
    precision (the difference of two nearby floats is exact or nearly so), multiplied in
    that precision chunk by chunk, summed in float64, and centred on the n x n result.
    Against converting every parameter to float64 and centring it, this reads the stack
    once and runs float32 products: 3-4x less server time at the same accuracy (tested).
    On a GPU (``device``) the chunks are multiplied there and the n x n result comes back.
    """
    n = stacks[0].shape[0]
    gram = torch.zeros(n, n, dtype=torch.float64, device=device)
    chunk = max(1, _GRAM_CHUNK // max(n, 1))
    for stack in stacks:
        flat = stack.reshape(n, -1)
        for start in range(0, flat.shape[1], chunk):
            x = flat[:, start:start + chunk].to(device, non_blocking=True)
            if center:
                x = x - x[:1]
            gram += (x @ x.T).to(torch.float64)
    if center:
        h = torch.eye(n, dtype=torch.float64, device=device) - 1.0 / n
        gram = h @ gram @ h
    return gram.cpu()


def relation_grad(r: torch.Tensor, gram: torch.Tensor, loss: str = "squared") -> torch.Tensor:
    """d/dr_ij^l of sum_l f_s(sum_j r_ij^l w_j^l, w_i^l), for all i, l, j at once.

    ``r`` is ``[n, L, n]`` and ``gram`` ``[L, n, n]`` with gram[l, j, k] = <w_j^l, w_k^l>.
    With e_i^l = s_i^l - w_i^l: <e_i^l, w_j^l> = (r^l G^l - G^l)_ij, so the squared loss
    has gradient 2 (r^l G^l - G^l) and the plain norm (r^l G^l - G^l) / ||e_i^l||, where
    ||e_i^l||^2 = sum_j r_ij^l <e_i^l, w_j^l> - <e_i^l, w_i^l> (a zero norm gets the zero
    subgradient).
    """
    diff = torch.einsum("ilk,lkj->ilj", r, gram) - gram.permute(1, 0, 2)
    if loss == "squared":
        return 2 * diff
    if loss != "l2":
        raise ValueError(f"unknown coaching loss {loss!r}")
    own = torch.diagonal(diff, dim1=0, dim2=2).T  # [i, l] = <e_i^l, w_i^l>
    norm = ((r * diff).sum(-1) - own).clamp_min(0).sqrt()
    safe = torch.where(norm > 0, norm, torch.ones_like(norm))
    return torch.where(norm.unsqueeze(-1) > 0, diff / safe.unsqueeze(-1), torch.zeros_like(diff))


def init_relations(kind: str, num_clients: int, num_layers: int, seed: int) -> torch.Tensor:
    n, L = num_clients, num_layers
    if kind == "uniform":
        return torch.full((n, L, n), 1.0 / n, dtype=torch.float64)
    if kind == "self":
        r = torch.zeros(n, L, n, dtype=torch.float64)
        r[torch.arange(n), :, torch.arange(n)] = 1.0
        return r
    if kind == "random":
        # normalised i.i.d. exponentials = Dirichlet(1, ..., 1): uniform on the simplex
        u = torch.rand(n, L, n, generator=generator(seed, "kapc", "relations"), dtype=torch.float64)
        e = -torch.log1p(-u)
        return e / e.sum(-1, keepdim=True)
    raise ValueError(f"unknown relation init {kind!r}")


def layer_spread(gram: torch.Tensor) -> torch.Tensor:
    """[L] mean squared distance of the participants' layer to their mean: trace(G_c) / n."""
    return torch.diagonal(gram, dim1=1, dim2=2).sum(-1) / gram.shape[-1]


def coaching_unit(gram: torch.Tensor, loss: str) -> torch.Tensor:
    """[L] size of f_s per layer: the spread for the squared loss, its root for the plain
    norm; a zero spread (all participants equal, e.g. round 1) counts as 1."""
    spread = layer_spread(gram)
    unit = spread if loss == "squared" else spread.sqrt()
    return torch.where(unit > 0, unit, torch.ones_like(unit))


def relation_step_sizes(gram: torch.Tensor, hp: KAPCHyperparameters) -> torch.Tensor:
    """[L] step size per layer for ``r_grad_scale=precondition``.

    eta_r divided by the layer's spread (its square root for the plain norm), so that a
    relation moves by the order of eta_r per step whatever the raw size of the layer's
    parameter differences; capped at the inverse of the gradient's Lipschitz constant,
    2 lambda lambda_max(G) + beta <= 2 lambda trace(G) + beta, so that a layer whose clients
    are nearly identical (tiny spread) cannot overshoot and oscillate. Both terms of Eq. 11
    are scaled alike, so the minimiser, the paper's balance of lambda against beta, is
    the one of the raw step; only the speed of reaching it changes.
    """
    spread = layer_spread(gram)
    step = hp.r_lr / coaching_unit(gram, hp.coaching_loss)
    if hp.coaching_loss == "squared":
        lipschitz = 2 * hp.lam * spread * gram.shape[-1] + hp.beta
    else:  # the plain norm's gradient has no Lipschitz constant at s = w; bound the beta part
        lipschitz = torch.full_like(spread, hp.beta)
    cap = torch.where(lipschitz > 0, 1.0 / lipschitz.clamp_min(1e-300),
                      torch.full_like(lipschitz, math.inf))
    return torch.minimum(step, cap)


def relation_step(r: torch.Tensor, gram: torch.Tensor, hp: KAPCHyperparameters,
                  num_clients: int) -> torch.Tensor:
    """E_r projected gradient steps of Eq. 12 / Eq. 32 on relation vectors ``r`` [n, L, n].

    ``gram`` is the participants' centred Gram per layer (see ``layer_gram``).
    """
    step = torch.full((1, gram.shape[0], 1), hp.r_lr, dtype=torch.float64)
    coach_unit = torch.ones_like(step)
    if hp.r_grad_scale == "precondition":
        step = relation_step_sizes(gram, hp).view(1, -1, 1)
    elif hp.r_grad_scale == "spread":
        # f_s measured in spread units: dimensionless, but beta keeps its raw size, so the
        # minimiser moves towards self-relations (docs/algorithms.md)
        coach_unit = coaching_unit(gram, hp.coaching_loss).view(1, -1, 1)
    for _ in range(hp.r_epochs):
        grad = relation_grad(r, gram, hp.coaching_loss) / coach_unit
        # the target 1/N (Eq. 32 keeps N, not the slice size) only shifts all entries of a
        # relation vector alike, which the projection removes: 1/N or 1/n give the same step
        r = project_simplex(r - step * (hp.lam * grad + hp.beta * (r - 1.0 / num_clients)))
    return r


# ---------------------------------------------------------------------------------------
# BLS client side: the generalization-bound criterion (29) and the Omega search
# ---------------------------------------------------------------------------------------
def _bound_sum(tau: Sequence[float], B: Sequence[float], n_cols: Sequence[int],
               omega: int) -> float:
    """M(Omega) of (27)-(29): sum_{m<=Omega} tau_m / (2 B_m) * prod_{j=m+1..Omega} sqrt(n_j)."""
    total = 0.0
    for m in range(omega):
        factor = math.prod(math.sqrt(n_cols[j]) for j in range(m + 1, omega))
        total += tau[m] / (2 * max(B[m], 1e-12)) * factor
    return total


def omega_criterion(omega: int, B: Sequence[float], tau: Sequence[float],
                    B_hat: Sequence[float], tau_hat: Sequence[float], d_out: Sequence[int],
                    n_cols: Sequence[int], num_classes: int) -> bool:
    """Inequality (29): L d_Omega M^(Omega) / (Omega c 2^(L-Omega)) prod_j B^_j/B_j <= M."""
    L = len(B)
    ratio = math.prod(bh / max(b, 1e-12) for bh, b in zip(B_hat, B, strict=True))
    lhs = (L * d_out[omega - 1] * _bound_sum(tau_hat, B_hat, n_cols, omega)
           / (omega * max(num_classes, 1) * 2.0 ** (L - omega)) * ratio)
    # at Omega = L with nothing changed the two sides are equal in exact arithmetic; the
    # left one's products and quotients may round a last bit above (seen on an AVX-512 CPU)
    return lhs <= _bound_sum(tau, B, n_cols, L) * (1 + 1e-12)


def search_omega(prev: int, num_layers: int, holds: Callable[[int], bool]) -> tuple[int, int]:
    """Neighbour search from the previous Omega for the largest Omega where ``holds``.

    Returns (Omega, criterion evaluations). The left side of (29) grows with Omega (the
    2^(L-Omega) in its denominator shrinks and M^ gains terms), so the criterion holds
    for the short prefixes and fails from some length on; the search walks from the
    previous Omega up while the next length still holds, or down until one holds, and
    stops at 1 (a client always shares its first layer, Omega in [1, L]). It finds the
    largest such Omega when the lengths that hold are a prefix of 1..L (so on cnn2,
    cnn_small and cnn_cifar in a review's 2,000 random draws each); otherwise a local
    one. The paper's
    pseudo-code (Algorithm 4, lines 16-24) states the two walking directions the other
    way round, which under its own criterion would always end at Omega = 1; we follow
    the reading that reproduces its Fig. 8 (about 19 of 21 layers uploaded).
    """
    L = num_layers
    omega = min(max(int(prev), 1), L)
    evals = 1
    if holds(omega):
        while omega < L:
            evals += 1
            if not holds(omega + 1):
                break
            omega += 1
    else:
        while omega > 1:
            omega -= 1
            evals += 1
            if holds(omega):
                break
    return omega, evals


def refresh_stale(omega: int, age: torch.Tensor, refresh_every: int) -> int:
    """Omega raised so that no layer's server copy becomes ``refresh_every`` selections old.

    ``age[l]`` counts the client's selections since layer l + 1 was last uploaded. A layer
    past Omega that would reach the limit with this upload is uploaded, and with it every
    layer before it (uploads are prefixes). Without the limit a client whose Omega stays
    low never refreshes the deep layers on the server, so R and the regularizers of the
    clients that lean on it keep using stale, possibly initial, copies (its own
    regularizer does not, with ``prefix_down``), and the bound's reference B, tau is never
    refreshed either (Algorithm 4 refreshes it only after a full upload).
    ``refresh_every = 0`` disables the limit.
    """
    if refresh_every <= 0:
        return omega
    stale = [l_idx + 1 for l_idx in range(omega, age.numel())
             if int(age[l_idx]) + 1 >= refresh_every]
    return max([omega, *stale])


def kapc_layers(spec: LayerSpec, hp: KAPCHyperparameters) -> LayerSpec:
    """The layers KAPC relates, selects and bounds (``norm_layers``)."""
    return spec.merge_norms() if hp.norm_layers == "merged" else spec


def layer_shapes(spec: LayerSpec, model: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """(d_l, n_l) per layer for (29): output dimension and columns of the layer's weight.

    The weight is the layer's first parameter; a conv weight [out, in, kh, kw] is read as
    the matrix [out, in*kh*kw] the bound is stated for.
    """
    d_out, n_cols = [], []
    for layer in spec.layers:
        w = model[layer.params[0]]
        d = int(w.shape[0]) if w.dim() > 0 else 1
        d_out.append(d)
        n_cols.append(max(1, w.numel() // max(d, 1)))
    return d_out, n_cols


# ---------------------------------------------------------------------------------------
# server
# ---------------------------------------------------------------------------------------
class KAPCServer(Server, Reporter):
    """Relation cube, the clients' latest uploads, and the personalized regularizers."""

    bls = False
    # relation cube, the clients' latest uploads, whether an upload arrived since R last moved
    state: ClassVar[tuple[str, ...]] = ("R", "W", "fresh")
    age: torch.Tensor  # KAPCBLSServer's (bls): per client and layer, uploads since its copy

    def __init__(self, ctx: ServerContext, hp: KAPCHyperparameters):
        super().__init__(ctx, hp)
        spec = kapc_layers(ctx.layers, hp)
        self.spec = spec
        self.device = server_device(ctx.train.device)
        self.layer_params = [list(layer.params) for layer in spec.layers]
        n = ctx.num_clients
        # Before any upload the server's row for a client is the model that client starts
        # from (Algorithm 1, line 1), so it is exact, not a placeholder.
        self.W = {p: ctx.stacks.repeat(ctx.init_model[p].detach(), n) for p in spec.param_names}
        if hp.init == "per_client":  # one client's model at a time: N of them may not fit
            for cid in range(n):
                first = initial_model(ctx, hp, cid)
                for p in spec.param_names:
                    self.W[p][cid].copy_(first[p])
        # N x L x N: on disk too with train.store = disk (4 GB at 10,000 clients, 5 layers)
        self.R = ctx.stacks.hold(init_relations(hp.r_init, n, len(spec), ctx.seed))
        self.fresh = True
        self._metrics: dict[str, float] = {}

    # -- one round ----------------------------------------------------------------------
    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        clients = sorted(selected)
        idx = torch.tensor(clients, dtype=torch.long)
        n, L = len(clients), len(self.spec)
        rows, layers, cols = idx.view(-1, 1, 1), torch.arange(L).view(1, -1, 1), idx.view(1, 1, -1)
        # Algorithm 5: slice R to the participants and normalise; for full participation the
        # slice is R itself. Rows of R are on the simplex, so the slice is non-negative and
        # normalising is a rescale by its mass.
        sub = self.R[rows, layers, cols]
        mass = sub.sum(-1, keepdim=True)
        r = torch.where(mass > 0, sub / mass.clamp_min(1e-300), torch.full_like(sub, 1.0 / n))
        # the participants' uploads, gathered once (no copy when everyone participates)
        full = n == self.ctx.num_clients
        stacks = {p: self.W[p] if full else self.W[p][idx] for p in self.spec.param_names}
        # R relates the uploads: with none new since its last step (every client of the
        # last round failed) it has nothing new to learn from and stays as it is
        if self.hp.r_epochs > 0 and self.fresh:
            self.fresh = False
            gram = torch.stack([layer_gram([stacks[p] for p in params], device=self.device)
                                for params in self.layer_params])
            r = relation_step(r, gram, self.hp, self.ctx.num_clients)
            # write the slice back with its mass kept: relations to clients absent this
            # round keep their values and every full relation vector still sums to 1
            self.R[rows, layers, cols] = torch.where(mass > 0, r * mass, sub)
        messages: dict[int, State] = {}
        for l_idx, params in enumerate(self.layer_params):
            send = torch.ones(n, dtype=torch.bool)
            if self.bls:
                # Algorithm 3: a layer whose self-relation is >= mu would be nearly the
                # client's own weights, so it is not worth the downlink
                send = r[torch.arange(n), l_idx, torch.arange(n)] < self.hp.mu
                if self.hp.prefix_down:
                    # Eq. 20: past the prefix the client uploaded last time its regularizer
                    # is its own last weights, not the server's stale copy of them
                    send &= self.age[idx, l_idx] == 0
            if not bool(send.any()):
                continue
            weights = r[:, l_idx, :]
            for p in params:
                # a gathered copy is let go once used: the regularizers take its place
                stack = stacks.pop(p)
                # Eq. 15/34 as one n x n by n x P product
                s = (weights.to(stack.dtype) @ stack.reshape(n, -1)).reshape(stack.shape)
                for a, cid in enumerate(clients):
                    if send[a]:
                        messages.setdefault(cid, {})[p] = s[a]
        sent = [sum(all(p in messages.get(cid, {}) for p in params) for params in self.layer_params)
                for cid in clients]
        self._metrics = {"layers_down_mean": float(sum(sent)) / max(len(sent), 1),
                         # how far R has moved from sharing (1/N) towards self (1), Fig. 7
                         "relation_self_mean": float(torch.diagonal(self.R, dim1=0, dim2=2).mean())}
        # BLS: what the server holds of the client, as the age of each layer's copy, so that
        # the client's staleness limit and Algorithm 4's full-regularizer branch follow the
        # uploads that arrived, not those the client sent (a late or rejected reply is lost)
        return {cid: Message(messages.get(cid, {}),
                             {"age": [int(a) for a in self.age[cid]]} if self.bls else {})
                for cid in clients}

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        counts = []
        for cid, reply in replies.items():
            count = self._uploaded_layers(cid, reply)
            for p in self.spec.prefix(count):
                self.W[p][cid].copy_(reply.tensors[p])  # the rest stay stale (Eq. 33)
            counts.append(count)
            self.fresh = True
            if self.bls:  # the copies past the prefix are one upload staler
                age = self.age[cid]
                age[count:] += 1
                age[:count] = 0
        if counts:
            self._metrics["layers_up_mean"] = float(sum(counts)) / len(counts)
            if self.bls:
                # how many uploads in a row the stalest server copy of a replying client's
                # layer has been left out of (bounded by refresh_every - 1)
                stale = self.age[torch.tensor(sorted(replies), dtype=torch.long)]
                self._metrics["layers_stale_max"] = float(stale.max())

    def check_reply(self, cid: int, reply: Message) -> None:
        # copy_ into W would broadcast a wrong shape and cast a wrong dtype silently
        count = self._uploaded_layers(cid, reply)
        check_message(f"client {cid}", reply,
                      {p: self.W[p][cid] for p in self.spec.prefix(count)})

    def _uploaded_layers(self, cid: int, reply: Message) -> int:
        """The reply's prefix length Omega; anything but a whole-layer prefix is an error."""
        names = set(reply.tensors)
        count = 0
        while count < len(self.layer_params) and all(p in names for p in self.layer_params[count]):
            count += 1
        expected = set(self.spec.prefix(count))
        if names != expected or count == 0 or (not self.bls and count != len(self.layer_params)):
            what = "every layer" if not self.bls else "the parameters of its first Omega >= 1 layers"
            raise MessageError(f"client {cid} must upload {what}; it sent {sorted(names)}")
        return count

    # -- state, metrics, files ------------------------------------------------------------
    def round_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def write_artifacts(self, out_dir: Path, plots: bool) -> None:
        from edgepfl.io import write_tensors

        out_dir = Path(out_dir)
        write_tensors(out_dir / "relation_cube.safetensors", {"R": self.R},
                      {"axes": ["client i", "layer l", "client j"], "layers": self.spec.names})
        if plots:
            client = self.ctx.num_clients - 1  # the paper's Fig. 7 shows the last client (9 of 10)
            plot_relation_matrix(self.R[client], self.spec.names,
                                 out_dir / f"relation_client{client}.png",
                                 f"relation matrix of client {client} (layers x clients)")


def plot_relation_matrix(matrix: torch.Tensor, layer_names: list[str], path: Path,
                         title: str) -> None:
    """Heatmap of one client's relation matrix r_i (layers x clients), as the paper's Fig. 7."""
    from edgepfl.plotting import plt, save_figure

    L, n = matrix.shape
    fig, ax = plt.subplots(figsize=(min(14.0, 2.5 + 0.35 * n), 1.6 + 0.45 * L))
    im = ax.imshow(matrix.numpy(), aspect="auto", cmap="viridis", vmin=0.0,
                   vmax=max(float(matrix.max()), 1e-12), interpolation="nearest")
    ax.set_yticks(range(L), labels=layer_names)
    if n <= 40:
        ax.set_xticks(range(n))
    ax.set_xlabel("client j")
    ax.set_ylabel("layer l")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="r_ij^l")
    save_figure(fig, path)


class KAPCBLSServer(KAPCServer):
    bls = True
    # + per client and layer, the client's uploads since that layer was last in one (0: the
    # server's copy is the client's latest weights of it, or the exact initial model)
    state: ClassVar[tuple[str, ...]] = ("R", "W", "fresh", "age")

    def __init__(self, ctx: ServerContext, hp: KAPCBLSHyperparameters):
        super().__init__(ctx, hp)
        self.age = torch.zeros(ctx.num_clients, len(self.spec), dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# client
# ---------------------------------------------------------------------------------------
def coaching_hook(lam: float, targets: list[torch.Tensor], loss: str,
                  groups: list[list[int]] | None = None):
    """Gradient of lambda * sum_l f_s(s^l, w^l), added to the CE gradient in place (Eq. 17).

    squared: 2 lambda (w - s); l2: lambda (w^l - s^l) / ||w^l - s^l|| per layer ``groups``
    (indices into the parameter list), the zero subgradient where the layer matches s.
    """
    def plain(params, grads):
        diffs = torch._foreach_sub(list(params), targets)
        for group in groups or []:
            norm = torch.sqrt(sum((diffs[k] * diffs[k]).sum() for k in group))
            if float(norm) > 0:
                for k in group:
                    grads[k].add_(diffs[k], alpha=lam / float(norm))

    return Pull(2 * lam, targets) if loss == "squared" else plain


class KAPCClient(PersonalModelClient):
    """Personal model kept in state as ``model.<name>``, as ``local`` does."""

    batchable = True
    bls = False

    def __init__(self, ctx: ClientContext, hp: KAPCHyperparameters):
        super().__init__(ctx, hp)
        spec = kapc_layers(ctx.layers, hp)
        self.spec = spec
        self.names = self.trainer.param_names
        position = {p: k for k, p in enumerate(self.names)}
        self.groups = [[position[p] for p in layer.params] for layer in spec.layers]
        self.d_out, self.n_cols = layer_shapes(spec, dict(self.trainer.params))

    def init_state(self, cid: int, init_model: State) -> State:
        state = model_to_state(initial_model(self.ctx, self.hp, cid, init_model))
        if self.bls:
            L = len(self.spec)
            state.update({
                "bls.q": torch.tensor(0, dtype=torch.int64),         # times selected (q_i)
                # Omega of the last upload sent and the ages the client expects the server's
                # copies to have; what it decides on is the server's word (_server_ages)
                "bls.omega": torch.tensor(L, dtype=torch.int64),
                "bls.B": torch.zeros(L, dtype=torch.float64),        # B_i^l of Eq. 30 (max kept)
                "bls.tau": torch.zeros(L, dtype=torch.float64),      # tau_i^l of Eq. 31 (max kept)
                # selections since layer l was last uploaded: the age of the server's copy
                # (0 at the start: the server's copy is the initial model, exactly)
                "bls.age": torch.zeros(L, dtype=torch.int64),
            })
        return state

    def _targets(self, msg: Message, previous: State) -> list[torch.Tensor]:
        """The coaching target per parameter: s_i where sent, else the previous weights."""
        for layer in self.spec.layers:
            have = [p in msg.tensors for p in layer.params]
            if any(have) and not all(have):
                raise MessageError(f"regularizer has part of layer {layer.name!r}: "
                                   f"{[p for p in layer.params if p in msg.tensors]}")
            if not self.bls and not all(have):
                raise MessageError(f"KAPC regularizer lacks layer {layer.name!r}")
        extra = set(msg.tensors) - set(self.names)
        if extra:
            raise MessageError(f"regularizer has unknown parameters {sorted(extra)}")
        targets = []
        for p in self.names:
            t = msg.tensors.get(p, previous[p])  # Eq. 20: own last-round weights if not sent
            if t.shape != previous[p].shape:
                raise MessageError(f"regularizer {p!r} has shape {tuple(t.shape)}, "
                                   f"expected {tuple(previous[p].shape)}")
            targets.append(t)
        return targets

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        """Local SGD from the client's own model, pulled towards its coaching target."""
        previous = self.personal_model(state, None)
        targets = self._targets(msg, previous)
        hook = None
        if self.hp.lam > 0:  # lambda = 0 adds nothing at all: exactly local training
            hook = coaching_hook(self.hp.lam, self.trainer.place(targets), self.hp.coaching_loss,
                                 self.groups)
        return sgd_request(self, previous, data, gen, grad_hook=hook)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        new_state: State = model_to_state(trained)
        count = len(self.spec)
        if self.bls:  # Algorithm 4 measures the trained layers against their targets
            targets = self._targets(msg, self.personal_model(state, None))
            count, bls_state, evals = self._select_layers(state, trained, targets,
                                                          self._server_ages(msg))
            new_state.update(bls_state)
            stats["omega_evals"] = float(evals)
        stats["layers_up"] = float(count)
        reply = Message({p: trained[p] for p in self.spec.prefix(count)})
        return UpdateResult(reply, new_state, stats)

    def _server_ages(self, msg: Message) -> torch.Tensor:
        """The server's age of each of its copies of this client's layers (its message's
        ``age``): uploads of the client it received since it last received the layer."""
        L = len(self.spec)
        check_meta("the server", msg.meta, {"age": ints(0)})
        age = cast(list[int], msg.meta["age"])  # check_meta: a list of integers
        if len(age) != L:
            raise MessageError(f"the server sent age for {len(age)} layers; the model has {L}")
        return torch.tensor(age, dtype=torch.int64)

    def _select_layers(self, state: State, trained: State, targets: list[torch.Tensor],
                       age: torch.Tensor) -> tuple[int, State, int]:
        """Algorithm 4: Omega_i (raised by the staleness limit) and the updated estimates.

        ``age`` is the server's (``_server_ages``). The Omega of the last upload that
        arrived is its count of fresh leading layers: the server zeroes a received prefix
        and ages the rest, and before the first upload every copy is fresh (the initial
        model), which reads as a full, L-layer upload as Algorithm 4's first selection does.
        """
        L = len(self.spec)
        target = dict(zip(self.names, targets, strict=True))
        B_cur = torch.zeros(L, dtype=torch.float64)
        tau_cur = torch.zeros(L, dtype=torch.float64)
        for l_idx, layer in enumerate(self.spec.layers):
            B_cur[l_idx] = math.sqrt(sum(float(trained[p].double().pow(2).sum()) for p in layer.params))
            tau_cur[l_idx] = math.sqrt(sum(float((trained[p] - target[p]).double().pow(2).sum())
                                           for p in layer.params))      # Eq. 30, 31
        stale = torch.nonzero(age > 0)
        q, prev = int(state["bls.q"]), int(stale[0, 0]) if len(stale) else L
        B, tau = state["bls.B"].clone(), state["bls.tau"].clone()
        evals = 0
        if not self.hp.select_layers:
            omega = L
        elif q == 0 or prev == L:
            # the regularizer was full-layered: refresh B and tau as running maxima and
            # restart from L - 1 (Algorithm 4, lines 3-9)
            B, tau = torch.maximum(B, B_cur), torch.maximum(tau, tau_cur)
            omega = max(1, L - 1)
        else:
            # c_i of Theorem 3 is the output size of the network (the model's classes), not
            # the classes present in D_i: at Omega = L, d_Omega is that output size and
            # Theorem 4 must reduce to Theorem 3, i.e. (29) must hold with equality when
            # nothing changed (B^ = B, tau^ = tau)
            holds = functools.partial(
                omega_criterion, B=B.tolist(), tau=tau.tolist(), B_hat=B_cur.tolist(),
                tau_hat=tau_cur.tolist(), d_out=self.d_out, n_cols=self.n_cols,
                num_classes=self.ctx.num_classes)
            omega, evals = search_omega(prev, L, holds)
        omega = refresh_stale(omega, age, self.hp.refresh_every)
        layers = torch.arange(1, L + 1)
        bls_state = {"bls.q": torch.tensor(q + 1, dtype=torch.int64),
                     "bls.omega": torch.tensor(omega, dtype=torch.int64),
                     "bls.B": B, "bls.tau": tau,
                     "bls.age": torch.where(layers <= omega, torch.zeros_like(age), age + 1)}
        return omega, bls_state, evals


class KAPCBLSClient(KAPCClient):
    bls = True


KAPC = Algorithm(
    name="kapc",
    summary="KAPC: layer-wise relation cube R on the server; each client is coached towards "
            "s_i^l = sum_j r_ij^l w_j^l",
    hyperparameters=KAPCHyperparameters,
    server=KAPCServer,
    client=KAPCClient,
    paper=PAPER,
    privacy=PrivacySupport(
        sample=True, refused="client level: its server builds the relation cube from each "
        "client's own model, which a noised sum cannot replace"),
    no_new_clients="its server coaches each client towards a mix of the others' uploads "
                   "weighted by that client's relations, which a newcomer has none of",
)

KAPC_BLS = replace(  # KAPC's paper, privacy and new clients
    KAPC, name="kapc_bls",
    summary="KAPC with bidirectional layer selection: regularizer layers with self-relation "
            ">= mu are not sent; clients upload the first Omega layers chosen by a "
            "generalization bound",
    hyperparameters=KAPCBLSHyperparameters,
    server=KAPCBLSServer,
    client=KAPCBLSClient,
)

ALGORITHM = KAPC
ALGORITHMS = (KAPC, KAPC_BLS)
