"""Collect HMPL Table IV / V runs (bench/papers/hmpl_tables.sh) into one markdown table.

    python bench/papers/collect_hmpl.py runs/hmpl > table.md
    python bench/papers/collect_hmpl.py bench/results/hmpl runs/hmpl > table.md
    python bench/papers/collect_hmpl.py bench/results/hmpl --against hmpl_s

Several roots are merged by grid folder name (bench/grid/grid_runs.py). One row per (grid folder,
run name): rounds run (and where early stopping ended the run), best and final mean accuracy
(mean ± std over the seeds found), final std across clients and worst client, each HMPL
tier's mean final accuracy (Com / Ord / Sup), the aggregated Ord model's final accuracy over
every client's test split (hmpl's ``acc_global_weighted_final``, hmpl_s's and FedAvg's
own ``acc_weighted_final``: with the whole training set dealt IID, the clients' test splits are
the whole test set), MB uploaded in total and per tier, the final accuracy and MB up of
the clients on each device class (weak / ordinary / superior, for every method), and
the paper's accuracy for the same table, data set and method. The paper reports one accuracy
per method, as papers do the best round (our "best mean"); ours - paper is given only for
runs of the paper's protocol (60 clients, the whole data set). With ``--against NAME`` a last
column gives, seed by seed, the final mean accuracy minus that of the run NAME of the same
seed, in the same grid folder or else in the folder whose name this one's begins with (a
tagged grid, ``-allsup``, is set against its untagged one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grid"))  # grid_runs
from grid_runs import finished_runs, unnamed_settings  # noqa: E402

# Zhang et al., Table IV (arbitrary image sizes) and Table V (regular sizes), accuracy
PAPER = {
    ("arbitrary", "mnist"): {"hypcluster": 0.954, "fedper": 0.935, "perfedavg": 0.931,
                             "pfedme": 0.979, "hmpl_s": 0.982, "hmpl": 0.986},
    ("arbitrary", "fmnist"): {"fedmd": 0.803, "hypcluster": 0.851, "fedper": 0.762,
                              "perfedavg": 0.732, "pfedme": 0.878, "hmpl_s": 0.857,
                              "hmpl": 0.886},
    ("regular", "mnist"): {"fedavg": 0.978, "fedprox": 0.979, "l2sgd": 0.982, "hmpl_s": 0.983,
                           "hmpl": 0.987},
    ("regular", "fmnist"): {"fedavg": 0.879, "fedprox": 0.874, "l2sgd": 0.880, "hmpl_s": 0.876,
                            "hmpl": 0.889},
}
TIERS = ("com", "ord", "sup")
DEVICES = ("weak", "ordinary", "superior")  # system.devices=tiers, HMPL's device classes


def mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def pm(values: list[float | None], scale: float = 100) -> str:
    """Mean over seeds (in % by default), with the standard deviation across seeds when
    there are several; '-' when a seed lacks the figure."""
    if not values or any(v is None for v in values):
        return "-"
    digits = 2 if scale == 100 else 0 if all(float(v).is_integer() for v in values) else 1
    m = f"{scale * mean(values):.{digits}f}"
    return m + (f" ± {scale * statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def tier_final(run: Path, summary: dict) -> dict[str, float | None]:
    """Each tier's mean final accuracy: the summary's, else tiers.json's (runs from before
    the summary recorded it); {} for a method without tiers."""
    if "acc_mean_tier_final" in summary:
        return summary["acc_mean_tier_final"]
    path = run / "tiers.json"
    return json.loads(path.read_text()).get("acc_final_mean", {}) if path.exists() else {}


def by_device(run: Path, summary: dict) -> dict[str, tuple[float, float]]:
    """Per device class (system.json's ``tier``): the mean final accuracy of its clients
    and the bytes they uploaded in total; {} for a run without device classes. Every
    method's row has it, so the baselines' weak devices can be set against HMPL's Com
    clients on the same devices (HMPL ranks by round-1 time, so its tiers need not be the
    device classes one for one)."""
    clients = json.loads((run / "system.json").read_text()).get("clients", [])
    tier = [c.get("tier") for c in clients]
    acc, up = summary.get("acc_clients_final"), summary.get("bytes_up_per_client")
    if not tier or None in tier or acc is None or up is None or len(acc) != len(tier):
        return {}
    out = {}
    for d in DEVICES:
        members = [i for i, t in enumerate(tier) if t == d]
        if members:
            out[d] = (mean([acc[i] for i in members]), sum(up[i] for i in members))
    return out


# methods whose clients predict with the server's model itself
GLOBAL_ONLY = ("hmpl_s", "fedavg", "fedprox")


def aggregated(summary: dict, algo: str) -> float | None:
    """The server's aggregated model's final accuracy over all clients' test splits:
    ``acc_global_*`` where a method reports it beside its personal models (hmpl's Ord
    model, HeteroFL's full width); for a method whose clients predict with the server's
    model, their own accuracy is that figure."""
    if algo in GLOBAL_ONLY:
        return summary.get("acc_weighted_final")
    return summary.get("acc_global_weighted_final")


def rounds_run(sums: list[dict]) -> str:
    """Rounds of each seed, with 'stopped at' for runs that early stopping ended."""
    parts = []
    for s in sums:
        planned = s.get("rounds_planned", s["rounds"])
        parts.append(f"{s['rounds']}/{planned}" + (" (early)" if s.get("stopped_early") else ""))
    return ", ".join(parts)


def finals_by_seed(dirs: list[Path], sums: list[dict] | None = None) -> dict[int, float]:
    """{seed (config.json's, as grid_runs.runs_by_method reads it): final mean accuracy};
    ``sums``, the runs' summaries where already read."""
    sums = sums or [json.loads((d / "summary.json").read_text()) for d in dirs]
    return {int(json.loads((d / "config.json").read_text())["seed"]): s["acc_mean_final"]
            for d, s in zip(dirs, sums, strict=True)}


def against(grids: dict[str, dict[str, list[Path]]], folder: str, finals: dict[int, float],
            ref: str) -> str:
    """Seed by seed, ``finals`` (a row's final mean accuracy per seed) minus that of the run
    ``ref`` of the same seed (in ``folder``, else in the longest grid folder name ``folder``
    begins with); '-' for a seed without it."""
    homes = [folder] + sorted((g for g in grids if g != folder and folder.startswith(g)),
                              key=len, reverse=True)
    refs = next((finals_by_seed(grids[g][ref]) for g in homes if ref in grids[g]), {})
    return ", ".join(f"{100 * (acc - refs[seed]):+.2f}" if seed in refs else "-"
                     for seed, acc in finals.items())


def main(roots: list[Path], ref: str | None = None) -> None:
    print("| runs | table | algorithm | seeds | rounds run | best mean acc | final mean acc | "
          "final std | final worst | clients Com / Ord / Sup | final Com / Ord / Sup | "
          "final weak / ord. / sup. devices | "
          "Ord model, all test splits | MB up | MB up Com / Ord / Sup | "
          "MB up weak / ord. / sup. devices | paper | ours (best) - paper |"
          + (f" final - {ref}, by seed |" if ref else ""))
    print("|---" * (19 if ref else 18) + "|")
    grids = finished_runs(roots)
    for name, runs in grids.items():
        for label, dirs in runs.items():
            sums = [json.loads((d / "summary.json").read_text()) for d in dirs]
            cfg = json.loads((dirs[0] / "config.json").read_text())
            kind = "arbitrary" if cfg["dataset"].get("aspect_ratios") else "regular"
            table = "IV" if kind == "arbitrary" else "V"
            algo = cfg["algorithm"]["name"]
            paper = PAPER.get((kind, cfg["dataset"]["name"]), {}).get(algo)
            protocol = (cfg["partition"]["clients"], cfg["dataset"]["fraction"]) == (60, 1.0)
            tiers = [tier_final(d, s) for d, s in zip(dirs, sums, strict=True)]
            # the tiers the ranking gave: tier_ratio of every client only if all were timed
            counts = " / ".join(pm([s["tiers"][k] for s in sums], 1) for k in TIERS) \
                if all("tiers" in s for s in sums) else "-"
            per_tier = " / ".join(pm([t.get(k) for t in tiers]) for k in TIERS) \
                if all(tiers) else "-"
            mb = " / ".join(f"{mean([s[f'bytes_up_{k}_total'] for s in sums]) / 1e6:.1f}"
                            for k in TIERS) \
                if all(f"bytes_up_{k}_total" in s for s in sums for k in TIERS) else "-"
            dev = [by_device(d, s) for d, s in zip(dirs, sums, strict=True)]
            full = all(set(v) == set(DEVICES) for v in dev)
            dev_acc = " / ".join(pm([v[k][0] for v in dev]) for k in DEVICES) if full else "-"
            dev_mb = " / ".join(f"{mean([v[k][1] for v in dev]) / 1e6:.1f}"
                                for k in DEVICES) if full else "-"
            best = mean([s["acc_mean_best"] for s in sums])
            diff = f"{100 * (best - paper):+.2f}" if paper is not None and protocol else ""
            print(f"| {name} | {table} | {label}{unnamed_settings(cfg, label)} | {len(sums)} | "
                  f"{rounds_run(sums)} | "
                  f"{pm([s['acc_mean_best'] for s in sums])} | "
                  f"{pm([s['acc_mean_final'] for s in sums])} | "
                  f"{100 * mean([s['acc_std_final'] for s in sums]):.2f} | "
                  f"{100 * mean([s['acc_min_final'] for s in sums]):.2f} | {counts} | {per_tier} | "
                  f"{dev_acc} | {pm([aggregated(s, algo) for s in sums])} | "
                  f"{mean([s['bytes_up_total'] for s in sums]) / 1e6:.1f} | {mb} | {dev_mb} | "
                  f"{'' if paper is None else f'{100 * paper:.1f}'} | {diff} |"
                  + (f" {against(grids, name, finals_by_seed(dirs, sums), ref)} |" if ref else ""))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[Path("runs/hmpl")])
    parser.add_argument("--against", metavar="NAME",
                        help="add each seed's final mean accuracy minus run NAME's (hmpl_s)")
    args = parser.parse_args()
    main(args.roots, args.against)
