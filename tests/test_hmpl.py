"""Defining properties of HMPL and HMPL_S (edgepfl.algorithms.hmpl) and of the one-module
model they run on (edgepfl.models.hmpl_tiers)."""

import json
import math

import pytest
import torch

from edgepfl.algorithms.hmpl import HMPLClient, tier_params
from edgepfl.engine.ledger import metric_columns
from edgepfl.engine.parts import resolve
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.io import write_csv, write_json
from edgepfl.models import LayerSpec, build_model
from edgepfl.models.hmpl_nets import layer_role
from edgepfl.models.hmpl_tiers import COM, ORD, STAGE, STAGES, HMPLTiers, stage_model
from edgepfl.system.memory import training_step_bytes
from edgepfl.training.client_data import ClientData
from tests.conftest import (
    crash_after,
    fast_config,
    forget_algorithm_setting,
    resumed_and_straight,
    without_wall,
)

HMPL = ["algorithm.name=hmpl", "model.name=hmpl_tiers"]
SMALL = ["dataset.fraction=0.1", "train.batch_size=16"]  # 200 training images, 8x8


def _sim(*overrides: str, clients: int = 6) -> Simulation:
    return Simulation(fast_config(*SMALL, f"partition.clients={clients}", *overrides),
                      progress=False)


def _shared(names) -> bool:
    return all(layer_role(n) in ("bs", "cp") for n in names)


# -- the model ----------------------------------------------------------------------------
@pytest.mark.parametrize("stage", STAGES)
def test_hmpl_tiers_computes_exactly_its_stage_tier_model(stage):
    torch.manual_seed(3)
    tier = build_model(stage_model(stage), (1, 28, 28), 10)
    union = HMPLTiers(1, 10)
    own = tier.state_dict()
    union.load_state_dict({**{k: torch.randn_like(p) for k, p in union.named_parameters()},
                           **own, STAGE: torch.tensor(stage)})
    x = torch.randn(3, 1, 21, 27)
    assert torch.equal(union(x), tier(x))
    # a layer its tier lacks is never read
    for name, p in union.named_parameters():
        if name not in own:
            p.data.fill_(float("nan"))
    assert torch.equal(union(x), tier(x))


def test_hmpl_tiers_starts_from_hmpl_ords_bs_layers_and_ends_in_the_classifier():
    torch.manual_seed(7)
    ordinary = build_model("hmpl_ord", (1, 28, 28), 10).state_dict()
    torch.manual_seed(7)
    union = build_model("hmpl_tiers", (1, 28, 28), 10)
    state = union.state_dict()
    assert all(torch.equal(state[k], v) for k, v in ordinary.items())
    spec = LayerSpec.from_model(union)
    assert spec.names[-1] == "fc3" and spec.buffers == (STAGE,)
    assert set(spec.param_names) == {n for s in STAGES for n in tier_params(s, (1, 10))}
    union.stage.fill_(5)
    with pytest.raises(ValueError, match="stage = 5"):
        union(torch.zeros(1, 1, 8, 8))


# -- configuration ------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,match", [
    (["algorithm.name=hmpl", "model.name=cnn_small"], r"model.name = 'hmpl_tiers'.*got 'cnn_small'"),
    (["algorithm.name=hmpl", "model.name=hmpl_ord"], r"'hmpl_tiers'.*got 'hmpl_ord'"),
    (["algorithm.name=hmpl_s", "model.name=cnn_small"], r"'hmpl_ord' or 'hmpl_tiers'.*got 'cnn_small'"),
    ([*HMPL, "algorithm.tier_ratio=[0.3, 0.4, 0.4]"], r"three shares .* sum to 1"),
    ([*HMPL, "algorithm.tier_ratio=[0.5, 0.5]"], r"tier_ratio"),
    ([*HMPL, "algorithm.sup_max_depth=3"], r"sup_max_depth"),
])
def test_a_model_or_setting_it_cannot_run_is_refused_naming_what_can(overrides, match):
    with pytest.raises(ConfigError, match=match):
        Simulation(fast_config(*overrides), progress=False)


def test_without_a_model_name_each_runs_its_own_model():
    for name, model in (("hmpl", "hmpl_tiers"), ("hmpl_s", "hmpl_ord")):
        assert resolve(fast_config(f"algorithm.name={name}")).model.name == model


# -- tiers ----------------------------------------------------------------------------------
TIMES = [5.0, 1.0, 3.0, 3.0, 9.0, 2.0, 7.0, 3.0, 8.0, 4.0]


def _ranked(*overrides: str, times=TIMES):
    sim = _sim(*HMPL, *overrides, clients=10)
    server = sim.server
    server.configure(1, list(range(len(times))))
    server.observe_times(1, dict(enumerate(times)))
    return sim, server


def test_round_one_times_split_the_clients_3_4_3_slowest_to_com_ties_by_id():
    # com_align = kept: conv3 goes to a Com client until its reply (fit: every Com round)
    _, server = _ranked("algorithm.com_align=kept")
    # by (time, id): 1 5 2 | 3 7 9 0 | 6 8 4 -- clients 2, 3 and 7 tie at 3.0
    assert server.tiers == ["ord", "sup", "sup", "ord", "com", "sup", "com", "ord", "com", "ord"]
    assert server.thresholds == {"lower": 3.0, "upper": 6.0}
    # the order replies arrive in changes nothing
    _, again = _ranked()
    again.tiers = [None] * 10
    again.thresholds = None
    again.observe_times(1, dict(reversed(list(enumerate(TIMES)))))
    assert again.tiers == server.tiers
    # and the instruction goes out with the next round's model
    down = server.configure(2, list(range(10)))
    assert down[4].meta == {"tier": "com"} and down[1].meta == {"tier": "sup", "depth": 1}
    assert down[0].meta == {}  # keep: an Ord round is FedAvg's message
    assert "cp_merge.weight" in down[1].tensors
    assert set(down[0].tensors) == set(tier_params(ORD, (1, 10)))
    # the Com model lacks conv3, but until a reply on it arrives its message carries the
    # Ord model's conv3, which generation = preserve derives ip_align from
    com = set(server.model_for(COM))
    assert "conv3.weight" not in com
    assert set(down[4].tensors) == com | {"conv3.weight", "conv3.bias"}
    server.aligned[4] = True
    assert set(server.configure(3, [4])[4].tensors) == com


def test_a_client_first_timed_later_gets_its_tier_from_the_thresholds():
    _, server = _ranked(times=TIMES[:6])  # 6 ranked: 2 Sup, 2 Ord, 2 Com; 4 not yet
    assert server.tiers[6:] == [None] * 4
    assert server.thresholds == {"lower": 2.5, "upper": 4.0}  # 1 2 | 3 3 | 5 9
    server.configure(2, [6, 7, 8, 9])
    server.observe_times(2, {6: 2.5, 7: 3.9, 8: 4.1})
    assert server.tiers[6:] == ["sup", "ord", "com", None]
    # 2 ranked, 1 late, and the one not timed yet, which trains the Ord model
    assert server.round_metrics()["clients_ord"] == 4


def test_seeded_round_times_give_every_tier_and_the_same_tiers_again():
    tiers = []
    for _ in range(2):
        sim = _sim(*HMPL, "train.rounds=1", clients=10)
        sim.step()
        tiers.append(sim.server.tiers)
    assert tiers[0] == tiers[1]
    assert sorted(tiers[0]) == ["com"] * 3 + ["ord"] * 4 + ["sup"] * 3


def _grow(server, cid: int, rnd: int, time: float) -> dict:
    msg = server.configure(rnd, [cid])[cid]
    server.observe_times(rnd, {cid: time})
    return msg.meta


def test_a_sup_model_grows_while_its_time_stays_under_the_bound_then_stops():
    _, server = _ranked()  # thresholds: lower 3, upper 6; clients 1, 2, 5 are Sup
    assert _grow(server, 1, 2, 5.9) == {"tier": "sup", "depth": 1}
    assert _grow(server, 1, 3, 1.0) == {"tier": "sup", "depth": 2}
    assert _grow(server, 1, 4, 1.0) == {"tier": "sup", "depth": 2}  # SUP_MAX_DEPTH
    assert _grow(server, 2, 2, 6.1) == {"tier": "sup", "depth": 1}  # past the bound ...
    assert _grow(server, 2, 3, 0.1) == {"tier": "sup", "depth": 1}  # ... it stops for good
    assert server.stopped[2] and not server.stopped[1]
    # an Ord or Com client never grows, however fast
    assert _grow(server, 0, 2, 0.1) == {} and _grow(server, 0, 3, 0.1) == {}
    _, lower = _ranked("algorithm.growth_bound=lower")
    assert _grow(lower, 1, 2, 4.0) == {"tier": "sup", "depth": 1}
    assert _grow(lower, 1, 3, 1.0) == {"tier": "sup", "depth": 1}
    _, flat = _ranked("algorithm.sup_max_depth=1")
    assert _grow(flat, 1, 2, 0.1) == _grow(flat, 1, 3, 0.1) == {"tier": "sup", "depth": 1}


def _empty(data: ClientData) -> ClientData:
    return ClientData(data.x, data.y, data.idx[:0])


def test_the_client_shrinks_grows_and_keeps_its_ip_layers_as_told():
    # random: each client's own draw (generation is tested below)
    sim = _sim(*HMPL, "algorithm.generation=random", "algorithm.com_align=kept")
    client: HMPLClient = sim.client
    server = sim.server
    data = _empty(sim.train_data[0])  # no step: what is loaded is what comes out
    ord_state = client.init_state(0, {})

    def told(stage):
        return Message({n: server.shared[n] for n in server.model_for(stage)},
                       {} if stage == ORD else {"tier": "com"} if stage == COM
                       else {"tier": "sup", "depth": stage})

    gen = torch.Generator()
    com = client.update(0, told(COM), ord_state, data, gen)
    assert set(com.state) == {STAGE, "ip_align.weight", "ip_align.bias"} and int(com.state[STAGE]) == COM
    assert torch.equal(com.state["ip_align.weight"],
                       client.new_layer(COM, "ip_align", 0)["ip_align.weight"])
    assert not torch.equal(com.state["ip_align.weight"],
                           client.new_layer(COM, "ip_align", 1)["ip_align.weight"])
    sup1 = client.update(0, told(1), ord_state, data, gen).state
    lateral = sup1["ip_lateral2.weight"] + 1  # as if trained
    sup2 = client.update(0, told(2), {**sup1, "ip_lateral2.weight": lateral}, data, gen).state
    assert int(sup2[STAGE]) == 2 and torch.equal(sup2["ip_lateral2.weight"], lateral)
    assert "ip_lateral1.weight" in sup2
    # Com and Sup are kept, a Sup model never leaves its tier (going back one Sup stage,
    # growth_revert, is tests/test_hmpl_growth.py's)
    for state, stage in [(com.state, ORD), (com.state, 1), (sup2, COM), (sup1, ORD)]:
        with pytest.raises(MessageError, match="cannot turn into"):
            client.update(0, told(stage), state, data, gen)
    # a download must be exactly the shared layers of the model it asks for
    bad = told(1)
    bad.tensors["ip_lateral2.weight"] = sup1["ip_lateral2.weight"]
    with pytest.raises(MessageError, match="unknown tensor 'ip_lateral2.weight'"):
        client.update(0, bad, ord_state, data, gen)
    with pytest.raises(MessageError, match="instruction"):
        client.update(0, Message(told(1).tensors, {"tier": "sup", "depth": 3}), ord_state, data, gen)


# -- aggregation ----------------------------------------------------------------------------
def _replies(server, values: dict[int, float], weights: dict[int, int]) -> dict[int, Message]:
    server.configure(2, sorted(values))
    return {c: Message({n: torch.full_like(t, values[c])
                        for n, t in server.model_for(server.stage_of(c)).items()},
                       {"num_samples": weights[c]}) for c in values}


@pytest.mark.parametrize("eta", [1.0, 0.5])
def test_bs_layers_average_over_their_holders_and_cp_over_sup_models_only(eta):
    sim = _sim(*HMPL, f"algorithm.eta={eta}", clients=4)
    server = sim.server
    server.tiers, server.depths = ["com", "ord", "sup", "sup"], [0, 0, 1, 2]
    before = {k: v.clone() for k, v in server.shared.items()}
    replies = _replies(server, {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}, {0: 1, 1: 2, 2: 3, 3: 4})
    for cid, reply in replies.items():
        server.check_reply(cid, reply)
    server.aggregate(2, replies)
    means = {"conv1.weight": (1 + 4 + 9 + 16) / 10,  # every model holds it
             "fc3.bias": (1 + 4 + 9 + 16) / 10,
             "conv3.weight": (4 + 9 + 16) / 9,  # not the Com model (Sec. III-E)
             "cp_merge.weight": (9 + 16) / 7}  # Sup models only (Eqs. 7-8)
    for name, mean in means.items():
        expected = before[name] + eta * (mean - before[name])  # Eqs. 6 and 8
        torch.testing.assert_close(server.shared[name], expected, rtol=1e-6, atol=1e-6)
    assert not any(layer_role(n) == "ip" for n in server.shared)
    # a layer no reply holds keeps its value
    server.tiers = ["com"] * 4
    after = {k: v.clone() for k, v in server.shared.items()}
    server.aggregate(3, _replies(server, {0: 7.0}, {0: 5}))
    assert torch.equal(server.shared["conv3.weight"], after["conv3.weight"])
    assert torch.equal(server.shared["cp_merge.weight"], after["cp_merge.weight"])
    assert not torch.equal(server.shared["conv1.weight"], after["conv1.weight"])


def test_a_reply_must_be_the_shared_layers_of_its_tier():
    sim = _sim(*HMPL, clients=4)
    server = sim.server
    server.tiers, server.depths = ["com", "ord", "sup", "sup"], [0, 0, 1, 2]
    replies = _replies(server, {0: 1.0, 1: 1.0, 2: 1.0}, {0: 1, 1: 1, 2: 1})
    leak = {**replies[2].tensors, "ip_lateral2.weight": torch.zeros(256, 128, 1, 1)}
    with pytest.raises(MessageError, match="unknown tensor 'ip_lateral2.weight'"):
        server.check_reply(2, Message(leak, {"num_samples": 1}))
    with pytest.raises(MessageError, match="unknown tensor 'conv3.weight'"):  # Com has none
        server.check_reply(0, Message(replies[1].tensors, {"num_samples": 1}))
    with pytest.raises(MessageError, match="lacks"):
        server.check_reply(2, replies[1])


# -- a whole run ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run():
    """3 rounds on 6 clients (2 Com, 2 Ord, 2 Sup), every message recorded."""
    sim = _sim(*HMPL)
    server = sim.server
    downs, ups = [], []
    configure, aggregate = server.configure, server.aggregate
    server.configure = lambda rnd, sel: downs.append(configure(rnd, sel)) or downs[-1]
    server.aggregate = lambda rnd, rep: (ups.append(dict(rep)), aggregate(rnd, rep))[1]
    up_before, accs = [], []
    for _ in range(3):
        up_before.append(sim.rounds.ledger.bytes_up.copy())
        sim.step()
        accs.append(list(sim.rounds.client_acc))
    return sim, downs, ups, up_before, accs


def test_ip_layers_are_never_uploaded_or_downloaded(run):
    sim, downs, ups, *_ = run
    for rnd in range(3):
        for cid, msg in downs[rnd].items():
            assert _shared(msg.tensors), (rnd, cid)
        for cid, msg in ups[rnd].items():
            assert _shared(msg.tensors), (rnd, cid)
    assert _shared(sim.server.eval_message(0).tensors)
    # ... yet the Com and Sup clients hold theirs
    for cid, tier in enumerate(sim.server.tiers):
        held = {n for n in sim.clients.row(cid) if n != STAGE}
        expected = {"com": {"ip_align"}, "ord": set(), "sup": {"ip_lateral2", "ip_lateral1"}}[tier]
        assert {n.split(".")[0] for n in held} == expected, (cid, tier)


def test_the_personal_model_is_the_tier_model_of_server_and_own_layers(run):
    sim, *_ = run
    shared = sim.server.shared
    for cid, tier in enumerate(sim.server.tiers):
        state = sim.clients.row(cid)
        model = sim.client.personal_model(state, sim.server.eval_message(cid))
        stage = int(state[STAGE])
        assert tier == ("com" if stage == COM else "ord" if stage == ORD else "sup")
        assert int(model[STAGE]) == stage
        for n in tier_params(stage, (1, 10)):
            assert torch.equal(model[n], state[n] if layer_role(n) == "ip" else shared[n]), n


def test_bytes_per_tier_are_what_each_tier_sends(run):
    sim, downs, ups, up_before, _ = run
    row = sim.metrics[1]  # round 2: every client holds its tier's model
    up = up_before[2] - up_before[1]  # the engine's count, per client
    assert [int(b) for b in up] == [ups[1][c].nbytes for c in range(6)]
    tiers = sim.server.tiers
    per = {t: [int(up[c]) for c, x in enumerate(tiers) if x == t] for t in ("com", "ord", "sup")}
    assert max(per["com"]) < min(per["ord"]) and max(per["ord"]) < min(per["sup"])
    # the weights: Com lacks conv3, Sup adds the CP layer (the sample count differs by client)
    size = {n: t.numel() * t.element_size() for n, t in sim.server.shared.items()}
    payload = {t: {ups[1][c].payload_bytes for c, x in enumerate(tiers) if x == t}
               for t in ("com", "ord", "sup")}
    (ordinary,), (com,), (sup,) = payload["ord"], payload["com"], payload["sup"]
    assert ordinary - com == size["conv3.weight"] + size["conv3.bias"]
    assert sup - ordinary == size["cp_merge.weight"] + size["cp_merge.bias"]
    for tier in ("com", "ord", "sup"):
        assert row[f"bytes_up_{tier}"] == sum(m.nbytes for c, m in ups[1].items()
                                              if sim.server.tiers[c] == tier)
    assert sum(row[f"bytes_up_{t}"] for t in ("com", "ord", "sup")) == row["bytes_up"]
    assert sum(row[f"bytes_down_{t}"] for t in ("com", "ord", "sup")) == row["bytes_down"]
    assert (row["clients_com"], row["clients_ord"], row["clients_sup"]) == (2, 2, 2)
    summary = sim.summary()
    assert summary["bytes_up_sup_total"] == sum(r["bytes_up_sup"] for r in sim.metrics)
    assert summary["tiers"] == {"com": 2, "ord": 2, "sup": 2}


def test_each_tiers_time_flops_and_step_memory_are_those_of_its_own_models_rounds(run):
    sim, *_ = run
    rows = sim.metrics
    # round 1: every client trains the Ord model, so only the clients ranked Ord count
    assert [tuple(r[f"trained_{t}"] for t in ("com", "ord", "sup")) for r in rows] == \
        [(0, 2, 0), (2, 2, 2), (2, 2, 2)]
    assert math.isnan(rows[0]["time_com"]) and math.isnan(rows[0]["flops_sup"])
    for row in rows[1:]:  # every client trained its tier's model: the tiers make up the round
        assert sum(row[f"trained_{t}"] * row[f"flops_{t}"] for t in ("com", "ord", "sup")) \
            == pytest.approx(row["flops_client"], rel=1e-12)
        assert all(row[f"time_{t}"] > 0 for t in ("com", "ord", "sup"))
    costs = sim.summary()["tier_costs"]
    for tier in ("com", "ord", "sup"):
        n = sum(r[f"trained_{tier}"] for r in rows)
        assert costs[tier]["client_rounds"] == n
        flops = sum(r[f"trained_{tier}"] * r[f"flops_{tier}"] for r in rows if r[f"trained_{tier}"])
        assert costs[tier]["flops_mean"] == pytest.approx(flops / n, rel=1e-12)
    # what one step holds: the tier models' weights, gradients and saved activations
    assert costs["sup"]["stage_model"] == "hmpl_sup2"  # both Sup models grew
    memory = {t: costs[t]["step_memory_bytes"] for t in ("com", "ord", "sup")}
    for tier in ("com", "ord", "sup"):
        model = build_model(costs[tier]["stage_model"], (1, 8, 8), 10)
        assert memory[tier] == training_step_bytes(model, (1, 8, 8), sim.cfg.train.batch_size)
        assert costs[tier]["params"] == sum(p.numel() for p in model.parameters())
    assert memory["com"]["total"] < memory["ord"]["total"] < memory["sup"]["total"]


def test_tiers_json_lists_each_clients_tier_depth_and_each_tiers_accuracy(run, tmp_path):
    sim, *_ = run
    write_json(tmp_path / "summary.json", sim.summary())  # what a finished run writes first
    sim.server.write_artifacts(tmp_path, plots=False)
    written = json.loads((tmp_path / "tiers.json").read_text())
    tiers = sim.server.tiers
    assert [c["tier"] for c in written["clients"]] == tiers
    # both Sup models grew once: their depth-1 rounds stayed under the upper threshold;
    # one's depth-2 round did not, and it went back to depth 1 (growth_revert)
    assert [c["depth"] for c in written["clients"] if c["tier"] != "sup"] == [0] * 4
    assert written["thresholds"] == sim.server.thresholds
    assert written["bound_s"] == sim.server.thresholds["upper"] and written["growth_revert"]
    sup = [c for c in written["clients"] if c["tier"] == "sup"]
    assert sorted(c["depth"] for c in sup) == [1, 2]
    for c in sup:
        assert c["kept_depth"] == c["depth"] and c["within_bound"]
        assert 0 < c["kept_time_s"] <= written["bound_s"]
        assert c["growth_stopped"] == (c["depth"] == 1)
        assert c["reverted_from"] == (2 if c["depth"] == 1 else None)
    assert all("kept_time_s" not in c for c in written["clients"] if c["tier"] != "sup")
    acc = sim.rounds.client_acc
    for tier in ("com", "ord", "sup"):
        mine = [acc[c] for c, x in enumerate(tiers) if x == tier]
        assert written["acc_final_mean"][tier] == pytest.approx(sum(mine) / len(mine), abs=1e-12)
    assert not math.isnan(sim.metrics[-1]["acc_global_mean"])
    assert written["costs"] == json.loads(json.dumps(sim.summary()["tier_costs"]))


def test_every_rounds_tier_accuracy_is_the_mean_over_that_tiers_clients(run, tmp_path):
    sim, *_, accs = run
    tiers = sim.server.tiers
    assert sorted(tiers) == ["com"] * 2 + ["ord"] * 2 + ["sup"] * 2  # ranked after round 1
    for row, acc in zip(sim.metrics, accs, strict=True):
        assert row["acc_mean"] == pytest.approx(sum(acc) / len(acc), abs=1e-12)
        for tier in ("com", "ord", "sup"):
            mine = [a for a, t in zip(acc, tiers, strict=True) if t == tier]
            assert row[f"acc_mean_{tier}"] == pytest.approx(sum(mine) / len(mine), abs=1e-12)
    final = sim.summary()["acc_mean_tier_final"]
    assert final == {t: sim.metrics[-1][f"acc_mean_{t}"] for t in ("com", "ord", "sup")}
    # the plot, from the run directory's metrics.csv
    write_csv(tmp_path / "metrics.csv", metric_columns(sim.metrics), sim.metrics)
    write_json(tmp_path / "summary.json", sim.summary())
    sim.server.write_artifacts(tmp_path, plots=True)
    assert (tmp_path / "accuracy_tiers.png").stat().st_size > 0
    assert json.loads((tmp_path / "tiers.json").read_text())["acc_final_mean"] == final


def test_before_the_ranking_every_client_counts_as_ord_and_com_and_sup_are_nan():
    server = _sim(*HMPL, clients=4).server
    figures = server.evaluation_metrics(1, [0.25, 0.5, math.nan, 1.0])
    assert figures["acc_mean_ord"] == pytest.approx(1.75 / 3)
    assert math.isnan(figures["acc_mean_com"]) and math.isnan(figures["acc_mean_sup"])
    server.tiers = ["com", "sup", "sup", None]  # a client not ranked yet is Ord
    figures = server.evaluation_metrics(2, [0.25, 0.5, math.nan, 1.0])
    assert (figures["acc_mean_com"], figures["acc_mean_ord"], figures["acc_mean_sup"]) == \
        (0.25, 1.0, 0.5)
    assert _sim("algorithm.name=hmpl_s", clients=4).server.evaluation_metrics(1, [0.5] * 4) == {}


@pytest.mark.parametrize("participation", [1.0, 0.5])
def test_with_every_client_ord_hmpl_is_hmpl_s_and_hmpl_s_is_fedavg_with_spp(participation):
    runs = {}
    for name, extra in [("hmpl", [*HMPL, "algorithm.tier_ratio=[0, 1, 0]"]),
                        ("hmpl_s", ["algorithm.name=hmpl_s", "model.name=hmpl_ord"]),
                        # FedAvg trains round 1's sample, HMPL every client (its ranking round)
                        ("hmpl_s_sampled", ["algorithm.name=hmpl_s", "model.name=hmpl_ord",
                                            "algorithm.first_round=sampled"]),
                        ("fedavg", ["algorithm.name=fedavg", "model.name=hmpl_ord"])]:
        sim = _sim(*extra, "train.rounds=2", f"train.participation={participation}", clients=4)
        sim.run()
        runs[name] = sim
    hmpl, hmpl_s, sampled, fedavg = (runs[k] for k in ("hmpl", "hmpl_s", "hmpl_s_sampled", "fedavg"))
    assert without_wall(sampled.metrics) == without_wall(fedavg.metrics)
    assert [{k: r[k] for k in s if k != "wall_s"} for r, s in zip(hmpl.metrics, hmpl_s.metrics, strict=True)] \
        == without_wall(hmpl_s.metrics)
    assert [r["clients"] for r in hmpl.metrics] == [4, round(4 * participation)]
    assert (without_wall(hmpl_s.metrics) == without_wall(fedavg.metrics)) == (participation == 1)
    for row in hmpl.metrics:
        assert row["acc_global_mean"] == row["acc_mean"]
        assert row["bytes_up_ord"] == row["bytes_up"] and row["clients_ord"] == 4
    assert set(hmpl.server.tiers) == {"ord"}
    for name, value in fedavg.server.global_model.items():
        assert torch.equal(sampled.server.shared[name], value), name
        assert torch.equal(hmpl.server.shared[name], hmpl_s.server.shared[name]), name


def test_round_one_times_every_client_so_the_tiers_are_tier_ratio_of_all_of_them():
    sim = _sim(*HMPL, "train.rounds=2", "train.participation=0.3", clients=10)
    sim.run()
    assert [r["clients"] for r in sim.metrics] == [10, 3]
    assert sorted(sim.server.tiers) == ["com"] * 3 + ["ord"] * 4 + ["sup"] * 3
    # sampled: only round 1's three are ranked (1:1:1), the rest wait for their first time
    old = _sim(*HMPL, "train.rounds=1", "train.participation=0.3",
               "algorithm.first_round=sampled", clients=10)
    old.run()
    assert old.metrics[0]["clients"] == 3
    assert sorted(t for t in old.server.tiers if t) == ["com", "ord", "sup"]


def test_a_run_from_before_first_round_existed_is_read_and_resumed_as_sampled(tmp_path, monkeypatch):
    from edgepfl.engine.rundir import comparable
    from edgepfl.engine.simulation import resume_run

    sets = (*HMPL, *SMALL, "partition.clients=10", "train.participation=0.3", "train.rounds=3")
    cfg = fast_config(*sets, "algorithm.first_round=sampled")
    straight = Simulation(cfg, progress=False)
    straight.run()
    crash_after(Simulation(cfg, tmp_path, progress=False), 1, monkeypatch)
    stored = forget_algorithm_setting(tmp_path, "first_round")
    assert comparable(stored)["algorithm"]["first_round"] == "sampled"
    assert comparable(resolve(fast_config(*sets)).model_dump())["algorithm"]["first_round"] == "all"
    resumed = resume_run(tmp_path, progress=False)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    # today's default is another configuration than what that run did
    with pytest.raises(ConfigError, match="first_round"):
        resume_run(tmp_path, fast_config(*sets), progress=False)


def test_a_resumed_run_equals_a_straight_one(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, *HMPL, *SMALL)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    for attr in ("tiers", "depths", "stopped", "times", "thresholds"):
        assert getattr(resumed.server, attr) == getattr(straight.server, attr), attr
    assert {"com", "ord", "sup"} == set(straight.server.tiers)
    # the checkpoint fell between a Sup model's growth decision and its growth
    assert int(straight.clients.stack(STAGE).max()) == 2
    for name, value in straight.server.shared.items():
        assert torch.equal(resumed.server.shared[name], value), name
    for key, stack in straight.clients.tensors.items():
        assert torch.equal(resumed.clients.tensors[key], stack), key


def test_hmpl_s_on_flower_equals_the_simulation_and_hmpl_tiers_by_measured_time():
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    from edgepfl.engine.flower_local import run_local

    base = {"dataset.name": "synthetic", "dataset.fraction": 0.1, "partition.clients": 3,
            "train.rounds": 2, "train.batch_size": 16, "train.local_epochs": 1, "train.lr": 0.05,
            "output.plots": False, "system.count_flops": False}
    rc = {**base, "algorithm.name": "hmpl_s", "model.name": "hmpl_ord"}
    sets = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in rc.items()]
    sim = Simulation(fast_config(*sets), progress=False).run()
    flower = run_local(rc)
    for ours, theirs in zip(flower.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "bytes_down"):
            assert ours[key] == theirs[key], (ours["round"], key)
    assert flower.summary["acc_clients_final"] == sim.summary["acc_clients_final"]
    # on Flower a round time is the client's measured training time: the tiers follow it,
    # one client each at 3:4:3 of three, and the run goes on with all three models
    run = run_local({**base, "algorithm.name": "hmpl", "model.name": "hmpl_tiers"})
    assert run.summary["tiers"] == {"com": 1, "ord": 1, "sup": 1}
    last = run.metrics[-1]
    assert all(last[f"bytes_up_{t}"] > 0 for t in ("com", "ord", "sup"))
    assert last["bytes_up_com"] < last["bytes_up_ord"] < last["bytes_up_sup"]
    # and reports each tier's accuracy as the simulation does (one client each here)
    for t in ("com", "ord", "sup"):
        assert 0 <= last[f"acc_mean_{t}"] <= 1


# -- generation of the tier models (algorithm.generation) -----------------------------------
def _told(server, stage: int, cids) -> dict[int, Message]:
    """The server's messages telling ``cids`` to hold ``stage``."""
    server.tiers = ["com" if stage == COM else "sup"] * len(server.tiers)
    server.depths = [max(stage, 0)] * len(server.tiers)
    return server.configure(2, list(cids))


def _generated(mode: str, stage: int, cids=(0, 1, 2),
               *overrides: str) -> tuple[Simulation, dict[int, dict]]:
    """Each of ``cids``' state right after it turned from Ord into ``stage`` (no SGD step:
    its data is empty)."""
    sim = _sim(*HMPL, f"algorithm.generation={mode}", *overrides)
    down = _told(sim.server, stage, cids)
    gen = torch.Generator()
    states = {c: sim.client.update(c, down[c], sim.client.init_state(c, {}),
                                   _empty(sim.train_data[c]), gen).state for c in cids}
    return sim, states


def _tier_module(sim: Simulation, stage: int, state: dict) -> torch.nn.Module:
    model = build_model(stage_model(stage), (1, 28, 28), 10)
    model.load_state_dict(sim.client.tier_model(stage, state, sim.server.eval_message(0)))
    return model.eval()


def _ord_module(sim: Simulation) -> torch.nn.Module:
    return _tier_module(sim, ORD, {})


@pytest.mark.parametrize("depth", [1, 2])
def test_a_generated_sup_model_computes_the_ord_model_exactly_where_its_shape_allows(depth):
    sim, states = _generated("preserve", depth)
    sup, ordinary = _tier_module(sim, depth, states[0]), _ord_module(sim)
    assert torch.equal(sim.server.shared["cp_merge.bias"], torch.zeros(256))
    # sides divisible by 8: every 2x upsampled map is its lower neighbour's size, no crop
    x = torch.rand(5, 1, 16, 24)
    with torch.no_grad():
        assert torch.equal(sup(x), ordinary(x))
        # with odd sides (28 -> 14 -> 7 -> 4) the crop moves SPP bin edges: near, not equal
        x = torch.rand(5, 1, 28, 28)
        assert torch.allclose(sup(x), ordinary(x), atol=0.05)


def test_a_generated_com_model_aligns_conv2_as_conv3_would_on_a_constant_window():
    sim, states = _generated("preserve", COM)
    conv3 = {n: sim.server.shared[n] for n in ("conv3.weight", "conv3.bias")}
    weight, bias = states[0]["ip_align.weight"], states[0]["ip_align.bias"]
    assert torch.equal(weight, conv3["conv3.weight"].sum((2, 3), keepdim=True))
    assert torch.equal(bias, conv3["conv3.bias"])
    # a 1x1 convolution equals a 3x3 one exactly where its window sees one value per
    # channel: the interior of a map constant per channel
    level = torch.rand(2, 128, 1, 1).expand(2, 128, 5, 5)
    aligned = torch.nn.functional.conv2d(level, weight, bias)
    full = torch.nn.functional.conv2d(level, conv3["conv3.weight"], conv3["conv3.bias"], padding=1)
    torch.testing.assert_close(aligned[..., 1:4, 1:4], full[..., 1:4, 1:4], rtol=1e-5, atol=1e-6)
    # the model, on whole images: nearer the Ord model than a Com model drawn at random
    x = torch.rand(8, 1, 28, 28)
    rand_sim, rand_states = _generated("random", COM)
    with torch.no_grad():
        near = (_tier_module(sim, COM, states[0])(x) - _ord_module(sim)(x)).abs().mean()
        far = (_tier_module(rand_sim, COM, rand_states[0])(x) - _ord_module(rand_sim)(x)).abs().mean()
    assert near < far / 2


@pytest.mark.parametrize("stage", [COM, 1, 2])
@pytest.mark.parametrize("mode", ["preserve", "shared", "random"])
def test_every_client_of_a_tier_starts_with_the_same_added_layers_but_under_random(mode, stage):
    _, states = _generated(mode, stage)
    added = [n for n in states[0] if n != STAGE]
    assert added and all(layer_role(n) == "ip" for n in added)
    same = [all(torch.equal(states[c][n], states[0][n]) for n in added) for c in (1, 2)]
    assert same == ([False, False] if mode == "random" else [True, True])
    if mode != "preserve":  # a seeded draw, the same again
        assert all(torch.equal(_generated(mode, stage)[1][0][n], states[0][n]) for n in added)


def test_preserve_sends_conv3_until_the_com_reply_arrives_and_needs_it_to_shrink():
    # under com_align = kept: fit sends conv3 every Com round and refits the aligner to it
    sim, _ = _generated("preserve", COM, (0,), "algorithm.com_align=kept")
    server, client = sim.server, sim.client
    data, gen = _empty(sim.train_data[0]), torch.Generator()
    down = server.configure(2, [0, 1])
    assert "conv3.weight" in down[0].tensors
    without = Message({n: t for n, t in down[0].tensors.items() if not n.startswith("conv3")},
                      down[0].meta)
    with pytest.raises(MessageError, match="derives ip_align from the Ord model's"):
        client.update(0, without, client.init_state(0, {}), data, gen)
    done = client.update(0, down[0], client.init_state(0, {}), data, gen)
    server.aggregate(2, {0: done.reply})
    assert server.aligned[0] and not server.aligned[1]
    after = server.configure(3, [0, 1])
    assert "conv3.weight" not in after[0].tensors and "conv3.weight" in after[1].tensors
    # a client that shrank already takes either message and keeps its aligner
    for msg in (down[0], after[0]):
        again = client.update(0, msg, done.state, data, gen).state
        assert torch.equal(again["ip_align.weight"], done.state["ip_align.weight"])
    # the server's record of it is state, kept across a checkpoint
    assert "aligned" in server.state
    assert "aligned" not in _sim(*HMPL, "algorithm.generation=shared").server.state


def test_a_run_from_before_generation_and_rank_by_existed_is_read_as_random_by_round():
    from edgepfl.engine.rundir import comparable

    stored = resolve(fast_config(*HMPL)).model_dump()
    for key in ("generation", "rank_by"):
        del stored["algorithm"][key]
    old = comparable(stored)["algorithm"]
    assert (old["generation"], old["rank_by"]) == ("random", "round")
    new = comparable(resolve(fast_config(*HMPL)).model_dump())["algorithm"]
    assert (new["generation"], new["rank_by"]) == ("preserve", "compute")


@pytest.mark.parametrize("overrides,match", [
    ([*HMPL, "algorithm.generation=ord"], r"generation.*'preserve', 'shared' or 'random'"),
    ([*HMPL, "algorithm.rank_by=link"], r"rank_by.*'compute' or 'round'"),
])
def test_bad_generation_or_rank_by_is_refused_naming_the_choices(overrides, match):
    with pytest.raises(ConfigError, match=match):
        Simulation(fast_config(*overrides), progress=False)


# -- tiers by device compute (algorithm.rank_by) --------------------------------------------
def test_compute_ranking_follows_the_device_and_growth_the_same_measure():
    # client 1 computes fastest but has the slowest link; client 4 the reverse
    compute = dict(enumerate(TIMES))
    rounds = {c: t + (100.0 if c == 1 else 0.0) - (8.0 if c == 4 else 0.0) for c, t in compute.items()}
    tiers = {}
    for rank_by in ("compute", "round"):
        sim = _sim(*HMPL, f"algorithm.rank_by={rank_by}", clients=10)
        server = sim.server
        server.configure(1, list(range(10)))
        server.observe_times(1, rounds, compute=compute)
        tiers[rank_by] = list(server.tiers)
        if rank_by == "compute":
            assert server.thresholds == {"lower": 3.0, "upper": 6.0}  # of compute times
            # growth on compute too: a Sup model with a slow round but quick training grows
            server.configure(2, [1])
            server.observe_times(2, {1: 50.0}, compute={1: 1.0})
            assert server.depths[1] == 2
            # a Com model's round time is still what its cost figures report
            server.configure(3, [4])
            server.observe_times(3, {4: 7.5}, compute={4: 9.0})
            assert server.round_metrics()["time_com"] == 7.5
    assert tiers["compute"][1] == "sup" and tiers["round"][1] == "com"
    assert tiers["compute"][4] == "com" and tiers["round"][4] == "sup"


def test_in_a_run_the_tiers_follow_device_compute_not_a_slow_link():
    def ranked(rank_by: str, slow: int | None = None):
        sim = _sim(*HMPL, f"algorithm.rank_by={rank_by}", "train.rounds=1", clients=10)
        if slow is not None:  # far slower than any link of the system model
            sim.rounds.system.links.uplink_bps[slow] = 1e3
        sim.step()
        return sim.server

    plain = ranked("compute")
    fastest = min(range(10), key=lambda c: (plain.times[c], c))
    assert plain.tiers[fastest] == "sup"
    slowed = ranked("compute", fastest)
    # the link is no part of a compute time: the same times, the same tiers
    assert slowed.times == plain.times and slowed.tiers == plain.tiers
    by_round = ranked("round", fastest)
    assert by_round.tiers[fastest] == "com"
    assert all(r > c for r, c in zip(by_round.times, plain.times, strict=True))


# -- a Com client's aligner refitted every round (algorithm.com_align) ----------------------
def test_com_align_fit_refits_ip_align_to_the_servers_conv3_before_each_com_round(monkeypatch):
    from edgepfl.algorithms import hmpl as hmpl_module
    from edgepfl.models.hmpl_nets import fitted_align
    from edgepfl.training.trainer import Trainer

    sim = _sim(*HMPL)  # fit is the default
    assert sim.server.hp.com_align == "fit"
    server, client, gen = sim.server, sim.client, torch.Generator()
    loaded = []  # ip_align as training starts, then SGD skipped
    monkeypatch.setattr(Trainer, "fit", lambda self, *a, **k: (
        loaded.append(self.export(["ip_align.weight", "ip_align.bias"])), {"loss": 0.0})[1])
    down = _told(server, COM, [0])
    first = client.update(0, down[0], client.init_state(0, {}), sim.train_data[0], gen)
    server.aggregate(2, {0: first.reply})
    # the server's conv3 moves on (here: by hand); under fit it still goes to the Com client
    server.shared["conv3.weight"] = server.shared["conv3.weight"] * 1.5 + 0.01
    after = server.configure(3, [0])
    assert "conv3.weight" in after[0].tensors and server.aligned[0]
    second = client.update(0, after[0], first.state, sim.train_data[0], gen)
    ordinary = {**after[0].tensors}
    images = hmpl_module.align_batches(sim.train_data[0], 64)
    expected = fitted_align(ordinary, images)
    for n, v in expected.items():
        torch.testing.assert_close(loaded[1][n], v)
        assert torch.equal(second.state[n], loaded[1][n])  # kept as trained, never sent
    assert not torch.equal(loaded[0]["ip_align.weight"], loaded[1]["ip_align.weight"])
    assert set(second.reply.tensors) == set(server.model_for(COM))
    # a Com message without conv3 is refused under fit, also once shrunk
    without = Message({n: t for n, t in after[0].tensors.items() if not n.startswith("conv3")},
                      after[0].meta)
    with pytest.raises(MessageError, match="com_align = 'fit'"):
        client.update(0, without, first.state, sim.train_data[0], gen)
    # kept: conv3 stops once the Com reply is in, and the aligner is the client's
    kept = _sim(*HMPL, "algorithm.com_align=kept")
    down = _told(kept.server, COM, [0])
    done = kept.client.update(0, down[0], kept.client.init_state(0, {}), _empty(kept.train_data[0]), gen)
    kept.server.aggregate(2, {0: done.reply})
    assert "conv3.weight" not in kept.server.configure(3, [0])[0].tensors


def test_a_run_from_before_com_align_existed_is_read_as_kept():
    from edgepfl.engine.rundir import comparable

    stored = resolve(fast_config(*HMPL)).model_dump()
    del stored["algorithm"]["com_align"]
    assert comparable(stored)["algorithm"]["com_align"] == "kept"


def test_a_client_past_the_deadline_in_the_ranking_round_is_ranked_by_its_time():
    # late clients are the slowest devices: left out of the ranking, they would stay on the
    # Ord model untiered while the split moved everyone else's tier
    base = (*HMPL, "algorithm.rank_by=round", "train.rounds=1", "faults.min_replies=0")
    free = _sim(*base, clients=10)
    free.step()
    t = sorted(free.server.times)
    late = _sim(*base, f"faults.deadline={(t[-3] + t[-2]) / 2}", clients=10)
    late.step()
    assert late.metrics[-1]["clients_failed"] == 2
    assert None not in late.server.tiers
    assert late.server.tiers == free.server.tiers


def test_the_tiers_bytes_add_up_to_the_links_under_faults():
    # a dropped client received nothing, a refused reply crossed the link: the tiers'
    # columns split the engine's counts, not the messages the server addressed
    sim = _sim(*HMPL, "faults.drop_rate=0.3", "faults.min_replies=0", "train.rounds=3",
               clients=10)
    rows = [sim.step() for _ in range(3)]
    assert sum(r["clients_failed"] for r in rows) > 0
    for r in rows:
        for d in ("up", "down"):
            assert sum(r[f"bytes_{d}_{t}"] for t in ("com", "ord", "sup")) == r[f"bytes_{d}"]


def test_tier_costs_price_sup_at_the_deepest_stage_trained():
    # growth after a Sup client's last round tells it a deeper stage it never trained
    sim = _sim(*HMPL, "train.rounds=2")
    sim.run()
    held = int(sim.clients.stack(STAGE).max())
    assert held >= 1 and sim.server.sup_depth_max() == held + 1
    assert sim.metrics[-1]["sup_depth_trained"] == held
    assert sim.summary()["tier_costs"]["sup"]["stage_model"] == stage_model(held)
