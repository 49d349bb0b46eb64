"""Golden metrics: every algorithm's short run on the synthetic data set, recorded from the
engine before the federation refactor, so that a change of the round loop that alters any
existing run (one digit of one metric) fails ``test_golden.py``.

Regenerate only on purpose (``python -m tests.golden``) and say why in the commit; a
figure changed on purpose is amended by hand and listed under "amended" in the file.
"""

from __future__ import annotations

import json
import math
import platform
import sys
from pathlib import Path

import torch

from edgepfl.system.memory import host_info

GOLDEN = Path(__file__).parent / "data" / "golden_metrics.json"

# one case per algorithm (their defaults), plus the engine's options that touch the round
CASES: dict[str, list[str]] = {name: [f"algorithm.name={name}"] for name in [
    "local", "fedavg", "fedprox", "kapc", "kapc_bls", "fedamp", "moon", "fedproto",
    "fedbabu", "fedbn", "pfedla", "dcpfl", "clusterfl", "perfedavg", "perfedavg_hf"]}
CASES["fedavg-partial"] = ["algorithm.name=fedavg", "train.participation=0.5",
                           "eval.every=2", "system.profile=fixed_rate"]
CASES["kapc-partial"] = ["algorithm.name=kapc", "train.participation=0.5",
                         "system.round_timing=chain"]
# recorded at KAPC's earlier default lambda = 1 (now 0.1): pinned, so that they still
# guard the round loop with the figures they hold
for case in ("kapc", "kapc_bls", "kapc-partial"):
    CASES[case].append("algorithm.lam=1")
CASES["fedavg-tiers"] = ["algorithm.name=fedavg", "system.devices=tiers"]

BASE = ["dataset.name=synthetic", "partition.clients=5", "train.rounds=3",
        "train.batch_size=32", "train.local_epochs=1", "train.lr=0.05", "output.plots=false"]


def run_case(overrides: list[str]) -> dict:
    from edgepfl.config import build_config
    from edgepfl.engine.simulation import Simulation

    result = Simulation(build_config({}, BASE + overrides), progress=False).run()
    rows = [{k: v for k, v in r.items() if k != "wall_s"} for r in result.metrics]
    keep = {k: v for k, v in result.summary.items()
            if k not in ("wall_time_s", "peak_rss_bytes", "edgepfl_version", "host")}
    return {"metrics": rows, "summary": keep}


def jsonable(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value


def cpu_maker() -> str:
    """AMD or Intel: the two makers' math libraries take different paths under the same
    instruction set cap (AVX2 on an Intel Xeon differs from AVX2 on an AMD EPYC in the
    last bits)."""
    cpu = str(host_info()["cpu"])
    return next((maker for maker in ("AMD", "Intel") if maker in cpu), cpu)


def machine() -> dict:
    return {"torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability(),
            "vendor": cpu_maker(), "machine": platform.machine(),
            "python": sys.version.split()[0]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    out = {"machine": machine(), "cases": {}}
    for name, overrides in CASES.items():
        out["cases"][name] = {"overrides": overrides, **jsonable(run_case(overrides))}
        print(name, out["cases"][name]["summary"]["acc_mean_final"], flush=True)
    GOLDEN.write_text(json.dumps(out, indent=1) + "\n")
