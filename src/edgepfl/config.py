"""Typed run configuration: TOML files, dotted ``--set`` overrides, validation.

A run is fully described by one ``Config``; its resolved form (every default filled in,
the algorithm's hyperparameters included) is what a run directory stores and what a
resume is checked against.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from edgepfl.errors import ConfigError
from edgepfl.system_config import SystemConfig


class _Section(BaseModel):
    # inf / nan cannot be stored in config.json (JSON has neither), so they are refused
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False,
                              strict=True)


def listed(value: Any) -> Any:
    """A list setting given as one comma-separated string (a Flower run config holds
    scalars only) as its list of items; anything else as it is, for pydantic to check."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


class DatasetConfig(_Section):
    name: str = Field("digits", description="mnist, fmnist, cifar10, cifar100, digits, "
                      "synthetic; your own data: npz, imagefolder, hf (read from dataset.path)")
    root: str | None = Field(None, description="data directory; default $EDGEPFL_DATA, else ./data")
    fraction: float = Field(1.0, gt=0, le=1, description="random share of train and test data to use")
    download: bool = Field(True, description="try to download missing files (md5-checked)")
    path: str | None = Field(
        None, description="npz, imagefolder, hf: the .npz file or the folder to read (relative "
        "to the working directory; a run's config.json stores it absolute)")
    test_fraction: float = Field(
        0.2, gt=0, lt=1, description="npz, imagefolder, hf without a test split of their own: "
        "the share of the samples held out for testing (of each client's with client ids, "
        "else of each class's), drawn from a fixed seed, so every run seed tests on the same")
    resize: int | None = Field(
        None, ge=1, description="imagefolder, hf: every image resized to resize x resize; None "
        "keeps each at its own size (images of several sizes need a model for any input size)")
    image_column: str = Field("image", min_length=1, description="hf: the column of the inputs "
                              "(images, or arrays)")
    label_column: str = Field("label", min_length=1, description="hf: the column of the labels "
                              "(class indices, or class names)")
    client_column: str | None = Field(
        None, description="hf: the column of each sample's client, for partition.scheme = "
        "natural")
    aspect_ratios: list[str] = Field(
        default_factory=list, description="images of arbitrary size (HMPL Sec. IV-B): every "
        "image seen through the largest crop of one of these 'W:H' ratios at a seeded random "
        "position, e.g. ['16:9', '4:3', '1:1', '3:4', '9:16']; empty: whole images. Needs a "
        "model that takes any input size")
    aspect_mode: Literal["image", "client"] = Field(
        "image", description="image: a ratio drawn per image; client: one per client (a "
        "device's camera), the ratios dealt evenly over the clients in a seeded order")

    @field_validator("aspect_ratios", mode="before")
    @classmethod
    def _aspect_ratios(cls, value: Any) -> Any:
        value = listed(value)  # "16:9,4:3"
        if not isinstance(value, list | tuple):
            return value  # pydantic names the type error
        out: list[str] = []
        for item in value:
            w, h = parse_aspect_ratio(item)
            if any(w * h2 == h * w2 for w2, h2 in map(parse_aspect_ratio, out)):
                raise ValueError(f"{item!r} repeats a ratio already listed")
            out.append(f"{w}:{h}")
        return out


ASPECT_RATIO = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*")


def parse_aspect_ratio(text: Any) -> tuple[int, int]:
    """``"16:9"`` -> ``(16, 9)`` (width, height); anything else is a ValueError naming it."""
    match = ASPECT_RATIO.fullmatch(text) if isinstance(text, str) else None
    if match is None or int(match[1]) == 0 or int(match[2]) == 0:
        raise ValueError(f"{text!r} is not an aspect ratio; write 'W:H' with positive integers "
                         "W and H, e.g. '16:9', '4:3', '1:1', '3:4', '9:16'")
    return int(match[1]), int(match[2])


class PartitionConfig(_Section):
    scheme: str = Field("dirichlet", description="iid, dirichlet, pathological, "
                        "primary_secondary, hierarchical (a class mix per edge, partition.edges "
                        "of them, and each client's drawn around its edge's), natural (each "
                        "sample's client from the data)")
    clients: int = Field(10, ge=1, description="number of clients (natural: the number of "
                         "clients in the data, which it is when left out)")
    alpha: float = Field(0.3, gt=0, description="Dirichlet concentration (smaller = more "
                         "skewed); hierarchical: a client's mix ~ Dir(alpha x its edge's mix), "
                         "so smaller = clients further from their edge")
    edge_alpha: float = Field(0.3, gt=0, description="hierarchical: each edge's class mix ~ "
                              "Dir(edge_alpha) (smaller = edges more different)")
    edges: int | None = Field(None, ge=1, description="hierarchical: the edges the data are "
                              "drawn for (None = topology.edges); set it to give a method without "
                              "edge servers (topology.edges = 0) the same split")
    min_size: int = Field(10, ge=1, description="dirichlet, hierarchical: minimum train samples "
                          "per client")
    classes_per_client: int = Field(2, ge=1, description="pathological: classes per client")

    @model_validator(mode="after")
    def _edges(self) -> PartitionConfig:
        if self.edges is not None and self.scheme != "hierarchical":
            raise ValueError(f"partition.edges = {self.edges!r} is read by partition.scheme = "
                             f"'hierarchical' only, not {self.scheme!r}; leave it unset")
        return self


class ModelConfig(_Section):
    name: str | None = Field(None, description="architecture; default depends on the data set "
                             "(and its BatchNorm variant for fedbn)")
    tiers: dict[str, str] = Field(
        default_factory=dict, description="device tier -> architecture (needs system.devices = "
        "'tiers'); a tier not named here uses model.name")


class TopologyConfig(_Section):
    edges: int = Field(0, ge=0, description="edge servers between clients and the cloud "
                       "(0 = star: clients talk to the server directly)")
    assignment: Literal["random", "contiguous", "explicit", "partition", "similar"] | None = Field(
        None, description="clients to edges: random (seeded, sizes differ by at most 1), "
        "contiguous (clients 0..n/K-1 on edge 0, ...), explicit (topology.parents), partition "
        "(each client under the edge its data was drawn for: partition.scheme = hierarchical "
        "only), similar (clients of close label histograms together: seeded balanced k-means, "
        "sizes differ by at most 1, any scheme); None = partition under partition.scheme = "
        "hierarchical, else random. With the hierarchical scheme another assignment is allowed: "
        "the same data under edges that do not follow it, a control")
    parents: list[int] = Field(default_factory=list, description="explicit: each client's edge")
    edge_rounds: int = Field(1, ge=1, description="k2: edge aggregations per cloud round "
                             "(local epochs per edge round stay train.local_epochs, k1)")
    mode: Literal["sync", "async"] = Field(
        "sync", description="sync: every edge k2 edge rounds per cloud round (the papers' "
        "schedule: Wen et al.'s T edge-client updates per cloud upload is k2); async, an "
        "extension beyond the papers: each edge as many as its clients' simulated time allows "
        "in a period of k2 median edge rounds (simulation only)")


class TrainConfig(_Section):
    rounds: int = Field(50, ge=1, description="communication rounds (KAPC paper: 50)")
    local_epochs: int = Field(5, ge=1, description="local epochs per round (KAPC paper: 5)")
    batch_size: int = Field(32, ge=1, description="client mini-batch size")
    lr: float = Field(0.01, gt=0, description="client SGD learning rate (KAPC paper: 0.01); "
                      "with lr_decay, the rate of the first round")
    lr_decay: Literal["none", "linear", "cosine", "exponential"] = Field(
        "none", description="how the clients' rate moves from train.lr at the first client step "
        "to train.lr_final at the last (rounds x topology.edge_rounds steps): none = train.lr "
        "throughout; linear = by equal differences; cosine = half a cosine wave, flat at both "
        "ends; exponential = by the same factor every step (HMPL Sec. IV-B: 0.01 to 0.001)")
    lr_final: float | None = Field(
        None, gt=0, description="the clients' rate at the last client step; needed with "
        "train.lr_decay, 0 < lr_final <= train.lr; None without decay")
    lr_decay_rounds: int | None = Field(
        None, ge=1, description="the rounds train.lr_decay spreads over: the rate reaches "
        "train.lr_final at this round and stays there after it; above train.rounds, a run "
        "follows the beginning of a longer schedule (HMPL Sec. IV-B decays over up to 800 "
        "rounds); None = train.rounds; only with a decay")
    momentum: float = Field(0.0, ge=0, lt=1, description="client SGD momentum (reset every round)")
    weight_decay: float = Field(0.0, ge=0, description="client SGD weight decay (L2 penalty "
                                "added to each gradient)")
    participation: float = Field(1.0, gt=0, le=1, description="fraction of clients per round "
                                 "(in a hierarchy: of each edge's clients)")
    early_stopping: int = Field(
        0, ge=0, description="patience, in evaluated rounds (eval.every): stop the run once "
        "this many evaluated rounds in a row have not raised the mean client accuracy by more "
        "than early_stopping_delta over the last round that did; decided from the metrics rows "
        "alone, so a resumed run stops where a straight one does; 0 = never stop early")
    early_stopping_delta: float = Field(
        0.0, ge=0, le=1, description="the rise of the mean client accuracy (a fraction: 0.001 = "
        "0.1 points) an evaluated round must beat to count as an improvement; 0 = any rise")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="where clients train and evaluate and KAPC's Gram matrices are "
        "formed: auto = the GPU when PyTorch sees one, else the CPU; results equal the CPU's "
        "within float tolerance (docs/architecture.md, 'Devices')")
    threads: int | Literal["auto"] = Field(
        "auto", description="torch CPU threads of this process (--threads sets it): auto = the "
        "cores no other process keeps busy, measured at the start and after every round (a "
        "step of under 20 MFLOPs a thread is not split further); how a run executes, not what "
        "it computes, though the last bits of floats may differ with the count: fix it for "
        "bit-identical reruns (bench/speed/README.md, 'Threads')")
    workers: int | Literal["auto"] = Field(
        1, description="clients of a round trained at the same time, each in a worker process "
        "of one thread (simulation on the CPU; auto = one per core no other process keeps "
        "busy); metrics equal the "
        "sequential run's")

    batch_clients: bool = Field(
        False, description="train a step's clients together, their SGD steps batched into one "
        "with torch.func.vmap (clients whose algorithm states its training as a fit request: "
        "the 'batched clients' column of docs/algorithms.md's supports table; several "
        "architectures, per architecture); each client's BatchNorm statistics its own; models without dropout; others train one after "
        "another); weights equal the sequential "
        "run's within float tolerance; pays on a GPU, not on a CPU (bench/speed/README.md); needs "
        "train.workers = 1")
    compile: Literal["off", "default", "reduce-overhead", "max-autotune-no-cudagraphs"] = Field(
        "off", description="torch.compile a plain local fit's forward, loss and backward as one "
        "graph in this mode (algorithms whose clients add a loss term, and models with dropout "
        "or BatchNorm, train eagerly); results equal eager within float tolerance; off = eager, the faster on "
        "a CPU (bench/speed/README.md, 'CPU modes'); the first step of each batch shape pays "
        "the compile (tens of seconds)")
    store: Literal["memory", "disk"] = Field(
        "memory", description="where per-client state lives (the clients' models and what a "
        "server keeps per client, e.g. KAPC's uploads and relation cube): memory, or disk = "
        "files mapped into memory, for federations whose state exceeds the machine's memory; "
        "the same results either way (docs/user-guide.md, 'Many clients: state on disk')")
    store_dir: str | None = Field(
        None, description="train.store = disk: the folder for its files (deleted as they are "
        "made, freed when the run ends); default the run directory, else the temp folder")

    @field_validator("workers")
    @classmethod
    def _workers(cls, value: int | str) -> int | str:
        if not isinstance(value, str) and (isinstance(value, bool) or value < 1):
            raise ValueError(f"{value!r}: give a number of processes >= 1, or 'auto'")
        return value

    @field_validator("threads")
    @classmethod
    def _threads(cls, value: int | str) -> int | str:
        if not isinstance(value, str) and (isinstance(value, bool) or value < 1):
            raise ValueError(f"{value!r}: give a number of threads >= 1, or 'auto'")
        return value

    @model_validator(mode="after")
    def _decay(self) -> TrainConfig:
        if self.lr_decay == "none":
            if self.lr_final is not None:
                raise ValueError(f"train.lr_final = {self.lr_final!r} is only read with a decay; "
                                 "set train.lr_decay to linear, cosine or exponential, or leave "
                                 "lr_final unset")
            if self.lr_decay_rounds is not None:
                raise ValueError(f"train.lr_decay_rounds = {self.lr_decay_rounds!r} is only read "
                                 "with a decay; set train.lr_decay to linear, cosine or "
                                 "exponential (and train.lr_final), or leave lr_decay_rounds "
                                 "unset")
        elif self.lr_final is None:
            raise ValueError(f"train.lr_decay = {self.lr_decay!r} needs train.lr_final, the rate "
                             f"at the last round: a number > 0 and <= train.lr = {self.lr!r}")
        elif self.lr_final > self.lr:
            raise ValueError(f"train.lr_final = {self.lr_final!r} is above train.lr = {self.lr!r}; "
                             f"a decay ends at a rate > 0 and <= train.lr")
        return self


class EvalConfig(_Section):
    every: int = Field(1, ge=1, description="evaluate every this many rounds (and the last)")
    statistic: Literal["best_round", "client_best"] = Field(
        "best_round", description="summary's protocol figure: best_round = the best round of "
        "the mean over clients (ours); client_best = each client's own best round, averaged "
        "(KAPC Sec. 7.1 for Local and FedAvg)")
    clients: Literal["all", "selected"] = Field(
        "all", description="summary's protocol figure over all clients (ours) or, per round, "
        "the clients selected that round (KAPC's client-selection scenario)")
    batch_size: int = Field(1024, ge=1, description="evaluation batch size (no effect on results)")
    validation: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of each client's training data held out as its "
        "validation split (seeded, label-stratified); when set, val_acc_* columns are "
        "recorded and the best round, early stopping and the protocol figure are chosen on "
        "validation, with test accuracy reported at the validation-best round")
    new_clients: float = Field(
        0.0, ge=0.0, lt=1.0, description="share of the clients held out of training (seeded "
        "from the run seed alone: the same clients for every algorithm of a comparison), never "
        "selected in any round; at each evaluated round each one is served as its method "
        "would serve a newcomer (e.g. the global model fine-tuned for new_client_epochs) and "
        "scored on its test split: acc_new_* columns, kept out of acc_*; 0 = off")
    new_client_epochs: int = Field(
        1, ge=0, description="local epochs a held-out client (eval.new_clients) fine-tunes "
        "what it is served on its own training data, with the run's SGD settings (train.lr, "
        "batch_size, momentum, weight_decay); 0 = what it is served, as is")


class FaultsConfig(_Section):
    drop_rate: float = Field(0.0, ge=0, le=1, description="share of each round's selected clients "
                             "that do not reply (seeded, the same for every algorithm; "
                             "simulation)")
    straggler_rate: float = Field(0.0, ge=0, le=1, description="share of the others whose "
                                  "compute is slowed by straggler_delay (simulation)")
    straggler_delay: float = Field(4.0, ge=1, description="a straggler's compute time, in "
                                   "multiples of its own")
    deadline: float | None = Field(None, gt=0, description="simulated seconds a client has "
                                   "from the round's start to deliver its reply; later "
                                   "replies count as failed (None: the server waits)")
    min_replies: float = Field(0.0, ge=0, le=1, description="share of a client step's "
                               "selected clients whose usable replies the run needs; fewer stop "
                               "the run with an error (resume from its last checkpoint)")
    max_message_bytes: int | None = Field(None, ge=1, description="a client reply larger "
                                          "than this is rejected as malformed (None: no cap)")
    client_timeout: float | None = Field(None, gt=0, description="wall-clock seconds a "
                                         "client's step may take in a worker process "
                                         "(train.workers > 1); a client still training then "
                                         "is a failed client of that round, its state "
                                         "unchanged, and its worker is replaced (None: no "
                                         "limit; simulation)")


TRACKERS = ("tensorboard", "mlflow", "wandb")


class OutputConfig(_Section):
    checkpoint_every: int | Literal["auto", "never"] = Field(
        "auto", description="write a checkpoint every this many rounds (and after the last); "
        "auto: after a round once the rounds since the last checkpoint took at least 10 times "
        "as long as writing it (every round unless the state is large); never: none, so the "
        "run cannot be resumed or extended (for a state too large to write twice to disk)")

    @field_validator("checkpoint_every")
    @classmethod
    def _checkpoint_every(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError("must be 'auto', 'never' or a whole number of rounds >= 1")
        return value
    plots: bool = Field(True, description="write PNG plots into the run directory")
    trackers: list[str] = Field(
        default_factory=list, description="experiment trackers that also receive the run: "
        "any of tensorboard (event files in <run dir>/tensorboard), mlflow (output.mlflow_uri) "
        "and wandb (offline unless WANDB_MODE says otherwise); each needs its extra, e.g. "
        "pip install 'edgepfl[tensorboard]'; a resumed run goes on in the same tracker run")
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI; default an SQLite store beside the run "
        "directories (sqlite:///<parent of the run dir>/mlflow.db)")
    experiment: str = Field("edgepfl", min_length=1, description="the MLflow experiment and "
                            "the W&B project that runs are filed under")

    @field_validator("trackers", mode="before")
    @classmethod
    def _trackers(cls, value: Any) -> Any:
        value = listed(value)  # "tensorboard,mlflow"
        if not isinstance(value, list | tuple):
            return value  # pydantic names the type error
        unknown = [v for v in value if v not in TRACKERS]
        if unknown:
            raise ValueError(f"unknown tracker{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(map(repr, unknown))}; valid trackers: "
                             f"{', '.join(TRACKERS)}")
        return list(dict.fromkeys(value))  # each tracker once, in the order given


class PrivacyConfig(_Section):
    level: Literal["none", "client", "sample"] = Field(
        "none", description="differential privacy (docs/user-guide.md, 'Differential "
        "privacy'): none; client = each client's whole contribution to a round (its model "
        "update) clipped to privacy.clip in L2 and Gaussian noise added to their sum at the "
        "aggregator (DP-FedAvg); sample = DP-SGD in every client's local training, each "
        "client's samples protected (per-sample clipping, noise on each step)")
    noise_multiplier: float = Field(
        1.0, ge=0, description="the Gaussian noise's standard deviation in multiples of "
        "privacy.clip, on the sum of clipped updates (client) or of clipped per-sample "
        "gradients (sample); 0 gives no guarantee (epsilon infinite)")
    clip: float | Literal["adaptive"] = Field(
        1.0, description="the L2 bound of each client's model update (client) or each "
        "sample's gradient (sample), > 0; 'adaptive' (client level): the bound follows "
        "privacy.target_quantile of the update norms, privately (Andrew et al. 2021)")
    clip_initial: float = Field(0.1, gt=0, description="privacy.clip = 'adaptive': the "
                                "first round's clip, > 0")
    target_quantile: float = Field(0.5, gt=0, lt=1, description="privacy.clip = 'adaptive': "
                                   "the quantile of the update norms the clip tracks, in (0, 1)")
    clip_lr: float = Field(0.2, gt=0, description="privacy.clip = 'adaptive': the clip's "
                           "geometric step, C <- C exp(-clip_lr (fraction unclipped - "
                           "target_quantile)), > 0")
    clip_count_stddev: float | None = Field(
        None, ge=0, description="privacy.clip = 'adaptive': the std of the Gaussian noise on "
        "the count of unclipped updates, >= 0, above privacy.noise_multiplier / 2 (or 0 "
        "with noise_multiplier 0); None: the aggregator's sampled clients / 20")
    delta: float | None = Field(
        None, gt=0, lt=1, description="the delta of (epsilon, delta)-DP; None: 1 / the number "
        "of clients (client), 1 / each client's number of training samples (sample)")
    target_epsilon: float | None = Field(
        None, gt=0, description="the privacy budget: the run stops after the last round that "
        "keeps epsilon within it, saying so (and is refused when round 1 alone passes it); "
        "None: no budget, epsilon is only reported")
    accountant: Literal["rdp", "pld"] = Field(
        "rdp", description="dp-accounting's accountant: rdp (Renyi DP; the only one with "
        "fixed-size sampling without replacement, which client level needs) or pld "
        "(privacy loss distributions, tighter; sample level only)")
    relation: Literal["add_remove", "replace_one"] | None = Field(
        None, description="the neighbouring data sets the epsilon is accounted for; None: "
        "the level's own. Sample level: add_remove (one sample added or removed; the "
        "default, the DP-SGD literature's, though a client's sample count leaves it in "
        "clear) or replace_one (one sample replaced, so the count may be public; a larger "
        "epsilon; needs privacy.accountant = 'pld'). Client level: replace_one only (the "
        "number of clients is public)")
    noise_at: Literal["edge", "cloud"] = Field(
        "edge", description="in a hierarchy (topology.edges > 0), where client-level noise is "
        "added: edge = at each edge, which sees its clients' clipped updates (each client "
        "trusts its edge); cloud is refused (an edge would hand its clients an un-noised "
        "average for topology.edge_rounds rounds)")

    secure_aggregation: bool = Field(
        False, description="on Flower, each aggregator (the server, or each edge) learns "
        "only the sum of its clients' updates, never one client's (Flower's SecAgg+; "
        "docs/deployment.md, 'Secure aggregation'); with privacy.level = 'client' the clients "
        "clip their updates and add the noise themselves. For algorithms whose aggregation "
        "is a sample-weighted mean; the simulation computes the same aggregate in process")
    secagg_threshold: float = Field(
        0.5, gt=0, le=1, description="privacy.secure_aggregation: the share of an "
        "aggregation's sampled clients (at least 2) whose key shares unmask the sum; fewer "
        "replies and the aggregation fails (and under client-level DP each client adds the "
        "noise a sum of that many needs)")
    secagg_range: float = Field(
        8.0, gt=0, description="privacy.secure_aggregation: every entry of a client's "
        "weighted update must lie in [-secagg_range, secagg_range] (SecAgg+ quantizes that "
        "range to 2^22 levels; a client whose update leaves it fails its round, saying so)")

    @field_validator("clip", mode="before")
    @classmethod
    def _clip(cls, value: Any) -> Any:
        if value == "adaptive" or (isinstance(value, int | float) and not isinstance(value, bool)
                                   and value > 0):
            return value
        raise ValueError(f"privacy.clip = {value!r}: give a number > 0 (a fixed clip) or "
                         "'adaptive' (client level: the clip follows a quantile of the update "
                         "norms)")

    @model_validator(mode="after")
    def _acting(self) -> PrivacyConfig:
        _check_privacy(self)
        _check_adaptive(self)
        return self


# noise (noise_multiplier x clip, the std on every weight of a noised sum) beyond this
# drowns any model, and epsilon is 0.0 to every printed digit
MAX_NOISE = 1e6
# below this the pld accountant's privacy loss distribution (its size grows as 1/noise^2)
# takes seconds to minutes per epsilon (1e-6: petabytes), for an epsilon of 10 or more a step
PLD_MIN_NOISE = 0.3


ADAPTIVE = ("clip_initial", "target_quantile", "clip_lr", "clip_count_stddev")
SECAGG = ("secagg_threshold", "secagg_range")


def _check_adaptive(p: PrivacyConfig) -> None:
    """Adaptive clipping is client level only; its settings act with it alone."""
    if p.clip == "adaptive" and p.level != "client":
        raise ValueError(f"privacy.clip = 'adaptive' with privacy.level = {p.level!r}: adaptive "
                         "clipping is for client level (the clip of each client's update); "
                         "set privacy.level = 'client' or give privacy.clip a number > 0")
    # a setting at its default is not 'given': a run's whole config, validated again (a
    # resumed run, a Flower run config), names every field
    fields = type(p).model_fields
    given = [f"privacy.{k}" for k in ADAPTIVE
             if k in p.model_fields_set and getattr(p, k) != fields[k].default]
    if given and p.clip != "adaptive":
        raise ValueError(f"{', '.join(given)} given with privacy.clip = {p.clip!r}: they set "
                         "adaptive clipping; set privacy.clip = 'adaptive' (privacy.level = "
                         "'client') or leave them out")


def _check_privacy(p: PrivacyConfig) -> None:
    """privacy.* settings given without privacy.level, noise that drowns any model, and
    noise too small for the pld accountant are refused (ValueError)."""
    secure = p.secure_aggregation
    given = [f"privacy.{k}" for k in SECAGG
             if k in p.model_fields_set and getattr(p, k) != type(p).model_fields[k].default]
    if given and not secure:
        raise ValueError(f"{', '.join(given)} given without privacy.secure_aggregation = true, "
                         "which they set: add it or leave them out")
    if secure and p.clip == "adaptive":
        raise ValueError("privacy.clip = 'adaptive' with privacy.secure_aggregation = true: the "
                         "clip follows a noised count of the clients whose update it clipped, "
                         "which the server would then have to learn through a secure sum too "
                         "(not implemented); give privacy.clip a number > 0")
    unused = sorted(k for k in p.model_fields_set
                    if k != "level" and k != "secure_aggregation" and k not in SECAGG)
    if unused and "level" not in p.model_fields_set:
        raise ValueError(f"{', '.join('privacy.' + k for k in unused)} given without "
                         "privacy.level, which is 'none' (no noise, nothing accounted): add "
                         "privacy.level = 'client' or 'sample' for them to act, or leave "
                         "them out")
    if p.level == "none":
        return
    if p.noise_multiplier > MAX_NOISE:
        raise ValueError(f"privacy.noise_multiplier = {p.noise_multiplier:g}: beyond "
                         f"{MAX_NOISE:g} epsilon is already 0.0 and the noise drowns any "
                         f"model; give a value from 0 to {MAX_NOISE:g}")
    clip = p.clip_initial if p.clip == "adaptive" else p.clip
    if p.noise_multiplier * clip > MAX_NOISE:
        raise ValueError(f"privacy.noise_multiplier x privacy.clip = "
                         f"{p.noise_multiplier * clip:g} is the noise's standard deviation "
                         f"on every weight of a noised sum: beyond {MAX_NOISE:g} it drowns "
                         "any model (and overflows float32 in training); lower privacy.clip "
                         "or privacy.noise_multiplier")
    if p.level == "sample" and p.accountant == "pld" and 0 < p.noise_multiplier < PLD_MIN_NOISE:
        fix = ("" if p.relation == "replace_one"
               else ", or privacy.accountant = 'rdp', which accounts any noise quickly")
        raise ValueError(f"privacy.noise_multiplier = {p.noise_multiplier:g} is below "
                         f"{PLD_MIN_NOISE:g}, the least the pld accountant takes: its privacy "
                         "loss distribution grows as 1 / noise^2 (seconds to minutes per "
                         "epsilon at 0.1, petabytes at 1e-6) and one step alone spends an "
                         f"epsilon of 10 or more; raise privacy.noise_multiplier to "
                         f"{PLD_MIN_NOISE:g} or more{fix}")


class AlgorithmConfig(BaseModel):
    """``name`` plus the algorithm's own hyperparameters, validated by the algorithm."""

    model_config = ConfigDict(extra="allow")
    name: str = "fedavg"

    def hyperparameters(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class Config(_Section):
    seed: int = Field(0, ge=-(2**63), lt=2**63, description="one seed fixes partition, init, sampling and data order")
    dataset: DatasetConfig = DatasetConfig()
    partition: PartitionConfig = PartitionConfig()
    model: ModelConfig = ModelConfig()
    topology: TopologyConfig = TopologyConfig()
    train: TrainConfig = TrainConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    eval: EvalConfig = EvalConfig()
    faults: FaultsConfig = FaultsConfig()
    output: OutputConfig = OutputConfig()
    system: SystemConfig = SystemConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    plugins: list[str] = Field(
        default_factory=list, description="plug-ins to load first: importable module names or "
        "paths of .py files that register algorithms, models and data sets "
        "(edgepfl.plugins; also edgepfl run --plugin)")

    @field_validator("plugins", mode="before")
    @classmethod
    def _plugins(cls, value: Any) -> Any:
        return listed(value)  # "a.py,b"


def _format_validation_error(exc: ValidationError, data: dict) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            section = _section_model(err["loc"][:-1])
            valid = ", ".join(section.model_fields) if section else "?"
            hint = did_you_mean(str(err["loc"][-1]), section.model_fields if section else [])
            lines.append(f"unknown setting {key!r}{hint}; valid keys here: {valid}")
        elif isinstance(err.get("input"), dict):
            lines.append(f"{key or 'config'}: {err['msg']}")
        else:
            lines.append(f"{key} = {err.get('input')!r}: {err['msg']}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def did_you_mean(name: str, valid: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the valid names closest to a misspelt one, else ``""``."""
    close = difflib.get_close_matches(name, list(valid), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _section_model(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        if isinstance(part, int):  # an item of a list of sections (system.tiers)
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        annotation = field.annotation
        if get_origin(annotation) is list:
            annotation = (get_args(annotation) or (None,))[0]
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def parse_value(text: str) -> Any:
    """Read a ``--set`` value as TOML (numbers, booleans, quoted strings), else a bare string;
    Python's ``True`` / ``False`` are read as TOML's ``true`` / ``false``. Settings are
    strict about types, so a quoted number stays a string and is refused where a number
    belongs, on the command line as in a file."""
    if text.strip() in ("True", "False"):
        return text.strip() == "True"
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``key.sub=value`` strings to a nested dict (returns a new dict)."""
    data = copy.deepcopy(data)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r} is not of the form key=value (e.g. train.rounds=10)")
        key, _, raw = item.partition("=")
        set_dotted(data, key, parse_value(raw.strip()), f"--set {item!r}")
    return data


def set_dotted(data: dict, key: str, value: Any, what: str) -> None:
    """Set ``a.b.c`` in a nested dict in place; ``what`` names the setting in errors."""
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"{what} has an empty key")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{what}: {part!r} is a value, not a section")
        node = child
    node[parts[-1]] = value


def load_toml(path: str | Path) -> dict:
    path = Path(path)
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not readable TOML: {exc}") from None


def build_config(data: dict | None = None, overrides: list[str] | None = None) -> Config:
    """Validate a nested dict plus overrides into a ``Config`` (raises ConfigError)."""
    merged = apply_overrides(data or {}, overrides or [])
    try:
        return Config.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc, merged)) from None


def load_config_file(path: str | Path) -> dict:
    """A TOML configuration file, or a run's own config.json (``.json``: what a run used,
    to run it again or vary it)."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        return load_toml(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} holds a JSON {type(data).__name__}, "
                          "not an object of settings")
    return data


def config_from_sources(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    return build_config(load_config_file(path) if path else {}, overrides)


def describe_sections() -> list[tuple[str, str, str]]:
    """(dotted key, default, description) of every fixed setting, for docs and ``list``."""
    rows: list[tuple[str, str, str]] = [("seed", "0", Config.model_fields["seed"].description or "")]
    for section, field in Config.model_fields.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            continue
        for key, sub in model.model_fields.items():
            default = sub.get_default(call_default_factory=True)
            rows.append((f"{section}.{key}", shown_default(default), sub.description or ""))
    return rows


def shown_default(value: Any) -> str:
    """A default as ``list`` shows it, as ``--set`` reads it back: Python's repr for a plain
    value (None aside: unset), TOML for a list, table or section (system.tiers), whose
    repr would be Python's object text."""
    if isinstance(value, (BaseModel, dict, list, tuple)):
        return _toml(value)
    return repr(value)


def _toml(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(x)}" for k, x in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)
