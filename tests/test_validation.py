"""A validation split (eval.validation): held out of each client's training data, scored
every evaluated round, and the only thing any choice of round looks at."""

import math

import numpy as np
import pytest
import torch

from edgepfl.data.partition import validation_split
from edgepfl.engine.schedule import early_stop
from edgepfl.engine.simulation import Simulation
from tests.conftest import fast_config, resumed_and_straight


def test_the_split_holds_out_each_class_share_and_loses_nothing():
    idx = torch.arange(1000, 1200)
    labels = torch.zeros(1300, dtype=torch.long)
    labels[1000:1150], labels[1150:1190], labels[1190:1200] = 0, 1, 2
    train, val = validation_split(idx, labels, 0.1, np.random.default_rng(3))
    assert val.numel() == 20 and train.numel() == 180
    assert sorted(train.tolist() + val.tolist()) == idx.tolist()
    assert torch.bincount(labels[val], minlength=3).tolist() == [15, 4, 1]
    again = validation_split(idx, labels, 0.1, np.random.default_rng(3))
    assert torch.equal(again[1], val)
    assert validation_split(idx, labels, 0.1, np.random.default_rng(4))[1].tolist() != val.tolist()
    # a client keeps at least one training sample; no share, no split
    assert validation_split(idx[:1], labels, 0.9, np.random.default_rng(0))[1].numel() == 0
    assert validation_split(idx, labels, 0.0, np.random.default_rng(0))[1].numel() == 0


def test_a_run_scores_validation_apart_from_training_and_picks_rounds_on_it():
    sim = Simulation(fast_config("eval.validation=0.25", "train.rounds=3"), progress=False)
    for cid in range(sim.num_clients):
        train, val = sim.train_data[cid], sim.val_data[cid]
        held = set(sim.partition.train[cid].tolist()) - set(train.idx.tolist())
        assert len(held) == val[1].numel() > 0  # what training lost is the validation split
        assert val[1].tolist() == sim.dataset.y_train[sorted(held)].tolist()
    result = sim.run()
    rows, summary = result.metrics, result.summary
    assert all(0 <= r["val_acc_mean"] <= 1 for r in rows)
    best = max(rows, key=lambda r: r["val_acc_mean"])
    assert summary["val_best_round"] == best["round"]
    assert summary["acc_mean_at_val_best"] == best["acc_mean"]
    assert summary["protocol"] == {"statistic": "best_round", "clients": "all",
                                   "selection": "validation", "acc": best["acc_mean"]}


def test_without_validation_nothing_is_held_out_or_added():
    sim = Simulation(fast_config("train.rounds=1"), progress=False)
    assert all(v is None for v in sim.val_data)
    assert all(torch.equal(t.idx, sim.partition.train[c]) for c, t in enumerate(sim.train_data))
    result = sim.run()
    assert not any(k.startswith("val_") for k in result.metrics[-1])
    assert "val_best_round" not in result.summary
    assert result.summary["protocol"]["selection"] == "test"


def test_early_stopping_watches_validation_when_there_is_one():
    rows = [{"round": r, "acc_mean": a, "val_acc_mean": v}
            for r, a, v in [(1, 0.5, 0.5), (2, 0.6, 0.4), (3, 0.7, 0.4), (4, 0.8, 0.4)]]
    assert early_stop(rows, 2) is None  # test accuracy keeps rising
    stop = early_stop(rows, 2, key="val_acc_mean")
    assert (stop["round"], stop["best_round"]) == (3, 1)
    assert "validation accuracy" in stop["reason"]


def test_client_picks_on_validation_survive_a_resume(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "eval.validation=0.25",
                                             "eval.statistic=client_best")
    a, b = resumed.rounds.summary(), straight.rounds.summary()
    assert a["acc_client_at_val_best_mean"] == b["acc_client_at_val_best_mean"]
    assert not math.isnan(a["acc_client_at_val_best_mean"])
    assert a["protocol"]["acc"] == a["acc_client_at_val_best_mean"]
    for key in ("val_all", "test_all"):
        assert resumed.rounds.ledger.val_best[key] == straight.rounds.ledger.val_best[key]


def test_a_share_outside_0_1_is_refused():
    from edgepfl.errors import ConfigError
    with pytest.raises(ConfigError, match="eval.validation"):
        fast_config("eval.validation=1.0")
