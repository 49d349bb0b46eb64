"""PNG plots of comparisons and reports (run-directory plots live in ``edgepfl.plotting``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgepfl.plotting import band, percent_axis, plt, save_figure, with_setting


def plot_curves(curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], path: Path,
                title: str, xlabel: str = "round", setting: str = "") -> None:
    """One line per label: (x, mean, spread) of accuracy as a fraction, drawn in percent
    with a ±spread band (e.g. the sample standard deviation over seeds; NaN or 0: none)
    clipped to [0, 100]. ``setting`` (``plotting.setting_line``) goes under the title."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, (x, mean, spread) in curves.items():
        mean, spread = 100 * np.asarray(mean, dtype=float), 100 * np.asarray(spread, dtype=float)
        line = ax.plot(x, mean, marker="." if len(x) < 30 else None, label=label)
        if np.nan_to_num(spread).any():
            band(ax, x, mean, np.nan_to_num(spread), color=line[0].get_color(), alpha=0.15)
    percent_axis(ax, xlabel)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean test accuracy")
    ax.set_title(with_setting(title, setting), fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    save_figure(fig, path)


def seed_curves(per_seed: list[list[tuple[int, float]]]) -> tuple[np.ndarray, np.ndarray,
                                                                    np.ndarray]:
    """(rounds, mean, sample std) over the seeds' curves, up to the shortest one (a run
    that stopped early); the std is 0 with one seed."""
    length = min(len(c) for c in per_seed)
    x = np.array([r for r, _ in per_seed[0][:length]])
    acc = np.array([[a for _, a in c[:length]] for c in per_seed]).reshape(len(per_seed), length)
    spread = acc.std(0, ddof=1) if len(per_seed) > 1 else np.zeros(length)
    return x, acc.mean(0), spread
