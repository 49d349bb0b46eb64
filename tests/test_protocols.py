"""The papers' evaluation protocols beside ours: each client's best round averaged, the mean
over each round's selected clients, Local's total epoch budget, DC-PFL's last period."""

import math

import numpy as np
import pytest
import torch

from edgepfl.engine.simulation import Simulation
from tests.conftest import fast_config, resumed_and_straight


def _stepped(*overrides):
    sim = Simulation(fast_config(*overrides), progress=False)
    per_round, selected = [], []
    while sim.round < sim.cfg.train.rounds:
        sim.step()
        per_round.append(list(sim.client_acc))
        selected.append(sim.rounds.last_record.selected)
    return sim, np.array(per_round), selected


def test_client_best_averages_each_clients_own_best_round():
    sim, accs, _ = _stepped("algorithm.name=local", "train.rounds=4", "eval.statistic=client_best")
    s = sim.summary()
    assert s["acc_client_best_mean"] == pytest.approx(accs.max(0).mean())
    assert s["acc_mean_best"] == pytest.approx(accs.mean(1).max())
    assert s["acc_client_best_mean"] >= s["acc_mean_best"]  # it can only flatter
    assert s["protocol"] == {"statistic": "client_best", "clients": "all",
                             "selection": "test", "acc": s["acc_client_best_mean"]}


def test_selected_clients_protocol_averages_each_rounds_selection():
    sim, accs, selected = _stepped("algorithm.name=fedavg", "algorithm.evaluate=local",
                                   "train.participation=0.5", "train.rounds=4",
                                   "eval.clients=selected")
    per_round = [accs[r, sel].mean() for r, sel in enumerate(selected)]
    assert [r["acc_mean_selected"] for r in sim.metrics] == pytest.approx(per_round)
    s = sim.summary()
    assert s["acc_mean_selected_best"] == pytest.approx(max(per_round))
    best_when_selected = [max(accs[r, c] for r, sel in enumerate(selected) if c in sel)
                          for c in range(accs.shape[1]) if any(c in sel for sel in selected)]
    assert s["acc_client_best_selected_mean"] == pytest.approx(np.mean(best_when_selected))
    assert s["protocol"]["acc"] == s["acc_mean_selected_best"]
    # ours is the default
    assert Simulation(fast_config("train.rounds=1"), progress=False).run().summary["protocol"] == {
        "statistic": "best_round", "clients": "all", "selection": "test",
        "acc": Simulation(fast_config("train.rounds=1"), progress=False).run().summary["acc_mean_best"]}


def test_local_with_a_total_epoch_budget_stops_training_when_it_is_spent():
    sim = Simulation(fast_config("algorithm.name=local", "algorithm.total_epochs=2",
                                 "train.rounds=4"), progress=False)
    sim.step()
    sim.step()
    after_budget = {k: v.clone() for k, v in sim.clients.row(0).items()}
    sim.step()
    for k, v in sim.clients.row(0).items():
        assert torch.equal(v, after_budget[k]), k
    row = sim.metrics[-1]
    assert math.isnan(row["train_loss"])  # nobody trained in round 3
    assert row["flops_client"] == 0
    assert sim.metrics[0]["bytes_down"] > 0  # the coordinator says how many epochs are left


def test_the_protocol_figures_survive_a_resume(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=local",
                                             "train.participation=0.5")
    for key in ("acc_client_best_mean", "acc_mean_selected_best", "acc_client_best_selected_mean"):
        assert resumed.summary()[key] == straight.summary()[key], key


def test_dcpfl_reports_the_mean_over_its_last_aggregation_period():
    sim = Simulation(fast_config("algorithm.name=dcpfl", "train.rounds=4", "algorithm.tau=2"),
                     progress=False)
    s = sim.run().summary
    rows = sim.metrics[-sim.server.tau_rounds:]
    assert s["acc_mean_last_period"] == pytest.approx(np.mean([r["acc_mean"] for r in rows]))
    assert s["last_period_rounds"] == [rows[0]["round"], rows[-1]["round"]]


@pytest.mark.parametrize("algorithm", [["algorithm.name=fedavg"],
                                       ["algorithm.name=hierfavg", "topology.edges=2"]])
def test_finetune_scores_each_client_on_the_global_model_tuned_on_its_own_data(algorithm):
    """evaluate = finetune: every client, selected or not, is scored on the model it would
    receive after finetune_epochs of SGD on its training data; training and traffic are
    those of evaluate = global."""
    from edgepfl.federation.rng import generator

    common = [*algorithm, "train.rounds=2", "train.participation=0.5"]
    plain = Simulation(fast_config(*common), progress=False)
    plain.run()
    tuned = Simulation(fast_config(*common, "algorithm.evaluate=finetune",
                                   "algorithm.finetune_epochs=2"), progress=False)
    result = tuned.run()
    for a, b in zip(plain.metrics, tuned.metrics, strict=True):
        assert a["bytes_up"] == b["bytes_up"] and a["train_loss"] == b["train_loss"]
    t, trainer = tuned.cfg.train, tuned.trainer
    for cid in range(tuned.num_clients):
        trainer.load(tuned.server.eval_message(cid).tensors)
        trainer.fit(tuned.train_data[cid], 2, t.batch_size, t.lr,
                    generator(tuned.cfg.seed, "finetune", cid))
        model = trainer.export()
        x, y = tuned.test_data[cid]
        assert result.client_accuracy[cid] == pytest.approx(trainer.evaluate(model, x, y)[0] / len(y))
    assert tuned.metrics[-1]["acc_mean"] != plain.metrics[-1]["acc_mean"]


@pytest.mark.parametrize("level", ["sample", "client"])
@pytest.mark.parametrize("algo", [["algorithm.name=fedavg"], ["algorithm.name=fedprox"],
                                  ["algorithm.name=hierfavg", "topology.edges=2"]])
def test_finetune_is_refused_under_differential_privacy(algo, level):
    """Test-time fine-tuning trains on client data outside either level's accounting; the
    algorithms declare it (PrivacySupport.unaccounted) and the engine refuses it."""
    from edgepfl.errors import ConfigError

    private = [f"privacy.level={level}", "privacy.noise_multiplier=1.0"]
    with pytest.raises(ConfigError, match="algorithm.evaluate = 'finetune'"):
        Simulation(fast_config(*algo, "algorithm.evaluate=finetune", *private), progress=False)
    Simulation(fast_config(*algo, "algorithm.evaluate=global", *private), progress=False)
