"""Plug-ins: a user's algorithm, model and data set, loaded from a file, a module or an
installed package, checked like built-in names and found again on resume."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
from click.testing import CliRunner

from edgepfl import plugins
from edgepfl.cli import main
from edgepfl.engine.simulation import Simulation
from tests.conftest import fast_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plugin" / "fedavgm_plugin.py"
SMALL = ["--set", "train.rounds=2", "--set", "partition.clients=4", "--set",
         "output.plots=false", "--quiet"]


def invoke(*args):
    return CliRunner().invoke(main, list(args))


def test_the_example_runs_from_the_command_line_and_resumes_in_a_fresh_process(tmp_path):
    run = tmp_path / "run"
    res = invoke("run", "--plugin", str(EXAMPLE), "--set", "algorithm.name=fedavgm",
                 "--set", "model.name=tiny_mlp", "--set", "dataset.name=blobs", *SMALL,
                 "--out", str(run))
    assert res.exit_code == 0, res.output
    assert "fedavgm on blobs (4 clients, 2 rounds)" in res.output
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["plugins"] == [str(EXAMPLE)] and cfg["model"]["name"] == "tiny_mlp"
    # a new process knows nothing of the plug-in but what config.json records: code from
    # the run directory, imported only when asked to
    resume = [sys.executable, "-m", "edgepfl.cli", "run", "--resume", str(run),
              "--set", "train.rounds=3", "--quiet"]
    done = subprocess.run(resume, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stdout
    assert "--trust-plugins" in done.stderr and repr(str(EXAMPLE)) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    done = subprocess.run([*resume, "--trust-plugins"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fedavgm on blobs (4 clients, 3 rounds)" in done.stdout
    # or named on the command line, as when it started
    done = subprocess.run([*resume[:-3], "--set", "train.rounds=4", "--quiet", "--plugin",
                           str(EXAMPLE)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "fedavgm on blobs (4 clients, 4 rounds)" in done.stdout


def test_a_refused_resume_imports_none_of_the_runs_plugins(tmp_path):
    """A run directory's config.json naming a plug-in the command does not: the resume is
    refused before anything is imported (the plug-in would write a marker)."""
    marker = tmp_path / "imported"
    plugin = tmp_path / "marker_plugin.py"
    plugin.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    run = tmp_path / "run"
    assert invoke("run", *SMALL[:-1], "--set", "dataset.name=synthetic", "--set",
                  "train.rounds=1", "--set", "train.local_epochs=1", "--quiet",
                  "--out", str(run)).exit_code == 0
    stored = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**stored, "plugins": [str(plugin)]}))
    before = (run / "metrics.csv").read_bytes()
    res = invoke("run", "--resume", str(run), "--set", "train.rounds=2", "--quiet")
    assert res.exit_code == 2, res.output
    assert "--trust-plugins" in res.output and "marker_plugin.py" in res.output
    assert not marker.exists(), "a refused resume imported the run's plug-in"
    assert (run / "metrics.csv").read_bytes() == before
    res = invoke("run", "--resume", str(run), "--set", "train.rounds=2", "--quiet",
                 "--trust-plugins")
    assert res.exit_code == 0, res.output
    assert marker.exists()
    assert invoke("run", "--trust-plugins", "--quiet").exit_code == 2


def test_list_shows_a_plugins_names_and_where_they_come_from():
    res = invoke("list", "--plugin", str(EXAMPLE), "plug-in")
    assert res.exit_code == 0, res.output
    for name in ("fedavgm", "tiny_mlp", "blobs"):
        assert name in res.output, name
    assert f"(plug-in {EXAMPLE})" in res.output
    res = invoke("list", "--plugin", str(EXAMPLE), "algorithm.server_lr")
    assert "fedavgm hyperparameters" in res.output and "(default 1.0)" in res.output
    # an algorithm's name lists its settings, whatever their descriptions say
    res = invoke("list", "--plugin", str(EXAMPLE), "fedavgm")
    assert "algorithm.server_lr" in res.output and "algorithm.momentum" in res.output


def test_compare_and_tune_take_a_plugins_algorithm(tmp_path):
    """In a fresh process, where only --plugin or the config's plugins can make the name
    known before --algorithms / --algorithm are checked."""
    tiny = ["--set", "dataset.name=blobs", "--set", "model.name=tiny_mlp", "--set",
            "train.rounds=1", "--set", "partition.clients=4", "--set", "output.plots=false",
            "--quiet", "--threads", "1"]
    cli = [sys.executable, "-m", "edgepfl.cli"]
    done = subprocess.run([*cli, "compare", "--plugin", str(EXAMPLE), "--algorithms",
                           "fedavg,fedavgm", "--seeds", "0", *tiny, "--out", str(tmp_path / "cmp")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = (tmp_path / "cmp" / "comparison.csv").read_text()
    assert "fedavgm" in rows and "fedavg" in rows
    config = tmp_path / "plug.toml"
    config.write_text(f"plugins = [{json.dumps(str(EXAMPLE))}]\n")
    done = subprocess.run([*cli, "tune", str(config), "--algorithm", "fedavgm", "--trials", "1",
                           "--set", "eval.validation=0.25", *tiny, "--study", str(tmp_path / "t")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "t" / "best.json").read_text())["algorithm"] == "fedavgm"


def test_tune_takes_a_plugins_algorithm_given_with_plugin_and_its_compare_loads_it(tmp_path):
    """--plugin used to rebuild the configuration from model_dump(), so that every setting
    counted as given: algorithm.name = 'fedavg' against --algorithm fedavgm."""
    tiny = ["--trials", "1", "--set", "eval.validation=0.2", "--set", "train.rounds=1",
            "--set", "dataset.name=blobs", "--set", "partition.clients=4", "--set",
            "output.plots=false", "--quiet", "--threads", "1"]
    res = invoke("tune", "--plugin", str(EXAMPLE), "--algorithm", "fedavgm", *tiny,
                 "--study", str(tmp_path / "t"))
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "t" / "best.json").read_text())["algorithm"] == "fedavgm"
    # the comparison it suggests loads the plug-in, or fedavgm would be unknown there
    suggested = next(line for line in res.output.splitlines() if "compare --tuned" in line)
    assert f"--plugin {EXAMPLE}" in suggested
    assert f"--plugin {EXAMPLE}" in (tmp_path / "t" / "tune.md").read_text()
    # a name the user did give still clashes
    res = invoke("tune", "--plugin", str(EXAMPLE), "--algorithm", "fedavgm", "--set",
                 "algorithm.name=fedavg", *tiny, "--study", str(tmp_path / "u"))
    assert res.exit_code == 2 and "name one algorithm" in res.output, res.output


def test_fedavgm_without_momentum_is_fedavg_and_with_it_is_not():
    plugins.load_plugins([str(EXAMPLE)])
    sets = ("dataset.name=blobs", "model.name=tiny_mlp", "train.rounds=2")
    fedavg = Simulation(fast_config("algorithm.name=fedavg", *sets), progress=False)
    plain = Simulation(fast_config("algorithm.name=fedavgm", "algorithm.momentum=0",
                                   "algorithm.server_lr=1", *sets), progress=False)
    moving = Simulation(fast_config("algorithm.name=fedavgm", *sets), progress=False)
    for sim in (fedavg, plain, moving):
        sim.run()
    for name, weights in fedavg.server.global_model.items():
        assert torch.allclose(plain.server.global_model[name], weights, atol=1e-6), name
    assert any(not torch.allclose(moving.server.global_model[n], w, atol=1e-3)
               for n, w in fedavg.server.global_model.items())
    assert moving.server.velocity and all(v.abs().sum() > 0 for v in moving.server.velocity.values())


def test_bad_plugins_are_named_errors(tmp_path):
    res = invoke("run", "--plugin", str(tmp_path / "missing.py"))
    assert res.exit_code == 2 and "no such file" in res.output
    res = invoke("run", "--plugin", "no_such_module_anywhere")
    assert res.exit_code == 2 and "no module of that name" in res.output
    text = tmp_path / "notes.txt"  # a file, but no loader takes its suffix
    text.write_text("register_model = 1\n")
    res = invoke("run", "--plugin", str(text))
    assert res.exit_code == 2 and "is not a Python source file" in res.output
    taken = tmp_path / "taken.py"
    taken.write_text("from edgepfl.plugins import register_model\n"
                     "register_model('cnn2', lambda c, k, s: None, 'a second cnn2')\n")
    res = invoke("run", "--plugin", str(taken))
    assert res.exit_code == 2 and "registers the model 'cnn2', which edgepfl already has" in res.output
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('half written')\n")
    res = invoke("list", "--plugin", str(broken))
    assert res.exit_code == 2 and "failed to load: RuntimeError: half written" in res.output


def test_an_installed_package_is_found_through_its_entry_point(tmp_path, monkeypatch):
    (tmp_path / "edgepfl_fake_pkg.py").write_text(textwrap.dedent("""
        from edgepfl.plugins import register_model
        from torch import nn

        def register():
            register_model("fake_linear", lambda c, k, s: nn.Sequential(nn.Flatten(),
                           nn.Linear(c * s * s, k)), "installed through an entry point")
    """))
    dist = tmp_path / "edgepfl_fake_pkg-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: edgepfl-fake-pkg\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[edgepfl.plugins]\nfake = edgepfl_fake_pkg:register\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugins, "_installed_loaded", False)
    from edgepfl.models import MODELS
    monkeypatch.delitem(MODELS, "fake_linear", raising=False)
    plugins.load_installed()
    assert MODELS["fake_linear"][1] == "installed through an entry point"
    assert plugins.origin("model", "fake_linear").startswith("fake")
    monkeypatch.delitem(MODELS, "fake_linear")


def test_flower_apps_load_the_plugins_of_the_run_config():
    from edgepfl.engine.flower_local import run_local

    result = run_local({"plugins": str(EXAMPLE), "algorithm.name": "fedavgm",
                        "dataset.name": "blobs", "partition.clients": 3, "train.rounds": 1,
                        "output.plots": False})
    assert result.summary["algorithm"] == "fedavgm" and result.summary["model"] == "tiny_mlp"


def test_a_checkpoint_cannot_name_code_for_a_resume_to_run(tmp_path):
    from edgepfl.engine.simulation import CHECKPOINT, resume_run, start_run
    from edgepfl.io import read_tensors, write_tensors

    marker = tmp_path / "ran"
    evil = tmp_path / "evil.py"
    evil.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    run = tmp_path / "run"
    start_run(fast_config("train.rounds=1"), run, progress=False)
    tensors, meta = read_tensors(run / CHECKPOINT)
    meta["config"]["plugins"] = [str(evil)]  # config.json still names none
    write_tensors(run / CHECKPOINT, tensors, meta)
    result = resume_run(run, overrides=["train.rounds=2"], progress=False)
    assert not marker.exists(), "a checkpoint's metadata ran code"
    assert [r["round"] for r in result.metrics] == [1, 2]


def test_a_plugin_named_in_a_configuration_is_recorded_by_its_absolute_path(tmp_path, monkeypatch):
    # the example itself, named relative to the working directory (one file may register
    # fedavgm per process)
    (tmp_path / "run.toml").write_text(f'plugins = ["{EXAMPLE.name}"]\n')
    monkeypatch.chdir(EXAMPLE.parent)
    res = invoke("run", str(tmp_path / "run.toml"), "--set", "algorithm.name=fedavgm",
                 "--set", "model.name=tiny_mlp", "--set", "dataset.name=blobs", *SMALL,
                 "--out", str(tmp_path / "run"))
    assert res.exit_code == 0, res.output
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())["plugins"]
    assert recorded == [str(EXAMPLE.resolve())]


def test_plugin_models_and_loaders_are_held_to_their_contract(tmp_path):
    bad = tmp_path / "contracts.py"
    bad.write_text(textwrap.dedent("""
        from torch import nn
        from edgepfl.plugins import register_dataset, register_model

        register_model("contract_fn", lambda c, k, s: (lambda x: x), "not a module")
        register_model("contract_width", lambda c, k, s: nn.Sequential(nn.Flatten(), nn.Linear(c * s * s, k - 1)),
                       "one logit short")
        register_model("contract_args", lambda c, k: None, "two arguments")
        register_dataset("contract_none", lambda source: None, "returns nothing")

        def load_missing(source):
            raise KeyError("column 'lbl'")

        register_dataset("contract_raises", load_missing, "raises")
    """))
    synthetic = ["--set", "dataset.name=synthetic"]
    for sets, needle in (
            (["--set", "model.name=contract_fn", *synthetic], "returned function, not a torch.nn.Module"),
            (["--set", "model.name=contract_width", *synthetic],
             r"returned (2, 9) for a batch of 2 inputs; a model returns logits of shape (batch, 10)"),
            (["--set", "model.name=contract_args", *synthetic], "factory(channels=1, num_classes=10"),
            (["--set", "dataset.name=contract_none", "--set", "model.name=mlp"],
             "returned NoneType; a loader returns a mapping"),
            (["--set", "dataset.name=contract_raises", "--set", "model.name=mlp"],
             "its loader failed: KeyError")):
        out = tmp_path / sets[1].split("=")[1]
        res = invoke("run", "--plugin", str(bad), *sets, *SMALL, "--out", str(out))
        assert res.exit_code == 2, (sets, res.output)
        assert needle in res.output and "contracts.py" in res.output, res.output
        assert not out.exists()


STATEFUL = EXAMPLE.parent / "client_momentum_plugin.py"


def test_the_stateful_example_keeps_its_clients_state_across_a_resume(tmp_path):
    """docs/plugins.md's example: each client's velocity and round count live in its state,
    which the checkpoint keeps; 2 rounds and a resume to 3 are the 3-round run."""
    from edgepfl.engine.simulation import CHECKPOINT
    from edgepfl.io import read_tensors

    args = ["--plugin", str(STATEFUL), "--set", "algorithm.name=clientmom", "--set",
            "dataset.name=synthetic", "--set", "partition.clients=3", "--set",
            "train.participation=0.67", "--set", "output.plots=false", "--quiet",
            "--threads", "1",
            # the state across a resume is under test: one epoch on a quarter of the set
            # still moves every velocity (the default is 5 epochs on all of it)
            "--set", "train.local_epochs=1", "--set", "dataset.fraction=0.25"]
    res = invoke("run", *args, "--set", "train.rounds=2", "--out", str(tmp_path / "r"))
    assert res.exit_code == 0, res.output
    tensors, _ = read_tensors(tmp_path / "r" / CHECKPOINT)
    counts = tensors["client/rounds"]
    assert counts.sum().item() == 4 and counts.max().item() <= 2, counts  # 2 clients a round
    assert any(k.startswith("client/velocity.") for k in tensors)
    res = invoke("run", "--resume", str(tmp_path / "r"), "--set", "train.rounds=3", "--quiet")
    assert res.exit_code == 0, res.output
    assert read_tensors(tmp_path / "r" / CHECKPOINT)[0]["client/rounds"].sum().item() == 6
    res = invoke("run", *args, "--set", "train.rounds=3", "--out", str(tmp_path / "whole"))
    assert res.exit_code == 0, res.output
    resumed, whole = (json.loads((tmp_path / d / "summary.json").read_text())
                      for d in ("r", "whole"))
    for key in ("acc_mean_final", "acc_std_final", "acc_min_final"):
        assert resumed[key] == whole[key], key
