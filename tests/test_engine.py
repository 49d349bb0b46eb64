"""The round loop: run directory, evaluation protocol, determinism, checkpoint and resume."""

import csv
import json
import math

import numpy as np
import pytest

from edgepfl.engine.rounds import Rounds
from edgepfl.engine.simulation import CHECKPOINT, Simulation, resume_run, start_run
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.federation.messages import MessageError
from tests.conftest import crash_after, fast_config, forget_algorithm_setting

SUMMARY_KEYS = {"algorithm", "dataset", "clients", "rounds", "seed", "acc_mean_best", "best_round",
                "acc_mean_final", "acc_weighted_final", "acc_std_final", "bytes_up_total",
                "bytes_down_total", "wall_time_s"}
COLUMNS = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "bytes_up",
           "bytes_down", "wall_s"]


def _strip(rows):
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


def test_run_directory_has_every_promised_file(tmp_path):
    cfg = fast_config("algorithm.name=fedavg", "output.plots=true")
    result = start_run(cfg, tmp_path / "run", progress=False)
    out = tmp_path / "run"
    for name in ["config.json", "partition.json", "metrics.csv", "summary.json", "accuracy.png",
                 "partition.png", CHECKPOINT]:
        assert (out / name).is_file(), name
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(c in rows[0] for c in COLUMNS)
    assert [int(r["round"]) for r in rows] == [1, 2, 3]
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary)
    assert summary == json.loads(json.dumps(result.summary))
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["name"] == "cnn_small"  # resolved, not None
    assert config["algorithm"] == {"name": "fedavg", "evaluate": "global", "finetune_epochs": 1}


def test_evaluation_reports_mean_weighted_spread_best_and_final():
    sim = Simulation(fast_config("algorithm.name=local", "train.rounds=4"), progress=False)
    result = sim.run()
    accs = np.array(result.client_accuracy)
    final = result.metrics[-1]
    assert final["acc_mean"] == pytest.approx(accs.mean())
    assert final["acc_std"] == pytest.approx(accs.std())
    assert final["acc_min"] == pytest.approx(accs.min())
    assert final["acc_weighted"] == pytest.approx(np.average(accs, weights=sim.test_sizes))
    s = result.summary
    assert s["acc_mean_best"] == max(r["acc_mean"] for r in result.metrics)
    assert s["acc_mean_final"] == final["acc_mean"]
    assert s["acc_mean_best"] >= s["acc_mean_final"]
    assert result.metrics[s["best_round"] - 1]["acc_mean"] == s["acc_mean_best"]


def test_eval_every_skips_rounds_but_always_evaluates_the_last():
    result = Simulation(fast_config("eval.every=2", "train.rounds=3"), progress=False).run()
    evaluated = [not math.isnan(r["acc_mean"]) for r in result.metrics]
    assert evaluated == [False, True, True]


def test_same_seed_same_run_other_seed_other_run():
    a = Simulation(fast_config("seed=3"), progress=False).run()
    b = Simulation(fast_config("seed=3"), progress=False).run()
    c = Simulation(fast_config("seed=4"), progress=False).run()
    assert _strip(a.metrics) == _strip(b.metrics)
    assert _strip(a.metrics) != _strip(c.metrics)


def test_resume_after_a_crash_equals_an_uninterrupted_run(tmp_path, monkeypatch):
    cfg = fast_config("algorithm.name=fedprox", "train.rounds=4", "train.participation=0.5")
    whole = start_run(cfg, tmp_path / "whole", progress=False)

    crash_after(Simulation(cfg, tmp_path / "cut", progress=False), 2, monkeypatch)
    with open(tmp_path / "cut" / "metrics.csv") as f:
        assert len(list(csv.DictReader(f))) == 2  # what was written before the crash is intact
    resumed = resume_run(tmp_path / "cut", progress=False)
    assert _strip(resumed.metrics) == _strip(whole.metrics)
    for key in ["acc_mean_best", "acc_mean_final", "bytes_up_total", "bytes_down_total",
                "acc_clients_final", "bytes_up_per_client"]:
        assert resumed.summary[key] == whole.summary[key], key


def test_a_run_from_before_a_hyperparameter_existed_resumes(tmp_path, monkeypatch):
    # a newer edgepfl adds an algorithm setting with a default that keeps the old behaviour:
    # a run written without it (config.json and the checkpoint) must resume, not be refused
    cfg = fast_config("algorithm.name=fedprox", "train.rounds=3")
    whole = start_run(cfg, tmp_path / "whole", progress=False)
    crash_after(Simulation(cfg, tmp_path / "old", progress=False), 1, monkeypatch)
    run = tmp_path / "old"
    stored = forget_algorithm_setting(run, "mu")
    resumed = resume_run(run, progress=False)
    assert _strip(resumed.metrics) == _strip(whole.metrics)
    # a stored value that differs from today's default is still a different configuration
    stored["algorithm"]["mu"] = 0.5
    (run / "config.json").write_text(json.dumps(stored))
    with pytest.raises(ConfigError, match="algorithm.mu"):
        resume_run(run, cfg, progress=False)


def test_resume_with_a_different_config_is_refused(tmp_path):
    cfg = fast_config("train.rounds=2")
    start_run(cfg, tmp_path / "run", progress=False)
    before = (tmp_path / "run" / "metrics.csv").read_bytes()
    with pytest.raises(ConfigError, match="train.lr"):
        resume_run(tmp_path / "run", fast_config("train.rounds=2", "train.lr=0.5"))
    assert (tmp_path / "run" / "metrics.csv").read_bytes() == before


def test_a_finished_run_extended_equals_a_longer_run(tmp_path):
    cfg = ("algorithm.name=fedprox", "train.participation=0.5")
    whole = start_run(fast_config(*cfg, "train.rounds=4"), tmp_path / "whole", progress=False)
    start_run(fast_config(*cfg, "train.rounds=2"), tmp_path / "ext", progress=False)
    extended = resume_run(tmp_path / "ext", progress=False, overrides=["train.rounds=4"])
    assert _strip(extended.metrics) == _strip(whole.metrics)
    assert extended.summary["acc_mean_final"] == whole.summary["acc_mean_final"]
    assert json.loads((tmp_path / "ext" / "config.json").read_text())["train"]["rounds"] == 4
    # shortening is refused, and so is anything else that differs; the run stays as it was
    before = {f.name: f.read_bytes() for f in (tmp_path / "ext").iterdir()}
    with pytest.raises(ConfigError, match="extended, not shortened"):
        resume_run(tmp_path / "ext", progress=False, overrides=["train.rounds=3"])
    with pytest.raises(ConfigError, match="train.lr"):
        resume_run(tmp_path / "ext", progress=False, overrides=["train.rounds=6", "train.lr=0.5"])
    assert {f.name: f.read_bytes() for f in (tmp_path / "ext").iterdir()} == before


def test_a_finished_run_is_never_overwritten(tmp_path):
    start_run(fast_config("train.rounds=1"), tmp_path / "run", progress=False)
    before = (tmp_path / "run" / "summary.json").read_bytes()
    with pytest.raises(EdgepflError, match="already holds a run"):
        start_run(fast_config("train.rounds=1"), tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "summary.json").read_bytes() == before


def test_a_corrupt_checkpoint_is_reported_not_loaded(tmp_path):
    start_run(fast_config("train.rounds=1"), tmp_path / "run", progress=False)
    (tmp_path / "run" / CHECKPOINT).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(EdgepflError, match="not a valid edgepfl checkpoint"):
        resume_run(tmp_path / "run", progress=False)


def test_partial_participation_selects_the_same_clients_for_every_algorithm():
    seqs = []
    for name in ["local", "fedavg"]:
        sim = Simulation(fast_config(f"algorithm.name={name}", "train.participation=0.34"),
                         progress=False)
        seen = []
        for _ in range(3):
            before = sim.bytes_up.copy() if name == "fedavg" else None
            row = sim.step()
            assert row["clients"] == 2
            if name == "fedavg":
                seen.append(sorted(np.flatnonzero(sim.bytes_up - before).tolist()))
        seqs.append(seen)
    from edgepfl.federation.rng import select_clients
    expected = [select_clients(0, r, 6, 0.34) for r in (1, 2, 3)]
    assert seqs[1] == expected


def test_system_costs_are_reported_per_round_and_in_total(tmp_path):
    from edgepfl.system import COST_COLUMNS

    cfg = fast_config("algorithm.name=fedavg", "system.profile=fixed_rate", "system.rate_mbps=2")
    result = start_run(cfg, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "system.json").is_file()
    with open(tmp_path / "run" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(c in rows[0] for c in COST_COLUMNS)
    # at 2 Mbit/s per client, the slowest upload of the round is the largest reply's bits / 2e6
    sim = Simulation(cfg, progress=False)
    sim.step()
    largest_reply = max(int(b) for b in sim.bytes_up)
    assert sim.metrics[0]["t_up"] == pytest.approx(8 * largest_reply / 2e6)
    assert sim.metrics[0]["flops_client"] > 0
    s = result.summary
    assert s["t_round_total"] == pytest.approx(sum(float(r["t_round"]) for r in rows), rel=1e-4)
    assert s["server_state_bytes"] > 0 and s["peak_rss_bytes"] > 0


def test_counting_flops_does_not_change_results():
    on = Simulation(fast_config("system.count_flops=true"), progress=False).run()
    off = Simulation(fast_config("system.count_flops=false"), progress=False).run()
    keep = ["acc_mean", "acc_std", "loss", "train_loss", "bytes_up", "bytes_down"]
    assert [[r[k] for k in keep] for r in on.metrics] == [[r[k] for k in keep] for r in off.metrics]
    assert all(math.isnan(r["t_compute"]) for r in off.metrics)


def test_a_kept_run_without_checkpoint_is_not_rerun(tmp_path):
    start_run(fast_config("train.rounds=1"), tmp_path / "run", progress=False)
    (tmp_path / "run" / CHECKPOINT).unlink()
    before = {f.name: f.read_bytes() for f in (tmp_path / "run").iterdir()}
    with pytest.raises(EdgepflError, match="finished run without its checkpoint"):
        resume_run(tmp_path / "run", progress=False)
    assert {f.name: f.read_bytes() for f in (tmp_path / "run").iterdir()} == before


def test_an_interrupted_extension_does_not_look_finished(tmp_path, monkeypatch):
    start_run(fast_config("train.rounds=1"), tmp_path / "run", progress=False)

    def crash(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Rounds, "step", crash)
    with pytest.raises(KeyboardInterrupt):
        resume_run(tmp_path / "run", progress=False, overrides=["train.rounds=3"])
    assert not (tmp_path / "run" / "summary.json").exists()
    monkeypatch.undo()
    assert resume_run(tmp_path / "run", progress=False).summary["rounds"] == 3


@pytest.mark.parametrize("meta", [
    {"round": "one"}, {"round": 1, "metrics": [], "client_acc": [], "bytes_up": [0],
                       "bytes_down": [0], "wall_time_s": 0.0, "config": {}},
    ["not", "an", "object"]])
def test_a_checkpoint_with_malformed_metadata_is_reported(tmp_path, meta):
    from edgepfl.io import read_tensors, write_tensors
    start_run(fast_config("train.rounds=1"), tmp_path / "run", progress=False)
    tensors, _ = read_tensors(tmp_path / "run" / CHECKPOINT)
    write_tensors(tmp_path / "run" / CHECKPOINT, tensors, meta)
    with pytest.raises(EdgepflError, match="not a valid edgepfl checkpoint"):
        resume_run(tmp_path / "run", progress=False)


@pytest.mark.parametrize("entry", [1, {"round": 1}, {"round": 1, "step": "1", "client": 99,
                                                    "reason": "x"}])
def test_a_checkpoint_with_a_malformed_failure_log_changes_nothing(tmp_path, entry):
    from edgepfl.io import read_tensors, write_tensors
    run = tmp_path / "run"
    start_run(fast_config("train.rounds=1"), run, progress=False)
    tensors, meta = read_tensors(run / CHECKPOINT)
    meta["failure_log"] = [entry]
    write_tensors(run / CHECKPOINT, tensors, meta)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(EdgepflError, match="not a valid edgepfl checkpoint.*failure log"):
        resume_run(run, overrides=["train.rounds=2"], progress=False)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before


def test_run_files_follow_the_umask(tmp_path):
    import os
    start_run(fast_config("train.rounds=1"), tmp_path / "run", progress=False)
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "run" / "summary.json").stat().st_mode & 0o777 == 0o666 & ~mask


def test_a_run_that_cannot_start_leaves_no_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEPFL_DATA", str(tmp_path / "nodata"))
    with pytest.raises(EdgepflError):
        start_run(fast_config("dataset.name=mnist", "dataset.download=false"), tmp_path / "run",
                  progress=False)
    assert not (tmp_path / "run").exists()


def test_a_client_without_a_named_prediction_is_left_out_of_that_figure(monkeypatch):
    from edgepfl.engine.transport import Figures

    sim = Simulation(fast_config("train.rounds=1"), progress=False)
    # client 0 has a 'global' prediction (8 of 10 right), client 1 none, the others no test
    # samples: the global figure is client 0's alone, not the mean with a zero for client 1
    crafted = {0: Figures(6, 10, 5.0, {"global": (8, 4.0)}), 1: Figures(4, 10, 7.0)}
    crafted.update({c: Figures(0, 0, math.nan) for c in range(2, sim.num_clients)})
    monkeypatch.setattr(sim.transport, "evaluate", lambda rnd, messages: crafted)
    row = sim.rounds.evaluate(1)
    assert row["acc_mean"] == pytest.approx(0.5)
    assert row["acc_global_mean"] == pytest.approx(0.8)
    assert row["acc_global_min"] == pytest.approx(0.8)
    assert row["loss_global"] == pytest.approx(0.4)


def test_the_summary_says_which_machine_and_torch_computed_the_run(tmp_path):
    # CPU float results differ in the last bits across processor models and torch versions
    # (enough to flip a near-tie prediction): a kept run must say where it came from
    import torch

    start_run(fast_config("train.rounds=1"), tmp_path / "run", progress=False)
    host = json.loads((tmp_path / "run" / "summary.json").read_text())["host"]
    assert host["torch"] == torch.__version__ and host["torch_threads"] == torch.get_num_threads()
    assert isinstance(host["cpu"], str) and host["cpu"] and host["cpus"] >= 1


def test_a_diverged_client_is_reported_once_and_a_sound_run_is_not(caplog):
    """A blown-up local training shows in the log when it happens, not only as a later
    accuracy collapse that reads like the method's (ClusterFL at lr 0.05, bench/papers/README.md)."""
    sound = Simulation(fast_config("train.rounds=2"), progress=False)
    with caplog.at_level("WARNING", logger="edgepfl"):
        sound.run()
    assert not [r for r in caplog.records if "diverged" in r.getMessage()]
    caplog.clear()
    blown = Simulation(fast_config("train.rounds=3", "train.lr=100"), progress=False)
    with caplog.at_level("WARNING", logger="edgepfl"):
        blown.run()
    said = [r.getMessage() for r in caplog.records if "diverged" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("round 1: training loss")
    assert blown.metrics[0]["train_loss"] > 10 * math.log(10)


def test_a_client_whose_model_blew_up_is_counted_not_hidden(caplog):
    """A NaN model still gets an accuracy (argmax of NaN logits), but its loss is NaN and
    the round's ``loss`` is a mean of the finite ones: without a count the clients a
    divergence killed vanish from the loss and show only as a low accuracy."""
    sim = Simulation(fast_config("train.rounds=2", "algorithm.name=local"), progress=False)
    with caplog.at_level("WARNING", logger="edgepfl"):
        sim.step()
        assert sim.metrics[-1]["clients_diverged"] == 0
        for t in sim.clients.row(3).values():  # client 3's personal model, in place
            if t.is_floating_point():
                t.fill_(math.nan)
        sim.step()
    row = sim.metrics[-1]
    assert row["clients_diverged"] == 1 and math.isfinite(row["loss"])
    said = [r.getMessage() for r in caplog.records if "not finite" in r.getMessage()]
    assert len(said) == 1 and "clients 3)" in said[0] and said[0].startswith("round 2:")
    assert sim.summary()["clients_diverged_final"] == 1


def test_a_server_that_configures_impossible_participants_is_stopped(monkeypatch):
    sim = Simulation(fast_config("train.participation=0.5"), progress=False)
    configure = sim.server.configure
    # a client out of range, none at all, the sample less one of its clients
    for chosen in (lambda s: [*s, 6], lambda s: [], lambda s: s[1:]):
        monkeypatch.setattr(sim.server, "configure",
                            lambda rnd, sampled, c=chosen: configure(rnd, c(sampled)))
        with pytest.raises(MessageError, match="may add only clients that train"):
            sim.step()
    assert sim.round == 0  # nothing was played
    monkeypatch.setattr(sim.server, "configure",
                        lambda rnd, sampled: configure(rnd, [0, 1, 2, 3, 4, 5]))
    assert sim.step()["clients"] == 6


def test_a_hook_sees_every_round_and_is_closed_when_the_run_fails(monkeypatch):
    from edgepfl.engine.rundir import Hook

    class Tally(Hook):
        def __init__(self):
            self.rows, self.finished, self.closed = [], 0, 0

        def after_round(self, rounds, row):
            self.rows.append((rounds.round, row["round"], len(rounds.metrics)))

        def after_run(self, rounds):
            self.finished += 1

        def close(self):
            self.closed += 1

    whole = Tally()
    Simulation(fast_config("train.rounds=3"), progress=False).run(hooks=[whole])
    assert (whole.rows, whole.finished, whole.closed) == ([(1, 1, 1), (2, 2, 2), (3, 3, 3)], 1, 1)

    cut = Tally()
    sim = Simulation(fast_config("train.rounds=3"), progress=False)
    crash_after(sim, 1, monkeypatch, hooks=[cut])
    assert (cut.rows, cut.finished, cut.closed) == ([(1, 1, 1)], 0, 1)


def test_a_resume_takes_the_resuming_commands_execution_settings(tmp_path, monkeypatch):
    cfg = fast_config("train.rounds=3")
    whole = start_run(cfg, tmp_path / "whole", progress=False)
    crash_after(Simulation(cfg, tmp_path / "cut", progress=False), 1, monkeypatch)
    resumed = resume_run(tmp_path / "cut", progress=False, overrides=["train.store=disk"])
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["train"]["store"] == "disk"
    assert _strip(resumed.metrics) == _strip(whole.metrics)
    with pytest.raises(ConfigError, match="train.lr"):
        resume_run(tmp_path / "cut", progress=False, overrides=["train.lr=0.5"])
