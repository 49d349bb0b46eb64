"""New clients (``eval.new_clients``): a seeded share of the clients is held out of
training, never selected and never changed, and served at each evaluated round as its
method would serve a newcomer (``acc_new_*``); a method that cannot says so."""

import json
import logging
import math

import numpy as np
import pytest
import torch

from edgepfl.algorithms import ALGORITHMS
from edgepfl.config import build_config
from edgepfl.engine.client_step import evaluate_client
from edgepfl.engine.simulation import Simulation
from edgepfl.engine.transport import check_runtime
from edgepfl.errors import ConfigError
from edgepfl.experiments.compare import CANNOT_SERVE, compare
from tests.conftest import fast_config, resumed_and_straight, without_wall

NEW = "eval.new_clients=0.34"  # 2 of the 6 clients
OWN_MODEL = {"hmpl": ["model.name=hmpl_tiers"], "hmpl_s": ["model.name=hmpl_ord"]}
HIERARCHICAL = {"hierfavg": ["topology.edges=2"], "hierbayes": ["topology.edges=2"]}


def config(name: str, *overrides: str):
    return fast_config(f"algorithm.name={name}", NEW, *HIERARCHICAL.get(name, []),
                       *OWN_MODEL.get(name, []), *overrides)


def rows_of(sim: Simulation) -> dict[int, dict]:
    return {cid: {k: v.clone() for k, v in sim.clients.row(cid).items()}
            for cid in sim.federation.held_out}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_held_out_clients_never_train_and_are_served_or_refused(name):
    sim = Simulation(config(name, "train.rounds=2"), progress=False)
    held = sim.federation.held_out
    assert len(held) == 2
    before = rows_of(sim)
    rows = [sim.step() for _ in range(2)]
    ledger = sim.rounds.ledger
    for cid in held:  # never selected: no bytes, no failure, its state as it started
        assert ledger.bytes_up[cid] == 0 and ledger.bytes_down[cid] == 0
        assert ledger.failures[cid] == 0
        for k, v in before[cid].items():
            assert torch.equal(v, sim.clients.row(cid)[k]), (cid, k)
        assert math.isnan(sim.client_acc[cid])  # in no acc_* figure
    assert all(r["clients"] <= 4 for r in rows)
    if ALGORITHMS[name].no_new_clients:
        assert all(math.isnan(r["acc_new_mean"]) for r in rows)
        assert sim.summary()["new_clients_refused"] == ALGORITHMS[name].no_new_clients
    else:
        assert all(0 <= r["acc_new_mean"] <= 1 and 0 <= r["acc_new_min"] <= 1 for r in rows)
        assert sim.summary()["acc_new_mean_final"] == rows[-1]["acc_new_mean"]


def test_the_held_out_clients_are_the_seeds_choice_alone():
    def held(*overrides):
        return Simulation(fast_config(NEW, *overrides), progress=False).federation.held_out

    assert held("algorithm.name=fedavg") == held("algorithm.name=ditto") \
        == held("algorithm.name=local", "train.participation=0.5")
    assert len({held(f"seed={s}") for s in range(6)}) > 1  # another seed, other clients


def test_acc_mean_is_over_the_trained_clients_alone():
    sim = Simulation(fast_config(NEW), progress=False)
    row = sim.step()
    trained = [a for c, a in enumerate(sim.client_acc) if c not in sim.federation.held_out]
    assert not any(math.isnan(a) for a in trained)
    assert row["acc_mean"] == float(np.mean(trained))
    assert row["clients"] == 4


def test_zero_epochs_serves_the_global_model_as_is():
    sim = Simulation(fast_config(NEW, "eval.new_client_epochs=0"), progress=False)
    sim.run()
    accs = []
    for cid in sim.federation.held_out:
        f = evaluate_client(sim.client, sim.trainer, cid, {}, sim.server.eval_message(cid),
                            sim.train_data[cid], sim.test_data[cid])
        accs.append(f.correct / f.count)
    assert sim.metrics[-1]["acc_new_mean"] == float(np.mean(accs))
    tuned = Simulation(fast_config(NEW), progress=False)
    tuned.run()
    assert tuned.metrics[-1]["acc_mean"] == sim.metrics[-1]["acc_mean"]  # only the newcomers
    assert tuned.metrics[-1]["loss_new"] != sim.metrics[-1]["loss_new"]


def test_no_new_clients_changes_nothing():
    plain = Simulation(fast_config(), progress=False).run()
    off = Simulation(fast_config("eval.new_clients=0"), progress=False).run()
    assert without_wall(off.metrics) == without_wall(plain.metrics)
    assert "acc_new_mean" not in plain.metrics[-1] and "new_clients" not in plain.summary


def test_a_method_that_cannot_serve_says_so(caplog):
    with caplog.at_level(logging.WARNING, logger="edgepfl"):
        result = Simulation(fast_config(NEW, "algorithm.name=local"), progress=False).run()
    said = [r.message for r in caplog.records if "cannot serve a new client" in r.message]
    assert len(said) == 1 and "local" in said[0]
    assert all(math.isnan(r["acc_new_mean"]) for r in result.metrics)
    assert "acc_new_mean_final" not in result.summary
    assert result.summary["new_clients_refused"]


def test_a_share_that_leaves_no_client_to_train_is_refused():
    with pytest.raises(ConfigError, match=r"eval.new_clients = 0.9 holds out 2 of the 2"):
        Simulation(fast_config("partition.clients=2", "eval.new_clients=0.9"), progress=False)
    with pytest.raises(ConfigError, match="eval.new_clients"):
        build_config({}, ["eval.new_clients=1.0"])


def test_a_runtime_that_cannot_serve_new_clients_refuses_them():
    with pytest.raises(ConfigError, match="only the simulation"):
        check_runtime(fast_config(NEW), None, False, False, transport_serves_new=False)
    pytest.importorskip("flwr")
    try:
        from edgepfl.engine.flower_local import run_local
    except ImportError:  # where run_local still lives in engine.flower
        from edgepfl.engine.flower import run_local

    with pytest.raises(ConfigError, match="eval.new_clients = 0.34 serves held-out clients"):
        run_local({"dataset.name": "synthetic", "partition.clients": 6, "train.rounds": 1,
                   "eval.new_clients": 0.34, "output.plots": False})


def test_compare_shows_the_new_clients_beside_acc_mean(tmp_path):
    said = []
    compare(fast_config("train.rounds=1", NEW), ["fedavg", "local"], [0], tmp_path,
            progress=False, echo=said.append)
    md = (tmp_path / "comparison.md").read_text()
    assert "new clients' best mean acc" in md and f"| {CANNOT_SERVE} |" in md
    header, *lines = (tmp_path / "comparison.csv").read_text().splitlines()
    columns = header.split(",")
    at = columns.index("acc_new_mean_final")
    values = {line.split(",")[0]: line.split(",")[at] for line in lines}
    assert 0 <= float(values["fedavg"]) <= 1 and values["local"] == ""
    summary = json.loads((tmp_path / "fedavg-seed0" / "summary.json").read_text())
    assert summary["new_clients"] == json.loads(
        (tmp_path / "local-seed0" / "summary.json").read_text())["new_clients"]
    assert any("new clients" in s for s in said)


def test_a_resumed_run_equals_a_straight_one(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, NEW, "algorithm.name=fedper")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    assert "acc_new_mean" in straight.metrics[-1]
