"""Engine overhead: FedAvg through the engine vs a bare PyTorch loop on the same samples.

Both train `cnn2` on Fashion-MNIST (10 clients, batch 32, one local epoch per round) in the
same process, visiting exactly the same samples in exactly the same order: the bare loop
replays, per round and client, the index order the engine's client drew. The bare loop is
what a hand-written script would do: one model, torch.optim.SGD, a FedAvg average by hand.
Evaluation is excluded from both (the engine evaluates only after the timed rounds).

    python bench/speed/throughput.py [--rounds 3] [--fraction 0.1] [--repeats 3]

Prints samples/s of both and the engine's overhead; record results in bench/speed/README.md and bench/LOG.md.
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


def engine_rounds(sim: Simulation, rounds: int) -> tuple[float, int]:
    samples = 0
    t0 = time.perf_counter()
    for _ in range(rounds):
        sim.step()
    elapsed = time.perf_counter() - t0
    samples = rounds * sum(d.n for d in sim.train_data)
    return elapsed, samples


def bare_rounds(sim: Simulation, rounds: int, start_round: int,
                channels_last: bool = False) -> tuple[float, int]:
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
    t0 = time.perf_counter()
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
    return time.perf_counter() - t0, samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dataset", default="fmnist")
    ap.add_argument("--no-flops", action="store_true", help="turn FLOP counting off in the engine")
    args = ap.parse_args()
    cfg = build_config({}, [f"dataset.name={args.dataset}", f"dataset.fraction={args.fraction}",
                            "model.name=cnn2", "partition.clients=10", "partition.alpha=0.3",
                            "train.batch_size=32", "train.local_epochs=1", "train.lr=0.01",
                            "algorithm.name=fedavg", f"train.rounds={args.rounds * args.repeats + 1}",
                            "eval.every=100000", "output.plots=false",
                            f"system.count_flops={str(not args.no_flops).lower()}"])
    sim = Simulation(cfg, progress=False)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.dataset} "
          f"fraction {args.fraction}: {sum(d.n for d in sim.train_data)} train samples over "
          f"{sim.num_clients} clients; {args.rounds} rounds per measurement, {args.repeats} repeats; "
          f"FLOP counting {'off' if args.no_flops else 'on (counted once per client, then cached)'}")
    bare_rounds(sim, 1, 1)  # warm-up: allocator, kernels
    bare_rounds(sim, 1, 1, channels_last=True)
    eng, bare, bare_cl = [], [], []
    for _ in range(args.repeats):
        rnd = sim.round + 1
        t, n = engine_rounds(sim, args.rounds)
        eng.append(n / t)
        t, n = bare_rounds(sim, args.rounds, rnd)
        bare.append(n / t)
        t, n = bare_rounds(sim, args.rounds, rnd, channels_last=True)
        bare_cl.append(n / t)
    e, b, c = (statistics.median(v) for v in (eng, bare, bare_cl))
    for label, med, runs in (("engine", e, eng), ("bare NCHW", b, bare),
                             ("bare channels-last", c, bare_cl)):
        print(f"{label:19}: {med:10.0f} samples/s   (runs: {', '.join(f'{x:.0f}' for x in runs)})")
    print(f"engine / bare NCHW = {e / b:.3f}; engine / bare channels-last = {e / c:.3f} "
          f"(engine overhead against the same layout: {100 * (c / e - 1):+.1f}% time)")


if __name__ == "__main__":
    main()
