"""Collect DC-PFL Table II runs (bench/papers/dcpfl_table2.sh) into one markdown table.

    python bench/papers/collect_table2.py runs/table2 > table.md
    python bench/papers/collect_table2.py bench/results/table2 runs/table2 > table.md

The paper reports, "when training converges", the final accuracy, the communication rounds,
the communication time and the total time (Table II). Its convergence point is not
defined; here it is the first round from which the mean accuracy stays within
``TOLERANCE`` of the run's final mean accuracy. Communication rounds count the rounds up
to that point in which a client uploaded model weights, the paper's definition (Sec. V-D:
"the round where clients transmit data to the server"; DC-PFL's rounds between two
aggregations of a layer are not communication rounds). DC-PFL still exchanges a few
hundred bytes of control data in those rounds (its mode, the layers due, a client's
loss), so for an algorithm that reports ``layers_up_mean`` a round counts when that is
above 0, for the others when any byte went up. Times are the simulated ones of the system
model (2 Mbit/s per client), summed over those rounds, each round taking its slowest
client's time (docs/system.md).

A method is held against DC-PFL on the seeds both have (a seed is another partition): the
ratio beside the total time, the ablations' "ours" and the second table, which gives each
seed's gap. Before 2026-11-30 those compared means over whatever seeds each row had.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grid"))  # grid_runs
from grid_runs import finished_runs  # noqa: E402

TOLERANCE = 0.01
# DC-PFL evaluates group models in aggregation rounds and locally trained ones in between, so
# its accuracy has a period of tau = 5 rounds; the mean over the last period does not depend
# on where in that period the run happens to stop
LAST = 5

# DC-PFL paper, Table II (FMNIST, "Low" heterogeneity; final accuracy, communication rounds,
# communication time s, total time s)
PAPER = {"local": (0.810, None, None, 114), "fedavg": (0.876, 79, 268, 506),
         "perfedavg": (0.890, 58, 197, 431), "clusterfl": (0.901, 61, 207, 391),
         "dcpfl": (0.925, 57, 73, 265)}
# Sec. V-C ablations on FMNIST, relative to the complete DC-PFL (accuracy in points, total
# training time as a fraction): NoDC (grouping fixed at gamma~ = 0.8) loses 6.2 points,
# NoLA (every layer every tau rounds) takes 49.7% longer at similar accuracy (given as 0).
ABLATION = {"dcpfl+fixed_gamma=0.8": (-0.062, None), "dcpfl+alpha=1": (0.0, 0.497)}


def converged_round(acc: list[float], tolerance: float = TOLERANCE) -> int:
    """Index (0-based) of the first round from which accuracy stays within tolerance of the last."""
    final = acc[-1]
    k = len(acc) - 1
    while k > 0 and abs(acc[k - 1] - final) <= tolerance:
        k -= 1
    return k


def uploaded_weights(row: dict) -> bool:
    """Whether a client uploaded model weights in this round (see the module's docstring)."""
    layers = row.get("layers_up_mean") or ""
    if layers:
        return float(layers) > 0
    return int(row["bytes_up"]) > 0


def one_run(run: Path) -> dict:
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    acc = [float(r["acc_mean"]) for r in rows]
    k = converged_round(acc)
    upto = rows[:k + 1]
    summary = json.loads((run / "summary.json").read_text())
    return {
        "seed": int(run.name.rsplit("-seed", 1)[1]), "rounds": summary["rounds"],
        "final": summary["acc_mean_final"], "best": summary["acc_mean_best"],
        "last": statistics.fmean(acc[-LAST:]),
        "worst": summary["acc_min_final"], "std": summary["acc_std_final"], "converged": k + 1,
        "comm_rounds": sum(1 for r in upto if uploaded_weights(r)),
        "comm_time": sum(float(r["t_down"]) + float(r["t_up"]) for r in upto),
        "total_time": sum(float(r["t_round"]) for r in upto),
        "mb": (summary["bytes_up_total"] + summary["bytes_down_total"]) / 1e6,
    }


def dcpfl_details(run: Path) -> str | None:
    """One line of what DC-PFL's two mechanisms did in a run: the splits (round: groups,
    purity of the grouping the split made), the rounds with a layer at the slow interval,
    and the run's bytes."""
    groups_file = run / "dcpfl_groups.json"
    if not groups_file.is_file():
        return None
    info = json.loads(groups_file.read_text())
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    low = [r for r in rows if float(r.get("layers_low") or 0) > 0]
    purity = info.get("purity") or []
    if not purity or "same_primary" not in purity[0]:  # written before 2026-11-29's fields
        from edgepfl.algorithms.dcpfl import group_purity

        history = [(g["round"], g["gamma_tilde"], g["labels"]) for g in info["groupings"]]
        purity = group_purity(history, run / "partition.json") or []
    splits = ", ".join(
        f"{p['from_round']}: {len(p['groups'])}"
        + ("" if p.get("same_primary") is None else f" ({100 * p['same_primary']:.0f}%)")
        for p in purity)
    if purity and purity[0].get("same_primary_chance") is not None:
        splits += f"; chance {100 * purity[0]['same_primary_chance']:.0f}%"
    summary = json.loads((run / "summary.json").read_text())
    mb = (summary["bytes_up_total"] + summary["bytes_down_total"]) / 1e6
    return (f"| {run.name} | {splits} | {len(low)} of {len(rows)} | "
            f"{max((float(r.get('layers_low') or 0) for r in rows), default=0):.0f} | {mb:.0f} |")


def mean(values: list[float]) -> float:
    return statistics.fmean(values)


def paired(runs: list[dict], comp: list[dict]) -> list[tuple[dict, dict]]:
    """A method's runs beside DC-PFL's on the seeds both have: a seed is another partition,
    so a gap taken over different seed sets mixes the method with the data."""
    by_seed = {r["seed"]: r for r in comp}
    return [(r, by_seed[r["seed"]]) for r in sorted(runs, key=lambda r: r["seed"])
            if r["seed"] in by_seed]


def paired_lines(folder: str, results: dict[str, list[dict]]) -> list[str]:
    comp = results.get("dcpfl")
    lines = []
    for name, runs in results.items():
        pairs = paired(runs, comp) if comp else []
        if name == "dcpfl" or not pairs:
            continue
        gaps = [100 * (r["final"] - c["final"]) for r, c in pairs]
        times = [r["total_time"] / c["total_time"] for r, c in pairs]
        lines.append(f"| {folder} | {name} | {', '.join(str(r['seed']) for r, _ in pairs)} | "
                     f"{', '.join(f'{g:+.2f}' for g in gaps)} | {mean(gaps):+.2f} | "
                     f"{', '.join(f'{t:.2f}' for t in times)} | {mean(times):.2f} |")
    return lines


def main(roots: list[Path]) -> None:
    print("| runs | method | seeds | rounds | final acc | ± seeds | last 5 rounds | best acc | final std | "
          "final worst | "
          "converged at "
          "| comm. rounds | comm. time (s) | total time (s) | MB up+down (whole run) | "
          "paper: final acc (%), comm. rounds, comm. time (s), total time (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    paired_rows: list[str] = []
    for folder, groups in finished_runs(roots).items():
        results = {name: [one_run(d) for d in dirs] for name, dirs in groups.items()}
        comp = results.get("dcpfl")
        for name, runs in results.items():
            rounds = runs[0]["rounds"]
            total = mean([r["total_time"] for r in runs])
            final = mean([r["final"] for r in runs])
            pairs = paired(runs, comp) if comp else []
            # against DC-PFL on the same seeds only (paired_lines spells the seeds out)
            time_ratio = (mean([r["total_time"] for r, _ in pairs])
                          / mean([c["total_time"] for _, c in pairs])) if pairs else None
            ratio = "" if time_ratio is None else f" (x {time_ratio:.2f})"
            paper = PAPER.get(name)
            ptxt = "" if paper is None else ", ".join(
                "-" if v is None else f"{100 * v:.1f}" if k == 0 else str(v)
                for k, v in enumerate(paper))
            if name in ABLATION:
                d_acc, d_time = ABLATION[name]
                ptxt = (f"vs DC-PFL: acc {100 * d_acc:+.1f} points, total time "
                        + ("-" if d_time is None else f"{d_time:+.1%}"))
                if time_ratio is not None:
                    ours_acc = mean([r["final"] - c["final"] for r, c in pairs])
                    ptxt += (f"; ours (seeds {', '.join(str(r['seed']) for r, _ in pairs)}): "
                             f"{100 * ours_acc:+.1f} points, total time {time_ratio - 1:+.1%}")
            print(f"| {folder} | {name} | {len(runs)} | {rounds} | "
                  f"{100 * final:.2f} | "
                  f"{100 * statistics.pstdev([r['final'] for r in runs]):.2f} | "
                  f"{100 * mean([r['last'] for r in runs]):.2f} | "
                  f"{100 * mean([r['best'] for r in runs]):.2f} | "
                  f"{100 * mean([r['std'] for r in runs]):.2f} | "
                  f"{100 * mean([r['worst'] for r in runs]):.2f} | "
                  f"{mean([r['converged'] for r in runs]):.0f} | "
                  f"{mean([r['comm_rounds'] for r in runs]):.0f} | "
                  f"{mean([r['comm_time'] for r in runs]):.0f} | {total:.0f}{ratio} | "
                  f"{mean([r['mb'] for r in runs]):.0f} | {ptxt} |")
        paired_rows += paired_lines(folder, results)
    if paired_rows:
        print("\n| runs | method | seeds shared with DC-PFL | final acc - DC-PFL's, per seed "
              "(points) | mean | total time / DC-PFL's, per seed | mean |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(paired_rows))
    details = [line for groups in finished_runs(roots).values() for name, dirs in groups.items()
               if name.startswith("dcpfl") for d in dirs if (line := dcpfl_details(d))]
    if details:
        print("\n| DC-PFL run | groupings (from round: groups (pairs in a group sharing a primary "
              "class)) | rounds with a layer at "
              "alpha*tau | most (group, layer) pairs at alpha*tau | MB up+down |")
        print("|---|---|---|---|---|")
        print("\n".join(details))


if __name__ == "__main__":
    main([Path(a) for a in sys.argv[1:]] or [Path("runs/table2")])
