"""DC-PFL (dynamic clustering for personalized FL): from one global model to one model per
client, splitting groups along a hierarchical group graph at the end of each rapid
decrease period of the training loss, with layer-wise aggregation intervals.

Phases of a run (all driven by the server; the client only follows the message's mode):

* warm-up, rounds 1..T_start: FedAvg with full uploads; every round the server adds the
  pairwise model discrepancy (Eq. 3) of the uploads to a running sum.
* then the averaged discrepancy matrix defines an average-linkage dendrogram (the group
  graph); gamma~ = 1 is one group. With partial participation a pair of clients that was
  never selected together has no measured discrepancy; it is completed from measured
  pairs (``complete_discrepancy``), never taken as 0 ("identical"). Each group aggregates
  its layers every tau local epochs (tau / train.local_epochs rounds), or every alpha*tau
  epochs when the layer's discrepancy (Eq. 5) is below 0.1 of the model's total (Eq. 6). A
  client uploads and downloads only the layers aggregated that round.
* the server smooths the mean pre-training loss, estimates the radius of curvature
  (Eq. 4) and, once it has not decreased for t_obv rounds, proposes the grouping one step
  lambda_gamma lower. One sync round (full upload) gives fresh weights for both the old
  and the new group models; in the trial round each client trains from both and reports
  both losses; the new grouping is kept only if its mean loss is lower, else the old one
  is kept for t_sp rounds before the same proposal is tried again.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import ClassVar, Literal, cast

import numpy as np
import torch
from pydantic import Field

from edgepfl.algorithms.dcpfl_groups import group_purity, plot_group_graph
from edgepfl.contract.algorithm import (
    Algorithm,
    Hyperparameters,
    PersonalModelClient,
    PrivacySupport,
    Reporter,
    SearchRange,
    Server,
    ServerContext,
    State,
    Uniform,
    UpdateResult,
    model_from_state,
    model_to_state,
)
from edgepfl.contract.kit import fit, sgd_request
from edgepfl.errors import ConfigError
from edgepfl.federation.aggregate import weighted_average
from edgepfl.federation.messages import (
    COUNT,
    NONNEGATIVE,
    Message,
    MessageError,
    check_message,
    exactly,
)
from edgepfl.federation.store import StackedStore
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest

WARMUP, NORMAL, SYNC, TRIAL = 0, 1, 2, 3
MODE_NAMES = {WARMUP: "warmup", NORMAL: "normal", SYNC: "sync", TRIAL: "trial"}


class DCPFLHyperparameters(Hyperparameters):
    # the step of the split threshold, which decides how finely the clients are grouped
    search_space: ClassVar[dict[str, SearchRange]] = {"lambda_gamma": Uniform(0.05, 0.5)}
    t_start: int = Field(5, ge=1, description="warm-up rounds whose model discrepancy is averaged "
                                               "(paper Sec. V: 'after 5 training rounds')")
    s: int = Field(5, ge=1, description="loss smoothing window in rounds (paper Sec. III-C: 5)")
    t_obv: int = Field(3, ge=1, description="rounds the radius must not decrease to end an RDP "
                                             "(paper Sec. V: 3)")
    t_sp: int = Field(6, ge=0, description="normal rounds the old grouping is kept after a rejected "
                                            "split before the same proposal is tried again "
                                            "(a sync round, then a trial; paper Sec. V: 6)")
    lambda_gamma: float = Field(0.2, gt=0, le=1, description="step of the normalised threshold "
                                                              "gamma~ per split (paper Sec. V: 0.2)")
    tau: int = Field(5, ge=1, description="aggregation interval of high-discrepancy layers in "
                                          "local epochs (paper Sec. V: '5 epochs'); a multiple "
                                          "of train.local_epochs, i.e. every "
                                          "tau / local_epochs rounds")
    alpha: int = Field(3, ge=1, description="interval factor of low-discrepancy layers, aggregated "
                                            "every alpha*tau epochs (paper Sec. V: 3)")
    low_ratio: float = Field(0.1, ge=0, description="a layer is low-discrepancy below this fraction "
                                                    "of the reference discrepancy (Eq. 6: 0.1)")
    low_reference: Literal["total", "mean"] = Field(
        "total", description="what Eq. 6 compares a layer's discrepancy against: total = "
        "the sum over the model's layers (a layer is low when it holds under low_ratio of "
        "the whole); mean = the mean over layers, as Eq. 6 is printed (docs/algorithms.md, "
        "'DC-PFL')")
    evaluate: Literal["group", "local"] = Field(
        "group", description="group = predict with the client's model with the layers its "
        "group aggregated this round laid over it (as the paper's Fig. 3); local = with "
        "the client's own model after its latest local training, before any group average")
    fixed_gamma: float | None = Field(None, ge=0, le=1, description=(
        "NoDC ablation (paper Sec. V-D): cut the group graph once at this gamma~ after the "
        "warm-up and never split again (the paper uses 0.8); unset = dynamic clustering"))


# -- Eq. 3 and Eq. 5: model discrepancy ----------------------------------------------------
def minmax(w: torch.Tensor) -> torch.Tensor:
    """S(w) of Eq. 3 over the last dimension; a constant vector maps to zeros (no range)."""
    w = w.to(torch.float64)
    lo = w.min(dim=-1, keepdim=True).values
    span = w.max(dim=-1, keepdim=True).values - lo
    return torch.where(span > 0, (w - lo) / torch.where(span > 0, span, 1.0), torch.zeros_like(w))


def discrepancy_matrix(flat: torch.Tensor) -> torch.Tensor:
    """D_ij = |S(w_i) - S(w_j)|_1 / dim(w) for the rows of ``flat`` [n, dim] (Eq. 3)."""
    return discrepancy_of([[row] for row in flat])


def discrepancy_of(models: Sequence[Sequence[torch.Tensor]], chunk: int = 1 << 16) -> torch.Tensor:
    """``discrepancy_matrix`` of the clients' flattened weights, each client given as its
    tensors in one order, without forming the [n, dim] matrix: S(w)'s min and range come
    from the tensors' own, and the L1 distances are summed over column chunks (an L1
    distance is a sum over coordinates). In float64, as ``minmax``; a round's participants
    of a 640k-weight CNN would otherwise need four [n, dim] float64 copies at once."""
    n = len(models)
    lo = torch.tensor([min(float(t.min()) for t in m) for m in models], dtype=torch.float64)
    hi = torch.tensor([max(float(t.max()) for t in m) for m in models], dtype=torch.float64)
    span = hi - lo
    scale = torch.where(span > 0, span, 1.0).unsqueeze(1)
    flat_ok = (span > 0).unsqueeze(1)
    dist = torch.zeros(n, n, dtype=torch.float64)
    dim = 0
    for k in range(len(models[0])):
        size = models[0][k].numel()
        for start in range(0, size, chunk):
            cols = torch.stack([m[k].reshape(-1)[start:start + chunk] for m in models])
            s = torch.where(flat_ok, (cols.to(torch.float64) - lo.unsqueeze(1)) / scale, 0.0)
            dist += torch.cdist(s, s, p=1)
        dim += size
    return dist / dim


def layer_discrepancy(client_layers: Iterable[torch.Tensor], group_layer: torch.Tensor) -> float:
    """D_{g,l} of Eq. 5: mean over the group's clients of |S(w_l,i) - S(w^g_l)|_1 / dim.

    ``client_layers``: one row per client (a [n, dim] tensor), or the clients' layers one
    at a time, so that a group of a thousand is never held as one [n, dim] copy."""
    g = minmax(group_layer.reshape(1, -1))
    total, n = 0.0, 0
    for w in client_layers:
        total += float((minmax(w.reshape(1, -1)) - g).abs().sum())
        n += 1
    return total / n / g.shape[1]


def reference_discrepancy(disc: list[float], reference: str = "mean") -> float:
    """D_g of Eq. 6: the mean of the layers' discrepancies (as printed) or their sum (the
    model's total, the reading under which layers of small CNNs are ever low)."""
    total = sum(disc)
    return total if reference == "total" else total / len(disc)


def low_layers(disc: list[float], ratio: float, reference: str = "mean") -> list[bool]:
    """Eq. 6: a layer is low-discrepancy when D_{g,l} < ratio * D_g."""
    ref = reference_discrepancy(disc, reference)
    return [d < ratio * ref for d in disc]


def layers_due(rnd: int, phase_start: int, low: list[bool], tau: int, alpha: int) -> list[bool]:
    """Which layers are aggregated in round ``rnd``: high ones every ``tau`` rounds, low ones
    every alpha*tau rounds, counted from the round the group's schedule (re)started. ``tau``
    here is in rounds (``tau_rounds``: the hyperparameter's epochs / train.local_epochs)."""
    k = rnd - phase_start
    return [k > 0 and k % (alpha * tau if lo else tau) == 0 for lo in low]


def tau_rounds(tau_epochs: int, local_epochs: int) -> int:
    """The paper's tau counts local epochs ("tau to be 5 epochs", Sec. V); a round trains
    ``local_epochs`` of them and layers can only be aggregated at the end of a round, so the
    interval in rounds is tau / local_epochs, which must be a whole number."""
    if tau_epochs % local_epochs:
        fits = sorted({max(1, tau_epochs // local_epochs) * local_epochs,
                       (tau_epochs // local_epochs + 1) * local_epochs})
        divisors = [d for d in range(1, tau_epochs + 1) if tau_epochs % d == 0]
        raise ConfigError(
            f"dcpfl: algorithm.tau = {tau_epochs} counts local epochs (paper Sec. V: 'tau to be 5 "
            f"epochs') and is not a multiple of train.local_epochs = {local_epochs}, so layers "
            f"could not be aggregated every {tau_epochs} epochs (only at round ends); valid: "
            f"algorithm.tau a multiple of {local_epochs} (e.g. {' or '.join(map(str, fits))}), "
            f"or train.local_epochs one of {divisors}")
    return tau_epochs // local_epochs


# -- Sec. III-B: hierarchical group graph ----------------------------------------------------
def complete_discrepancy(avg: np.ndarray, seen: np.ndarray) -> np.ndarray:
    """The discrepancy matrix the group graph is built from, given the averaged measured
    discrepancies ``avg`` and ``seen`` [n, n], whether a pair was ever measured (both clients
    uploaded in the same warm-up round).

    Measured pairs keep their average. An unmeasured pair has no evidence of similarity, so
    it must not read as 0 ("identical"): it gets the length of the shortest chain of measured
    pairs joining the two clients, min over k of D_ik + D_kj and so on. Eq. 3 is an L1
    distance between min-max scaled weights, so within a round D_ij <= D_ik + D_kj: the chain
    is the tightest upper bound the measurements give (a shared neighbour being the shortest
    chain). Pairs that no chain joins (e.g. a client never selected in the warm-up) get the
    largest entry, so they merge last in the group graph; with no measured pair at all every
    pair gets 1 (only ratios to gamma_global matter). With every pair measured (full
    participation) ``avg`` is returned as it is.
    """
    avg = np.asarray(avg, dtype=np.float64)
    known = np.asarray(seen, dtype=bool)
    known = known | known.T
    np.fill_diagonal(known, True)
    if known.all():
        return avg
    from scipy.sparse.csgraph import csgraph_from_dense, shortest_path

    dist = np.where(known, avg, np.inf)
    np.fill_diagonal(dist, np.inf)
    # the measured pairs as a sparse graph (a measured 0 stays an edge) and Dijkstra from
    # every client: sparse searches where Floyd-Warshall makes n passes over n x n (at
    # 10,000 clients, 10^12 steps)
    chains = shortest_path(csgraph_from_dense(dist, null_value=np.inf), method="D")
    out = np.where(known, avg, chains)
    finite = out[np.isfinite(out)]
    top = float(finite.max()) if finite.size else 0.0
    out[~np.isfinite(out)] = top if top > 0 else 1.0
    np.fill_diagonal(out, 0.0)
    return out


def group_graph(disc: np.ndarray) -> tuple[np.ndarray, float]:
    """Average-linkage dendrogram of the discrepancy matrix and gamma_global, the smallest
    threshold that puts every client in one group (the last merge height)."""
    from scipy.cluster.hierarchy import linkage
    from scipy.spatial.distance import squareform

    n = disc.shape[0]
    if n < 2:
        return np.zeros((0, 4)), 0.0
    sym = (disc + disc.T) / 2
    np.fill_diagonal(sym, 0.0)
    z = linkage(squareform(sym, checks=False), method="average")
    return z, float(z[:, 2].max())


def cut(z: np.ndarray, gamma_global: float, gamma_tilde: float, n: int) -> list[int]:
    """Grouping at normalised threshold gamma~ = gamma / gamma_global: clients whose groups
    merge at a height <= gamma~ * gamma_global share a group. Labels are numbered by first
    appearance so equal groupings compare equal."""
    from scipy.cluster.hierarchy import fcluster

    if n < 2:
        return [0] * n
    raw = fcluster(z, t=gamma_tilde * gamma_global, criterion="distance")
    return canonical(raw.tolist())


def canonical(labels: list[int]) -> list[int]:
    seen: dict[int, int] = {}
    return [seen.setdefault(int(x), len(seen)) for x in labels]


def refines(fine: list[int], coarse: list[int]) -> bool:
    """True when every group of ``fine`` lies inside one group of ``coarse``."""
    owner: dict[int, int] = {}
    return all(owner.setdefault(f, c) == c for f, c in zip(fine, coarse, strict=True))


# -- Sec. III-C: rapid decrease periods --------------------------------------------------------
def radius_of_curvature(losses: list[float], s: int) -> list[float]:
    """r(t) of Eq. 4 for each round of ``losses`` (nan where undefined).

    l_w(t) = mean of l(t') over the window t' = t-s+1..t (a window "of length s", its
    factor 1/s; the LaTeX lower limit max(1, t-s) would put s + 1 terms over s), l'(t) =
    l_w(t) - l_w(t-1), l''(t) = l'(t) - l'(t-1). An s-round window also cancels a loss
    pattern that repeats every s rounds, such as the jump after each aggregation when the
    aggregation period is s rounds (the paper's tau = 5 epochs at one epoch a round and
    s = 5), which an (s+1)-round window passes into l' and l''.
    r(t) is only defined once all three windows it uses are full (t >= s + 2), so the ramp
    of a filling window is not mistaken for a bend; where l'' <= 0 the curve does not bend
    towards flattening and r is +inf.
    """
    n = len(losses)
    lw = [sum(losses[max(0, t - s):t]) / s for t in range(1, n + 1)]
    out = []
    for t in range(1, n + 1):
        if t < s + 2:
            out.append(math.nan)
            continue
        d1 = lw[t - 1] - lw[t - 2]
        d1_prev = lw[t - 2] - lw[t - 3]
        d2 = d1 - d1_prev
        # a bend below rounding noise of the smoothed loss is no bend (a straight line's l''
        # comes out as +-1e-16, which would otherwise give huge but finite, jittering radii)
        eps = 1e-9 * (1.0 + abs(lw[t - 1]))
        out.append((1 + d1 * d1) ** 1.5 / d2 if d2 > eps else math.inf)
    return out


def rdp_ended(losses: list[float], s: int, t_obv: int) -> bool:
    """The RDP has ended when r(t) < r(t') for t' = t+1..t+t_obv, t + t_obv being now: the
    radius reached a minimum t_obv rounds ago and has not decreased since."""
    r = radius_of_curvature(losses, s)
    if len(r) < t_obv + 1:
        return False
    window = r[-t_obv - 1:]
    if any(math.isnan(x) for x in window) or not math.isfinite(window[0]):
        return False
    return all(window[0] < x for x in window[1:])


# -- server --------------------------------------------------------------------------------
class DCPFLServer(Server, Reporter):
    # everything a resumed run needs: the stores and matrices as tensors, the phase
    # bookkeeping (scalars, groupings, losses, history, trials) as JSON values
    state: ClassVar[tuple[str, ...]] = (
        "uploads", "group", "trial0", "trial1", "disc_sum", "disc_count", "z", "pending", "low",
        "gamma_global", "built", "gamma", "proposal_gamma", "mode", "phase_start", "retry_at",
        "done", "labels", "proposal", "losses", "history", "trials", "classified")

    def __init__(self, ctx: ServerContext, hp: DCPFLHyperparameters):
        super().__init__(ctx, hp)
        n, nl = ctx.num_clients, len(ctx.layers)
        # tau is in local epochs (paper Sec. V); the schedule counts rounds. Derived from the
        # configuration, which a resume checks, so it is not declared state.
        self.tau_rounds = tau_rounds(hp.tau, ctx.train.local_epochs)
        self.names = list(ctx.init_model)
        self.params = ctx.layers.param_names
        self.uploads = StackedStore(n, ctx.stacks)      # each client's latest uploaded weights
        self.group = StackedStore(n, ctx.stacks)        # row i: the current model of i's group
        self.trial0 = StackedStore(n, ctx.stacks)       # M0 / M1 of a pending trial
        self.trial1 = StackedStore(n, ctx.stacks)
        for cid in range(n):
            self.uploads.set_row(cid, ctx.init_model)
            self.group.set_row(cid, ctx.init_model)
        self.disc_sum = torch.zeros(n, n, dtype=torch.float64)
        self.disc_count = torch.zeros(n, n, dtype=torch.float64)
        self.z = torch.zeros(max(n - 1, 0), 4, dtype=torch.float64)
        self.gamma_global = 0.0
        self.built = False
        self.labels = [0] * n
        self.gamma = 1.0
        self.proposal: list[int] = [0] * n
        self.proposal_gamma = 1.0
        self.mode = WARMUP
        self.phase_start = 0                 # round the layer schedule (re)started
        self.retry_at = -1                   # round after which a rejected split is retried
        self.done = False                    # every client is its own group
        self.pending = torch.ones(n, nl, dtype=torch.bool)   # layers to download next round
        self.low = torch.zeros(n, nl, dtype=torch.bool)      # Eq. 6 class of i's group's layers
        self.losses: list[float] = []        # l(t) since the current grouping began
        self.history: list[tuple[int, float, list[int]]] = [(0, 1.0, list(self.labels))]
        self.trials: list[tuple[int, float, float, float, int]] = []
        # every Eq. 5-6 classification: round, each group's clients, layer ratios, low layers
        self.classified: list[dict] = []
        self._metrics: dict[str, float] = {}
        # the layers each client of this round was asked to upload (set by configure)
        self._up: dict[int, list[int]] = {}

    # -- helpers -------------------------------------------------------------------------
    def _layer_names(self, mask: torch.Tensor, full: bool) -> list[str]:
        names = self.ctx.layers.params_of([i for i, m in enumerate(mask.tolist()) if m])
        return names + list(self.ctx.layers.buffers) if full else names

    def _up_names(self, up: list[int]) -> list[str]:
        """What a client uploads for the layer indices ``up``: their parameters, with the
        buffers when it is every layer."""
        mask = torch.zeros(len(self.ctx.layers), dtype=torch.bool)
        mask[list(up)] = True
        return self._layer_names(mask, bool(mask.all()))

    def _members(self, labels: list[int]) -> dict[int, list[int]]:
        groups: dict[int, list[int]] = {}
        for cid, g in enumerate(labels):
            groups.setdefault(g, []).append(cid)
        return groups

    def _aggregate_groups(self, labels: list[int], replies: dict[int, Message],
                          names_of: dict[int, list[str]], target: StackedStore,
                          prefix: str = "") -> None:
        """Sample-weighted average per group of the named tensors, written to every member."""
        for members in self._members(labels).values():
            present = [c for c in members if c in replies]
            names = names_of.get(members[0], [])
            if not present or not names:
                continue
            states = [{n: replies[c].tensors[prefix + n] for n in names} for c in present]
            weights = [cast(int, replies[c].meta["num_samples"]) for c in present]
            if sum(weights) == 0:
                continue
            avg = weighted_average(states, weights)
            for c in members:
                target.set_row(c, avg)

    def _classify(self, labels: list[int], rnd: int) -> None:
        """Eq. 5-6 for every group from the clients' latest weights vs. the group model."""
        hp = self.hp
        names = self.ctx.layers.names
        ratios: list[list[float]] = []
        groups = []
        for members in self._members(labels).values():
            disc = []
            for i in range(len(self.ctx.layers)):
                params = self.ctx.layers.params_of(i)
                w = (torch.cat([self.uploads.tensors[n][c].flatten() for n in params])
                     for c in members)
                g = torch.cat([self.group.tensors[n][members[0]].flatten() for n in params])
                disc.append(layer_discrepancy(w, g))
            low = low_layers(disc, hp.low_ratio, hp.low_reference)
            for c in members:
                self.low[c] = torch.tensor(low)
            ref = reference_discrepancy(disc, hp.low_reference)
            if ref > 0:  # a one-client group equals its group model: no ratio
                ratios.append([d / ref for d in disc])
                groups.append({"clients": members, "ratios": ratios[-1],
                               "low": [n for n, lo in zip(names, low, strict=True) if lo]})
        # how close each layer came to Eq. 6's threshold (D_{g,l} / D_g, the mean over the
        # groups of two or more): a run whose ratios stay above low_ratio saves nothing, and
        # the log shows why
        self._metrics["low_layers_mean"] = float(self.low.sum(dim=1, dtype=torch.float64).mean())
        if ratios:
            self._metrics["layer_disc_ratio_min"] = min(min(r) for r in ratios)
            for i, name in enumerate(names):
                self._metrics[f"disc_ratio.{name}"] = float(np.mean([r[i] for r in ratios]))
        self.classified.append({"round": rnd, "reference": hp.low_reference,
                                "low_ratio": hp.low_ratio, "groups": groups})

    def _layers_low(self) -> int:
        """(group, layer) pairs aggregated at the slow interval alpha*tau; a one-client group
        exchanges nothing and counts none; at alpha = 1 (NoLA) no interval is slower."""
        if self.hp.alpha == 1:
            return 0
        return sum(int(self.low[members[0]].sum()) for members in self._members(self.labels).values()
                   if len(members) > 1)

    def _discrepancy(self, rnd: int | None = None) -> np.ndarray:
        """The matrix the group graph is built from: the warm-up average of each measured
        pair, unmeasured pairs completed (``complete_discrepancy``). With ``rnd`` (the build
        round) the number of completed pairs is logged and warned about."""
        avg = (self.disc_sum / self.disc_count.clamp(min=1)).numpy()
        seen = (self.disc_count > 0).numpy()
        if rnd is not None:
            n = self.ctx.num_clients
            unseen = int((~(seen | seen.T))[np.triu_indices(n, k=1)].sum())
            self._metrics["disc_pairs_imputed"] = float(unseen)
            if unseen:
                warnings.warn(
                    f"dcpfl: {unseen} of {n * (n - 1) // 2} client pairs were never selected "
                    f"together in the {rnd} warm-up rounds (train.participation < 1); their "
                    "discrepancy is completed from the measured pairs (shortest chain, else the "
                    "largest entry), not taken as 0; a longer warm-up (algorithm.t_start) "
                    "measures more pairs", stacklevel=2)
        return complete_discrepancy(avg, seen)

    def _propose(self) -> bool:
        """The next grouping down the graph that actually differs from the current one."""
        n = self.ctx.num_clients
        g = self.gamma
        while g > 0:
            g = max(0.0, g - self.hp.lambda_gamma)
            if g < 1e-9:
                g = 0.0
            labels = cut(self.z.numpy(), self.gamma_global, g, n)
            if labels != self.labels:
                self.proposal, self.proposal_gamma = labels, g
                return True
        self.done = True
        return False

    # -- protocol --------------------------------------------------------------------------
    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        out = {}
        self._up = {}
        sizes = {g: len(m) for g, m in self._members(self.labels).items()}
        for cid in selected:
            if self.mode == TRIAL:
                t0 = {f"m0.{k}": v for k, v in self.trial0.row(cid).items()}
                t1 = {f"m1.{k}": v for k, v in self.trial1.row(cid).items()}
                out[cid] = Message({**t0, **t1}, {"mode": "trial"})
            else:
                down = self.group.row(cid, self._layer_names(self.pending[cid], bool(self.pending[cid].all())))
                if self.mode in (WARMUP, SYNC):
                    up = list(range(len(self.ctx.layers)))
                elif sizes[self.labels[cid]] == 1:
                    up = []  # a one-client group's aggregate is its own model: nothing to send
                else:
                    up = [i for i, d in enumerate(layers_due(rnd, self.phase_start,
                                                             self.low[cid].tolist(),
                                                             self.tau_rounds, self.hp.alpha)) if d]
                out[cid] = Message({k: v.clone() for k, v in down.items()},
                                   {"mode": MODE_NAMES[self.mode], "up": up})
                self._up[cid] = up
        return out

    def check_reply(self, cid: int, reply: Message) -> None:
        who, model = f"client {cid}", self.ctx.init_model
        if self.mode == TRIAL:  # both trained models, both losses
            check_message(who, reply, {f"{t}.{k}": v for t in ("m0", "m1") for k, v in model.items()},
                          {"num_samples": COUNT, "loss0": NONNEGATIVE, "loss1": NONNEGATIVE})
            return
        if cid not in self._up:
            raise MessageError(f"{who} was asked for nothing this round")
        # a group averages the layers its members were asked for: another list breaks it
        up = self._up[cid]
        check_message(who, reply, {n: model[n] for n in self._up_names(up)},
                      {"num_samples": COUNT, "loss": NONNEGATIVE, "up": exactly(up)})

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        hp = self.hp
        n = self.ctx.num_clients
        mode = self.mode
        self._metrics = {"mode": float(mode)}
        # a reply confirms its client got this round's download; a client that failed
        # gets its pending layers the next time it is selected
        for cid in replies:
            self.pending[cid] = False
        if mode == TRIAL:
            self._finish_trial(rnd, replies)
            self._after(rnd)
            return
        ups = {cid: cast(list[int], r.meta["up"]) for cid, r in replies.items()}  # check_reply
        for cid, reply in replies.items():
            self.uploads.set_row(cid, reply.tensors)
        names_of = {cid: self._up_names(up) for cid, up in ups.items()}
        for cid in range(n):  # a group's members share one schedule; fill the absent ones
            if cid not in names_of:
                names_of[cid] = []
        for members in self._members(self.labels).values():
            lead = next((c for c in members if names_of[c]), members[0])
            for c in members:
                names_of[c] = names_of[lead]
        self._aggregate_groups(self.labels, replies, names_of, self.group)
        for cid in range(n):
            if names_of[cid]:
                self.pending[cid] |= torch.tensor(
                    [all(p in names_of[cid] for p in self.ctx.layers.params_of(i))
                     for i in range(len(self.ctx.layers))])
        if replies:
            self.losses.append(float(np.mean([float(cast(float, r.meta["loss"]))
                                              for r in replies.values()])))
            # l(t) of Eq. 4, the curve whose bends end the rapid-decrease periods
            self._metrics["rdp_loss"] = self.losses[-1]
        self._metrics["layers_up_mean"] = float(np.mean([len(u) for u in ups.values()])) if ups else 0.0

        if mode == WARMUP:
            self._warm_up(rnd, replies)
        elif mode == SYNC:
            self._open_trial(replies)
            return
        elif mode == NORMAL and (rnd - self.phase_start) % (hp.alpha * self.tau_rounds) == 0:
            self._classify(self.labels, rnd)  # every layer was just synchronised: Eq. 6 anew
        self._after(rnd)

    def _warm_up(self, rnd: int, replies: dict[int, Message]) -> None:
        """Warm-up: accumulate the replying clients' pairwise discrepancies; at t_start,
        build the grouping graph over them and cut it at gamma = 1 (or the fixed gamma)."""
        hp, n = self.hp, self.ctx.num_clients
        cids = sorted(replies)
        if len(cids) >= 2:
            d = discrepancy_of([[replies[c].tensors[k] for k in self.params] for c in cids])
            idx = torch.tensor(cids)
            self.disc_sum[idx.unsqueeze(1), idx] += d
            self.disc_count[idx.unsqueeze(1), idx] += 1
        if rnd >= hp.t_start:
            z, self.gamma_global = group_graph(self._discrepancy(rnd))
            self.z = torch.from_numpy(z).to(torch.float64)
            self.built = True
            fixed = hp.fixed_gamma is not None
            self.gamma = hp.fixed_gamma if fixed else 1.0
            self.labels = cut(z, self.gamma_global, self.gamma, n)
            if fixed:
                self.done = True  # NoDC: this grouping is final
                self.history.append((rnd, self.gamma, list(self.labels)))
            self.phase_start = rnd
            self._classify(self.labels, rnd)
            self.mode = NORMAL

    def _open_trial(self, replies: dict[int, Message]) -> None:
        """A sync round's fresh full weights: the old (M0) and proposed (M1) group models
        of the split trial."""
        n = self.ctx.num_clients
        full = {c: list(self.names) for c in range(n)}
        # a group with no member in this round has no fresh model: its members compare
        # their current group model (not a missing or an earlier trial's one)
        for c in range(n):
            current = self.group.row(c)
            self.trial0.set_row(c, current)
            self.trial1.set_row(c, current)
        self._aggregate_groups(self.labels, replies, full, self.trial0)
        self._aggregate_groups(self.proposal, replies, full, self.trial1)
        self.mode = TRIAL

    def _after(self, rnd: int) -> None:
        """Decide whether the next round is a sync round opening a split trial."""
        if not self.built or self.done or self.mode != NORMAL:
            return
        if self.retry_at >= 0:
            if rnd >= self.retry_at:
                self.retry_at = -1
                self.mode = SYNC
            return
        if rdp_ended(self.losses, self.hp.s, self.hp.t_obv) and self._propose():
            self.mode = SYNC

    def _finish_trial(self, rnd: int, replies: dict[int, Message]) -> None:
        l0 = (float(np.mean([float(cast(float, r.meta["loss0"])) for r in replies.values()]))
              if replies else 0.0)
        l1 = (float(np.mean([float(cast(float, r.meta["loss1"])) for r in replies.values()]))
              if replies else 0.0)
        accept = l0 > l1  # the paper's rule: evolve only if the mean loss decreases
        self.trials.append((rnd, self.proposal_gamma, l0, l1, int(accept)))
        prefix = "m1." if accept else "m0."
        for cid, reply in replies.items():
            self.uploads.set_row(cid, {k[3:]: v for k, v in reply.tensors.items()
                                       if k.startswith(prefix)})
        if accept:
            self.labels, self.gamma = list(self.proposal), self.proposal_gamma
            self.history.append((rnd, self.gamma, list(self.labels)))
            self.losses = []
        else:
            self.retry_at = rnd + self.hp.t_sp
        full = {c: list(self.names) for c in range(self.ctx.num_clients)}
        self._aggregate_groups(self.labels, replies, full, self.group, prefix)
        self.pending[:] = True
        self.phase_start = rnd
        self._classify(self.labels, rnd)
        self.mode = NORMAL
        if accept and len(set(self.labels)) == self.ctx.num_clients:
            self.done = True
        self._metrics["trial_accepted"] = float(accept)

    def eval_message(self, cid: int) -> Message | None:
        if self.hp.evaluate == "local":
            return None  # the client's own trained weights, as its state holds them
        # what the client will hold once it receives the layers aggregated this round
        return Message(self.group.row(cid, self._layer_names(self.pending[cid],
                                                              bool(self.pending[cid].all()))))

    def summary_figures(self, metrics: list[dict]) -> dict:
        """The mean accuracy over the last aggregation period (tau local epochs): between
        aggregations clients predict with their local models, in aggregation rounds with the
        group's, so the final round alone depends on where in the rhythm a run stops."""
        rows = [r for r in metrics if not math.isnan(r["acc_mean"])][-max(1, self.tau_rounds):]
        if not rows:
            return {}
        return {"acc_mean_last_period": float(np.mean([r["acc_mean"] for r in rows])),
                "last_period_rounds": [rows[0]["round"], rows[-1]["round"]]}

    def round_metrics(self) -> dict[str, float]:
        return {"groups": float(len(set(self.labels))), "gamma_tilde": self.gamma,
                "layers_low": float(self._layers_low()) if self.built else 0.0, **self._metrics}

    # -- artifacts ---------------------------------------------------------------------------
    def write_artifacts(self, out_dir: Path, plots: bool) -> None:
        from edgepfl.io import write_json

        write_json(Path(out_dir) / "dcpfl_groups.json", {
            "gamma_global": self.gamma_global,
            # what the group graph was built from; pair_rounds = 0 marks a completed pair
            "discrepancy": self._discrepancy().tolist(),
            "pair_rounds": self.disc_count.to(torch.int64).tolist(),
            "linkage": self.z.tolist(),
            "groupings": [{"round": r, "gamma_tilde": g, "labels": lab} for r, g, lab in self.history],
            "trials": [{"round": int(t[0]), "gamma_tilde": t[1], "loss_old": t[2], "loss_new": t[3],
                        "accepted": bool(t[4])} for t in self.trials],
            "classifications": self.classified,
            "purity": group_purity(self.history, Path(out_dir) / "partition.json"),
        })
        if plots and self.built and self.ctx.num_clients >= 2:
            plot_group_graph(self.z.numpy(), self.gamma_global,
                             [g for _, g, _ in self.history], Path(out_dir) / "dcpfl_group_graph.png")


# -- client ---------------------------------------------------------------------------------
class DCPFLClient(PersonalModelClient):
    # a trial round trains two models (no fit request: its update runs whole); every other
    # round is the plain fit
    batchable = True

    def _loss(self, state: State, data: ClientData) -> float:
        if data.n == 0:
            return 0.0
        return sum(self.trainer.evaluate(state, x, y)[1] for x, y in data.buckets()) / data.n

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest | None:
        """Local SGD from the group's layers over the client's own (None for a trial round,
        which trains two models: ``update`` runs it whole)."""
        if msg.meta.get("mode") == "trial":
            return None
        msg.require("up")
        return sgd_request(self, self._held(msg, state), data, gen)

    def update(self, cid: int, msg: Message, state: State, data: ClientData,
               gen: torch.Generator) -> UpdateResult:
        if msg.meta.get("mode") == "trial":
            return self._trial(msg, data, gen)
        return self.run_update(cid, msg, state, data, gen)

    def _held(self, msg: Message, state: State) -> State:
        """The model the client starts from: the received layers over its own."""
        return {**self.personal_model(state, None), **msg.tensors}

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               weights: State, stats: dict[str, float]) -> UpdateResult:
        # l_i(t): the received model before local SGD (Sec. III-C); evaluating it after the
        # training gives the same figure (neither draws randomness nor changes it)
        loss = self._loss(self._held(msg, state), data)
        up = [int(i) for i in msg.meta["up"]]  # type: ignore[union-attr]
        names = self.ctx.layers.params_of(up)
        if len(up) == len(self.ctx.layers):
            names = names + list(self.ctx.layers.buffers)
        reply = Message({n: weights[n] for n in names},
                        {"num_samples": data.n, "loss": loss, "up": up})
        return UpdateResult(reply, model_to_state(weights), stats)

    def _trial(self, msg: Message, data: ClientData, gen: torch.Generator) -> UpdateResult:
        """Train from both the old (M0) and the proposed (M1) group model on the same batch
        order, report both training losses and upload both results; the server keeps one."""
        start = gen.get_state()
        out, losses, stats = {}, {}, {}
        for tag in ("m0", "m1"):
            model = {k[3:]: v for k, v in msg.tensors.items() if k.startswith(tag + ".")}
            gen.set_state(start)
            self.trainer.load(model)
            st = fit(self, data, gen)
            trained = self.trainer.export()
            losses[tag] = self._loss(trained, data)
            out.update({f"{tag}.{k}": v for k, v in trained.items()})
            if tag == "m0":
                stats = st
        reply = Message(out, {"num_samples": data.n, "loss0": losses["m0"], "loss1": losses["m1"]})
        # the next round's download carries the chosen group model in full, so what the
        # client keeps here is overwritten before it is used to train
        keep = {f"model.{k[3:]}": v for k, v in out.items() if k.startswith("m0.")}
        return UpdateResult(reply, keep, stats)

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        model = model_from_state(state)
        if eval_msg is not None:
            model.update(eval_msg.tensors)
        return model


ALGORITHM = Algorithm(
    name="dcpfl",
    summary="DC-PFL: dynamic hierarchical clustering by model discrepancy, split at the end of "
            "rapid loss-decrease periods, layer-wise aggregation intervals",
    hyperparameters=DCPFLHyperparameters,
    server=DCPFLServer,
    client=DCPFLClient,
    paper="Liu, Huang, He, Cao, Dynamic Clustering for Personalized Federated Learning on "
          "Heterogeneous Edge Devices (DC-PFL)",
    privacy=PrivacySupport(
        refused="client level: its server measures discrepancies between individual client "
        "models; sample level: each client sends the received model's loss on its training data, "
        "un-noised"),
    no_new_clients="its server aggregates each client's layers within that client's groups: "
                   "a stranger belongs to none",
)
