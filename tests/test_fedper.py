"""Defining properties of FedPer (edgepfl.algorithms.fedper)."""

import json

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

TRAINING = ["round", "acc_mean", "acc_weighted", "acc_min", "loss", "train_loss",
            "bytes_down", "bytes_up"]


def _sim(*overrides: str) -> Simulation:
    return Simulation(fast_config("algorithm.name=fedper", *overrides), progress=False)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_registered_with_the_classifier_as_default_personal_layer():
    assert "fedper" in ALGORITHMS
    assert get_algorithm("fedper").hyperparameters().personal_layers == 1
    sim = _sim()
    assert sim.client.personal == ["fc2.weight", "fc2.bias"]


def test_zero_personal_layers_is_fedavg_exactly():
    fedper = _sim("algorithm.personal_layers=0", "train.participation=0.5")
    fedavg = Simulation(fast_config("algorithm.name=fedavg", "train.participation=0.5"),
                        progress=False)
    rows = [[{k: r[k] for k in TRAINING} for r in s.run().metrics] for s in (fedper, fedavg)]
    assert rows[0] == rows[1]
    assert set(fedper.server.global_model) == set(fedavg.server.global_model)
    for k, v in fedavg.server.global_model.items():
        assert torch.equal(fedper.server.global_model[k], v), k


def test_personal_layers_never_travel_and_stay_per_client():
    # a BatchNorm model: the running statistics of a personal BatchNorm layer stay with it
    sim = _sim("algorithm.personal_layers=3", "model.name=cnn_small_bn",
               "train.participation=0.5")
    personal = ["bn2.weight", "bn2.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                "bn2.running_mean", "bn2.running_var", "bn2.num_batches_tracked"]
    assert sorted(sim.client.personal) == sorted(personal)
    init = sim.trainer.export()
    down, up = _record(sim)
    sim.run()
    sent = {k for rnd in down for m in rnd.values() for k in m.tensors}
    uploaded = {k for _, m in up for k in m.tensors}
    base = set(sim.trainer.state_names) - set(personal)
    assert sent == base and uploaded == base
    assert set(sim.server.global_model) == base
    trained = {cid for cid, _ in up}
    never = set(range(sim.num_clients)) - trained
    heads = sim.clients.stack("personal.fc2.weight")
    for cid in trained:
        assert not torch.equal(heads[cid], init["fc2.weight"])
    for cid in never:  # a client never selected still holds the initial head
        assert torch.equal(heads[cid], init["fc2.weight"])
    a, b = sorted(trained)[:2]
    assert not torch.equal(heads[a], heads[b])
    # the client predicts with the server's base and its own personalization layers
    for cid in range(sim.num_clients):
        model = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        assert torch.equal(model["conv1.weight"], sim.server.global_model["conv1.weight"])
        assert torch.equal(model["fc2.weight"], heads[cid])
        assert torch.equal(model["bn2.running_mean"],
                           sim.clients.stack("personal.bn2.running_mean")[cid])


def test_base_is_the_sample_weighted_mean_of_the_replies_and_bytes_are_the_base():
    sim = _sim("algorithm.personal_layers=2", "train.participation=0.5")
    _, up = _record(sim)
    row = sim.step()
    assert len(up) == 3
    weights = torch.tensor([float(m.meta["num_samples"]) for _, m in up], dtype=torch.float64)
    assert len(set(weights.tolist())) > 1  # unequal weights, so a plain mean would fail
    for k, v in sim.server.global_model.items():
        want = sum(w * m.tensors[k].double() for w, (_, m) in zip(weights, up, strict=True))
        torch.testing.assert_close(v, (want / weights.sum()).float())
    base = _nbytes(sim.server.global_model.values())
    assert base < _nbytes(sim.trainer.export().values())
    assert row["bytes_down"] == 3 * base
    assert row["bytes_up"] == 3 * base + sum(m.meta_bytes for _, m in up)


def test_no_reply_leaves_the_base_unchanged():
    sim = _sim()
    before = {k: v.clone() for k, v in sim.server.global_model.items()}
    sim.server.aggregate(1, {})
    sim.server.aggregate(1, {0: Message(dict(before), {"num_samples": 0})})
    assert all(torch.equal(sim.server.global_model[k], v) for k, v in before.items())


@pytest.mark.parametrize("count", [4, 9])
def test_too_many_personal_layers_are_refused(count):
    with pytest.raises(ConfigError, match=rf"personal_layers = {count}: the model has 4 layers "
                       r"\(conv1, conv2, fc1, fc2\); valid: 0 to 3"):
        _sim(f"algorithm.personal_layers={count}")
    with pytest.raises(ConfigError, match="algorithm.personal_layers = -1"):
        _sim("algorithm.personal_layers=-1")


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=fedper",
                                             "train.participation=0.5")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


def test_flower_run_equals_the_simulation():
    """The personalization layers live in each node's Context.state on Flower."""
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    from edgepfl.engine.flower_local import run_local
    from tests.test_flower import run_config

    rc = {**run_config(algorithm__name="fedper"), "train.participation": 0.67}
    sim = Simulation(fast_config(*[f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                  for k, v in rc.items()]), progress=False).run()
    result = run_local(rc)
    assert len(result.metrics) == len(sim.metrics) == 2
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "bytes_down"):
            assert ours[key] == theirs[key], (ours["round"], key)
