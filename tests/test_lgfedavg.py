"""Defining properties of LG-FedAvg (edgepfl.algorithms.lgfedavg)."""

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.lgfedavg import LOCAL
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

PART = "train.participation=0.5"
FIGURES = ["round", "acc_mean", "acc_weighted", "acc_min", "loss", "train_loss",
           "bytes_down", "bytes_up"]


def _sim(*overrides: str) -> Simulation:
    return Simulation(fast_config("algorithm.name=lgfedavg", *overrides), progress=False)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_registered_with_the_classifier_as_the_global_head():
    assert "lgfedavg" in ALGORITHMS
    assert get_algorithm("lgfedavg").hyperparameters().global_layers == 1
    sim = _sim()
    assert sim.client.shared == ["fc2.weight", "fc2.bias"]
    assert set(sim.server.global_model) == {"fc2.weight", "fc2.bias"}


def test_all_layers_global_is_fedavg_exactly():
    lg = _sim("algorithm.global_layers=4", PART)
    fedavg = Simulation(fast_config("algorithm.name=fedavg", PART), progress=False)
    rows = [[{k: r[k] for k in FIGURES} for r in s.run().metrics] for s in (lg, fedavg)]
    assert rows[0] == rows[1]
    assert set(lg.server.global_model) == set(fedavg.server.global_model)
    for k, v in fedavg.server.global_model.items():
        assert torch.equal(lg.server.global_model[k], v), k
    assert lg.client.kept == []


def test_the_local_representation_never_travels_and_stays_per_client():
    # a BatchNorm model: the running statistics of a local BatchNorm layer stay with it
    sim = _sim("algorithm.global_layers=3", "model.name=cnn_small_bn", PART)
    head = ["bn2.weight", "bn2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
            "bn2.running_mean", "bn2.running_var", "bn2.num_batches_tracked"]
    assert sorted(sim.client.shared) == sorted(head)
    body = set(sim.trainer.state_names) - set(head)
    assert {"conv1.weight", "bn1.running_mean"} <= body
    init = sim.trainer.export()
    down, up = _record(sim)
    sim.run()
    sent = {k for rnd in down for m in rnd.values() for k in m.tensors}
    uploaded = {k for _, m in up for k in m.tensors}
    assert sent == set(head) and uploaded == set(head)
    assert not body & uploaded and not body & set(sim.server.global_model)
    trained = {cid for cid, _ in up}
    never = set(range(sim.num_clients)) - trained
    bodies = sim.clients.stack(LOCAL + "conv1.weight")
    for cid in trained:
        assert not torch.equal(bodies[cid], init["conv1.weight"])
    for cid in never:  # a client never selected still holds the initial body
        assert torch.equal(bodies[cid], init["conv1.weight"])
    a, b = sorted(trained)[:2]
    assert not torch.equal(bodies[a], bodies[b])
    # the client predicts with its own body and the server's head
    for cid in range(sim.num_clients):
        model = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        assert torch.equal(model["fc2.weight"], sim.server.global_model["fc2.weight"])
        assert torch.equal(model["conv1.weight"], bodies[cid])
        assert torch.equal(model["bn1.running_mean"],
                           sim.clients.stack(LOCAL + "bn1.running_mean")[cid])


def test_head_is_the_sample_weighted_mean_of_the_replies_and_bytes_are_the_head():
    sim = _sim("algorithm.global_layers=2", PART)
    _, up = _record(sim)
    row = sim.step()
    assert len(up) == 3
    weights = torch.tensor([float(m.meta["num_samples"]) for _, m in up], dtype=torch.float64)
    assert len(set(weights.tolist())) > 1  # unequal weights, so a plain mean would fail
    assert set(sim.server.global_model) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    for k, v in sim.server.global_model.items():
        want = sum(w * m.tensors[k].double() for w, (_, m) in zip(weights, up, strict=True))
        torch.testing.assert_close(v, (want / weights.sum()).float())
    head = _nbytes(sim.server.global_model.values())
    assert head < _nbytes(sim.trainer.export().values())
    assert row["bytes_down"] == 3 * head
    assert row["bytes_up"] == 3 * head + sum(m.meta_bytes for _, m in up)


@pytest.mark.parametrize("count", [5, 9])
def test_more_global_layers_than_the_model_has_are_refused(count):
    with pytest.raises(ConfigError, match=rf"global_layers = {count}: the model has 4 layers "
                       r"\(conv1, conv2, fc1, fc2\); valid: 1 to 4"):
        _sim(f"algorithm.global_layers={count}")
    with pytest.raises(ConfigError, match="algorithm.global_layers = 0"):
        _sim("algorithm.global_layers=0")


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=lgfedavg", PART)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


@pytest.mark.tolerance
def test_batched_clients_give_the_sequential_run(monkeypatch):
    from edgepfl.training.trainer import Trainer
    from tests.test_batch_clients import assert_same_run

    batched, fit_many = [], Trainer.fit_many

    def spy(self, reqs):
        batched.append(len(reqs) if self.batchable(reqs) else 0)
        return fit_many(self, reqs)

    monkeypatch.setattr(Trainer, "fit_many", spy)
    runs = [_sim(f"train.batch_clients={b}", "train.momentum=0.5") for b in ("false", "true")]
    for sim in runs:
        sim.run()
    assert batched and all(n == 6 for n in batched)  # rounds 2-3: all six at once
    # the clients' local conv layers end 1.3e-5 apart on an AVX-512 Xeon with AVX512-FP16
    # (2026-11-30), 1.2e-7 on AVX2 kernels: the batched kernels' layout, as
    # test_batch_clients.STATE_ATOL's cases
    assert_same_run(*runs, atol=1e-4)


def test_both_privacy_levels_run():
    for level in ("client", "sample"):
        _sim(f"privacy.level={level}", "privacy.noise_multiplier=0.5", "train.rounds=1").run()
