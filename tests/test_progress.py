"""Progress where nobody watches a live line, and the package's log."""

import io
import logging
import math

import pytest

from edgepfl.engine import progress
from edgepfl.engine.progress import RoundProgress, configure_logging


def _row(rnd, acc):
    return {"round": rnd, "acc_mean": acc, "acc_min": acc / 2, "bytes_up": 1_000_000,
            "bytes_down": 2_000_000, "wall_s": 0.5}


def test_kept_output_gets_one_line_per_evaluated_round(monkeypatch):
    out, err = io.StringIO(), io.StringIO()  # neither is a terminal
    monkeypatch.setattr(progress.sys, "stdout", out)
    monkeypatch.setattr(progress.sys, "stderr", err)
    bar = RoundProgress(4, 0, "fedavg on digits", None)
    for rnd, acc in [(1, math.nan), (2, 0.5), (3, math.nan), (4, 0.75)]:
        bar.update(rnd, _row(rnd, acc))
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and err.getvalue() == ""
    assert lines[0].startswith("fedavg on digits: round 2/4  acc 50.00% (worst 25.00%)  3.00 MB")
    assert lines[1].startswith("fedavg on digits: round 4/4  acc 75.00%")
    assert lines[1].endswith("~0 s left")


def test_no_lines_when_progress_is_off(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(progress.sys, "stdout", out)
    bar = RoundProgress(2, 0, "x", False)
    bar.update(1, _row(1, 0.5))
    assert out.getvalue() == ""


def test_the_log_gets_one_handler_whatever_the_number_of_calls():
    log = logging.getLogger("edgepfl")
    saved = list(log.handlers), log.level, log.propagate
    stream = io.StringIO()
    try:
        log.handlers = [h for h in log.handlers if not getattr(h, "_edgepfl", False)]
        configure_logging("warning", stream)
        configure_logging("info", stream)
        ours = [h for h in log.handlers if getattr(h, "_edgepfl", False)]
        assert len(ours) == 1 and log.level == logging.INFO
        log.info("resuming runs/x after round 3")
        assert stream.getvalue().rstrip().endswith("INFO edgepfl: resuming runs/x after round 3")
        with pytest.raises(ValueError, match="not one of"):
            configure_logging("loud", stream)
    finally:
        log.handlers, log.level, log.propagate = saved[0], saved[1], saved[2]
