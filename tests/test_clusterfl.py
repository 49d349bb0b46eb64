"""Defining properties of ClusterFL (edgepfl.algorithms.clusterfl)."""

import json
import math

import torch

from edgepfl.algorithms import ALGORITHMS
from edgepfl.algorithms.clusterfl import cosine_similarity, kmeans, spectral_clusters
from edgepfl.data.partition import Partition
from edgepfl.engine.simulation import Simulation, resume_run, start_run
from tests.conftest import fast_config

CFL = ("algorithm.name=clusterfl",)
ACC_KEYS = ["acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss"]


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _param_bytes(sim: Simulation) -> int:
    return sum(sim.server.w.tensors[p][0].numel() * 4 for p in sim.server.params)


def test_registered_with_defaults():
    hp = ALGORITHMS["clusterfl"].hyperparameters()
    assert (hp.num_clusters, hp.warmup_rounds, hp.rho) == (3, 1, 0.1)


def test_cosine_similarity_is_scale_invariant():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(4, 50, generator=gen)
    s = cosine_similarity(w)
    assert torch.allclose(s, s.T) and torch.allclose(s.diagonal(), torch.ones(4, dtype=torch.float64))
    scaled = w.clone()
    scaled[1] *= 7.5
    assert torch.allclose(cosine_similarity(scaled), s)
    assert math.isclose(float(cosine_similarity(torch.stack([w[0], -w[0]]))[0, 1]), -1.0)


def test_spectral_clustering_recovers_planted_clusters_under_a_shared_component():
    # a large shared component (the common initialisation) makes all cosines close to 1;
    # the planted structure must still be found from the eigenvectors of S
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(200, generator=gen) * 20
    centres = torch.randn(3, 200, generator=gen)
    w = torch.stack([base + centres[i % 3] + 0.05 * torch.randn(200, generator=gen)
                     for i in range(9)])
    sim = cosine_similarity(w)
    assert sim.min() > 0.99
    assert spectral_clusters(sim, 3) == [0, 1, 2] * 3
    assert spectral_clusters(sim, 1) == [0] * 9
    assert sorted(set(spectral_clusters(sim, 20))) == list(range(9))  # K capped at N
    assert kmeans(torch.tensor([[0.0], [0.1], [5.0], [5.1]]), 2) == [0, 0, 1, 1]


def test_rho_zero_trains_exactly_as_local():
    rows = {}
    states = {}
    for name, extra in (("local", ()), ("cfl0", (*CFL, "algorithm.rho=0")),
                        ("cfl", (*CFL, "algorithm.rho=5"))):
        sim = Simulation(fast_config(f"algorithm.name={name if name == 'local' else 'clusterfl'}",
                                     *extra, "train.rounds=4"), progress=False)
        for _ in range(4):
            sim.step()
        rows[name] = [[r[k] for k in ACC_KEYS] for r in sim.metrics]
        states[name] = {k: v.clone() for k, v in sim.clients.tensors.items()}
    assert rows["cfl0"] == rows["local"]
    assert all(torch.equal(states["cfl0"][k], states["local"][k]) for k in states["local"])
    # the pull is real: a strong rho changes the training from the first ADMM round on
    assert rows["cfl"][0] == rows["local"][0]  # round 1 is warm-up: still local
    assert rows["cfl"][2] != rows["local"][2]


def _two_group_sim(*overrides: str) -> Simulation:
    """Clients 0-2 hold identical data (classes 0-4); clients 3-5 identical data of classes 5-9."""
    probe = Simulation(fast_config(*CFL), progress=False)
    ds = probe.dataset
    lo_tr = torch.nonzero(ds.y_train < 5).flatten()[:150]
    hi_tr = torch.nonzero(ds.y_train >= 5).flatten()[:150]
    lo_te = torch.nonzero(ds.y_test < 5).flatten()[:40]
    hi_te = torch.nonzero(ds.y_test >= 5).flatten()[:40]
    part = Partition(train=[lo_tr] * 3 + [hi_tr] * 3, test=[lo_te] * 3 + [hi_te] * 3,
                     num_classes=ds.num_classes, scheme="test")
    return Simulation(fast_config(*CFL, *overrides), progress=False, dataset=ds, partition=part)


def test_identical_data_together_disjoint_labels_apart():
    sim = _two_group_sim("algorithm.num_clusters=2", "algorithm.warmup_rounds=2")
    sim.step()
    assert sim.server.labels == [-1] * 6 and sim.metrics[-1]["clusters"] == 0
    sim.step()
    assert sim.server.labels == [0, 0, 0, 1, 1, 1]
    assert sim.metrics[-1]["clusters"] == 2
    sim.step()
    assert sim.server.labels == [0, 0, 0, 1, 1, 1]  # clusters are fixed once formed


def test_consensus_is_mean_of_w_plus_u_and_duals_follow_admm():
    sim = _two_group_sim("algorithm.num_clusters=2", "algorithm.rho=0.5")
    srv = sim.server
    sim.step()  # warm-up + clustering: u starts at 0, so z_c is the mean of the members' w
    for p in srv.params:
        w, z = srv.w.tensors[p], srv.z.tensors[p]
        assert torch.allclose(z[0], w[:3].mean(0), atol=1e-6)
        assert torch.allclose(z[3], w[3:].mean(0), atol=1e-6)
    for _ in range(2):
        sent = sim.server.configure(sim.round + 1, list(range(6)))
        for cid in range(6):  # the anchor sent is z_c - u_i
            for p in srv.params:
                assert torch.equal(sent[cid].tensors[p], srv.z.tensors[p][cid] - srv.u.tensors[p][cid])
        u_old = {p: srv.u.tensors[p].clone() for p in srv.params}
        sim.step()
        for p in srv.params:
            w, u, z = srv.w.tensors[p], srv.u.tensors[p], srv.z.tensors[p]
            for members in ([0, 1, 2], [3, 4, 5]):
                zc = (w[members] + u_old[p][members]).mean(0)
                assert all(torch.allclose(z[c], zc, atol=1e-6) for c in members)
                assert torch.allclose(u[members], u_old[p][members] + w[members] - zc, atol=1e-6)
                # hence the duals of a cluster sum to zero
                assert torch.allclose(u[members].sum(0), torch.zeros_like(zc), atol=1e-5)
    assert sim.metrics[-1]["primal_residual"] > 0
    # with only some members uploading, the duals no longer cancel: z_c must still be the
    # mean of w + u over ALL members (stored w for the absent), and only uploaders' u move
    from edgepfl.federation.messages import Message
    for present in ([0, 4], [1, 5]):
        u_old = {p: srv.u.tensors[p].clone() for p in srv.params}
        replies = {c: Message({p: srv.w.tensors[p][c] + 0.01 * (c + 1) for p in srv.params})
                   for c in present}
        srv.aggregate(sim.round + 1, replies)
        for p in srv.params:
            w, u, z = srv.w.tensors[p], srv.u.tensors[p], srv.z.tensors[p]
            for members, here in (([0, 1, 2], present[:1]), ([3, 4, 5], present[1:])):
                zc = (w[members] + u_old[p][members]).mean(0)
                assert torch.allclose(z[members[0]], zc, atol=1e-6)
                absent = [c for c in members if c not in here]
                assert torch.equal(u[absent], u_old[p][absent])
                assert torch.allclose(u[here], u_old[p][here] + w[here] - zc, atol=1e-6)
    assert not torch.allclose(srv.z.tensors[srv.params[0]][0],
                              srv.w.tensors[srv.params[0]][:3].mean(0), atol=1e-4)


def test_bytes_are_what_is_sent():
    sim = Simulation(fast_config(*CFL, "algorithm.warmup_rounds=2", "train.rounds=4"),
                     progress=False)
    rows = [sim.step() for _ in range(4)]
    model = _param_bytes(sim)
    assert (rows[0]["bytes_up"], rows[0]["bytes_down"]) == (0, 0)  # local warm-up: silent
    assert rows[1]["bytes_up"] == 6 * model                         # one upload to cluster
    assert rows[1]["bytes_down"] == 6 * len(json.dumps({"upload": True}, separators=(",", ":")))
    for row in rows[2:]:                                            # ADMM: anchor down, w up
        assert (row["bytes_up"], row["bytes_down"]) == (6 * model, 6 * model)


def test_partial_participation_late_clients_join_a_cluster():
    sim = Simulation(fast_config(*CFL, "train.participation=0.5", "train.rounds=8",
                                 "algorithm.num_clusters=2"), progress=False)
    for _ in range(8):
        sim.step()
    srv = sim.server
    joined = [c for c, lab in enumerate(srv.labels) if lab >= 0]
    assert set(srv.clustered_ids) < set(joined)  # somebody joined after the clustering round
    assert all(0 <= lab < 2 for lab in (srv.labels[c] for c in joined))


def test_resume_reproduces_metrics(tmp_path):
    over = (*CFL, "algorithm.warmup_rounds=2", "train.rounds=5", "train.participation=0.67")
    full = start_run(fast_config(*over), tmp_path / "full", progress=False).metrics
    sim = Simulation(fast_config(*over, "output.checkpoint_every=100"), tmp_path / "part",
                     progress=False)
    sim._write_setup()
    for _ in range(3):
        sim.step()
    sim.save_checkpoint()
    resumed = resume_run(tmp_path / "part", progress=False).metrics
    keys = [*ACC_KEYS, "bytes_up", "bytes_down", "clusters", "primal_residual"]
    assert len(resumed) == len(full) == 5
    for a, b in zip(resumed, full, strict=True):
        assert all(_same(a[k], b[k]) for k in keys), (a, b)
    saved = json.loads((tmp_path / "full" / "clusterfl_clusters.json").read_text())
    assert saved["clustered_at_round"] == 2 and len(saved["labels"]) == 6


def test_configurations_that_switch_clustering_off_say_so():
    import pytest

    with pytest.warns(UserWarning, match="warmup_rounds=3 is not below train.rounds=3"):
        Simulation(fast_config(*CFL, "algorithm.warmup_rounds=3"), progress=False)
    # one of 6 clients per round: the clustering round sees a single upload, K = 3 is capped
    sim = Simulation(fast_config(*CFL, "train.participation=0.17", "train.rounds=2"),
                     progress=False)
    with pytest.warns(UserWarning, match="only 1 clients uploaded in the clustering round 1"):
        row = sim.step()
    assert row["clusters"] == 1.0
