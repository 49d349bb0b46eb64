"""PNG plots of comparisons and reports (run-directory plots live in ``edgepfl.plotting``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgepfl.plotting import plt, save_figure


def plot_curves(curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], path: Path,
                title: str, xlabel: str = "round") -> None:
    """One line per label: (x, mean, std) with a +-std band (e.g. over seeds)."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for label, (x, mean, std) in curves.items():
        ax.plot(x, mean, label=label)
        if np.any(std > 0):
            ax.fill_between(x, mean - std, mean + std, alpha=0.15)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("mean test accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)
