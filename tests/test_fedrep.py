"""Defining properties of FedRep (edgepfl.algorithms.fedrep)."""

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

PART = "train.participation=0.5"
HEAD = ["fc2.weight", "fc2.bias"]


def _sim(name: str = "fedrep", *overrides: str) -> Simulation:
    return Simulation(fast_config(f"algorithm.name={name}", *overrides), progress=False)


def test_registered_with_the_papers_epochs_and_the_classifier_as_head():
    assert "fedrep" in ALGORITHMS
    hp = get_algorithm("fedrep").hyperparameters()
    assert (hp.personal_layers, hp.head_epochs, hp.body_epochs) == (1, 10, None)
    assert _sim().client.personal == HEAD


def test_the_head_trains_first_with_the_body_frozen_then_the_body_with_the_head_frozen():
    sim = _sim("fedrep", "algorithm.head_epochs=2", "train.rounds=1")
    tr = sim.trainer
    phases = []
    real = tr.fit

    def spy(data, epochs, *args, trainable=None, **kw):
        before = tr.export()
        stats = real(data, epochs, *args, trainable=trainable, **kw)
        phases.append((epochs, list(trainable), before, tr.export()))
        return stats

    tr.fit = spy
    sim.step()
    assert len(phases) == 2 * sim.num_clients
    body = [n for n in tr.param_names if n not in HEAD]
    for i in range(0, len(phases), 2):
        (e_head, head, h0, h1), (e_body, trained, b0, b1) = phases[i], phases[i + 1]
        assert (e_head, head, e_body, trained) == (2, HEAD, 1, body)
        # head phase: the head moves, the body stays where it was sent
        assert all(not torch.equal(h0[n], h1[n]) for n in HEAD)
        assert all(torch.equal(h0[n], h1[n]) for n in body)
        # body phase: from the new head, which stays fixed while the body moves
        assert all(torch.equal(h1[n], b0[n]) and torch.equal(b0[n], b1[n]) for n in HEAD)
        assert all(not torch.equal(b0[n], b1[n]) for n in body)


def test_the_head_never_leaves_the_client_and_the_body_is_the_weighted_mean():
    sim = _sim("fedrep", "algorithm.head_epochs=1", PART)
    down, up = _record(sim)
    sim.step()
    body = set(sim.trainer.state_names) - set(HEAD)
    assert len(up) == 3
    assert all(set(m.tensors) == body for _, m in up)
    assert all(set(m.tensors) == body for rnd in down for m in rnd.values())
    assert set(sim.server.global_model) == body
    weights = torch.tensor([float(m.meta["num_samples"]) for _, m in up], dtype=torch.float64)
    assert len(set(weights.tolist())) > 1
    for k, v in sim.server.global_model.items():
        want = sum(w * m.tensors[k].double() for w, (_, m) in zip(weights, up, strict=True))
        torch.testing.assert_close(v, (want / weights.sum()).float())
    sim.run()
    heads = sim.clients.stack("personal.fc2.weight")
    trained = sorted({cid for cid, _ in up})
    assert len(trained) > 1
    assert all(not torch.equal(heads[a], heads[b]) for a, b in zip(trained, trained[1:], strict=False))
    # a client predicts with the server's body and its own head
    for cid in range(sim.num_clients):
        model = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        assert torch.equal(model["fc1.weight"], sim.server.global_model["fc1.weight"])
        assert torch.equal(model["fc2.weight"], heads[cid])


def test_no_head_epochs_is_fedbabus_federated_training_bit_for_bit():
    """The head never moves from the one initial model every client starts from, and the
    body trains with it frozen: FedBABU's rounds (without its test-time fine-tuning)."""
    fedrep = _sim("fedrep", "algorithm.head_epochs=0", PART)
    fedbabu = _sim("fedbabu", "algorithm.finetune_epochs=0", PART)
    for sim in (fedrep, fedbabu):
        sim.run()
    assert without_wall(fedrep.metrics) == without_wall(fedbabu.metrics)
    for k, v in fedbabu.server.global_model.items():
        assert torch.equal(fedrep.server.global_model[k], v), k


def test_a_head_of_every_layer_or_none_is_refused():
    with pytest.raises(ConfigError, match="personal_layers = 4: the model has 4 layers"):
        _sim("fedrep", "algorithm.personal_layers=4")
    with pytest.raises(ConfigError, match="algorithm.personal_layers = 0"):
        _sim("fedrep", "algorithm.personal_layers=0")


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=fedrep",
                                             "algorithm.head_epochs=2", PART)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


def test_sample_level_privacy_accounts_both_phases():
    sim = _sim("fedrep", "privacy.level=sample", "privacy.noise_multiplier=1",
               "algorithm.head_epochs=2", "train.rounds=1")
    sim.run()
    assert sim.metrics[0]["epsilon"] > 0


def test_flower_run_equals_the_simulation():
    """What a client keeps lives in each node's Context.state on Flower."""
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    import json

    from edgepfl.engine.flower_local import run_local
    from tests.test_flower import run_config

    rc = {**run_config(algorithm__name="fedrep"), "train.participation": 0.67}
    sim = Simulation(fast_config(*[f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                  for k, v in rc.items()]), progress=False).run()
    result = run_local(rc)
    assert len(result.metrics) == len(sim.metrics) == 2
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "bytes_down"):
            assert ours[key] == theirs[key], (ours["round"], key)
