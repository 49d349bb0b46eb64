"""What runs cost: KAPC Tables 5-6 style tables and accuracy-vs-cost plots from run dirs.

Everything is read back from the files a run leaves (``summary.json``, ``metrics.csv``),
so runs made at different times, or by different versions, can be set side by side; a
figure a run does not have is shown as ``n/a`` rather than guessed.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from edgepfl.errors import EdgepflError
from edgepfl.io import read_json
from edgepfl.system.cost import TOTAL_KEYS

NA = "n/a"


@dataclass
class RunRecord:
    path: Path
    label: str
    summary: dict
    rows: list[dict[str, float]]
    config: dict = field(default_factory=dict)  # config.json; {} where the run has none

    @property
    def rounds(self) -> int:
        rounds = self.summary.get("rounds")
        return int(rounds) if isinstance(rounds, int) and rounds > 0 else len(self.rows)

    def column(self, name: str) -> list[float]:
        return [r.get(name, math.nan) for r in self.rows]

    def total(self, key: str, summary_key: str) -> float:
        """The summary's total, else the sum of the per-round column, else NaN."""
        value = self.summary.get(summary_key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if self.rows and key in self.rows[0]:
            return float(sum(self.column(key)))
        return math.nan

    def per_round(self, key: str, summary_key: str) -> float:
        return self.total(key, summary_key) / self.rounds if self.rounds else math.nan


def _client_link(run: RunRecord, direction: str) -> float:
    """MB a round on the client links; a run from before the split, all links."""
    value = run.per_round(f"bytes_{direction}_client", f"bytes_{direction}_client_total")
    return value if math.isfinite(value) else run.per_round(f"bytes_{direction}",
                                                            f"bytes_{direction}_total")


def _number(text: str | None) -> float:
    if text is None or text.strip() == "":
        return math.nan
    try:
        return float(text)
    except ValueError:
        return math.nan


def load_run(path: Path) -> RunRecord:
    """A run directory's summary and per-round metrics (EdgepflError naming what is wrong)."""
    path = Path(path)
    if not path.is_dir():
        raise EdgepflError(f"run directory {str(path)!r} does not exist or is not a directory")
    if not (path / "summary.json").is_file():
        raise EdgepflError(f"{str(path)!r} has no summary.json: not a finished edgepfl run "
                           "(an unfinished one can be completed with --resume)")
    summary = read_json(path / "summary.json")
    if not isinstance(summary, dict):
        raise EdgepflError(f"{path / 'summary.json'} does not hold a JSON object")
    try:
        with open(path / "metrics.csv", newline="") as f:
            reader = csv.DictReader(f)
            rows = [{k: _number(v) for k, v in row.items() if k is not None} for row in reader]
            columns = reader.fieldnames or []
    except FileNotFoundError:
        raise EdgepflError(f"{str(path)!r} has no metrics.csv: "
                           "not an edgepfl run directory") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise EdgepflError(f"{path / 'metrics.csv'} is not readable CSV: {exc}") from None
    missing = [c for c in ("round", "acc_mean", "bytes_up", "bytes_down") if c not in columns]
    if missing:
        raise EdgepflError(f"{path / 'metrics.csv'} lacks the columns {missing}; it has {columns}")
    try:
        config = read_json(path / "config.json")
    except EdgepflError:  # only a plot's title reads it: no reason to refuse the run
        config = {}
    return RunRecord(path, path.name, summary, rows, config if isinstance(config, dict) else {})


def load_runs(run_dirs: list[Path]) -> list[RunRecord]:
    if not run_dirs:
        raise EdgepflError("no run directories given; pass one or more RUN_DIR")
    runs = [load_run(Path(p)) for p in run_dirs]
    names = [r.label for r in runs]
    for run in runs:  # same directory name in different places: show the paths instead
        if names.count(run.label) > 1:
            run.label = str(run.path)
    return runs


def _fmt(value: float, digits: int = 2) -> str:
    return NA if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _share(part: float, whole: float) -> str:
    if not math.isfinite(part):
        return NA
    if not math.isfinite(whole) or whole <= 0:
        return _fmt(part)
    return f"{part:.2f} ({100 * part / whole:.1f}%)"


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def report_table(run_dirs: list[Path]) -> str:
    """Markdown: time per round split as in KAPC Table 5, bytes and FLOPs per round as in
    Table 6, then accuracy, run totals and memory."""
    runs = load_runs(run_dirs)
    # a hierarchy's columns (backhaul time, edge work, edge <-> cloud bytes), when any run has one
    tiered = any(run.summary.get("edges") for run in runs)
    # the wait for replies past faults.deadline, when any run waited: else the shares of a
    # round with a deadline would not add up to its time
    waited = any(run.summary.get("t_wait_total") for run in runs)
    lines = ["# System cost of the runs", "",
             "Per-round figures are a run's totals divided by its rounds. Times are simulated "
             "seconds of a synchronous round on the run's edge network (docs/system.md); the "
             "percentages are shares of the round time. MB = 10^6 bytes; GFLOPs = 10^9 FLOPs "
             "counted by torch FlopCounterMode (matrix products and convolutions).", "",
             *_time_table(runs, tiered, waited), "",
             *_traffic_table(runs, tiered), "",
             *_totals_table(runs)]
    return "\n".join(lines) + "\n"


def _per_round(run: RunRecord, col: str) -> float:
    return run.per_round(col, TOTAL_KEYS[col])


def _time_table(runs: list[RunRecord], tiered: bool, waited: bool) -> list[str]:
    lines = ["## Time per round (s)", "",
             _row(["run", "algorithm", "time", "U-comm", "D-comm", "client", "server"]
                  + (["backhaul", "edge"] if tiered else []) + (["wait"] if waited else [])),
             _row(["---"] * (7 + 2 * tiered + waited))]
    for run in runs:
        t = _per_round(run, "t_round")
        lines.append(_row([run.label, str(run.summary.get("algorithm", NA)), _fmt(t),
                           _share(_per_round(run, "t_up"), t),
                           _share(_per_round(run, "t_down"), t),
                           _share(_per_round(run, "t_compute"), t),
                           _share(_per_round(run, "t_server"), t)]
                          + ([_share(_per_round(run, "t_backhaul"), t),
                              _share(_per_round(run, "t_edge"), t)] if tiered else [])
                          + ([_share(_per_round(run, "t_wait"), t)] if waited else [])))
    return lines


def _traffic_table(runs: list[RunRecord], tiered: bool) -> list[str]:
    lines = ["## Communication and computation per round", "",
             _row(["run", "algorithm", "U-comm (MB)", "D-comm (MB)", "C-comp (GFLOPs)",
                   "S-comp (GFLOPs)"] + (["edge-cloud U (MB)", "edge-cloud D (MB)"] if tiered else [])),
             _row(["---"] * (8 if tiered else 6))]
    for run in runs:
        lines.append(_row([
            run.label, str(run.summary.get("algorithm", NA)),
            # the client links (KAPC Table 6's U-comm); a hierarchy's backhaul has its own
            # columns, so a tiered row and a star's compare alike
            _fmt(_client_link(run, "up") / 1e6),
            _fmt(_client_link(run, "down") / 1e6),
            _fmt(_per_round(run, "flops_client") / 1e9),
            _fmt(_per_round(run, "flops_server") / 1e9, 4)]
            + ([_fmt(run.per_round("bytes_up_edge", "bytes_up_edge_total") / 1e6),
                _fmt(run.per_round("bytes_down_edge", "bytes_down_edge_total") / 1e6)]
               if tiered else [])))
    return lines


NEW_CLIENT_HEADERS = ["new clients best mean acc (%)", "new clients final mean acc (%)",
                      "new clients final worst (%)"]


def _totals_table(runs: list[RunRecord]) -> list[str]:
    # the held-out clients' figures (eval.new_clients), when any run held clients out
    new = any(run.summary.get("new_clients") for run in runs)
    lines = ["## Accuracy, totals and memory", "",
             _row(["run", "algorithm", "dataset", "rounds", "best mean acc (%)",
                   "final mean acc (%)", "final std across clients (%)",
                   "final worst client (%)"] + (NEW_CLIENT_HEADERS if new else [])
                  + ["simulated time (s)", "MB up + down", "server state (MB)",
                     "peak RSS (MB)"]),
             _row(["---"] * (12 + 3 * new))]
    for run in runs:
        s = run.summary
        total_mb = (run.total("bytes_up", "bytes_up_total")
                    + run.total("bytes_down", "bytes_down_total")) / 1e6
        lines.append(_row([
            run.label, str(s.get("algorithm", NA)), str(s.get("dataset", NA)), str(run.rounds),
            _fmt(_get(s, "acc_mean_best") * 100), _fmt(_get(s, "acc_mean_final") * 100),
            _fmt(_get(s, "acc_std_final") * 100), _fmt(_get(s, "acc_min_final") * 100)]
            + (_new_client_cells(s) if new else [])
            + [_fmt(run.total("t_round", TOTAL_KEYS["t_round"]), 1), _fmt(total_mb),
               _fmt(_get(s, "server_state_bytes") / 1e6, 3),
               _fmt(_get(s, "peak_rss_bytes") / 1e6, 1)]))
    refused = [f"{run.label} ({run.summary['new_clients_refused']})" for run in runs
               if run.summary.get("new_clients") and run.summary.get("new_clients_refused")]
    if refused:
        lines += ["", "New clients n/a: the method cannot serve a client it never trained: "
                  + "; ".join(refused) + "."]
    return lines


def _new_client_cells(summary: dict) -> list[str]:
    """Best and final mean accuracy of the held-out clients and the worst one's final;
    n/a for a run without them or whose method cannot serve a new client."""
    if not summary.get("new_clients") or summary.get("new_clients_refused"):
        return [NA] * 3
    return [_fmt(_get(summary, key) * 100)
            for key in ("acc_new_mean_best", "acc_new_mean_final", "acc_new_min_final")]


def _get(summary: dict, key: str) -> float:
    value = summary.get(key)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return math.nan


def _curve(run: RunRecord, cost: list[float]) -> tuple[list[float], list[float]]:
    """Accuracy at evaluated rounds against the cost accumulated up to and including them."""
    xs, ys, acc_sum = [], [], 0.0
    for row, c in zip(run.rows, cost, strict=True):
        acc_sum += c
        if math.isfinite(row.get("acc_mean", math.nan)):
            xs.append(acc_sum)
            ys.append(row["acc_mean"])
    return xs, ys


def report_plots(run_dirs: list[Path], out_dir: Path) -> list[Path]:
    """``accuracy_vs_bytes.png`` and ``accuracy_vs_time.png`` in ``out_dir``: mean accuracy
    at evaluated rounds against cumulative MB (up + down) and cumulative simulated seconds.
    A run without simulated times is left out of the time plot (and said so on it)."""
    from edgepfl.plotting import percent_axis, plt, save_figure, setting_line, with_setting

    runs = load_runs(run_dirs)
    out_dir = Path(out_dir)
    written = []
    # the runs' setting under the title where they share it; runs of different settings
    # are told apart by their labels
    settings = {setting_line(run.config) for run in runs}
    setting = settings.pop() if len(settings) == 1 else ""
    for name, xlabel in (("accuracy_vs_bytes.png", "cumulative MB (up + down)"),
                         ("accuracy_vs_time.png", "cumulative simulated time (s)")):
        fig, ax = plt.subplots(figsize=(6.5, 4))
        left_out = []
        for run in runs:
            if name == "accuracy_vs_bytes.png":
                cost = [(u + d) / 1e6 for u, d in zip(run.column("bytes_up"),
                                                      run.column("bytes_down"), strict=True)]
            else:
                cost = run.column("t_round")
            if not cost or not all(math.isfinite(c) for c in cost):
                left_out.append(run.label)
                continue
            xs, ys = _curve(run, cost)
            ax.plot(xs, [100 * y for y in ys], marker="." if len(xs) < 30 else None,
                    label=run.label)
        percent_axis(ax, xlabel)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("mean test accuracy (personalized)")
        title = with_setting("accuracy against " + ("communication" if "bytes" in name
                                                    else "simulated time"), setting)
        if left_out:
            title += f"\n(no data for: {', '.join(left_out)})"
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize=8)
        path = out_dir / name
        save_figure(fig, path)
        written.append(path)
    return written
