"""Splitting a data set's labels into per-client index sets.

A partition is computed from labels alone and is fully determined by its arguments and
seed, so two algorithms compared on the same seed train on exactly the same clients. Every
scheme first decides *how many* samples of each class each client gets (an ``[N, C]`` count
matrix) and only then *which* ones, by one seeded draw per class without replacement; the
test split reuses the train count matrix, so a client is evaluated on the label mix it
trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from edgepfl.errors import ConfigError, DataError

if TYPE_CHECKING:
    from edgepfl.config import PartitionConfig
    from edgepfl.data.datasets import Dataset

SCHEMES: dict[str, str] = {
    "iid": "uniform: a seeded shuffle split into near-equal parts",
    "dirichlet": "label skew: each class spread over clients by proportions ~ Dir(alpha) "
    "(smaller alpha = more skewed)",
    "pathological": "each client holds exactly classes_per_client classes, each class split "
    "evenly among the clients that hold it",
    "primary_secondary": "DC-PFL: equal sizes; a primary class with 40-60% of a client's data, "
    "a secondary with 20-40%, the rest spread over the other classes",
    "hierarchical": "edges that differ: each of partition.edges (default topology.edges) "
    "edges draws a class mix ~ Dir(edge_alpha), each of its clients (spread over the edges as evenly as possible, "
    "consecutive ids) a mix ~ Dir(alpha x its edge's mix); each class is then cut over the "
    "clients in proportion to their mixes, as dirichlet cuts it (sizes vary)",
    "natural": "each sample's client from the data (npz 'client' array, hf dataset.client_column, "
    "image folders <client>/<class>/), as FEMNIST-style data sets come; partition.clients = the "
    "number of clients in the data",
}

DIRICHLET_MAX_DRAWS = 1000
PRIMARY_SECONDARY_MAX_DRAWS = 100
PRIMARY_SHARE = (0.4, 0.6)
SECONDARY_SHARE = (0.2, 0.4)
_SEED_TAG = 0x5041_5254  # keeps these streams apart from other uses of the same user seed


@dataclass(frozen=True, eq=False)  # eq=False: lists of tensors have no useful ==
class Partition:
    """Per-client sorted int64 index tensors into a data set's train and test tensors."""

    train: list[torch.Tensor]
    test: list[torch.Tensor]
    num_classes: int
    scheme: str
    edges: tuple[int, ...] | None = None  # hierarchical: each client's edge in the split

    @property
    def num_clients(self) -> int:
        return len(self.train)

    def class_counts(
        self, y_train: torch.Tensor, y_test: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray]:
        """``[N, C]`` int64 label counts of every client's train and test share."""
        ytr = _labels(y_train, "y_train", self.num_classes)
        yte = _labels(y_test, "y_test", self.num_classes)
        return _counts(self.train, ytr, self.num_classes), _counts(self.test, yte, self.num_classes)

    def to_json(self, y_train: torch.Tensor, y_test: torch.Tensor) -> dict[str, Any]:
        """A summary for reports and run directories (sizes and label counts, no indices)."""
        train_counts, test_counts = self.class_counts(y_train, y_test)
        out: dict[str, Any] = {
            "scheme": self.scheme,
            "num_clients": self.num_clients,
            "num_classes": self.num_classes,
            "clients": [
                {
                    "train_size": int(train_counts[i].sum()),
                    "test_size": int(test_counts[i].sum()),
                    "train_class_counts": [int(v) for v in train_counts[i]],
                    "test_class_counts": [int(v) for v in test_counts[i]],
                }
                for i in range(self.num_clients)
            ],
        }
        if self.edges is not None:  # the edge each client's data was drawn for
            out["edges"] = max(self.edges) + 1
            for row, edge in zip(out["clients"], self.edges, strict=True):
                row["edge"] = edge
        return out


def make_partition(
    y_train: torch.Tensor,
    y_test: torch.Tensor,
    num_classes: int,
    scheme: str,
    clients: int,
    seed: int,
    alpha: float = 0.3,
    min_size: int = 10,
    classes_per_client: int = 2,
    train_clients: torch.Tensor | None = None,
    test_clients: torch.Tensor | None = None,
    edges: int = 0,
    edge_alpha: float = 0.3,
) -> Partition:
    """Split train and test labels over ``clients`` clients with the named scheme.

    Only the parameters the scheme uses are checked (``alpha`` and ``min_size`` for
    dirichlet, the same and ``edges``, ``edge_alpha`` for hierarchical,
    ``classes_per_client`` for pathological, ``train_clients`` for natural:
    each training sample's client in ``0..clients-1``). A natural split's test samples go
    to the clients ``test_clients`` names; without them, as in every other scheme, each
    client gets the share of each class's test samples it has of its training samples.
    """
    num_classes = _check_scheme(scheme, num_classes)
    ytr = _labels(y_train, "y_train", num_classes)
    yte = _labels(y_test, "y_test", num_classes)
    n = ytr.size
    clients = _check_clients(clients, n)

    # Separate streams for train and test: the train split never depends on the test labels.
    train_ss, test_ss = np.random.SeedSequence([int(seed) % 2**64, _SEED_TAG]).spawn(2)
    rng = np.random.default_rng(train_ss)
    totals = np.bincount(ytr, minlength=num_classes)
    edge_of = None
    if scheme == "hierarchical":
        edge_of = _edge_of(clients, edges)
        counts = _hierarchical(totals, edge_of, rng, alpha, edge_alpha, min_size)
        owner = _assign(ytr, counts, rng)
    else:
        owner, counts = _train_owners(scheme, ytr, totals, clients, rng, alpha, min_size,
                                      classes_per_client, train_clients)
    _check_nonempty(counts, scheme, n, clients)
    if scheme == "natural" and test_clients is not None:
        test_owner = _owners(test_clients, yte.size, clients, "test")
    else:
        test_rng = np.random.default_rng(test_ss)
        test_counts = _test_counts(counts, totals, np.bincount(yte, minlength=num_classes),
                                   test_rng)
        test_owner = _assign(yte, test_counts, test_rng)
    return Partition(
        train=_split(owner, clients),
        test=_split(test_owner, clients),
        num_classes=num_classes,
        scheme=scheme,
        edges=None if edge_of is None else tuple(int(e) for e in edge_of),
    )


# --------------------------------------------------------------------------- helpers


def _check_nonempty(counts: np.ndarray, scheme: str, n: int, clients: int) -> None:
    """Every client needs training samples."""
    empty = np.flatnonzero(counts.sum(1) == 0)
    if empty.size and scheme == "natural":
        raise DataError(
            f"natural partition: client {int(empty[0])} (and {empty.size - 1} more) has no "
            f"train samples in the data; every client needs some (a larger dataset.fraction)")
    if empty.size:
        raise DataError(
            f"{scheme} partition left client {int(empty[0])} (and {empty.size - 1} more) with no "
            f"train samples ({n} samples over {clients} clients); use fewer clients"
        )


def _train_owners(scheme: str, ytr: np.ndarray, totals: np.ndarray, clients: int,
                  rng: np.random.Generator, alpha: float, min_size: int,
                  classes_per_client: int, train_clients: torch.Tensor | None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Each training sample's client and the [clients, classes] counts, by ``scheme``."""
    n, num_classes = ytr.size, totals.size
    if scheme in ("iid", "natural"):
        if scheme == "iid":
            owner = _iid(n, clients, rng)
        else:
            owner = _owners(train_clients, n, clients, "train")
        counts = np.bincount(owner * num_classes + ytr, minlength=clients * num_classes).reshape(
            clients, num_classes
        )
        return owner, counts
    if scheme == "dirichlet":
        counts = _dirichlet(totals, clients, rng, alpha, min_size)
    elif scheme == "pathological":
        counts = _pathological(totals, clients, rng, classes_per_client)
    else:
        counts = _primary_secondary(totals, clients, rng)
    return _assign(ytr, counts, rng), counts


def _check_scheme(scheme: str, num_classes: Any) -> int:
    if scheme not in SCHEMES:
        raise ConfigError(
            f"unknown partition scheme {scheme!r}; choose one of: {', '.join(SCHEMES)}"
        )
    if isinstance(num_classes, bool) or not isinstance(num_classes, int | np.integer):
        raise ConfigError(f"num_classes must be an integer >= 1, got {num_classes!r}")
    num_classes = int(num_classes)
    if num_classes < 1:
        raise ConfigError(f"num_classes must be an integer >= 1, got {num_classes}")
    return num_classes


def _owners(ids: Any, n: int, clients: int, split: str) -> np.ndarray:
    """A natural split's client of every sample of ``split``, checked."""
    if ids is None:
        raise ConfigError(
            "partition.scheme = 'natural' takes each sample's client from the data, but this "
            "data set names none; give them (an npz 'client' array, dataset.client_column of an "
            f"hf set, image folders <client>/<class>/), or choose another scheme: "
            f"{', '.join(s for s in SCHEMES if s != 'natural')}")
    arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if arr.shape != (n,) or (arr.size and arr.dtype.kind not in "iu"):
        raise DataError(f"natural partition: {split} client ids must be {n} integers, got shape "
                        f"{arr.shape} of {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    bad = arr[(arr < 0) | (arr >= clients)]
    if bad.size:
        raise DataError(f"natural partition: {split} sample of client {int(bad[0])}, but "
                        f"partition.clients = {clients} (valid ids 0..{clients - 1})")
    return arr


def partition_of(cfg: PartitionConfig, dataset: Dataset, seed: int,
                 edges: int = 0) -> Partition:
    """The partition a run's ``partition`` settings give ``dataset`` (every runtime splits
    it this way); ``edges``, ``topology.edges``, is read by the hierarchical scheme only, and
    only where ``partition.edges`` is unset. A
    natural split needs ``partition.clients`` to be the number of clients
    the data names: the settings stay the whole description of the federation (the system
    model, topology and algorithms read that number before any data is loaded). Left
    unset, it is the data's count (``engine.parts.natural_clients``, at ``resolve``)."""
    natural = cfg.scheme == "natural"
    if natural and dataset.client_train is not None and cfg.clients != len(dataset.clients):
        names = ", ".join(dataset.clients[:5]) + (", ..." if len(dataset.clients) > 5 else "")
        raise ConfigError(
            f"partition.scheme = 'natural': data set {dataset.name!r} has "
            f"{len(dataset.clients)} clients ({names}), but partition.clients = {cfg.clients}; "
            f"set partition.clients = {len(dataset.clients)}, or leave it out (a natural "
            f"split then takes the data's count)")
    if natural and dataset.client_train is not None:
        sizes = np.bincount(dataset.client_train.numpy(), minlength=len(dataset.clients))
        if (sizes == 0).any():
            empty = dataset.clients[int(np.flatnonzero(sizes == 0)[0])]
            raise DataError(
                f"partition.scheme = 'natural': client {empty!r} of data set {dataset.name!r} "
                f"has no training samples (all of its samples are test samples, or "
                f"dataset.fraction left none); give it training samples or remove it")
    return make_partition(
        dataset.y_train, dataset.y_test, dataset.num_classes, cfg.scheme, cfg.clients, seed,
        alpha=cfg.alpha, min_size=cfg.min_size, classes_per_client=cfg.classes_per_client,
        train_clients=dataset.client_train if natural else None,
        test_clients=dataset.client_test if natural else None,
        edges=edges if cfg.edges is None else cfg.edges, edge_alpha=cfg.edge_alpha)


def _check_clients(clients: Any, n: int) -> int:
    if isinstance(clients, bool) or not isinstance(clients, int | np.integer):
        raise ConfigError(f"partition.clients must be an integer in [1, {n}], got {clients!r}")
    clients = int(clients)
    if not 1 <= clients <= n:
        raise ConfigError(
            f"partition.clients={clients} is out of range: it must be in [1, {n}] "
            f"(at most the number of train samples, {n})"
        )
    return clients


def _labels(y: Any, what: str, num_classes: int) -> np.ndarray:
    arr = y.detach().cpu().numpy() if isinstance(y, torch.Tensor) else np.asarray(y)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise DataError(
            f"{what} must be a 1-D integer label tensor, got shape {arr.shape} of {arr.dtype}"
        )
    arr = arr.astype(np.int64, copy=False)
    bad = arr[(arr < 0) | (arr >= num_classes)]
    if bad.size:
        raise DataError(f"{what} has label {int(bad[0])}, valid labels are 0..{num_classes - 1}")
    return arr


def _counts(parts: list[torch.Tensor], y: np.ndarray, num_classes: int) -> np.ndarray:
    out = np.zeros((len(parts), num_classes), dtype=np.int64)
    for i, idx in enumerate(parts):
        out[i] = np.bincount(y[idx.numpy()], minlength=num_classes)
    return out


def _iid(n: int, clients: int, rng: np.random.Generator) -> np.ndarray:
    sizes = np.full(clients, n // clients, dtype=np.int64)
    sizes[: n % clients] += 1
    owner = np.empty(n, dtype=np.int64)
    owner[rng.permutation(n)] = np.repeat(np.arange(clients), sizes)
    return owner


def _assign(labels: np.ndarray, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Owner of every sample (-1 = unused), drawing ``counts[i, c]`` class-c samples for i.

    One random key per sample, sorted within class, is a uniform draw without replacement
    for all classes at once.
    """
    clients, num_classes = counts.shape
    totals = np.bincount(labels, minlength=num_classes)
    taken = counts.sum(0)
    assert (taken <= totals).all(), "count matrix asks for more samples than a class has"
    order = np.lexsort((rng.random(labels.size), labels))  # by class, random within class
    class_start = np.cumsum(totals) - totals
    owners = np.repeat(np.tile(np.arange(clients), num_classes), counts.T.ravel())
    first = np.cumsum(taken) - taken
    within = np.arange(owners.size) - np.repeat(first, taken)
    positions = np.repeat(class_start, taken) + within
    owner = np.full(labels.size, -1, dtype=np.int64)
    owner[order[positions]] = owners
    return owner


def _split(owner: np.ndarray, clients: int) -> list[torch.Tensor]:
    # A stable sort by owner keeps each client's indices in increasing order.
    order = np.argsort(owner, kind="stable").astype(np.int64)
    sizes = np.bincount(owner[owner >= 0], minlength=clients)
    bounds = np.count_nonzero(owner < 0) + np.concatenate(([0], np.cumsum(sizes)))
    return [torch.from_numpy(order[bounds[i] : bounds[i + 1]].copy()) for i in range(clients)]


def _largest_remainder(
    exact: np.ndarray, target: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """Round each column of ``exact`` down, then add 1 to the ``target - floor-sum`` rows with
    the largest remainders (random tie-break), so column sums hit ``target`` exactly.

    Rows whose exact value is 0 never receive a unit as long as target <= ceil(column sum).
    """
    floor = np.floor(exact).astype(np.int64)
    left = np.clip(target - floor.sum(0), 0, None)
    frac = exact - floor
    order = np.lexsort((rng.random(exact.shape), -frac), axis=0)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(exact.shape[0])[:, None], axis=0)
    return floor + (rank < left[None, :])


# --------------------------------------------------------------------------- schemes


def _check_alpha(alpha: Any, key: str = "partition.alpha") -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float | np.number):
        raise ConfigError(f"{key} must be a number > 0, got {alpha!r}")
    if not (0.0 < float(alpha) < math.inf):  # the comparison also rejects NaN
        raise ConfigError(f"{key} must be > 0 (and finite), got {alpha}")
    return float(alpha)


def _check_min_size(min_size: Any, clients: int, totals: np.ndarray, scheme: str) -> int:
    if isinstance(min_size, bool) or not isinstance(min_size, int | np.integer) or min_size < 0:
        raise ConfigError(f"partition.min_size must be an integer >= 0, got {min_size!r}")
    n = int(totals.sum())
    need = max(int(min_size), 1)  # a client without data cannot train
    if need * clients > n:
        raise DataError(
            f"{scheme}: {clients} clients x min_size {need} = {need * clients} train samples "
            f"needed but the data has {n}; lower partition.min_size or partition.clients"
        )
    return need


def _cut(props: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """The [N, C] counts of cutting each class c at the cumulative proportions
    ``props[c]`` over the clients: floor keeps cuts monotone, and the last cut is the
    class size so every sample is used."""
    cuts = np.minimum(np.floor(np.cumsum(props, axis=1) * totals[:, None]), totals[:, None])
    cuts[:, -1] = totals
    return np.diff(cuts.astype(np.int64), axis=1, prepend=0).T


def _dirichlet(
    totals: np.ndarray, clients: int, rng: np.random.Generator, alpha: float, min_size: int
) -> np.ndarray:
    alpha = _check_alpha(alpha)
    need = _check_min_size(min_size, clients, totals, "dirichlet")
    smallest = 0
    for _ in range(DIRICHLET_MAX_DRAWS):
        props = rng.dirichlet(np.full(clients, float(alpha)), size=totals.size)  # [C, N]
        counts = _cut(props, totals)  # [N, C]
        sizes = counts.sum(1)
        if sizes.min() >= need:
            return counts
        smallest = max(smallest, int(sizes.min()))
    raise DataError(
        f"dirichlet: in {DIRICHLET_MAX_DRAWS} draws with alpha={alpha} no split gave all "
        f"{clients} clients at least min_size={need} train samples (best smallest client: "
        f"{smallest}); lower partition.min_size or partition.clients, or raise partition.alpha"
    )


def _edge_of(clients: int, edges: Any) -> np.ndarray:
    """Each client's edge in a hierarchical split: as even as possible, consecutive ids (the
    sizes of topology.assignment = contiguous)."""
    if isinstance(edges, bool) or not isinstance(edges, int | np.integer) \
            or not 1 <= edges <= clients:
        raise ConfigError(
            f"partition.scheme = 'hierarchical' draws a class mix per edge server, so it needs "
            f"partition.edges (or, unset, topology.edges) between 1 and partition.clients "
            f"({clients}); got {edges!r}{' (a star)' if edges == 0 else ''}. Set topology.edges "
            f"or partition.edges (a star's methods: the same split, no edge servers), or "
            f"choose a scheme without edges: "
            f"{', '.join(s for s in SCHEMES if s != 'hierarchical')}")
    return np.arange(clients) * int(edges) // clients


# the smallest concentration a client's Dir(alpha x edge mix) gets: an edge's mix can hold
# classes at 1e-30, which numpy's sampler refuses at 0 and turns to NaN near it
MIN_CONCENTRATION = 1e-6


def _hierarchical(totals: np.ndarray, edge_of: np.ndarray, rng: np.random.Generator,
                  alpha: float, edge_alpha: float, min_size: int) -> np.ndarray:
    """Edge k's class mix pi_k ~ Dir(edge_alpha), client i's q_i ~ Dir(alpha pi_k(i)); class c
    cut over the clients in proportion to q_ic (dirichlet's cut, so every sample is used
    and sizes vary as there). Redrawn, up to DIRICHLET_MAX_DRAWS times, until every client
    has min_size samples."""
    alpha = _check_alpha(alpha)
    edge_alpha = _check_alpha(edge_alpha, "partition.edge_alpha")
    clients, num_classes = edge_of.size, totals.size
    need = _check_min_size(min_size, clients, totals, "hierarchical")
    edges = int(edge_of.max()) + 1
    smallest = 0
    for _ in range(DIRICHLET_MAX_DRAWS):
        mix = rng.dirichlet(np.full(num_classes, edge_alpha), size=edges)  # [K, C]
        conc = np.maximum(alpha * mix[edge_of], MIN_CONCENTRATION)  # [N, C]
        q = np.stack([rng.dirichlet(row) for row in conc])  # [N, C]
        q = np.nan_to_num(q, nan=0.0)
        mass = q.sum(0)  # [C]: a class no client wants is spread evenly
        props = np.where(mass[None, :] > 0, q / np.where(mass > 0, mass, 1.0)[None, :],
                         1.0 / clients).T  # [C, N]
        counts = _cut(props, totals)
        sizes = counts.sum(1)
        if sizes.min() >= need:
            return counts
        smallest = max(smallest, int(sizes.min()))
    raise DataError(
        f"hierarchical: in {DIRICHLET_MAX_DRAWS} draws with alpha={alpha}, edge_alpha="
        f"{edge_alpha} no split gave all {clients} clients at least min_size={need} train "
        f"samples (best smallest client: {smallest}); lower partition.min_size or "
        f"partition.clients, or raise partition.alpha")


def _pathological(totals: np.ndarray, clients: int, rng: np.random.Generator, k: int) -> np.ndarray:
    num_classes = totals.size
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or not 1 <= k <= num_classes:
        raise ConfigError(
            f"partition.classes_per_client={k!r} is out of range: it must be an integer in "
            f"[1, {num_classes}] (the number of classes)"
        )
    k = int(k)
    # Client i holds classes (i*k + j) mod C: consecutive blocks wrap around, so each class
    # has floor or ceil of N*k/C holders.
    held = np.zeros((clients, num_classes), dtype=bool)
    held[
        np.arange(clients)[:, None], (np.arange(clients)[:, None] * k + np.arange(k)) % num_classes
    ] = True
    counts = np.zeros((clients, num_classes), dtype=np.int64)
    for c in range(num_classes):
        holders = np.flatnonzero(held[:, c])
        if holders.size == 0:
            continue  # fewer than C/k clients: this class goes unused
        if totals[c] < holders.size:
            raise DataError(
                f"pathological: class {c} has {int(totals[c])} train samples but "
                f"{holders.size} clients hold it; use fewer clients or a smaller "
                f"classes_per_client (or more data: a larger dataset.fraction)"
            )
        base, extra = divmod(int(totals[c]), holders.size)
        share = np.full(holders.size, base, dtype=np.int64)
        share[rng.choice(holders.size, extra, replace=False)] += 1
        counts[holders, c] = share
    return counts


def _primary_secondary(totals: np.ndarray, clients: int, rng: np.random.Generator) -> np.ndarray:
    """DC-PFL's split: every client gets ``n // clients`` samples, ``U(0.4, 0.6)`` of them
    from its primary class ``i mod C``, ``U(0.2, 0.4)`` from a random secondary class, the
    rest spread evenly over the remaining classes.

    The sizes add up to (almost) the whole train set, so the class pools have almost no
    slack: a secondary chosen uniformly would overdraw some class in most draws. Secondaries
    are therefore drawn with probability proportional to the class's remaining pool, and the
    "rest" is spread as evenly as the pools allow (a class that runs dry is topped up from
    the client's other classes). A draw that still does not fit is redrawn.
    """
    num_classes = totals.size
    if num_classes < 3:
        raise ConfigError(
            f"primary_secondary needs at least 3 classes (a primary, a secondary and the rest), "
            f"the data has {num_classes}"
        )
    per = int(totals.sum()) // clients
    reason = ""
    for _ in range(PRIMARY_SECONDARY_MAX_DRAWS):
        counts, reason = _primary_secondary_draw(totals, clients, per, rng)
        if counts is not None:
            return counts
    raise DataError(
        f"primary_secondary: in {PRIMARY_SECONDARY_MAX_DRAWS} draws the class pools never "
        f"covered every client's {per} train samples (last draw: {reason}). Every class must "
        f"supply 40-60% of the data of each client whose primary class it is, so use at "
        f"least as many clients as classes ({num_classes}), ideally a multiple of it, so "
        f"that every class is primary equally often (now {clients}). A smaller "
        f"dataset.fraction does not help: client sizes shrink with the data."
    )


def _primary_secondary_draw(
    totals: np.ndarray, clients: int, per: int, rng: np.random.Generator
) -> tuple[np.ndarray | None, str]:
    """One draw of the count matrix, or None and why it did not fit the class pools."""
    num_classes = totals.size
    primary = np.arange(clients) % num_classes
    n_p = np.rint(rng.uniform(*PRIMARY_SHARE, clients) * per).astype(np.int64)
    n_s = np.rint(rng.uniform(*SECONDARY_SHARE, clients) * per).astype(np.int64)
    n_s = np.minimum(n_s, per - n_p)
    pool = totals - np.bincount(primary, weights=n_p, minlength=num_classes).astype(np.int64)
    if (pool < 0).any():
        c = int(np.argmin(pool))
        return None, (
            f"class {c} has {int(totals[c])} samples, its primary clients alone need "
            f"{int(totals[c] - pool[c])}"
        )
    secondary = np.empty(clients, dtype=np.int64)
    for i in rng.permutation(clients):
        room = np.clip(pool - n_s[i], 0, None).astype(np.float64)
        room[primary[i]] = 0.0
        if room.sum() <= 0:
            return None, f"no class had {int(n_s[i])} samples left for client {i}'s secondary"
        s = int(rng.choice(num_classes, p=room / room.sum()))
        secondary[i] = s
        pool[s] -= n_s[i]
    allowed = np.ones((clients, num_classes), dtype=bool)
    allowed[np.arange(clients), primary] = False
    allowed[np.arange(clients), secondary] = False
    counts = _fill_evenly(per - n_p - n_s, pool, allowed, rng)
    if counts is None:
        return None, "the samples left after primaries and secondaries did not fit the rest"
    np.add.at(counts, (np.arange(clients), primary), n_p)
    np.add.at(counts, (np.arange(clients), secondary), n_s)
    return counts, ""


def _fill_evenly(
    need: np.ndarray, pool: np.ndarray, allowed: np.ndarray, rng: np.random.Generator
) -> np.ndarray | None:
    """Give row i ``need[i]`` units spread evenly over its allowed columns, taking at most
    ``pool[c]`` from column c; None if no way was found.

    Each round offers every row an even split over its allowed columns that still have
    room; oversubscribed columns are scaled down to exactly their room (largest
    remainder), so every round either finishes or empties a column. When the pools are
    nearly exhausted a row can be left needing units that only its excluded columns still
    have; ``_reroute`` then frees room for it by moving another row's units.
    """
    rows, cols = allowed.shape
    out = np.zeros((rows, cols), dtype=np.int64)
    need = need.astype(np.int64).copy()
    room = pool.astype(np.int64).copy()
    for _ in range(cols + 1):
        active = need > 0
        usable = allowed & (room > 0)[None, :] & active[:, None]
        width = usable.sum(1)
        if not usable.any():
            break
        safe_width = np.maximum(width, 1)
        keys = np.where(usable, rng.random((rows, cols)), 2.0)
        rank = keys.argsort(1).argsort(1)
        offer = np.where(usable, (need // safe_width)[:, None], 0) + (
            usable & (rank < (need % safe_width)[:, None])
        )
        demand = offer.sum(0)
        for c in np.flatnonzero(demand > room):
            exact = offer[:, c] * (room[c] / demand[c])
            offer[:, c] = _largest_remainder(exact[:, None], np.array([room[c]]), rng)[:, 0]
        out += offer
        need -= offer.sum(1)
        room -= offer.sum(0)
    if (need > 0).any() and not _reroute(out, need, room, allowed):
        return None
    return out


def _reroute(out: np.ndarray, need: np.ndarray, room: np.ndarray, allowed: np.ndarray) -> bool:
    """Satisfy the remaining ``need`` in place by augmenting paths of length two.

    Row i needs units but only columns it may not use (c) have room: find a row j that may
    use c and holds units of a column d that i may use; move j's units from d to c and give
    the freed d units to i. Sizes of all other rows are unchanged.
    """
    for i in np.flatnonzero(need > 0):
        while need[i] > 0:
            direct = allowed[i] & (room > 0)
            if direct.any():
                c = int(np.argmax(np.where(direct, room, -1)))
                m = min(int(need[i]), int(room[c]))
                out[i, c] += m
                need[i] -= m
                room[c] -= m
                continue
            moved = False
            for col in np.flatnonzero(room > 0):
                gain = np.where(allowed[:, col][:, None] & allowed[i][None, :], out, 0)
                if gain.max() <= 0:
                    continue
                j, d = np.unravel_index(int(np.argmax(gain)), gain.shape)
                m = min(int(need[i]), int(room[col]), int(gain[j, d]))
                out[j, d] -= m
                out[j, col] += m
                out[i, d] += m
                room[col] -= m
                need[i] -= m
                moved = True
                break
            if not moved:
                return False
    return True


# --------------------------------------------------------------------------- test split


def _test_counts(
    train_counts: np.ndarray,
    train_totals: np.ndarray,
    test_totals: np.ndarray,
    rng: np.random.Generator,
) -> np.ndarray:
    """Test samples per client and class, following each client's train label mix.

    Client i gets ``train_counts[i, c] / train_totals[c]`` of class c's test samples,
    rounded by largest remainder; when a scheme uses every train sample of a class, every
    test sample of it goes to some client. A client that holds train data but would get no
    test sample at all takes one of its own classes: an unassigned test sample if there is
    one, else one from the client with the most test samples of that class, provided that
    client keeps at least one. If neither exists the client stays without test data.
    """
    share = train_counts / np.maximum(train_totals, 1)[None, :]
    exact = share * test_totals[None, :]
    target = np.minimum(np.rint(exact.sum(0)).astype(np.int64), test_totals)
    counts = _largest_remainder(exact, target, rng)

    free = test_totals - counts.sum(0)
    sizes = counts.sum(1)
    for i in np.flatnonzero((train_counts.sum(1) > 0) & (sizes == 0)):
        for c in np.argsort(-train_counts[i], kind="stable"):
            if train_counts[i, c] == 0:
                break
            if free[c] > 0:
                free[c] -= 1
            else:
                donors = (counts[:, c] > 0) & (sizes > 1)
                if not donors.any():
                    continue
                d = int(np.argmax(np.where(donors, counts[:, c], -1)))
                counts[d, c] -= 1
                sizes[d] -= 1
            counts[i, c] += 1
            sizes[i] += 1
            break
    return counts


# --------------------------------------------------------------------------- validation


def validation_split(idx: torch.Tensor, labels: torch.Tensor, share: float,
                     rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A client's training indices ``idx`` as (train, validation): ``round(share * n)``
    samples held out, each class giving its share (largest remainders, random tie-break),
    each class's held-out samples drawn at random. Both keep ``idx``'s order."""
    n = idx.numel()
    if share <= 0 or n == 0:
        return idx, idx[:0]
    y = labels.index_select(0, idx).numpy()
    classes, inverse = np.unique(y, return_inverse=True)
    per_class = np.bincount(inverse, minlength=classes.size)
    target = np.array([min(round(share * n), n - 1)])
    counts = _largest_remainder((share * per_class)[:, None].astype(np.float64), target, rng)[:, 0]
    held = np.zeros(n, dtype=bool)
    for c, k in enumerate(counts):
        if k:
            held[rng.choice(np.flatnonzero(inverse == c), size=int(k), replace=False)] = True
    mask = torch.from_numpy(held)
    return idx[~mask], idx[mask]
