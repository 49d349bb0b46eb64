"""The federation: who the clients are, what they run and whom they talk to.

One seeded description that every runtime reads: for each client its device tier (the
``system.tiers`` class that prices its compute), its model architecture (``model.tiers``
maps a tier to a model; the rest run ``model.name``) and its parent, the cloud (a star)
or one of ``topology.edges`` edge servers. Its data view is the partition's row for the
same client id. A star of one architecture is exactly the federation every run had
before hierarchies and tiers existed: nothing here draws randomness in that case.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from edgepfl.errors import ConfigError
from edgepfl.federation.rng import derive_seed, select_clients

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


def assign_edges(num_clients: int, edges: int, assignment: str, seed: int,
                 parents: list[int] | None = None) -> list[int]:
    """Each client's edge server (``CLOUD`` for all in a star), checked: every edge has a
    client and no client names an edge that does not exist."""
    if edges == 0:
        if parents:
            raise ConfigError("topology.parents is set but topology.edges = 0 (a star has no "
                              "edges); set topology.edges to the number of edge servers")
        return [CLOUD] * num_clients
    if edges > num_clients:
        raise ConfigError(f"topology.edges = {edges} is more than the {num_clients} clients; "
                          f"valid: 0 (star) to {num_clients}")
    if assignment == "explicit":
        if len(parents or []) != num_clients:
            raise ConfigError(f"topology.assignment = 'explicit' needs topology.parents with one "
                              f"edge per client ({num_clients}); it has {len(parents or [])}")
        bad = [p for p in parents if not 0 <= p < edges]
        if bad:
            raise ConfigError(f"topology.parents holds {sorted(set(bad))}; edges are 0..{edges - 1}")
        out = list(parents)
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

    def select(self, seed: int, rnd: int, participation: float) -> list[int]:
        """The round's clients: in a star, the seeded sample every run has drawn
        (``select_clients``); in a hierarchy, round(participation * n_k), at least 1, of
        each edge's n_k clients, from a stream of the edge's own."""
        if not self.hierarchical:
            return select_clients(seed, rnd, self.num_clients, participation)
        chosen: list[int] = []
        for k in range(self.edges):
            members = self.members(k)
            picked = select_clients(derive_seed(seed, "edge", k), rnd, len(members), participation)
            chosen += [members[i] for i in picked]
        return sorted(chosen)

    def to_json(self) -> dict:
        return {"edges": self.edges, "edge_rounds": self.edge_rounds,
                "clients": [{"client": c, "tier": self.tier[c], "arch": self.arch[c],
                             "parent": "cloud" if self.parent[c] == CLOUD else self.parent[c]}
                            for c in range(self.num_clients)]}

    @classmethod
    def build(cls, cfg: Config, num_clients: int) -> Federation:
        """``cfg`` resolved (``model.name`` filled in)."""
        system, model, topo = cfg.system, cfg.model, cfg.topology
        if topo.edges == 0:  # what only a hierarchy reads is an error in a star, not a no-op
            defaults = type(system).model_fields
            for key in ("backhaul_mbps", "edge_flops"):
                if getattr(system, key) != defaults[key].default:
                    raise ConfigError(f"system.{key} = {getattr(system, key)!r} prices the "
                                      "edge servers of a hierarchy, but topology.edges = 0 (a "
                                      "star); set topology.edges, or leave system." + key)
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
        arch = tuple(model.tiers.get(t, model.name) if t is not None else model.name for t in tier)
        parent = assign_edges(num_clients, topo.edges, topo.assignment, cfg.seed, topo.parents)
        if topo.edge_rounds > 1 and topo.edges == 0:
            raise ConfigError(f"topology.edge_rounds = {topo.edge_rounds} needs edge servers; "
                              "set topology.edges >= 1 (0 = star, where it must be 1)")
        order = (model.name, *(model.tiers[t.name] for t in system.tiers if t.name in model.tiers))
        return cls(tier, flops, arch, tuple(parent), topo.edges, topo.edge_rounds, order)
