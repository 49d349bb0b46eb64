"""The round as a record and its observers: a server reports through ``Reporter`` only,
the record's bytes are the ledger's, a client's time is computed only for a reporter
that asks, and the participants a server configures are checked."""

import math
from pathlib import Path

import pytest

from edgepfl.algorithms.fedavg import FedAvgServer
from edgepfl.contract.algorithm import Reporter, RoundView, Server
from edgepfl.engine import record as record_module
from edgepfl.engine.simulation import Simulation
from edgepfl.federation.messages import MessageError
from tests.conftest import fast_config

SRC = Path(__file__).resolve().parents[1] / "src" / "edgepfl"


class Watching(FedAvgServer, Reporter):
    """FedAvg that keeps every record it is shown and reports a column of its own."""

    def __init__(self, *args, timed: bool = False):
        super().__init__(*args)
        self.records: list = []
        self.timed = timed

    def observe(self, record: RoundView) -> None:
        self.records.append((record.round, list(record.selected), dict(record.bytes_down),
                             dict(record.bytes_up),
                             record.timing() if self.timed else None))

    def round_metrics(self) -> dict[str, float]:
        return {"watched": float(len(self.records))}


def watched(*overrides: str, timed: bool = False) -> tuple[Simulation, Watching]:
    sim = Simulation(fast_config("algorithm.name=fedavg", *overrides), progress=False)
    old = sim.rounds.server
    server = Watching(old.ctx, old.hp, timed=timed)
    sim.rounds.server = sim.server = server
    sim.rounds.reporters = [server]
    return sim, server


def test_a_reporting_method_on_a_server_that_is_no_reporter_is_refused_at_once():
    with pytest.raises(TypeError, match="round_metrics.*inherit.*Reporter"):
        class Forgetful(FedAvgServer):  # noqa: F841
            def round_metrics(self) -> dict[str, float]:
                return {"lost": 1.0}

    class Declared(FedAvgServer, Reporter):
        def round_metrics(self) -> dict[str, float]:
            return {"kept": 1.0}

    assert issubclass(Declared, Server)


def test_a_reporter_sees_each_rounds_record_with_the_ledgers_bytes():
    sim, server = watched("train.participation=0.5", "faults.drop_rate=0.3")
    sim.run()
    assert [r[0] for r in server.records] == [1, 2, 3]
    for (rnd, selected, down, up, _), row in zip(server.records, sim.metrics, strict=True):
        assert row["round"] == rnd and row["clients"] == len(selected)
        assert sum(down.values()) == row["bytes_down"] and sum(up.values()) == row["bytes_up"]
        assert set(down) <= set(selected) and set(up) <= set(selected)
    # a dropped client received nothing: some round had fewer downloads than participants
    assert any(len(down) < len(sel) for _, sel, down, _, _ in server.records)
    assert [row["watched"] for row in sim.metrics] == [1.0, 2.0, 3.0]


def test_a_clients_time_is_computed_only_for_a_reporter_that_asks(monkeypatch):
    calls = []
    real = record_module.client_times
    monkeypatch.setattr(record_module, "client_times",
                        lambda *a: calls.append(1) or real(*a))
    sim, server = watched("system.count_flops=true")
    sim.run()
    assert calls == []  # FedAvg does not ask: nobody pays for the times
    sim, server = watched("system.count_flops=true", timed=True)
    sim.run()
    assert len(calls) == 3
    timing = server.records[0][4]
    assert set(timing.times) == set(server.records[0][1])  # every client replied
    assert all(math.isfinite(t) and t > 0 for t in timing.times.values())
    assert all(timing.compute[c] <= timing.times[c] for c in timing.times)
    assert timing.flops is not None and all(f > 0 for f in timing.flops.values())


def test_the_participants_a_server_configures_are_checked():
    sim, server = watched("train.participation=0.5")
    configure = server.configure

    def drops_one(rnd, selected):
        return configure(rnd, selected[1:])

    server.configure = drops_one
    with pytest.raises(MessageError, match="configured clients .* but the round selected"):
        sim.step()
    sim, server = watched("eval.new_clients=0.34", "train.participation=0.5")
    configure = server.configure
    held = sim.federation.held_out[0]

    def invites_a_held_out_one(rnd, selected):
        return configure(rnd, sorted({*selected, held}))

    server.configure = invites_a_held_out_one
    with pytest.raises(MessageError, match="may add only clients that train"):
        sim.step()


def test_a_server_may_invite_clients_that_train_beyond_the_sample():
    sim, server = watched("train.participation=0.5")
    configure = server.configure
    server.configure = lambda rnd, selected: configure(rnd, sim.federation.trained)
    row = sim.step()
    assert row["clients"] == sim.federation.num_clients
    assert server.records[0][1] == list(range(sim.federation.num_clients))


def test_the_engine_never_looks_at_which_methods_a_server_overrides():
    for path in (SRC / "engine").glob("*.py"):
        text = path.read_text()
        assert "is not Server." not in text and "type(self.server)" not in text, path.name
