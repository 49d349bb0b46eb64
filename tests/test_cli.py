"""The command line: bad input gets exit code 2 and a message naming the value."""

import json

import pytest
from click.testing import CliRunner

from edgepfl.cli import main

FAST = ["--set", "dataset.name=synthetic", "--set", "partition.clients=4", "--set",
        "train.rounds=2", "--set", "output.plots=false", "--quiet"]


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_list_names_everything():
    res = invoke("list")
    assert res.exit_code == 0
    for word in ["fedavg", "fedprox", "local", "mnist", "fmnist", "cifar10", "cifar100", "digits",
                 "synthetic", "cnn2", "dirichlet", "pathological", "primary_secondary",
                 "train.participation", "algorithm.mu"]:
        assert word in res.output, word


def test_run_writes_a_run_directory_and_prints_the_summary(tmp_path):
    res = invoke("run", *FAST, "--out", str(tmp_path / "r"))
    assert res.exit_code == 0, res.output
    assert "best mean acc" in res.output and "final" in res.output and "worst client" in res.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["rounds"] == 2


def test_run_reads_a_toml_config(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[dataset]\nname = "synthetic"\n[partition]\nclients = 3\n'
                   '[train]\nrounds = 1\n[algorithm]\nname = "fedprox"\nmu = 0.5\n'
                   '[output]\nplots = false\n')
    res = invoke("run", str(cfg), "--out", str(tmp_path / "r"), "--quiet")
    assert res.exit_code == 0, res.output
    stored = json.loads((tmp_path / "r" / "config.json").read_text())
    assert stored["algorithm"] == {"name": "fedprox", "mu": 0.5, "evaluate": "global"}
    assert stored["partition"]["clients"] == 3


@pytest.mark.parametrize("args,words", [
    (["--set", "train.bogus=1"], ["train.bogus", "rounds"]),
    (["--set", "algorithm.name=nope"], ["nope", "fedavg", "local"]),
    (["--set", "dataset.name=imagenet"], ["imagenet", "mnist", "synthetic"]),
    (["--set", "partition.scheme=weird"], ["weird", "dirichlet"]),
    (["--set", "partition.alpha=0"], ["partition.alpha", "0", "greater than 0"]),
    (["--set", "partition.alpha=-2"], ["partition.alpha", "-2"]),
    (["--set", "partition.clients=999999"], ["999999"]),
    (["--set", "train.participation=1.5"], ["train.participation", "1.5"]),
    (["--set", "noequals"], ["noequals", "key=value"]),
    (["--set", "system.devices=tiers", "--set", 'system.tiers=[{name="a",flops=1e9,share=1.0,foo=1}]'],
     ["system.tiers.0.foo", "name, flops, share"]),
])
def test_bad_input_exits_2_naming_the_value(tmp_path, args, words):
    res = invoke("run", *FAST, *args, "--out", str(tmp_path / "r"))
    assert res.exit_code == 2, res.output
    for word in words:
        assert word in res.output, (word, res.output)
    assert "Traceback" not in res.output


def test_unreadable_config_file_exits_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("this is = = not toml")
    res = invoke("run", str(bad))
    assert res.exit_code == 2 and "bad.toml" in res.output
    res = invoke("run", str(tmp_path / "missing.toml"))
    assert res.exit_code == 2 and "missing.toml" in res.output


def test_resume_with_other_settings_exits_2_and_keeps_the_run(tmp_path):
    out = tmp_path / "r"
    assert invoke("run", *FAST, "--out", str(out)).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = invoke("run", *FAST, "--set", "train.lr=0.9", "--resume", str(out))
    assert res.exit_code == 2 and "train.lr" in res.output
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_compare_writes_table_csv_and_plot(tmp_path):
    res = invoke("compare", "--algorithms", "local,fedavg", "--seeds", "0,1", *FAST,
                 "--out", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    for name in ["comparison.csv", "comparison.md", "comparison.png"]:
        assert (tmp_path / "c" / name).is_file()
    table = (tmp_path / "c" / "comparison.md").read_text()
    assert "| local | cnn_small |" in table and "| fedavg | cnn_small |" in table
    assert "±" in table
    rows = (tmp_path / "c" / "comparison.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 4


def test_compare_runs_fedbn_on_the_batchnorm_variant_and_says_so(tmp_path):
    res = invoke("compare", "--algorithms", "fedavg,fedbn", *FAST, "--out", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    assert "different models (fedavg: cnn_small, fedbn: cnn_small_bn)" in res.output
    table = (tmp_path / "c" / "comparison.md").read_text()
    assert "| fedavg | cnn_small |" in table and "| fedbn | cnn_small_bn |" in table
    assert "±" not in table  # one seed: no spread over seeds to show
    config = json.loads((tmp_path / "c" / "fedbn-seed0" / "config.json").read_text())
    assert config["model"]["name"] == "cnn_small_bn"


def test_compare_rejects_unknown_algorithm_before_running(tmp_path):
    res = invoke("compare", "--algorithms", "fedavg,nope", *FAST, "--out", str(tmp_path / "c"))
    assert res.exit_code == 2 and "nope" in res.output
    assert not (tmp_path / "c").exists()


def test_report_tabulates_costs_of_runs(tmp_path):
    for name in ["local", "fedavg"]:
        assert invoke("run", *FAST, "--set", f"algorithm.name={name}",
                      "--out", str(tmp_path / name)).exit_code == 0
    res = invoke("report", str(tmp_path / "local"), str(tmp_path / "fedavg"),
                 "--out", str(tmp_path / "rep"))
    assert res.exit_code == 0, res.output
    assert "| local | local |" in res.output and "| fedavg | fedavg |" in res.output
    assert "U-comm" in res.output and "GFLOPs" in res.output
    for name in ["report.md", "accuracy_vs_bytes.png", "accuracy_vs_time.png"]:
        assert (tmp_path / "rep" / name).is_file()


def test_report_of_a_missing_run_exits_2(tmp_path):
    res = invoke("report", str(tmp_path / "nowhere"))
    assert res.exit_code == 2 and "nowhere" in res.output


def test_compare_routes_hyperparameters_to_the_algorithms_that_have_them(tmp_path):
    res = invoke("compare", "--algorithms", "fedavg,fedprox", *FAST, "--set", "algorithm.mu=0.3",
                 "--out", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    prox = json.loads((tmp_path / "c" / "fedprox-seed0" / "config.json").read_text())
    assert prox["algorithm"] == {"name": "fedprox", "mu": 0.3, "evaluate": "global"}
    res = invoke("compare", "--algorithms", "fedavg,fedprox", *FAST,
                 "--set", "algorithm.fedprox.mu=0.2", "--out", str(tmp_path / "d"))
    assert res.exit_code == 0, res.output
    prox = json.loads((tmp_path / "d" / "fedprox-seed0" / "config.json").read_text())
    assert prox["algorithm"]["mu"] == 0.2
    res = invoke("compare", "--algorithms", "fedavg,local", *FAST, "--set", "algorithm.mu=0.3",
                 "--out", str(tmp_path / "e"))
    assert res.exit_code == 2 and "algorithm.mu" in res.output


def test_resume_with_more_rounds_extends_the_run(tmp_path):
    out = tmp_path / "r"
    assert invoke("run", *FAST, "--out", str(out)).exit_code == 0
    res = invoke("run", "--resume", str(out), "--set", "train.rounds=3", "--quiet")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3
    assert len((out / "metrics.csv").read_text().strip().splitlines()) == 1 + 3


def test_resume_with_the_config_file_again_does_not_extend_the_run(tmp_path):
    """A config file without train.rounds must not extend a run to the default 50."""
    cfg = tmp_path / "c.toml"
    cfg.write_text('[dataset]\nname = "synthetic"\n[partition]\nclients = 4\n[output]\nplots = false\n')
    out = tmp_path / "r"
    assert invoke("run", str(cfg), "--set", "train.rounds=2", "--out", str(out), "--quiet").exit_code == 0
    res = invoke("run", str(cfg), "--resume", str(out), "--quiet")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "config.json").read_text())["train"]["rounds"] == 2
    assert json.loads((out / "summary.json").read_text())["rounds"] == 2
    # naming train.rounds does extend it
    res = invoke("run", str(cfg), "--set", "train.rounds=3", "--resume", str(out), "--quiet")
    assert res.exit_code == 0, res.output
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3


@pytest.mark.parametrize("args,words", [
    (["--set", "system.server_flops=inf"], ["system.server_flops", "inf"]),
    (["--set", "train.lr=nan"], ["train.lr", "nan"]),
    (["--set", "seed=18446744073709551616"], ["seed", "18446744073709551616"]),
])
def test_values_a_run_folder_could_not_store_are_refused(tmp_path, args, words):
    res = invoke("run", *FAST, *args, "--out", str(tmp_path / "r"))
    assert res.exit_code == 2, res.output
    for word in words:
        assert word in res.output, (word, res.output)
    assert not (tmp_path / "r").exists()


def test_undecodable_config_and_unwritable_out_exit_2(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe[train]")
    res = invoke("run", str(bad))
    assert res.exit_code == 2 and "bad.toml" in res.output and "Traceback" not in res.output
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = invoke("run", *FAST, "--out", str(blocker / "sub"))
    assert res.exit_code == 2 and "sub" in res.output, res.output


def test_compare_takes_the_configured_seed_and_refuses_repeats(tmp_path):
    res = invoke("compare", "--algorithms", "local", *FAST, "--set", "seed=5",
                 "--out", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    assert (tmp_path / "c" / "local-seed5").is_dir()
    for args in (["--algorithms", "local,local"], ["--algorithms", "local", "--seeds", "1,1"]):
        res = invoke("compare", *args, *FAST, "--out", str(tmp_path / "d"))
        assert res.exit_code == 2 and "more than once" in res.output, res.output
        assert not (tmp_path / "d").exists()


def test_compare_again_continues_an_interrupted_comparison(tmp_path):
    out = tmp_path / "c"
    # as if interrupted: the first run finished, the comparison files were never written
    assert invoke("run", *FAST, "--set", "algorithm.name=local", "--out",
                  str(out / "local-seed0")).exit_code == 0
    kept = (out / "local-seed0" / "metrics.csv").read_bytes()
    res = invoke("compare", "--algorithms", "local,fedavg", *FAST, "--out", str(out))
    assert res.exit_code == 0, res.output
    assert (out / "local-seed0" / "metrics.csv").read_bytes() == kept
    rows = (out / "comparison.csv").read_text().strip().splitlines()
    assert len(rows) == 1 + 2
    # a changed configuration is refused rather than mixed in
    (out / "comparison.csv").unlink()
    res = invoke("compare", "--algorithms", "local,fedavg", *FAST, "--set", "train.lr=0.9",
                 "--out", str(out))
    assert res.exit_code == 2 and "train.lr" in res.output
