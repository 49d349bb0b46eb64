"""compare checks every algorithm before the first run, gives one algorithm its own model,
and runs star methods beside hierarchical ones on the same clients without the edges."""

import json

import pytest

from edgepfl.errors import ConfigError
from edgepfl.experiments.compare import compare
from tests.conftest import fast_config


def _config(tmp_path, name):
    return json.loads((tmp_path / name / "config.json").read_text())


def test_an_algorithm_that_cannot_run_stops_the_comparison_before_any_run(tmp_path):
    base = fast_config("train.rounds=1")
    with pytest.raises(ConfigError, match="hierfavg cannot run in this comparison"):
        compare(base, ["fedavg", "hierfavg"], [0], tmp_path / "c", progress=False,
                echo=lambda _: None)
    assert not (tmp_path / "c" / "fedavg-seed0").exists()


def test_star_methods_run_on_the_hierarchys_clients_without_its_edges(tmp_path):
    base = fast_config("train.rounds=1", "topology.edges=2")
    said = []
    compare(base, ["hierfavg", "fedavg"], [0], tmp_path, progress=False, echo=said.append)
    hier, star = _config(tmp_path, "hierfavg-seed0"), _config(tmp_path, "fedavg-seed0")
    assert (hier["topology"]["edges"], star["topology"]["edges"]) == (2, 0)
    assert {k: v for k, v in hier["partition"].items()} == star["partition"]
    parts = [json.loads((tmp_path / f"{n}-seed0" / "partition.json").read_text())["clients"]
             for n in ("hierfavg", "fedavg")]
    assert parts[0] == parts[1]  # the same clients with the same data
    assert any("fedavg runs on the same clients as a star" in s for s in said)
    assert "without the edges" in (tmp_path / "comparison.md").read_text()


def test_one_algorithm_gets_its_own_model(tmp_path):
    base = fast_config("train.rounds=1", "algorithm.fedprox.model=mlp")
    said = []
    compare(base, ["fedavg", "fedprox"], [0], tmp_path, progress=False, echo=said.append)
    assert _config(tmp_path, "fedprox-seed0")["model"]["name"] == "mlp"
    assert _config(tmp_path, "fedavg-seed0")["model"]["name"] == "cnn_small"
    assert any("different models" in s for s in said)
