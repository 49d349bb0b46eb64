"""Defining properties of FedRoD (edgepfl.algorithms.fedrod)."""

import pytest
import torch
import torch.nn.functional as F

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.fedrod import PERSONAL_HEAD, balanced_softmax_loss, log_prior
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import EdgepflError
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

PART = "train.participation=0.5"
HEAD = ["fc2.weight", "fc2.bias"]
FIGURES = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss"]
UNBALANCED = "algorithm.balanced=false"


def _sim(name: str = "fedrod", *overrides: str) -> Simulation:
    return Simulation(fast_config(f"algorithm.name={name}", *overrides), progress=False)


def _heads(sim: Simulation) -> dict[str, torch.Tensor]:
    return {n: sim.clients.stack(PERSONAL_HEAD + n) for n in HEAD}


def test_registered_with_the_balanced_softmax_and_the_classifier_as_head():
    assert "fedrod" in ALGORITHMS
    hp = get_algorithm("fedrod").hyperparameters()
    assert hp.balanced and hp.head_lr is None and hp.personal_init == "generic"
    assert _sim().client.head == HEAD


def test_the_balanced_softmax_is_plain_cross_entropy_under_uniform_classes():
    gen = torch.Generator().manual_seed(0)
    logits, y = torch.randn(12, 4, generator=gen), torch.arange(12) % 4
    uniform = log_prior(torch.arange(40) % 4, 4)
    torch.testing.assert_close(uniform, torch.full((4,), -torch.log(torch.tensor(4.0)).item()))
    torch.testing.assert_close(balanced_softmax_loss(logits, y, uniform),
                               F.cross_entropy(logits, y))
    # a skewed prior shifts the logits by log(n_c / n); an absent class by log(1e-8)
    skewed = log_prior(torch.tensor([0, 0, 0, 1]), 3)
    torch.testing.assert_close(skewed, torch.log(torch.tensor([0.75, 0.25, 1e-8])))
    torch.testing.assert_close(balanced_softmax_loss(logits[:, :3], y % 3, skewed),
                               F.cross_entropy(logits[:, :3] + skewed, y % 3))
    assert not torch.isclose(balanced_softmax_loss(logits[:, :3], y % 3, skewed),
                             F.cross_entropy(logits[:, :3], y % 3))


@pytest.mark.parametrize("momentum", ["train.momentum=0", "train.momentum=0.5"])
def test_unbalanced_with_a_still_zero_head_is_fedavg_bit_for_bit(momentum):
    """Plain cross-entropy: the model's steps are FedAvg's; a personal head held at zero
    adds exact zeros to the generic classifier, so every figure is FedAvg's too."""
    rod = _sim("fedrod", UNBALANCED, "algorithm.head_lr=0", "algorithm.personal_init=zero",
               PART, momentum)
    fedavg = _sim("fedavg", PART, momentum)
    rows = [[{k: r[k] for k in FIGURES} for r in s.run().metrics] for s in (rod, fedavg)]
    assert rows[0] == rows[1]
    assert [r["acc_global_mean"] for r in rod.metrics] == [r["acc_mean"] for r in rod.metrics]
    for k, v in fedavg.server.global_model.items():
        assert torch.equal(rod.server.global_model[k], v), k
    assert all(bool((h == 0).all()) for h in _heads(rod).values())


def test_the_generic_model_is_fedavgs_whatever_the_personal_head_does():
    """The head trains on detached features and logits: it never reaches the model."""
    rod = _sim("fedrod", UNBALANCED, PART)
    fedavg = _sim("fedavg", PART)
    for sim in (rod, fedavg):
        sim.run()
    for k, v in fedavg.server.global_model.items():
        assert torch.equal(rod.server.global_model[k], v), k
    assert [r["train_loss"] for r in rod.metrics] == [r["train_loss"] for r in fedavg.metrics]
    # the balanced softmax takes another path on these skewed clients
    balanced = _sim("fedrod", PART)
    balanced.run()
    assert any(not torch.equal(balanced.server.global_model[k], v)
               for k, v in fedavg.server.global_model.items())


def test_the_personal_head_trains_stays_on_the_client_and_adds_to_the_generic_one():
    sim = _sim("fedrod", PART)
    init = {n: sim.server.global_model[n].clone() for n in HEAD}
    down, up = _record(sim)
    sim.run()
    model = set(sim.trainer.state_names)
    assert all(set(m.tensors) == model and set(m.meta) == {"num_samples"} for _, m in up)
    assert all(set(m.tensors) == model for rnd in down for m in rnd.values())
    assert not any(k.startswith(PERSONAL_HEAD) for k in sim.server.global_model)
    trained = {cid for cid, _ in up}
    assert len(trained) > 1
    heads = _heads(sim)
    w = sim.server.global_model
    for cid in range(sim.num_clients):
        # the personal head starts as a copy of the initial classifier and moves once trained
        moved = any(not torch.equal(heads[n][cid], init[n]) for n in HEAD)
        assert moved == (cid in trained), cid
        personal = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        for k in sim.trainer.state_names:
            want = w[k] + heads[k][cid] if k in HEAD else w[k]
            assert torch.equal(personal[k], want), (cid, k)
    a, b = sorted(trained)[:2]
    assert not torch.equal(heads["fc2.weight"][a], heads["fc2.weight"][b])
    last = sim.metrics[-1]
    assert "acc_global_mean" in last and last["acc_global_mean"] != last["acc_mean"]


def test_the_sum_of_heads_is_the_sum_of_their_logits():
    sim = _sim("fedrod", "train.rounds=1")
    sim.run()
    tr, row = sim.trainer, sim.clients.row(0)
    x = sim.train_data[0].select(torch.arange(5))[0]
    tr.load(sim.server.global_model)
    tr.model.eval()
    with torch.no_grad():
        generic = tr.model(tr.layout(x))
        features = tr.model.features(tr.layout(x))
        own = F.linear(features, row[PERSONAL_HEAD + "fc2.weight"], row[PERSONAL_HEAD + "fc2.bias"])
        tr.load(sim.client.personal_model(row, sim.server.eval_message(0)))
        summed = tr.model(tr.layout(x))
    tr.forget()
    torch.testing.assert_close(summed, generic + own)


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=fedrod", PART)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    for n, h in _heads(straight).items():
        assert torch.equal(_heads(resumed)[n], h), n


def test_client_level_privacy_runs_and_sample_level_is_refused():
    sim = _sim("fedrod", "privacy.level=client", "privacy.noise_multiplier=0.5",
               "train.rounds=1")
    sim.run()
    with pytest.raises(EdgepflError, match="outside the trainer's DP-SGD"):
        _sim("fedrod", "privacy.level=sample", "privacy.noise_multiplier=1")
