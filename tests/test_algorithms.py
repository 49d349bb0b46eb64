"""Defining properties of the first three algorithms."""

import math

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, ServerContext, get_algorithm
from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.config import TrainConfig
from edgepfl.contract.kit import proximal_hook
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.aggregate import weighted_average
from edgepfl.federation.messages import Message, MessageError
from edgepfl.models import LayerSpec
from tests.conftest import fast_config


def _metrics(cfg):
    result = Simulation(cfg, progress=False).run()
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in result.metrics], result


def test_fedprox_with_mu_zero_is_exactly_fedavg():
    fedavg, _ = _metrics(fast_config("algorithm.name=fedavg"))
    prox0, _ = _metrics(fast_config("algorithm.name=fedprox", "algorithm.mu=0"))
    assert prox0 == fedavg


def test_fedprox_with_positive_mu_differs_from_fedavg():
    fedavg, _ = _metrics(fast_config("algorithm.name=fedavg"))
    prox, _ = _metrics(fast_config("algorithm.name=fedprox", "algorithm.mu=1.0"))
    assert [r["acc_mean"] for r in prox] != [r["acc_mean"] for r in fedavg] or \
        [r["train_loss"] for r in prox] != [r["train_loss"] for r in fedavg]


def test_fedprox_gradient_is_that_of_the_proximal_term():
    w = torch.randn(5, requires_grad=True)
    anchor = torch.randn(5)
    (0.5 * 0.3 * (w - anchor).pow(2).sum()).backward()
    grads = [torch.zeros(5)]
    proximal_hook(0.3, [anchor])([w.detach()], grads)
    torch.testing.assert_close(grads[0], w.grad)


def test_fedprox_default_mu_is_not_zero():
    # PFLlib's default of mu = 0 silently turns FedProx into FedAvg
    assert get_algorithm("fedprox").hyperparameters().mu > 0


def test_local_sends_no_bytes_and_clients_end_different():
    _, result = _metrics(fast_config("algorithm.name=local"))
    assert result.summary["bytes_up_total"] == 0
    assert result.summary["bytes_down_total"] == 0
    assert all(r["bytes_up"] == 0 and r["bytes_down"] == 0 for r in result.metrics)


def test_fedavg_bytes_are_the_model_size_per_client_and_direction():
    cfg = fast_config("algorithm.name=fedavg", "train.participation=0.5")
    sim = Simulation(cfg, progress=False)
    model_bytes = sum(t.numel() * t.element_size() for t in sim.trainer.export().values())
    row = sim.step()
    assert row["clients"] == 3
    assert row["bytes_down"] == 3 * model_bytes
    per_client_meta = [Message({}, {"num_samples": sim.train_data[c].n}).meta_bytes
                       for c in range(sim.num_clients) if sim.bytes_up[c] > 0]
    assert row["bytes_up"] == 3 * model_bytes + sum(per_client_meta)
    assert (sim.bytes_up > 0).sum() == 3  # only selected clients sent


def test_fedavg_aggregate_is_the_sample_weighted_mean():
    init = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    spec = LayerSpec(())
    server = FedAvgServer(ServerContext(3, spec, init, TrainConfig(), 0), None)
    a = {"w": torch.full((2, 2), 1.0), "b": torch.tensor([1.0, 0.0])}
    b = {"w": torch.full((2, 2), 4.0), "b": torch.tensor([0.0, 3.0])}
    server.aggregate(1, {0: Message(a, {"num_samples": 1}), 2: Message(b, {"num_samples": 2})})
    torch.testing.assert_close(server.global_model["w"], torch.full((2, 2), 3.0))
    torch.testing.assert_close(server.global_model["b"], torch.tensor([1 / 3, 2.0]))


@pytest.mark.parametrize("bad", [-1, 2.5, "ten", True])
def test_fedavg_rejects_a_bad_sample_count_from_a_client(bad):
    init = {"w": torch.zeros(2)}
    server = FedAvgServer(ServerContext(2, LayerSpec(()), init, TrainConfig(), 0), None)
    with pytest.raises(MessageError, match="num_samples"):
        server.aggregate(1, {0: Message({"w": torch.ones(2)}, {"num_samples": bad})})


def test_fedavg_rejects_a_reply_missing_parameters():
    init = {"w": torch.zeros(2), "b": torch.zeros(1)}
    server = FedAvgServer(ServerContext(2, LayerSpec(()), init, TrainConfig(), 0), None)
    with pytest.raises(MessageError, match="lacks"):
        server.check_reply(0, Message({"w": torch.ones(2)}, {"num_samples": 3}))


def test_weighted_average_keeps_integer_buffers_and_checks_weights():
    s = [{"x": torch.tensor([0.0]), "n": torch.tensor(5)}, {"x": torch.tensor([2.0]), "n": torch.tensor(7)}]
    out = weighted_average(s, [1, 1])
    assert out["x"].item() == 1.0 and out["n"].item() == 5
    with pytest.raises(ValueError):
        weighted_average(s, [0, 0])


def test_fedavg_personal_model_is_the_global_model_for_every_client():
    sim = Simulation(fast_config("algorithm.name=fedavg"), progress=False)
    sim.step()
    for cid in range(sim.num_clients):
        model = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        for k, v in sim.server.global_model.items():
            assert torch.equal(model[k], v)


def test_local_client_trains_only_on_its_own_data():
    # a client whose data is swapped for another's ends with another model; with its own it
    # matches a second run exactly (training is a function of its data and the seed only)
    a = Simulation(fast_config("algorithm.name=local", "train.rounds=1"), progress=False)
    b = Simulation(fast_config("algorithm.name=local", "train.rounds=1"), progress=False)
    b.train_data[1] = b.train_data[2]
    a.step()
    b.step()
    assert torch.equal(a.clients.stack("model.fc2.weight")[0], b.clients.stack("model.fc2.weight")[0])
    assert not torch.equal(a.clients.stack("model.fc2.weight")[1], b.clients.stack("model.fc2.weight")[1])


def test_hyperparameters_are_typed_and_unknown_ones_rejected():
    with pytest.raises(ConfigError, match="algorithm.bogus.*valid: .*mu"):
        Simulation(fast_config("algorithm.name=fedprox", "algorithm.bogus=1"), progress=False)
    with pytest.raises(ConfigError, match="algorithm.mu = -1"):
        Simulation(fast_config("algorithm.name=fedprox", "algorithm.mu=-1"), progress=False)


# one case per algorithm, so that parallel test processes share them out
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_algorithm_learns_above_chance_on_synthetic_data(name):
    algo = ALGORITHMS[name]
    edges = ["topology.edges=2"] if algo.edge is not None else []
    if name == "dcpfl":  # its tau counts local epochs: a multiple of the 2 here
        edges.append("algorithm.tau=4")
    if name.startswith("hmpl"):  # it runs on HMPL's models only
        edges.append("model.name=hmpl_tiers")
    _, result = _metrics(fast_config(f"algorithm.name={name}", "train.rounds=4",
                                     "train.local_epochs=2", *edges))
    assert result.summary["acc_mean_best"] > 0.3, name
    assert not math.isnan(result.summary["acc_mean_final"])


def test_fedavg_local_evaluation_predicts_with_each_clients_trained_model():
    sim = Simulation(fast_config("algorithm.name=fedavg", "algorithm.evaluate=local",
                                 "train.participation=0.5"), progress=False)
    init = sim.trainer.export()
    replies = {}
    real = sim.server.aggregate

    def spy(rnd, msgs):
        replies.update(msgs)
        real(rnd, msgs)

    sim.server.aggregate = spy
    sim.step()
    for cid in range(sim.num_clients):
        model = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        expected = replies[cid].tensors if cid in replies else init
        for k in init:
            assert torch.equal(model[k], expected[k]), (cid, k)
    glob = _metrics(fast_config("algorithm.name=fedavg"))[0]
    loc = _metrics(fast_config("algorithm.name=fedavg", "algorithm.evaluate=local"))[0]
    assert [r["bytes_up"] for r in loc] == [r["bytes_up"] for r in glob]  # same protocol
    assert [r["acc_mean"] for r in loc] != [r["acc_mean"] for r in glob]
