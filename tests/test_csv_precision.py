"""CSV files (metrics.csv above all) hold floats that read back as the same float."""

import csv
import math

import numpy as np


def test_floats_written_to_csv_read_back_equal(tmp_path):
    from edgepfl.io import write_csv
    from edgepfl.report.tables import load_run

    values = [0.1, 1 / 3, 2 / 3, 0.6004825395459179, 1e-300, 123456789.12345678, 1e22,
              -0.0, np.float64(0.7) / 3, float(np.float32(0.1)), math.inf]
    rows = [{"round": i + 1, "acc_mean": v, "bytes_up": 10, "bytes_down": 20}
            for i, v in enumerate(values)]
    rows.append({"round": len(values) + 1, "acc_mean": math.nan, "bytes_up": 0, "bytes_down": 0})
    write_csv(tmp_path / "metrics.csv", ["round", "acc_mean", "bytes_up", "bytes_down"], rows)
    with open(tmp_path / "metrics.csv", newline="") as f:
        read = list(csv.DictReader(f))
    assert [float(r["acc_mean"]) for r in read[:-1]] == [float(v) for v in values]
    assert read[-1]["acc_mean"] == ""  # not evaluated
    assert "np.float64" not in (tmp_path / "metrics.csv").read_text()
    assert [int(r["bytes_up"]) for r in read] == [10] * len(values) + [0]
    (tmp_path / "summary.json").write_text("{}")
    run = load_run(tmp_path)  # the report's reader
    assert run.column("acc_mean")[:-1] == [float(v) for v in values]
