"""DC-PFL's artifacts about its groupings (``dcpfl_groups.json``'s purity, the group graph's
plot), written after a run from what the server and the engine recorded; kept apart from the
algorithm's server and client (``edgepfl.algorithms.dcpfl``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def group_purity(history: list[tuple[int, float, list[int]]], partition: Path) -> list[dict] | None:
    """For each grouping the run held (from its round to the next grouping's): each group's
    clients' primary classes (their most frequent training label, from the run's
    partition.json) and its purity, the share of its clients whose primary class is the
    group's most common one; ``purity`` is the client-weighted mean over the groups (with
    few large groups it is low even for a perfect clustering, so also:) ``same_primary``,
    the share of client pairs within a group that share their primary class, beside
    ``same_primary_chance``, that share over all pairs: above chance, the groups follow the
    primary classes. What a user reads to see whether the clustering found the data's
    structure; computed after the run from what the engine wrote, never by the server,
    which does not see labels. None when the run directory has no partition.json."""
    from edgepfl.io import read_json

    if not partition.is_file():
        return None
    counts = [c["train_class_counts"] for c in read_json(partition)["clients"]]
    primary = [int(np.argmax(c)) if sum(c) else -1 for c in counts]

    def same_share(members_of: list[list[int]]) -> float | None:
        same = total = 0
        for members in members_of:
            classes = [primary[c] for c in members]
            for a in range(len(classes)):
                for b in range(a + 1, len(classes)):
                    same += classes[a] == classes[b]
                    total += 1
        return same / total if total else None

    chance = same_share([list(range(len(primary)))])
    out = []
    for k, (rnd, gamma, labels) in enumerate(history):
        groups: dict[int, list[int]] = {}
        for cid, g in enumerate(labels):
            groups.setdefault(g, []).append(cid)
        rows, pure = [], 0
        for members in groups.values():
            classes = [primary[c] for c in members]
            top = max(classes.count(x) for x in set(classes))
            pure += top
            rows.append({"clients": members, "primary_classes": classes, "purity": top / len(members)})
        out.append({"from_round": rnd, "until_round": history[k + 1][0] if k + 1 < len(history) else None,
                    "gamma_tilde": gamma, "purity": pure / max(1, len(labels)),
                    "same_primary": same_share(list(groups.values())),
                    "same_primary_chance": chance, "groups": rows})
    return out


def plot_group_graph(z: np.ndarray, gamma_global: float, cuts: list[float], path: Path) -> None:
    """Dendrogram on the normalised axis gamma~ with the cuts the run took."""
    from scipy.cluster.hierarchy import dendrogram

    from edgepfl.plotting import plt, save_figure

    zz = z.copy()
    if gamma_global > 0:
        zz[:, 2] /= gamma_global
    fig, ax = plt.subplots(figsize=(7, 4))
    dendrogram(zz, ax=ax, color_threshold=0)
    for g in cuts:
        ax.axhline(g, color="tab:red", linestyle="--", linewidth=1)
        ax.text(ax.get_xlim()[1], g, f" {g:.2f}", va="center", color="tab:red", fontsize=8)
    ax.set_xlabel("client")
    ax.set_ylabel("normalised threshold gamma~")
    ax.set_title("DC-PFL hierarchical group graph and chosen cuts")
    save_figure(fig, path)
