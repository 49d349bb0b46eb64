"""Experiment trackers (output.trackers): what each writes, read back with its own reader,
and a resumed run going on in the same tracker run."""

import csv
import json
import math
import struct
import sys
import time

import pytest

from edgepfl.config import build_config
from edgepfl.engine.rundir import comparable, config_diff
from edgepfl.engine.simulation import Simulation, resume_run, start_run
from edgepfl.engine.trackers import as_text, flatten
from edgepfl.errors import ConfigError
from tests.conftest import crash_after, fast_config

TB = 'output.trackers=["tensorboard"]'
MLFLOW = 'output.trackers=["mlflow"]'


def metrics_csv(out) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv as (round, value) per column, rounds without a value left out."""
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, cell in row.items():
            if key != "round" and cell != "":
                series.setdefault(key, []).append((int(row["round"]), float(cell)))
    return series


def summary_figures(out) -> dict[str, float]:
    summary = json.loads((out / "summary.json").read_text())
    return {f"summary/{k}": float(v) for k, v in summary.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def params_of(out) -> dict[str, str]:
    return {k: as_text(v) for k, v in flatten(json.loads((out / "config.json").read_text())).items()}


def trackers_state(out) -> dict:
    return json.loads((out / "trackers.json").read_text())


# -- settings ------------------------------------------------------------------------------
def test_unknown_tracker_is_refused_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown tracker 'tensorbord'; valid trackers: "
                                          r"tensorboard, mlflow, wandb"):
        build_config({}, ['output.trackers=["mlflow", "tensorbord"]'])
    # a Flower run config holds scalars: a comma-separated list
    assert build_config({}, ['output.trackers="wandb, mlflow"']).output.trackers == ["wandb",
                                                                                     "mlflow"]


def test_trackers_without_a_run_directory_are_refused_before_round_one():
    sim = Simulation(fast_config(TB), progress=False)
    with pytest.raises(ConfigError, match="needs a run directory"):
        sim.run()
    assert sim.round == 0


def test_a_missing_extra_is_refused_before_any_tracker_or_round(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"pip install 'edgepfl\[wandb\]'"):
        start_run(fast_config('output.trackers=["tensorboard", "wandb"]'), out, progress=False)
    assert not (out / "metrics.csv").exists()
    assert not (out / "tensorboard").exists()


def test_trackers_are_not_part_of_what_a_run_computes():
    plain = fast_config().model_dump()
    tracked = fast_config('output.trackers=["tensorboard", "mlflow"]', "output.experiment=x",
                          "output.mlflow_uri=sqlite:///elsewhere.db").model_dump()
    assert config_diff(comparable(plain), comparable(tracked)) == []
    # the rest of output still counts
    no_plots = fast_config("output.plots=true").model_dump()
    assert config_diff(comparable(plain), comparable(no_plots)) == [
        "output.plots: run has False, given True"]


# -- TensorBoard ---------------------------------------------------------------------------
def tensorboard(out):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"),
                              size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)]
               for tag in events.Tags()["scalars"]}
    return events, scalars


def assert_series(logged: dict, expected: dict) -> None:
    """Every column with a value logged at exactly its rounds, as float32 (TensorBoard
    stores scalars so)."""
    assert set(logged) == set(expected)
    for key, series in expected.items():
        assert [s for s, _ in logged[key]] == [s for s, _ in series], key
        assert [v for _, v in logged[key]] == pytest.approx([v for _, v in series], rel=1e-6), key


def test_tensorboard_has_every_round_the_config_and_the_summary(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.hparams import plugin_data_pb2

    out = tmp_path / "run"
    start_run(fast_config(TB, "eval.every=2", "output.plots=true"), out, progress=False)
    events, scalars = tensorboard(out)
    rows = metrics_csv(out)
    assert_series({k: v for k, v in scalars.items() if not k.startswith("summary/")}, rows)
    assert [s for s, _ in scalars["acc_mean"]] == [2, 3]  # round 1 was not evaluated
    summary = {k: v[0] for k, v in scalars.items() if k.startswith("summary/")}
    assert {k: s for k, (s, _) in summary.items()} == {k: 3 for k in summary_figures(out)}
    assert {k: v for k, (_, v) in summary.items()} == pytest.approx(summary_figures(out), rel=1e-6)
    assert {"plots/accuracy", "plots/partition"} <= set(events.Tags()["images"])
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["train.rounds"].number_value == 3
    assert hparams["algorithm.name"].string_value == "fedavg"
    assert hparams["output.trackers"].string_value == '["tensorboard"]'


def test_a_run_resumes_with_a_tracker_added_which_gets_every_round(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    start_run(fast_config("train.rounds=1"), out, progress=False)
    resume_run(out, progress=False, overrides=["train.rounds=2", TB])
    _, scalars = tensorboard(out)
    assert [s for s, _ in scalars["acc_mean"]] == [1, 2]
    assert_series({k: v for k, v in scalars.items() if not k.startswith("summary/")},
                  metrics_csv(out))
    assert json.loads((out / "config.json").read_text())["output"]["trackers"] == ["tensorboard"]


def test_tensorboard_hides_rounds_a_crashed_process_wrote_past_its_checkpoint(tmp_path,
                                                                              monkeypatch):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    cfg = fast_config(TB, "train.rounds=4", "output.checkpoint_every=2")
    crash_after(Simulation(cfg, out, progress=False), 3, monkeypatch)
    state = trackers_state(out)["tensorboard"]
    # as if the process died after writing round 3's events, before saving it as logged
    state["logged"] = 2
    (out / "trackers.json").write_text(json.dumps({"tensorboard": state}))
    resume_run(out, progress=False)
    _, scalars = tensorboard(out)
    assert [s for s, _ in scalars["acc_mean"]] == [1, 2, 3, 4]


# -- MLflow --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One folder of run directories, so that the tests share the SQLite store beside them
    (making one takes seconds)."""
    pytest.importorskip("mlflow")
    return tmp_path_factory.mktemp("runs")


def mlflow_run(out):
    from mlflow.tracking import MlflowClient

    state = trackers_state(out)["mlflow"]
    assert state["tracking_uri"] == f"sqlite:///{out.resolve().parent / 'mlflow.db'}"
    client = MlflowClient(state["tracking_uri"])
    return client, client.get_run(state["run_id"])


def history(client, run) -> dict[str, list[tuple[int, float]]]:
    return {key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics}


def test_mlflow_has_the_config_every_round_the_tags_and_the_files(runs):
    out = runs / "fedavg"
    start_run(fast_config(MLFLOW, "eval.every=2", "output.plots=true", "seed=7"), out,
              progress=False)
    client, run = mlflow_run(out)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "fedavg"
    assert client.get_experiment(run.info.experiment_id).name == "edgepfl"
    assert run.data.params == params_of(out)
    assert run.data.params["train.rounds"] == "3"
    assert {k: run.data.tags[k] for k in ("algorithm", "dataset", "seed")} == {
        "algorithm": "fedavg", "dataset": "synthetic", "seed": "7"}
    logged = history(client, run)
    assert {k: v for k, v in logged.items() if not k.startswith("summary/")} == metrics_csv(out)
    assert [s for s, _ in logged["acc_mean"]] == [2, 3]
    assert {k: v for k, v in logged.items() if k.startswith("summary/")} == {
        k: [(3, v)] for k, v in summary_figures(out).items()}
    files = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert files == {"summary.json", "config.json", "plots"}
    assert {a.path for a in client.list_artifacts(run.info.run_id, "plots")} == {
        "plots/accuracy.png", "plots/partition.png"}
    stored = client.download_artifacts(run.info.run_id, "summary.json", str(out.parent))
    assert json.loads(open(stored).read()) == json.loads((out / "summary.json").read_text())


def test_a_resumed_run_goes_on_in_the_same_mlflow_run_without_logging_a_round_twice(
        runs, monkeypatch):
    out = runs / "crashed"
    # round 3 is logged, then the run dies in round 4 with its checkpoint at round 2: the
    # resumed run computes round 3 again
    cfg = fast_config(MLFLOW, "train.rounds=4", "output.checkpoint_every=2")
    crash_after(Simulation(cfg, out, progress=False), 3, monkeypatch)
    client, run = mlflow_run(out)
    assert run.info.status == "FAILED"
    first = run.info.run_id
    resume_run(out, progress=False)
    client, run = mlflow_run(out)
    assert run.info.run_id == first
    assert run.info.status == "FINISHED"
    logged = history(client, run)
    assert [s for s, _ in logged["acc_mean"]] == [1, 2, 3, 4]
    assert {k for k in logged if not k.startswith("summary/")} == set(metrics_csv(out))
    for key, series in metrics_csv(out).items():
        if key == "wall_s":  # round 3's own, from the process that first ran it
            assert [s for s, _ in logged[key]] == [s for s, _ in series]
        else:
            assert logged[key] == series, key


def test_an_extended_run_keeps_its_mlflow_run_and_says_what_changed(runs):
    out = runs / "extended"
    start_run(fast_config(MLFLOW, "train.rounds=2"), out, progress=False)
    first = trackers_state(out)["mlflow"]["run_id"]
    resume_run(out, progress=False, overrides=["train.rounds=3"])
    client, run = mlflow_run(out)
    assert run.info.run_id == first
    assert [s for s, _ in history(client, run)["acc_mean"]] == [1, 2, 3]
    # MLflow keeps a parameter as first logged
    assert run.data.params["train.rounds"] == "2"
    assert run.data.tags["resumed.train.rounds"] == "3"
    assert history(client, run)["summary/rounds"] == [(2, 2.0), (3, 3.0)]


# -- Weights & Biases ----------------------------------------------------------------------
def wandb_records(path) -> list:
    """The records of a .wandb file (W&B's offline transaction log: blocks of 32 KiB of
    records, each a checksum, a length and a kind before its bytes; the bytes W&B's own
    Record protobuf)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # too little for a header: the block's tail is padding
            pos += left
            continue
        _, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if size == 0 and kind == 0:
            pos += left
            continue
        if pos + 7 + size > len(data):  # a record still being written
            break
        pending += data[pos + 7:pos + 7 + size]
        pos += 7 + size
        if kind in (1, 4):  # a whole record, or the last piece of one
            out.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return out


def finished_wandb_records(path, wait: float = 60.0) -> list:
    """The records of a run's .wandb file once it holds the run's exit record: W&B's
    service flushes the file after ``finish()`` has returned, so on a busy machine it can
    still be empty or cut when the test reads it."""
    deadline = time.monotonic() + wait
    while True:
        records = wandb_records(path) if path.stat().st_size >= 7 else []
        kinds = [rec.WhichOneof("record_type") for rec in records]
        if "exit" in kinds:
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {wait} s: {kinds}"
        time.sleep(0.2)


def wandb_run(out):
    """The offline runs in ``out``/wandb, oldest first: (run id, config, tags, history
    steps with their figures, summary updates, exit code)."""
    found = []
    for path in (out / "wandb").glob("offline-run-*/run-*.wandb"):
        run_id, config, tags, steps, summary, code = None, {}, [], {}, {}, None
        start = None
        for rec in finished_wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run_id, tags = rec.run.run_id, list(rec.run.tags)
                # folder names hold the second only (two in one second: "-1" added)
                start = (rec.run.start_time.seconds, rec.run.start_time.nanos)
                config = {u.key: json.loads(u.value_json) for u in rec.run.config.update
                          if u.key != "_wandb"}
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in rec.history.item}
                steps[items.pop("_step")] = {k: v for k, v in items.items()
                                             if not k.startswith("_")}
            elif kind == "summary":
                summary.update({u.key or "/".join(u.nested_key): json.loads(u.value_json)
                                for u in rec.summary.update})
            elif kind == "exit":
                code = rec.exit.exit_code
        assert run_id is not None and start is not None, f"{path} holds no run record"
        found.append((start, (run_id, config, tags, steps, summary, code)))
    return [run for _, run in sorted(found, key=lambda f: f[0])]


def test_wandb_offline_run_has_the_config_every_round_and_resumes_under_its_id(tmp_path,
                                                                              monkeypatch):
    pytest.importorskip("wandb", reason="wandb not installed (pip install 'edgepfl[wandb]')")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is edgepfl's default
    monkeypatch.delenv("WANDB_DIR", raising=False)
    for var in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):  # not the home's
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    out = tmp_path / "run"
    start_run(fast_config('output.trackers=["wandb"]', "train.rounds=2", "eval.every=2"), out,
              progress=False)
    resume_run(out, progress=False, overrides=["train.rounds=3"])
    (first_id, config, tags, first, summary, code), (second_id, _, _, second, _, code2) = \
        wandb_run(out)
    assert first_id == second_id == trackers_state(out)["wandb"]["id"]
    assert (code, code2) == (0, 0)
    assert config == {**flatten(json.loads((out / "config.json").read_text())),
                      "train.rounds": 2}
    assert tags == ["fedavg", "synthetic", "seed=0"]
    # each process logged only its own rounds, and round 1 without its NaN evaluation
    assert sorted(first) == [1, 2] and sorted(second) == [3]
    logged = {**first, **second}
    for key, series in metrics_csv(out).items():
        assert [(s, logged[s][key]) for s, _ in series] == series, key
    assert "acc_mean" not in logged[1]
    figures = {k: v for k, v in summary.items() if k.startswith("summary/")}
    assert figures["summary/rounds"] == 2
    assert all(not math.isnan(v) for v in figures.values())


def test_a_shared_sqlite_store_is_made_once_before_worker_processes(tmp_path):
    pytest.importorskip("mlflow")
    from edgepfl.engine.trackers import prepare_mlflow_stores

    cfg = fast_config(MLFLOW)
    prepare_mlflow_stores([(cfg, tmp_path / "cmp" / "fedavg-seed0"),
                           (cfg, tmp_path / "cmp" / "fedavg-seed1")])
    import sqlite3

    with sqlite3.connect(tmp_path / "cmp" / "mlflow.db") as db:
        tables = {r[0] for r in db.execute("select name from sqlite_master where type='table'")}
    assert {"experiments", "runs", "alembic_version"} <= tables  # the schema, migrated
    prepare_mlflow_stores([(fast_config(), tmp_path / "plain" / "run")])  # no mlflow: nothing
    assert not (tmp_path / "plain").exists()


def test_a_tracker_that_fails_mid_run_leaves_the_run_going_and_catches_up_on_resume(
        tmp_path, monkeypatch, caplog):
    pytest.importorskip("tensorboard")
    from edgepfl.engine.trackers import TensorBoardTracker

    log_rows = TensorBoardTracker.log_rows

    def dies_at_round_two(self, rows):
        if rows[-1][0] >= 2:
            raise ConnectionError("the server went away")
        log_rows(self, rows)

    monkeypatch.setattr(TensorBoardTracker, "log_rows", dies_at_round_two)
    out = tmp_path / "run"
    with caplog.at_level("WARNING", logger="edgepfl"):
        result = start_run(fast_config("train.rounds=3", TB), out, progress=False)
    assert [r["round"] for r in result.metrics] == [1, 2, 3]
    assert (out / "summary.json").exists()
    assert "tensorboard failed after round 2 (ConnectionError" in caplog.text
    assert trackers_state(out)["tensorboard"]["logged"] == 1
    monkeypatch.setattr(TensorBoardTracker, "log_rows", log_rows)
    resume_run(out, progress=False, overrides=["train.rounds=4"])
    assert trackers_state(out)["tensorboard"]["logged"] == 4  # the missed rounds, then round 4
