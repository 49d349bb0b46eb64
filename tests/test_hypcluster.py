"""Defining properties of HypCluster (edgepfl.algorithms.hypcluster)."""

import json

import pytest
import torch
import torch.nn.functional as F

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.hypcluster import hypothesis_key, split_hypotheses
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message
from edgepfl.federation.rng import generator
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

TRAINING = ["round", "acc_mean", "acc_weighted", "acc_min", "loss", "train_loss",
            "bytes_down", "bytes_up", "flops_client"]


def _sim(*overrides: str) -> Simulation:
    return Simulation(fast_config("algorithm.name=hypcluster", *overrides), progress=False)


def _model_bytes(sim: Simulation) -> int:
    return sum(t.numel() * t.element_size() for t in sim.trainer.export().values())


def _loss(sim: Simulation, model, cid: int) -> float:
    """Mean cross-entropy of ``model`` on client ``cid``'s training data, by hand."""
    x, y = sim.train_data[cid].gather()
    sim.trainer.load(model)
    sim.trainer.model.eval()
    with torch.no_grad():
        return float(F.cross_entropy(sim.trainer.model(x), y))


def _hypotheses(sim: Simulation) -> list[dict]:
    return [{k: v.clone() for k, v in sim.server.model(c).items()}
            for c in range(sim.server.centers)]


def test_registered_with_documented_defaults():
    assert "hypcluster" in ALGORITHMS
    assert get_algorithm("hypcluster").hyperparameters().clusters == 2


def test_one_cluster_is_fedavg_exactly():
    hyp = _sim("algorithm.clusters=1", "train.participation=0.5")
    fedavg = Simulation(fast_config("algorithm.name=fedavg", "train.participation=0.5"),
                        progress=False)
    rows = [[{k: r[k] for k in TRAINING} for r in s.run().metrics] for s in (hyp, fedavg)]
    assert rows[0] == rows[1]
    model = hyp.server.model(0)
    assert set(model) == set(fedavg.server.global_model)
    assert all(torch.equal(model[k], v) for k, v in fedavg.server.global_model.items())


def test_initialisation_is_fedjax_kmeans_init():
    """Round 1: every client trains w_0 and the first hypothesis is the model of a uniformly
    drawn one; round 2: the clients report their losses on it and the next hypothesis is
    the model of the client whose best loss is the largest."""
    sim = _sim("algorithm.clusters=2", "train.rounds=4")
    init = sim.trainer.export()
    down, up = _record(sim)
    sim.step()
    assert set(down[0][0].tensors) == {f"init.{n}" for n in init}
    candidates = sorted(cid for cid, _ in up)
    pick = int(torch.randint(len(candidates), (1,), generator=generator(sim.cfg.seed,
                                                                        "hypcluster-init", 1)))
    first = candidates[pick]
    assert sim.server.center_clients == [first]
    trained = dict(up)[first].tensors
    h0 = sim.server.model(0)
    assert all(torch.equal(h0[k], trained[k]) for k in init)
    assert not torch.equal(h0["fc1.weight"], init["fc1.weight"])

    up.clear()
    sim.step()
    losses = {cid: float(m.tensors["losses"][0]) for cid, m in up}
    for cid, value in losses.items():  # what the clients report is the loss of h_0 on their data
        assert value == pytest.approx(_loss(sim, h0, cid), rel=1e-5)
    worst = max(losses, key=losses.get)
    assert min(losses.values()) < losses[worst]
    assert sim.server.center_clients == [first, worst]
    h1 = sim.server.model(1)
    assert all(torch.equal(h1[k], dict(up)[worst].tensors[k]) for k in init)
    assert sim.server.centers == 2


def test_a_client_joins_the_hypothesis_of_lowest_loss():
    sim = _sim("algorithm.clusters=3", "train.rounds=4")
    for _ in range(3):  # the three initialisation rounds
        sim.step()
    assert sim.server.centers == 3
    hyps = _hypotheses(sim)
    _, up = _record(sim)
    sim.step()
    chosen = {}
    for cid, reply in up:
        losses = [_loss(sim, h, cid) for h in hyps]
        assert reply.meta["cluster"] == min(range(3), key=losses.__getitem__), (cid, losses)
        chosen[cid] = reply.meta["cluster"]
    assert sim.server.assignment == [chosen[c] for c in range(sim.num_clients)]

    # a hand-made case whose argmin is not the first hypothesis: h_1 has been trained on the
    # client's data, h_0 and h_2 are the initial model and a scaled copy of it
    data, init = sim.train_data[0], sim.trainer.export()
    sim.trainer.load(init)
    sim.trainer.fit(data, 3, 32, 0.1, torch.Generator().manual_seed(0))
    fitted = sim.trainer.export()
    candidates = [init, fitted, {k: 3 * v for k, v in init.items()}]
    assert min(range(3), key=lambda c: _loss(sim, candidates[c], 0)) == 1
    msg = Message({hypothesis_key(c, k): v for c, h in enumerate(candidates) for k, v in h.items()})
    result = sim.client.update(0, msg, {}, data, torch.Generator().manual_seed(1))
    assert result.reply.meta["cluster"] == 1
    # and it trains that hypothesis: the same SGD from h_1 by hand
    sim.trainer.load(fitted)
    sim.trainer.fit(data, 1, 32, 0.05, torch.Generator().manual_seed(1))
    assert all(torch.equal(result.reply.tensors[k], v) for k, v in sim.trainer.export().items())


def test_each_hypothesis_is_the_weighted_mean_of_its_members_and_an_empty_one_is_kept():
    sim = _sim("algorithm.clusters=3", "train.rounds=4")
    server = sim.server
    g = torch.Generator().manual_seed(3)
    for c in range(3):
        server.hypotheses.set_row(c, {k: torch.randn(v.shape, generator=g)
                                      for k, v in sim.trainer.export().items()})
    server.centers = 3
    before = _hypotheses(sim)
    server.aggregate(5, {})  # no reply: nothing moves
    assert all(torch.equal(server.model(c)[k], before[c][k]) for c in range(3) for k in before[c])

    def reply(cluster: int, n: int) -> Message:
        return Message({k: torch.randn(v.shape, generator=g) for k, v in before[0].items()},
                       {"num_samples": n, "cluster": cluster})

    replies = {0: reply(0, 10), 3: reply(2, 7), 4: reply(0, 30)}
    server.aggregate(5, replies)
    for k in before[0]:
        want = (10 * replies[0].tensors[k] + 30 * replies[4].tensors[k]) / 40
        torch.testing.assert_close(server.model(0)[k], want)
        assert torch.equal(server.model(1)[k], before[1][k])  # nobody joined h_1
        assert torch.equal(server.model(2)[k], replies[3].tensors[k])
    assert server.assignment[:5] == [0, -1, -1, 2, 0]
    assert server.round_metrics() == {"hypotheses": 3.0, "clusters_joined": 2.0}


def test_the_client_predicts_with_its_lowest_loss_hypothesis():
    sim = _sim("algorithm.clusters=2")
    for _ in range(3):
        sim.step()
    msg = sim.server.eval_message(0)
    _, hyps = split_hypotheses(msg, sim.trainer.state_names)
    assert len(hyps) == 2
    picks = set()
    for cid in range(sim.num_clients):
        [model] = sim.client.predictive(cid, sim.clients.row(cid), msg, sim.train_data[cid])[""]
        losses = [_loss(sim, h, cid) for h in hyps]
        best = min(range(2), key=losses.__getitem__)
        assert all(torch.equal(model[k], hyps[best][k]) for k in hyps[best])
        picks.add(best)
    assert picks == {0, 1}  # both hypotheses serve someone, so the choice is tested


def test_bytes_carry_every_hypothesis_the_client_chooses_from():
    sim = _sim("algorithm.clusters=3", "train.rounds=4")
    model, clients = _model_bytes(sim), sim.num_clients
    rows = sim.run().metrics
    # initialisation: w_0 and the hypotheses chosen so far; then all k hypotheses
    assert [r["bytes_down"] for r in rows] == [clients * model * m for m in (1, 2, 3, 3)]
    loss_bytes = [0, 4, 8]  # the float32 losses of the hypotheses received
    for r, extra in zip(rows, loss_bytes, strict=False):
        assert clients * (model + extra) < r["bytes_up"] < clients * (model + extra + 60)
    assert clients * model < rows[3]["bytes_up"] < clients * (model + 60)


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=hypcluster",
                                             "train.participation=0.5")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    assert straight.server.center_clients == resumed.server.center_clients


def test_bad_cluster_counts_are_refused():
    with pytest.raises(ConfigError, match="algorithm.clusters = 0"):
        _sim("algorithm.clusters=0")
    with pytest.raises(ConfigError, match="algorithm.clusters = 7 exceeds the 6 clients; "
                                          "valid: 1 to 6"):
        _sim("algorithm.clusters=7")
    with pytest.warns(UserWarning, match="leaves no HypCluster round"):
        _sim("algorithm.clusters=3", "train.rounds=3")


def test_flower_run_equals_the_simulation():
    """Initialisation and clustered rounds over Flower's wire format, losses tensor and
    cluster index included, give the simulation's figures."""
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    from edgepfl.engine.flower_local import run_local
    from tests.test_flower import run_config

    rc = {**run_config(algorithm__name="hypcluster"), "partition.clients": 4,
          "train.rounds": 3, "algorithm.clusters": 2}
    sim = Simulation(fast_config(*[f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                  for k, v in rc.items()]), progress=False).run()
    result = run_local(rc)
    assert len(result.metrics) == len(sim.metrics) == 3
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "bytes_down",
                    "hypotheses", "clusters_joined"):
            assert ours[key] == theirs[key], (ours["round"], key)
    assert sim.metrics[-1]["clusters_joined"] > 0  # the last round is a clustered one
