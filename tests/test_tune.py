"""edgepfl tune: search spaces, the validation-only objective, a resumable SQLite study,
pruning through the run driver's hooks, and compare --tuned."""

import csv
import itertools
import json

import pytest
from click.testing import CliRunner

from edgepfl.algorithms import ALGORITHMS
from edgepfl.cli import main
from edgepfl.config import TrainConfig, build_config
from edgepfl.contract.algorithm import Choice, IntRange, LogUniform, Uniform
from edgepfl.engine.parts import resolve
from edgepfl.errors import ConfigError
from edgepfl.experiments.search_space import (
    TRAIN_SPACE,
    default_space,
    parse_space,
    search_space,
    spec_text,
)
from edgepfl.experiments.tune import tune
from tests.conftest import fast_config

optuna = pytest.importorskip("optuna")

FAST = ["--set", "dataset.name=synthetic", "--set", "partition.clients=4", "--set",
        "train.rounds=2", "--set", "train.local_epochs=1", "--set", "output.plots=false",
        "--quiet", "--threads", "1"]
VALIDATION = ["--set", "eval.validation=0.2"]


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


# -- the search space ---------------------------------------------------------------------
def test_space_parser_reads_every_kind():
    space = parse_space(["algorithm.mu=loguniform:0.001:1", "train.lr=uniform:0.01:0.2",
                         "algorithm.k=int:2:8", "algorithm.mode=choice:a,b",
                         "algorithm.flag=choice:true,false", "algorithm.n=choice:1,2.5"])
    assert space == {"algorithm.mu": LogUniform(0.001, 1.0), "train.lr": Uniform(0.01, 0.2),
                     "algorithm.k": IntRange(2, 8), "algorithm.mode": Choice(("a", "b")),
                     "algorithm.flag": Choice((True, False)),
                     "algorithm.n": Choice((1, 2.5))}
    # the text form reads back as the same range
    for key, rng in space.items():
        assert parse_space([f"{key}={spec_text(rng)}"]) == {key: rng}
    assert parse_space(['algorithm.mode=choice:"1",b'])["algorithm.mode"] == Choice(("1", "b"))
    assert spec_text(Choice(("1", "b"))) == 'choice:"1",b'


@pytest.mark.parametrize("item, why", [
    ("algorithm.mu", "not of the form KEY=KIND"),
    ("algorithm.mu=", "not of the form KEY=KIND"),
    ("mu=loguniform:0.1:1", "not a dotted setting"),
    ("algorithm.mu=gauss:0:1", "unknown kind 'gauss'"),
    ("algorithm.mu=loguniform:0:1", "0 < LOW < HIGH"),
    ("algorithm.mu=loguniform:1:0.1", "0 < LOW < HIGH"),
    ("algorithm.mu=loguniform:0.1", "takes two numbers"),
    ("algorithm.mu=uniform:a:b", "must be numbers"),
    ("algorithm.mu=uniform:0:inf", "finite"),
    ("algorithm.mu=uniform:1:1", "LOW < HIGH"),
    ("algorithm.k=int:1.5:3", "whole numbers"),
    ("algorithm.k=int:3:2", "LOW < HIGH"),
    ("algorithm.m=choice:a", "at least two values"),
    ("algorithm.m=choice:a,,b", "none of them empty"),
    ("algorithm.m=choice:a,a", "twice"),
])
def test_a_bad_space_names_the_spec_and_the_valid_forms(item, why):
    with pytest.raises(ConfigError) as exc:
        parse_space([item])
    text = str(exc.value)
    assert repr(item) in text and why in text
    assert "loguniform:LOW:HIGH" in text and "int:LOW:HIGH" in text and "choice:A,B" in text


def test_a_space_names_each_setting_once():
    with pytest.raises(ConfigError, match="names algorithm.mu twice"):
        parse_space(["algorithm.mu=loguniform:0.1:1", "algorithm.mu=uniform:0:1"])


def base_dict(algorithm, *overrides):
    data = fast_config(*overrides).model_dump()
    data["algorithm"] = {**data["algorithm"], "name": algorithm}
    return data


@pytest.mark.parametrize("algorithm, item, why", [
    ("fedprox", "algorithm.k=int:1:3", "k is not a hyperparameter of fedprox; valid: evaluate, finetune_epochs, mu"),
    ("fedbn", "algorithm.k=int:1:3", "valid: (none)"),
    ("fedprox", "train.rounds=int:1:5", "train.rounds is the budget"),
    ("fedprox", "train.workers=int:1:2", "how a run executes"),
    ("fedprox", "train.speed=uniform:0:1", "not a train setting"),
    ("fedprox", "model.name=choice:mlp,cnn2", "model.name is neither"),
    ("fedper", "algorithm.personal_layers=loguniform:1:2", "takes whole numbers; use int"),
    ("l2sgd", "algorithm.p=uniform:0.5:1", "algorithm.p = 1.0 is not a valid setting"),
    ("fedavg", "algorithm.evaluate=choice:global,nearest",
     "algorithm.evaluate = 'nearest' is not a valid setting"),
])
def test_a_range_is_checked_against_the_algorithm(algorithm, item, why):
    with pytest.raises(ConfigError) as exc:
        search_space(base_dict(algorithm), algorithm, parse_space([item]))
    assert f"--space {item.split('=')[0]}=" in str(exc.value)
    assert why in str(exc.value)


def test_set_takes_a_setting_out_of_the_search_and_space_replaces_a_range():
    base = base_dict("fedprox")
    assert search_space(base, "fedprox", {}) == {"train.lr": TRAIN_SPACE["train.lr"],
                                                 "algorithm.mu": LogUniform(0.001, 1.0)}
    assert list(search_space(base, "fedprox", {}, fixed=["train.lr"])) == ["algorithm.mu"]
    given = parse_space(["algorithm.mu=loguniform:0.01:0.1", "train.momentum=choice:0,0.9"])
    assert search_space(base, "fedprox", given) == {
        "train.lr": TRAIN_SPACE["train.lr"], "algorithm.mu": LogUniform(0.01, 0.1),
        "train.momentum": Choice((0, 0.9))}
    with pytest.raises(ConfigError, match="both fixed .--set. and searched .--space."):
        search_space(base, "fedprox", given, fixed=["algorithm.mu"])
    with pytest.raises(ConfigError, match="nothing to search for fedavg"):
        search_space(base_dict("fedavg"), "fedavg", {}, fixed=["train.lr"])
    # a default range the base makes invalid says how to get past it
    with pytest.raises(ConfigError, match="pfedme's search space .*--space algorithm.personal_lr"):
        search_space(base_dict("pfedme", "algorithm.lamda=100"), "pfedme", {})


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_declared_space_is_valid_at_every_corner(name):
    algo = ALGORITHMS[name]
    hp = algo.hyperparameters
    assert set(hp.not_searched) <= set(TRAIN_SPACE), hp.not_searched
    space = default_space(name)
    for key in space:
        section, _, field = key.partition(".")
        fields = TrainConfig.model_fields if section == "train" else hp.model_fields
        assert section in ("train", "algorithm") and field in fields, key
    # every combination of the ranges' ends, not just each alone: a search draws them together
    for corner in itertools.product(*(rng.ends() for rng in space.values())):
        data = {"algorithm": {"name": name}}
        for key, value in zip(space, corner, strict=True):
            section, _, field = key.partition(".")
            data.setdefault(section, {})[field] = value
        resolve(build_config(data))


def test_pfedbayes_does_not_search_the_rate_it_never_reads():
    assert "train.lr" not in default_space("pfedbayes")
    assert "train.lr" in default_space("fedavg")


# -- the study ----------------------------------------------------------------------------
def test_tune_refuses_without_a_validation_split(tmp_path):
    res = invoke("tune", "--algorithm", "fedprox", "--trials", "2", *FAST,
                 "--study", str(tmp_path / "s"))
    assert res.exit_code == 2
    assert "eval.validation" in res.output and "test set" in res.output
    assert not (tmp_path / "s").exists()


def test_a_study_writes_its_tables_and_resumes_to_the_total(tmp_path):
    study = tmp_path / "study"
    res = invoke("tune", "--algorithm", "fedprox", "--trials", "3", *FAST, *VALIDATION,
                 "--study", str(study), "--no-prune")
    assert res.exit_code == 0, res.output
    for name in ("study.db", "best.json", "tune.md", "tune.csv"):
        assert (study / name).exists(), name
    first = rows(study / "tune.csv")
    assert [r["trial"] for r in first] == ["0", "1", "2"]
    assert all(r["state"] == "complete" for r in first)
    assert sorted(p.name for p in study.glob("trial-*")) == [
        "trial-0000", "trial-0001", "trial-0002"]
    best = json.loads((study / "best.json").read_text())
    top = max(first, key=lambda r: float(r["val_acc_mean_best"]))
    assert best["trial"] == int(top["trial"]) and best["algorithm"] == "fedprox"
    assert best["value"] == float(top["val_acc_mean_best"])
    # --set-ready: the settings read back as the trial's values
    cfg = build_config({"algorithm": {"name": "fedprox"}}, best["settings"])
    assert cfg.train.lr == float(top["train.lr"])
    assert cfg.algorithm.hyperparameters()["mu"] == float(top["algorithm.mu"])
    # the winner's own run directory ran with those values
    ran = json.loads((study / best["run_dir"] / "config.json").read_text())
    assert ran["train"]["lr"] == cfg.train.lr and ran["eval"]["validation"] == 0.2
    assert "**" + top["trial"] + "**" in (study / "tune.md").read_text()
    # the comparison it suggests is in the study's setting, on seeds it was not tuned on
    suggested = (study / "tune.md").read_text()
    assert "--set eval.validation=0.2" in suggested and "--seeds 1,2,3,4,5" in suggested

    res = invoke("tune", "--algorithm", "fedprox", "--trials", "4", *FAST, *VALIDATION,
                 "--study", str(study), "--no-prune")
    assert res.exit_code == 0, res.output
    assert "3 of 4 trials done" in res.output
    again = rows(study / "tune.csv")
    assert [r["trial"] for r in again] == ["0", "1", "2", "3"]
    assert again[:3] == first
    assert len(list(study.glob("trial-*"))) == 4

    # the same study with another problem is refused before a trial runs
    res = invoke("tune", "--algorithm", "fedprox", "--trials", "5", *FAST, *VALIDATION,
                 "--set", "train.rounds=3", "--study", str(study / "study.db"))
    assert res.exit_code == 2
    assert "another search" in res.output and "train.rounds: study has 2, given 3" in res.output
    assert len(rows(study / "tune.csv")) == 4


def test_the_sampler_draws_the_same_points_from_the_same_seed(tmp_path):
    from edgepfl.experiments.tune import _next_trial, _open_study

    space = {"train.lr": LogUniform(0.001, 0.3), "algorithm.k": IntRange(1, 9),
             "algorithm.m": Choice(("a", "b", "c"))}

    def points(folder, seed, runs):
        folder.mkdir()
        drawn = []
        for total in runs:  # each entry: a process that runs the study up to that total
            study, storage = _open_study(folder / "study.db", "none", 2)
            while (nxt := _next_trial(study, storage, folder / "lock", total, seed, space)):
                trial, params = nxt
                study.tell(trial, params["train.lr"])
                drawn.append(params)
        return drawn

    straight = points(tmp_path / "a", 7, [4])
    assert len(straight) == 4 and len({p["train.lr"] for p in straight}) == 4
    assert points(tmp_path / "b", 7, [2, 4]) == straight  # resumed: the same points
    assert points(tmp_path / "c", 8, [4]) != straight


def test_an_interrupted_point_is_tried_once_more(tmp_path):
    from optuna.trial import TrialState

    from edgepfl.experiments.tune import _next_trial, _open_study

    space = {"train.lr": LogUniform(0.001, 0.3)}
    study, storage = _open_study(tmp_path / "study.db", "none", 2)

    def draw():
        return _next_trial(study, storage, tmp_path / "lock", 5, 7, space)

    def interrupt(trial):  # what Ctrl-C leaves: not counted, never judged
        trial.set_user_attr("interrupted", "stopped by the user")
        study.tell(trial, state=TrialState.FAIL)

    first, point = draw()
    interrupt(first)
    again, same = draw()
    assert same == point and again.number == first.number + 1
    interrupt(again)  # interrupted twice: left, so that it cannot stall the study
    third, other = draw()
    assert other != point
    study.tell(third, 0.5)


class PruneAfterFirstRound(optuna.pruners.BasePruner):
    def prune(self, study, trial):
        return trial.last_step is not None and trial.last_step >= 1


def test_the_pruning_hook_stops_a_run_that_falls_behind(tmp_path):
    cfg = fast_config("partition.clients=4", "train.rounds=3", "eval.validation=0.2")
    best = tune(cfg, "fedprox", 1, tmp_path / "s", pruner=PruneAfterFirstRound(),
                progress=False, echo=lambda _: None)
    assert best == {}  # no complete trial, so no best setting
    assert not (tmp_path / "s" / "best.json").exists()
    study = optuna.load_study(study_name="edgepfl",
                              storage=f"sqlite:///{tmp_path / 's' / 'study.db'}")
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.PRUNED
    assert list(trial.intermediate_values) == [1]
    metrics = rows(tmp_path / "s" / "trial-0000" / "metrics.csv")
    assert [r["round"] for r in metrics] == ["1"]  # of 3 planned
    (row,) = rows(tmp_path / "s" / "tune.csv")
    assert row["state"] == "pruned" and row["rounds"] == "1"
    assert study.user_attrs["pruners"] == ["PruneAfterFirstRound"]
    assert "No trial has completed yet" in (tmp_path / "s" / "tune.md").read_text()


# -- compare --tuned ----------------------------------------------------------------------
def test_compare_runs_a_tuned_algorithm_at_its_best_setting(tmp_path):
    study = tmp_path / "tune-fedprox"
    study.mkdir()
    (study / "best.json").write_text(json.dumps({
        "algorithm": "fedprox", "value": 0.5, "trial": 3, "trials": {"complete": 4},
        "settings": ["train.lr=0.0123", "algorithm.mu=0.456"]}))
    out = tmp_path / "cmp"
    args = ["compare", "--algorithms", "fedavg,fedprox", "--seeds", "0", *FAST,
            "--set", "train.rounds=1", "--set", "train.lr=0.05", "--out", str(out)]
    res = invoke(*args, "--tuned", str(study / "study.db"))
    assert res.exit_code == 0, res.output
    tuned = json.loads((out / "fedprox-seed0" / "config.json").read_text())
    assert tuned["train"]["lr"] == 0.0123 and tuned["algorithm"]["mu"] == 0.456
    plain = json.loads((out / "fedavg-seed0" / "config.json").read_text())
    assert plain["train"]["lr"] == 0.05
    table = (out / "comparison.md").read_text()
    assert "| fedprox (tuned) |" in table and "| fedavg |" in table
    assert "| fedavg | defaults (no study given) |" in table
    assert "train.lr=0.0123, algorithm.mu=0.456" in table
    by_algo = {r["algorithm"]: r["tuned"] for r in rows(out / "comparison.csv")}
    assert by_algo["fedavg"] == "" and "algorithm.mu=0.456" in by_algo["fedprox"]
    assert "fedprox's tuned train.lr replaces" in res.output
    # an untuned baseline against a tuned method is said, not left to the table
    assert "fedavg run at their defaults while fedprox were tuned" in res.output

    res = invoke(*args[:-1], str(tmp_path / "other"), "--tuned", str(study),
                 "--algorithms", "fedavg,local")
    assert res.exit_code == 2 and "tuned fedprox, which is not among" in res.output
    res = invoke(*args[:-1], str(tmp_path / "none"), "--tuned", str(tmp_path / "missing"))
    assert res.exit_code == 2 and "no " in res.output and "best.json" in res.output


def test_the_same_command_again_goes_on_with_its_study(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["tune", "--algorithm", "fedprox", *FAST, *VALIDATION, "--set", "train.rounds=1"]
    assert invoke(*args, "--trials", "1").exit_code == 0
    again = invoke(*args, "--trials", "2")
    assert again.exit_code == 0, again.output
    assert "1 of 2 trials done" in again.output
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["tune-fedprox"]
    assert len(rows(tmp_path / "runs" / "tune-fedprox" / "tune.csv")) == 2


def test_the_median_pruner_never_judges_the_first_quarter_of_the_rounds():
    from edgepfl.experiments.tune import _pruner

    study = optuna.create_study(direction="maximize")
    for value in (0.9, 0.8, 0.85, 0.95, 0.7):  # five finished trials: medians to judge by
        trial = study.ask()
        for step in range(1, 9):
            trial.report(value, step)
        study.tell(trial, value)
    pruner = _pruner(None, rounds=8)
    behind = study.ask()
    for step in range(1, 9):
        behind.report(0.0, step)  # far behind from the first round
        judged = bool(pruner.prune(study, study.trials[-1]))
        assert judged == (step > 2), step  # rounds 1-2 are the first quarter of 8


def test_a_trial_folder_claimed_meanwhile_is_refused_and_left_alone(tmp_path, monkeypatch):
    """A trial's folder is claimed as edgepfl run claims its --out (locked, config.json
    created exclusively): where another process (a worker, a shell) claims it while this
    one sets the trial up, the trial fails with the reason and writes nothing there."""
    import edgepfl.experiments.runs as runs

    study, trial = tmp_path / "study", tmp_path / "study" / "trial-0000"
    real = runs.federation_of

    def federation_of(cfg):  # the trial's set-up: the other process claims the folder
        if study.exists():
            trial.mkdir(exist_ok=True)
            (trial / "config.json").write_text('{"theirs": 1}')
        return real(cfg)

    monkeypatch.setattr(runs, "federation_of", federation_of)
    res = invoke("tune", "--algorithm", "fedavg", "--trials", "1", *FAST, *VALIDATION,
                 "--study", str(study), "--no-prune")
    assert "trial 0 failed" in res.output and "already holds a run" in res.output, res.output
    [row] = rows(study / "tune.csv")
    assert row["state"] == "failed" and "already holds a run" in row["error"]
    assert sorted(p.name for p in trial.iterdir()) == ["config.json"]
    assert (trial / "config.json").read_text() == '{"theirs": 1}'
