"""What changes over a run's rounds (``edgepfl.engine.schedule``): the clients' learning
rate (``train.lr_decay``, ``train.lr_final``) and early stopping (``train.early_stopping``,
``train.early_stopping_delta``), in both runtimes, with workers and across a resume."""

import json
import logging
import math

import pytest

from edgepfl.config import build_config
from edgepfl.engine.schedule import can_stop_early, client_lr, early_stop, round_lr, step_lr
from edgepfl.engine.simulation import Simulation, resume_run
from edgepfl.errors import ConfigError
from tests.conftest import fast_config, without_wall
from tests.test_workers import same_rows

DECAYS = ("linear", "cosine", "exponential")


def _train(*overrides: str):
    return build_config({}, list(overrides)).train


# -- the rate of a step ---------------------------------------------------------------------
@pytest.mark.parametrize("decay", DECAYS)
def test_a_decay_starts_at_lr_ends_at_lr_final_and_never_rises(decay):
    t = _train("train.lr=0.01", f"train.lr_decay={decay}", "train.lr_final=0.001")
    rates = [client_lr(t, s, 800) for s in range(1, 801)]
    assert rates[0] == 0.01 and rates[-1] == 0.001
    assert all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert all(0.001 <= r <= 0.01 for r in rates)
    assert client_lr(t, 900, 800) == rates[-1]  # past the end: the last rate
    mid = client_lr(t, 3, 5)  # halfway
    expected = {"linear": 0.0055, "cosine": 0.0055, "exponential": math.sqrt(0.01 * 0.001)}
    assert mid == pytest.approx(expected[decay], rel=1e-12)


def test_exponential_decay_takes_the_same_factor_every_step_and_none_keeps_lr():
    t = _train("train.lr=0.01", "train.lr_decay=exponential", "train.lr_final=0.001")
    ratios = [client_lr(t, s + 1, 11) / client_lr(t, s, 11) for s in range(1, 11)]
    assert ratios == pytest.approx([0.1 ** 0.1] * 10, rel=1e-12)
    const = _train("train.lr=0.01")
    assert {client_lr(const, s, 50) for s in range(1, 51)} == {0.01}
    assert client_lr(t, 1, 1) == 0.01  # a one-step run trains at train.lr


def test_a_hierarchy_decays_over_its_client_steps_rounds_times_edge_rounds():
    cfg = fast_config("train.rounds=3", "topology.edges=2", "topology.edge_rounds=2",
                      "train.lr_decay=linear", "train.lr_final=0.01")  # lr 0.05
    steps = [step_lr(cfg, s) for s in range(1, 7)]
    assert steps == pytest.approx([0.05 - 0.008 * k for k in range(6)], rel=1e-12)
    assert [round_lr(cfg, r) for r in (1, 2, 3)] == [steps[0], steps[2], steps[4]]
    # an asynchronous edge's extra edge round trains at its cloud round's last step's rate
    assert step_lr(cfg, ("async", 2, 3)) == steps[3]


@pytest.mark.parametrize("decay", DECAYS)
def test_a_horizon_of_h_rounds_gives_round_r_the_rate_of_the_h_round_schedule(decay):
    sets = ("train.lr=0.01", f"train.lr_decay={decay}", "train.lr_final=0.001")
    cfg = fast_config("train.rounds=10", *sets, "train.lr_decay_rounds=800")
    t = cfg.train
    assert [round_lr(cfg, r) for r in range(1, 11)] == [client_lr(t, r, 800) for r in range(1, 11)]
    assert round_lr(cfg, 10) > 0.009  # the beginning of the long schedule, not its end
    # a horizon under the run's rounds reaches lr_final there and stays
    short = fast_config("train.rounds=10", *sets, "train.lr_decay_rounds=4")
    assert [round_lr(short, r) for r in range(1, 11)] == \
        [client_lr(t, r, 4) for r in range(1, 5)] + [0.001] * 6
    # the default horizon is the run's rounds, as before the setting existed
    default = fast_config("train.rounds=10", *sets)
    assert default.train.lr_decay_rounds is None
    assert [round_lr(default, r) for r in range(1, 11)] == \
        [round_lr(fast_config("train.rounds=10", *sets, "train.lr_decay_rounds=10"), r)
         for r in range(1, 11)] == [client_lr(t, r, 10) for r in range(1, 11)]
    # a hierarchy: H rounds of k2 edge rounds each
    tree = fast_config("train.rounds=3", "topology.edges=2", "topology.edge_rounds=2", *sets,
                       "train.lr_decay_rounds=5")
    assert [step_lr(tree, s) for s in range(1, 7)] == [client_lr(t, s, 10) for s in range(1, 7)]


def test_clients_train_at_the_rate_of_the_horizons_schedule_and_a_run_with_one_extends(tmp_path):
    sets = ("train.lr_decay=linear", "train.lr_final=0.01", "train.lr_decay_rounds=5")  # lr 0.05
    sim = Simulation(fast_config("train.rounds=2", *sets), tmp_path, progress=False)
    seen = _record_rates(sim)
    sim.run()
    assert seen == pytest.approx([0.05] * 6 + [0.04] * 6, rel=1e-12)
    # its rates do not depend on train.rounds, so it may be extended
    longer = resume_run(tmp_path, fast_config("train.rounds=3", *sets), progress=False)
    assert [r["lr"] for r in longer.metrics] == pytest.approx([0.05, 0.04, 0.03], rel=1e-12)


@pytest.mark.parametrize("overrides,match", [
    (["train.lr_decay_rounds=30"], r"train.lr_decay_rounds = 30 is only read with a decay"),
    (["train.lr_decay=linear", "train.lr_final=0.001", "train.lr_decay_rounds=0"],
     r"train.lr_decay_rounds = 0: .*greater than or equal to 1"),
    (["train.lr_decay=linear"], r"train.lr_decay = 'linear' needs train.lr_final.*<= train.lr = 0.01"),
    (["train.lr_final=0.001"], r"train.lr_final = 0.001 is only read with a decay"),
    (["train.lr_decay=cosine", "train.lr_final=0.1"], r"train.lr_final = 0.1 is above train.lr = 0.01"),
    (["train.lr_decay=exponential", "train.lr_final=0"], r"train.lr_final = 0: .*greater than 0"),
    (["train.lr_decay=step"], r"train.lr_decay = 'step': .*'none', 'linear', 'cosine' or 'exponential'"),
    (["train.early_stopping=-1"], r"train.early_stopping = -1"),
    (["train.early_stopping_delta=2"], r"train.early_stopping_delta = 2"),
])
def test_bad_values_are_refused_naming_what_is_valid(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config({}, overrides)


# -- runs at the decayed rate ----------------------------------------------------------------
def _record_rates(sim: Simulation) -> list[float]:
    """The ``train.lr`` each client update of ``sim`` sees, in call order."""
    seen: list[float] = []
    for part in sim.transport.parts.values():
        update = part.update

        def recording(*args, _part=part, _update=update, **kwargs):
            seen.append(_part.ctx.train.lr)
            return _update(*args, **kwargs)

        part.update = recording
    return seen


def test_without_decay_or_with_a_decay_to_lr_itself_a_run_is_the_default_run_bit_for_bit():
    default = Simulation(fast_config("train.rounds=2"), progress=False)
    seen = _record_rates(default)
    default.run()
    assert set(seen) == {0.05} and [r["lr"] for r in default.metrics] == [0.05, 0.05]
    flat = Simulation(fast_config("train.rounds=2", "train.lr_decay=linear",
                                  "train.lr_final=0.05"), progress=False).run()
    assert without_wall(flat.metrics) == without_wall(default.metrics)


def test_clients_train_at_the_rounds_decayed_rate_and_metrics_say_which():
    sim = Simulation(fast_config("train.lr_decay=linear", "train.lr_final=0.01"), progress=False)
    seen = _record_rates(sim)
    sim.run()
    assert seen == pytest.approx([0.05] * 6 + [0.03] * 6 + [0.01] * 6, rel=1e-12)
    assert seen[-1] == 0.01  # lr_final exactly
    assert [r["lr"] for r in sim.metrics] == pytest.approx([0.05, 0.03, 0.01], rel=1e-12)
    assert all(p.ctx.train.lr == 0.05 for p in sim.transport.parts.values())  # lent, not kept
    # its last round, at lr_final, is a round at that constant rate from the same state
    again = Simulation(sim.cfg, progress=False)
    again.step()
    again.step()
    tensors, meta = again.rounds.save_state()
    tensors.update(again.clients.state_dict("client/"))
    constant = Simulation(fast_config("train.lr=0.01"), progress=False)
    constant.load_state(tensors, meta)
    constant.rounds.ledger.round = 2
    row = constant.step()
    assert (row["lr"], row["train_loss"]) == (0.01, sim.metrics[2]["train_loss"])


def test_a_hierarchys_clients_train_at_their_steps_rate():
    sim = Simulation(fast_config("algorithm.name=hierfavg", "train.rounds=2", "topology.edges=2",
                                 "topology.edge_rounds=2", "train.lr_decay=exponential",
                                 "train.lr_final=0.005"), progress=False)
    seen = _record_rates(sim)
    sim.run()
    expected = [step_lr(sim.cfg, s) for s in range(1, 5)]
    assert seen == [r for r in expected for _ in range(6)]
    assert [r["lr"] for r in sim.metrics] == [expected[0], expected[2]]


def test_worker_processes_train_at_the_same_rates_as_the_sequential_run():
    runs = [Simulation(fast_config("train.rounds=2", f"train.workers={w}", "train.lr_decay=cosine",
                                   "train.lr_final=0.001"), progress=False) for w in (1, 2)]
    for sim in runs:
        sim.run()
    seq, par = runs
    assert par.transport.pool is not None
    same_rows(seq.metrics, par.metrics)
    a, b = seq.clients.state_dict("c/"), par.clients.state_dict("c/")
    assert all(a[k].equal(b[k]) for k in a)
    const = Simulation(fast_config("train.rounds=2"), progress=False).run()
    assert const.metrics[1]["train_loss"] != seq.metrics[1]["train_loss"]


def test_flower_trains_at_the_simulations_rates_and_stops_where_it_does():
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    from edgepfl.engine.flower_local import run_local

    rc = {"dataset.name": "synthetic", "partition.clients": 3, "train.rounds": 4,
          "train.batch_size": 32, "train.local_epochs": 1, "train.lr": 0.05,
          "train.lr_decay": "linear", "train.lr_final": 0.005, "train.early_stopping": 2,
          "train.early_stopping_delta": 1.0, "output.plots": False, "system.count_flops": False}
    sets = [f"{k}={json.dumps(v) if isinstance(v, bool | str) else v}" for k, v in rc.items()]
    sim = Simulation(fast_config(*sets), progress=False).run()
    flower = run_local(rc)
    assert len(sim.metrics) == len(flower.metrics) == 3  # of 4 rounds
    for ours, theirs in zip(flower.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "lr"):
            assert ours[key] == theirs[key], (ours["round"], key)
    for key in ("stopped_early", "stopped_round", "stop_reason", "acc_mean_final", "rounds"):
        assert flower.summary[key] == sim.summary[key], key


def test_a_decaying_run_cannot_be_extended(tmp_path):
    cfg = fast_config("train.rounds=1", "train.lr_decay=linear", "train.lr_final=0.01")
    Simulation(cfg, tmp_path, progress=False).run()
    with pytest.raises(ConfigError, match=r"train.lr_decay = 'linear'.*cannot be extended"):
        resume_run(tmp_path, overrides=["train.rounds=2"], progress=False)
    assert json.loads((tmp_path / "config.json").read_text())["train"]["rounds"] == 1
    assert (tmp_path / "summary.json").exists()


# -- early stopping --------------------------------------------------------------------------
def _rows(*accs):
    return [{"round": r, "acc_mean": a} for r, a in enumerate(accs, 1)]


def test_early_stop_is_the_patience_th_evaluation_in_a_row_without_improvement():
    rows = _rows(0.5, 0.6, 0.6, 0.59, 0.7, 0.7)
    assert early_stop(rows, 2)["round"] == 4
    assert early_stop(rows, 2)["best_round"] == 2 and early_stop(rows, 2)["acc_mean"] == 0.6
    assert early_stop(rows, 3) is None  # round 5 improved
    assert early_stop(rows, 1)["round"] == 3
    assert early_stop(rows, 0) is None  # off
    assert early_stop(rows[:3], 2) is None
    # unevaluated rounds (eval.every) do not count
    nan = math.nan
    assert early_stop(_rows(0.5, nan, 0.5, nan, 0.4, nan, 0.9), 2)["round"] == 5
    # delta: gains each at most delta count as none, measured from the last real gain
    slow = _rows(0.5, 0.505, 0.509, 0.508, 0.6)
    assert early_stop(slow, 3, 0.01)["round"] == 4
    assert early_stop(slow, 3, 0.0) is None
    stop = early_stop(slow, 3, 0.01)
    assert "did not improve by more than 0.01 on 0.5000 (round 1) in 3 evaluated rounds" in stop["reason"]


def test_an_early_stop_needs_patience_plus_one_evaluated_rounds_before_the_last():
    assert not can_stop_early(8, 2, 0)  # off
    assert can_stop_early(8, 2, 2)  # evaluated 2, 4, 6 before round 8
    assert not can_stop_early(7, 2, 3) and can_stop_early(9, 2, 3)
    assert not can_stop_early(3, 1, 2) and can_stop_early(4, 1, 2)


# a run that cannot improve by more than 1 stops at its (patience + 1)-th evaluation:
# with eval.every = 2, patience 1, that is round 4 of 8
STOPS = ("train.rounds=8", "eval.every=2", "train.early_stopping=1",
         "train.early_stopping_delta=1.0")


@pytest.fixture(scope="module")
def stopped():
    return Simulation(fast_config(*STOPS), progress=False).run()


def test_a_run_stops_early_and_its_summary_says_where_and_why(stopped):
    s = stopped.summary
    assert [r["round"] for r in stopped.metrics] == [1, 2, 3, 4]
    assert (s["stopped_early"], s["stopped_round"], s["rounds"], s["rounds_planned"]) == \
        (True, 4, 4, 8)
    assert "in 1 evaluated round " in s["stop_reason"] and "(round 2)" in s["stop_reason"]
    # the final figures are those of the round it stopped at
    last = stopped.metrics[-1]
    assert (s["final_round"], s["acc_mean_final"], s["acc_std_final"]) == \
        (4, last["acc_mean"], last["acc_std"])


def test_patience_0_never_stops_a_run():
    off = Simulation(fast_config("train.early_stopping_delta=1.0"), progress=False).run()
    default = Simulation(fast_config(), progress=False).run()
    assert len(off.metrics) == 3 and off.summary["stopped_early"] is False
    assert off.summary["stopped_round"] is None and off.summary["stop_reason"] is None
    assert without_wall(off.metrics) == without_wall(default.metrics)


def test_a_rule_that_fires_only_at_the_last_round_is_no_early_stop():
    run = Simulation(fast_config("train.rounds=2", "train.early_stopping=1",
                                 "train.early_stopping_delta=1.0"), progress=False).run()
    assert early_stop(run.metrics, 1, 1.0)["round"] == 2
    assert (run.summary["rounds"], run.summary["stopped_early"]) == (2, False)


def test_a_resumed_run_stops_at_the_same_round(tmp_path, stopped):
    first = Simulation(fast_config(*STOPS), tmp_path, progress=False)
    first._write_setup()
    first.step()
    first.step()
    first.save_checkpoint()
    resumed = resume_run(tmp_path, progress=False)
    assert without_wall(resumed.metrics) == without_wall(stopped.metrics)
    assert resumed.summary["stopped_round"] == 4
    # a stopped run resumed or extended goes no further: the history says it stopped
    again = resume_run(tmp_path, overrides=["train.rounds=12"], progress=False)
    assert len(again.metrics) == 4 and again.summary["stopped_round"] == 4
    assert json.loads((tmp_path / "summary.json").read_text())["stopped_early"] is True


def test_a_patience_the_run_cannot_reach_is_explained(caplog):
    with caplog.at_level(logging.WARNING, logger="edgepfl"):
        Simulation(fast_config("train.rounds=4", "eval.every=2", "train.early_stopping=2"),
                   progress=False)
    assert "train.early_stopping = 2 needs 3 evaluated rounds before the last" in caplog.text
    assert "eval.every = 2 has 1: this run will not stop early" in caplog.text
