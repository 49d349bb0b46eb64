"""Per-client state on disk (``train.store = "disk"``): stacks in files mapped into memory
give the in-memory run's results exactly, resume from a checkpoint onto disk again, and
leave no file behind."""

import errno
import math
import os

import pytest
import torch

from edgepfl.engine.simulation import CHECKPOINT, Simulation, resume_run
from edgepfl.errors import ConfigError
from edgepfl.federation.store import MEMORY, StackedStore, Stacks
from tests.conftest import fast_config, resumed_and_straight, without_wall


def mapped_in(tensor: torch.Tensor, directory) -> bool:
    name = tensor.untyped_storage().filename
    return name is not None and os.path.dirname(name) == str(directory)


def test_a_disk_stack_is_a_mapped_file_that_is_already_unlinked(tmp_path):
    stacks = Stacks(tmp_path)
    t = stacks.zeros((5, 3, 4), torch.float32)
    assert t.shape == (5, 3, 4) and not t.any()
    assert mapped_in(t, tmp_path)
    assert list(tmp_path.iterdir()) == []  # its disk space goes with the tensor
    t[2].copy_(torch.arange(12.0).view(3, 4))
    assert torch.equal(t[[0, 2]].sum(0), torch.arange(12.0).view(3, 4))
    assert Stacks.of(t).directory == tmp_path and Stacks.of(t[2]).on_disk
    assert Stacks.of(t.clone()) is MEMORY
    value = torch.randn(3, 4)
    rep = stacks.repeat(value, 4)
    assert mapped_in(rep, tmp_path) and torch.equal(rep, value.expand(4, 3, 4))
    assert torch.equal(MEMORY.repeat(value, 4), rep)
    cp = stacks.copy(value)
    assert mapped_in(cp, tmp_path) and torch.equal(cp, value)
    held = stacks.hold(value)
    assert mapped_in(held, tmp_path) and torch.equal(held, value)
    assert MEMORY.hold(value) is value
    # a file mapped by anyone else is not a disk stack
    (tmp_path / "other.bin").write_bytes(bytes(48))
    other = torch.from_file(str(tmp_path / "other.bin"), shared=True, size=12)
    assert other.untyped_storage().filename is not None and Stacks.of(other) is MEMORY


def test_a_disk_too_small_for_a_stack_is_a_clear_error_when_it_is_made(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    with pytest.raises(ConfigError, match=r"cannot hold a per-client stack \(1000, 1000\) of "
                                          r"4.0 MB \(No space left on device\).*store_dir"):
        Stacks(tmp_path).zeros((1000, 1000), torch.float32)
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_stacked_store_on_disk_keeps_its_rows_and_loads_onto_disk(tmp_path):
    store = StackedStore(4, Stacks(tmp_path))
    store.set_row(1, {"w": torch.ones(3), "b": torch.tensor([2.0])})
    assert all(mapped_in(store.tensors[k], tmp_path) for k in ("w", "b"))
    assert torch.equal(store.row(1)["w"], torch.ones(3)) and store.row(0) == {}
    again = StackedStore(4, Stacks(tmp_path))
    again.load_state_dict(store.state_dict("s/"), "s/")
    assert mapped_in(again.tensors["w"], tmp_path)
    assert torch.equal(again.row(1)["b"], torch.tensor([2.0]))


# algorithm -> (settings, the server attributes that hold a row per client)
CASES = {
    "kapc": (["train.participation=0.5"], ["W", "R"]),
    "dcpfl": (["algorithm.t_start=2"], ["uploads", "group"]),
    "clusterfl": ([], ["w", "u", "z"]),
    "fedamp": ([], ["models"]),
}


def server_stacks(server, names):
    for name in names:
        value = getattr(server, name)
        if isinstance(value, torch.Tensor):
            yield value
        else:
            yield from (value.tensors.values() if isinstance(value, StackedStore)
                        else value.values())


@pytest.mark.parametrize("algorithm", list(CASES))
def test_state_on_disk_gives_the_in_memory_runs_results_exactly(algorithm, tmp_path):
    settings, names = CASES[algorithm]
    runs = []
    for store in ("memory", "disk"):
        sim = Simulation(fast_config(f"algorithm.name={algorithm}", f"train.store={store}",
                                     f"train.store_dir={tmp_path}", *settings), progress=False)
        sim.run()
        runs.append(sim)
    mem, disk = runs
    assert list(tmp_path.iterdir()) == []
    # the disk run's state really is in mapped files, the memory run's is not
    for sim, on_disk in ((mem, False), (disk, True)):
        held = list(sim.clients.tensors.values()) + list(server_stacks(sim.server, names))
        assert held and all(mapped_in(t, tmp_path) == on_disk for t in held)
    for ra, rb in zip(without_wall(mem.metrics), without_wall(disk.metrics), strict=True):
        assert ra.keys() == rb.keys()
        for k, va in ra.items():
            assert (math.isnan(va) and math.isnan(rb[k])) if isinstance(va, float) and \
                math.isnan(va) else va == rb[k], k
    for a, b in ((mem.clients.state_dict("c/"), disk.clients.state_dict("c/")),
                 (mem.server.save_state()[0], disk.server.save_state()[0])):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("algorithm,settings", [
    ("kapc", []),
    # its evaluation messages are rows of the server's disk stacks (the group models)
    ("dcpfl", ["algorithm.t_start=2", "train.rounds=4"])])
def test_worker_processes_train_and_evaluate_from_a_store_on_disk(algorithm, settings, tmp_path):
    # a row of a mapped file cannot be handed to a worker as the memory store's rows
    # are (by file descriptor): it goes as a copy, and the results are the same
    runs = [Simulation(fast_config(f"algorithm.name={algorithm}", *settings, *extra),
                       progress=False)
            for extra in ([], ["train.workers=2", "train.store=disk",
                               f"train.store_dir={tmp_path}"])]
    for sim in runs:
        sim.run()
    seq, par = runs
    assert without_wall(seq.metrics) == without_wall(par.metrics)
    a, b = seq.clients.state_dict("c/"), par.clients.state_dict("c/")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_run_on_disk_resumes_onto_disk_and_ends_as_a_straight_run(tmp_path):
    resumed, straight = resumed_and_straight(
        tmp_path, "algorithm.name=kapc", "train.participation=0.5", "train.store=disk")
    assert all(mapped_in(t, tmp_path) for t in resumed.server.W.values())
    assert all(mapped_in(t, tmp_path) for t in resumed.clients.tensors.values())
    assert not any(p.name.startswith("stack-") for p in tmp_path.iterdir())
    a, b = straight.clients.state_dict("c/"), resumed.clients.state_dict("c/")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(straight.server.W[p], resumed.server.W[p]) for p in straight.server.W)
    assert without_wall(straight.metrics) == without_wall(resumed.metrics)


def test_a_run_kept_in_memory_resumes_with_its_state_on_disk(tmp_path):
    settings = ["algorithm.name=kapc", "train.rounds=2", "train.participation=0.5"]
    first = Simulation(fast_config(*settings), tmp_path, progress=False)
    first._write_setup()
    first.step()
    first.save_checkpoint()
    # the checkpoint of a run in memory loads onto disk
    loaded = Simulation(fast_config(*settings, "train.store=disk"), tmp_path, progress=False)
    loaded.load_checkpoint(tmp_path / CHECKPOINT)
    assert all(mapped_in(t, tmp_path) for t in [*loaded.server.W.values(), loaded.server.R,
                                                *loaded.clients.tensors.values()])
    # and the run, resumed with the setting changed, ends as a straight run does
    resumed = resume_run(tmp_path, overrides=["train.store=disk"], progress=False)
    straight = Simulation(fast_config(*settings), progress=False).run()
    assert without_wall(straight.metrics) == without_wall(resumed.metrics)
    assert not any(p.name.startswith("stack-") for p in tmp_path.iterdir())


def test_an_unusable_store_folder_is_refused_naming_the_setting(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"train.store_dir = .*file/sub.*writable folder"):
        Simulation(fast_config("train.store=disk", f"train.store_dir={blocker / 'sub'}"),
                   progress=False)


def test_a_state_larger_than_the_memory_left_is_refused_before_it_is_made(
        monkeypatch, tmp_path):
    from edgepfl.federation import store

    assert store.available_memory_bytes() > 0  # Linux: MemAvailable (+ free swap)
    monkeypatch.setattr(store, "available_memory_bytes", lambda: 10_000)
    with pytest.raises(ConfigError, match=r"the clients' state \(6 clients x .* MB\) needs "
                                          r".* GB.*set train.store = disk"):
        Simulation(fast_config("algorithm.name=kapc"), progress=False)
    # a server's stack is checked where it is made: 2 GB asked, 1 GB left
    monkeypatch.setattr(store, "available_memory_bytes", lambda: 1 << 30)
    with pytest.raises(ConfigError, match=r"a per-client stack \(1000, 524288\) needs 2.1 GB"):
        MEMORY.zeros((1000, 1 << 19), torch.float32)
    # on disk the same federation is built: its pages are the kernel's to write back
    monkeypatch.setattr(store, "available_memory_bytes", lambda: 10_000)
    sim = Simulation(fast_config("algorithm.name=kapc", "train.store=disk",
                                 f"train.store_dir={tmp_path}"), progress=False)
    assert sim.clients.stacks.on_disk
