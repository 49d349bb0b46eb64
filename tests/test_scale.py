"""What must scale with the federation: files written once per run or every round."""

import time
import tracemalloc

import matplotlib.axes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from edgepfl.engine.rundir import CheckpointPolicy
from edgepfl.io import read_tensors, write_tensors
from edgepfl.plotting import BARS_UP_TO, plot_partition


def test_a_checkpoint_is_streamed_without_a_second_copy_in_memory(tmp_path):
    state = {f"client/{k}": torch.randn(1 << 20) for k in range(16)}  # 64 MiB
    state["scalar"] = torch.tensor(3, dtype=torch.int64)
    state["mask"] = torch.tensor([True, False])
    state["view"] = torch.randn(64, 32).t()  # not contiguous
    tracemalloc.start()
    write_tensors(tmp_path / "c.safetensors", state, {"round": 3, "loss": float("nan")})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / 2**20:.1f} MiB held while writing 64 MiB"
    # the safetensors library reads it as its own, and so do we
    theirs = load_file(tmp_path / "c.safetensors")
    ours, meta = read_tensors(tmp_path / "c.safetensors")
    assert meta == {"round": 3, "loss": None}
    for name, value in state.items():
        assert torch.equal(theirs[name], value) and torch.equal(ours[name], value)
    header = (tmp_path / "c.safetensors").read_bytes()[:8]
    assert int.from_bytes(header, "little") % 8 == 0
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]  # no temporary left


def test_a_large_federations_partition_plot_is_one_image(tmp_path, monkeypatch):
    def no_bars(*args, **kwargs):
        raise AssertionError("a bar per client and class does not scale")

    counts = np.random.default_rng(0).integers(0, 30, size=(BARS_UP_TO + 1, 10))
    monkeypatch.setattr(matplotlib.axes.Axes, "bar", no_bars)
    plot_partition(counts, tmp_path / "p.png", [str(k) for k in range(10)])
    assert (tmp_path / "p.png").stat().st_size > 0


def test_auto_checkpoints_cost_a_tenth_of_the_rounds_at_most(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    policy = CheckpointPolicy("auto")
    assert policy.due(1, 50)  # nothing written yet: a checkpoint costs nothing known
    with policy.writing():
        now[0] += 2.0  # a 2 s checkpoint
    now[0] += 19.0
    assert not policy.due(2, 50)  # 19 s of rounds < 10 x 2 s
    now[0] += 1.0
    assert policy.due(3, 50)
    assert policy.due(50, 50)  # the last round always
    fixed = CheckpointPolicy(3)
    assert [r for r in range(1, 11) if fixed.due(r, 10)] == [3, 6, 9, 10]


def test_never_checkpointing_writes_none_and_the_run_cannot_be_extended(tmp_path):
    from edgepfl.engine.simulation import CHECKPOINT, Simulation, resume_run
    from edgepfl.errors import ConfigError
    from tests.conftest import fast_config

    assert not any(CheckpointPolicy("never").due(r, 3) for r in (1, 2, 3))
    cfg = fast_config("output.checkpoint_every=never")
    Simulation(cfg, tmp_path, progress=False).run()
    assert (tmp_path / "summary.json").exists() and not (tmp_path / CHECKPOINT).exists()
    longer = fast_config("output.checkpoint_every=never", "train.rounds=4")
    with pytest.raises(ConfigError, match="no checkpoint"):
        resume_run(tmp_path, longer)
