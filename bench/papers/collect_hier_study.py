"""Collect the study on edges that mean something (bench/papers/hier_study.sh) into tables.

    python bench/papers/collect_hier_study.py runs/hier_study [more roots] > tables.md

For every data set, K and edge assignment (the split's own edges, or random ones over the
same split and clients): the last round's personalized accuracy of hierbayes through the
edge posterior (as trained) and under psi*, the cloud prior (re-scored,
ROOT/reevaluated.jsonl), their difference seed by seed, HierFAVG (its global model, and
fine-tuned at test time), FedAvg fine-tuned and Local; mean ± std over seeds. How much the
edges mean: each client's label distribution's total-variation distance to its own edge's
pooled distribution against the whole federation's (from partition.json and
federation.json). A second table gives hierbayes' best round, spread, worst client, psi*
and the learned precisions.
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collect_hier import pm  # noqa: E402


def edge_distances(run: Path) -> tuple[float, float]:
    """Mean over clients of TV(client, its edge's clients pooled) and TV(client, all pooled)."""
    part = json.loads((run / "partition.json").read_text())
    fed = json.loads((run / "federation.json").read_text())
    counts = np.array([c["train_class_counts"] for c in part["clients"]], dtype=float)
    parent = np.array([c["parent"] for c in fed["clients"]])
    share = counts / counts.sum(axis=1, keepdims=True)
    pooled = counts.sum(axis=0) / counts.sum()
    own, whole = [], []
    for i in range(len(counts)):
        edge = counts[parent == parent[i]].sum(axis=0)
        own.append(0.5 * np.abs(share[i] - edge / edge.sum()).sum())
        whole.append(0.5 * np.abs(share[i] - pooled).sum())
    return float(np.mean(own)), float(np.mean(whole))


def rescored(roots: list[Path]) -> dict[str, dict]:
    """Run directory name (relative to its root's parent) -> re-scored figures, the last
    line for each run and protocol."""
    out: dict[str, dict] = {}
    for root in roots:
        path = root / "reevaluated.jsonl"
        if path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    key = "/".join(Path(r["run"]).parts[-2:]) + "|" + " ".join(r["settings"])
                    out[key] = r["reevaluated"]
    return out


def main(roots: list[Path]) -> None:
    again = rescored(roots)
    # (data set, K, assignment) -> column -> seed -> value
    cells: dict[tuple[str, int, str], dict[str, dict[int, float]]] = defaultdict(
        lambda: defaultdict(dict))
    details: dict[tuple[str, int, str], list[dict]] = defaultdict(list)
    for root in roots:
        for run in sorted(root.glob("*-hier-K*/*-seed*")):
            if not (run / "summary.json").is_file():
                continue
            ds, k = re.match(r"(\w+)-hier-K(\d+)", run.parent.name).groups()
            seed = int(re.search(r"-seed(\d+)$", run.name)[1])
            s = json.loads((run / "summary.json").read_text())
            key = f"{run.parent.name}/{run.name}|"
            method = run.name.split("+")[0]
            assignment = "random" if "assignment=random" in run.name else "split's"
            if "weighting=samples" in run.name:
                assignment += ", weighting=samples"
            targets = [assignment] if method.startswith("hier") else ["split's", "random"]
            for a in targets:
                cell = cells[(ds, int(k), a)]
                if method == "hierbayes":
                    cell["edge posterior"][seed] = s["acc_mean_final"]
                    cloud = again.get(key + "algorithm.personalize=cloud")
                    if cloud:
                        cell["psi* (cloud)"][seed] = cloud["acc_mean"]
                        cell["edge - cloud"][seed] = s["acc_mean_final"] - cloud["acc_mean"]
                    own, whole = edge_distances(run)
                    cell["TV own edge"][seed], cell["TV federation"][seed] = own, whole
                    details[(ds, int(k), a)].append(s)
                elif method == "hierfavg":
                    cell["HierFAVG"][seed] = s["acc_mean_final"]
                    tuned = again.get(key + "algorithm.evaluate=finetune")
                    if tuned:
                        cell["HierFAVG fine-tuned"][seed] = tuned["acc_mean"]
                elif method == "fedavg":
                    tuned = again.get(key + "algorithm.evaluate=finetune")
                    if tuned:
                        cell["FedAvg fine-tuned"][seed] = tuned["acc_mean"]
                elif method == "local":
                    cell["Local"][seed] = s["acc_mean_final"]
    columns = ["edge posterior", "psi* (cloud)", "edge - cloud", "HierFAVG",
               "HierFAVG fine-tuned", "FedAvg fine-tuned", "Local"]
    print("| data | K | edges | seeds | hierbayes, edge posterior | hierbayes, psi* | "
          "edge - psi* | HierFAVG | HierFAVG fine-tuned | FedAvg fine-tuned | Local | "
          "TV to own edge / federation |")
    print("|" + "---|" * 12)
    for (ds, k, a) in sorted(cells, key=lambda c: (c[0], c[1], c[2].startswith("random"), c[2])):
        cell = cells[(ds, k, a)]
        seeds = len(cell["edge posterior"])
        row = [pm(list(cell[c].values())) for c in columns]
        tv = (f"{pm(list(cell['TV own edge'].values()), 1, 2)} / "
              f"{pm(list(cell['TV federation'].values()), 1, 2)}")
        print(f"| {ds} | {k} | {a} | {seeds} | " + " | ".join(row) + f" | {tv} |")
    print()
    print("Final round (20), personalized accuracy in %, mean ± std over seeds; 'edge - psi*' "
          "is the seed-by-seed difference. FedAvg and Local do not depend on the edges: the "
          "same runs appear in both rows of a K.")
    print()
    print("| data | K | edges | seeds | best acc | final acc | final std across clients | "
          "final worst | psi* final | hier_client_precision | hier_edge_precision |")
    print("|" + "---|" * 11)
    for (ds, k, a) in sorted(details, key=lambda c: (c[0], c[1], c[2].startswith("random"), c[2])):
        s = details[(ds, k, a)]

        def col(name, scale=100.0, digits=2, s=s):
            return pm([x.get(name) for x in s], scale, digits)

        print(f"| {ds} | {k} | {a} | {len(s)} | {col('acc_mean_best')} | "
              f"{col('acc_mean_final')} | {col('acc_std_final')} | {col('acc_min_final')} | "
              f"{col('acc_psi_mean_final')} | {col('hier_client_precision', 1, 1)} | "
              f"{col('hier_edge_precision', 1, 1)} |")


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]] or [Path("runs/hier_study")])
