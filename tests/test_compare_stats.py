"""Statistics over seeds, the comparison's and the sweep's tables built from them, the
grid's parsing and the plots' axes."""

import math

import numpy as np
import pytest

from edgepfl.config import build_config
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.experiments.compare import (
    COMPARISON_COLUMNS,
    RUN_COLUMNS,
    comparison_markdown,
    pick_reference,
    with_statistics,
)
from edgepfl.report import stats

T_975_2 = 4.302652729911275  # Student's t, 97.5% quantile, 2 degrees of freedom (tables: 4.303)
T_975_1 = 12.706204736174698  # 1 degree of freedom (tables: 12.706)


# -- the statistics -----------------------------------------------------------------------
def test_three_values_by_hand():
    est = stats.estimate([0.8, 0.9, 1.0])
    assert est.n == 3
    assert est.mean == pytest.approx(0.9)
    # sample standard deviation: sqrt((0.01 + 0 + 0.01) / (3 - 1)) = 0.1
    assert est.sd == pytest.approx(0.1)
    assert est.half_width == pytest.approx(T_975_2 * 0.1 / math.sqrt(3))
    assert est.half_width == pytest.approx(0.24841377, abs=1e-8)
    assert (est.low, est.high) == pytest.approx((0.9 - 0.24841377, 0.9 + 0.24841377))


def test_the_spread_is_the_sample_std_not_the_population_one():
    values = [0.61, 0.64, 0.70, 0.55]
    assert stats.estimate(values).sd == pytest.approx(np.std(values, ddof=1))
    assert stats.estimate(values).sd > np.std(values)


def test_t_quantiles_match_the_tables():
    assert stats.t_quantile(0.95, 2) == pytest.approx(T_975_2)
    assert stats.t_quantile(0.95, 1) == pytest.approx(T_975_1)
    assert stats.t_quantile(0.90, 4) == pytest.approx(2.131847, abs=1e-6)
    with pytest.raises(ValueError, match="confidence"):
        stats.t_quantile(1.0, 2)


def test_two_values_use_one_degree_of_freedom():
    est = stats.estimate([0.5, 0.7])
    assert est.sd == pytest.approx(math.sqrt(0.02))
    assert est.half_width == pytest.approx(T_975_1 * math.sqrt(0.02) / math.sqrt(2))


def test_one_value_has_no_spread_and_no_interval():
    est = stats.estimate([0.8])
    assert est.n == 1 and est.mean == 0.8
    assert math.isnan(est.sd) and math.isnan(est.half_width) and not est.has_spread
    assert stats.interval_text(est) == "n/a"
    assert stats.mean_sd_text(est, 100) == "80.00"  # no "± 0.00" that reads as measured
    cols = stats.columns("acc", est)
    assert cols["acc_mean"] == 0.8 and all(math.isnan(cols[k]) for k in
                                           ("acc_sd", "acc_ci_low", "acc_ci_high"))


def test_missing_values_are_left_out_not_counted_as_zero():
    est = stats.estimate([0.8, None, math.nan, 0.9, 1.0])
    assert est.n == 3 and est.mean == pytest.approx(0.9) and est.sd == pytest.approx(0.1)
    assert stats.estimate([]).n == 0 and stats.mean_sd_text(stats.estimate([])) == "n/a"


def test_cells():
    est = stats.estimate([0.8, 0.9, 1.0])
    assert stats.mean_sd_text(est, 100) == "90.00 ± 10.00"
    assert stats.interval_text(est, 100) == "[65.16, 114.84]"
    diff = stats.estimate([-0.01, 0.02, 0.02])
    assert stats.mean_text(diff, 100, signed=True) == "+1.00"
    assert stats.interval_text(diff, 100, signed=True).startswith("[-")


def test_paired_difference_by_hand():
    values = {0: 0.8, 1: 0.9, 2: 1.0}
    reference = {0: 0.7, 1: 0.7, 2: 0.7}
    assert stats.paired_differences(values, reference) == pytest.approx({0: 0.1, 1: 0.2, 2: 0.3})
    est = stats.paired_estimate(values, reference)
    assert est.mean == pytest.approx(0.2) and est.sd == pytest.approx(0.1)
    assert est.half_width == pytest.approx(T_975_2 * 0.1 / math.sqrt(3))


def test_pairing_takes_out_what_a_seed_does_to_both():
    # a hard seed and an easy one; the method is 2 points better on every seed
    reference = {0: 0.50, 1: 0.70, 2: 0.90}
    method = {k: v + 0.02 for k, v in reference.items()}
    apart = stats.estimate(method.values()), stats.estimate(reference.values())
    assert apart[0].low < apart[1].high  # side by side the intervals overlap widely
    paired = stats.paired_estimate(method, reference)
    assert paired.mean == pytest.approx(0.02)
    assert paired.half_width < 1e-9  # the same gain on every seed: no doubt about it


def test_paired_difference_uses_only_seeds_both_have():
    diffs = stats.paired_differences({0: 0.8, 1: 0.9, 2: None}, {0: 0.7, 2: 0.5, 3: 0.1})
    assert diffs == pytest.approx({0: 0.1})
    assert not stats.paired_estimate({0: 0.8}, {0: 0.7}).has_spread


# -- the comparison's table ---------------------------------------------------------------
def _rows(values: dict[str, list[float]]) -> list[dict]:
    rows = []
    for name, accs in values.items():
        for seed, acc in enumerate(accs):
            row = {k: None for k in RUN_COLUMNS}
            row.update(algorithm=name, model="cnn_small", seed=seed, acc_mean_best=acc + 0.01,
                       acc_mean_final=acc, acc_std_final=0.05, acc_min_final=acc - 0.1,
                       acc_client_best_mean=acc + 0.02, bytes_up_total=2e6,
                       bytes_down_total=1e6, run_dir=f"{name}-seed{seed}")
            rows.append(row)
    return rows


def test_reference_is_fedavg_else_the_first_else_what_was_named():
    assert pick_reference(["local", "fedavg"], None) == "fedavg"
    assert pick_reference(["local", "fedprox"], None) == "local"
    assert pick_reference(["local", "fedprox"], "fedprox") == "fedprox"
    with pytest.raises(EdgepflError, match=r"--reference 'kapc' is not among .*local, fedprox"):
        pick_reference(["local", "fedprox"], "kapc")


def test_rows_carry_the_algorithms_statistics_and_the_paired_difference():
    rows = with_statistics(_rows({"local": [0.8, 0.9, 1.0], "fedavg": [0.7, 0.7, 0.7]}),
                           ["local", "fedavg"], "fedavg")
    assert set(COMPARISON_COLUMNS) >= set(RUN_COLUMNS)
    local = [r for r in rows if r["algorithm"] == "local"]
    assert [r["acc_mean_final_diff"] for r in local] == pytest.approx([0.1, 0.2, 0.3])
    for r in local:
        assert r["reference"] == "fedavg" and r["n_seeds"] == 3
        assert r["acc_mean_final_mean"] == pytest.approx(0.9)
        assert r["acc_mean_final_sd"] == pytest.approx(0.1)
        assert r["acc_mean_final_ci_high"] == pytest.approx(0.9 + T_975_2 * 0.1 / math.sqrt(3))
        assert r["acc_mean_final_diff_mean"] == pytest.approx(0.2)
        assert r["acc_mean_final_diff_ci_low"] == pytest.approx(0.2 - T_975_2 * 0.1 / math.sqrt(3))
    fedavg = [r for r in rows if r["algorithm"] == "fedavg"]
    assert all("acc_mean_final_diff" not in r for r in fedavg)  # no difference to itself
    assert fedavg[0]["acc_mean_final_sd"] == 0.0


def test_markdown_says_the_spread_is_the_sample_std_and_pairs_with_the_reference():
    base = build_config({}, ["partition.clients=4", "train.rounds=2"])
    rows = _rows({"local": [0.8, 0.9, 1.0], "fedavg": [0.7, 0.7, 0.7]})
    text = comparison_markdown(rows, ["local", "fedavg"], base, "fedavg")
    assert "sample standard deviation (ddof = 1)" in text and "t-interval" in text
    local = next(line for line in text.splitlines() if line.startswith("| local |"))
    cells = [c.strip() for c in local.strip("|").split("|")]
    assert cells[4:6] == ["90.00 ± 10.00", "[65.16, 114.84]"]
    assert "## Against fedavg, seed by seed" in text
    paired = [line for line in text.splitlines() if line.startswith("| local | 3 |")]
    assert paired and "| +20.00 | [-4.84, +44.84] |" in paired[0]


def test_markdown_of_one_seed_shows_no_spread_and_no_interval():
    base = build_config({}, [])
    text = comparison_markdown(_rows({"local": [0.8], "fedavg": [0.7]}), ["local", "fedavg"],
                               base, "fedavg")
    assert "±" not in text
    paired = next(line for line in text.splitlines() if line.startswith("| local | 1 |"))
    assert paired == "| local | 1 | +10.00 | n/a | +10.00 | n/a |"


# -- the sweep's grid ---------------------------------------------------------------------
def test_grid_values_are_read_as_toml_like_set():
    from edgepfl.experiments.sweep import parse_grid

    grid = parse_grid(["train.lr=0.01,0.05", "algorithm.name=fedavg,fedprox",
                       'dataset.aspect_ratios=["16:9", "1:1"],["4:3"]',
                       "train.batch_clients=true,false", 'model.name="a,b",c'])
    assert grid == [("train.lr", [0.01, 0.05]), ("algorithm.name", ["fedavg", "fedprox"]),
                    ("dataset.aspect_ratios", [["16:9", "1:1"], ["4:3"]]),
                    ("train.batch_clients", [True, False]), ("model.name", ["a,b", "c"])]


@pytest.mark.parametrize("items,overrides,words", [
    ([], [], ["--grid"]),
    (["train.lr"], [], ["train.lr", "key=v1,v2"]),
    (["train.lr="], [], ["no values"]),
    (["seed=0,1"], [], ["--seeds"]),
    (["train.lr=0.1", "train.lr=0.2"], [], ["more than once"]),
    (["train.lr=0.1,0.1"], [], ["0.1", "more than once"]),
    (["train.lr=0.1,0.2"], ["train.lr=0.3"], ["--set train.lr"]),
])
def test_bad_grids_are_refused_naming_the_value(items, overrides, words):
    from edgepfl.experiments.sweep import parse_grid

    with pytest.raises(EdgepflError) as info:
        parse_grid(items, overrides)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_run_directories_are_named_from_the_varied_values():
    from edgepfl.experiments.sweep import point_names

    assert point_names(["train.lr", "partition.alpha"], [(0.01, 0.1), (0.05, 1.0)]) == [
        "lr=0.01+alpha=0.1", "lr=0.05+alpha=1.0"]
    assert point_names(["train.batch_size", "eval.batch_size"], [(32, 64)]) == [
        "train.batch_size=32+eval.batch_size=64"]
    assert point_names(["dataset.aspect_ratios"], [(["16:9", "1:1"],)]) == [
        "aspect_ratios=16_9,1_1"]
    with pytest.raises(EdgepflError, match="share the run directory"):
        point_names(["model.name"], [("a b",), ("a/b",)])


def test_every_grid_point_is_validated_before_a_run_and_errs_as_set_does():
    from edgepfl.experiments.sweep import plan_sweep

    base = build_config({}, ["dataset.name=synthetic"])
    with pytest.raises(ConfigError) as by_set:
        build_config(base.model_dump(), ["train.bogus=1"])
    with pytest.raises(ConfigError) as by_grid:
        plan_sweep(base, [("train.lr", [0.1]), ("train.bogus", [1, 2])], [0])
    assert str(by_set.value) in str(by_grid.value)
    # a value out of range at one point only: that point is named
    with pytest.raises(ConfigError, match=r"partition.alpha = -1(.|\n)*partition.alpha=-1"):
        plan_sweep(base, [("partition.alpha", [0.5, -1])], [0])
    plan, of, points, names = plan_sweep(base, [("train.lr", [0.1, 0.2]),
                                                ("partition.alpha", [0.5])], [3, 4])
    assert [r.name for r in plan] == ["lr=0.1+alpha=0.5-seed3", "lr=0.2+alpha=0.5-seed3",
                                      "lr=0.1+alpha=0.5-seed4", "lr=0.2+alpha=0.5-seed4"]
    assert [(r.config.train.lr, r.config.seed) for r in plan] == [(0.1, 3), (0.2, 3),
                                                                   (0.1, 4), (0.2, 4)]
    assert plan[0].config.model.name == "cnn_small"  # resolved per point


# -- the plots ----------------------------------------------------------------------------
def test_setting_line_names_data_clients_skew_and_rounds():
    from edgepfl.plotting import setting_line

    cfg = build_config({}, ["dataset.name=mnist", "partition.clients=20",
                            "partition.alpha=0.1", "train.rounds=30"]).model_dump()
    assert setting_line(cfg) == "mnist, 20 clients, dirichlet α = 0.1, 30 rounds"
    assert setting_line(cfg, skip=["partition.alpha"]) == "mnist, 20 clients, dirichlet, 30 rounds"
    patho = build_config({}, ["partition.scheme=pathological"]).model_dump()
    assert "pathological 2 classes per client" in setting_line(patho)
    assert setting_line(None) == ""


def test_accuracy_plots_are_in_percent_on_whole_rounds_with_the_band_in_range(tmp_path, monkeypatch):
    import json

    import edgepfl.plotting as plotting

    drawn = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: drawn.append(fig))
    (tmp_path / "config.json").write_text(json.dumps(build_config({}, [
        "partition.clients=7", "partition.alpha=0.2", "train.rounds=3"]).model_dump()))
    metrics = [{"round": r, "acc_mean": a, "acc_std": 0.3, "acc_min": 0.0}
               for r, a in ((1, 0.1), (2, 0.5), (3, 0.95))]
    plotting.plot_accuracy(metrics, tmp_path / "accuracy.png", "fedavg on digits")
    [fig] = drawn
    ax = fig.axes[0]
    fig.canvas.draw()
    assert "7 clients, dirichlet α = 0.2, 3 rounds" in ax.get_title()
    assert all(float(t).is_integer() for t in ax.get_xticks())
    assert ax.lines[0].get_ydata()[-1] == pytest.approx(95.0)
    assert ax.yaxis.get_major_formatter()(50, 0).endswith("%")
    band = np.concatenate([p.vertices for p in ax.collections[0].get_paths()])
    assert band[:, 1].min() >= 0.0 and band[:, 1].max() <= 100.0
    assert band[:, 1].min() == 0.0 and band[:, 1].max() == 100.0  # 10 - 30 and 95 + 30, clipped


def test_comparison_plot_is_in_percent_with_the_band_clipped(tmp_path, monkeypatch):
    import edgepfl.report.plots as plots

    drawn = []
    monkeypatch.setattr(plots, "save_figure", lambda fig, path: drawn.append(fig))
    x, mean, sd = plots.seed_curves([[(1, 0.05), (2, 0.9)], [(1, 0.25), (2, 0.99)],
                                     [(1, 0.15), (2, 0.97), (3, 0.99)]])
    assert sd[0] == pytest.approx(0.1)  # sample std of 5, 25, 15 %
    # the seed that ran longest keeps its last round (others stopped early), alone
    assert list(x) == [1, 2, 3] and mean[2] == pytest.approx(0.99) and sd[2] == 0.0
    plots.plot_curves({"fedavg": (x, mean, 3 * sd)}, tmp_path / "c.png", "t", setting="s")
    [fig] = drawn
    ax = fig.axes[0]
    fig.canvas.draw()
    assert ax.get_title() == "t\ns"
    assert all(float(t).is_integer() for t in ax.get_xticks())
    band = np.concatenate([p.vertices for p in ax.collections[0].get_paths()])
    assert band[:, 1].min() == 0.0 and band[:, 1].max() <= 100.0
