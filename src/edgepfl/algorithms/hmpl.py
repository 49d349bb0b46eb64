"""HMPL (Zhang et al., "Device-Performance-Driven Heterogeneous Multiparty Learning for
Arbitrary Images", IEEE TNNLS 2023) and HMPL_S, its reduced form (Sec. IV-C).

HMPL (Sec. III):

* **Round 1** (Sec. III-C): every client trains the Ord model, which ends in an SPP layer
  (Sec. III-D), so images of any size and aspect ratio pass. The server ranks the clients
  by their time (``rank_by``: the device's training time, or the whole round's with the
  links) and splits them by two time thresholds, 3:4:3 by default
  (``tier_ratio``): the slowest become Com (told to *shrink*: conv3 removed, a 1x1 IP
  convolution aligns conv2's channels), the middle stay Ord (*keep*), the fastest become
  Sup (told to *grow*: an FPN top-down stage with a 1x1 IP lateral and a 3x3 CP
  convolution). A client that did not reply in round 1 gets its tier from the two
  thresholds when its first time is observed. A client keeps its tier.
* **Generation** (``generation``): the layers a tier adds start from the Ord model, so
  that a new Com or Sup model computes what it did as nearly as its shape allows
  (``models.hmpl.preserving_start``), or from one random draw per tier, or per client.
* **Growth** (Sec. III-C2): a Sup model gains one top-down stage towards the earlier
  layers (``ip_lateral2``, then ``ip_lateral1``) after each round whose time stays under
  the upper time threshold, up to ``sup_max_depth``; once its time exceeds it, it stops,
  back at the stage before, whose time was within it (``growth_revert``; stage 1 at least).
* **Aggregation** (Sec. III-E): each BS layer is averaged over the clients whose model
  holds it (Com models lack conv3) with the server step eta, Eq. 5-6; the CP layer is
  averaged over the Sup models only, Eq. 7-8; IP layers never leave their client.
* **Personal model**: the client's current tier model, made of the server's BS and CP
  layers and its own IP layers. The Ord model of the server's BS layers is reported
  beside it (``acc_global_*``), as Figs. 6-7 report the aggregated model.

HMPL_S is "only the heterogeneous feature-map integration" (Sec. IV-C): every client
trains the Ord model with SPP and the server averages it as FedAvg does (Eq. 3).

The engine evaluates every client on one architecture, built before round 1; a client's
tier is only known after it. So ``hmpl`` runs on ``model.name = 'hmpl_tiers'``, every
tier in one module whose ``stage`` buffer picks the one that runs
(``models/hmpl_tiers.py``); clients train on their own tier's model (``hmpl_com``,
``hmpl_ord``, ``hmpl_sup``, ``hmpl_sup2``, one skeleton each, built on first use).
docs/algorithms.md ("hmpl / hmpl_s") lists the choices where the paper is silent.
"""

from __future__ import annotations

import logging
import math
from typing import Any, ClassVar, Literal, cast

import torch
from pydantic import Field, field_validator

from edgepfl.algorithms.hmpl_report import BYTE_COLUMNS, TierReports, tier_costs
from edgepfl.contract.algorithm import (
    Algorithm,
    Client,
    ClientContext,
    Hyperparameters,
    PrivacySupport,
    RoundView,
    Server,
    ServerContext,
    State,
    UpdateResult,
)
from edgepfl.contract.kit import num_samples
from edgepfl.data.aspect import shape_groups
from edgepfl.errors import ConfigError
from edgepfl.federation.aggregate import weighted_average
from edgepfl.federation.messages import COUNT, Message, MessageError, check_entries, check_message
from edgepfl.federation.rng import derive_seed
from edgepfl.models.hmpl_nets import SUP_MAX_DEPTH, fitted_align, layer_role, preserving_start
from edgepfl.models.hmpl_tiers import (
    COM,
    ORD,
    STAGE,
    STAGES,
    check_stage,
    tier_module,
    tier_name,
    tier_params,
)
from edgepfl.training.client_data import ClientData
from edgepfl.training.sgd import FitRequest
from edgepfl.training.trainer import Trainer

log = logging.getLogger("edgepfl")

PAPER = ("Zhang, Gong, Gao, Qin, Wang, Lin and Wang, Device-Performance-Driven Heterogeneous "
         "Multiparty Learning for Arbitrary Images, IEEE TNNLS 2023")

# the server's instruction, in a training message's metadata: the tier the client must
# hold ("com" or "sup") and a Sup model's depth; a message without it says "keep the Ord
# model", so that an Ord round costs what FedAvg's does
TIER, DEPTH = "tier", "depth"
NUM_SAMPLES = "num_samples"
UNION = "hmpl_tiers"  # the model hmpl runs on
# what a Com model's aligner is derived from under generation = "preserve" (and fitted to
# under com_align = "fit")
ALIGN_SOURCE = ("conv3.weight", "conv3.bias")


def align_batches(data: ClientData, count: int) -> list[torch.Tensor]:
    """The client's first ``count`` training images, one batch per input shape."""
    pos = torch.arange(min(count, data.n))
    if data.boxes is None:
        return [data.select(pos)[0]]
    return [data.select(pos[group])[0] for group in shape_groups(data.boxes[pos])]


FIRST_ROUND: Any = Field(
    "all", description="who trains round 1, whose times rank the clients into tiers (Sec. "
    "III-C): all = every client, whatever train.participation, so the tiers are exactly "
    "tier_ratio of all clients; sampled = round 1's seeded sample, later clients tiered by "
    "its time thresholds when first timed (shares then drift from tier_ratio)")


class HMPLHyperparameters(Hyperparameters):
    # what runs stored before each setting existed did
    before: ClassVar[dict[str, Any]] = {"first_round": "sampled", "generation": "random",
                                        "rank_by": "round", "com_align": "kept",
                                        "growth_revert": False}
    first_round: Literal["all", "sampled"] = FIRST_ROUND
    generation: Literal["preserve", "shared", "random"] = Field(
        "preserve", description="how the layers a tier adds to the Ord model (Com's "
        "ip_align, Sup's laterals and CP layer) start: preserve = so the new model "
        "computes what the Ord model did, as nearly as its shape allows (Sec. III-D); "
        "shared = one random draw per tier; random = one per client. Under com_align = fit "
        "it decides the Sup layers only")
    com_align: Literal["kept", "fit"] = Field(
        "fit", description="a Com client's ip_align: kept = its own from generation on, "
        "trained only in its rounds; fit = at the start of each of its rounds refitted by "
        "least squares on align_images of its images to the server's conv3 (sent with the "
        "Com model, about 1.2 MB), then trained; never sent (this project's reading of "
        "Sec. III-C1)")
    align_images: int = Field(
        64, ge=1, description="com_align = fit: how many of the client's training images "
        "(the first, in its own order) the aligner is fitted on")
    rank_by: Literal["compute", "round"] = Field(
        "compute", description="the time that ranks the clients into tiers and decides Sup "
        "growth: compute = the device's local training time of the round (simulation: the "
        "system model's compute time; Flower: measured), as Table III's device classes; "
        "round = download + compute + upload")
    tier_ratio: list[float] = Field(
        [0.3, 0.4, 0.3], min_length=3, max_length=3,
        description="shares of the clients, ranked by round-1 time, that become Com "
        "(slowest), Ord and Sup (fastest); Sec. III-C: 3:4:3")
    eta: float = Field(
        1.0, gt=0, description="server step of Eqs. 6 and 8: W <- W + eta * (holders' "
        "sample-weighted mean - W); the paper gives it no value, 1 is the plain mean")
    sup_max_depth: int = Field(
        SUP_MAX_DEPTH, ge=1, le=SUP_MAX_DEPTH,
        description=f"top-down stages a Sup model may grow to (1: no growth; {SUP_MAX_DEPTH}: "
        "every pair of neighbouring convolutions, Sec. III-C2)")
    growth_bound: Literal["upper", "lower"] = Field(
        "upper", description="the time threshold a Sup model grows under (Sec. III-C2): "
        "upper = the Ord/Com one (the paper's 'upper time threshold'), lower = the Sup/Ord one")
    growth_revert: bool = Field(
        True, description="when a Sup model's time at a stage exceeds the growth bound: "
        "true = it goes back to the stage before and stays (keeping the shared layers it "
        "trained, dropping that stage's lateral), so its model is within the bound (Sec. "
        "III-C2; at stage 1 it stays); false = it stops growing at the stage that broke "
        "the bound")

    @field_validator("tier_ratio")
    @classmethod
    def _ratio(cls, ratio: list[float]) -> list[float]:
        if any(r < 0 for r in ratio) or abs(sum(ratio) - 1) > 1e-9:
            raise ValueError(f"{ratio} is not three shares (Com, Ord, Sup), each >= 0, that sum "
                             "to 1; the paper's is [0.3, 0.4, 0.3]")
        return ratio


class HMPLSHyperparameters(Hyperparameters):
    """FedAvg on the Ord model; round 1 as HMPL's, so that HMPL with every client Ord is
    HMPL_S (``first_round = 'sampled'`` is FedAvg's round 1)."""

    before: ClassVar[dict[str, Any]] = {"first_round": "sampled"}
    first_round: Literal["all", "sampled"] = Field(
        "all", description="who trains round 1: all = every client, as in HMPL's ranking "
        "round, so that hmpl with every client Ord is hmpl_s; sampled = round 1's seeded "
        "sample, FedAvg's round 1")


# -- the tier models ----------------------------------------------------------------------
def shared_names(stage: int, dims: tuple[int, int]) -> list[str]:
    """What a client of ``stage`` receives and sends back: its BS and CP layers."""
    return [n for n in tier_params(stage, dims) if layer_role(n) != "ip"]


def ip_names(stage: int, dims: tuple[int, int]) -> list[str]:
    return [n for n in tier_params(stage, dims) if layer_role(n) == "ip"]


def model_kind(algorithm: str, arch: str, model: dict[str, torch.Tensor],
               allowed: tuple[str, ...]) -> tuple[str, tuple[int, int]]:
    """Which of ``allowed`` (``hmpl_tiers``, ``hmpl_ord``) the engine's model is, and its
    (input channels, classes); a ConfigError naming the model to set otherwise."""
    conv, head = model.get("conv1.weight"), model.get("fc3.weight")
    if conv is not None and head is not None and conv.dim() == 4 and head.dim() == 2:
        dims = (int(conv.shape[1]), int(head.shape[0]))
        names = set(model)
        union = {n for s in STAGES for n in tier_params(s, dims)}
        kinds = {UNION: union, "hmpl_ord": set(tier_params(ORD, dims))}
        for kind in allowed:
            if names == kinds[kind]:
                return kind, dims
    why = ("every HMPL tier in one module: a client's tier is decided from its round time "
           "during the run, and the engine evaluates each client on one architecture")
    if allowed == ("hmpl_ord", UNION):
        why = "HMPL_S is FedAvg on HMPL's Ord model"
    raise ConfigError(f"algorithm.name = {algorithm!r} runs on model.name = "
                      f"{' or '.join(repr(a) for a in allowed)} ({why}); got {arch or 'another'!r}")


def message_stage(msg: Message) -> int:
    """The tier model a training message tells the client to hold."""
    unknown = sorted(set(msg.meta) - {TIER, DEPTH})
    if unknown:
        raise MessageError(f"hmpl: the server sent unknown metadata {unknown}")
    tier = msg.meta.get(TIER, "ord")
    if tier in ("com", "ord") and DEPTH not in msg.meta:
        return COM if tier == "com" else ORD
    depth = msg.meta.get(DEPTH)
    if tier == "sup" and isinstance(depth, int) and not isinstance(depth, bool) \
            and 1 <= depth <= SUP_MAX_DEPTH:
        return depth
    raise MessageError(f"hmpl: the server's instruction {msg.meta} is none of: nothing (keep "
                       f"the Ord model), {{tier: com}}, {{tier: sup, depth: 1..{SUP_MAX_DEPTH}}}")


def instruction(stage: int) -> dict[str, Any]:
    if stage == COM:
        return {TIER: "com"}
    if stage == ORD:
        return {}
    return {TIER: "sup", DEPTH: stage}


def client_stage(state: State) -> int:
    value = state.get(STAGE)
    if value is None:
        return ORD
    try:
        return check_stage(int(value))
    except ValueError as exc:
        raise MessageError(f"hmpl: the client's state: {exc}") from None


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5 + 1e-9)


# -- the server ----------------------------------------------------------------------------
class HMPLServer(Server, TierReports):
    """The shared layers (BS and CP), every client's tier and the time thresholds."""

    state: ClassVar[tuple[str, ...]] = ("shared", "tiers", "depths", "stopped", "times",
                                        "thresholds")
    reduced: ClassVar[bool] = False  # HMPL_S: every client Ord, FedAvg's mean

    def __init__(self, ctx: ServerContext, hp: HMPLHyperparameters | HMPLSHyperparameters):
        super().__init__(ctx, hp)
        name = "hmpl_s" if self.reduced else "hmpl"
        allowed = ("hmpl_ord", UNION) if self.reduced else (UNION,)
        arch = next(iter(ctx.architectures), "")
        params = {p: ctx.init_model[p] for p in ctx.layers.param_names}
        self.kind, self.dims = model_kind(name, arch, params, allowed)
        roles = ("bs",) if self.reduced else ("bs", "cp")
        self.shared: State = {p: v.clone() for p, v in params.items() if layer_role(p) in roles}
        n = ctx.num_clients
        full = None if self.reduced else cast(HMPLHyperparameters, hp)
        self.preserve = full is not None and full.generation == "preserve"
        if self.preserve:
            # no client trains the CP layer before a Sup model exists, so setting it here
            # is setting it at every Sup model's generation from the Ord model
            self.shared.update(preserving_start("cp_merge", self.shared))
        # per run, what its settings keep: only preserve keeps aligned, so runs of the other
        # modes resume as they were saved
        self.state = (*self.state, *(("aligned",) if self.preserve else ()),  # type: ignore[misc]
                      *(() if self.reduced else ("sup_times",)))
        # a Com client whose reply on the Com model has arrived: it holds its aligner, so
        # conv3 (what the aligner is derived from) no longer goes with its model
        self.aligned = [False] * n
        # com_align = fit: every Com round carries conv3, what the aligner is fitted to
        self.refit = full is not None and full.com_align == "fit"
        # None: not ranked yet (the client trains the Ord model)
        self.tiers: list[str | None] = ["ord" if self.reduced else None] * n
        self.depths = [0] * n  # a Sup client's depth: the one it is told next
        self.stopped = [False] * n  # a Sup client whose time passed the growth bound
        # a Sup client's latest time (ranking measure) at each stage 1..SUP_MAX_DEPTH it
        # trained, None where it never did: what the stage it keeps is reported with
        self.sup_times: list[list[float | None]] = [[None] * SUP_MAX_DEPTH for _ in range(n)]
        self.times: list[float | None] = [None] * n  # the round time a tier was given by
        # "lower" (Sup/Ord) and "upper" (Ord/Com) time thresholds, once ranked
        self.thresholds: dict[str, float] | None = None
        # this round's own figures: who was told which stage, bytes per tier
        self._sent: dict[int, int] = {}
        self._bytes = dict.fromkeys(BYTE_COLUMNS, 0)
        self._costs: dict[str, float] = {}
        self._trained_depth = 0  # the deepest Sup stage a reply this round was trained on
        self._warned = False

    def stage_of(self, cid: int) -> int:
        tier = self.tiers[cid]
        return COM if tier == "com" else self.depths[cid] if tier == "sup" else ORD

    def model_for(self, stage: int) -> State:
        return {n: self.shared[n] for n in shared_names(stage, self.dims)}

    # -- one round ------------------------------------------------------------------------
    def configure(self, rnd: int, selected: list[int]) -> dict[int, Message]:
        if rnd == 1 and self.hp.first_round == "all":  # every client is timed, to rank all
            fed = self.ctx.federation
            selected = fed.trained if fed is not None else list(range(self.ctx.num_clients))
        if rnd > 1 and self.thresholds is None and not self.reduced and not self._warned:
            self._warned = True
            log.warning("hmpl: no client's round time has been observed yet, so every client "
                        "still trains the Ord model (the simulation times rounds with "
                        "system.count_flops = true)")
        self._sent, self._bytes, self._costs = {}, dict.fromkeys(BYTE_COLUMNS, 0), {}
        self._trained_depth = 0
        by_stage: dict[tuple[int, bool], Message] = {}
        out = {}
        for cid in selected:
            stage = self.stage_of(cid)
            # resent until a reply on the Com model arrives: a client whose reply was lost
            # may not have shrunk yet
            generating = stage == COM and (self.refit or (self.preserve and not self.aligned[cid]))
            if (stage, generating) not in by_stage:
                tensors = self.model_for(stage)
                if generating:
                    tensors = {**tensors, **{n: self.shared[n] for n in ALIGN_SOURCE}}
                by_stage[stage, generating] = Message(tensors, instruction(stage))
            out[cid] = by_stage[stage, generating]
            self._sent[cid] = stage
        return out

    def check_reply(self, cid: int, reply: Message) -> None:
        # exactly the shared layers of the model the client was told to hold: an IP layer
        # (or anything else) in an upload is refused
        stage = self._sent.get(cid, self.stage_of(cid))
        check_message(f"client {cid} ({tier_name(stage)})", reply, self.model_for(stage),
                      {NUM_SAMPLES: COUNT})

    def aggregate(self, rnd: int, replies: dict[int, Message]) -> None:
        weights = {cid: num_samples(cid, reply) for cid, reply in replies.items()}
        for cid in replies:
            stage = self._sent.get(cid, self.stage_of(cid))
            if stage == COM:
                self.aligned[cid] = True
            self._trained_depth = max(self._trained_depth, stage)
        # Eqs. 5-8: each layer over the replies that hold it (a Com model has no conv3, only
        # Sup models a CP layer); layers of one holder set are averaged together
        groups: dict[tuple[int, ...], list[str]] = {}
        for name in self.shared:
            holders = tuple(c for c, reply in replies.items() if name in reply.tensors)
            if sum(weights[c] for c in holders) > 0:  # else it keeps its value
                groups.setdefault(holders, []).append(name)
        eta = 1.0 if self.reduced else self.hp.eta
        shared = dict(self.shared)
        for holders, names in groups.items():
            mean = weighted_average([{n: replies[c].tensors[n] for n in names} for c in holders],
                                    [weights[c] for c in holders])
            for n in names:
                # eta = 1 is the mean itself, bit for bit FedAvg's (Eq. 3)
                shared[n] = mean[n] if eta == 1.0 else self.shared[n] + eta * (mean[n] - self.shared[n])
        self.shared = shared

    def observe(self, record: RoundView) -> None:
        # each tier's share of the links' bytes, by the model each client was sent
        for direction, sent in (("down", record.bytes_down), ("up", record.bytes_up)):
            for cid, nbytes in sent.items():
                stage = self._sent.get(cid, self.stage_of(cid))
                self._bytes[f"bytes_{direction}_{tier_name(stage)}"] += nbytes
        timing = record.timing()
        if timing is not None and timing.times:
            self.observe_times(record.round, timing.times, timing.flops, compute=timing.compute)

    def observe_times(self, rnd: int, times: dict[int, float],
                      flops: dict[int, int] | None = None,
                      compute: dict[int, float] | None = None) -> None:
        if self.reduced:
            return
        # the ranking measure; without a compute time of its own (a caller that gives one
        # time), the round time is all there is
        measure = compute if self.hp.rank_by == "compute" and compute is not None else times
        if self.thresholds is None:
            self._rank(measure)
        else:
            for cid in sorted(measure):
                if self.tiers[cid] is None:  # no reply in the ranking round: its first time
                    self._assign(cid, self._classify(measure[cid]), measure[cid])
        # per-tier costs stay round times, whatever ranks the tiers
        self._costs = tier_costs(times, flops, self.tiers, self._sent)
        self._grow(measure)

    def _assign(self, cid: int, tier: str, time: float) -> None:
        self.tiers[cid], self.times[cid] = tier, time
        self.depths[cid] = 1 if tier == "sup" else 0

    def _rank(self, times: dict[int, float]) -> None:
        """Sec. III-C: fastest ``sup`` share Sup, slowest ``com`` share Com (ties by id);
        the thresholds lie halfway between the neighbouring clients of two tiers."""
        order = sorted(times, key=lambda c: (times[c], c))
        n = len(order)
        _, ordinary, sup = self.hp.tier_ratio  # Com: the rest, the slowest
        b1 = min(n, _round_half_up(sup * n))
        b2 = max(b1, min(n, _round_half_up((sup + ordinary) * n)))
        for i, cid in enumerate(order):
            self._assign(cid, "sup" if i < b1 else "ord" if i < b2 else "com", times[cid])

        def between(i: int) -> float:
            if i <= 0:
                return -math.inf
            if i >= n:
                return math.inf
            return (times[order[i - 1]] + times[order[i]]) / 2

        self.thresholds = {"lower": between(b1), "upper": between(b2)}

    def _classify(self, time: float) -> str:
        assert self.thresholds is not None
        if time <= self.thresholds["lower"]:
            return "sup"
        return "com" if time > self.thresholds["upper"] else "ord"

    def bound(self) -> float:
        """The growth bound (``growth_bound``'s threshold), in the ranking measure."""
        assert self.thresholds is not None
        return self.thresholds[self.hp.growth_bound]

    def _grow(self, times: dict[int, float]) -> None:
        """Sec. III-C2: a Sup model whose round time stays under the bound grows one stage;
        the first time it is past it, it stops for good, under ``growth_revert`` back at the
        stage before (whose time was within the bound: it grew from there), never below
        stage 1."""
        bound = self.bound()
        for cid in sorted(times):
            stage = self._sent.get(cid, ORD)
            if self.tiers[cid] != "sup" or stage < 1 or stage != self.depths[cid]:
                continue  # timed on another model than its current Sup model
            self.sup_times[cid][stage - 1] = times[cid]
            if times[cid] > bound:
                if self.hp.growth_revert and not self.stopped[cid] and stage > 1:
                    self.depths[cid] = stage - 1
                self.stopped[cid] = True
            elif not self.stopped[cid] and stage < self.hp.sup_max_depth:
                self.depths[cid] = stage + 1

    def kept(self, cid: int) -> tuple[int | None, float | None]:
        """A Sup client's kept stage and its latest time there: the deepest stage it was
        timed at, up to the one it is told to hold (a client that grew after its last
        round holds the stage before); (None, None) when it never trained a Sup model."""
        timed = [d for d in range(1, self.depths[cid] + 1) if self.sup_times[cid][d - 1] is not None]
        if self.tiers[cid] != "sup" or not timed:
            return None, None
        return timed[-1], self.sup_times[cid][timed[-1] - 1]

    def load_state(self, tensors: State, meta: dict[str, Any] | None = None) -> None:
        meta = dict(meta or {})
        if "sup_times" in self.state and "sup_times" not in meta:
            # a checkpoint from before the stages' times were kept: unknown until retimed
            meta["sup_times"] = [[None] * SUP_MAX_DEPTH for _ in self.tiers]
        super().load_state(tensors, meta)

    # -- evaluation and figures -----------------------------------------------------------
    def eval_message(self, cid: int) -> Message | None:
        # every shared layer: the client takes its tier's, and the Ord model of the BS
        # layers is the global prediction (evaluation is not counted)
        return Message(self.shared)

class HMPLSServer(HMPLServer):
    reduced = True


# -- the client ----------------------------------------------------------------------------
class HMPLClient(Client):
    """Serves clients of every tier: one skeleton per tier model, built on first use. Its
    state: ``stage`` (-1 Com, 0 Ord, k Sup at depth k) and its IP layers by name."""

    reduced: ClassVar[bool] = False
    batchable: ClassVar[bool] = True

    def __init__(self, ctx: ClientContext, hp: HMPLHyperparameters | HMPLSHyperparameters):
        super().__init__(ctx, hp)
        name = "hmpl_s" if self.reduced else "hmpl"
        allowed = ("hmpl_ord", UNION) if self.reduced else (UNION,)
        params = {n: p.detach() for n, p in ctx.trainer.params.items()}
        self.kind, self.dims = model_kind(name, ctx.arch, params, allowed)
        # the engine's skeleton entries a tier may lack, for evaluating it there
        common = set.intersection(*(set(tier_params(s, self.dims)) for s in STAGES))
        self._zeros = {n: torch.zeros(p.shape, dtype=p.dtype) for n, p in params.items()
                       if n not in common}
        self._trainers: dict[int, Trainer] = {}

    def init_state(self, cid: int, init_model: State) -> State:
        return {STAGE: torch.tensor(ORD)}

    def trainer_at(self, stage: int) -> Trainer:
        if stage not in self._trainers:
            with torch.device("meta"):  # its weights are loaded before every use
                model = tier_module(stage, *self.dims)
            device = self.trainer.device
            self._trainers[stage] = Trainer(model.to_empty(device=device),
                                            self.trainer.eval_batch_size,
                                            self.trainer.channels_last, device,
                                            compile=self.trainer.compile)
        return self._trainers[stage]

    def new_layer(self, stage: int, layer: str, cid: int,
                  ordinary: State | None = None) -> State:
        """An IP layer the client adds (shrinking or growing). preserve: derived from the
        Ord model's layers in ``ordinary`` (``preserving_start``); shared and random: drawn
        from a seed of the tier's layer (shared) or also of the client (random), so that
        neither when nor in which process it grows changes it."""
        mode = self.hp.generation
        if mode == "preserve":
            return preserving_start(layer, ordinary or {})
        with torch.device("meta"):
            module = tier_module(stage, *self.dims).get_submodule(layer)
        module.to_empty(device="cpu")
        who = (cid,) if mode == "random" else ()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.ctx.seed, "hmpl", "ip", *who, layer))
            module.reset_parameters()
        return {f"{layer}.{n}": p.detach() for n, p in module.named_parameters()}

    def fit_request(self, cid: int, msg: Message, state: State, data: ClientData,
                    gen: torch.Generator) -> FitRequest:
        """The tier model the server asks for (grown or shrunk to it, its added layers
        started as ``generation`` says, Com's aligner refitted under ``com_align = fit``),
        trained on that tier's skeleton: requests of one tier batch together."""
        current, target = client_stage(state), message_stage(msg)
        if self.reduced and target != ORD:
            raise MessageError(f"hmpl_s: every client holds the Ord model; the server sent "
                               f"{msg.meta}")
        grows = current == ORD or (current >= 1 and target >= current)
        if target != current and not grows and not self.reverts(current, target):
            raise MessageError(f"hmpl: a client holding the {tier_name(current)} model "
                               f"(stage {current}) cannot turn into stage {target}: Com and Sup "
                               "are kept, and a Sup model only grows (under "
                               "algorithm.growth_revert, or goes back one Sup stage)")
        trainer = self.trainer_at(target)
        shared = shared_names(target, self.dims)
        expected = {n: trainer.params[n] for n in shared}
        source = {}
        refit = target == COM and not self.reduced and self.hp.com_align == "fit"
        if target == COM and not self.reduced and (self.hp.generation == "preserve" or refit):
            # the Ord model's conv3, sent until the server has a reply on the Com model:
            # needed when shrinking, ignored once shrunk
            ordinary = tier_params(ORD, self.dims)
            source = {n: msg.tensors[n] for n in ALIGN_SOURCE if n in msg.tensors}
            check_entries("hmpl: the server's conv3", source,
                          {n: ordinary[n] for n in ALIGN_SOURCE}, unknown=False)
            if refit and len(source) < len(ALIGN_SOURCE):
                raise MessageError(f"hmpl: a Com client under algorithm.com_align = 'fit' "
                                   f"fits ip_align to the Ord model's {list(ALIGN_SOURCE)} "
                                   f"every round; the server sent {sorted(source) or 'neither'}")
            if current != COM and len(source) < len(ALIGN_SOURCE):
                raise MessageError(f"hmpl: a client shrinking to the Com model under "
                                   f"algorithm.generation = 'preserve' derives ip_align from "
                                   f"the Ord model's {list(ALIGN_SOURCE)}; the server sent "
                                   f"{sorted(source) or 'neither'}")
        check_entries(f"hmpl: the server's {tier_name(target)} model",
                      {n: v for n, v in msg.tensors.items() if n not in source}, expected,
                      required=True, unknown=False)
        model = {n: msg.tensors[n] for n in shared}
        own = ip_names(target, self.dims)
        model.update({n: state[n] for n in own if n in state})
        for layer in dict.fromkeys(n.rsplit(".", 1)[0] for n in own if n not in model):
            model.update(self.new_layer(target, layer, cid, source))
        if refit and data.n > 0:
            model.update(fitted_align({**model, **source}, align_batches(data, self.hp.align_images)))
        t = self.ctx.train
        return FitRequest(model, data, t.local_epochs, t.batch_size, t.lr, gen,
                          momentum=t.momentum, weight_decay=t.weight_decay, trainer=trainer)

    def reverts(self, current: int, target: int) -> bool:
        """Whether going from ``current`` to ``target`` is a Sup model's one step back to the
        stage before (``growth_revert``, the server's answer to a time past the bound)."""
        return (not self.reduced and self.hp.growth_revert and current >= 2
                and target == current - 1)

    def finish(self, cid: int, msg: Message, state: State, data: ClientData,
               trained: State, stats: dict[str, float]) -> UpdateResult:
        target = message_stage(msg)
        reply = Message({n: trained[n] for n in shared_names(target, self.dims)},
                        {NUM_SAMPLES: data.n})
        own = {n: trained[n] for n in ip_names(target, self.dims)}
        current = client_stage(state)
        if self.reverts(current, target):
            # the dropped stage's own layers are discarded: the engine keeps a state entry
            # once written (an entry not returned keeps its value), so they are zeroed, as
            # the layers a tier lacks are on the engine's skeleton (never read at this stage)
            own.update({n: torch.zeros_like(state[n]) for n in ip_names(current, self.dims)
                        if n not in own and n in state})
        return UpdateResult(reply, {STAGE: torch.tensor(target), **own}, stats)


    # -- prediction -----------------------------------------------------------------------
    def on_skeleton(self, model: State, stage: int) -> State:
        """A tier model as a state of the engine's skeleton: on hmpl_tiers its layers, zeros
        for the layers it lacks (never read) and its stage; hmpl_ord is the Ord model."""
        if self.kind == UNION:
            return {**self._zeros, **model, STAGE: torch.tensor(stage)}
        if stage != ORD:
            raise MessageError(f"hmpl: a client holding the {tier_name(stage)} model cannot be "
                               "evaluated on hmpl_ord; run on model.name = 'hmpl_tiers'")
        return model

    def tier_model(self, stage: int, state: State, eval_msg: Message | None) -> State:
        if eval_msg is None:
            raise MessageError("hmpl clients predict with the server's shared layers, but none "
                               "were given")
        shared, model = eval_msg.tensors, {}
        for n in tier_params(stage, self.dims):
            source = state if layer_role(n) == "ip" else shared
            if n not in source:
                raise MessageError(f"hmpl: the {tier_name(stage)} model's {n!r} is missing from "
                                   f"the {'client state' if source is state else 'server model'}")
            model[n] = source[n]
        if self.kind == "hmpl_ord" and model.keys() == shared.keys():
            return shared  # the same object for every client: loaded once per evaluation
        return model

    def personal_model(self, state: State, eval_msg: Message | None) -> State:
        stage = client_stage(state)
        return self.on_skeleton(self.tier_model(stage, state, eval_msg), stage)

    def predictive(self, cid: int, state: State, eval_msg: Message | None,
                   data: ClientData) -> dict[str, list[State]]:
        own = self.personal_model(state, eval_msg)
        if self.reduced:
            return {"": [own]}
        stage = client_stage(state)
        # Figs. 6-7's aggregated model: the Ord model of the server's BS layers
        glob = own if stage == ORD else self.on_skeleton(self.tier_model(ORD, {}, eval_msg), ORD)
        return {"": [own], "global": [glob]}


class HMPLSClient(HMPLClient):
    reduced = True


HMPL = Algorithm(
    name="hmpl",
    summary="HMPL: clients ranked by round-1 time into Com / Ord / Sup models (3:4:3) with "
            "SPP; Sup models grow an FPN path while time allows; BS layers averaged over "
            "holders, CP over Sup models, IP kept local",
    hyperparameters=HMPLHyperparameters,
    server=HMPLServer,
    client=HMPLClient,
    paper=PAPER,
    default_model="hmpl_tiers",
    privacy=PrivacySupport(
        refused="client level: models of three tiers grown during training, each averaged over "
        "its own holders; sample level: its stages train on skeletons of their own"),
    no_new_clients="a client's model is staged by its timed first round (Com / Ord / Sup), "
                   "which a newcomer never had",
)

HMPL_S = Algorithm(
    name="hmpl_s",
    summary="HMPL_S: HMPL's SPP only: every client trains the Ord model, FedAvg aggregation",
    hyperparameters=HMPLSHyperparameters,
    server=HMPLSServer,
    client=HMPLSClient,
    paper=PAPER,
    default_model="hmpl_ord",
    privacy=PrivacySupport(
        refused="client level and sample level: not reviewed (HMPL's SPP models)"),
    no_new_clients="not reviewed (HMPL's staged clients)",
)

ALGORITHMS = (HMPL, HMPL_S)
