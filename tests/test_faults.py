"""Injected client faults (``faults.*``): who fails is the seed's choice alone, a failed
client's state and bytes stay as they were, a round nobody replied in changes no server."""

import math

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS
from edgepfl.engine.rounds import Rounds
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.faults import draw_faults, share
from tests.conftest import fast_config, resumed_and_straight, without_wall

OWN_MODEL = {"hmpl": ["model.name=hmpl_tiers"], "hmpl_s": ["model.name=hmpl_ord"]}
HIERARCHICAL = {"hierfavg": ["topology.edges=2", "topology.edge_rounds=2"],
                "hierbayes": ["topology.edges=2", "topology.edge_rounds=2"]}


def config(name: str, *overrides: str):
    return fast_config(f"algorithm.name={name}", "train.rounds=2", *HIERARCHICAL.get(name, []),
                       *OWN_MODEL.get(name, []), *overrides)


def part_state(part) -> tuple[dict, dict]:
    tensors, meta = part.save_state()
    return {k: v.clone() for k, v in tensors.items()}, meta


def assert_same_state(before: tuple[dict, dict], after: tuple[dict, dict], what: str) -> None:
    assert before[0].keys() == after[0].keys(), what
    for k, v in before[0].items():
        assert torch.equal(v, after[0][k]), f"{what}: {k} changed"
    assert before[1] == after[1], what


def recording(sim: Simulation) -> list:
    """The deliveries of every client step of ``sim``'s rounds, as they happen."""
    seen = []
    train = sim.rounds.train

    def spy(record, step, down):
        delivery = train(record, step, down)
        seen.append((step, sorted(down), delivery))
        return delivery

    sim.rounds.train = spy
    return seen


def test_the_draw_is_the_seeds_alone_and_hits_the_share_on_average():
    clients = list(range(0, 40, 2))
    a = draw_faults(3, 7, clients, 0.3, 0.5)
    assert a == draw_faults(3, 7, list(reversed(clients)), 0.3, 0.5)
    assert a != draw_faults(3, 8, clients, 0.3, 0.5)
    assert not a.dropped & a.stragglers
    assert a.dropped | a.stragglers <= set(clients)
    assert len(a.dropped) == 6  # 0.3 x 20 is whole: no rounding either way
    assert len(a.stragglers) == 7  # 0.5 x 14 rounds down or up: 7 either way
    # below one client per round the expected share is still exact
    drops = [len(draw_faults(0, s, [1, 2], 0.3, 0.0).dropped) for s in range(4000)]
    assert sum(drops) / (2 * 4000) == pytest.approx(0.3, abs=0.02)
    assert draw_faults(0, 1, clients, 1.0, 0.0).dropped == set(clients)
    assert draw_faults(0, 1, clients, 0.0, 0.0).dropped == set()
    assert share(0.25, 4, 0.999) == 1 and share(0.25, 4, 0.0) == 1 and share(0.2, 4, 0.1) == 0


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_dropped_clients_are_untouched_and_every_algorithm_completes(name):
    sim = Simulation(config(name, "faults.drop_rate=0.3"), progress=False)
    seen = recording(sim)
    dropped_any = 0
    for _ in range(2):
        rows = {cid: part_state_row(sim, cid) for cid in range(sim.federation.num_clients)}
        up, down = sim.rounds.ledger.bytes_up.copy(), sim.rounds.ledger.bytes_down.copy()
        first = len(seen)
        row = sim.step()
        failed = [c for _, _, d in seen[first:] for c in d.failed]
        assert row["clients_failed"] == len(failed)
        dropped = {c for _, _, d in seen[first:] for c in d.dropped}
        # a client dropped in every one of its steps this round was never reached
        for cid in dropped:
            if all(cid not in d.replies for _, _, d in seen[first:]):
                for k, v in rows[cid].items():
                    assert torch.equal(v, sim.clients.row(cid)[k]), (cid, k)
                assert sim.rounds.ledger.bytes_up[cid] == up[cid] and sim.rounds.ledger.bytes_down[cid] == down[cid]
        dropped_any += len(dropped)
    assert dropped_any > 0
    assert sim.rounds.summary()["clients_failed_total"] == sum(r["clients_failed"] for r in sim.metrics)


def part_state_row(sim: Simulation, cid: int) -> dict:
    return {k: v.clone() for k, v in sim.clients.row(cid).items()}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_round_nobody_replied_in_changes_no_server_state(name):
    sim = Simulation(config(name, "faults.drop_rate=1"), progress=False)
    sim.step()  # edges take their first model from the cloud in a round's downlink
    before = [part_state(p) for p in (sim.server, *sim.edges)]
    row = sim.step()
    assert row["clients_failed"] >= row["clients"] > 0
    assert row["bytes_up_client"] == 0 and row["bytes_down_client"] == 0
    for part, state in zip((sim.server, *sim.edges), before, strict=True):
        assert_same_state(state, part_state(part), f"{name}: {type(part).__name__}")


def test_the_same_clients_fail_for_every_algorithm():
    failed = {name: Simulation(config(name, "faults.drop_rate=0.4", "train.participation=0.5"),
                               progress=False).run().summary["clients_failed_per_client"]
              for name in ("fedavg", "kapc", "local")}
    assert failed["fedavg"] == failed["kapc"] == failed["local"]
    assert sum(failed["fedavg"]) > 0


def test_drops_reweight_fedavg_over_the_replies_that_arrived():
    sim = Simulation(config("fedavg", "faults.drop_rate=0.5"), progress=False)
    seen = recording(sim)
    got = {}
    aggregate = sim.server.aggregate
    sim.server.aggregate = lambda rnd, replies: (got.update(replies), aggregate(rnd, replies))
    sim.step()
    (_, asked, delivery), = seen
    assert sorted(got) == sorted(delivery.arrived) == sorted(set(asked) - delivery.dropped)
    assert delivery.dropped


def test_a_late_reply_is_not_aggregated_and_the_round_waits_for_the_deadline():
    # a deadline past every client's time without faults, short of a 1,000-fold compute
    plain = Simulation(config("fedavg", "train.rounds=1"), progress=False)
    plain.step()
    slowest = plain.metrics[0]["t_round"]
    assert math.isfinite(slowest) and slowest > 0
    deadline = 1.5 * slowest
    sim = Simulation(config("fedavg", "train.rounds=1", "faults.straggler_rate=0.5",
                            "faults.straggler_delay=1000", f"faults.deadline={deadline}"),
                     progress=False)
    seen = recording(sim)
    row = sim.step()
    (_, _, delivery), = seen
    assert delivery.late == delivery.slowdown.keys() and len(delivery.late) == 3
    assert row["clients_failed"] == 3
    for cid in delivery.late:  # it received the model and trained, its reply came too late
        assert sim.rounds.ledger.bytes_down[cid] > 0 and sim.rounds.ledger.bytes_up[cid] == 0
    assert row["t_round"] == pytest.approx(deadline + row["t_server"], rel=1e-9)
    # without the deadline the stragglers reply and the round waits for them
    waited = Simulation(config("fedavg", "train.rounds=1", "faults.straggler_rate=0.5",
                               "faults.straggler_delay=1000"), progress=False).step()
    assert waited["clients_failed"] == 0 and waited["t_round"] > 2 * slowest


@pytest.mark.parametrize("timing", ["phase", "chain"])
def test_each_edge_round_ends_by_the_deadline(timing):
    """In a hierarchy each edge's clients wait for each other's phases, not for another
    edge's: lateness is decided per edge, and every edge round the cloud's row sums ends
    by the deadline."""
    plain = Simulation(config("hierfavg", "train.rounds=1", f"system.round_timing={timing}"),
                       progress=False).step()
    # just short of the critical edge's mean edge round: under phase timing some clients
    # whose own chains fit must still be given up on
    deadline = 0.95 * (plain["t_down"] + plain["t_compute"] + plain["t_up"]) / 2
    sim = Simulation(config("hierfavg", "train.rounds=1", f"system.round_timing={timing}",
                            f"faults.deadline={deadline}"), progress=False)
    seen = recording(sim)
    row = sim.step()
    assert any(d.late for _, _, d in seen)
    # the critical edge's two edge rounds, each at most the deadline
    assert row["t_down"] + row["t_compute"] + row["t_up"] + row["t_wait"] \
        <= 2 * deadline * (1 + 1e-9)


def test_a_run_with_faults_resumes_to_the_straight_runs_figures(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=kapc",
                                             "faults.drop_rate=0.4")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    assert resumed.rounds.ledger.failures.tolist() == straight.rounds.ledger.failures.tolist()


def test_faults_need_what_they_act_on():
    with pytest.raises(ConfigError, match="count_flops"):
        Simulation(config("fedavg", "faults.deadline=1", "system.count_flops=false"),
                   progress=False)
    sim = Simulation(config("fedavg", "faults.drop_rate=0.3"), progress=False)

    class Real(type(sim.transport)):
        counts_flops = False  # a runtime whose clients are real (Flower)

    sim.transport.__class__ = Real
    with pytest.raises(ConfigError, match="on Flower clients fail"):
        Rounds(sim.rounds.parts, sim.transport, sim.system, sim.flops)
    with pytest.raises(ConfigError):
        fast_config("faults.drop_rate=1.5")


# -- faults.client_timeout: a hung client step in a worker process -----------------------------
def test_a_client_past_client_timeout_fails_its_round_and_its_worker_is_replaced(tmp_path,
                                                                                  monkeypatch):
    import csv
    import time

    import edgepfl.engine.simulation as simulation

    step = simulation.client_step

    def hangs(cfg, part, step_, cid, *args):
        if cid == 2:
            time.sleep(120)  # forked workers inherit this patch: the pool starts later
        return step(cfg, part, step_, cid, *args)

    monkeypatch.setattr(simulation, "client_step", hangs)
    out = tmp_path / "run"
    started = time.monotonic()
    result = simulation.start_run(config("fedavg", "train.workers=2", "faults.client_timeout=3"),
                                  out, progress=False)
    assert time.monotonic() - started < 60
    assert [r["clients_failed"] for r in result.metrics] == [1, 1]
    assert result.summary["clients_failed_per_client"] == [0, 0, 2, 0, 0, 0]
    with open(out / "failures.csv") as f:
        reasons = {int(r["client"]): r["reason"] for r in csv.DictReader(f)}
    assert reasons == {2: "no reply: its step ran past faults.client_timeout = 3 s"}


def test_a_time_limit_nobody_reaches_gives_the_sequential_runs_figures():
    seq = Simulation(config("fedavg"), progress=False)
    seq.run()
    timed = Simulation(config("fedavg", "train.workers=2", "faults.client_timeout=600"),
                       progress=False)
    timed.run()
    assert without_wall(timed.metrics) == without_wall(seq.metrics)
    a, b = seq.clients.state_dict("c/"), timed.clients.state_dict("c/")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_client_timeout_without_worker_processes_is_refused_at_set_up():
    for setting in ("train.workers=1", "train.batch_clients=true"):
        with pytest.raises(ConfigError, match="faults.client_timeout = 3 .* needs "
                                              "train.workers > 1"):
            Simulation(config("fedavg", setting, "faults.client_timeout=3"), progress=False)


def test_a_worker_that_hangs_is_replaced_and_the_others_keep_their_work():
    import os

    from edgepfl.engine.workers import TimedPool

    pool = TimedPool(2, _sleep_or_pid)
    try:
        first = list(pool.map([0, 30, 0.01, 0.02], timeout=2, on_timeout=lambda t: "late"))
        assert first[1] == "late" and all(isinstance(r, int) for r in first[::2])
        assert first[0] != os.getpid()
        again = list(pool.map([0, 0]))  # the replaced worker serves as the others do
        assert len(again) == 2 and all(isinstance(r, int) for r in again)
        with pytest.raises(ValueError, match="negative"):  # a task's error is the caller's
            pool.map([0, -1])
        assert len(list(pool.map([0, 0, 0]))) == 3  # fresh workers after it
    finally:
        pool.close()


def _sleep_or_pid(seconds: float) -> int:
    import os
    import time

    time.sleep(seconds)
    return os.getpid()
