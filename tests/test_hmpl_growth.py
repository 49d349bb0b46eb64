"""HMPL's Sup growth bounded as Sec. III-C2 bounds it (algorithm.growth_revert): a Sup model
whose time at a stage passes the growth bound goes back to the stage before and stays."""

import json

import pytest
import torch

from edgepfl.algorithms.hmpl import ip_names, shared_names
from edgepfl.engine.simulation import CHECKPOINT, Simulation
from edgepfl.federation.messages import Message, MessageError
from edgepfl.io import write_json
from edgepfl.models.hmpl_tiers import ORD, STAGE, stage_model
from tests.conftest import fast_config, without_wall
from tests.test_hmpl import HMPL, SMALL, _empty, _grow, _ranked, _sim

DIMS = (1, 10)


# -- the server's decisions -----------------------------------------------------------------
def test_a_sup_model_past_the_bound_goes_back_once_and_never_grows_again():
    _, server = _ranked()  # thresholds: lower 3, upper 6 (the bound); Sup: clients 1, 2, 5
    assert server.hp.growth_revert  # the default
    assert _grow(server, 1, 2, 5.9) == {"tier": "sup", "depth": 1}  # within: grows
    assert _grow(server, 1, 3, 6.1) == {"tier": "sup", "depth": 2}  # past it at stage 2 ...
    assert server.depths[1] == 1 and server.stopped[1]  # ... back to stage 1
    for rnd in range(4, 8):  # well within the bound from now on, and still stage 1
        assert _grow(server, 1, rnd, 0.5) == {"tier": "sup", "depth": 1}
        assert server.depths[1] == 1
    assert server.kept(1) == (1, 0.5)  # the latest time of the kept stage
    # a client under the bound grows to sup_max_depth and stays there, not stopped
    assert _grow(server, 5, 2, 2.0) == {"tier": "sup", "depth": 1}
    for rnd in (3, 4):
        assert _grow(server, 5, rnd, 5.0) == {"tier": "sup", "depth": 2}
    assert server.depths[5] == server.hp.sup_max_depth == 2 and not server.stopped[5]
    assert server.kept(5) == (2, 5.0)
    # past the bound at stage 1, the Sup model's first: it stays at stage 1 (never Ord)
    assert _grow(server, 2, 2, 7.0) == {"tier": "sup", "depth": 1}
    assert _grow(server, 2, 3, 0.1) == {"tier": "sup", "depth": 1}
    assert server.depths[2] == 1 and server.stopped[2] and server.tiers[2] == "sup"
    assert server.kept(2) == (1, 0.1)


def test_without_growth_revert_a_model_past_the_bound_keeps_the_stage_that_broke_it():
    _, server = _ranked("algorithm.growth_revert=false")
    assert _grow(server, 1, 2, 5.9) == {"tier": "sup", "depth": 1}
    assert _grow(server, 1, 3, 6.1) == {"tier": "sup", "depth": 2}
    assert _grow(server, 1, 4, 0.5) == {"tier": "sup", "depth": 2}  # stopped, not shrunk
    assert server.depths[1] == 2 and server.stopped[1]
    assert server.kept(1) == (2, 0.5)


def test_tiers_json_reports_each_sup_clients_kept_stage_and_time_against_the_bound(tmp_path):
    sim, server = _ranked()
    _grow(server, 1, 2, 5.9)
    _grow(server, 1, 3, 6.5)  # goes back to stage 1, timed at 5.9 there
    _grow(server, 2, 2, 7.0)  # past the bound at stage 1: stays, its time reported as it is
    server.write_artifacts(tmp_path, plots=False)
    written = json.loads((tmp_path / "tiers.json").read_text())
    assert (written["growth_bound"], written["bound_s"], written["growth_revert"]) == \
        ("upper", 6.0, True)
    rows = {c["client"]: c for c in written["clients"]}
    assert {k: rows[1][k] for k in ("depth", "kept_depth", "kept_time_s", "within_bound",
                                    "reverted_from", "growth_stopped")} == \
        {"depth": 1, "kept_depth": 1, "kept_time_s": 5.9, "within_bound": True,
         "reverted_from": 2, "growth_stopped": True}
    assert (rows[2]["kept_depth"], rows[2]["kept_time_s"], rows[2]["within_bound"],
            rows[2]["reverted_from"]) == (1, 7.0, False, None)
    # a Sup client never trained on its Sup model (not selected since the ranking)
    assert (rows[5]["kept_depth"], rows[5]["kept_time_s"], rows[5]["within_bound"]) == \
        (None, None, None)
    assert "kept_depth" not in rows[0]  # Ord


def test_a_checkpoint_from_before_the_stage_times_loads_them_as_unknown():
    server = _ranked()[1]
    _grow(server, 1, 2, 5.9)
    tensors, meta = server.save_state()
    assert meta["sup_times"][1] == [5.9, None]
    del meta["sup_times"]
    again = _ranked()[1]
    again.load_state(tensors, meta)
    assert again.depths == server.depths and again.sup_times == [[None, None]] * 10
    assert "sup_times" not in _sim("algorithm.name=hmpl_s").server.state


# -- the client -----------------------------------------------------------------------------
def test_the_client_goes_back_one_stage_and_its_dropped_lateral_is_gone():
    sim = _sim(*HMPL)
    client, server, gen = sim.client, sim.server, torch.Generator()
    data = _empty(sim.train_data[0])  # no step: what is loaded is what comes out

    def told(stage):
        return Message(dict(server.model_for(stage)), {"tier": "sup", "depth": stage})

    sup1 = client.update(0, told(1), client.init_state(0, {}), data, gen).state
    sup2 = client.update(0, told(2), sup1, data, gen).state
    sup2 = {**sup2, "ip_lateral1.weight": sup2["ip_lateral1.weight"] + 1,
            "ip_lateral2.weight": sup2["ip_lateral2.weight"] + 2}  # as if trained
    request = client.fit_request(0, told(1), sup2, data, gen)
    assert set(request.weights) == set(shared_names(1, DIMS)) | set(ip_names(1, DIMS))
    assert request.trainer is client.trainer_at(1)  # trains (and is priced as) stage 1
    assert torch.equal(request.weights["ip_lateral2.weight"], sup2["ip_lateral2.weight"])
    back = client.update(0, told(1), sup2, data, gen)
    assert int(back.state[STAGE]) == 1
    assert set(back.reply.tensors) == set(shared_names(1, DIMS))  # no IP layer, no lateral1
    assert torch.equal(back.state["ip_lateral2.weight"], sup2["ip_lateral2.weight"])
    # the engine keeps an entry once written, so the dropped lateral is zeroed
    assert not back.state["ip_lateral1.weight"].any() and not back.state["ip_lateral1.bias"].any()
    # one stage back only, never out of the Sup tier
    for state in (sup2, sup1):
        with pytest.raises(MessageError, match="cannot turn into"):
            client.update(0, Message(dict(server.model_for(ORD)), {}), state, data, gen)
    # without growth_revert a Sup model only grows, as before the setting
    old = _sim(*HMPL, "algorithm.growth_revert=false")
    with pytest.raises(MessageError, match="cannot turn into"):
        old.client.update(0, told(1), sup2, data, gen)


# -- a whole run ----------------------------------------------------------------------------
REVERTING = (*HMPL, *SMALL, "train.rounds=4")  # a Sup client goes back after round 3


def _recording(sim: Simulation) -> list[dict]:
    """Each round's per-client FLOPs and times (ranking measure) as the server sees them."""
    seen: list[dict] = []
    observe = sim.server.observe_times

    def record(rnd, times, flops=None, compute=None):
        seen.append({"flops": dict(flops or {}), "time": dict(compute or times)})
        return observe(rnd, times, flops, compute)

    sim.server.observe_times = record
    return seen


@pytest.fixture(scope="module")
def reverting():
    sim = Simulation(fast_config(*REVERTING), progress=False)
    seen = _recording(sim)
    sends = []
    configure = sim.server.configure
    sim.server.configure = lambda rnd, sel: sends.append(configure(rnd, sel)) or sends[-1]
    sim.run()
    return sim, seen, sends


def test_in_a_run_the_reverted_client_trains_and_is_priced_at_the_stage_it_keeps(reverting, tmp_path):
    sim, seen, sends = reverting
    server = sim.server
    (back,) = [c for c in range(6) if server.tiers[c] == "sup" and server.stopped[c]]
    assert server.depths[back] == 1 and server.sup_times[back][1] is not None
    assert [sends[r][back].meta["depth"] for r in (1, 2, 3)] == [1, 2, 1]
    # round 4 at stage 1 costs what round 2 at stage 1 did, less than round 3 at stage 2
    assert seen[3]["flops"][back] == seen[1]["flops"][back] < seen[2]["flops"][back]
    assert seen[3]["time"][back] == seen[1]["time"][back] <= server.bound() < seen[2]["time"][back]
    row = sim.clients.row(back)
    assert int(row[STAGE]) == 1 and not row["ip_lateral1.weight"].any()
    assert server.kept(back) == (1, seen[3]["time"][back])
    # the Sup tier's model in the summary is the deepest one kept: the other Sup client's
    other = next(c for c in range(6) if server.tiers[c] == "sup" and c != back)
    assert server.kept(other)[0] == 2
    assert sim.summary()["tier_costs"]["sup"]["stage_model"] == stage_model(2)
    write_json(tmp_path / "summary.json", sim.summary())
    server.write_artifacts(tmp_path, plots=False)
    rows = json.loads((tmp_path / "tiers.json").read_text())["clients"]
    assert all(c["within_bound"] for c in rows if c["tier"] == "sup")


def test_a_run_resumed_after_a_revert_equals_a_straight_one(reverting, tmp_path):
    straight, *_ = reverting
    first = Simulation(fast_config(*REVERTING), tmp_path, progress=False)
    for _ in range(3):
        first.step()
    assert any(first.server.stopped)  # the checkpoint falls after the revert decision
    first.save_checkpoint()
    resumed = Simulation(fast_config(*REVERTING), tmp_path, progress=False)
    resumed.load_checkpoint(tmp_path / CHECKPOINT)
    resumed.step()
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    for attr in ("tiers", "depths", "stopped", "times", "thresholds", "sup_times"):
        assert getattr(resumed.server, attr) == getattr(straight.server, attr), attr
    for name, value in straight.server.shared.items():
        assert torch.equal(resumed.server.shared[name], value), name
    for key, stack in straight.clients.tensors.items():
        assert torch.equal(resumed.clients.tensors[key], stack), key
