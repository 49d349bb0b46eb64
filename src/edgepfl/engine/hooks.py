"""The side work of a run: what is called after each round, at the end and on the way out.

A module of its own so that every kind of side work (the run directory's files in
``engine.rundir``, the experiment trackers in ``engine.trackers``, the thread count in
``engine.threads``) builds on it without importing the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from edgepfl.engine.rounds import Rounds


class Hook:
    """Side work of a run, called by ``drive``: ``after_round`` with the round's metrics
    row once the round is complete, ``after_run`` once the last round is done (not when
    the run fails), ``close`` always, last. ``run_rounds`` adds ``after_summary``."""

    def after_round(self, rounds: Rounds, row: dict) -> None:
        return None

    def after_run(self, rounds: Rounds) -> None:
        return None

    def close(self) -> None:
        return None

    def after_summary(self, summary: dict, out: Path | None) -> None:
        """Called by ``run_rounds`` after ``close``, once the run is done and its finished
        files are written (summary.json, the plots; ``out``: the run directory, if any),
        with the summary; not when the run or writing those files fails."""
        return None
