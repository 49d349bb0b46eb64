"""Progress and logs: a live line on a terminal, one plain line per evaluated round where
the output is kept (a file, a pipe, a batch job's log), and the package's log set up once.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

log = logging.getLogger("edgepfl")
LOG_LEVELS = ("debug", "info", "warning", "error")


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Give the package's log one handler (once; a second call sets the level only): Rich's
    on a terminal, plain timestamped lines otherwise. A library user's own logging set-up
    is left alone: only the command line and the Flower apps call this."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    log.setLevel(level.upper())
    if any(getattr(h, "_edgepfl", False) for h in log.handlers):
        return
    stream = stream or sys.stderr
    if stream.isatty():
        from rich.logging import RichHandler
        handler: logging.Handler = RichHandler(console=Console(file=stream), show_path=False)
    else:
        handler = logging.StreamHandler(stream)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                               "%Y-%m-%d %H:%M:%S"))
    handler._edgepfl = True  # type: ignore[attr-defined]
    log.addHandler(handler)
    log.propagate = False


def kept_stream() -> TextIO | None:
    """Where per-round lines go when nobody watches a live line: standard output when it is
    redirected (``edgepfl run > log.txt``), else standard error when that is; None when
    both are a terminal."""
    for stream in (sys.stdout, sys.stderr):
        if not stream.isatty():
            return stream
    return None


class RoundProgress:
    """``enabled``: True, a live line on standard error; False, nothing; None, a live line
    if standard error is a terminal, and plain lines per evaluated round wherever output
    is kept (``kept_stream``)."""

    def __init__(self, total: int, start: int, label: str, enabled: bool | None = None):
        self.total, self.label, self.start = total, label, start
        self._progress = None
        self._lines = kept_stream() if enabled is None else None
        self._began = time.perf_counter()
        if enabled is None:
            enabled = sys.stderr.isatty()
        if enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False,
            )
            self._task = self._progress.add_task(label, total=total, completed=start, info="")
            self._progress.start()

    def update(self, rnd: int, row: dict, note: str = "") -> None:
        """Round ``rnd``'s line; ``note`` (e.g. that the round aggregated nothing) is
        added to it, and a round with a note gets a plain line even if not evaluated."""
        acc = row.get("acc_mean")
        if self._progress is not None:
            mb = (row["bytes_up"] + row["bytes_down"]) / 1e6
            acc_txt = "acc   -  " if acc is None or acc != acc else f"acc {acc:6.2%}"
            self._progress.update(self._task, completed=rnd,
                                  info=f"{acc_txt}  {mb:8.2f} MB  {row['wall_s']:.2f}s/round"
                                  + (f"  {note}" if note else ""))
        if self._lines is not None and (note or (acc is not None and not math.isnan(acc))):
            self._lines.write(self.line(rnd, row, note) + "\n")
            self._lines.flush()

    def line(self, rnd: int, row: dict, note: str = "") -> str:
        """One evaluated round as a plain line: accuracy and its worst client, the round's
        megabytes, seconds per round so far and the time the rounds left would take."""
        per_round = (time.perf_counter() - self._began) / max(rnd - self.start, 1)
        left = per_round * (self.total - rnd)
        worst = row.get("acc_min", math.nan)
        worst_txt = "" if worst != worst else f" (worst {worst:.2%})"
        mb = (row["bytes_up"] + row["bytes_down"]) / 1e6
        acc = row.get("acc_mean")
        acc_txt = "-" if acc is None or acc != acc else f"{acc:.2%}"
        return (f"{self.label}: round {rnd}/{self.total}  acc {acc_txt}{worst_txt}  "
                f"{mb:.2f} MB  {per_round:.2f} s/round  ~{_duration(left)} left"
                + (f"  [{note}]" if note else ""))

    def stopped(self, stop: dict | None) -> None:
        """Say that the run ended before its last round (``Rounds.stopped``): on the live
        line, and in the log, which is all a run without a terminal shows."""
        if stop is None:
            return
        if "best_round" in stop:  # a privacy budget's stop was logged where it was decided
            log.info("%s: stopped early after round %d: %s", self.label, stop["round"],
                     stop["reason"])
        if self._progress is not None:  # the reason is the log's: said once
            self._progress.update(self._task, total=stop["round"],
                                  info=f"stopped early after round {stop['round']}")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


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
