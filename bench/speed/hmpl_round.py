"""HMPL's round against HMPL_S's at the same tiers (issue 57): seconds and counted FLOPs a
round, and where an HMPL round's time goes, per model kind (Com, Ord, Sup stage 1 and 2).

    python bench/speed/hmpl_round.py [--rounds 6] [--fraction 0.01] [--clients 10]
                                     [--algorithms hmpl hmpl_s] [--profile 25] [--set k=v ...]

Each algorithm runs ``--rounds`` rounds in a simulation of its own, one after the other in
one process on one thread, on HMPL's protocol (bench/papers/hmpl_tables.sh: Fashion-MNIST,
IID, batch 20, lr 0.01, HMPL's device classes ``system.devices = tiers``, every client's
test split evaluated every round) with every client in every round, so that the tiers are
3:4:3 of the round's clients from round 2 on and a Sup model reaches stage 2 (round 3) and
goes back to stage 1 (round 4, ``growth_revert``) within a few rounds. Round 1 trains
every client on the Ord model in both (``first_round = all``) and is left out. Per round:
``wall_s`` and ``flops_client`` from the metrics, the process's CPU time (what other
processes' load inflates least), and the time inside

* ``Trainer.run`` per model trained (a client's local SGD; a client whose work is new to
  the FLOP cache trains under the counter: rounds 2-4 of hmpl),
* ``fitted_align`` (a Com client's least-squares refit of its aligner, ``com_align = fit``),
* the rest of ``Client.fit_request`` (growing/shrinking, checks),
* ``evaluate_predictive`` per model evaluated (personal, and hmpl's global Ord model for
  every non-Ord client),
* the server's ``aggregate``.

``--profile N``: a cProfile of hmpl's rounds after the first, the N functions with the
most cumulative time. Record results in bench/speed/README.md and bench/LOG.md.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import edgepfl.algorithms.hmpl as hmpl_mod
from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation
from edgepfl.models.hmpl_tiers import STAGE
from edgepfl.training.trainer import Trainer

SPENT: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)


def model_kind(model: torch.nn.Module) -> str:
    name = type(model).__name__
    depth = getattr(model, "depth", None)
    return f"{name}({depth})" if depth is not None else name


def timed(key_of, fn):
    def wrapper(*a, **kw):
        key = key_of(*a, **kw)
        start = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            SPENT[key] += time.perf_counter() - start
            CALLS[key] += 1
    return wrapper


def stage_key(self, states, *a, **kw) -> str:
    stage = states[0].get(STAGE) if states else None
    names = {-1: "Com", 0: "Ord", 1: "Sup(1)", 2: "Sup(2)"}
    return "eval " + (names[int(stage)] if stage is not None else "Ord (hmpl_ord)")


def install() -> None:
    Trainer.run = timed(lambda self, req: "train " + model_kind(self.model), Trainer.run)
    evaluator = next(c for c in Trainer.__mro__ if "evaluate_predictive" in c.__dict__)
    evaluator.evaluate_predictive = timed(stage_key, evaluator.evaluate_predictive)
    hmpl_mod.fitted_align = timed(lambda *a, **kw: "fitted_align", hmpl_mod.fitted_align)
    hmpl_mod.HMPLClient.fit_request = timed(lambda *a, **kw: "fit_request (all)",
                                            hmpl_mod.HMPLClient.fit_request)
    hmpl_mod.HMPLServer.aggregate = timed(lambda *a, **kw: "aggregate",
                                          hmpl_mod.HMPLServer.aggregate)


def measure(algorithm: str, args, profile: cProfile.Profile | None) -> dict:
    cfg = build_config({}, [f"algorithm.name={algorithm}", "dataset.name=fmnist",
                            f"dataset.fraction={args.fraction}",
                            f"partition.clients={args.clients}", "partition.scheme=iid",
                            "train.participation=1", "train.batch_size=20", "train.lr=0.01",
                            "system.devices=tiers", f"train.rounds={args.rounds}", "seed=0",
                            "train.threads=1", "output.plots=false", *args.sets])
    with tempfile.TemporaryDirectory() as out:
        sim = Simulation(cfg, Path(out), progress=False)
        sim.step()
        SPENT.clear()
        CALLS.clear()
        per_round = []
        for _ in range(args.rounds - 1):
            before = dict(SPENT)
            cpu = time.process_time()
            with profile or contextlib.nullcontext():
                sim.step()
            part = {k: v - before.get(k, 0.0) for k, v in SPENT.items()}
            part["(round: process CPU s)"] = time.process_time() - cpu
            per_round.append(part)
        rows = sim.metrics
        sim.transport.close()
    return {"rows": rows, "parts": per_round, "calls": dict(CALLS)}


def fmt(x: float) -> str:
    return f"{x:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithms", nargs="+", default=["hmpl", "hmpl_s"])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--profile", type=int, default=0, metavar="N")
    p.add_argument("--set", nargs="*", default=[], dest="sets")
    args = p.parse_args()
    torch.set_num_threads(1)
    install()
    results = {}
    for name in args.algorithms:
        prof = cProfile.Profile() if args.profile and name == "hmpl" else None
        results[name] = measure(name, args, prof)
        res = results[name]
        print(f"\n## {name}")
        cols = ["wall_s", "flops_client", "clients_com", "clients_ord", "clients_sup",
                "sup_depth_trained", "flops_com", "flops_ord", "flops_sup"]
        print("| round | " + " | ".join(cols) + " |")
        for r in res["rows"]:
            print(f"| {r['round']} | " + " | ".join(
                f"{r[c]:.4g}" if isinstance(r.get(c), float) else str(r.get(c, ""))
                for c in cols) + " |")
        keys = sorted({k for part in res["parts"] for k in part})
        print("\nseconds inside, per round (rounds 2..):")
        print("| part | " + " | ".join(str(i + 2) for i in range(len(res["parts"])))
              + " | calls in all |")
        for k in keys:
            print(f"| {k} | " + " | ".join(fmt(part.get(k, 0.0)) for part in res["parts"])
                  + f" | {res['calls'].get(k, 0)} |")
        if prof is not None:
            print()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)
    if {"hmpl", "hmpl_s"} <= results.keys():
        def med(name, key, first=2):
            return statistics.median(float(r[key]) for r in results[name]["rows"]
                                     if r["round"] >= first)
        last = max(args.rounds - 1, 2)
        for first, label in ((2, "rounds 2.."), (last, f"rounds {last}.. (after the revert)")):
            a, b = med("hmpl", "wall_s", first), med("hmpl_s", "wall_s", first)
            ca = statistics.median(p["(round: process CPU s)"] for p in results["hmpl"]["parts"][first - 2:])
            cb = statistics.median(p["(round: process CPU s)"] for p in results["hmpl_s"]["parts"][first - 2:])
            fa, fb = med("hmpl", "flops_client", first), med("hmpl_s", "flops_client", first)
            print(f"\n{label}: hmpl {a:.2f} s, hmpl_s {b:.2f} s a round (median): {a / b:.2f}x; "
                  f"CPU {ca:.2f} s against {cb:.2f}: {ca / cb:.2f}x; "
                  f"FLOPs {fa:.4g} against {fb:.4g}: {fa / fb:.2f}x")


if __name__ == "__main__":
    main()
