"""What a run builds from its configuration, the same way wherever it runs (the
simulation, a Flower ServerApp, a Flower ClientApp): the federation's description, each
architecture's seeded initial model, the algorithm's server, edge and client parts.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from edgepfl.algorithms import ClientContext, ServerContext, get_algorithm
from edgepfl.config import Config, build_config
from edgepfl.contract.algorithm import (
    Algorithm,
    Architecture,
    Client,
    Edge,
    EdgeContext,
    Hyperparameters,
    Server,
)
from edgepfl.data import dataset_of, partition_of
from edgepfl.data.aspect import Crops, parse_ratios
from edgepfl.data.datasets import Dataset
from edgepfl.data.partition import Partition
from edgepfl.errors import ConfigError
from edgepfl.federation.aggregate import ParamIndex
from edgepfl.federation.rng import derive_seed
from edgepfl.federation.store import MEMORY, Stacks
from edgepfl.federation.topology import Federation, default_assignment
from edgepfl.models import DEFAULT_MODEL, MODELS, LayerSpec, build_model, zoo
from edgepfl.plugins import load_plugins
from edgepfl.privacy import check_privacy, make_trainer
from edgepfl.training.device import select_device
from edgepfl.training.trainer import Trainer


def natural_clients(cfg: Config, dataset: Dataset | None = None
                    ) -> tuple[Config, Dataset | None]:
    """A natural split whose ``partition.clients`` was not given takes the data's count of
    clients (a given count must match it: ``partition_of``); ``dataset``, the data set if
    loaded already, is returned, loaded if this needed it."""
    part = cfg.partition
    if part.scheme != "natural" or "clients" in part.model_fields_set:
        return cfg, dataset
    load_plugins(cfg.plugins)  # the data set may be a plug-in's
    dataset = dataset or dataset_of(cfg.dataset, cfg.seed)
    if not dataset.clients or part.clients == len(dataset.clients):
        return cfg, dataset
    counted = part.model_copy(update={"clients": len(dataset.clients)})
    return cfg.model_copy(update={"partition": counted}), dataset


def resolve(cfg: Config) -> Config:
    """Fill in what defaults depend on (model per data set, algorithm hyperparameters,
    a natural split's count of clients), with the configuration's plug-ins loaded first."""
    load_plugins(cfg.plugins)
    cfg = natural_clients(cfg)[0]
    algo = get_algorithm(cfg.algorithm.name)
    hp = algo.parse_hyperparameters(cfg.algorithm.hyperparameters())
    if algo.complete is not None:
        hp = algo.complete(cfg, hp)
    data = cfg.model_dump()
    if data["model"]["name"] is None and algo.default_model is not None:
        data["model"]["name"] = algo.default_model
    if data["model"]["name"] is None:
        base = DEFAULT_MODEL.get(cfg.dataset.name, "mlp")
        variant = base + algo.model_variant
        data["model"]["name"] = variant if variant in MODELS else base
    for tier, name in data["model"]["tiers"].items():
        if name not in MODELS:
            raise ConfigError(f"model.tiers.{tier} = {name!r} is not a known model; valid: "
                              f"{', '.join(MODELS)}")
    data["algorithm"] = {"name": algo.name, **hp.model_dump()}
    if data["topology"]["assignment"] is None:
        data["topology"]["assignment"] = default_assignment(cfg.partition.scheme)
    return build_config(data)


def load_federation(cfg: Config, dataset: Dataset | None = None,
                    partition: Partition | None = None) -> tuple[Dataset, Partition]:
    """The run's data set and its seeded split over the clients (either may be given)."""
    dataset = dataset or dataset_of(cfg.dataset, cfg.seed)
    partition = partition or partition_of(cfg.partition, dataset, cfg.seed, cfg.topology.edges)
    return dataset, partition


def _check_algorithm(algorithm: Algorithm, federation: Federation) -> None:
    from edgepfl.algorithms import ALGORITHMS

    if federation.hierarchical and algorithm.edge is None:
        valid = [a.name for a in ALGORITHMS.values() if a.edge is not None]
        raise ConfigError(f"algorithm.name = {algorithm.name!r} runs on a star (server and "
                          f"clients), but topology.edges = {federation.edges}; algorithms with "
                          f"edge servers: {', '.join(valid)} (or set topology.edges = 0)")
    if not federation.hierarchical and algorithm.edge is not None:
        raise ConfigError(f"algorithm.name = {algorithm.name!r} needs edge servers; set "
                          f"topology.edges between 1 and partition.clients")
    archs = federation.architectures
    if len(archs) > 1 and not algorithm.heterogeneous:
        valid = [a.name for a in ALGORITHMS.values() if a.heterogeneous]
        raise ConfigError(f"algorithm.name = {algorithm.name!r} needs one model architecture for "
                          f"every client, but model.tiers gives {len(archs)} ({', '.join(archs)}); "
                          f"algorithms for clients of different architectures: {', '.join(valid)}")


def image_crops(cfg: Config, dataset: Dataset) -> Crops | None:
    """The crop geometry of ``dataset.aspect_ratios`` on this data set (None: whole images)."""
    if not cfg.dataset.aspect_ratios:
        return None
    _, height, width = dataset.input_shape
    return Crops(parse_ratios(cfg.dataset.aspect_ratios), height, width)


def _check_variable_size(cfg: Config, algorithm: Algorithm, federation: Federation,
                         native: list[tuple[int, int]] | None = None) -> None:
    """Crops of several sizes, or images kept at their several sizes (``native``), need an
    algorithm and models that take any input size."""
    from edgepfl.algorithms import ALGORITHMS

    ratios = cfg.dataset.aspect_ratios
    if native is None:
        cause = f"dataset.aspect_ratios = {ratios} crops them to several"
        gives = f"dataset.aspect_ratios = {ratios} gives images of several sizes"
        fix = "dataset.aspect_ratios = []"
    else:
        cause = gives = (f"the images of dataset.path = {cfg.dataset.path!r} come in "
                         f"{len(native)} sizes ({', '.join(f'{h}x{w}' for h, w in native[:4])}"
                         f"{', ...' if len(native) > 4 else ''})")
        fix = "dataset.resize to make them one size"
    if not algorithm.variable_size:
        valid = [a.name for a in ALGORITHMS.values() if a.variable_size]
        raise ConfigError(f"algorithm.name = {algorithm.name!r} needs images of one size, but "
                          f"{cause}; algorithms for images of any size: {', '.join(valid)} "
                          f"(or set {fix})")
    # read at call time: the registry is the models' own (edgepfl.models.zoo)
    fixed = [name for name in federation.architectures if name not in zoo.VARIABLE_SIZE_MODELS]
    if fixed:
        valid = [name for name in MODELS if name in zoo.VARIABLE_SIZE_MODELS]
        raise ConfigError(f"{gives}, but "
                          f"model {', '.join(map(repr, fixed))} takes one input size only (a "
                          f"fixed-size flatten before its fully connected layers); models for "
                          f"images of any size: {', '.join(valid) or 'none registered yet'} "
                          f"(set model.name, or {fix})")


def _probe(name: str, model: torch.nn.Module, channels: int, crops: Crops | None,
           native: list[tuple[int, int]] | None = None) -> None:
    """Run every crop size (or every size of ``native`` images) through the model once, so
    that a crop too small for it (8x8 synthetic images seen 16:9 through three 2x2
    poolings) stops the run before round 1. In eval mode and without gradients: the
    model's weights and buffers stay as built."""
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for h, w in (crops.shapes if crops is not None else native or []):
                try:
                    model(torch.zeros(1, channels, h, w))
                except RuntimeError as exc:
                    what = (f"the {h}x{w} images of dataset.path" if crops is None else
                            f"the {h}x{w} crops of dataset.aspect_ratios = "
                            f"{[f'{a}:{b}' for a, b in crops.ratios]} on {crops.height}x"
                            f"{crops.width} images")
                    raise ConfigError(f"model {name!r} cannot take {what}: {exc}") from None
    finally:
        model.train(training)


def check_rate(cfg: Config) -> None:
    """Refuse a ``train.lr`` that float32 weights cannot be stepped by at all (beyond
    float32's range, every client step would raise), before anything is built."""
    top = float(torch.finfo(torch.float32).max)
    if cfg.train.lr > top:
        raise ConfigError(f"train.lr = {cfg.train.lr:g} is beyond float32's range "
                          f"({top:.4g}): no client could take a step with it; rates that "
                          "train are around 0.001 to 1 (e.g. train.lr = 0.05)")


def run_stacks(cfg: Config, out_dir: Path | None) -> Stacks:
    """Where the run's per-client stacks live (``train.store``, ``train.store_dir``)."""
    train = cfg.train
    if train.store == "memory":
        return MEMORY
    directory = Path(train.store_dir) if train.store_dir is not None else (
        out_dir if out_dir is not None else Path(tempfile.gettempdir()))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"train.store_dir = {str(directory)!r}: cannot make the folder for "
                          f"train.store = 'disk' ({exc.strerror}); give a writable folder") from None
    return Stacks(directory)


@dataclass
class Parts:
    cfg: Config
    algorithm: Algorithm
    hp: Hyperparameters
    federation: Federation
    architectures: dict[str, Architecture]
    trainers: dict[str, Trainer]
    num_classes: int
    input_shape: tuple[int, int, int]
    stacks: Stacks = MEMORY

    @classmethod
    def build(cls, cfg: Config, dataset: Dataset, num_clients: int | None = None,
              out_dir: Path | None = None, partition: Partition | None = None) -> Parts:
        """``cfg`` resolved. Each architecture's initial model is drawn from the run's seed
        (``model.name``'s from the seed alone, as every run has); a parameter that
        architectures share starts from one value, the first architecture's. ``out_dir``,
        the run directory, is where ``train.store = "disk"`` maps its files by default.
        ``partition``, the run's split, is read by edge assignments that follow the data
        (topology.assignment = partition, similar); drawn again from the seed if not given."""
        check_rate(cfg)
        algorithm = get_algorithm(cfg.algorithm.name)
        hp = algorithm.parse_hyperparameters(cfg.algorithm.hyperparameters())
        split_edges, histograms = None, None
        if cfg.topology.edges and (cfg.topology.assignment or default_assignment(
                cfg.partition.scheme)) in ("partition", "similar"):
            partition = partition or partition_of(cfg.partition, dataset, cfg.seed,
                                                  cfg.topology.edges)
            split_edges = partition.edges
            histograms = partition.class_counts(dataset.y_train, dataset.y_test)[0]
        federation = Federation.build(cfg, num_clients or cfg.partition.clients, split_edges,
                                      histograms)
        _check_algorithm(algorithm, federation)
        crops = image_crops(cfg, dataset)
        native = dataset.sizes if dataset.variable_size else None
        if crops is not None or native is not None:
            _check_variable_size(cfg, algorithm, federation, native)
        device = select_device(cfg.train.device)
        trainers: dict[str, Trainer] = {}
        models: dict[str, dict[str, torch.Tensor]] = {}
        for name in federation.architectures:
            parts = ("init",) if name == cfg.model.name else ("init", name)
            torch.manual_seed(derive_seed(cfg.seed, *parts))
            model = build_model(name, dataset.input_shape, dataset.num_classes)
            if crops is not None or native is not None:
                _probe(name, model, dataset.input_shape[0], crops, native)
            trainers[name] = make_trainer(cfg, model, device)
            models[name] = trainers[name].export()
        check_privacy(cfg, algorithm, federation, {n: t.model for n, t in trainers.items()}, hp)
        if len(models) > 1:
            index = ParamIndex(models)
            first = index.union(models)
            models = {a: index.model(a, first) for a in models}
            for name, model in models.items():
                trainers[name].load(model)
        architectures = {name: Architecture(name, LayerSpec.from_model(trainers[name].model),
                                            {k: v.clone() for k, v in models[name].items()})
                         for name in models}
        return cls(cfg, algorithm, hp, federation, architectures, trainers, dataset.num_classes,
                   dataset.input_shape, run_stacks(cfg, out_dir))

    # the first architecture (the only one unless model.tiers says otherwise)
    @property
    def first(self) -> Architecture:
        return next(iter(self.architectures.values()))

    @property
    def layers(self) -> LayerSpec:
        return self.first.layers

    @property
    def init_model(self) -> dict[str, torch.Tensor]:
        return self.first.init_model

    @property
    def trainer(self) -> Trainer:
        return self.trainers[self.first.name]

    def _server_ctx(self) -> ServerContext:
        cfg = self.cfg
        return ServerContext(self.federation.num_clients, self.layers, self.init_model, cfg.train,
                             cfg.seed, self.federation, self.architectures,
                             self.fresh_model(self.first.name), self.input_shape, self.stacks)

    def server(self) -> Server:
        return self.algorithm.server(self._server_ctx(), self.hp)

    def edge(self, k: int) -> Edge:
        assert self.algorithm.edge is not None
        base = self._server_ctx()
        ctx = EdgeContext(**{f: getattr(base, f) for f in base.__dataclass_fields__},
                          edge=k, members=tuple(self.federation.members(k)))
        return self.algorithm.edge(ctx, self.hp)

    def client(self, arch: str | None = None) -> Client:
        """The client part for architecture ``arch`` (default: the first); it serves every
        client of that architecture and keeps no per-client memory."""
        cfg = self.cfg
        a = self.architectures[arch or self.first.name]
        return self.algorithm.client(ClientContext(self.trainers[a.name], a.layers, cfg.train,
                                                   self.num_classes, cfg.seed, a.name,
                                                   self.fresh_model(a.name)), self.hp)

    def fresh_model(self, arch: str) -> Callable[[int], dict[str, torch.Tensor]]:
        """``seed -> a newly initialised model of architecture ``arch``, drawn as the run's
        initial model was (torch's global generator is left as it was)."""
        trainer = self.trainers[arch]
        shape = self.input_shape

        def fresh(seed: int) -> dict[str, torch.Tensor]:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                model = build_model(arch, shape, self.num_classes)
            state = dict(model.named_parameters()) | dict(model.named_buffers())
            return {n: state[n].detach() for n in trainer.state_names}

        return fresh

    def clients(self) -> dict[str, Client]:
        return {name: self.client(name) for name in self.architectures}
