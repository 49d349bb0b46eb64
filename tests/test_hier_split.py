"""Edges that mean something (issue 55): the hierarchical split, edge assignments that
follow the data, and a hierarchy whose strength the models' spread decides."""

import math

import numpy as np
import pytest
import torch

from edgepfl.algorithms.hierbayes import Layout, edge_update
from edgepfl.data.partition import make_partition
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.rng import derive_seed
from edgepfl.federation.topology import assign_edges, similar_groups
from tests.conftest import fast_config

RNG = np.random.default_rng(0)
Y_TRAIN = torch.from_numpy(RNG.integers(0, 10, 6000))
Y_TEST = torch.from_numpy(RNG.integers(0, 10, 1000))


def _split(seed: int, clients: int = 40, edges: int = 4):
    part = make_partition(Y_TRAIN, Y_TEST, 10, "hierarchical", clients, seed, alpha=1.0,
                          edges=edges, edge_alpha=0.3)
    return part, part.class_counts(Y_TRAIN, Y_TEST)[0]


def _tv(p: np.ndarray, q: np.ndarray) -> float:
    return 0.5 * float(np.abs(p - q).sum())


def _shares(counts: np.ndarray) -> np.ndarray:
    return counts / counts.sum(-1, keepdims=True)


def own_and_federation(counts: np.ndarray, parent: np.ndarray) -> tuple[float, float]:
    """Mean TV distance of a client's label mix to its own edge's and to the federation's."""
    p, fed = _shares(counts), _shares(counts.sum(0))
    own = [_tv(p[i], _shares(counts[parent == parent[i]].sum(0))) for i in range(len(p))]
    return float(np.mean(own)), float(np.mean([_tv(p[i], fed) for i in range(len(p))]))


def own_and_other_edges(counts: np.ndarray, parent: np.ndarray) -> tuple[float, float]:
    """Mean TV distance of a client's label mix to its own edge's other clients and to each
    other edge: both groups of other clients of (about) one size, so under a random
    assignment they are the same in expectation (the client itself in its own edge's mix
    would pull that one closer whatever the edges are)."""
    p = _shares(counts)
    own, other = [], []
    for i in range(len(p)):
        for k in np.unique(parent):
            members = parent == k
            members[i] = False
            (own if k == parent[i] else other).append(_tv(p[i], _shares(counts[members].sum(0))))
    return float(np.mean(own)), float(np.mean(other))


# -- the split -----------------------------------------------------------------------------
def test_a_hierarchical_split_puts_clients_near_their_own_edge():
    for seed in range(3):
        part, counts = _split(seed)
        parent = np.array(part.edges)
        assert np.bincount(parent).tolist() == [10, 10, 10, 10]  # as even as possible
        assert counts.sum(1).min() >= 10  # min_size, as dirichlet keeps it
        own, fed = own_and_federation(counts, parent)
        assert own < fed - 0.1, (own, fed)
        own, other = own_and_other_edges(counts, parent)
        assert own < other - 0.1, (own, other)


def test_random_edges_are_no_closer_than_any_other_edge_in_expectation():
    gaps = []
    for seed in range(8):
        part, counts = _split(seed)
        random = np.array(assign_edges(40, 4, "random", seed))
        own, other = own_and_other_edges(counts, random)
        gaps.append(own - other)
    assert abs(float(np.mean(gaps))) < 0.02, gaps


def test_the_hierarchical_split_is_seeded_and_needs_edges():
    a, _ = _split(5)
    b, _ = _split(5)
    assert all(torch.equal(x, y) for x, y in zip(a.train, b.train, strict=True))
    assert a.edges == b.edges
    with pytest.raises(ConfigError, match=r"got 0 \(a star\)"):
        make_partition(Y_TRAIN, Y_TEST, 10, "hierarchical", 40, 0, edges=0)
    with pytest.raises(ConfigError, match=r"partition.edges \(or, unset, topology.edges\) between 1"):
        make_partition(Y_TRAIN, Y_TEST, 10, "hierarchical", 4, 0, edges=5)
    with pytest.raises(ConfigError, match="partition.edge_alpha"):
        make_partition(Y_TRAIN, Y_TEST, 10, "hierarchical", 40, 0, edges=4, edge_alpha=0.0)


def test_partition_json_records_each_clients_edge():
    part, _ = _split(1, clients=12, edges=3)
    doc = part.to_json(Y_TRAIN, Y_TEST)
    assert doc["edges"] == 3
    assert [row["edge"] for row in doc["clients"]] == list(part.edges) == [0] * 4 + [1] * 4 + [2] * 4
    other = make_partition(Y_TRAIN, Y_TEST, 10, "dirichlet", 12, 1).to_json(Y_TRAIN, Y_TEST)
    assert "edges" not in other and "edge" not in other["clients"][0]


# -- edge assignments that follow the data ----------------------------------------------------
def test_a_run_on_a_hierarchical_split_puts_clients_under_their_data_edge_by_default():
    hier = ["algorithm.name=hierfavg", "partition.scheme=hierarchical", "topology.edges=2",
            "partition.min_size=5"]
    sim = Simulation(fast_config(*hier), progress=False)
    assert sim.cfg.topology.assignment == "partition"  # resolved, so config.json says so
    assert list(sim.federation.parent) == list(sim.partition.edges)
    control = Simulation(fast_config(*hier, "topology.assignment=random"), progress=False)
    assert control.cfg.topology.assignment == "random"  # allowed: the control
    assert Simulation(fast_config("algorithm.name=hierfavg", "topology.edges=2"),
                      progress=False).cfg.topology.assignment == "random"
    with pytest.raises(ConfigError, match="only partition.scheme = 'hierarchical' draws"):
        Simulation(fast_config("algorithm.name=hierfavg", "topology.edges=2",
                               "topology.assignment=partition"), progress=False)
    with pytest.raises(ConfigError, match=r"got 0 \(a star\)"):
        Simulation(fast_config("partition.scheme=hierarchical"), progress=False)


def test_partition_edges_gives_a_star_method_the_hierarchys_split():
    """The study compares FedAvg and Local (no edge servers) with the hierarchies on one
    split: partition.edges draws it without topology.edges."""
    hier = ["partition.scheme=hierarchical", "partition.min_size=5"]
    tree = Simulation(fast_config("algorithm.name=hierfavg", "topology.edges=3", *hier),
                      progress=False)
    star = Simulation(fast_config("algorithm.name=fedavg", "partition.edges=3", *hier),
                      progress=False)
    assert star.federation.hierarchical is False
    assert star.partition.edges == tree.partition.edges
    assert all(torch.equal(a, b) for a, b in zip(star.partition.train, tree.partition.train,
                                                 strict=True))
    with pytest.raises(ConfigError, match="split has 3 edges .* topology.edges = 2"):
        Simulation(fast_config("algorithm.name=hierfavg", "topology.edges=2",
                               "partition.edges=3", *hier), progress=False)
    with pytest.raises(ConfigError, match="partition.edges = 3 is read by partition.scheme = "
                                          "'hierarchical' only"):
        fast_config("algorithm.name=fedavg", "partition.edges=3")


def test_similar_assignment_groups_clients_of_close_histograms():
    rng = np.random.default_rng(3)
    kinds = np.array([[80, 10, 5, 5], [5, 80, 10, 5], [5, 5, 10, 80]])
    truth = rng.permutation(np.repeat(np.arange(3), 4))
    counts = kinds[truth] + rng.integers(0, 4, (12, 4))
    groups = np.array(similar_groups(counts, 3, seed=7))
    assert sorted(np.bincount(groups).tolist()) == [4, 4, 4]
    for k in range(3):  # each group is one kind of client
        assert len(set(truth[groups == k])) == 1
    assert similar_groups(counts, 3, seed=7) == groups.tolist()  # deterministic
    # balanced when the histograms are not: 7 alike and 2 others over 3 edges
    lopsided = np.vstack([np.tile(kinds[0], (7, 1)), np.tile(kinds[1], (2, 1))])
    assert sorted(np.bincount(similar_groups(lopsided, 3, seed=0)).tolist()) == [3, 3, 3]


def test_similar_assignment_in_a_run_brings_edges_closer_than_random():
    part, counts = _split(2)
    similar = np.array(assign_edges(40, 4, "similar", 2, histograms=counts))
    random = np.array(assign_edges(40, 4, "random", 2))
    assert own_and_federation(counts, similar)[0] < own_and_federation(counts, random)[0] - 0.1
    sim = Simulation(fast_config("algorithm.name=hierfavg", "topology.edges=2",
                                 "topology.assignment=similar"), progress=False)
    hist = sim.partition.class_counts(sim.dataset.y_train, sim.dataset.y_test)[0]
    seed = derive_seed(sim.cfg.seed, "topology", "similar")
    assert list(sim.federation.parent) == similar_groups(hist, 2, seed)


# -- a hierarchy the data decide -----------------------------------------------------------------
def test_samples_weighting_moves_the_edge_mean_to_the_larger_clients():
    init = {"w": torch.zeros(3)}
    layout = Layout(init, ["w"], True)
    uploads = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    flat = torch.full((3,), 1e-12, dtype=torch.float64)  # no pull towards the cloud
    args = (uploads, 2, 1e-3, torch.zeros(3, dtype=torch.float64), flat,
            torch.ones(3, dtype=torch.float64), torch.full((3,), 1e-4, dtype=torch.float64),
            1.0, 1e-4, 5, layout)
    equal, _, a_eq, b_eq = edge_update(*args)
    weighted, _, a_w, b_w = edge_update(*args, torch.tensor([3.0, 1.0], dtype=torch.float64))
    assert torch.allclose(equal, torch.full((3,), 0.5, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(weighted, torch.full((3,), 0.25, dtype=torch.float64), atol=1e-9)
    assert torch.allclose(a_eq, a_w)  # the count of observations stays the number of clients
    # the spread is weighted as well: 3/4 * 1/4 instead of 1/4 around the mean
    assert float((b_w / b_eq).mean()) == pytest.approx(0.75, rel=1e-3)


def _precision(*overrides: str) -> dict:
    cfg = fast_config("algorithm.name=hierbayes", "topology.edges=2", "partition.clients=20",
                      "train.rounds=3", *overrides)
    return Simulation(cfg, progress=False).run().summary


def test_the_learned_client_precision_is_the_datas_not_the_priors():
    """A 100x prior_scale changes the learned client-level precision by less than 2x on 20
    clients; the second pass's start at the prior's mean kept it ~100x apart."""
    low, high = _precision("algorithm.prior_scale=1"), _precision("algorithm.prior_scale=100")
    for s in (low, high):
        assert s["hier_client_precision"] > 0 and s["hier_edge_precision"] > 0
    ratio = low["hier_client_precision"] / high["hier_client_precision"]
    assert 0.5 < ratio < 2, ratio
    old = [_precision("algorithm.prior_scale=1", "algorithm.precision_start=prior",
                      "algorithm.prior_strength=1"),
           _precision("algorithm.prior_scale=100", "algorithm.precision_start=prior",
                      "algorithm.prior_strength=1")]
    assert old[0]["hier_client_precision"] / old[1]["hier_client_precision"] > 10


def test_samples_weighting_runs_and_reports_the_edges_data():
    summary = _precision("algorithm.weighting=samples", "train.rounds=2")
    assert not math.isnan(summary["acc_mean_final"])
    assert summary["hier_client_precision"] > 0


def test_the_partition_plot_draws_clients_edge_by_edge(tmp_path):
    from edgepfl.plotting import plot_partition

    part, counts = _split(0, clients=12, edges=3)
    plot_partition(counts, tmp_path / "p.png", [str(k) for k in range(10)], edges=part.edges)
    plot_partition(counts, tmp_path / "q.png", list("abcdefghij"), edges=[2, 1, 0] * 4)
    assert (tmp_path / "p.png").stat().st_size > 0 and (tmp_path / "q.png").stat().st_size > 0
