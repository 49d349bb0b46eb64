"""What ``train.threads = auto`` picks, against fixed thread counts, quiet and busy.

Each case is a whole ``edgepfl run`` in its own process (torch's thread pool and OpenMP's
wait policy are set once per process), timed by its rounds' ``wall_s`` in metrics.csv:
the median over the rounds after the first (the first counts FLOPs). ``--busy`` runs one
``python3 -c "while True: pass"`` beside every case, the load a laptop, a shared server
or a CI machine with a test run going puts on the cores.

    python bench/speed/threads.py                 # the small model (the default run)
    python bench/speed/threads.py --busy
    python bench/speed/threads.py --large         # resnet18, batch 64
    python bench/speed/threads.py --crossover     # step time, 1 thread against all cores

The figures and what ``auto`` picks from them: bench/speed/README.md, 'Threads'.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = ["train.rounds=12"]
LARGE = ["model.name=resnet18", "dataset.name=fmnist", "dataset.fraction=0.005",
         "train.batch_size=64", "partition.clients=2", "train.local_epochs=1", "train.rounds=3",
         "eval.every=100"]


def per_round(settings: list[str], threads: str | None, env: dict[str, str]) -> tuple[float, list]:
    """Median seconds a round after the first, and every round's, of one run."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "edgepfl.cli", "run", "--quiet", "--out", f"{tmp}/run"]
        cmd += [a for s in settings for a in ("--set", s)]
        cmd += ["--set", "output.plots=false"]
        if threads is not None:
            cmd += ["--threads", threads]
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(f"{tmp}/run/metrics.csv") as f:
            walls = [float(r["wall_s"]) for r in csv.DictReader(f)]
    return statistics.median(walls[1:]), walls


def crossover(repeats: int) -> None:
    """A local step's time on one thread against all the cores, per model and batch."""
    code = r"""
import sys, time, torch
from edgepfl.models.zoo import build_model
from edgepfl.engine.threads import step_flops
name, c, hw, batch, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
torch.manual_seed(0)
model = build_model(name, (c, hw, hw), 10).to(memory_format=torch.channels_last)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(batch, c, hw, hw).to(memory_format=torch.channels_last)
y = torch.randint(0, 10, (batch,))
def step():
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
for _ in range(3): step()
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < 2.0:
    step(); n += 1
print((time.perf_counter() - t0) / n, step_flops(model, x[0], batch))
"""
    cores = os.cpu_count() or 1
    print(f"| model | batch | step GFLOPs | 1 thread ms | {cores} threads ms | {cores} / 1 |")
    print("|---|---|---|---|---|---|")
    for name, c, hw, batch in [("cnn_small", 1, 8, 32), ("cnn2", 1, 28, 10), ("cnn2", 1, 28, 64),
                               ("lenet5", 1, 28, 64), ("cnn_cifar", 3, 32, 64),
                               ("resnet18", 3, 32, 8), ("resnet18", 3, 32, 64)]:
        times = {}
        for threads in (1, cores):
            runs = []
            for _ in range(repeats):
                out = subprocess.run([sys.executable, "-c", code, name, str(c), str(hw),
                                      str(batch), str(threads)], check=True,
                                     capture_output=True, text=True).stdout.split()
                runs.append(float(out[0]))
            times[threads], flops = statistics.median(runs), float(out[1])
        print(f"| {name} | {batch} | {flops / 1e9:.2f} | {1e3 * times[1]:.1f} | "
              f"{1e3 * times[cores]:.1f} | {times[cores] / times[1]:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy", action="store_true", help="one busy process beside each case")
    ap.add_argument("--large", action="store_true", help="resnet18 at batch 64, not the default")
    ap.add_argument("--crossover", action="store_true", help="step time per model and batch")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    if args.crossover:
        crossover(args.repeats)
        return
    settings = LARGE if args.large else SMALL
    cores = str(os.cpu_count() or 1)
    cases = [("auto (default)", None, {}), ("1", "1", {}), (cores, cores, {}),
             (f"{cores}, OMP_WAIT_POLICY=ACTIVE", cores, {"OMP_WAIT_POLICY": "ACTIVE"}),
             (f"{cores}, OMP_WAIT_POLICY=PASSIVE", cores, {"OMP_WAIT_POLICY": "PASSIVE"})]
    busy = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy
            else None)
    try:
        time.sleep(1.0 if busy else 0.0)
        print(f"{'large (resnet18, batch 64)' if args.large else 'small (default run)'}, "
              f"{'one busy process beside' if busy else 'quiet'}, {cores} cores")
        print("| threads | s/round (median of the runs) | each run's median |")
        print("|---|---|---|")
        env = {**os.environ, "EDGEPFL_DATA": os.environ.get(
            "EDGEPFL_DATA", str(Path(__file__).resolve().parents[3] / "shared" / "data"))}
        # the cases take turns, so that a drift of the machine falls on all of them
        results: dict[str, list] = {label: [] for label, _, _ in cases}
        for _ in range(args.repeats):
            for label, threads, extra in cases:
                results[label].append(per_round(settings, threads, {**env, **extra}))
        for label, runs in results.items():
            med = statistics.median(m for m, _ in runs)
            each = " / ".join(f"{m:.3f}" for m, _ in runs)
            print(f"| {label} | {med:.3f} | {each} |", flush=True)
    finally:
        if busy is not None:
            busy.kill()


if __name__ == "__main__":
    main()
