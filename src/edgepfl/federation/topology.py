"""The federation: who the clients are, what they run and whom they talk to.

One seeded description that every runtime reads: for each client its device tier (the
``system.tiers`` class that prices its compute), its model architecture (``model.tiers``
maps a tier to a model; the rest run ``model.name``) and its parent, the cloud (a star)
or one of ``topology.edges`` edge servers. Its data view is the partition's row for the
same client id. A star of one architecture is exactly the federation every run had
before hierarchies and tiers existed: nothing here draws randomness in that case.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from edgepfl.errors import ConfigError
from edgepfl.federation.rng import derive_seed, generator, select_clients

if TYPE_CHECKING:
    from edgepfl.config import Config
    from edgepfl.system_config import DeviceTier

CLOUD = -1


def tier_counts(tiers: list[DeviceTier], num_clients: int) -> list[int]:
    """Clients per tier: shares times N, rounded by largest remainder so they add up to N.

    Exact counts rather than independent draws, so a 3:4:3 split of 10 clients is 3, 4, 3
    and not whatever a small sample happens to give.
    """
    raw = np.array([t.share for t in tiers]) * num_clients
    counts = np.floor(raw).astype(int)
    for i in np.argsort(-(raw - counts), kind="stable")[: num_clients - counts.sum()]:
        counts[i] += 1
    return counts.tolist()


def assign_tiers(tiers: list[DeviceTier], num_clients: int, seed: int) -> list[DeviceTier]:
    """Each client's device tier: exact shares, placed by a seeded permutation."""
    labels = [t for t, c in zip(tiers, tier_counts(tiers, num_clients), strict=True)
              for _ in range(c)]
    order = np.random.default_rng(derive_seed(seed, "system", "tiers")).permutation(num_clients)
    return [labels[i] for i in np.argsort(order)]


def default_assignment(scheme: str) -> str:
    """``topology.assignment`` when unset: the split's own edges for a hierarchical split."""
    return "partition" if scheme == "hierarchical" else "random"


def _split_edges(num_clients: int, edges: int, parents: list[int] | None,
                 split_edges: Sequence[int] | None) -> list[int]:
    """topology.assignment = partition: each client under the edge its data was drawn for."""
    if parents:
        raise ConfigError("topology.parents applies only to topology.assignment = 'explicit', "
                          "not 'partition'")
    if split_edges is None or len(split_edges) != num_clients:
        raise ConfigError("topology.assignment = 'partition' puts each client under the edge "
                          "its data was drawn for, which only partition.scheme = "
                          "'hierarchical' draws; use it with that scheme, or another "
                          "assignment: similar, random, contiguous, explicit")
    out = [int(k) for k in split_edges]
    if max(out, default=-1) + 1 != edges:
        raise ConfigError(f"topology.assignment = 'partition' puts each client under the "
                          f"edge its data was drawn for, but the split has "
                          f"{max(out, default=-1) + 1} edges (partition.edges) and "
                          f"topology.edges = {edges}; make them equal, or choose another "
                          f"assignment: similar, random, contiguous, explicit")
    return out


def assign_edges(num_clients: int, edges: int, assignment: str, seed: int,
                 parents: list[int] | None = None, split_edges: Sequence[int] | None = None,
                 histograms: np.ndarray | None = None) -> list[int]:
    """Each client's edge server (``CLOUD`` for all in a star), checked: every edge has a
    client and no client names an edge that does not exist. ``split_edges``: each client's
    edge in a hierarchical partition (``partition``); ``histograms``: the [N, C] train label
    counts (``similar``)."""
    if edges == 0:
        if parents:
            raise ConfigError("topology.parents is set but topology.edges = 0 (a star has no "
                              "edges); set topology.edges to the number of edge servers")
        return [CLOUD] * num_clients
    if edges > num_clients:
        raise ConfigError(f"topology.edges = {edges} is more than the {num_clients} clients; "
                          f"valid: 0 (star) to {num_clients}")
    if assignment == "explicit":
        explicit = parents or []
        if len(explicit) != num_clients:
            raise ConfigError(f"topology.assignment = 'explicit' needs topology.parents with one "
                              f"edge per client ({num_clients}); it has {len(explicit)}")
        bad = [p for p in explicit if not 0 <= p < edges]
        if bad:
            raise ConfigError(f"topology.parents holds {sorted(set(bad))}; edges are 0..{edges - 1}")
        out = list(explicit)
    elif assignment == "partition":
        out = _split_edges(num_clients, edges, parents, split_edges)
    elif assignment == "similar":
        if parents:
            raise ConfigError("topology.parents applies only to topology.assignment = 'explicit', "
                              "not 'similar'")
        if histograms is None or len(histograms) != num_clients:
            raise ConfigError("topology.assignment = 'similar' groups clients by their label "
                              "histograms, which this federation was not given")
        out = similar_groups(histograms, edges, derive_seed(seed, "topology", "similar"))
    else:
        if parents:
            raise ConfigError(f"topology.parents applies only to topology.assignment = 'explicit', "
                              f"not {assignment!r}")
        # sizes differ by at most one; contiguous keeps client order, random permutes it
        out = [int(k) for k in np.arange(num_clients) * edges // num_clients]
        if assignment == "random":
            perm = np.random.default_rng(derive_seed(seed, "topology", "edges")).permutation(num_clients)
            out = [out[i] for i in np.argsort(perm)]
    empty = sorted(set(range(edges)) - set(out))
    if empty:
        raise ConfigError(f"edges {empty} have no clients; every edge of topology.edges = {edges} "
                          "needs at least one")
    return out


def _sizes(n: int, k: int) -> np.ndarray:
    """k group sizes of n clients differing by at most one (contiguous's)."""
    return np.bincount(np.arange(n) * k // n, minlength=k)


SIMILAR_ITERS = 50


def similar_groups(histograms: np.ndarray, k: int, seed: int) -> list[int]:
    """Clients grouped into ``k`` groups of sizes differing by at most one, clients of close
    normalised label histograms together: balanced k-means. Centres start at a seeded
    k-means++ draw; each pass assigns the (client, centre) pairs in increasing squared
    distance, a client to the first centre with room, then moves each centre to its
    clients' mean, until the groups stop changing. Deterministic given ``seed``."""
    counts = np.asarray(histograms, dtype=np.float64)
    n = counts.shape[0]
    totals = counts.sum(1, keepdims=True)
    p = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    rng = np.random.default_rng(seed)
    centres = [p[int(rng.integers(n))]]
    for _ in range(1, k):  # k-means++: the next centre far from those chosen
        d = np.min([((p - c) ** 2).sum(1) for c in centres], axis=0)
        total = d.sum()
        pick = int(rng.choice(n, p=d / total)) if total > 0 else int(rng.integers(n))
        centres.append(p[pick])
    centre = np.stack(centres)
    room = _sizes(n, k)
    group = np.full(n, -1, dtype=np.int64)
    for _ in range(SIMILAR_ITERS):
        dist = ((p[:, None, :] - centre[None, :, :]) ** 2).sum(2)  # [n, k]
        order = np.argsort(dist, axis=None, kind="stable")
        new = np.full(n, -1, dtype=np.int64)
        left = room.copy()
        for flat in order:
            i, j = divmod(int(flat), k)
            if new[i] < 0 and left[j] > 0:
                new[i] = j
                left[j] -= 1
        if np.array_equal(new, group):
            break
        group = new
        centre = np.stack([p[group == j].mean(0) for j in range(k)])
    return [int(g) for g in group]


@dataclass(frozen=True)
class Federation:
    """Per client: tier (None without ``system.devices = 'tiers'``), architecture, parent."""

    tier: tuple[str | None, ...]
    tier_flops: tuple[float | None, ...]
    arch: tuple[str, ...]
    parent: tuple[int, ...]
    edges: int = 0
    edge_rounds: int = 1
    order: tuple[str, ...] = ()  # architectures in configuration order: model.name, then tiers
    # clients held out of training (eval.new_clients): never selected, served at evaluation
    held_out: tuple[int, ...] = ()

    @property
    def num_clients(self) -> int:
        return len(self.arch)

    @property
    def hierarchical(self) -> bool:
        return self.edges > 0

    @property
    def architectures(self) -> list[str]:
        """The architectures clients run, in configuration order: ``model.name`` first,
        then ``model.tiers``' models in the order of ``system.tiers``."""
        used = set(self.arch)
        return [a for a in dict.fromkeys((*self.order, *self.arch)) if a in used]

    def members(self, edge: int) -> list[int]:
        return [cid for cid, p in enumerate(self.parent) if p == edge]

    @property
    def trained(self) -> list[int]:
        """The clients that may train: all but the held-out ones (``eval.new_clients``)."""
        held = set(self.held_out)
        return [cid for cid in range(self.num_clients) if cid not in held]

    def select(self, seed: int, rnd: int, participation: float) -> list[int]:
        """The round's clients: in a star, the seeded sample every run has drawn
        (``select_clients``); in a hierarchy, round(participation * n_k), at least 1, of
        each edge's n_k clients, from a stream of the edge's own. Held-out clients
        (``eval.new_clients``) are never chosen: the sample is drawn among the others."""
        held = set(self.held_out)
        if not self.hierarchical:
            pool = self.trained
            return [pool[i] for i in select_clients(seed, rnd, len(pool), participation)]
        chosen: list[int] = []
        for k in range(self.edges):
            members = [c for c in self.members(k) if c not in held]
            picked = select_clients(derive_seed(seed, "edge", k), rnd, len(members), participation)
            chosen += [members[i] for i in picked]
        return sorted(chosen)

    def to_json(self) -> dict:
        return {"edges": self.edges, "edge_rounds": self.edge_rounds,
                "clients": [{"client": c, "tier": self.tier[c], "arch": self.arch[c],
                             "parent": "cloud" if self.parent[c] == CLOUD else self.parent[c],
                             **({"held_out": True} if c in self.held_out else {})}
                            for c in range(self.num_clients)]}

    @classmethod
    def build(cls, cfg: Config, num_clients: int, split_edges: Sequence[int] | None = None,
              histograms: np.ndarray | None = None) -> Federation:
        """``cfg`` resolved (``model.name`` filled in). ``split_edges`` and ``histograms``:
        a hierarchical partition's edge per client and the clients' [N, C] train label
        counts, which topology.assignment = partition and similar read."""
        system, model, topo = cfg.system, cfg.model, cfg.topology
        name = cast(str, model.name)  # filled in by resolution
        assignment = topo.assignment or default_assignment(cfg.partition.scheme)
        if assignment == "partition" and cfg.partition.scheme != "hierarchical":
            raise ConfigError(f"topology.assignment = 'partition' puts each client under the edge "
                              f"its data was drawn for, which only partition.scheme = "
                              f"'hierarchical' draws; partition.scheme = "
                              f"{cfg.partition.scheme!r} draws no edges: use "
                              f"topology.assignment = 'similar' (edges of clients with close "
                              f"label histograms), random, contiguous or explicit")
        if topo.edges == 0:  # what only a hierarchy reads is an error in a star, not a no-op
            defaults = type(system).model_fields
            for key in ("backhaul_mbps", "edge_flops"):
                if getattr(system, key) != defaults[key].default:
                    raise ConfigError(f"system.{key} = {getattr(system, key)!r} prices the "
                                      "edge servers of a hierarchy, but topology.edges = 0 (a "
                                      "star); set topology.edges, or leave system." + key)
        tier: tuple[str | None, ...]
        flops: tuple[float | None, ...]
        if system.devices == "tiers":
            assigned = assign_tiers(system.tiers, num_clients, cfg.seed)
            tier = tuple(t.name for t in assigned)
            flops = tuple(float(t.flops) for t in assigned)
        else:
            tier, flops = (None,) * num_clients, (None,) * num_clients
        if model.tiers:
            if system.devices != "tiers":
                raise ConfigError("model.tiers maps device tiers to models, but system.devices = "
                                  f"{system.devices!r}; set system.devices = 'tiers'")
            names = [t.name for t in system.tiers]
            unknown = sorted(set(model.tiers) - set(names))
            if unknown:
                raise ConfigError(f"model.tiers names tiers {unknown}; system.tiers has {names}")
        arch = tuple(model.tiers.get(t, name) if t is not None else name for t in tier)
        parent = assign_edges(num_clients, topo.edges, assignment, cfg.seed, topo.parents,
                              split_edges, histograms)
        if topo.edge_rounds > 1 and topo.edges == 0:
            raise ConfigError(f"topology.edge_rounds = {topo.edge_rounds} needs edge servers; "
                              "set topology.edges >= 1 (0 = star, where it must be 1)")
        order = (name, *(model.tiers[t.name] for t in system.tiers if t.name in model.tiers))
        held = held_out_clients(cfg.seed, num_clients, cfg.eval.new_clients, parent, topo.edges)
        return cls(tier, flops, arch, tuple(parent), topo.edges, topo.edge_rounds, order, held)


def held_out_clients(seed: int, num_clients: int, share: float, parent: Sequence[int],
                     edges: int) -> tuple[int, ...]:
    """The clients ``eval.new_clients`` holds out of training: round(share * N), at least
    one when the share is above 0, drawn from the run seed alone (the same clients for
    every algorithm at a seed). Refused where no client, or no client of an edge, would
    be left to train."""
    if share <= 0:
        return ()
    count = max(1, round(share * num_clients))
    if count >= num_clients:
        raise ConfigError(f"eval.new_clients = {share} holds out {count} of the "
                          f"{num_clients} clients, which leaves none to train; give a "
                          f"share below {(num_clients - 1) / num_clients:.3g}")
    perm = torch.randperm(num_clients, generator=generator(seed, "new-clients"))
    held = tuple(sorted(perm[:count].tolist()))
    for k in range(edges):
        members = [c for c, p in enumerate(parent) if p == k]
        if members and set(members) <= set(held):
            raise ConfigError(f"eval.new_clients = {share} holds out every client of edge {k} "
                              f"(clients {members}), which leaves it none to train; give a "
                              "smaller share (or more clients per edge)")
    return held
