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
    """(rounds, mean, sample std) over the seeds' curves, round by round over the seeds
    that reached the round (a run that stopped early leaves the later rounds to the
    others, rather than cutting every seed's curve to its length); the std is 0 where one
    seed reached the round."""
    by_round: dict[int, list[float]] = {}
    for curve in per_seed:
        for rnd, acc in curve:
            by_round.setdefault(rnd, []).append(acc)
    x = np.array(sorted(by_round))
    values = [np.array(by_round[r]) for r in x]
    mean = np.array([v.mean() for v in values])
    spread = np.array([v.std(ddof=1) if len(v) > 1 else 0.0 for v in values])
    return x, mean, spread
