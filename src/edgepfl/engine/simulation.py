"""The in-process simulation engine: the round loop and everything around it.

sample clients -> server.configure -> messages down (counted, copied) -> client.update
-> messages up (counted, copied) -> server.aggregate -> evaluate -> log -> checkpoint.

The engine owns client sampling, message delivery and byte accounting, evaluation,
logging and checkpoints; algorithms own only what to send and how to fold replies.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from edgepfl import __version__
from edgepfl.algorithms import ClientContext, ServerContext, get_algorithm
from edgepfl.algorithms.base import Algorithm, Client, Hyperparameters, Server
from edgepfl.algorithms.training import ClientData, Trainer
from edgepfl.config import Config, build_config
from edgepfl.data import load_dataset, make_partition
from edgepfl.data.datasets import Dataset
from edgepfl.data.partition import Partition
from edgepfl.engine.progress import RoundProgress
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.federation.messages import MessageError
from edgepfl.federation.rng import derive_seed, generator, select_clients
from edgepfl.federation.store import StackedStore
from edgepfl.io import read_json, read_tensors, write_csv, write_json, write_tensors
from edgepfl.models import DEFAULT_MODEL, MODELS, LayerSpec, build_model
from edgepfl.system import (
    COST_COLUMNS,
    FlopMeter,
    SystemModel,
    cost_totals,
    peak_rss_bytes,
    state_bytes,
    work_signature,
)

METRIC_COLUMNS = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss",
                  "train_loss", "bytes_up", "bytes_down", "clients", "wall_s", *COST_COLUMNS]
CHECKPOINT = "checkpoint.safetensors"


def resolve(cfg: Config) -> Config:
    """Fill in what defaults depend on (model per data set, algorithm hyperparameters)."""
    algo = get_algorithm(cfg.algorithm.name)
    hp = algo.parse_hyperparameters(cfg.algorithm.hyperparameters())
    data = cfg.model_dump()
    if data["model"]["name"] is None:
        base = DEFAULT_MODEL.get(cfg.dataset.name, "mlp")
        variant = base + algo.model_variant
        data["model"]["name"] = variant if variant in MODELS else base
    data["algorithm"] = {"name": algo.name, **hp.model_dump()}
    return build_config(data)


def config_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += config_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}: run has {va!r}, given {vb!r}")
    return out


@dataclass
class Parts:
    """What a run builds from its configuration and data set's shapes, the same way
    wherever it runs (this simulation, or a Flower ServerApp / ClientApp)."""

    cfg: Config
    algorithm: Algorithm
    hp: Hyperparameters
    layers: LayerSpec
    trainer: Trainer
    init_model: dict[str, torch.Tensor]
    num_classes: int

    @classmethod
    def build(cls, cfg: Config, dataset: Dataset) -> Parts:
        """``cfg`` resolved; the initial model drawn from the run's seed alone."""
        algorithm = get_algorithm(cfg.algorithm.name)
        hp = algorithm.parse_hyperparameters(cfg.algorithm.hyperparameters())
        torch.manual_seed(derive_seed(cfg.seed, "init"))
        model = build_model(cfg.model.name, dataset.input_shape, dataset.num_classes)
        trainer = Trainer(model, cfg.eval.batch_size)
        return cls(cfg, algorithm, hp, LayerSpec.from_model(model), trainer, trainer.export(),
                   dataset.num_classes)

    def server(self, num_clients: int) -> Server:
        cfg = self.cfg
        return self.algorithm.server(
            ServerContext(num_clients, self.layers, self.init_model, cfg.train, cfg.seed), self.hp)

    def client(self) -> Client:
        cfg = self.cfg
        return self.algorithm.client(
            ClientContext(self.trainer, self.layers, cfg.train, self.num_classes, cfg.seed), self.hp)


def metric_columns(metrics: list[dict], base: list[str] = METRIC_COLUMNS) -> list[str]:
    """``base`` and then every other key the rows have (an algorithm's own figures)."""
    return base + list(dict.fromkeys(k for row in metrics for k in row if k not in base))


def finish_run_dir(out: Path, cfg: Config, summary: dict, server: Server,
                   metrics: list[dict]) -> None:
    """What a finished run writes: its summary, the algorithm's artifacts, the plot."""
    write_json(out / "summary.json", summary)
    server.write_artifacts(out, cfg.output.plots)
    if cfg.output.plots:
        from edgepfl.plotting import plot_accuracy
        plot_accuracy(metrics, out / "accuracy.png", f"{cfg.algorithm.name} on {cfg.dataset.name}")


def client_split(dataset: Dataset, partition: Partition,
                 cid: int) -> tuple[ClientData, tuple[torch.Tensor, torch.Tensor]]:
    """Client ``cid``'s training view and its test samples."""
    ds, idx = dataset, partition.test[cid]
    return (ClientData(ds.x_train, ds.y_train, partition.train[cid]),
            (ds.x_test.index_select(0, idx), ds.y_test.index_select(0, idx)))


def accuracy_row(accs: list[float], losses: list[float], test_sizes: np.ndarray) -> dict:
    """A round's evaluation figures from every client's accuracy and mean loss (NaN for a
    client without test samples): unweighted mean, weighted mean, spread, worst."""
    acc = np.array(accs)
    ok = ~np.isnan(acc)
    return {"acc_mean": float(acc[ok].mean()),
            "acc_weighted": float(np.average(acc[ok], weights=test_sizes[ok])),
            "acc_std": float(acc[ok].std()),
            "acc_min": float(acc[ok].min()),
            "loss": float(np.nanmean(losses))}


def load_federation(cfg: Config, dataset: Dataset | None = None,
                    partition: Partition | None = None) -> tuple[Dataset, Partition]:
    """The run's data set and its seeded split over the clients (either may be given)."""
    dataset = dataset or load_dataset(cfg.dataset.name, cfg.dataset.root, cfg.dataset.fraction,
                                      cfg.seed, cfg.dataset.download)
    partition = partition or make_partition(
        dataset.y_train, dataset.y_test, dataset.num_classes, cfg.partition.scheme,
        cfg.partition.clients, cfg.seed, alpha=cfg.partition.alpha,
        min_size=cfg.partition.min_size, classes_per_client=cfg.partition.classes_per_client)
    return dataset, partition


def accuracy_summary(metrics: list[dict], client_acc: list[float]) -> dict:
    """Best round (the papers' figure), final round and its spread, from evaluated rows."""
    evaluated = [r for r in metrics if not math.isnan(r["acc_mean"])]
    best = max(evaluated, key=lambda r: r["acc_mean"]) if evaluated else None
    final = evaluated[-1] if evaluated else None
    return {
        "acc_mean_best": best["acc_mean"] if best else None,
        "best_round": best["round"] if best else None,
        "acc_mean_final": final["acc_mean"] if final else None,
        "acc_weighted_final": final["acc_weighted"] if final else None,
        "acc_std_final": final["acc_std"] if final else None,
        "acc_min_final": final["acc_min"] if final else None,
        "final_round": final["round"] if final else None,
        "acc_clients_final": client_acc,
    }


@dataclass
class RunResult:
    summary: dict
    metrics: list[dict]
    out_dir: Path | None
    client_accuracy: list[float] = field(default_factory=list)


class Simulation:
    """One run of one algorithm on one federation. ``run()`` executes the rounds."""

    def __init__(self, cfg: Config, out_dir: str | Path | None = None, *,
                 progress: bool | None = None, dataset: Dataset | None = None,
                 partition: Partition | None = None):
        self.cfg = cfg = resolve(cfg)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.progress = progress
        self.dataset, self.partition = load_federation(cfg, dataset, partition)
        n = self.num_clients = self.partition.num_clients

        parts = Parts.build(cfg, self.dataset)
        self.algorithm = parts.algorithm
        self.layers, self.trainer, init_model = parts.layers, parts.trainer, parts.init_model
        self.server = parts.server(n)
        self.client = parts.client()
        self.clients = StackedStore(n)
        for cid in range(n):
            self.clients.set_row(cid, self.client.init_state(cid, init_model))

        splits = [client_split(self.dataset, self.partition, cid) for cid in range(n)]
        self.train_data = [train for train, _ in splits]
        self.test_data = [test for _, test in splits]
        self.test_sizes = np.array([y.numel() for _, y in self.test_data])
        self.round = 0
        self.metrics: list[dict] = []
        self.client_acc: list[float] = []
        self.bytes_up = np.zeros(n, dtype=np.int64)
        self.bytes_down = np.zeros(n, dtype=np.int64)
        self.wall_time = 0.0
        self.system = SystemModel.build(cfg.system, n, cfg.seed)
        self.flops = FlopMeter(enabled=cfg.system.count_flops, cache=cfg.system.cache_flops)
        self.server_state_bytes = state_bytes(self.server.state_dict())

    # -- one round ------------------------------------------------------------------
    def step(self) -> dict:
        cfg = self.cfg
        rnd = self.round + 1
        t0 = time.perf_counter()
        selected = select_clients(cfg.seed, rnd, self.num_clients, cfg.train.participation)
        with self.flops.measure() as configure_flops:
            down = self.server.configure(rnd, selected)
        if set(down) != set(selected):
            raise MessageError(f"server configured clients {sorted(down)} but round {rnd} selected {selected}")
        replies, losses, weights = {}, [], []
        sent_down: dict[int, int] = {}
        sent_up: dict[int, int] = {}
        client_flops: dict[int, int] = {}
        for cid in selected:
            sent_down[cid] = down[cid].nbytes
            msg, state = down[cid].delivered(), self.clients.row(cid)
            torch.manual_seed(derive_seed(cfg.seed, "torch", rnd, cid))
            # local training cost depends on shapes, not values: counted once per signature
            with self.flops.measure(("client", cid, work_signature(msg, state))) as counted:
                result = self.client.update(cid, msg, state, self.train_data[cid],
                                            generator(cfg.seed, "client", rnd, cid))
            client_flops[cid] = counted.flops or 0
            self.clients.set_row(cid, result.state)
            sent_up[cid] = result.reply.nbytes
            replies[cid] = result.reply.delivered()
            if "train_loss" in result.stats:
                losses.append(result.stats["train_loss"])
                weights.append(self.train_data[cid].n)
        with self.flops.measure() as aggregate_flops:
            self.server.aggregate(rnd, replies)
        for cid in selected:
            self.bytes_down[cid] += sent_down[cid]
            self.bytes_up[cid] += sent_up[cid]
        self.server_state_bytes = max(self.server_state_bytes, state_bytes(self.server.state_dict()))
        counting = self.flops.enabled
        costs = self.system.round_costs(
            selected, sent_down, sent_up, client_flops if counting else None,
            (configure_flops.flops or 0) + (aggregate_flops.flops or 0) if counting else None)

        row: dict = {"round": rnd, "bytes_up": sum(sent_up.values()),
                     "bytes_down": sum(sent_down.values()),
                     "clients": len(selected),
                     "train_loss": float(np.average(losses, weights=weights)) if losses else math.nan}
        if rnd % cfg.eval.every == 0 or rnd == cfg.train.rounds:
            row.update(self.evaluate())
        else:
            row.update(acc_mean=math.nan, acc_weighted=math.nan, acc_std=math.nan,
                       acc_min=math.nan, loss=math.nan)
        row.update(costs)
        row.update(self.server.round_metrics())
        row["wall_s"] = time.perf_counter() - t0
        self.wall_time += row["wall_s"]
        self.round = rnd
        self.metrics.append(row)
        return row

    def evaluate(self) -> dict:
        """Every client's personalized model on its own test split."""
        self.trainer.forget()
        accs, losses = [], []
        for cid in range(self.num_clients):
            x, y = self.test_data[cid]
            if y.numel() == 0:
                accs.append(math.nan)
                losses.append(math.nan)
                continue
            state = self.client.personal_model(self.clients.row(cid), self.server.eval_message(cid))
            correct, loss = self.trainer.evaluate(state, x, y)
            accs.append(correct / y.numel())
            losses.append(loss / y.numel())
        self.client_acc = accs
        return accuracy_row(accs, losses, self.test_sizes)

    # -- whole run ---------------------------------------------------------------------
    def run(self) -> RunResult:
        cfg = self.cfg
        if self.out_dir is not None and self.round == 0:
            self._write_setup()
        bar = RoundProgress(cfg.train.rounds, self.round,
                            f"{cfg.algorithm.name} on {cfg.dataset.name}", self.progress)
        try:
            while self.round < cfg.train.rounds:
                row = self.step()
                if self.out_dir is not None:
                    write_csv(self.out_dir / "metrics.csv", self.metric_columns(), self.metrics)
                    if self.round % cfg.output.checkpoint_every == 0 or self.round == cfg.train.rounds:
                        self.save_checkpoint()
                bar.update(self.round, row)
        finally:
            bar.close()
        summary = self.summary()
        if self.out_dir is not None:
            finish_run_dir(self.out_dir, cfg, summary, self.server, self.metrics)
        return RunResult(summary, self.metrics, self.out_dir, list(self.client_acc))

    def metric_columns(self) -> list[str]:
        return metric_columns(self.metrics)

    def summary(self) -> dict:
        cfg = self.cfg
        return {
            "algorithm": cfg.algorithm.name, "dataset": cfg.dataset.name, "model": cfg.model.name,
            "clients": self.num_clients, "rounds": self.round, "seed": cfg.seed,
            "participation": cfg.train.participation,
            **accuracy_summary(self.metrics, self.client_acc),
            "bytes_up_total": int(self.bytes_up.sum()),
            "bytes_down_total": int(self.bytes_down.sum()),
            "bytes_up_per_client": self.bytes_up.tolist(),
            "bytes_down_per_client": self.bytes_down.tolist(),
            "wall_time_s": self.wall_time,
            **cost_totals(self.metrics),
            "server_state_bytes": self.server_state_bytes,
            "client_state_bytes": self.clients.nbytes(),
            "peak_rss_bytes": peak_rss_bytes(),
            "model_params": self.layers.numel,
            "layers": self.layers.names,
            "edgepfl_version": __version__,
        }

    # -- files ---------------------------------------------------------------------------
    def _write_setup(self) -> None:
        out = self.out_dir
        assert out is not None
        write_json(out / "config.json", self.cfg.model_dump())
        part = self.partition.to_json(self.dataset.y_train, self.dataset.y_test)
        part["layers"] = self.layers.to_json()
        write_json(out / "partition.json", part)
        write_json(out / "system.json", self.system.describe())
        if self.cfg.output.plots:
            from edgepfl.plotting import plot_partition
            counts, _ = self.partition.class_counts(self.dataset.y_train, self.dataset.y_test)
            plot_partition(counts, out / "partition.png", self.dataset.classes)

    def save_checkpoint(self) -> None:
        assert self.out_dir is not None
        tensors = self.clients.state_dict("client/")
        tensors.update({f"server/{k}": v for k, v in self.server.state_dict().items()})
        meta = {"round": self.round, "config": self.cfg.model_dump(), "metrics": self.metrics,
                "client_acc": self.client_acc, "bytes_up": self.bytes_up.tolist(),
                "bytes_down": self.bytes_down.tolist(), "wall_time_s": self.wall_time,
                "server_state_bytes": self.server_state_bytes,
                "edgepfl_version": __version__}
        write_tensors(self.out_dir / CHECKPOINT, tensors, meta)

    def load_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Clients' and server's state from a checkpoint's tensors (no config check: the
        caller vouches that they belong to this configuration)."""
        self.clients.load_state_dict(tensors, "client/")
        self.server.load_state_dict({k[len("server/"):]: v for k, v in tensors.items()
                                     if k.startswith("server/")})

    def load_checkpoint(self, path: Path) -> None:
        tensors, meta = read_tensors(path)
        try:
            config = meta["config"]
            rnd = int(meta["round"])
            metrics = [{k: (math.nan if v is None else v) for k, v in row.items()}
                       for row in meta["metrics"]]
            client_acc = [math.nan if v is None else float(v) for v in meta["client_acc"]]
            bytes_up = np.array(meta["bytes_up"], dtype=np.int64)
            bytes_down = np.array(meta["bytes_down"], dtype=np.int64)
            wall_time = float(meta["wall_time_s"])
            server_bytes = int(meta.get("server_state_bytes", self.server_state_bytes))
            shape = (self.num_clients,)
            if not isinstance(config, dict) or len(metrics) != rnd or \
                    bytes_up.shape != shape or bytes_down.shape != shape:
                raise ValueError(f"round {rnd}, {len(metrics)} metric rows, byte counts for "
                                 f"{bytes_up.shape} / {bytes_down.shape} clients")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EdgepflError(f"{path} is not a valid edgepfl checkpoint: its metadata is "
                               f"malformed ({type(exc).__name__}: {exc})") from None
        # train.rounds may have grown (an extended run): nothing in a round depends on it
        if config_diff(_without_rounds(config), _without_rounds(self.cfg.model_dump())):
            raise EdgepflError(f"{path} belongs to a different configuration than {path.parent}/config.json")
        if rnd > self.cfg.train.rounds:
            raise EdgepflError(f"{path} is at round {rnd}, past train.rounds={self.cfg.train.rounds}")
        self.load_state(tensors)
        self.round, self.metrics, self.client_acc = rnd, metrics, client_acc
        self.bytes_up, self.bytes_down, self.wall_time = bytes_up, bytes_down, wall_time
        self.server_state_bytes = server_bytes


def default_run_dir(cfg: Config, base: Path = Path("runs")) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = base / f"{cfg.algorithm.name}-{cfg.dataset.name}-{stamp}"
    k = 1
    while path.exists():
        k += 1
        path = base / f"{cfg.algorithm.name}-{cfg.dataset.name}-{stamp}-{k}"
    return path


def start_run(cfg: Config, out_dir: str | Path | None = None, progress: bool | None = None,
              **kwargs) -> RunResult:
    """Run a configuration into a fresh run directory (refuses to overwrite a run)."""
    cfg = resolve(cfg)
    out = Path(out_dir) if out_dir is not None else default_run_dir(cfg)
    if (out / "config.json").exists():
        raise EdgepflError(f"{out} already holds a run; use --resume {out} to continue it "
                           "or choose another --out")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EdgepflError(f"cannot create the run directory {out}: {exc}") from None
    try:
        sim = Simulation(cfg, out, progress=progress, **kwargs)
    except BaseException:
        # e.g. a data set that is not there: leave no empty run directory behind
        if created and not any(out.iterdir()):
            out.rmdir()
        raise
    return sim.run()


def _without_rounds(cfg: dict) -> dict:
    return {**cfg, "train": {k: v for k, v in cfg.get("train", {}).items() if k != "rounds"}}


def resume_run(run_dir: str | Path, cfg: Config | None = None,
               progress: bool | None = None, overrides: list[str] | None = None,
               **kwargs) -> RunResult:
    """Continue ``run_dir`` from its last checkpoint.

    ``cfg`` (a whole configuration) or ``overrides`` (``key=value`` applied to the run's
    own configuration) must match the run, except that ``train.rounds`` may be raised: the
    run then goes on to the new last round, exactly as a run started with that many rounds
    would have (nothing in a round depends on the total), and its config.json says so.
    ``kwargs`` go to ``Simulation`` (an already loaded ``dataset`` / ``partition``).
    """
    run_dir = Path(run_dir)
    stored = read_json(run_dir / "config.json")
    if not isinstance(stored, dict) or not isinstance(stored.get("train"), dict):
        raise ConfigError(f"{run_dir / 'config.json'} is not an edgepfl run configuration")
    if cfg is None and overrides:
        cfg = build_config(stored, overrides)
    run_cfg = build_config(stored)
    if cfg is not None:
        given = resolve(cfg).model_dump()
        diff = config_diff(_without_rounds(stored), _without_rounds(given))
        if diff:
            raise ConfigError(f"cannot resume {run_dir} with a different configuration:\n  "
                              + "\n  ".join(diff))
        rounds = given["train"]["rounds"]
        if rounds < stored["train"]["rounds"]:
            raise ConfigError(f"cannot resume {run_dir} with train.rounds={rounds}: the run has "
                              f"{stored['train']['rounds']}; a run can be extended, not shortened")
        if rounds > stored["train"]["rounds"]:
            if not (run_dir / CHECKPOINT).exists():
                raise ConfigError(f"cannot extend {run_dir}: it has no checkpoint to go on from")
            run_cfg = build_config(given)
    ckpt = run_dir / CHECKPOINT
    if not ckpt.exists() and (run_dir / "summary.json").exists():
        raise EdgepflError(f"{run_dir} holds a finished run without its checkpoint (kept "
                           "results); there is nothing to go on from")
    sim = Simulation(run_cfg, run_dir, progress=progress, **kwargs)
    if ckpt.exists():
        sim.load_checkpoint(ckpt)
    if run_cfg.train.rounds != stored["train"]["rounds"]:
        # only once the checkpoint has loaded: a refused extension leaves the run as it was;
        # the old summary goes, so that an interrupted extension does not look finished
        write_json(run_dir / "config.json", run_cfg.model_dump())
        (run_dir / "summary.json").unlink(missing_ok=True)
    return sim.run()
