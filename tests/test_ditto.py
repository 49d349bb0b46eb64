"""Defining properties of Ditto (edgepfl.algorithms.ditto)."""

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.contract.algorithm import model_from_state
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

EVALUATION = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss"]
PART = "train.participation=0.5"


def _sim(name: str = "ditto", *overrides: str) -> Simulation:
    return Simulation(fast_config(f"algorithm.name={name}", *overrides), progress=False)


def _personal(sim: Simulation, cid: int) -> dict[str, torch.Tensor]:
    return model_from_state(sim.clients.row(cid))


def test_registered_with_a_positive_lambda():
    assert "ditto" in ALGORITHMS
    hp = get_algorithm("ditto").hyperparameters()
    assert hp.lamda > 0 and hp.personal_epochs is None


def test_lambda_zero_is_local_beside_fedavg_bit_for_bit():
    """lambda = 0: each personal model is Local's (same data, same batches: the personal
    training reads a copy of the round's generator), and the global model is FedAvg's."""
    ditto = _sim("ditto", "algorithm.lamda=0", PART)
    local = _sim("local", PART)
    fedavg = _sim("fedavg", PART)
    rows = [[{k: r[k] for k in EVALUATION} for r in s.run().metrics]
            for s in (ditto, local, fedavg)]
    assert rows[0] == rows[1]  # evaluated on the personal models: Local's figures
    assert [r["train_loss"] for r in ditto.metrics] == [r["train_loss"] for r in fedavg.metrics]
    for cid in range(ditto.num_clients):
        mine, theirs = _personal(ditto, cid), model_from_state(local.clients.row(cid))
        assert mine.keys() == theirs.keys()
        for k, v in theirs.items():
            assert torch.equal(mine[k], v), (cid, k)
    for k, v in fedavg.server.global_model.items():
        assert torch.equal(ditto.server.global_model[k], v), k


def _distance(sim: Simulation, anchor) -> float:
    return max(float(sum((_personal(sim, c)[n] - anchor[n]).pow(2).sum()
                         for n in sim.trainer.param_names)) ** 0.5
               for c in range(sim.num_clients))


def test_a_large_lambda_keeps_the_personal_models_at_the_global_one():
    """One round at full participation: every client received the initial model, and the
    farthest personal model from it shrinks as lambda grows (lr * lambda = 1 at 20: each
    step lands within one gradient step of w)."""
    distances = []
    for lamda in (0, 2, 20):
        sim = _sim("ditto", f"algorithm.lamda={lamda}", "train.rounds=1")
        w = {k: v.clone() for k, v in sim.server.global_model.items()}
        sim.run()
        distances.append(_distance(sim, w))
    assert distances[0] > distances[1] > distances[2]
    assert distances[2] < 0.2 * distances[0]


def test_the_reply_is_fedavgs_and_the_personal_model_never_leaves():
    sim = _sim("ditto", PART)
    down, up = _record(sim)
    sim.run()
    model = set(sim.trainer.state_names)
    assert all(set(m.tensors) == model and set(m.meta) == {"num_samples"} for _, m in up)
    assert all(set(m.tensors) == model for rnd in down for m in rnd.values())
    trained = {cid for cid, _ in up}
    assert trained
    for cid in trained:  # the personal model differs from what it sent last
        last = [m for c, m in up if c == cid][-1]
        assert any(not torch.equal(_personal(sim, cid)[k], last.tensors[k])
                   for k in sim.trainer.param_names)
    # a client predicts with its personal model alone
    assert sim.server.eval_message(0) is None
    personal = sim.client.personal_model(sim.clients.row(0), None)
    assert all(torch.equal(personal[k], v) for k, v in _personal(sim, 0).items())


def test_personal_epochs_train_the_personal_model_longer():
    one = _sim("ditto", "train.rounds=1")
    three = _sim("ditto", "train.rounds=1", "algorithm.personal_epochs=3")
    one.run()
    three.run()
    for k, v in one.server.global_model.items():  # the global training is untouched
        assert torch.equal(three.server.global_model[k], v)
    assert not torch.equal(_personal(one, 0)["fc2.weight"], _personal(three, 0)["fc2.weight"])


def test_a_lambda_whose_steps_diverge_is_refused():
    with pytest.raises(ConfigError, match=r"lr \* lambda = 2 makes.*valid: lamda < 2 / lr = 40"):
        _sim("ditto", "algorithm.lamda=40")
    with pytest.raises(ConfigError, match="algorithm.lamda = -1"):
        _sim("ditto", "algorithm.lamda=-1")


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=ditto", PART)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


def test_sample_level_privacy_accounts_both_trainings():
    sim = _sim("ditto", "privacy.level=sample", "privacy.noise_multiplier=1",
               "train.rounds=1", "algorithm.personal_epochs=2")
    sim.run()
    assert sim.metrics[0]["epsilon"] > 0


def test_flower_run_equals_the_simulation():
    """What a client keeps lives in each node's Context.state on Flower."""
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    import json

    from edgepfl.engine.flower_local import run_local
    from tests.test_flower import run_config

    rc = {**run_config(algorithm__name="ditto"), "train.participation": 0.67}
    sim = Simulation(fast_config(*[f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                  for k, v in rc.items()]), progress=False).run()
    result = run_local(rc)
    assert len(result.metrics) == len(sim.metrics) == 2
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "bytes_down"):
            assert ours[key] == theirs[key], (ours["round"], key)
