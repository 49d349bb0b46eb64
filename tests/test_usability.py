"""What a new user runs into first: misspelt names, long listings, re-running a run's own
configuration, quoted numbers, and resuming what is not a run."""

import json

from click.testing import CliRunner

from edgepfl.cli import main

# the command line is under test, not the training: one local epoch on a quarter of the set
FAST = ["--set", "dataset.name=synthetic", "--set", "partition.clients=3", "--set",
        "train.rounds=1", "--set", "output.plots=false", "--set", "train.local_epochs=1",
        "--set", "dataset.fraction=0.25", "--quiet"]


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_a_misspelt_setting_or_algorithm_gets_the_closest_valid_names():
    res = invoke("run", "--set", "train.rouds=3")
    assert res.exit_code == 2 and "unknown setting 'train.rouds' (did you mean 'rounds'?)" in res.output
    res = invoke("run", "--set", "trian.rounds=3")
    assert res.exit_code == 2 and "(did you mean 'train'?)" in res.output
    res = invoke("run", "--set", "algorithm.name=fedprx")
    assert res.exit_code == 2 and "did you mean 'fedprox'" in res.output
    res = invoke("run", "--set", "train.zzzz=3")
    assert res.exit_code == 2 and "did you mean" not in res.output


def test_list_filters_by_a_pattern():
    everything = invoke("list").output
    lr = invoke("list", "lr_decay")
    assert lr.exit_code == 0
    names = [line.split()[0] for line in lr.output.splitlines() if line.startswith("  ")]
    assert names == ["train.lr", "train.lr_decay", "train.lr_final", "train.lr_decay_rounds"]
    assert len(lr.output) < len(everything) / 20
    assert "eval.validation" in invoke("list", "EVAL.*").output
    assert invoke("list", "no-such-thing-anywhere").exit_code != 0


def test_a_runs_own_config_json_runs_again(tmp_path):
    assert invoke("run", *FAST, "--set", "algorithm.name=fedprox", "--set", "algorithm.mu=0.3",
                  "--out", str(tmp_path / "a")).exit_code == 0
    again = invoke("run", str(tmp_path / "a" / "config.json"), "--set", "seed=1", "--quiet",
                   "--out", str(tmp_path / "b"))
    assert again.exit_code == 0, again.output
    a = json.loads((tmp_path / "a" / "config.json").read_text())
    b = json.loads((tmp_path / "b" / "config.json").read_text())
    assert b["seed"] == 1 and {**b, "seed": 0} == a
    (tmp_path / "list.json").write_text("[1, 2]")
    res = invoke("run", str(tmp_path / "list.json"))
    assert res.exit_code == 2 and "not an object of settings" in res.output


def test_a_quoted_number_is_refused_in_a_file_as_on_the_command_line(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[train]\nrounds = "1"\n')
    res = invoke("run", str(cfg))
    assert res.exit_code == 2 and "train.rounds = '1'" in res.output
    res = invoke("run", "--set", 'train.rounds="1"')
    assert res.exit_code == 2 and "train.rounds = '1'" in res.output


def test_resume_errors_read_like_every_other_error(tmp_path):
    res = invoke("run", "--resume", str(tmp_path / "nothing"))
    assert res.exit_code == 2 and res.output.startswith("error: --resume")
    (tmp_path / "empty").mkdir()
    res = invoke("run", "--resume", str(tmp_path / "empty"))
    assert res.exit_code == 2 and "holds no run to resume" in res.output
