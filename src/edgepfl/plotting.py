"""PNG figures without a display (matplotlib's Agg backend), written atomically.

Below the runtimes and algorithms on purpose: an algorithm's artifacts (KAPC's relation
heatmap, DC-PFL's groups) and the run directory's own plots use it without importing the
report layer.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from edgepfl.io import write_bytes_atomic  # noqa: E402


def save_figure(fig, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    write_bytes_atomic(Path(path), buf.getvalue())


def _evaluated(metrics: Sequence[dict]) -> list[dict]:
    return [r for r in metrics if not math.isnan(_number(r.get("acc_mean")))]


def partition_words(partition: Mapping) -> str:
    """A partition's scheme with the skew that belongs to it, for a table's header:
    "dirichlet (alpha 0.3)", "pathological (2 classes per client)", "natural"."""
    scheme = partition.get("scheme")
    skew = {"dirichlet": ("alpha", "alpha {}"),
            "pathological": ("classes_per_client", "{} classes per client")}
    key, text = skew.get(scheme, (None, ""))  # type: ignore[arg-type]
    value = partition.get(key) if key else None
    return f"{scheme} ({text.format(value)})" if value is not None else str(scheme)


def setting_line(config: Mapping | None, skip: Sequence[str] = ()) -> str:
    """What a figure's curves were run on, from a configuration (``Config.model_dump()`` or
    a run's config.json): data set, clients, partition with its skew, rounds. ``skip``
    leaves out settings that vary between the curves (a sweep's grid keys). "" without one."""
    if not isinstance(config, Mapping):
        return ""

    def get(dotted: str):
        node: Any = config
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        return None if dotted in skip else node

    parts = [str(v) for v in [get("dataset.name")] if v is not None]
    if get("partition.clients") is not None:
        parts.append(f"{get('partition.clients')} clients")
    scheme = get("partition.scheme")
    if scheme is not None:
        # the skew is what makes a partition hard, so it belongs beside the scheme's name
        skew = {"dirichlet": ("partition.alpha", "α = {}"),
                "pathological": ("partition.classes_per_client", "{} classes per client")}
        key, text = skew.get(scheme, (None, ""))
        value = get(key) if key else None
        parts.append(f"{scheme} {text.format(value)}" if value is not None else str(scheme))
    if get("train.rounds") is not None:
        parts.append(f"{get('train.rounds')} rounds")
    return ", ".join(parts)


def _run_config(path: Path) -> dict | None:
    """The configuration of the run directory a figure is drawn into (its config.json,
    written when the run starts), else None."""
    import json

    try:
        data = json.loads((Path(path).parent / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def with_setting(title: str, setting: str) -> str:
    return f"{title}\n{setting}" if setting else title


def percent_axis(ax, xlabel: str | None = "round") -> None:
    """Ticks in percent on an accuracy axis whose values are percent (as the terminal
    prints accuracy) and, against rounds, whole-number ticks (there is no round 2.5)."""
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(xmax=100))
    if xlabel == "round":
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))


def band(ax, x, mean, spread, color=None, alpha: float = 0.2, label: str | None = None) -> None:
    """A ±spread band around ``mean`` (percent), clipped to [0, 100]: an accuracy outside it
    cannot happen, the band's symmetry notwithstanding."""
    low = np.clip(np.asarray(mean) - np.asarray(spread), 0.0, 100.0)
    high = np.clip(np.asarray(mean) + np.asarray(spread), 0.0, 100.0)
    ax.fill_between(x, low, high, alpha=alpha, color=color, label=label, linewidth=0)


def plot_accuracy(metrics: Sequence[dict], path: Path, title: str,
                  setting: str | None = None) -> None:
    """Mean accuracy per round with the +-std band and the worst client, in percent.
    ``setting`` goes under the title; None reads it from the config.json of the run
    directory the figure goes into (the engine passes a title only)."""
    rows = _evaluated(metrics)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    if rows:
        r = np.array([row["round"] for row in rows])
        mean = 100 * np.array([_number(row["acc_mean"]) for row in rows])
        std = 100 * np.array([_number(row.get("acc_std")) for row in rows])
        line = ax.plot(r, mean, marker="." if len(rows) < 30 else None, label="mean over clients")
        if not np.isnan(std).all():
            band(ax, r, mean, np.nan_to_num(std), color=line[0].get_color(), label="± std")
        ax.plot(r, 100 * np.array([_number(row.get("acc_min")) for row in rows]), "--", lw=1,
                label="worst client")
    percent_axis(ax)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (each client, own test split)")
    if setting is None:
        setting = setting_line(_run_config(path))
    ax.set_title(with_setting(title, setting), fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="lower right")
    save_figure(fig, path)


def plot_accuracy_series(metrics: Sequence[dict], series: dict[str, str], path: Path,
                         title: str, dashed: Sequence[str] = (),
                         setting: str | None = None) -> None:
    """One line per label: the metrics column it names over the evaluated rounds, in
    percent; a round where a column is missing or NaN (a tier without clients yet) leaves
    a gap. Labels in ``dashed`` are drawn dashed (a reference beside the others).
    ``setting`` as in ``plot_accuracy``."""
    rows = _evaluated(metrics)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    r = np.array([row["round"] for row in rows])
    for label, column in series.items():
        values = 100 * np.array([_number(row.get(column)) for row in rows], dtype=float)
        if rows and not np.isnan(values).all():
            ax.plot(r, values, "--" if label in dashed else "-", lw=1 if label in dashed else 1.5,
                    marker="." if len(rows) < 30 else None, label=label)
    percent_axis(ax)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (mean over clients)")
    if setting is None:
        setting = setting_line(_run_config(path))
    ax.set_title(with_setting(title, setting), fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="lower right", fontsize=8)
    save_figure(fig, path)


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):  # "" in a metrics.csv read back: not recorded
        return math.nan


BARS_UP_TO = 200  # clients drawn as stacked bars; more as a heatmap


def _client_ticks(ax, order: np.ndarray, names: Sequence[str] | None) -> bool:
    """Whole clients on the x axis (never 2.5), each tick the id of the client drawn there
    (``order``), or its name where the data names its clients (up to ``NAMED_UP_TO``)."""
    n = order.size
    if names is not None and len(names) == n and n <= NAMED_UP_TO:
        ax.set_xticks(range(n), [str(names[i]) for i in order], rotation=90, fontsize=6)
        return True
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(
        lambda x, _: str(int(order[round(x)])) if 0 <= round(x) < n else ""))
    return False


NAMED_UP_TO = 40  # clients named on the partition plot's axis; more are numbered


def plot_partition(counts: np.ndarray, path: Path, classes: Sequence[str] | None = None,
                   edges: Sequence[int] | None = None,
                   names: Sequence[str] | None = None) -> None:
    """Stacked bar per client of its train samples per class; past ``BARS_UP_TO`` clients
    a heatmap of each client's class shares (one image, not n x c bar patches, whose
    drawing would cost more than the run). ``edges``, each client's edge server: clients
    drawn edge by edge, each edge's block marked and named. ``names``: each client's name
    (a data set with its own clients), shown in place of its number."""
    n, c = counts.shape
    order = np.arange(n)
    if edges is not None and len(edges) == n and min(edges, default=-1) >= 0:
        order = np.argsort(np.asarray(edges), kind="stable")
        counts = counts[order]
    if n > BARS_UP_TO:
        fig, ax = plt.subplots(figsize=(10, 3.6))
        totals = counts.sum(axis=1, keepdims=True)
        shares = np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)
        image = ax.imshow(shares.T, aspect="auto", interpolation="nearest", cmap="viridis",
                          extent=(-0.5, n - 0.5, c - 0.5, -0.5))
        fig.colorbar(image, ax=ax, label="share of the client's train samples")
        ax.set_xlabel(f"client ({n} clients)")
        ax.set_ylabel("class")
        if classes is not None and c <= 20:
            ax.set_yticks(range(c), [str(k) for k in classes[:c]], fontsize=6)
        ax.set_title("per-client class distribution")
        _mark_edges(ax, edges, order, named=_client_ticks(ax, order, names))
        save_figure(fig, path)
        return
    fig, ax = plt.subplots(figsize=(max(5, min(16, 0.25 * n + 3)), 3.6))
    bottom = np.zeros(n)
    cmap = plt.get_cmap("tab20" if c > 10 else "tab10")
    for k in range(c):
        label = classes[k] if classes is not None and k < len(classes) and c <= 20 else None
        ax.bar(np.arange(n), counts[:, k], bottom=bottom, color=cmap(k % cmap.N), label=label, width=0.85)
        bottom += counts[:, k]
    ax.set_xlabel("client")
    ax.set_ylabel("train samples")
    ax.set_title("per-client class distribution")
    if c <= 20:
        ax.legend(fontsize=6, ncol=2, bbox_to_anchor=(1.01, 1), loc="upper left")
    _mark_edges(ax, edges, order, named=_client_ticks(ax, order, names))
    save_figure(fig, path)


def _mark_edges(ax, edges: Sequence[int] | None, order: np.ndarray, named: bool = False) -> None:
    """Lines between the edges' blocks of clients (drawn in ``order``), each edge named
    above its block, and the clients' own ids on the axis."""
    if edges is None or len(edges) != order.size or min(edges, default=-1) < 0:
        return
    sorted_edges = np.asarray(edges)[order]
    bounds = np.flatnonzero(np.diff(sorted_edges)) + 0.5
    for x in bounds:
        ax.axvline(x, color="black", linewidth=0.8)
    starts = np.concatenate(([-0.5], bounds))
    ends = np.concatenate((bounds, [order.size - 0.5]))
    for k, lo, hi in zip(sorted_edges[np.concatenate(([0], (bounds + 0.5).astype(int)))],
                         starts, ends, strict=True):
        ax.text((lo + hi) / 2, 1.0, f"edge {int(k)}", transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=7)
    ax.set_title(ax.get_title(), pad=14)  # room for the edges' names
    if order.size <= 60 and not named:
        ax.set_xticks(range(order.size), [str(int(i)) for i in order], fontsize=5)
    ax.set_xlabel("client (by edge)")
