"""Server time per round: KAPC (and KAPC+BLS) against FedAvg, measured, not simulated.

    python bench/speed/server_time.py [--repeats 5] [--threads 1]

One round of server work is ``configure`` (KAPC: Gram matrices, the R step, every selected
client's regularizer s_i) plus ``aggregate`` on the replies (FedAvg: the weighted mean;
KAPC: storing the uploads). Client models are the `cnn2` initial model plus independent
noise, so the numbers do not depend on training. Scenarios are the paper's two: 10 clients
all participating and 100 clients with 10 per round, plus 100 clients all participating to
show how the O(N^2 P) part grows. Each cell is the median over repeats; the ratio is
taken within one process run, on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgepfl.algorithms import get_algorithm
from edgepfl.config import TrainConfig
from edgepfl.contract.algorithm import ServerContext
from edgepfl.federation.messages import Message
from edgepfl.models.layers import LayerSpec
from edgepfl.models.zoo import build_model


def replies_for(init: dict, selected: list[int], gen: torch.Generator) -> dict[int, Message]:
    return {cid: Message({k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in init.items()},
                         {"num_samples": 600}) for cid in selected}


def server_round_seconds(name: str, n: int, per_round: int, repeats: int) -> float:
    torch.manual_seed(0)
    model = build_model("cnn2", (1, 28, 28), 10)
    init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    algo = get_algorithm(name)
    server = algo.server(ServerContext(n, LayerSpec.from_model(model), init, TrainConfig(), 0),
                         algo.hyperparameters())
    gen = torch.Generator().manual_seed(1)
    times = []
    for rnd in range(1, repeats + 2):
        selected = sorted(torch.randperm(n, generator=gen)[:per_round].tolist())
        replies = replies_for(init, selected, gen)  # built outside the timed part
        t0 = time.perf_counter()
        server.configure(rnd, selected)
        server.aggregate(rnd, replies)
        if rnd > 1:  # round 1 warms up allocators
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), cnn2 "
          f"({sum(p.numel() for p in build_model('cnn2', (1, 28, 28), 10).parameters()):,} parameters)")
    print("| clients | per round | fedavg ms | kapc ms | kapc_bls ms | kapc / fedavg |")
    print("|---|---|---|---|---|---|")
    for n, k in ((10, 10), (100, 10), (100, 100)):
        ms = {a: 1e3 * server_round_seconds(a, n, k, args.repeats) for a in ("fedavg", "kapc", "kapc_bls")}
        print(f"| {n} | {k} | {ms['fedavg']:.1f} | {ms['kapc']:.1f} | {ms['kapc_bls']:.1f} | "
              f"{ms['kapc'] / ms['fedavg']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
