"""Defining properties of APFL (edgepfl.algorithms.apfl)."""

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.apfl import ALPHA, PERSONAL
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import EdgepflError
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

PART = "train.participation=0.5"
FIGURES = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss"]


def _sim(name: str = "apfl", *overrides: str) -> Simulation:
    return Simulation(fast_config(f"algorithm.name={name}", *overrides), progress=False)


def _alphas(sim: Simulation) -> list[float]:
    return sim.clients.stack(ALPHA).tolist()


def test_registered_with_a_learned_alpha():
    assert "apfl" in ALGORITHMS
    hp = get_algorithm("apfl").hyperparameters()
    assert hp.alpha_learned and 0 < hp.alpha < 1


@pytest.mark.parametrize("momentum", ["train.momentum=0", "train.momentum=0.5"])
def test_alpha_zero_fixed_is_fedavg_bit_for_bit(momentum):
    """w's steps are FedAvg's, and the evaluated mix 0 v + 1 w is the global model."""
    apfl = _sim("apfl", "algorithm.alpha=0", "algorithm.alpha_learned=false", PART, momentum)
    fedavg = _sim("fedavg", PART, momentum)
    rows = [[{k: r[k] for k in FIGURES} for r in s.run().metrics] for s in (apfl, fedavg)]
    assert rows[0] == rows[1]
    for k, v in fedavg.server.global_model.items():
        assert torch.equal(apfl.server.global_model[k], v), k
    for cid in range(apfl.num_clients):
        model = apfl.client.personal_model(apfl.clients.row(cid), apfl.server.eval_message(cid))
        assert all(torch.equal(model[k], v) for k, v in fedavg.server.global_model.items())
    assert _alphas(apfl) == [0.0] * apfl.num_clients


def test_a_learned_alpha_moves_from_its_start_and_a_fixed_one_does_not():
    learned = _sim("apfl", "algorithm.alpha=0.5", PART)
    _, up = _record(learned)
    learned.run()
    trained = {cid for cid, _ in up}
    alphas = _alphas(learned)
    for cid in range(learned.num_clients):
        assert (alphas[cid] != 0.5) == (cid in trained), cid
        assert 0 <= alphas[cid] <= 1
    fixed = _sim("apfl", "algorithm.alpha=0.5", "algorithm.alpha_learned=false", PART)
    fixed.run()
    assert _alphas(fixed) == [0.5] * fixed.num_clients


def test_the_client_predicts_with_the_mix_and_sends_only_w():
    sim = _sim("apfl", PART)
    down, up = _record(sim)
    sim.run()
    model = set(sim.trainer.state_names)
    assert all(set(m.tensors) == model and set(m.meta) == {"num_samples"} for _, m in up)
    assert all(set(m.tensors) == model for rnd in down for m in rnd.values())
    cid = up[-1][0]
    row = sim.clients.row(cid)
    a = float(row[ALPHA])
    w = sim.server.global_model
    mix = sim.client.personal_model(row, sim.server.eval_message(cid))
    for k in sim.trainer.param_names:
        torch.testing.assert_close(mix[k], a * row[PERSONAL + k] + (1 - a) * w[k])
        assert not torch.equal(row[PERSONAL + k], w[k])  # v_i is a model of its own


def test_alpha_one_fixed_trains_the_personal_model_on_its_own_loss():
    """alpha = 1: v_bar = v, so v takes plain SGD steps on its own data (Local's steps on
    the batches w's training draws); the global model still trains as FedAvg."""
    apfl = _sim("apfl", "algorithm.alpha=1", "algorithm.alpha_learned=false", "train.rounds=1")
    local = _sim("local", "train.rounds=1")
    apfl.run()
    local.run()
    for cid in range(apfl.num_clients):
        for k in apfl.trainer.param_names:
            torch.testing.assert_close(apfl.clients.stack(PERSONAL + k)[cid],
                                       local.clients.stack("model." + k)[cid],
                                       atol=1e-5, rtol=1e-4)


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=apfl", PART)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    assert _alphas(resumed) == _alphas(straight)


def test_client_level_privacy_runs_and_sample_level_is_refused():
    sim = _sim("apfl", "privacy.level=client", "privacy.noise_multiplier=0.5",
               "train.rounds=1")
    sim.run()
    with pytest.raises(EdgepflError, match="outside the trainer's DP-SGD"):
        _sim("apfl", "privacy.level=sample", "privacy.noise_multiplier=1")


def test_flower_run_equals_the_simulation():
    """What a client keeps lives in each node's Context.state on Flower."""
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    import json

    from edgepfl.engine.flower_local import run_local
    from tests.test_flower import run_config

    rc = {**run_config(algorithm__name="apfl"), "train.participation": 0.67}
    sim = Simulation(fast_config(*[f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                  for k, v in rc.items()]), progress=False).run()
    result = run_local(rc)
    assert len(result.metrics) == len(sim.metrics) == 2
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "bytes_down"):
            assert ours[key] == theirs[key], (ours["round"], key)
