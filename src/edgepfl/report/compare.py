"""Several algorithms on the same federation: same partition, same client sequence.

Both follow from the seed alone (partition and sampling never draw from an algorithm's
randomness), so running each algorithm with the same seed is what makes them comparable.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from edgepfl.config import Config, build_config
from edgepfl.data import load_dataset, make_partition
from edgepfl.engine.simulation import resolve, resume_run, start_run
from edgepfl.errors import EdgepflError
from edgepfl.io import write_bytes_atomic, write_csv
from edgepfl.report.plots import plot_curves

COMPARISON_COLUMNS = ["algorithm", "model", "seed", "acc_mean_best", "best_round", "acc_mean_final",
                      "acc_weighted_final", "acc_std_final", "acc_min_final",
                      "acc_client_best_mean", "acc_mean_selected_best",
                      "acc_client_best_selected_mean", "bytes_up_total",
                      "bytes_down_total", "wall_time_s", "run_dir"]


def _mean_std(values: list[float]) -> tuple[float, float]:
    arr = np.array([v for v in values if v is not None], dtype=float)
    if arr.size == 0:
        return math.nan, math.nan
    return float(arr.mean()), float(arr.std())


def split_hyperparameters(base: Config, algorithms: list[str]) -> dict[str, dict]:
    """Hyperparameters per algorithm from ``algorithm.*`` settings.

    ``algorithm.<name>.<key>`` applies to that algorithm only; a plain ``algorithm.<key>``
    applies to every compared algorithm that has such a hyperparameter. A setting that no
    compared algorithm accepts is an error rather than silently dropped.
    """
    from edgepfl.algorithms import get_algorithm
    from edgepfl.errors import ConfigError

    given = base.algorithm.hyperparameters()
    per_algo = {name: dict(given.pop(name)) for name in algorithms
                if isinstance(given.get(name), dict)}
    out = {}
    for name in algorithms:
        fields = get_algorithm(name).hyperparameters.model_fields
        out[name] = {k: v for k, v in given.items() if k in fields}
        out[name].update(per_algo.get(name, {}))
    unused = [k for k in given if not any(k in get_algorithm(a).hyperparameters.model_fields
                                          for a in algorithms)]
    if unused:
        raise ConfigError(f"algorithm.{unused[0]} is a hyperparameter of none of "
                          f"{', '.join(algorithms)}; use algorithm.<name>.<key> for one of them")
    return out


def compare(base: Config, algorithms: list[str], seeds: list[int], out: Path,
            progress: bool | None = None, echo=print) -> list[dict]:
    if not algorithms:
        raise EdgepflError("--algorithms is empty; give a comma-separated list, e.g. local,fedavg")
    if (out / "comparison.csv").exists():
        raise EdgepflError(f"{out} already holds a comparison; choose another --out")
    configs = {}
    for name, hp in split_hyperparameters(base, algorithms).items():
        data = base.model_dump()
        data["algorithm"] = {"name": name, **hp}
        configs[name] = resolve(build_config(data))
    models = {name: cfg.model.name for name, cfg in configs.items()}
    if len(set(models.values())) > 1:
        echo("note: the algorithms run different models (" +
             ", ".join(f"{n}: {m}" for n, m in models.items()) +
             "); --set model.name=... gives them all the same one")
    rows, curves = [], {}
    for seed in seeds:
        cfg0 = configs[algorithms[0]]
        dataset = load_dataset(cfg0.dataset.name, cfg0.dataset.root, cfg0.dataset.fraction,
                               seed, cfg0.dataset.download)
        partition = make_partition(dataset.y_train, dataset.y_test, dataset.num_classes,
                                   cfg0.partition.scheme, cfg0.partition.clients, seed,
                                   alpha=cfg0.partition.alpha, min_size=cfg0.partition.min_size,
                                   classes_per_client=cfg0.partition.classes_per_client)
        for name in algorithms:
            cfg = build_config({**configs[name].model_dump(), "seed": seed})
            run_dir = out / f"{name}-seed{seed}"
            # the same command again: a finished run is read back, an interrupted one goes
            # on from its checkpoint; a changed configuration is refused
            data = {"dataset": dataset, "partition": partition}
            if (run_dir / "config.json").exists():
                result = resume_run(run_dir, cfg, progress=progress, **data)
            else:
                result = start_run(cfg, run_dir, progress=progress, **data)
            s = result.summary
            echo(f"{name:>10} seed {seed}: best {s['acc_mean_best']:.4f} (round {s['best_round']}), "
                 f"final {s['acc_mean_final']:.4f} ± {s['acc_std_final']:.4f}, "
                 f"up {s['bytes_up_total'] / 1e6:.2f} MB, down {s['bytes_down_total'] / 1e6:.2f} MB")
            rows.append({**{k: s.get(k) for k in COMPARISON_COLUMNS}, "model": cfg.model.name,
                         "run_dir": run_dir.name})
            curves.setdefault(name, []).append(
                [(r["round"], r["acc_mean"]) for r in result.metrics if not math.isnan(r["acc_mean"])])
    write_csv(out / "comparison.csv", COMPARISON_COLUMNS, rows)
    write_bytes_atomic(out / "comparison.md", comparison_markdown(rows, algorithms, base).encode())
    plot_data = {}
    for name, per_seed in curves.items():
        length = min(len(c) for c in per_seed)
        x = np.array([r for r, _ in per_seed[0][:length]])
        acc = np.array([[a for _, a in c[:length]] for c in per_seed])
        plot_data[name] = (x, acc.mean(0), acc.std(0))
    plot_curves(plot_data, out / "comparison.png",
                f"{base.dataset.name}, {base.partition.clients} clients, {base.partition.scheme}")
    return rows


def comparison_markdown(rows: list[dict], algorithms: list[str], base: Config) -> str:
    seeds = sorted({r["seed"] for r in rows})
    partial = base.train.participation < 1
    lines = [
        f"# Comparison on {base.dataset.name}",
        "",
        f"{base.partition.clients} clients, partition {base.partition.scheme} "
        f"(alpha {base.partition.alpha}), {base.train.rounds} rounds, participation "
        f"{base.train.participation}, seeds {', '.join(map(str, seeds))}. "
        f"{'Mean ± std over seeds' if len(seeds) > 1 else 'One seed, so no spread over seeds'}; "
        "accuracy is the unweighted mean over clients of each client's personalized model on "
        "its own test split. *Best* is the best round (the papers' protocol), *final* the last.",
        "*Each client's best* averages every client's own best round (KAPC Sec. 7.1's protocol "
        "for Local and FedAvg); with participation below 1, *selected* takes each round's mean "
        "over the clients selected in it (KAPC's client-selection scenario). The paper's "
        "protocols can only flatter; the first two columns are ours.",
        "",
        "| algorithm | model | best mean acc | final mean acc | final std across clients | "
        "final worst client | each client's best | " + ("best over selected | " if partial else "")
        + "MB up | MB down |",
        "|---|---|---|---|---|---|---|" + ("---|" if partial else "") + "---|---|",
    ]
    for name in algorithms:
        sel = [r for r in rows if r["algorithm"] == name]

        def cell(key, scale=100.0, digits=2, sel=sel):
            m, s = _mean_std([r[key] * scale if r[key] is not None else None for r in sel])
            # a spread over one seed would read as a measured zero
            return f"{m:.{digits}f}" + (f" ± {s:.{digits}f}" if len(sel) > 1 else "")

        selected = f"{cell('acc_mean_selected_best')} | " if partial else ""
        lines.append(f"| {name} | {sel[0]['model']} | {cell('acc_mean_best')} | {cell('acc_mean_final')} | "
                     f"{cell('acc_std_final')} | {cell('acc_min_final')} | "
                     f"{cell('acc_client_best_mean')} | {selected}"
                     f"{cell('bytes_up_total', 1e-6)} | {cell('bytes_down_total', 1e-6)} |")
    lines.append("")
    lines.append("Accuracies in %.")
    return "\n".join(lines) + "\n"
