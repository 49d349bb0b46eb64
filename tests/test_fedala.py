"""Defining properties of FedALA (edgepfl.algorithms.fedala)."""

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.fedala import LOCAL, STARTED, WEIGHTS
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError, EdgepflError
from tests.conftest import fast_config, resumed_and_straight, without_wall

PART = "train.participation=0.5"
TOP = ["fc2.weight", "fc2.bias"]
FIGURES = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss"]
QUICK = "algorithm.start_epochs=12"  # the start phase's bound, to keep tests short


def _sim(name: str = "fedala", *overrides: str) -> Simulation:
    return Simulation(fast_config(f"algorithm.name={name}", *overrides), progress=False)


def _weights(sim: Simulation) -> dict[str, torch.Tensor]:
    return {n: sim.clients.stack(WEIGHTS + n) for n in sim.client.top}


def _spy_requests(sim: Simulation) -> list:
    """Every fit_request's (cid, message, state before, weights it trains from)."""
    seen, real = [], sim.client.fit_request

    def spy(cid, msg, state, data, gen):
        request = real(cid, msg, state, data, gen)
        seen.append((cid, msg, {k: v.clone() for k, v in state.items()},
                     {k: v.clone() for k, v in request.weights.items()}))
        return request

    sim.client.fit_request = spy
    return seen


def test_registered_with_the_papers_settings_and_the_classifier_on_top():
    assert "fedala" in ALGORITHMS
    hp = get_algorithm("fedala").hyperparameters()
    assert (hp.eta, hp.rand_percent, hp.layer_idx) == (1.0, 80, 1)
    assert _sim().client.top == TOP
    assert _sim("fedala", "algorithm.layer_idx=2").client.top == ["fc1.weight", "fc1.bias", *TOP]


@pytest.mark.parametrize("momentum", ["train.momentum=0", "train.momentum=0.5"])
def test_weights_held_at_one_are_fedavg_bit_for_bit(momentum):
    """eta = 0: W never leaves 1, the aggregation is the global model exactly, and ALA's
    random numbers come from a stream of their own: every figure is FedAvg's."""
    ala = _sim("fedala", "algorithm.eta=0", QUICK, PART, momentum)
    fedavg = _sim("fedavg", PART, momentum)
    rows = [[{k: r[k] for k in FIGURES} for r in s.run().metrics] for s in (ala, fedavg)]
    assert rows[0] == rows[1]
    for k, v in fedavg.server.global_model.items():
        assert torch.equal(ala.server.global_model[k], v), k
    assert all(bool((w == 1).all()) for w in _weights(ala).values())
    assert any(STARTED in ala.clients.row(cid) for cid in range(ala.num_clients))  # ALA ran


def test_the_weights_move_stay_in_the_unit_interval_and_make_the_start():
    sim = _sim("fedala", QUICK)
    seen = _spy_requests(sim)
    sim.step()
    # round 1: no local model yet, every client starts from the global model as sent
    assert all(all(torch.equal(start[k], msg.tensors[k]) for k in start)
               for _, msg, _, start in seen)
    assert all(bool((w == 1).all()) for w in _weights(sim).values())
    sim.step()
    sim.step()
    weights = _weights(sim)
    for n, w in weights.items():
        assert bool(((w >= 0) & (w <= 1)).all()), n
    assert any(bool((w != 1).any()) for w in weights.values())
    assert all(STARTED in sim.clients.row(cid) for cid in range(sim.num_clients))
    # round 3's start: the layers below the top are the global model's, the top its
    # aggregation with the local model of round 2 under the W learned this round
    rows = {cid: sim.clients.row(cid) for cid in range(sim.num_clients)}
    for cid, msg, before, start in seen[-sim.num_clients:]:
        for k, v in start.items():
            if k not in TOP:
                assert torch.equal(v, msg.tensors[k]), (cid, k)
                continue
            g, local, w = msg.tensors[k], before[LOCAL + k], rows[cid][WEIGHTS + k]
            assert torch.equal(v, g + (local - g) * (1 - w)), (cid, k)
        assert any(not torch.equal(start[k], msg.tensors[k]) for k in TOP), cid


def test_the_start_phase_trains_until_settled_and_later_rounds_one_epoch(monkeypatch):
    sim = _sim("fedala", "partition.clients=2", "algorithm.rand_percent=50",
               "algorithm.start_epochs=15")
    epochs, real = [], sim.client._subset

    def subset(data, gen):
        part, order = real(data, gen)
        assert part.n == data.n * 50 // 100
        epochs.append([data.n, 0])

        def counted():
            epochs[-1][1] += 1
            return order()

        return part, counted

    monkeypatch.setattr(sim.client, "_subset", subset)
    sim.step()
    assert epochs == []  # nothing to aggregate with yet
    sim.step()
    assert all(11 <= e <= 15 for _, e in epochs), epochs  # > num_pre_loss losses, bounded
    epochs.clear()
    sim.step()
    assert [e for _, e in epochs] == [1, 1]


def test_a_client_predicts_with_its_aggregation_of_the_latest_global_model():
    sim = _sim("fedala", QUICK, PART)
    sim.run()
    w = sim.server.global_model
    for cid in range(sim.num_clients):
        row = sim.clients.row(cid)
        model = sim.client.personal_model(row, sim.server.eval_message(cid))
        for k in sim.trainer.state_names:
            if k in TOP and LOCAL + k in row:
                want = w[k] + (row[LOCAL + k] - w[k]) * (1 - row[WEIGHTS + k])
            else:
                want = w[k]
            assert torch.equal(model[k], want), (cid, k)


def test_more_top_layers_than_the_model_has_are_refused():
    with pytest.raises(ConfigError, match="layer_idx = 5: the model has 4 layers"):
        _sim("fedala", "algorithm.layer_idx=5")
    _sim("fedala", "algorithm.layer_idx=4")  # every layer adaptive is allowed


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=fedala", QUICK, PART)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    for n, w in _weights(straight).items():
        assert torch.equal(_weights(resumed)[n], w), n


def test_batched_clients_give_the_sequential_run(monkeypatch):
    from edgepfl.training.trainer import Trainer
    from tests.test_batch_clients import assert_same_run

    batched, fit_many = [], Trainer.fit_many

    def spy(self, reqs):
        batched.append(len(reqs) if self.batchable(reqs) else 0)
        return fit_many(self, reqs)

    monkeypatch.setattr(Trainer, "fit_many", spy)
    # FLOPs uncounted: no client trains alone under the meter, all six batch every round
    runs = [_sim("fedala", QUICK, f"train.batch_clients={b}", "train.momentum=0.5",
                 "system.count_flops=false") for b in ("false", "true")]
    for sim in runs:
        sim.run()
    assert batched == [6, 6, 6]
    assert_same_run(*runs, atol=1e-4)


def test_client_level_privacy_runs_and_sample_level_is_refused():
    sim = _sim("fedala", QUICK, "privacy.level=client", "privacy.noise_multiplier=0.5")
    sim.run()
    with pytest.raises(EdgepflError, match="outside the trainer's DP-SGD"):
        _sim("fedala", "privacy.level=sample", "privacy.noise_multiplier=1")
