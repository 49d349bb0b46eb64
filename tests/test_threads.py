"""``train.threads``: what ``auto`` picks, a number set as given, and the CLI's --threads."""

import json
import os

import pytest
import torch
from click.testing import CliRunner

from edgepfl.cli import main
from edgepfl.config import build_config
from edgepfl.engine import threads as th
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.models.zoo import build_model
from tests.conftest import fast_config


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_number_is_set_as_given_and_auto_keeps_to_the_process_s_count(monkeypatch):
    sim = Simulation(fast_config("train.threads=3"), progress=False)
    assert sim.threads.count == 3 and torch.get_num_threads() == 3
    # this test process started at one thread (conftest): auto stays there, unmeasured
    monkeypatch.setattr(th, "cpu_counters", lambda: pytest.fail("measured the load"))
    sim = Simulation(fast_config(), progress=False)
    assert sim.cfg.train.threads == "auto"
    assert sim.threads.count == 1 and torch.get_num_threads() == 1


def test_auto_takes_the_cores_other_processes_leave(monkeypatch):
    monkeypatch.setattr(th, "usable_cores", lambda: 8)
    big = 100 * th.FLOPS_PER_THREAD
    assert th.auto_threads(big, 0.2, 8) == 8  # a shell's load leaves every core
    assert th.auto_threads(big, 0.6, 8) == 7
    assert th.auto_threads(big, 2.7, 8) == 5  # three cores taken
    assert th.auto_threads(big, 11.0, 8) == 1  # more load than cores: still one
    assert th.auto_threads(big, 0.0, 2) == 2  # never above the process's own count
    assert th.auto_threads(None, 0.0, 8) == 8  # a step of unknown size is taken as large
    # a small step is not cut finer than FLOPS_PER_THREAD a thread
    assert th.auto_threads(2.5 * th.FLOPS_PER_THREAD, 0.0, 8) == 3
    assert th.auto_threads(th.FLOPS_PER_THREAD / 10, 0.0, 8) == 1


def test_others_load_leaves_out_this_process_s_own_time(monkeypatch):
    monkeypatch.setattr(th.os, "cpu_count", lambda: 4)
    # 400 jiffies over 4 CPUs (one tick of wall time each 4): 300 busy, 100 of them ours
    assert th.others_load((0, 0, 0), (300, 400, 100)) == pytest.approx(2.0)
    assert th.others_load((0, 0, 0), (100, 400, 100)) == 0.0
    assert th.others_load((5, 5, 5), (5, 5, 5)) == 0.0


def test_the_governor_gives_cores_back_when_the_machine_gets_busy(monkeypatch):
    monkeypatch.setattr(th.ThreadGovernor, "ceiling", 4)
    monkeypatch.setattr(th, "usable_cores", lambda: 4)
    monkeypatch.setattr(th.os, "cpu_count", lambda: 4)
    # counters as (busy, total, own): 4 CPUs, 400 jiffies a reading
    readings = iter([(0, 0, 0), (100, 400, 100),  # start: only this process works
                     (500, 800, 200),  # a round beside 3 cores of others' work
                     (700, 1200, 400)])  # quiet again
    monkeypatch.setattr(th, "cpu_counters", lambda: next(readings))
    gov = th.ThreadGovernor("auto", lambda: 100 * th.FLOPS_PER_THREAD, probe_s=0)
    assert gov.count == 4 and torch.get_num_threads() == 4
    gov.after_round(None, {})
    assert gov.count == 1 and torch.get_num_threads() == 1
    gov.after_round(None, {})
    assert gov.count == 4 and torch.get_num_threads() == 4


def test_busy_cores_are_read_from_the_kernel():
    first = th.cpu_counters()
    if first is None:
        pytest.skip("no /proc here")
    sum(range(10**6))
    load = th.others_load(first, th.cpu_counters())
    assert 0.0 <= load <= (os.cpu_count() or 1)


def test_step_flops_grows_with_model_and_batch_and_is_none_for_a_model_it_cannot_run():
    small = build_model("cnn_small", (1, 8, 8), 10)
    large = build_model("lenet5", (1, 28, 28), 10)
    a = th.step_flops(small, torch.zeros(1, 8, 8), 32)
    assert a > 0 and th.step_flops(small, torch.zeros(1, 8, 8), 64) == pytest.approx(2 * a)
    assert th.step_flops(large, torch.zeros(1, 28, 28), 32) > a
    assert small.training  # the estimate leaves the model's mode as it was
    assert th.step_flops(small, torch.zeros(3, 5, 5), 32) is None  # wrong input


@pytest.mark.parametrize("value", [0, -1, "many", True])
def test_a_bad_thread_count_is_refused_naming_the_value(value):
    with pytest.raises(ConfigError, match="threads"):
        build_config({"train": {"threads": value}})


def test_the_cli_threads_option_is_the_setting(tmp_path):
    runner = CliRunner()
    out = tmp_path / "run"
    base = ["run", "--quiet", "--out", str(out), "--set", "dataset.name=synthetic",
            "--set", "partition.clients=3", "--set", "train.rounds=1",
            "--set", "output.plots=false",
            # the setting is under test, not the training: one small epoch is enough
            "--set", "train.local_epochs=1", "--set", "dataset.fraction=0.25"]
    result = runner.invoke(main, [*base, "--threads", "2"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["train"]["threads"] == 2
    # how a run executes: a resume may change it
    result = runner.invoke(main, ["run", "--quiet", "--resume", str(out), "--threads", "1",
                                  "--set", "train.rounds=2"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["train"]["threads"] == 1
    result = runner.invoke(main, [*base[:3], str(tmp_path / "other"), *base[4:],
                                  "--threads", "zero"])
    assert result.exit_code == 2 and "'zero'" in result.output and "auto" in result.output


