"""Declared server state (``Server.state``, edgepfl.federation.state): what a server saves
after a few rounds loads into a fresh server of the same configuration and restores every
declared attribute exactly, through a JSON round trip of the bookkeeping."""

import json
import math

import pytest
import torch

from edgepfl.engine.simulation import Simulation
from edgepfl.federation.store import StackedStore
from tests.conftest import fast_config

DCPFL_QUICK = ("algorithm.t_start=2", "algorithm.s=2", "algorithm.t_obv=1", "algorithm.t_sp=1",
               "algorithm.tau=2", "algorithm.alpha=2", "dataset.fraction=0.4")

# (id, overrides, rounds stepped before saving)
CASES = [
    ("fedavg", ["train.participation=0.5"], 2),
    ("kapc", ["train.participation=0.5"], 2),
    ("fedamp", ["train.participation=0.5", "algorithm.alphaK=0.01", "algorithm.sigma=100",
                "algorithm.lamda=0.01"], 2),
    ("pfedla", ["train.participation=0.5", "algorithm.hn_lr=0.5", "algorithm.hidden_dim=16",
                "algorithm.embedding_dim=8"], 2),
    ("fedproto", ["train.participation=0.5"], 2),
    # still in warm-up: no cluster yet, the primal residual is NaN
    ("clusterfl", ["algorithm.warmup_rounds=3", "train.rounds=5"], 2),
    # clustered, with a late joiner
    ("clusterfl", ["algorithm.warmup_rounds=2", "algorithm.num_clusters=2", "train.rounds=5",
                   "train.participation=0.67"], 2),
    # warm-up only
    ("dcpfl", [*DCPFL_QUICK, "train.rounds=12"], 2),
    # past a split trial: history and trials hold tuples
    ("dcpfl", [*DCPFL_QUICK, "train.rounds=12"], 10),
]
IDS = ["fedavg", "kapc", "fedamp", "pfedla", "fedproto", "clusterfl-warmup", "clusterfl-clustered",
       "dcpfl-warmup", "dcpfl-split"]


def _same(a, b, where: str) -> None:
    """Exact equality: tensors by dtype, shape and value; floats NaN-aware and of the same
    type (1 and 1.0 differ); a tuple restored as a list compares by its items."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, StackedStore):
        assert isinstance(b, StackedStore), where
        assert a.tensors.keys() == b.tensors.keys(), where
        for k in a.tensors:
            _same(a.tensors[k], b.tensors[k], f"{where}/{k}")
            _same(a.present[k], b.present[k], f"{where}/{k}.__present__")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert type(a) is type(b), f"{where}: {a!r} restored as {b!r}"
        if isinstance(a, float) and math.isnan(a):
            assert math.isnan(b), where
        else:
            assert a == b, f"{where}: {a!r} restored as {b!r}"


@pytest.mark.parametrize(("name", "extra", "steps"), CASES, ids=IDS)
def test_saved_state_restores_every_declared_attribute(name, extra, steps):
    cfg = fast_config(f"algorithm.name={name}", *extra)
    sim = Simulation(cfg, progress=False)
    for _ in range(steps):
        sim.step()
    server = sim.server
    declared = type(server).state
    assert declared, f"{type(server).__name__} declares no state"
    assert not {"state_dict", "load_state_dict"} & set(vars(type(server))), \
        "declared state replaces hand-written checkpoint methods"

    tensors, meta = server.save_state()
    assert server.state_dict().keys() == tensors.keys()
    meta = json.loads(json.dumps(meta, allow_nan=False))  # strict JSON: NaN kept as text
    tensors = {k: v.clone() for k, v in tensors.items()}

    fresh = Simulation(cfg, progress=False).server
    fresh.load_state(tensors, meta)
    for attr in declared:
        _same(getattr(server, attr), getattr(fresh, attr), f"{name}.{attr}")
    # loading copies: the fresh server does not share memory with the checkpoint
    again, again_meta = fresh.save_state()
    for k, v in again.items():
        assert v.data_ptr() != tensors[k].data_ptr() or v.numel() == 0, k
    assert json.loads(json.dumps(again_meta)) == meta


def test_dcpfl_split_case_covers_the_tuple_lists():
    """The dcpfl-split case above exercises history/trials only if a trial happened."""
    sim = Simulation(fast_config("algorithm.name=dcpfl", *DCPFL_QUICK, "train.rounds=12"),
                     progress=False)
    for _ in range(10):
        sim.step()
    assert len(sim.server.history) >= 2 and sim.server.trials
    fresh = Simulation(fast_config("algorithm.name=dcpfl", *DCPFL_QUICK, "train.rounds=12"),
                       progress=False).server
    tensors, meta = sim.server.save_state()
    fresh.load_state(tensors, json.loads(json.dumps(meta)))
    # the history's entries stay tuples (the fresh server's first entry is one); the
    # trials come back as lists, which everything reading them indexes the same way
    assert all(isinstance(h, tuple) for h in fresh.history)
    assert [list(t) for t in fresh.trials] == [list(t) for t in sim.server.trials]


def test_clusterfl_nan_residual_restores_as_float():
    cfg = fast_config("algorithm.name=clusterfl", "algorithm.warmup_rounds=3", "train.rounds=5")
    sim = Simulation(cfg, progress=False)
    sim.step()
    assert math.isnan(sim.server._residual)
    tensors, meta = sim.server.save_state()
    assert meta["_residual"] == {"__float__": "nan"}
    fresh = Simulation(cfg, progress=False).server
    fresh._residual = 0.5  # a value of the right type that must be overwritten
    fresh.load_state(tensors, json.loads(json.dumps(meta)))
    assert isinstance(fresh._residual, float) and math.isnan(fresh._residual)


def test_nan_inside_a_list_comes_back_as_a_float_and_a_refused_load_changes_nothing():
    from edgepfl.federation.state import StateError, load_state, save_state

    class Part:
        def __init__(self):
            self.losses = []
            self.w = torch.zeros(2)

    part = Part()
    part.losses = [2.5, math.nan]
    tensors, meta = save_state(part, ("losses", "w"))
    fresh = Part()
    load_state(fresh, ("losses", "w"), tensors, json.loads(json.dumps(meta, allow_nan=False)))
    assert fresh.losses[0] == 2.5 and math.isnan(fresh.losses[1])
    target = Part()
    with pytest.raises(StateError, match="does not declare"):
        load_state(target, ("losses", "w"), {**tensors, "stray": torch.ones(1)}, meta)
    assert target.losses == []  # nothing applied
