"""HMPL's tier-ratio study (Zhang et al., Sec. IV-E, Figs. 8-9) from finished runs.

    python bench/papers/hmpl_tier_grid.py bench/results/hmpl [runs/hmpl ...]

Every finished ``hmpl`` run under the roots whose tiers were ranked over all clients
(``algorithm.first_round = all``; runs from before the setting ranked round 1's sample
only and are left out, with a note) is grouped by (data set, image sizes, rounds,
``algorithm.generation``, ``algorithm.rank_by``, ``train.lr_decay_rounds``,
``algorithm.tier_ratio``; runs from before the middle three were ``random``, ``round``
and the run's rounds), whatever grid folder it sits in, so that the default 3:4:3 cell
of the tables and a tagged grid cell of the same ratio are seeds of one cell. The paper's
grid is Com 10-50% by Ord 40-60% (Sup the rest); other ratios found are listed too.

Printed per (data set, image sizes, rounds): two Com x Ord matrices, the clients' mean
accuracy at its best round (the tables' "best mean") and the aggregated Ord model's final
accuracy over every client's test split (Fig. 9's "global model"), each the mean over the
seeds; then one row per ratio with the spread over seeds, each tier's final accuracy, the
tier sizes and the bytes up.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "grid"))  # grid_runs
from collect_hmpl import mean, pm, tier_final  # noqa: E402
from grid_runs import finished_runs, settings  # noqa: E402

COM = (0.1, 0.2, 0.3, 0.4, 0.5)  # the paper's grid (Sec. IV-E)
ORD = (0.4, 0.5, 0.6)


def cells(roots: list[Path]) -> tuple[dict, int]:
    """{(data set, image sizes, rounds, generation, rank_by, decay horizon): {tier_ratio:
    [(run, summary), ...]}} and the
    number of hmpl runs left out because they ranked round 1's sample only."""
    out: dict = {}
    skipped = 0
    for runs in finished_runs(roots).values():
        for dirs in runs.values():
            for run in dirs:
                cfg = settings(run)
                algo = cfg["algorithm"]
                if algo["name"] != "hmpl":
                    continue
                if algo.get("first_round") != "all":
                    skipped += 1
                    continue
                summary = json.loads((run / "summary.json").read_text())
                sizes = "arbitrary" if cfg["dataset"]["aspect_ratios"] else "regular"
                rounds = summary.get("rounds_planned", summary["rounds"])
                # runs of other generations, rankings or rate schedules are no seeds of a cell
                key = (cfg["dataset"]["name"], sizes, rounds, algo["generation"],
                       algo["rank_by"], cfg["train"].get("lr_decay_rounds") or rounds)
                ratio = tuple(round(float(r), 2) for r in algo["tier_ratio"])
                out.setdefault(key, {}).setdefault(ratio, []).append((run, summary))
    return out, skipped


def mean_pct(values: list[float | None]) -> str:
    values = [v for v in values if v is not None]
    return f"{100 * mean(values):.2f}" if values else "-"


def matrix(grid: dict, figure) -> list[str]:
    lines = ["| Com \\ Ord | " + " | ".join(f"{o:.0%}" for o in ORD) + " |",
             "|---|" + "---|" * len(ORD)]
    for c in COM:
        row = []
        for o in ORD:
            found = next((v for k, v in grid.items()
                          if abs(k[0] - c) < 1e-6 and abs(k[1] - o) < 1e-6), None)
            row.append("" if found is None else
                       f"{mean_pct([figure(s) for _, s in found])} ({len(found)})")
        lines.append(f"| {c:.0%} | " + " | ".join(row) + " |")
    return lines


def main(roots: list[Path]) -> None:
    found, skipped = cells(roots)
    for (dataset, sizes, rounds, generation, rank_by, horizon), grid in sorted(found.items()):
        print(f"### {dataset}, {sizes} image sizes, {rounds} rounds (generation = {generation}, "
              f"rank_by = {rank_by}, rate decay over {horizon} rounds)\n")
        print("Clients' mean accuracy, best round (mean over seeds; seeds in brackets):\n")
        print("\n".join(matrix(grid, lambda s: s["acc_mean_best"])) + "\n")
        print("Aggregated Ord model, final, all clients' test splits (Fig. 9's global "
              "model):\n")
        print("\n".join(matrix(grid, lambda s: s.get("acc_global_weighted_final"))) + "\n")
        print("| tier_ratio (Com / Ord / Sup) | seeds | best mean acc | final mean acc | "
              "final worst client | final Com / Ord / Sup | aggregated Ord model | "
              "clients Com / Ord / Sup | MB up |")
        print("|---|---|---|---|---|---|---|---|---|")
        for ratio, runs in sorted(grid.items()):
            sums = [s for _, s in runs]
            tiers = [tier_final(r, s) for r, s in runs]
            per_tier = " / ".join(mean_pct([t.get(k) for t in tiers]) for k in
                                  ("com", "ord", "sup"))
            sizes_ = {tuple(s["tiers"].get(k, 0) for k in ("com", "ord", "sup")) for s in sums}
            print(f"| {' / '.join(f'{r:g}' for r in ratio)} | {len(runs)} | "
                  f"{pm([s['acc_mean_best'] for s in sums])} | "
                  f"{pm([s['acc_mean_final'] for s in sums])} | "
                  f"{pm([s['acc_min_final'] for s in sums])} | {per_tier} | "
                  f"{pm([s.get('acc_global_weighted_final') for s in sums])} | "
                  f"{', '.join(' / '.join(map(str, t)) for t in sorted(sizes_))} | "
                  f"{statistics.fmean(s['bytes_up_total'] for s in sums) / 1e6:.1f} |")
        print()
    if skipped:
        print(f"({skipped} hmpl runs ranked round 1's sample only, first_round = sampled: "
              "their tiers are not tier_ratio of all clients, left out)")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main([Path(p) for p in sys.argv[1:]])
