"""The command line: bad input gets exit code 2 and a message naming the value."""

import csv
import json

import pytest
from click.testing import CliRunner

from edgepfl.cli import main

# what these tests check is the command line's handling, never how well a run learns: one
# local epoch on a quarter of the synthetic set (the default is 5 epochs on all of it)
FAST = ["--set", "dataset.name=synthetic", "--set", "partition.clients=4", "--set",
        "train.rounds=2", "--set", "output.plots=false", "--set", "train.local_epochs=1",
        "--set", "dataset.fraction=0.25", "--quiet"]


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_list_names_everything():
    res = invoke("list")
    assert res.exit_code == 0
    for word in ["fedavg", "fedprox", "local", "mnist", "fmnist", "cifar10", "cifar100", "digits",
                 "synthetic", "cnn2", "dirichlet", "pathological", "primary_secondary",
                 "train.participation", "algorithm.mu"]:
        assert word in res.output, word


def test_every_listed_default_is_read_back_by_set():
    """`list` shows defaults so that a user can copy one into --set; system.tiers' default,
    made of sections, is shown as TOML rather than Python's object text."""
    from edgepfl.config import Config, config_from_sources, describe_sections

    for key, shown, _ in describe_sections():
        if shown == "None":  # unset: nothing to copy
            continue
        given = {"system.tiers": ["system.devices=tiers"],  # read only with the other
                 "privacy": ["privacy.level=none"]}  # privacy.* alone are refused
        cfg = config_from_sources(None, [*given.get(key, given.get(key.split(".")[0], [])),
                                         f"{key}={shown}"])
        section, _, name = key.partition(".")
        got = getattr(getattr(cfg, section), name) if name else getattr(cfg, section)
        want = (Config.model_fields[section].get_default(call_default_factory=True)
                if not name else getattr(getattr(Config(), section), name))
        assert got == want, key
    res = invoke("list", "system.tiers")
    assert 'name = "weak"' in res.output and "DeviceTier(" not in res.output


def test_run_writes_a_run_directory_and_prints_the_summary(tmp_path):
    res = invoke("run", *FAST, "--out", str(tmp_path / "r"))
    assert res.exit_code == 0, res.output
    assert "best mean acc" in res.output and "final" in res.output and "worst client" in res.output
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["rounds"] == 2


def test_run_reads_a_toml_config(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[dataset]\nname = "synthetic"\nfraction = 0.25\n[partition]\nclients = 3\n'
                   '[train]\nrounds = 1\nlocal_epochs = 1\n[algorithm]\nname = "fedprox"\nmu = 0.5\n'
                   '[output]\nplots = false\n')
    res = invoke("run", str(cfg), "--out", str(tmp_path / "r"), "--quiet")
    assert res.exit_code == 0, res.output
    stored = json.loads((tmp_path / "r" / "config.json").read_text())
    assert stored["algorithm"] == {"name": "fedprox", "mu": 0.5, "evaluate": "global",
                                   "finetune_epochs": 1}
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
    assert prox["algorithm"] == {"name": "fedprox", "mu": 0.3, "evaluate": "global",
                                 "finetune_epochs": 1}
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
    cfg.write_text('[dataset]\nname = "synthetic"\nfraction = 0.25\n[partition]\nclients = 4\n'
                   '[train]\nlocal_epochs = 1\n[output]\nplots = false\n')
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


def test_compare_table_has_sample_std_intervals_and_the_paired_difference(tmp_path):
    res = invoke("compare", "--algorithms", "local,fedavg", "--seeds", "0,1", *FAST,
                 "--set", "train.rounds=1", "--out", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    table = (tmp_path / "c" / "comparison.md").read_text()
    assert "sample standard deviation (ddof = 1)" in table and "| best 95% CI |" in table
    assert "## Against fedavg, seed by seed" in table
    assert any(line.startswith("| local | 2 | ") for line in table.splitlines())
    with open(tmp_path / "c" / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    local = [r for r in rows if r["algorithm"] == "local"]
    fedavg = {r["seed"]: r for r in rows if r["algorithm"] == "fedavg"}
    for r in local:  # the per-seed difference is this run minus fedavg's run of its seed
        assert float(r["acc_mean_best_diff"]) == (float(r["acc_mean_best"])
                                                 - float(fedavg[r["seed"]]["acc_mean_best"]))
        assert r["reference"] == "fedavg" and r["n_seeds"] == "2"
        assert float(r["acc_mean_final_ci_low"]) <= float(r["acc_mean_final_mean"])


def test_compare_with_a_validation_split_reports_the_round_it_picked(tmp_path):
    res = invoke("compare", "--algorithms", "local,fedavg", "--seeds", "0,1", *FAST,
                 "--set", "train.rounds=3", "--set", "eval.validation=0.2",
                 "--out", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    table = (tmp_path / "c" / "comparison.md").read_text()
    assert "| mean acc at validation's best round | its 95% CI |" in table
    assert "at validation's best round − fedavg" in table
    with open(tmp_path / "c" / "comparison.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:  # the test figure of the round the validation split picked
        run = json.loads((tmp_path / "c" / r["run_dir"] / "summary.json").read_text())
        assert float(r["acc_mean_at_val_best"]) == run["acc_mean_at_val_best"]
        assert int(r["val_best_round"]) == run["val_best_round"]
        assert float(r["acc_mean_at_val_best"]) <= float(r["acc_mean_best"])


def test_compare_refuses_a_reference_it_does_not_run(tmp_path):
    res = invoke("compare", "--algorithms", "local,fedprox", "--reference", "fedavg", *FAST,
                 "--out", str(tmp_path / "c"))
    assert res.exit_code == 2, res.output
    assert "--reference 'fedavg'" in res.output and "local, fedprox" in res.output
    assert not (tmp_path / "c").exists()
    res = invoke("compare", "--algorithms", "local", "--jobs", "0", *FAST,
                 "--out", str(tmp_path / "c"))
    assert res.exit_code == 2 and "--jobs 0" in res.output, res.output
    assert not (tmp_path / "c").exists()


def test_compare_in_worker_processes_equals_one_at_a_time(tmp_path):
    one_round = [*FAST, "--set", "train.rounds=1", "--threads", "1"]
    tables = {}
    for jobs in ("1", "2"):
        res = invoke("compare", "--algorithms", "local,fedavg", "--jobs", jobs, *one_round,
                     "--out", str(tmp_path / jobs))
        assert res.exit_code == 0, res.output
        with open(tmp_path / jobs / "comparison.csv", newline="") as f:
            tables[jobs] = [{k: v for k, v in r.items() if k.startswith("acc_")}
                            for r in csv.DictReader(f)]
    assert "2 runs, 2 at a time" in res.output
    assert tables["1"] == tables["2"] and len(tables["1"]) == 2


def test_a_failing_run_is_named_and_the_others_finish(tmp_path):
    out = tmp_path / "c"
    # a run already in the folder with another setting: resuming it is refused
    assert invoke("run", *FAST, "--set", "algorithm.name=local", "--set", "train.lr=0.9",
                  "--set", "train.rounds=1", "--out", str(out / "local-seed0")).exit_code == 0
    res = invoke("compare", "--algorithms", "local,fedavg", *FAST, "--set", "train.rounds=1",
                 "--out", str(out))
    assert res.exit_code == 2, res.output
    assert "1 of 2 runs failed" in res.output and "local-seed0: " in res.output
    assert "train.lr" in res.output
    assert (out / "fedavg-seed0" / "summary.json").is_file()
    assert not (out / "comparison.csv").exists() and not (out / "comparison.md").exists()


def test_sweep_runs_every_combination_and_tabulates_it(tmp_path):
    out = tmp_path / "s"
    args = ["sweep", "--grid", "train.lr=0.01,0.05", "--grid", "partition.alpha=0.5",
            *FAST, "--set", "train.rounds=1", "--out", str(out)]
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [
        "lr=0.01+alpha=0.5-seed0", "lr=0.05+alpha=0.5-seed0"]
    assert json.loads((out / "lr=0.05+alpha=0.5-seed0" / "config.json").read_text())[
        "train"]["lr"] == 0.05
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["train.lr"], r["partition.alpha"], r["n_seeds"]) for r in rows] == [
        ("0.01", "0.5", "1"), ("0.05", "0.5", "1")]
    assert rows[0]["acc_mean_best_mean"] and rows[0]["acc_mean_best_ci_low"] == ""  # one seed
    table = (out / "sweep.md").read_text()
    assert "| train.lr | partition.alpha | best mean acc |" in table and "n/a" in table
    assert (out / "sweep.png").is_file()
    # again, as after an interruption: finished runs are kept as they are
    kept = (out / "lr=0.01+alpha=0.5-seed0" / "metrics.csv").read_bytes()
    for name in ("sweep.csv", "sweep.md", "sweep.png"):
        (out / name).unlink()
    res = invoke(*args)
    assert res.exit_code == 0, res.output
    assert (out / "lr=0.01+alpha=0.5-seed0" / "metrics.csv").read_bytes() == kept
    res = invoke(*args)
    assert res.exit_code == 2 and "already holds a sweep" in res.output


def test_sweep_with_a_validation_split_gives_the_figure_to_choose_by(tmp_path):
    out = tmp_path / "s"
    res = invoke("sweep", "--grid", "train.lr=0.01,0.05", *FAST, "--set", "train.rounds=2",
                 "--set", "eval.validation=0.2", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "| at validation's best round | its 95% CI |" in (out / "sweep.md").read_text()
    with open(out / "sweep.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        run = json.loads((out / r["run_dirs"] / "summary.json").read_text())
        assert float(r["acc_mean_at_val_best_mean"]) == run["acc_mean_at_val_best"]


@pytest.mark.parametrize("grid,words", [
    ("train.bogus=1,2", ["unknown setting 'train.bogus'", "rounds"]),
    ("partition.alpha=0.5,-1", ["partition.alpha = -1", "greater than 0"]),
    ("train.rounds", ["train.rounds", "key=v1,v2"]),
])
def test_sweep_checks_every_combination_before_running(tmp_path, grid, words):
    res = invoke("sweep", "--grid", "train.lr=0.01,0.05", "--grid", grid, *FAST,
                 "--out", str(tmp_path / "s"))
    assert res.exit_code == 2, res.output
    for word in words:
        assert word in res.output, (word, res.output)
    assert "Traceback" not in res.output
    assert not (tmp_path / "s").exists()


def test_resume_with_a_config_file_names_a_run_directory_that_is_not_one(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text('{"train": 5}')
    (tmp_path / "same.toml").write_text('[algorithm]\nname = "fedavg"\n')
    res = invoke("run", "--resume", str(run), str(tmp_path / "same.toml"))
    assert res.exit_code == 2, res.output
    assert "is not an edgepfl run configuration" in res.output


def test_compare_progress_lines_name_their_run(tmp_path):
    fast = [a for a in FAST if a != "--quiet"]
    res = invoke("compare", "--algorithms", "fedavg", "--seeds", "0,1", *fast,
                 "--set", "train.rounds=1", "--out", str(tmp_path / "c"))
    assert res.exit_code == 0, res.output
    assert "fedavg-seed1: fedavg on synthetic: round 1/1" in res.output


def test_output_into_a_closed_pipe_is_not_an_error():
    # `edgepfl list | head -1`: the reader leaves early; the command ends without a
    # traceback or "error", with the status a pipe's writer gets. The reader here closes
    # before the first write, so the pipe is closed whatever the output's size.
    import os
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        f"{sys.executable} -c 'import sys; from edgepfl.cli import main; sys.exit(main())' "
        "list | (exec 0<&-); echo ${PIPESTATUS[0]} >&2", shell=True, capture_output=True,
        executable="/bin/bash",
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert b"Broken pipe" not in proc.stderr and b"error" not in proc.stderr
    assert proc.stderr.split()[-1] == b"141"
