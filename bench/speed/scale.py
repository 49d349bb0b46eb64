"""Scale: set-up time, seconds per round, checkpoint cost and peak memory of a federation
of N clients, each configuration in a fresh process (peak memory is per process).

    python bench/speed/scale.py [--clients 100 1000 10000] [--algorithms fedavg kapc dcpfl]
                          [--rounds 3] [--participation 0.1] [--dataset mnist]
                          [--modes seq] [--workers auto] [--no-checkpoint]
                          [--set key=value ...]

``--modes`` says how the clients of a round run, each a fresh process: ``seq1`` one after
another on one thread (the default, as the memory figures were taken), ``seq`` one after
another with PyTorch's default threads (every core), ``par`` in ``--workers`` worker
processes of one thread each (``train.workers``), ``cuda`` on the GPU (``train.device``),
``vmap`` and ``cuda-vmap`` with a round's clients trained together, their SGD steps batched
with ``torch.func.vmap`` (``train.batch_clients``) on the CPU's threads or on the GPU.
Rounds are timed against the first mode listed, in the same run. With
``--set train.store=disk`` the per-client state lives in files mapped into memory (in the
run's temporary folder); peak RSS then counts the file pages the kernel held at once, and
the peak of anonymous memory (sampled every 20 ms) is what the run itself needed.

One JSON line per run and a markdown table at the end; record results in bench/speed/README.md and bench/LOG.md.
Evaluation runs once, after the timed rounds (every client's test split: it scales with N
too, and is reported on its own). Peak memory is the main process's; with workers, the
largest worker's peak is reported beside it (forked workers share the data set's pages,
so their peaks are not additive).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import json, resource, sys, threading, time
    import torch
    if sys.argv[3] == "1":
        torch.set_num_threads(1)
    # the peak of anonymous memory apart: with train.store = disk the stacks are file pages
    # the kernel may drop or write back, and ru_maxrss counts those it held at once
    peak_anon = [0]
    def sample():
        while True:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        peak_anon[0] = max(peak_anon[0], int(line.split()[1]) * 1024)
            time.sleep(0.02)
    threading.Thread(target=sample, daemon=True).start()
    from pathlib import Path
    from edgepfl.config import build_config
    from edgepfl.engine.simulation import Simulation
    from edgepfl.system import peak_rss_bytes
    overrides, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    t0 = time.perf_counter()
    cfg = build_config({}, overrides)
    sim = Simulation(cfg, out, progress=False)
    sim._write_setup()
    setup = time.perf_counter() - t0
    rss_setup = peak_rss_bytes()
    rounds = []
    for _ in range(cfg.train.rounds):
        t = time.perf_counter()
        sim.step()
        rounds.append(time.perf_counter() - t)
    state = sim.clients.nbytes() + sum(t.numel() * t.element_size()
                                       for t in sim.server.save_state()[0].values())
    checkpoint = size = float("nan")
    if sys.argv[4] == "1":
        t = time.perf_counter(); sim.save_checkpoint(); checkpoint = time.perf_counter() - t
        size = (out / "checkpoint.safetensors").stat().st_size
    sim.transport.close()
    print(json.dumps({"setup_s": setup, "round_s": rounds, "checkpoint_s": checkpoint,
                      "checkpoint_mb": size / 1e6, "peak_rss_mb": peak_rss_bytes() / 1e6,
                      "rss_after_setup_mb": rss_setup / 1e6, "state_mb": state / 1e6,
                      "peak_anon_mb": peak_anon[0] / 1e6,
                      "worker_peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1e3,
                      "threads": torch.get_num_threads(), "device": str(sim.trainer.device)}))
""")


MODES = {"seq1": (["train.device=cpu", "train.workers=1"], "1"),
         "seq": (["train.device=cpu", "train.workers=1"], "all"),
         "par": (["train.device=cpu"], "1"),
         "cuda": (["train.device=cuda", "train.workers=1"], "all"),
         "vmap": (["train.device=cpu", "train.workers=1", "train.batch_clients=true"], "all"),
         "cuda-vmap": (["train.device=cuda", "train.workers=1", "train.batch_clients=true"],
                       "all")}


def run(algorithm: str, clients: int, mode: str, args) -> dict:
    sets, threads = MODES[mode]
    if mode == "par":
        sets = [*sets, f"train.workers={args.workers}"]
    overrides = [*sets, f"algorithm.name={algorithm}", f"dataset.name={args.dataset}",
                 f"partition.clients={clients}", "partition.scheme=iid",
                 f"train.participation={args.participation}", "train.local_epochs=1",
                 f"train.rounds={args.rounds}", f"eval.every={args.rounds + 1}",
                 "output.plots=true", *args.sets]
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(overrides), out, threads,
                               "0" if args.no_checkpoint else "1"],
                              capture_output=True, text=True)
    head = {"algorithm": algorithm, "clients": clients, "mode": mode}
    if proc.returncode:
        return {**head, "error": proc.stderr.strip()[-400:]}
    return {**head, **json.loads(proc.stdout.splitlines()[-1])}


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--algorithms", nargs="+", default=["fedavg", "kapc", "dcpfl"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--participation", type=float, default=0.1)
    p.add_argument("--dataset", default="mnist")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=["seq1"])
    p.add_argument("--workers", default="auto", help="train.workers for mode par")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="skip timing a checkpoint (it needs the state's size again on disk)")
    p.add_argument("--set", nargs="*", default=[], dest="sets",
                   help="further key=value settings for every run")
    args = p.parse_args()
    rows = []
    for algorithm in args.algorithms:
        for n in args.clients:
            for mode in args.modes:
                row = run(algorithm, n, mode, args)
                print(json.dumps(row), flush=True)
                rows.append(row)
    base = {(r["algorithm"], r["clients"]): median(r["round_s"]) for r in rows
            if r["mode"] == args.modes[0] and "error" not in r}
    print(f"\n| algorithm | clients | mode | set-up s | s per round (median) | speed-up vs "
          f"{args.modes[0]} | checkpoint s | checkpoint MB | state MB | peak RSS MB (largest "
          "worker) | peak anonymous MB |\n|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['algorithm']} | {r['clients']} | {r['mode']} | error: "
                  f"{r['error'][-80:]} | | | | | | | |")
            continue
        med = median(r["round_s"])
        ref = base.get((r["algorithm"], r["clients"]))
        ratio = f"{ref / med:.2f}x" if ref else "-"
        worker = f" ({r['worker_peak_rss_mb']:.0f})" if r["mode"] == "par" else ""
        print(f"| {r['algorithm']} | {r['clients']} | {r['mode']} | {r['setup_s']:.1f} | "
              f"{med:.2f} | {ratio} | {r['checkpoint_s']:.2f} | {r['checkpoint_mb']:.0f} | "
              f"{r['state_mb']:.0f} | {r['peak_rss_mb']:.0f}{worker} | {r['peak_anon_mb']:.0f} |")


if __name__ == "__main__":
    main()
