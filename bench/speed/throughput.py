"""Engine speed: FedAvg through the engine, in one or more modes, against a bare PyTorch loop
on the same samples.

Every mode and the bare loop train the same model on the same federation in the same
process, visiting exactly the same samples in exactly the same order: the bare loop
replays, per round and client, the index order the engine's client drew. The bare loop is
what a hand-written script would do: one model, torch.optim.SGD, a FedAvg average by hand,
inputs normalised once before training. Evaluation is excluded (the engine evaluates only
after the timed rounds). Each measurement runs every mode and the bare loop in turn, so a
drifting load hits them alike; figures are medians over ``--repeats``.

    python bench/speed/throughput.py [--rounds 3] [--fraction 0.1] [--repeats 3]
    # PFLlib's MNIST setting (issue 43): 20 clients, Dirichlet 0.1, batch 10, lr 0.005, cnn2
    python bench/speed/throughput.py --pfllib --threads 1 --modes "" "train.compile=default"

``--modes``: one engine per entry, each a space-separated list of key=value settings ("" =
the defaults); ratios are against the first. Times are wall-clock and, beside them, the
process's CPU time (which a shared machine's other jobs do not inflate: with one thread
and more jobs than cores the CPU-time ratios are the steadier ones). Record results in
bench/speed/README.md and bench/LOG.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation
from edgepfl.federation.rng import generator
from edgepfl.models import build_model


def apply_compile(sim: Simulation) -> None:
    """``train.compile`` onto the simulation's trainers, where the engine has not passed it
    (until the engine's set-up hands the setting to every trainer it builds)."""
    for trainer in sim.parts.trainers.values():
        trainer.compile = sim.cfg.train.compile


def engine_rounds(sim: Simulation, rounds: int) -> tuple[float, float, int]:
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        sim.step()
    samples = rounds * sum(d.n for d in sim.train_data)
    return time.perf_counter() - t0, time.process_time() - c0, samples


def bare_rounds(sim: Simulation, rounds: int, start_round: int,
                channels_last: bool = False) -> tuple[float, float, int]:
    """FedAvg written by hand with the same data, order, model and step size.

    ``channels_last`` gives the hand-written loop the memory layout the engine uses for
    convolutional models, so that the engine's own overhead is measured apart from it.
    """
    ds = sim.dataset
    cfg = sim.cfg
    # a hand-written loop holds its inputs as float, normalised once (the engine keeps
    # 8-bit pixels and normalises per batch, which its figure includes)
    images = ds.images("train")
    model = build_model(cfg.model.name, ds.input_shape, ds.num_classes)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=layout)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=cfg.train.lr)
    samples = 0
    t0, c0 = time.perf_counter(), time.process_time()
    for rnd in range(start_round, start_round + rounds):
        new_states, weights = [], []
        for cid, data in enumerate(sim.train_data):
            model.load_state_dict(global_state)
            gen = generator(cfg.seed, "client", rnd, cid)
            order = data.idx[torch.randperm(data.n, generator=gen)]
            for s in range(0, data.n, cfg.train.batch_size):
                bidx = order[s:s + cfg.train.batch_size]
                x, y = images[bidx].contiguous(memory_format=layout), ds.y_train[bidx]
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x), y).backward()
                opt.step()
            samples += data.n
            new_states.append({k: v.clone() for k, v in model.state_dict().items()})
            weights.append(data.n)
        total = sum(weights)
        global_state = {k: sum(w / total * s[k] for w, s in zip(weights, new_states, strict=True))
                        for k in global_state}
    return time.perf_counter() - t0, time.process_time() - c0, samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--pfllib", action="store_true",
                    help="PFLlib's MNIST setting: mnist, 20 clients, Dirichlet 0.1, batch 10, "
                    "lr 0.005 (else Fashion-MNIST, 10 clients, Dirichlet 0.3, batch 32, lr 0.01)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--modes", nargs="+", default=[""],
                    help="engine modes, each a space-separated list of key=value settings")
    ap.add_argument("--no-bare", action="store_true", help="skip the hand-written loop")
    ap.add_argument("--no-flops", action="store_true", help="turn FLOP counting off in the engine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    setting = (["dataset.name=mnist", "partition.clients=20", "partition.alpha=0.1",
                "train.batch_size=10", "train.lr=0.005"] if args.pfllib else
               [f"dataset.name={args.dataset}", "partition.clients=10", "partition.alpha=0.3",
                "train.batch_size=32", "train.lr=0.01"])
    base = [*setting, f"dataset.fraction={args.fraction}", "model.name=cnn2",
            "partition.scheme=dirichlet", "train.local_epochs=1", "algorithm.name=fedavg",
            "train.device=cpu", f"train.rounds={args.rounds * args.repeats + 1}",
            "eval.every=100000", "output.plots=false",
            f"system.count_flops={str(not args.no_flops).lower()}"]
    sims = []
    for mode in args.modes:
        sim = Simulation(build_config({}, [*base, *mode.split()]), progress=False)
        apply_compile(sim)
        t0 = time.perf_counter()
        sim.step()  # round 1 apart: FLOP counting, compiling, allocator warm-up
        print(f"mode {mode or '(defaults)'!r}: round 1 took {time.perf_counter() - t0:.1f} s",
              flush=True)
        sims.append(sim)
    sim = sims[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{sim.cfg.dataset.name} fraction {args.fraction}, batch {sim.cfg.train.batch_size}: "
          f"{sum(d.n for d in sim.train_data)} train samples over {sim.num_clients} clients; "
          f"{args.rounds} rounds per measurement, {args.repeats} repeats; FLOP counting "
          f"{'off' if args.no_flops else 'on (counted once per client, then cached)'}")
    labels = [f"engine {m or '(defaults)'}" for m in args.modes]
    if not args.no_bare:
        bare_rounds(sim, 1, 1)  # warm-up: allocator, kernels
        bare_rounds(sim, 1, 1, channels_last=True)
        labels += ["bare NCHW", "bare channels-last"]
    runs: dict[str, list[tuple[float, float]]] = {label: [] for label in labels}
    for _ in range(args.repeats):
        rnd = sim.round + 1
        measured = [engine_rounds(s, args.rounds) for s in sims]
        if not args.no_bare:
            measured += [bare_rounds(sim, args.rounds, rnd),
                         bare_rounds(sim, args.rounds, rnd, channels_last=True)]
        for label, (wall, cpu, n) in zip(labels, measured, strict=True):
            runs[label].append((n / wall, n / cpu))
        print("  " + "; ".join(f"{label}: {w:.0f} samples/s wall, {c:.0f} CPU"
                               for label, ((w, c), *_) in
                               ((k, v[-1:]) for k, v in runs.items())), flush=True)
    first = labels[0]
    ref_w = statistics.median(w for w, _ in runs[first])
    ref_c = statistics.median(c for _, c in runs[first])
    print(f"\n| run | samples/s, wall (runs) | vs {first}, wall | samples/s of CPU time (runs) "
          f"| vs {first}, CPU |\n|---|---|---|---|---|")
    for label, v in runs.items():
        w = statistics.median(x for x, _ in v)
        c = statistics.median(x for _, x in v)
        print(f"| {label} | {w:,.0f} ({', '.join(f'{x:,.0f}' for x, _ in v)}) | {w / ref_w:.2f}x "
              f"| {c:,.0f} ({', '.join(f'{x:,.0f}' for _, x in v)}) | {c / ref_c:.2f}x |")


if __name__ == "__main__":
    main()
