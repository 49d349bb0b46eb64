"""Round time: edgepfl's simulation against Flower's simulation runtime, same task, one run.

FedAvg on Fashion-MNIST (`cnn2`, 10 clients, Dirichlet 0.3, 10% of the data, every client
every round, one local epoch, batch 32, lr 0.01), three ways:

* ``edgepfl``: edgepfl's in-process ``Simulation``;
* ``edgepfl-on-flower``: the same edgepfl FedAvg (``edgepfl.engine.flower``'s ServerApp and
  ClientApp) on Flower's simulation runtime (Ray);
* ``flower``: FedAvg as Flower's PyTorch quickstart writes it, on Flower's simulation
  runtime: Flower's ``FedAvg`` strategy, a ClientApp that loads the received arrays into a
  model and trains it with a ``DataLoader`` and ``torch.optim.SGD``. Its data are the same
  client shares, already decoded tensors in memory (the quickstart decodes images per
  batch, which would be slower), so the comparison is of the runtimes, not data pipelines.

Every way trains the same clients on the same number of samples per round. Reported: the
median time of a training round after the first (steady state; client evaluation is left
out of all three) and the wall time of the whole run, start-up included (Ray's start, the
actors' imports and data loading). Flower runs clients in parallel actors; ``--cpus``
sets the CPUs each actor asks for (Flower's default is 2: one client at a time on this
machine; 1: two at a time).

Needs Flower's simulation extra, which is not one of edgepfl's:
``pip install 'flwr[simulation]>=1.41,<2'`` (Ray; keep torch 2.13.0 installed first).

    python bench/checks/flower_sim.py [--rounds 5] [--cpus 2 1] [--threads 2 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from edgepfl.config import build_config
from edgepfl.engine import flower as efl
from edgepfl.engine.simulation import Simulation
from edgepfl.models import build_model

try:
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation
except ImportError as exc:  # pragma: no cover
    raise SystemExit("needs Flower's simulation runtime: "
                     f"pip install 'flwr[simulation]>=1.41,<2' ({exc})") from exc

CLIENTS = 10
# Ray's workers import the quickstart ClientApp by name
sys.path.insert(0, str(Path(__file__).parent))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                         os.environ.get("PYTHONPATH")]))
import flower_quickstart as quickstart  # noqa: E402


def settings(rounds: int, fraction: float) -> dict:
    """The task as edgepfl settings; one round more than timed, so that the last round's
    evaluation (edgepfl always evaluates the last round) falls outside the timed rounds."""
    return {"algorithm.name": "fedavg", "dataset.name": "fmnist", "dataset.fraction": fraction,
            "model.name": "cnn2", "partition.clients": CLIENTS, "partition.alpha": 0.3,
            "train.batch_size": 32, "train.local_epochs": 1, "train.lr": 0.01,
            "train.rounds": rounds + 1, "eval.every": 100_000, "output.plots": False,
            "system.count_flops": False}


def as_sets(conf: dict) -> list[str]:
    return [f"{k}={v}" for k, v in conf.items()]


def edgepfl_sim(conf: dict, rounds: int) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    sim = Simulation(build_config({}, as_sets(conf)), progress=False)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        sim.step()
        times.append(time.perf_counter() - t)
    return times, time.perf_counter() - t0


class _Configured(ClientApp):
    """edgepfl's ClientApp with the run config that ``flwr run`` would give it (Flower's
    ``run_simulation`` passes none)."""

    def __init__(self, run_config: dict):
        super().__init__()
        self.run_config = run_config

    def __call__(self, message: Message, context: Context) -> Message:
        # a Context's run config is read-only; the node's state object is shared, so what
        # the client keeps between rounds still persists
        configured = Context(run_id=context.run_id, node_id=context.node_id,
                             node_config=context.node_config, state=context.state,
                             run_config=dict(self.run_config))
        return efl.client_app(message, configured)


def edgepfl_on_flower(conf: dict, rounds: int, cpus: float) -> tuple[list[float], float]:
    result: dict = {}
    server = ServerApp()

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        result["run"] = efl.run_server(grid, conf)

    t0 = time.perf_counter()
    run_simulation(server, _Configured(conf), CLIENTS, backend_config=_backend(cpus))
    metrics = result["run"].metrics
    # the run's one more round (with the evaluation) is not part of the other rows' runs
    total = time.perf_counter() - t0 - metrics[rounds]["wall_s"]
    return [r["wall_s"] for r in metrics[:rounds]], total


def flower(conf: dict, rounds: int, cpus: float) -> tuple[list[float], float]:
    sets = as_sets(conf)
    stamps: list[float] = []
    trained: list[tuple[int, int]] = []
    server = ServerApp()

    def count(replies: list[RecordDict], key: str) -> MetricRecord:
        # Flower's FedAvg aggregates whatever replies arrive; a round only counts if every
        # client trained on its whole share
        trained.append((len(replies), sum(int(r["metrics"][key]) for r in replies)))
        return MetricRecord({})

    @server.main()
    def _main(grid: Grid, context: Context) -> None:
        x, _, _, classes = quickstart.shares(tuple(sets))
        model = build_model(conf["model.name"], tuple(x.shape[1:]), classes)
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=CLIENTS,
                          min_available_nodes=CLIENTS, min_evaluate_nodes=0,
                          train_metrics_aggr_fn=count)

        def stamp(rnd: int, arrays: ArrayRecord) -> MetricRecord | None:
            stamps.append(time.perf_counter())
            return None

        config = ConfigRecord({"sets": sets, "model": conf["model.name"], "lr": conf["train.lr"],
                               "batch-size": conf["train.batch_size"],
                               "local-epochs": conf["train.local_epochs"]})
        strategy.start(grid, ArrayRecord(model.state_dict()), num_rounds=rounds,
                       train_config=config, evaluate_fn=stamp)

    t0 = time.perf_counter()
    run_simulation(server, quickstart.app, CLIENTS, backend_config=_backend(cpus))
    total = time.perf_counter() - t0
    _, _, parts, _ = quickstart.shares(tuple(sets))
    want = (CLIENTS, sum(len(p) for p in parts))
    if trained != [want] * rounds:
        raise SystemExit(f"Flower FedAvg: (replies, samples) per round {trained}, expected {want} "
                         f"in each of {rounds} rounds; a ClientApp failed (see the log above)")
    return [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)], total


def _backend(cpus: float) -> dict:
    return {"client_resources": {"num_cpus": cpus, "num_gpus": 0.0},
            "init_args": {"num_cpus": os.cpu_count() or 1}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per run")
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--cpus", type=float, nargs="+", default=[2.0, 1.0],
                    help="CPUs per Flower actor (one run each)")
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1],
                    help="torch threads of edgepfl's simulation (one run each)")
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error(f"--rounds {args.rounds}: at least 2 (the first round is start-up and not timed)")
    conf = settings(args.rounds, args.fraction)
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows.append((f"edgepfl, {threads} thread(s)", *edgepfl_sim(conf, args.rounds)))
    torch.set_num_threads(max(args.threads))
    for cpus in args.cpus:
        rows.append((f"edgepfl-on-flower, {cpus:g} CPU(s) per actor",
                     *edgepfl_on_flower(conf, args.rounds, cpus)))
        rows.append((f"flower FedAvg, {cpus:g} CPU(s) per actor", *flower(conf, args.rounds, cpus)))
    best = statistics.median(rows[0][1][1:])
    _, _, parts, _ = quickstart.shares(tuple(as_sets(conf)))
    print(f"\ntorch {torch.__version__}, {os.cpu_count()} CPUs; fmnist fraction {args.fraction}: "
          f"{sum(len(p) for p in parts)} train samples per round over {CLIENTS} clients; "
          f"{args.rounds} timed rounds")
    print(f"{'runtime':45} {'round s (median, rounds 2..)':>29} {'x ' + rows[0][0]:>28} {'run s':>8}")
    for label, times, total in rows:
        med = statistics.median(times[1:])
        print(f"{label:45} {med:29.2f} {med / best:28.2f} {total:8.1f}")
        print(f"{'':45} rounds: {', '.join(f'{t:.2f}' for t in times)}")


if __name__ == "__main__":
    main()
