import os
from pathlib import Path

import pytest
import torch

from edgepfl.config import build_config

# The models in tests are tiny: one thread is faster than two, and immune to the
# spin-wait collapse OpenMP suffers when another process holds the second core.
torch.set_num_threads(1)

SHARED_DATA = Path(os.environ.get("EDGEPFL_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def fast_config(*overrides: str):
    """A run small enough for unit tests: synthetic data, 6 clients, 3 rounds."""
    base = ["dataset.name=synthetic", "partition.clients=6", "train.rounds=3",
            "train.batch_size=32", "train.local_epochs=1", "train.lr=0.05",
            "output.plots=false"]
    return build_config({}, base + list(overrides))


def resumed_and_straight(tmp_path, *overrides: str):
    """A 3-round run checkpointed after 2 rounds and resumed in a fresh Simulation, and the
    same run done straight through (both Simulations, to compare metrics and state)."""
    from edgepfl.engine.simulation import CHECKPOINT, Simulation

    straight = Simulation(fast_config(*overrides), progress=False)
    straight.run()
    first = Simulation(fast_config(*overrides), tmp_path, progress=False)
    first.step()
    first.step()
    first.save_checkpoint()
    resumed = Simulation(fast_config(*overrides), tmp_path, progress=False)
    resumed.load_checkpoint(tmp_path / CHECKPOINT)
    resumed.step()
    return resumed, straight


def crash_after(sim, rounds: int, monkeypatch, hooks=()) -> None:
    """Run ``sim`` until it is interrupted in the round after ``rounds`` (a crash)."""
    real_step = sim.rounds.step

    def crash():
        if sim.round == rounds:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(sim.rounds, "step", crash)
    with pytest.raises(KeyboardInterrupt):
        sim.run(hooks)


def forget_algorithm_setting(run_dir: Path, key: str) -> dict:
    """Make ``run_dir`` (a run with a checkpoint) look written before ``algorithm.<key>``
    existed: the key leaves config.json and the checkpoint's stored config. Returns the
    config.json without it."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from edgepfl.engine.simulation import CHECKPOINT

    stored = json.loads((run_dir / "config.json").read_text())
    del stored["algorithm"][key]
    (run_dir / "config.json").write_text(json.dumps(stored))
    ckpt = str(run_dir / CHECKPOINT)
    with safe_open(ckpt, "pt") as f:
        meta = json.loads(f.metadata()["edgepfl"])
    del meta["config"]["algorithm"][key]
    save_file(load_file(ckpt), ckpt, metadata={"edgepfl": json.dumps(meta)})
    return stored


def without_wall(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in rows]


@pytest.fixture
def shared_data() -> Path:
    if not (SHARED_DATA / "MNIST" / "raw").exists():
        pytest.skip(f"MNIST files not found under {SHARED_DATA} (set EDGEPFL_DATA)")
    return SHARED_DATA
