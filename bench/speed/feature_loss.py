"""Losses on a model's features: one forward pass (FeatureTap) against a second one.

MOON's contrastive loss and FedProto's prototype distance read the model's features. They
used to run ``features(x)`` a second time after the forward that computed the logits; they
now read the classifier's input from that forward (``edgepfl.training.features.
tap_features``). This times a round of both algorithms with each way, in one process,
alternating, on MNIST (10% of it, 10 clients, cnn2, batch 32, one local epoch).

    python bench/speed/feature_loss.py [--rounds 2] [--repeats 2]

Prints seconds per round of both and their ratio; record results in bench/speed/README.md and bench/LOG.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation


@contextmanager
def second_pass(model, classifier):
    """The former way: features recomputed from the batch the model was called on."""
    body = model.net if hasattr(model, "net") else model

    class Tap:
        x = None

        def take(self):
            return body.features(self.x)

    tap = Tap()
    handle = model.register_forward_pre_hook(lambda module, args: setattr(tap, "x", args[0]))
    try:
        yield tap
    finally:
        handle.remove()


def seconds_per_round(algorithm: str, patched: bool, rounds: int) -> float:
    import edgepfl.algorithms.fedproto as fedproto
    import edgepfl.algorithms.moon as moon
    from edgepfl.training.features import tap_features

    cfg = build_config({}, [f"algorithm.name={algorithm}", "dataset.name=mnist",
                            "dataset.fraction=0.1", "partition.clients=10", "partition.alpha=0.1",
                            "model.name=cnn2", "train.local_epochs=1", f"train.rounds={rounds + 1}"])
    sim = Simulation(cfg, progress=False)
    sim.step()  # FedProto has no global prototypes, hence no feature loss, in round 1
    for module in (moon, fedproto):
        module.tap_features = second_pass if patched else tap_features
    try:
        t0 = time.perf_counter()
        for _ in range(rounds):
            sim.step()
        return (time.perf_counter() - t0) / rounds
    finally:
        for module in (moon, fedproto):
            module.tap_features = tap_features


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print("| algorithm | second pass s/round | one pass s/round | one / second |")
    print("|---|---|---|---|")
    for algorithm in ("moon", "fedproto"):
        times = {True: [], False: []}
        for _ in range(args.repeats):
            for patched in (True, False):
                times[patched].append(seconds_per_round(algorithm, patched, args.rounds))
        old, new = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {algorithm} | {old:.2f} | {new:.2f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
