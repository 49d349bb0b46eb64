"""hierbayes' closed-form blocks (Eq. 23-28): pure functions of per-coordinate tensors, the
edge and cloud updates and the edge level's fixed point, kept apart from the algorithm's
server, edge and client parts (``edgepfl.algorithms.hierbayes``)."""

from __future__ import annotations

import torch

from edgepfl.contract.algorithm import State
from edgepfl.federation.messages import Message, MessageError


def _split(msg: Message, prefix: str) -> State:
    return {k[len(prefix):]: v for k, v in msg.tensors.items() if k.startswith(prefix)}


class Layout:
    """A level's per-coordinate vectors (float64, the model's parameters end to end) and which
    coordinates share a variance: a tensor's (``per_layer``) or none."""

    def __init__(self, init: State, names: list[str], per_layer: bool):
        self.names, self.per_layer = names, per_layer
        self.like = {n: init[n] for n in names}
        sizes = torch.tensor([init[n].numel() for n in names])
        self.sizes = sizes.double()
        self.index = torch.repeat_interleave(torch.arange(len(names)), sizes)
        # the coordinates sharing each coordinate's variance
        self.dim: float | torch.Tensor = self.sizes[self.index] if per_layer else 1.0

    def flat(self, model: State) -> torch.Tensor:
        return torch.cat([model[n].reshape(-1).double() for n in self.names])

    def tensor_means(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of a per-coordinate vector over each tensor's coordinates."""
        sums = torch.zeros(len(self.names), dtype=x.dtype).index_add_(0, self.index, x)
        return sums / self.sizes

    def pool(self, x: torch.Tensor) -> torch.Tensor:
        """Each coordinate's value replaced by its tensor's mean when variances are shared."""
        return self.tensor_means(x)[self.index] if self.per_layer else x

    def prior_var(self, scale: float) -> torch.Tensor:
        """b_p / a_p per coordinate: ``scale`` x its tensor's initial mean square."""
        sq = self.flat(self.like) ** 2
        mean_sq = self.tensor_means(sq)
        floor = float(sq.mean()) or 1.0  # zero-initialised tensors (biases) take the model's
        return scale * torch.where(mean_sq > 0, mean_sq, torch.full_like(mean_sq, floor))[self.index]

    def model(self, flat: torch.Tensor, prefix: str) -> State:
        out, i = {}, 0
        for n in self.names:
            t = self.like[n]
            out[prefix + n] = flat[i:i + t.numel()].reshape(t.shape).to(t.dtype)
            i += t.numel()
        return out

    def shared(self, flat: torch.Tensor, prefix: str) -> State:
        """A vector constant within each variance group, sent as one value per tensor when
        variances are per layer (a model's worth of bytes otherwise)."""
        if not self.per_layer:
            return self.model(flat, prefix)
        starts = torch.cumsum(self.sizes, 0).long() - self.sizes.long()
        return {prefix + n: flat[int(starts[j])].reshape(1).to(self.like[n].dtype)
                for j, n in enumerate(self.names)}

    def read(self, msg: Message, prefix: str) -> torch.Tensor:
        """The per-coordinate vector of ``prefix``'s entries: whole tensors, or one value per
        tensor (expanded) for a vector ``shared`` sent."""
        parts = _split(msg, prefix)
        if set(parts) != set(self.names):
            raise MessageError(f"message needs a {prefix!r} entry for every parameter; missing "
                               f"{sorted(set(self.names) - set(parts))[:3]}, unexpected "
                               f"{sorted(set(parts) - set(self.names))[:3]}")
        return self.flat({n: _broadcast(n, parts[n], self.like[n]) for n in self.names})




# -- the closed-form blocks (pure functions of per-coordinate tensors) ---------------------
def expected_var(a: float | torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """E[sigma^2] under IG(a, b) (its mode b / (a + 1) while the mean is infinite)."""
    if isinstance(a, torch.Tensor):
        return torch.where(a > 1, b / (a - 1).clamp_min(1e-300), b / (a + 1))
    return b / (a - 1) if a > 1 else b / (a + 1)


def gaussian_block(means: torch.Tensor, count: float, lam: torch.Tensor, prior_mean: torch.Tensor,
                   prior_prec: torch.Tensor | float) -> tuple[torch.Tensor, torch.Tensor]:
    """argmin over q = N(m, v) of  lam/2 sum_i E[(x_i - z)^2] + E[KL(q || N(prior_mean,
    1/prior_prec))]: the posterior of z given ``count`` Gaussian observations with mean
    ``means.mean(0)`` and expected precision ``lam``. Returns (m, v)."""
    prec = count * lam + prior_prec
    m = (lam * count * means.mean(0) + prior_prec * prior_mean) / prec
    return m, 1.0 / prec


def gamma_block(sq: torch.Tensor, count: float, a_p: float, b_p: float | torch.Tensor,
                dim: float | torch.Tensor = 1.0) -> tuple[float | torch.Tensor, torch.Tensor]:
    """argmin over q = IG(a, b) of sigma^2 of -sum_i sum_j E[log N(x_ij; z_j, sigma^2)] +
    KL(q || IG(a_p, b_p)) for ``count`` observations of ``dim`` coordinates sharing sigma^2,
    where ``sq`` is the mean over observations and coordinates of E[(x_ij - z_j)^2]."""
    return a_p + count * dim / 2, b_p + 0.5 * count * dim * sq


def _broadcast(name: str, value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A parameter's entry at the parameter's shape: sent whole, or as one shared value."""
    if value.shape == like.shape:
        return value
    if value.numel() == 1:
        return value.reshape(()).expand(like.shape)
    raise MessageError(f"entry {name!r} has shape {tuple(value.shape)}; expected "
                       f"{tuple(like.shape)} or one shared value")


def edge_update(uploads: torch.Tensor, size: float, eps: float | torch.Tensor, m0: torch.Tensor,
                lam_e: torch.Tensor, a: float | torch.Tensor, b: torch.Tensor, a_p: float,
                b_p: float | torch.Tensor, iters: int, layout: Layout | None = None,
                weights: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor, torch.Tensor]:
    """Eq. 25: q(phi_k) and q(sigma_ck^2) from the uploaded client means (rows of
    ``uploads``) standing for the edge's ``size`` clients, whose posterior variances are
    ``eps ** 2`` (a number, or the clients' mean per coordinate). ``weights`` (``weighting =
    "samples"``) weight each client's term, the count staying ``size``; ``b`` infinite starts
    the sweeps without a pull (``precision_start = "data"``). Returns (m_k, v_k, a_k, b_k)."""
    pool, dim = (layout.pool, layout.dim) if layout is not None else ((lambda x: x), 1.0)
    centre, spread = _moments(uploads, weights)
    spread = spread + eps ** 2
    for _ in range(iters):
        m, v = gaussian_block(centre, size, a / b, m0, lam_e)
        a, b = gamma_block(pool(spread + (centre[0] - m) ** 2 + v), size, a_p, b_p, dim)
    return m, v, a, b


def cloud_update(means: torch.Tensor, variances: torch.Tensor, psi_prior_var: float,
                 a: float | torch.Tensor, b: torch.Tensor, a_p: float, b_p: float | torch.Tensor,
                 iters: int, weights: torch.Tensor | None = None, layout: Layout | None = None,
                 scratch: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor, torch.Tensor]:
    """Eq. 28: q(psi) and q(sigma_e^2) from the edges' posteriors N(m_k, v_k) (rows).
    ``weights`` (asynchronous edges: stale ones count as fractions of an observation)
    scale each edge's term in the objective; ``scratch``, a buffer shaped like ``means``
    that it may overwrite. Returns (m_0, v_0, a_e, b_e)."""
    pool, dim = (layout.pool, layout.dim) if layout is not None else ((lambda x: x), 1.0)
    count = means.shape[0] if weights is None else float(weights.sum())
    centre, spread = _moments(means, weights, scratch)
    spread = spread + (variances.mean(0) if weights is None
                       else (_column(weights, means) * variances).sum(0))
    zero = torch.zeros_like(means[0])
    for _ in range(iters):
        m, v = gaussian_block(centre, count, a / b, zero, 1.0 / psi_prior_var)
        a, b = gamma_block(pool(spread + (centre[0] - m) ** 2 + v), count, a_p, b_p, dim)
    return m, v, a, b


def _column(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Weights normalised to sum to one, shaped to scale ``rows``' rows."""
    return (weights / weights.sum()).view(-1, *([1] * (rows.dim() - 1))).to(rows.dtype)


def _moments(rows: torch.Tensor, weights: torch.Tensor | None = None,
             scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' (weighted) mean, kept as one row, and their mean square distance from it.
    The coordinate-ascent sweeps need  mean_i (x_i - m)^2  for a moving m; it equals this
    spread + (mean - m)^2, so a sweep touches one row instead of all of them."""
    w = None if weights is None else _column(weights, rows)
    centre = rows.mean(0, keepdim=True) if w is None else (w * rows).sum(0, keepdim=True)
    diff = torch.sub(rows, centre, out=scratch if scratch is not None else torch.empty_like(rows))
    diff.square_()
    return centre, (diff.mean(0) if w is None else diff.mul_(w).sum(0))


def edge_level_fixed_point(ybar: torch.Tensor, meas: torch.Tensor, psi_prior_var: float,
                           a_p: float, b_p: float | torch.Tensor, layout: Layout | None = None,
                           weights: torch.Tensor | None = None, steps: int = 60,
                           ) -> tuple[torch.Tensor, torch.Tensor, float | torch.Tensor, torch.Tensor]:
    """Eq. 25 and 28 (the edges' Gaussian blocks, q(psi), q(sigma_e^2)) at their common fixed
    point, with Eq. 28's E[(phi_k - psi)^2] taken under the joint Gaussian optimum of
    (phi_1..phi_K, psi) given the precisions rather than the product of its marginals
    (``edge_spread = "joint"``). The means are the same either way; the product form adds
    v_k + v_0 and drops the covariance of phi_k and psi, which holds sigma_e^2 at
    w / (K - 1) (w = 1 / meas, the edges' own uncertainty) however close the edges agree.
    Per coordinate (pooled per tensor), with x = 1 / E[1/sigma_e^2], w_k = 1 / meas_k,
    P = 1/psi_prior_var + sum_k o_k / (x + w_k), m_0 = sum_k o_k ybar_k / (x + w_k) / P:

        E[(phi_k - psi)^2] = (x / (x + w_k))^2 ((ybar_k - m_0)^2 + 1 / P) + x w_k / (x + w_k)

    and x = (b_p + C d/2 mean_k E) / (a_p + C d/2), C = sum_k o_k, solved by bisection on
    log x (the fixed point EM creeps towards: at equal w_k it is x = K/(K-1) spread - w,
    the one-way random-effects REML estimate, floored by the prior). Returns (m_0, v_0,
    a_e, b_e), v_0 = 1 / (C / x + 1/psi_prior_var) as Eq. 28 writes q(psi)."""
    omega = (torch.ones(ybar.shape[0], dtype=ybar.dtype) if weights is None
             else weights.to(ybar.dtype))
    count = float(omega.sum())
    col = omega.view(-1, *([1] * (ybar.dim() - 1)))
    w = 1.0 / meas.clamp_min(1e-300)
    p0 = 1.0 / psi_prior_var
    b_p = torch.as_tensor(b_p, dtype=ybar.dtype).expand_as(ybar[0])
    rough = (col / count * ((ybar - (col / count * ybar).sum(0)) ** 2 + w)).sum(0)
    if layout is not None and layout.per_layer:
        x = _per_tensor_fixed_point(ybar, w, omega, p0, a_p, b_p, layout, rough, steps)
        dim: float | torch.Tensor = layout.dim
    else:
        a_c = a_p + count / 2
        x = _fixed_point(lambda x: (b_p + 0.5 * count * _edge_spread(x, ybar, w, col, count, p0)[0])
                         / a_c, b_p / a_c, rough, steps)
        dim = 1.0
    a = a_p + count * dim / 2
    e, m0 = _edge_spread(x, ybar, w, col, count, p0)
    b = b_p + 0.5 * count * dim * (layout.pool(e) if layout is not None else e)
    return m0, 1.0 / (count * a / b + p0), a, b


def _per_tensor_fixed_point(ybar: torch.Tensor, w: torch.Tensor, omega: torch.Tensor,
                            p0: float, a_p: float, b_p: torch.Tensor, layout: Layout,
                            rough: torch.Tensor, steps: int) -> torch.Tensor:
    """``edge_level_fixed_point``'s x with one value per tensor (expanded per coordinate)."""
    count = float(omega.sum())
    # one x (and one w_k) per tensor: the spread about m_0 from each tensor's Gram matrix
    # of the centred ybar_k and their mean, so a bisection step is O(K^2) per tensor
    bt, d = layout.tensor_means(b_p), layout.sizes.to(ybar.dtype)
    wt = torch.stack([layout.tensor_means(r) for r in w])
    centre = ybar.mean(0)
    rows = torch.cat([ybar - centre, centre[None]])
    gram = torch.stack([rows[:, i:i + n] @ rows[:, i:i + n].T for i, n in
                        zip((torch.cumsum(layout.sizes, 0) - layout.sizes).long().tolist(),
                            layout.sizes.long().tolist(), strict=True)])

    def spread(x: torch.Tensor) -> torch.Tensor:
        inv = omega[:, None] / (x + wt)
        prec = inv.sum(0) + p0
        beta = inv / prec
        coef = torch.eye(len(omega), len(omega) + 1, dtype=ybar.dtype)[None] \
            - torch.cat([beta.T, torch.zeros_like(prec)[:, None]], 1)[:, None, :]
        coef[:, :, -1] = 1 - beta.sum(0)[:, None]
        quad = torch.einsum("tki,tij,tkj->kt", coef, gram, coef) / d
        shrink = x / (x + wt)
        e = shrink ** 2 * (quad + 1.0 / prec) + x * wt / (x + wt)
        return (omega[:, None] / count * e).sum(0)

    a_t = a_p + count * d / 2
    return _fixed_point(lambda x: (bt + 0.5 * count * d * spread(x)) / a_t, bt / a_t,
                        layout.tensor_means(rough), steps)[layout.index]


def _edge_spread(x: torch.Tensor, ybar: torch.Tensor, w: torch.Tensor, col: torch.Tensor,
                 count: float, p0: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted mean over edges of E[(phi_k - psi)^2] under the joint Gaussian, and m_0."""
    inv = col / (x + w)
    prec = inv.sum(0) + p0
    m0 = (inv * ybar).sum(0) / prec
    shrink = x / (x + w)
    e = shrink ** 2 * ((ybar - m0) ** 2 + 1.0 / prec) + x * w / (x + w)
    return (col / count * e).sum(0), m0


def _fixed_point(update, lo: torch.Tensor, rough: torch.Tensor, steps: int) -> torch.Tensor:
    """x = update(x), elementwise, by bisection on log x: the map is at least ``lo`` (the
    prior's b_p / a) everywhere and falls below the identity for large x (it grows as x / C)."""
    lo = lo.clamp_min(1e-300)
    hi = 10 * rough + 10 * lo
    for _ in range(60):
        above = update(hi) > hi
        if not bool(above.any()):
            break
        hi = torch.where(above, hi * 10, hi)
    lo, hi = lo.log(), hi.log()
    for _ in range(steps):
        mid = (lo + hi) / 2
        up = update(mid.exp()) > mid.exp()
        lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
    return ((lo + hi) / 2).exp()


# edge <-> cloud passes per cloud round: psi converges to ~1e-6 at equal weights; the
# edge-level variance does not quite (13% short of its fixed point from the prior at 10
# edges, in round 1; rounds start warm from the last, which closes the gap)
JOINT_SWEEPS = 20


def edge_posteriors(ybar: torch.Tensor, meas: torch.Tensor, m0: torch.Tensor,
                    lam_e: torch.Tensor, weighted: torch.Tensor | None = None,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 25's q(phi_k) for each edge (rows) from its clients' mean ``ybar`` and that mean's
    precision ``meas`` = S_k lambda_k, under the cloud's N(m_0, 1 / lambda_e). A caller
    sweeping over fixed reports passes ``weighted`` = ``meas * ybar`` (computed once) and
    ``out``, two buffers shaped like ``ybar`` for the result (a fresh tensor of a model per
    edge costs more in page faults than the arithmetic)."""
    means, prec = out if out is not None else (torch.empty_like(ybar), torch.empty_like(ybar))
    torch.add(meas, lam_e, out=prec)
    torch.add(meas * ybar if weighted is None else weighted, lam_e * m0, out=means).div_(prec)
    return means, prec.reciprocal_()
