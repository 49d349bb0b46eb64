"""Every algorithm's defaults are valid for any federation size: a user who only names the
algorithm and the number of clients gets a run, not a refusal of the algorithm's own
defaults."""

import pytest

from edgepfl.algorithms import ALGORITHMS
from edgepfl.data import load_dataset
from edgepfl.engine.parts import Parts, resolve
from tests.conftest import fast_config


@pytest.fixture(scope="module")
def synthetic():
    return load_dataset("synthetic", None, 1.0, 0, False)


@pytest.mark.parametrize("clients", [2, 30, 1000])
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_the_defaults_build_every_part_at_any_size(name, clients, synthetic):
    topology = ["topology.edges=2"] if ALGORITHMS[name].edge is not None else []
    cfg = resolve(fast_config(f"algorithm.name={name}", f"partition.clients={clients}",
                              *topology))
    parts = Parts.build(cfg, synthetic, clients)
    parts.server()
    for k in range(parts.federation.edges):
        parts.edge(k)
    for arch in parts.architectures:
        parts.client(arch)
