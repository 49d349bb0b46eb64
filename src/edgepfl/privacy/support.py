"""What a private run needs of its configuration, checked when its parts are built (on
every runtime, a Flower ClientApp included), and the trainer it trains with."""

from __future__ import annotations

import logging
from typing import Any

import torch

from edgepfl.config import Config
from edgepfl.contract.algorithm import Algorithm
from edgepfl.errors import ConfigError
from edgepfl.federation.topology import Federation
from edgepfl.privacy.accountant import library
from edgepfl.privacy.dpsgd import PrivateTrainer
from edgepfl.training.trainer import Trainer

log = logging.getLogger("edgepfl")


def supports(algorithm: Algorithm, level: str) -> bool:
    declared = algorithm.privacy
    return declared.client == "mean" if level == "client" else declared.sample


def check_privacy(cfg: Config, algorithm: Algorithm, federation: Federation,
                  models: dict[str, torch.nn.Module], hp: Any) -> None:
    """Refuse, naming the setting and what is valid, a private run this engine cannot
    account for; ``models``: each architecture's module, ``hp`` the algorithm's parsed
    hyperparameters."""
    from edgepfl.algorithms import ALGORITHMS

    p = cfg.privacy
    level = p.level
    if p.secure_aggregation:
        _check_secure(algorithm, federation, hp)
    if level == "none":
        return
    library()
    if not supports(algorithm, level):
        valid = [a.name for a in ALGORITHMS.values() if supports(a, level)]
        raise ConfigError(f"privacy.level = {level!r} is refused by algorithm.name = "
                          f"{algorithm.name!r}: {algorithm.privacy.refused}; algorithms with "
                          f"{level}-level privacy: {', '.join(valid)} (docs/algorithms.md, "
                          "'Differential privacy')")
    unaccounted = algorithm.privacy.unaccounted
    reason = unaccounted(hp) if unaccounted is not None else None
    if reason:
        raise ConfigError(f"privacy.level = {level!r} with {reason}")
    if level == "client":
        _check_client(cfg, federation)
    else:
        _check_sample(cfg, models)
    if p.noise_multiplier == 0:
        log.warning("privacy.noise_multiplier = 0: updates are clipped but not noised, so "
                    "there is no privacy guarantee (epsilon is infinite)")


def _check_secure(algorithm: Algorithm, federation: Federation, hp: Any) -> None:
    """Secure aggregation hands an aggregator the sample-weighted mean of its clients'
    updates and nothing else: the algorithm's aggregation must be that mean (what
    ``PrivacySupport(client='mean')`` declares), over one model every client was sent."""
    from edgepfl.algorithms import ALGORITHMS

    if algorithm.privacy.client != "mean":
        valid = [a.name for a in ALGORITHMS.values() if a.privacy.client == "mean"]
        raise ConfigError(
            f"privacy.secure_aggregation = true is refused by algorithm.name = "
            f"{algorithm.name!r}: its server needs more than the sample-weighted mean of the "
            f"clients' models ({algorithm.privacy.refused or 'each client own reply'}); "
            f"algorithms whose aggregation is that mean: {', '.join(valid)} "
            "(docs/deployment.md, 'Secure aggregation')")
    unsummed = algorithm.privacy.unsummed
    reason = unsummed(hp) if unsummed is not None else None
    if reason:
        raise ConfigError(f"privacy.secure_aggregation = true with {reason}")
    if len(federation.architectures) > 1:
        raise ConfigError(
            "privacy.secure_aggregation = true needs one architecture for every client, but "
            f"model.tiers gives {len(federation.architectures)}: a masked sum adds the same "
            "entries of every client (set model.tiers = {})")


def _check_client(cfg: Config, federation: Federation) -> None:
    p = cfg.privacy
    if len(federation.architectures) > 1:
        raise ConfigError(
            f"privacy.level = 'client' needs one architecture for every client, but model.tiers "
            f"gives {len(federation.architectures)} ({', '.join(federation.architectures)}): "
            "each parameter would be averaged over a different random set of clients, and the "
            "noised sum's fixed denominator per parameter is not implemented (set "
            "model.tiers = {})")
    if p.relation == "add_remove":
        raise ConfigError(
            "privacy.relation = 'add_remove' at client level: the engine samples a fixed "
            "number of the (public) clients, which is accounted under replace-one (one "
            "client's data replaced by another's); leave privacy.relation unset or set "
            "'replace_one'")
    if p.accountant != "rdp":
        raise ConfigError(
            f"privacy.accountant = {p.accountant!r}: client level samples a fixed number of "
            "clients without replacement each round, and among dp-accounting's accountants "
            "only rdp accounts for that sampling; set privacy.accountant = 'rdp'")
    if not federation.hierarchical:
        return
    if p.noise_at == "cloud":
        raise ConfigError(
            "privacy.noise_at = 'cloud' is refused: an edge hands its clients its average for "
            f"topology.edge_rounds = {federation.edge_rounds} edge round(s) before the cloud "
            "sees it, so that average would go out un-noised, and the edges would see the "
            "clients' updates anyway; set privacy.noise_at = 'edge' (each edge adds the noise "
            "to its clients' clipped sum; a client trusts its own edge)")
    if cfg.topology.mode != "sync":
        raise ConfigError(
            f"privacy.level = 'client' with topology.mode = {cfg.topology.mode!r}: an edge's "
            "number of edge rounds per cloud round then depends on simulated speeds, which "
            "the accounting does not follow; set topology.mode = 'sync'")


def _check_sample(cfg: Config, models: dict[str, torch.nn.Module]) -> None:
    if cfg.privacy.relation == "replace_one" and cfg.privacy.accountant != "pld":
        raise ConfigError(
            f"privacy.relation = 'replace_one' with privacy.accountant = "
            f"{cfg.privacy.accountant!r}: dp-accounting's RDP accountant has no Poisson "
            "sampling under replace-one; set privacy.accountant = 'pld'")
    if cfg.train.compile != "off":
        raise ConfigError(
            f"privacy.level = 'sample' with train.compile = {cfg.train.compile!r}: DP-SGD's "
            "per-sample gradients run eagerly, so nothing would be compiled; set "
            "train.compile = 'off'")
    if cfg.train.batch_clients:
        raise ConfigError(
            "privacy.level = 'sample' with train.batch_clients = true: the batched path "
            "vmaps over clients and would need per-sample gradients inside it (a second "
            "vmap level) that it does not compute; set train.batch_clients = false")
    if cfg.dataset.aspect_ratios:
        raise ConfigError(
            f"privacy.level = 'sample' with dataset.aspect_ratios = {cfg.dataset.aspect_ratios}: "
            "a Poisson-sampled batch mixes crop sizes, which do not stack into one tensor; "
            "set dataset.aspect_ratios = []")
    normed = [name for name, model in models.items()
              if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())]
    if normed:
        raise ConfigError(
            f"privacy.level = 'sample' with BatchNorm in model {', '.join(map(repr, normed))}: "
            "a BatchNorm output depends on the whole batch, so a sample has no gradient of "
            "its own to clip, and its running statistics leave the client un-noised; choose a "
            "model without BatchNorm (e.g. model.name = cnn2)")


def make_trainer(cfg: Config, model: torch.nn.Module, device: torch.device) -> Trainer:
    """The trainer of an architecture: DP-SGD's at sample level, else the plain one."""
    p = cfg.privacy
    if p.level == "sample":
        return PrivateTrainer(model, cfg.eval.batch_size, device=device, clip=float(p.clip),
                              noise_multiplier=p.noise_multiplier)
    return Trainer(model, cfg.eval.batch_size, device=device, compile=cfg.train.compile)
