"""Parallel clients (``train.workers``) and the training device (``train.device``): a run
whose clients train in worker processes gives the sequential run's metrics and states."""

import math

import pytest
import torch

from edgepfl.config import build_config
from edgepfl.engine.simulation import CHECKPOINT, Simulation, resume_run
from edgepfl.engine.workers import worker_count
from edgepfl.errors import ConfigError
from edgepfl.training.device import select_device, server_device
from tests.conftest import fast_config, without_wall

# every test here compares two computations: run again on AVX2 kernels by make test
pytestmark = pytest.mark.tolerance

CASES = {
    "fedavg": [],
    "kapc": ["train.participation=0.5"],
    "dcpfl": [],
    "fedproto": [],
    "hierfavg": ["topology.edges=2", "topology.edge_rounds=2"],
    "fedavg-faults": ["faults.drop_rate=0.3", "faults.straggler_rate=0.3",
                      "faults.deadline=1000"],
    "hmpl-crops": ["model.name=hmpl_tiers", 'dataset.aspect_ratios=["4:3", "1:1", "3:4"]',
                   "dataset.fraction=0.1", "train.batch_size=16"],
}


def run(case: str, workers: int, *extra: str) -> Simulation:
    name = case.split("-")[0]
    sim = Simulation(fast_config(f"algorithm.name={name}", "train.rounds=2",
                                 f"train.workers={workers}", *CASES[case], *extra), progress=False)
    sim.run()
    return sim


def same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(without_wall(a), without_wall(b), strict=True):
        assert ra.keys() == rb.keys()
        for k, va in ra.items():
            vb = rb[k]
            same = (isinstance(va, float) and math.isnan(va) and math.isnan(vb)) or va == vb
            assert same, f"{k}: sequential {va!r}, parallel {vb!r}"


@pytest.mark.parametrize("case", list(CASES))
def test_parallel_clients_give_the_sequential_runs_metrics_and_states(case):
    seq, par = run(case, 1), run(case, 2)
    assert par.transport.pool is not None and seq.transport.pool is None
    same_rows(seq.metrics, par.metrics)
    assert seq.client_acc == par.client_acc
    a, b = seq.clients.state_dict("c/"), par.clients.state_dict("c/")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), case
    st, sp = seq.server.save_state()[0], par.server.save_state()[0]
    assert all(torch.equal(st[k], sp[k]) for k in st), case


def test_flops_counted_in_workers_are_the_sequential_counts():
    seq = run("fedavg", 1, "system.cache_flops=false")
    par = run("fedavg", 2, "system.cache_flops=false")
    assert [r["flops_client"] for r in seq.metrics] == [r["flops_client"] for r in par.metrics]
    assert seq.metrics[0]["flops_client"] > 0


def test_workers_stop_with_the_run():
    sim = run("fedavg", 2)
    assert sim.transport.pool._pool is None  # run() closed it
    sim.step()  # and a further step starts it again
    assert sim.transport.pool._pool is not None
    sim.transport.close()


def test_a_run_resumes_with_another_number_of_workers(tmp_path):
    first = Simulation(fast_config("train.rounds=2", "train.workers=2"), tmp_path, progress=False)
    first._write_setup()
    first.step()
    first.save_checkpoint()
    first.transport.close()
    resumed = resume_run(tmp_path, overrides=["train.workers=1"], progress=False)
    straight = Simulation(fast_config("train.rounds=2"), progress=False).run()
    same_rows(straight.metrics, resumed.metrics)
    assert (tmp_path / CHECKPOINT).exists()


def test_worker_count_and_bad_values():
    assert worker_count(3, torch.device("cpu")) == 3
    assert worker_count("auto", torch.device("cpu")) >= 1
    assert worker_count("auto", torch.device("cuda")) == 1  # a GPU trains in this process
    with pytest.raises(ConfigError, match=r"train.workers = 4 .*train.device"):
        worker_count(4, torch.device("cuda"))
    for bad in ("0", "-2", "many"):
        with pytest.raises(ConfigError, match="train.workers"):
            build_config({}, [f"train.workers={bad}"])


def test_device_settings():
    assert select_device("cpu") == torch.device("cpu")
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert server_device("cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match="train.device"):
        build_config({}, ["train.device=tpu"])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"train.device = 'cuda'.*valid here: 'cpu'"):
            Simulation(fast_config("train.device=cuda"), progress=False)


def test_cpu_device_is_the_default_runs_result_here():
    if torch.cuda.is_available():
        pytest.skip("auto picks the GPU on this machine")
    a = Simulation(fast_config("train.rounds=2", "train.device=cpu"), progress=False).run()
    b = Simulation(fast_config("train.rounds=2"), progress=False).run()
    same_rows(a.metrics, b.metrics)


def test_in_parallel_every_task_is_made_before_a_reply_is_stored(monkeypatch):
    # the pool draws tasks in a thread of its own; a reply stored meanwhile (an HMPL client
    # adding its IP layers to the store) must not change the store under a task being made
    sim = Simulation(fast_config("algorithm.name=fedavg", "train.workers=2"), progress=False)
    inproc = sim.transport
    stored, seen = [], []
    real_row, real_set = inproc.store.row, inproc.store.set_row
    monkeypatch.setattr(inproc.store, "row", lambda cid, *a: (seen.append(len(stored)), real_row(cid, *a))[1])
    monkeypatch.setattr(inproc.store, "set_row", lambda cid, v: (stored.append(cid), real_set(cid, v))[1])
    # a pool that draws each task only when its previous result has been taken
    monkeypatch.setattr(inproc.pool, "map", lambda tasks: (inproc._worker_task(t) for t in tasks))
    sim.step()
    assert len(stored) == 6 and seen[:6] == [0] * 6
