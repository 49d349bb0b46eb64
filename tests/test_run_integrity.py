"""What a run directory holds is one run's: one writer at a time, no success without
training, checked checkpoints and checked replies (issue 60)."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edgepfl.engine.rundir import LOCK, run_dir_lock
from edgepfl.engine.simulation import resume_run, start_run
from edgepfl.errors import ConfigError, EdgepflError
from tests.conftest import fast_config


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}


def _hold(path: str, held, release) -> None:  # another process writing the directory
    with run_dir_lock(Path(path)):
        held.set()
        release.wait(60)


class _Holder:
    """A second process holding ``path`` as a run in progress would."""

    def __init__(self, path: Path):
        ctx = mp.get_context("fork")
        self.held, self.release = ctx.Event(), ctx.Event()
        self.proc = ctx.Process(target=_hold, args=(str(path), self.held, self.release))

    def __enter__(self):
        self.proc.start()
        assert self.held.wait(30)
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.proc.join(30)


# -- 1. one writer per run directory --------------------------------------------------------
def test_a_second_run_into_a_directory_being_set_up_is_refused_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    out.mkdir()  # the first run is setting up: no config.json yet
    with _Holder(out):
        before = _files(out)
        with pytest.raises(EdgepflError, match=f"{out} is in use: another process holds"):
            start_run(fast_config("train.rounds=1"), out, progress=False)
        assert _files(out) == before and not (out / "config.json").exists()


def test_a_resume_of_a_run_another_process_writes_is_refused_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    start_run(fast_config("train.rounds=1"), out, progress=False)
    assert not (out / LOCK).exists()  # let go once the run ended
    with _Holder(out):
        before = _files(out)
        with pytest.raises(EdgepflError, match="is in use"):
            resume_run(out, progress=False, overrides=["train.rounds=2"])
        with pytest.raises(EdgepflError, match="is in use"):
            start_run(fast_config("train.rounds=1"), out, progress=False)
        assert _files(out) == before
    # once the other process is gone, the run is the first one's and goes on
    assert json.loads((out / "config.json").read_text())["train"]["rounds"] == 1
    assert resume_run(out, progress=False, overrides=["train.rounds=2"]).summary["rounds"] == 2


def test_config_json_exists_before_set_up_and_a_failed_set_up_removes_it(tmp_path, monkeypatch):
    import edgepfl.engine.simulation as simulation

    out, seen = tmp_path / "run", []
    real = simulation.load_federation

    def load(cfg, *args):
        seen.append((out / "config.json").exists())
        return real(cfg, *args)

    monkeypatch.setattr(simulation, "load_federation", load)
    start_run(fast_config("train.rounds=1"), out, progress=False)
    assert seen == [True]

    def fail(cfg, *args):
        raise EdgepflError("no data")

    monkeypatch.setattr(simulation, "load_federation", fail)
    with pytest.raises(EdgepflError, match="no data"):
        start_run(fast_config("train.rounds=1"), tmp_path / "other", progress=False)
    assert not (tmp_path / "other").exists()


def test_a_run_refused_for_a_missing_tracker_leaves_no_run_directory(tmp_path, monkeypatch):
    from edgepfl.engine.trackers import TRACKERS

    def missing(cls=None):
        raise ConfigError("output.trackers has 'tensorboard', which needs the tensorboard "
                          "package; install it with pip install 'edgepfl[tensorboard]'")

    monkeypatch.setattr(TRACKERS["tensorboard"], "check", staticmethod(missing))
    cfg = fast_config("train.rounds=1", "output.trackers=['tensorboard']")
    for _ in range(2):  # the same command again says the same, not "already holds a run"
        with pytest.raises(ConfigError, match="needs the tensorboard package"):
            start_run(cfg, tmp_path / "run", progress=False)
        assert not (tmp_path / "run").exists()


def test_the_lock_is_reentrant_in_a_process_and_removes_a_directory_it_made(tmp_path):
    out = tmp_path / "made"
    with run_dir_lock(out):
        with run_dir_lock(out):
            assert (out / LOCK).exists()
        assert (out / LOCK).exists()  # still held by the outer block
    assert not out.exists()


# -- 2. no success without training ---------------------------------------------------------
FAST = ["--set", "dataset.name=synthetic", "--set", "partition.clients=6",
        "--set", "train.batch_size=32", "--set", "output.plots=false",
        "--set", "train.local_epochs=1"]  # the default 5 epochs: nothing here needs them


def test_a_run_whose_every_reply_was_rejected_exits_non_zero_with_the_reason(tmp_path):
    from click.testing import CliRunner

    from edgepfl.cli import main

    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", *FAST, "--set", "train.lr=1e10",
                                    "--set", "train.rounds=2", "--out", str(out), "--quiet"])
    assert res.exit_code == 2, res.output
    assert "no client's reply was aggregated in any of the run's 2 round(s)" in res.output
    assert "12 rejected: NaN or Inf values" in res.output and "lower train.lr" in res.output
    assert "best mean acc" not in res.output and not (out / "summary.json").exists()
    # and the same again (a resume) says the same, rather than reporting the initial model
    res = CliRunner().invoke(main, ["run", "--resume", str(out), "--quiet"])
    assert res.exit_code == 2 and "no client's reply was aggregated" in res.output


def test_a_round_that_aggregated_nothing_says_so_in_its_progress_line(capsys, caplog):
    from edgepfl.engine.simulation import Simulation
    from edgepfl.engine.transport import NothingTrained

    sim = Simulation(fast_config("train.lr=1e10", "train.rounds=2"), progress=None)
    with pytest.raises(NothingTrained):
        sim.run()
    lines = [line for line in capsys.readouterr().out.splitlines() if "round " in line]
    assert len(lines) == 2 and all("[nothing aggregated: all 6 replies failed]" in line
                                   for line in lines)
    # the divergence warning counts the rejected replies, though no loss of theirs arrived
    assert "round 1: 6 of the 6 replies asked for had NaN or Inf values" in caplog.text


def test_a_run_that_aggregated_in_every_round_reports_as_before():
    from edgepfl.engine.simulation import Simulation

    sim = Simulation(fast_config("train.rounds=2"), progress=False)
    result = sim.run()
    assert result.summary["rounds"] == 2 and sim.rounds.ledger.rounds_aggregated == 2
    assert sim.rounds.round_note == ""


def test_a_round_where_every_test_loss_is_nan_leaks_no_numpy_warning():
    import math
    import warnings

    import numpy as np

    from edgepfl.engine.ledger import accuracy_row

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        row = accuracy_row([0.1, 0.2], [math.nan, math.nan], np.array([3, 4]))
    assert math.isnan(row["loss"]) and row["acc_mean"] == pytest.approx(0.15)


# -- 3. checked checkpoints -----------------------------------------------------------------
def _float_tensor_at(path: Path) -> tuple[str, int]:
    """A float32 tensor of a safetensors file and the file offset of its first value."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    name = next(k for k, v in sorted(header.items())
                if k != "__metadata__" and v["dtype"] == "F32"
                and v["data_offsets"][1] > v["data_offsets"][0])
    return name, 8 + n + header[name]["data_offsets"][0]


def _finished(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    start_run(fast_config("train.rounds=2", "algorithm.name=local"), out, progress=False)
    return out


@pytest.mark.parametrize("damage", ["flipped exponent bit", "NaN written in"])
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage):
    import struct

    from edgepfl.engine.simulation import CHECKPOINT

    out = _finished(tmp_path)
    ckpt = out / CHECKPOINT
    _, at = _float_tensor_at(ckpt)
    raw = bytearray(ckpt.read_bytes())
    if damage == "flipped exponent bit":
        raw[at + 3] ^= 0x40
    else:
        raw[at:at + 4] = struct.pack("<f", float("nan"))
    ckpt.write_bytes(bytes(raw))
    before = _files(out)
    with pytest.raises(EdgepflError, match=f"{ckpt} is damaged: its contents do not match"):
        resume_run(out, progress=False, overrides=["train.rounds=3"])
    assert _files(out) == before


def test_a_checkpoint_without_a_hash_is_read_with_a_warning_but_never_with_nan(tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    from edgepfl.engine.simulation import CHECKPOINT

    out = _finished(tmp_path)
    ckpt = out / CHECKPOINT
    from safetensors import safe_open
    with safe_open(str(ckpt), "pt") as f:
        meta = {"edgepfl": f.metadata()["edgepfl"]}
    tensors = load_file(ckpt)
    save_file(tensors, ckpt, metadata=meta)  # as written before checkpoints had a hash
    assert resume_run(out, progress=False, overrides=["train.rounds=3"]).summary["rounds"] == 3
    assert "carries no hash of its contents" in caplog.text
    start_run(fast_config("train.rounds=2", "algorithm.name=local"), tmp_path / "b",
              progress=False)
    tensors = load_file(tmp_path / "b" / CHECKPOINT)
    name, _ = _float_tensor_at(tmp_path / "b" / CHECKPOINT)
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, tmp_path / "b" / CHECKPOINT, metadata=meta)
    with pytest.raises(EdgepflError, match=f"tensor {name!r} holds NaN or Inf values, which "
                                           "it carries no hash to tell from damage"):
        resume_run(tmp_path / "b", progress=False, overrides=["train.rounds=3"])


def test_tensors_that_held_nan_when_written_read_back(tmp_path):
    import torch

    from edgepfl.io import read_tensors, write_tensors

    state = {"diverged": torch.tensor([1.0, float("nan")]), "w": torch.ones(3),
             "n": torch.arange(4)}
    write_tensors(tmp_path / "c.safetensors", state, {"round": 1})
    back, meta = read_tensors(tmp_path / "c.safetensors")
    assert meta == {"round": 1} and torch.equal(back["w"], state["w"])
    assert torch.isnan(back["diverged"][1])


# -- 4. the default reply check is exact; a client that raises is a failed client -----------
def _plugin(monkeypatch, misbehave):
    """A plug-in as an author writes one: FedAvg's parts with the default check_reply,
    whose client ``misbehave(cid, result)`` may spoil (or raise in)."""
    import dataclasses

    from edgepfl.algorithms import ALGORITHMS
    from edgepfl.algorithms.fedavg import FedAvgClient, FedAvgServer
    from edgepfl.contract.algorithm import Server

    class PlainServer(FedAvgServer):
        check_reply = Server.check_reply  # what a plug-in that writes none gets

    class SpoilingClient(FedAvgClient):
        batchable = False

        def update(self, cid, msg, state, data, gen):
            return misbehave(cid, super().update(cid, msg, state, data, gen))

    algo = dataclasses.replace(ALGORITHMS["fedavg"], name="plain", server=PlainServer,
                               client=SpoilingClient)
    monkeypatch.setitem(ALGORITHMS, "plain", algo)


def _spoil(cid, result):
    import dataclasses

    import torch

    from edgepfl.federation.messages import Message

    tensors, meta = dict(result.reply.tensors), dict(result.reply.meta)
    if cid == 0:
        del tensors[sorted(tensors)[0]]  # a parameter missing
    elif cid == 1:
        tensors["extra"] = torch.zeros(3)  # a tensor nobody asked for
    elif cid == 2:
        meta["num_samples"] = -5
    elif cid == 3:
        raise RuntimeError("boom in client 3")
    elif cid == 4:
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].double()
    return dataclasses.replace(result, reply=Message(tensors, meta))


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_replies_and_a_raising_client_are_failed_clients_not_a_crash(tmp_path, monkeypatch,
                                                                         workers):
    import csv

    _plugin(monkeypatch, _spoil)
    out = tmp_path / "run"
    result = start_run(fast_config("algorithm.name=plain", "train.rounds=2",
                                   f"train.workers={workers}"), out, progress=False)
    assert [r["clients_failed"] for r in result.metrics] == [5, 5]
    assert result.summary["clients_failed_per_client"] == [2, 2, 2, 2, 2, 0]
    with open(out / "failures.csv") as f:
        reasons = {int(r["client"]): r["reason"] for r in csv.DictReader(f)}
    assert "rejected: client 0's reply lacks" in reasons[0]
    assert "rejected: client 1 sent an unknown tensor 'extra'" in reasons[1]
    assert "rejected: client 2 sent num_samples = -5; expected a positive integer" in reasons[2]
    assert reasons[3] == "no reply: its update raised RuntimeError: boom in client 3"
    assert "rejected: client 4 sent" in reasons[4] and "torch.float64" in reasons[4]


def test_a_run_whose_every_client_raises_says_why_it_trained_nothing(monkeypatch):
    from edgepfl.engine.simulation import Simulation
    from edgepfl.engine.transport import NothingTrained

    def always(cid, result):
        raise ValueError(f"client {cid} cannot")

    _plugin(monkeypatch, always)
    with pytest.raises(NothingTrained, match=r"12 no reply \(first, client 0: no reply: its "
                                             r"update raised ValueError: client 0 cannot\)"):
        Simulation(fast_config("algorithm.name=plain", "train.rounds=2"), progress=False).run()


def test_a_setting_refused_in_a_client_step_still_stops_the_run(monkeypatch):
    from edgepfl.engine.simulation import Simulation

    def refuse(cid, result):
        raise ConfigError("train.something = 3 cannot work here; set it to 2")

    _plugin(monkeypatch, refuse)
    with pytest.raises(ConfigError, match="set it to 2"):
        Simulation(fast_config("algorithm.name=plain", "train.rounds=1"), progress=False).run()


# -- 16. noise ---------------------------------------------------------------------------------
def test_ctrl_c_names_the_run_directory_to_resume(tmp_path, monkeypatch):
    from click.testing import CliRunner

    import edgepfl.engine.simulation as simulation
    from edgepfl.cli import main

    def interrupted(cfg, out, **kwargs):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(simulation, "start_run", interrupted)
    out = tmp_path / "run"
    res = CliRunner().invoke(main, ["run", *FAST, "--out", str(out), "--quiet"])
    assert res.exit_code == 130
    assert f"continue with edgepfl run --resume {out})" in res.output
    assert "RUN_DIR" not in res.output
    # a --runtime ray run does not resume: its message says so
    import edgepfl.engine.flower_ray as flower_ray

    def ray_interrupted(run_config, *args, **kwargs):
        Path(run_config["out"]).mkdir(parents=True, exist_ok=True)
        (Path(run_config["out"]) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(flower_ray, "run_ray", ray_interrupted)
    res = CliRunner().invoke(main, ["run", *FAST, "--out", str(tmp_path / "ray"), "--quiet",
                                    "--runtime", "ray"])
    assert res.exit_code == 130 and "--runtime ray does not resume" in res.output
    monkeypatch.chdir(tmp_path)  # the default directory, made up before the run starts
    res = CliRunner().invoke(main, ["run", *FAST, "--quiet"])
    assert res.exit_code == 130 and "--resume runs/fedavg-synthetic-" in res.output


def test_ctrl_c_before_the_run_has_a_directory_names_no_placeholder(monkeypatch):
    from click.testing import CliRunner

    import edgepfl.engine.rundir as rundir
    from edgepfl.cli import main

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir, "default_run_dir", interrupted)
    res = CliRunner().invoke(main, ["run", *FAST, "--quiet"])
    assert res.exit_code == 130
    assert "RUN_DIR" not in res.output and "no run was started" in res.output


def test_an_early_stop_gives_its_reason_once(tmp_path, caplog):
    import logging

    from click.testing import CliRunner

    from edgepfl.cli import main

    caplog.set_level(logging.INFO, logger="edgepfl")  # the log the terminal shows

    res = CliRunner().invoke(main, ["run", *FAST, "--set", "train.rounds=20", "--set",
                                    "train.early_stopping=1", "--set", "train.lr=0.00001",
                                    "--out", str(tmp_path / "run"), "--quiet"])
    assert res.exit_code == 0, res.output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_early"] and summary["stopped_round"] < 20
    said = res.output + caplog.text
    assert said.count(summary["stop_reason"]) == 1, said
    assert f"stopped early after round {summary['stopped_round']} of 20" in res.output


def test_output_trackers_as_one_string_is_a_list_of_one():
    from edgepfl.config import build_config

    assert build_config({"output": {"trackers": "tensorboard"}}).output.trackers == ["tensorboard"]
    assert fast_config("output.trackers=tensorboard").output.trackers == ["tensorboard"]
    assert fast_config("output.trackers=tensorboard, mlflow").output.trackers == [
        "tensorboard", "mlflow"]
    with pytest.raises(ConfigError, match="unknown tracker 'tensorbord'"):
        fast_config("output.trackers=tensorbord")


def test_a_privacy_budget_stop_is_said_once_and_a_live_line_takes_it(caplog):
    import logging

    from edgepfl.engine.progress import RoundProgress
    from edgepfl.engine.simulation import Simulation

    caplog.set_level(logging.INFO, logger="edgepfl")
    sim = Simulation(fast_config("privacy.level=client", "privacy.noise_multiplier=1.0",
                                 "privacy.target_epsilon=5.0", "train.rounds=5"), progress=False)
    assert sim.run().summary["rounds"] == 1
    assert caplog.text.count("the privacy budget: round 2 would spend") == 1
    # the default delta, 1 / 6 clients, is warned of
    assert "delta 0.166667 (the default, 1 / clients) is at least 1 / 6 clients" in caplog.text
    # a live line (a terminal) with a stop that has no best round: no KeyError
    bar = RoundProgress(5, 0, "x", enabled=True)
    bar.stopped(sim.rounds.stopped)
    bar.close()


def _partition_ticks(monkeypatch, tmp_path, n, **kwargs) -> list[str]:
    import numpy as np

    import edgepfl.plotting as plotting

    figures = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: figures.append(fig))
    counts = np.arange(n * 3).reshape(n, 3) + 1
    plotting.plot_partition(counts, tmp_path / "p.png", ["a", "b", "c"], **kwargs)
    fig = figures[0]
    fig.canvas.draw()
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    return [t.get_text() for t, x in zip(ax.get_xticklabels(), ax.get_xticks(), strict=True)
            if lo <= x <= hi]


def test_partition_plots_number_whole_clients_and_name_them_where_named(monkeypatch, tmp_path):
    ticks = _partition_ticks(monkeypatch, tmp_path, 4)
    assert ticks and all(t.isdigit() for t in ticks), ticks  # no 0.5, 1.5, ...
    names = ["alice", "bob", "carol", "dave"]
    assert _partition_ticks(monkeypatch, tmp_path, 4, names=names) == names


def test_table_headers_name_the_partition_with_its_own_skew():
    from edgepfl.plotting import partition_words

    assert partition_words({"scheme": "natural", "alpha": 0.3}) == "natural"
    assert partition_words({"scheme": "dirichlet", "alpha": 0.3}) == "dirichlet (alpha 0.3)"
    assert partition_words({"scheme": "pathological", "alpha": 0.3,
                            "classes_per_client": 2}) == "pathological (2 classes per client)"
    from edgepfl.config import build_config
    from edgepfl.experiments.compare import _header

    line = _header(build_config({}, ["partition.scheme=natural"]), [0], [])[2]
    assert "partition natural, " in line and "alpha" not in line


# -- 7. compare --jobs workers end with their parent ------------------------------------------
MIDDLE = textwrap.dedent("""
    import concurrent.futures as cf, multiprocessing as mp, os, sys, time
    from edgepfl.experiments.runs import _start_worker

    if __name__ == "__main__":
        pool = cf.ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"),
                                      initializer=_start_worker, initargs=(1, None, os.getpid()))
        futures = [pool.submit(time.sleep, 300) for _ in range(2)]
        while len(pool._processes) < 2:
            time.sleep(0.1)
        time.sleep(8)  # the workers have started (and run their initializer)
        print(" ".join(str(p) for p in pool._processes), flush=True)
        time.sleep(300)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_compare_workers_end_when_their_parent_is_killed(tmp_path):
    script = tmp_path / "middle.py"
    script.write_text(MIDDLE)
    middle = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    workers: list[int] = []
    try:
        workers = [int(p) for p in middle.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(p) for p in workers)
        middle.send_signal(signal.SIGKILL)
        middle.wait(30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in workers), "a worker outlived its parent"
    finally:
        middle.kill()
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- 6. a rate no float32 weight can take is refused at set-up -------------------------------
def test_a_learning_rate_beyond_float32_is_refused_at_set_up_leaving_no_directory(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"train.lr = 1e\+39 is beyond float32's range"):
        start_run(fast_config("train.lr=1e39", "train.rounds=1"), out, progress=False)
    assert not out.exists()
    # the largest float32 itself still runs (and diverges: a run that trained nothing)
    from edgepfl.engine.parts import check_rate
    check_rate(fast_config("train.lr=3e38"))


# -- 16. sample-level DP accounting logs no absl warning per RDP order ------------------------
def test_the_rdp_accountant_leaves_no_absl_warnings(caplog):
    import logging

    pytest.importorskip("dp_accounting")
    from edgepfl.privacy.accountant import sample_epsilon

    with caplog.at_level(logging.WARNING):
        eps = sample_epsilon(((0.114695, 37),), 1.0, 1e-5)  # orders that do not converge
    assert eps > 0 and not [r for r in caplog.records if r.name == "absl"]


# -- 13. examples/flower/make_certs.py copied out of the repository ---------------------------
def _make_certs_at(path: Path):
    import importlib.util
    import shutil

    repo = Path(__file__).resolve().parents[1]
    path.parent.mkdir(parents=True)
    shutil.copy(repo / "examples" / "flower" / "make_certs.py", path)
    spec = importlib.util.spec_from_file_location(f"make_certs_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, repo


def test_make_certs_copied_anywhere_asks_git_where_the_repository_is(tmp_path):
    pytest.importorskip("cryptography")
    copied, repo = _make_certs_at(tmp_path / "a" / "b" / "make_certs.py")
    copied._check_folder(tmp_path / "certs")  # no repository there: nothing to refuse
    with pytest.raises(SystemExit, match="inside the repository .* not ignored by git"):
        copied._check_folder(repo / "examples" / "keys")  # this checkout, not ignored
    copied._check_folder(repo / "runs" / "certs")  # ignored: fine


# -- 10. the compare command a study prints loads the study's plug-ins -----------------------
def test_the_compare_command_of_a_study_names_its_plugins(tmp_path):
    from edgepfl.experiments.tune import compare_command

    cmd = compare_command(tmp_path / "study", "fedavgm",
                          {"seed": 0, "plugins": ["/x/fedavgm_plugin.py"],
                           "algorithm": {"name": "fedavgm"}})
    assert "--plugin /x/fedavgm_plugin.py" in cmd and "--algorithms fedavgm" in cmd


# -- 17. edgepfl tune takes --out as every other command does ---------------------------------
def test_tune_takes_out_for_its_study_folder(tmp_path):
    pytest.importorskip("optuna")
    from click.testing import CliRunner

    from edgepfl.cli import main

    study = tmp_path / "study"
    res = CliRunner().invoke(main, ["tune", "--algorithm", "fedprox", "--trials", "1", *FAST,
                                    "--set", "train.rounds=1", "--set", "eval.validation=0.2",
                                    "--out", str(study), "--quiet"])
    assert res.exit_code == 0, res.output
    assert (study / "tune.md").exists() and (study / "trial-0000").is_dir()


def test_tune_refuses_study_and_out_naming_two_folders(tmp_path):
    from click.testing import CliRunner

    from edgepfl.cli import main

    res = CliRunner().invoke(main, ["tune", "--algorithm", "fedprox", "--trials", "1",
                                    "--study", str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    assert res.exit_code != 0
    assert "name the same thing, the study's folder, differently: give one" in res.output
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# -- 5. privacy settings without privacy.level are said to do nothing ----------------------------
def test_privacy_settings_without_a_level_are_warned_of(caplog):
    from edgepfl.engine.simulation import Simulation

    Simulation(fast_config("privacy.level=none", "privacy.noise_multiplier=2.0",
                           "privacy.target_epsilon=3.0"), progress=False)
    assert ("privacy.noise_multiplier, privacy.target_epsilon are set but privacy.level = "
            "'none': no noise is added") in caplog.text
    caplog.clear()
    Simulation(fast_config(), progress=False)
    assert "privacy.level" not in caplog.text


# -- 5. what the accuracy figures would leave unsaid is said at set-up -------------------------
def test_a_one_class_data_set_and_clients_without_test_data_are_warned_of(tmp_path, caplog):
    import numpy as np

    from edgepfl.config import build_config
    from edgepfl.engine.simulation import Simulation

    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (60, 1, 8, 8), dtype=np.uint8)
    client = np.array(["ann", "bob", "cy"])[np.arange(60) % 3]
    # cy has training samples only: no test samples at all
    x_test = rng.integers(0, 256, (20, 1, 8, 8), dtype=np.uint8)
    client_test = np.array(["ann", "bob"])[np.arange(20) % 2]
    np.savez(tmp_path / "d.npz", x=x, y=np.zeros(60, dtype=np.int64), client=client,
             x_test=x_test, y_test=np.zeros(20, dtype=np.int64), client_test=client_test)
    cfg = build_config({}, ["dataset.name=npz", f"dataset.path={tmp_path / 'd.npz'}",
                            "partition.scheme=natural", "partition.clients=3",
                            "model.name=mlp", "train.rounds=1", "output.plots=false"])
    Simulation(cfg, progress=False)
    assert "1 of 3 clients have no test samples (clients cy)" in caplog.text
    assert "the training data holds 1 class: every prediction is right" in caplog.text


# -- 6. an empty npz is refused with the file named, not a traceback ---------------------------
def test_an_empty_npz_is_refused_as_data_not_a_traceback(tmp_path):
    import numpy as np

    from edgepfl.data import load_dataset
    from edgepfl.errors import DataError

    np.savez(tmp_path / "d.npz", x=np.zeros((0, 4), dtype=np.float32),
             y=np.zeros(0, dtype=np.int64))
    with pytest.raises(DataError, match="holds no samples"):
        load_dataset("npz", path=tmp_path / "d.npz", test_fraction=0.25)


# -- 6. one huge image among small ones is refused before its canvas is made -------------------
def test_one_huge_image_among_small_ones_is_refused_naming_it(monkeypatch):
    import numpy as np

    import edgepfl.data.own as own
    from edgepfl.errors import DataError

    monkeypatch.setattr(own, "_CANVAS_FLOOR", 1 << 20)  # 1 MiB here, 1 GiB in earnest
    small = [np.zeros((3, 8, 8), dtype=np.uint8) for _ in range(20)]
    huge = np.zeros((3, 600, 600), dtype=np.uint8)
    files = [f"cat/{k}.png" for k in range(20)] + ["cat/huge.png"]
    with pytest.raises(DataError, match=r"cat/huge.png \(600x600 pixels\) would make every "
                                        r"image's canvas that large.*set dataset.resize"):
        own._pack([*small, huge], files)
    canvas, sizes = own._pack([*small, np.zeros((3, 16, 16), dtype=np.uint8)], files)
    assert canvas.shape == (21, 3, 16, 16) and sizes[-1].tolist() == [16, 16]
