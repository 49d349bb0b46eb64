"""Cost tables and accuracy-vs-cost plots read back from (fake) run directories."""

import csv
import json

import pytest

from edgepfl.errors import EdgepflError
from edgepfl.report.tables import load_run, report_plots, report_table

COLUMNS = ["round", "acc_mean", "bytes_up", "bytes_down", "t_down", "t_compute", "t_up",
           "t_server", "t_round", "flops_client", "flops_server"]


def make_run(path, algorithm="fedavg", rounds=4, costs=True, totals=True, evaluated=(2, 4)):
    """A run dir: every round uploads 2 MB, downloads 1 MB and takes 10 simulated s
    (up 5, down 2, client 2.5, server 0.5); accuracy only at ``evaluated`` rounds."""
    path.mkdir(parents=True)
    rows = []
    for r in range(1, rounds + 1):
        row = {"round": r, "acc_mean": 0.5 + 0.1 * r if r in evaluated else "",
               "bytes_up": 2_000_000, "bytes_down": 1_000_000}
        if costs:
            row.update(t_down=2.0, t_compute=2.5, t_up=5.0, t_server=0.5, t_round=10.0,
                       flops_client=3e9, flops_server=2e6)
        rows.append(row)
    with open(path / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS if costs else COLUMNS[:4], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    summary = {"algorithm": algorithm, "dataset": "digits", "rounds": rounds,
               "acc_mean_best": 0.9, "acc_mean_final": 0.875, "acc_std_final": 0.05,
               "acc_min_final": 0.8,
               "bytes_up_total": 2_000_000 * rounds, "bytes_down_total": 1_000_000 * rounds}
    if costs and totals:
        summary.update(t_down_total=2.0 * rounds, t_compute_total=2.5 * rounds,
                       t_up_total=5.0 * rounds, t_server_total=0.5 * rounds,
                       t_round_total=10.0 * rounds, flops_client_total=3e9 * rounds,
                       flops_server_total=2e6 * rounds, server_state_bytes=1_500_000,
                       peak_rss_bytes=300_000_000)
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def table_rows(text, heading):
    block = text.split(f"## {heading}")[1].split("##")[0]
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in block.strip().splitlines() if line.startswith("|")][2:]


def test_table_splits_time_per_round_like_kapc_table5(tmp_path):
    text = report_table([make_run(tmp_path / "a")])
    [row] = table_rows(text, "Time per round")
    assert row == ["a", "fedavg", "10.00", "5.00 (50.0%)", "2.00 (20.0%)", "2.50 (25.0%)",
                   "0.50 (5.0%)"]
    [row] = table_rows(text, "Communication and computation per round")
    assert row == ["a", "fedavg", "2.00", "1.00", "3.00", "0.0020"]
    [row] = table_rows(text, "Accuracy, totals and memory")
    assert row == ["a", "fedavg", "digits", "4", "90.00", "87.50", "5.00", "80.00", "40.0", "12.00",
                   "1.500", "300.0"]


def test_a_deadlines_wait_gets_its_column_so_the_shares_add_up(tmp_path):
    waited = make_run(tmp_path / "w")
    summary = json.loads((waited / "summary.json").read_text())
    summary.update(t_round_total=12.0 * 4, t_wait_total=2.0 * 4)
    (waited / "summary.json").write_text(json.dumps(summary))
    text = report_table([make_run(tmp_path / "a"), waited])
    header = text.split("## Time per round")[1].split("\n")[2]
    assert header.strip("| ").split(" | ")[-1] == "wait"
    plain, wait = table_rows(text, "Time per round")
    # a run that never recorded a wait (made before t_wait existed) shows n/a
    assert plain[-1] == "n/a" and wait[-1] == "2.00 (16.7%)"
    shares = [float(c.split("(")[1].rstrip("%)")) for c in wait[3:]]
    assert sum(shares) == pytest.approx(100.0, abs=0.2)
    assert "wait" not in report_table([make_run(tmp_path / "b")]).split("## Time per round")[1].split("##")[0]


def test_totals_fall_back_to_the_per_round_columns(tmp_path):
    text = report_table([make_run(tmp_path / "a", totals=False)])
    assert table_rows(text, "Time per round")[0][2:4] == ["10.00", "5.00 (50.0%)"]
    assert table_rows(text, "Accuracy, totals and memory")[0][-2:] == ["n/a", "n/a"]


def test_new_client_figures_get_columns_when_a_run_held_clients_out(tmp_path):
    def held_out(path, algorithm, refused=None):
        run = make_run(path, algorithm=algorithm)
        summary = json.loads((run / "summary.json").read_text())
        summary.update(new_clients=[7, 8], new_clients_refused=refused)
        if not refused:
            summary.update(acc_new_mean_best=0.7, acc_new_mean_final=0.65, acc_new_min_final=0.5)
        (run / "summary.json").write_text(json.dumps(summary))
        return run

    plain = make_run(tmp_path / "plain")
    heading = "Accuracy, totals and memory"
    assert "new clients" not in report_table([plain]).split(f"## {heading}")[1]
    text = report_table([held_out(tmp_path / "served", "fedavg"), plain,
                         held_out(tmp_path / "refused", "fedper", refused="no global head")])
    header = text.split(f"## {heading}")[1].split("\n")[2]
    assert header.strip("| ").split(" | ")[8:11] == [
        "new clients best mean acc (%)", "new clients final mean acc (%)",
        "new clients final worst (%)"]
    served, without, refused = table_rows(text, heading)
    assert served[8:11] == ["70.00", "65.00", "50.00"] and served[-1] == "300.0"
    assert without[8:11] == ["n/a"] * 3 and refused[8:11] == ["n/a"] * 3
    assert all(len(row) == 15 for row in (served, without, refused))
    assert "New clients n/a: the method cannot serve a client it never trained: " \
           "refused (no global head)." in text


def test_runs_without_system_costs_show_na(tmp_path):
    old = make_run(tmp_path / "old", costs=False)
    new = make_run(tmp_path / "new", algorithm="kapc")
    text = report_table([old, new])
    rows = table_rows(text, "Time per round")
    assert rows[0] == ["old", "fedavg"] + ["n/a"] * 5
    assert rows[1][:3] == ["new", "kapc", "10.00"]
    assert table_rows(text, "Communication and computation per round")[0][2:] == [
        "2.00", "1.00", "n/a", "n/a"]


def test_same_directory_names_are_told_apart(tmp_path):
    a = make_run(tmp_path / "x" / "run")
    b = make_run(tmp_path / "y" / "run")
    labels = [r[0] for r in table_rows(report_table([a, b]), "Time per round")]
    assert labels == [str(a), str(b)]


def test_plots_are_written(tmp_path):
    runs = [make_run(tmp_path / "a"), make_run(tmp_path / "b", costs=False)]
    out = tmp_path / "report"
    paths = report_plots(runs, out)
    assert [p.name for p in paths] == ["accuracy_vs_bytes.png", "accuracy_vs_time.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_curves_use_evaluated_rounds_and_cumulative_cost(tmp_path):
    from edgepfl.report.tables import _curve

    run = load_run(make_run(tmp_path / "a", evaluated=(2, 4)))
    xs, ys = _curve(run, run.column("t_round"))
    assert xs == [20.0, 40.0] and ys == pytest.approx([0.7, 0.9])


@pytest.mark.parametrize("breakage, message", [
    ("missing", "does not exist"),
    ("no_summary", "no summary.json"),
    ("no_metrics", "no metrics.csv"),
    ("bad_columns", "lacks the columns"),
    ("bad_json", "not readable JSON"),
])
def test_bad_run_dirs_are_named(tmp_path, breakage, message):
    path = tmp_path / "broken"
    if breakage != "missing":
        make_run(path)
    if breakage == "no_summary":
        (path / "summary.json").unlink()
    elif breakage == "no_metrics":
        (path / "metrics.csv").unlink()
    elif breakage == "bad_columns":
        (path / "metrics.csv").write_text("round,loss\n1,0.5\n")
    elif breakage == "bad_json":
        (path / "summary.json").write_text("{not json")
    with pytest.raises(EdgepflError) as exc:
        report_table([make_run(tmp_path / "fine"), path])
    assert message in str(exc.value) and "broken" in str(exc.value)


def test_no_run_dirs_is_an_error():
    with pytest.raises(EdgepflError, match="no run directories"):
        report_table([])
