"""The GPU check of ``train.device``: every algorithm run on the CPU and on CUDA from the
same seed, compared round by round, then the time of a FedAvg and a KAPC round on each.

    python bench/checks/device_check.py [--rounds 2] [--algorithms ...] [--gpu-set key=value ...]
                                 [--out device_check.json]

Needs a CUDA GPU. Small federations (Fashion-MNIST, 6 clients, 5% of the data, the
algorithm's default model) keep the whole check to a few minutes; what it shows is that
each algorithm runs on the GPU and lands where the CPU does. Exact equality is not
expected: cuDNN's convolution kernels sum in another order than oneDNN's, and SGD
carries the rounding differences on from there. ``--gpu-set`` adds settings to the GPU
run alone: ``--gpu-set train.batch_clients=true`` compares clients trained together on the
GPU with the CPU's one-after-another run.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import traceback

import torch

from edgepfl.algorithms import ALGORITHMS
from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation

EXTRA = {"hierfavg": ["topology.edges=2", "topology.edge_rounds=2"],
         "hierbayes": ["topology.edges=2", "topology.edge_rounds=2"],
         "fedmd": ["algorithm.public_epochs=1", "algorithm.public_size=500"]}
CROPS = 'dataset.aspect_ratios=["16:9", "4:3", "1:1", "3:4", "9:16"]'


def config(name: str, device: str, rounds: int, *extra: str):
    return build_config({}, [f"algorithm.name={name}", "dataset.name=fmnist",
                             "dataset.fraction=0.05", "partition.clients=6",
                             "partition.scheme=dirichlet", "partition.alpha=0.5",
                             f"train.rounds={rounds}", "train.local_epochs=1",
                             "train.batch_size=20", f"train.device={device}",
                             "output.plots=false", *EXTRA.get(name, []), *extra])


def run(name: str, device: str, rounds: int, *extra: str) -> tuple[Simulation, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    sim = Simulation(config(name, device, rounds, *extra), progress=False)
    sim.run()
    torch.cuda.synchronize()
    return sim, time.perf_counter() - start


def compare(name: str, rounds: int, *extra: str, gpu_only: tuple[str, ...] = ()) -> dict:
    row: dict = {"algorithm": name + (" (crops)" if extra else "")}
    try:
        cpu, t_cpu = run(name, "cpu", rounds, *extra)
        gpu, t_gpu = run(name, "cuda", rounds, *extra, *gpu_only)
    except Exception as exc:  # the check reports every algorithm, failing ones included
        row["error"] = f"{type(exc).__name__}: {exc}"
        row["trace"] = traceback.format_exc()[-1500:]
        return row
    diff = {}
    for key in ("acc_mean", "loss", "train_loss"):
        a = [r[key] for r in cpu.metrics]
        b = [r[key] for r in gpu.metrics]
        diff[key] = max((abs(x - y) for x, y in zip(a, b, strict=True)
                         if not (math.isnan(x) and math.isnan(y))), default=0.0)
    sc, sg = cpu.clients.state_dict("c/"), gpu.clients.state_dict("c/")
    state = max((float((sc[k].double() - sg[k].double()).abs().max()) for k in sc
                 if sc[k].is_floating_point() and sc[k].numel()), default=0.0)
    on_host = all(t.device.type == "cpu" for t in sg.values())
    row.update(acc_cpu=cpu.metrics[-1]["acc_mean"], acc_gpu=gpu.metrics[-1]["acc_mean"],
               max_acc_diff=diff["acc_mean"], max_loss_diff=diff["loss"],
               max_train_loss_diff=diff["train_loss"], max_state_diff=state,
               states_on_host=on_host, seconds_cpu=t_cpu, seconds_gpu=t_gpu)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--algorithms", nargs="*", default=sorted(ALGORITHMS))
    p.add_argument("--gpu-set", nargs="*", default=[], dest="gpu_sets",
                   help="settings of the GPU run only, e.g. train.batch_clients=true")
    p.add_argument("--out", default="device_check.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: this check needs one")
    rows = []
    for name in args.algorithms:
        cases = [()]
        if ALGORITHMS[name].variable_size:
            own = ALGORITHMS[name].default_model is not None
            cases.append((CROPS,) if own else (CROPS, "model.name=cnn2_spp"))
        for extra in cases:
            row = compare(name, args.rounds, *extra, gpu_only=tuple(args.gpu_sets))
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            rows.append(row)
            with open(args.out, "w") as f:  # after every row: a cut-off check keeps its rows
                json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                           "gpu_sets": args.gpu_sets, "rows": rows}, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, GPU run's own "
          f"settings: {args.gpu_sets or 'none'}\n")
    print("| algorithm | acc CPU | acc GPU | max acc diff | max loss diff | max state diff |"
          " s CPU | s GPU |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['algorithm']} | error: {r['error'][:100]} | | | | | | |")
            continue
        print(f"| {r['algorithm']} | {r['acc_cpu']:.4f} | {r['acc_gpu']:.4f} | "
              f"{r['max_acc_diff']:.2e} | {r['max_loss_diff']:.2e} | {r['max_state_diff']:.2e} | "
              f"{r['seconds_cpu']:.1f} | {r['seconds_gpu']:.1f} |")


if __name__ == "__main__":
    main()
