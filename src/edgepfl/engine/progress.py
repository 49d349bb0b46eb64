"""Progress display: a live line on a terminal, silence otherwise (logs stay clean)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger("edgepfl")


class RoundProgress:
    def __init__(self, total: int, start: int, label: str, enabled: bool | None = None):
        if enabled is None:
            enabled = sys.stderr.isatty()
        self._progress = None
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False,
            )
            self._task = self._progress.add_task(label, total=total, completed=start, info="")
            self._progress.start()

    def update(self, rnd: int, row: dict) -> None:
        if self._progress is None:
            return
        acc = row.get("acc_mean")
        acc_txt = "acc   -  " if acc is None or acc != acc else f"acc {acc:6.2%}"
        mb = (row["bytes_up"] + row["bytes_down"]) / 1e6
        self._progress.update(self._task, completed=rnd,
                              info=f"{acc_txt}  {mb:8.2f} MB  {row['wall_s']:.2f}s/round")

    def stopped(self, stop: dict | None) -> None:
        """Say that the run ended before its last round (``Rounds.stopped``): on the live
        line, and in the log, which is all a run without a terminal shows."""
        if stop is None:
            return
        log.info("stopped early after round %d: %s", stop["round"], stop["reason"])
        if self._progress is not None:
            self._progress.update(self._task, total=stop["round"],
                                  info=f"stopped early: no gain since round {stop['best_round']}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


@contextmanager
def setting_up(label: str, enabled: bool | None = None) -> Iterator[None]:
    """A live "setting up" line on a terminal while a run is built: a large federation's
    set-up (data split, every client's initial state) takes a minute or more before the
    first round's line appears."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield
        return
    with Console(stderr=True).status(f"[bold]{label}[/bold]: setting up"):
        yield
