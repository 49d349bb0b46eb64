"""Federations: client -> edge -> cloud hierarchies (HierFAVG), clients of different
architectures, per-link bytes and costs, and the settings that describe them."""

import json
import math

import numpy as np
import pytest
import torch

from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError, EdgepflError
from edgepfl.federation.aggregate import ParamIndex, average_width_slices
from edgepfl.federation.store import StackedStore
from edgepfl.federation.topology import CLOUD, Federation, assign_edges
from tests.conftest import fast_config, resumed_and_straight, without_wall

HIER = ["algorithm.name=hierfavg", "partition.clients=6"]
TIERS = ["system.devices=tiers", "model.tiers.weak=cnn_small_narrow"]


def _run(*overrides):
    sim = Simulation(fast_config(*overrides), progress=False)
    return sim, sim.run()


# -- HierFAVG -----------------------------------------------------------------------------
def test_hierfavg_with_one_edge_and_one_edge_round_is_fedavg_exactly():
    fed, fed_result = _run("algorithm.name=fedavg")
    hier, hier_result = _run(*HIER, "topology.edges=1", "topology.edge_rounds=1")
    same = ["acc_mean", "acc_std", "loss", "train_loss", "bytes_up_client", "bytes_down_client"]
    for a, b in zip(fed_result.metrics, hier_result.metrics, strict=True):
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
    for name, value in fed.server.global_model.items():
        assert torch.equal(value, hier.server.global_model[name]), name


def test_hierfavg_with_several_edges_and_one_edge_round_is_fedavg_up_to_rounding():
    # one round: the same client updates, averaged in two stages instead of one
    fed = Simulation(fast_config("algorithm.name=fedavg"), progress=False)
    hier = Simulation(fast_config(*HIER, "topology.edges=3", "topology.edge_rounds=1"),
                      progress=False)
    fed.step()
    hier.step()
    for name, value in fed.server.global_model.items():
        assert torch.allclose(value, hier.server.global_model[name], rtol=0, atol=1e-6), name


def test_one_edge_with_k2_edge_rounds_is_k2_fedavg_rounds():
    # HierFAVG's k2: each edge round starts from the edge's own average, not the cloud's
    # model, and the cloud aggregates once per k2 client rounds (seeds: step (r-1) k2 + s)
    fed = Simulation(fast_config("algorithm.name=fedavg", "train.rounds=2"), progress=False)
    fed.step()
    fed.step()
    hier = Simulation(fast_config(*HIER, "topology.edges=1", "topology.edge_rounds=2",
                                  "train.rounds=1"), progress=False)
    hier.step()
    for name, value in fed.server.global_model.items():
        assert torch.equal(value, hier.server.global_model[name]), name


def test_with_two_edges_and_k2_edge_rounds_the_cloud_takes_the_edges_second_averages():
    sim = Simulation(fast_config(*HIER, "topology.edges=2", "topology.edge_rounds=2"),
                     progress=False)
    sent, averaged = {0: [], 1: []}, {0: [], 1: []}
    for k, edge in enumerate(sim.edges):
        def configure(rnd, step, selected, k=k, real=edge.configure):
            msgs = real(rnd, step, selected)
            sent[k].append(next(iter(msgs.values())).tensors)
            return msgs

        def aggregate(rnd, step, replies, k=k, edge=edge, real=edge.aggregate):
            real(rnd, step, replies)
            averaged[k].append((dict(edge.model), sum(edge.samples.values())))
        edge.configure, edge.aggregate = configure, aggregate
    cloud = {k: v.clone() for k, v in sim.server.global_model.items()}
    sim.step()
    for k in (0, 1):
        assert all(torch.equal(sent[k][0][n], cloud[n]) for n in cloud)  # edge round 1
        assert all(torch.equal(sent[k][1][n], averaged[k][0][0][n]) for n in cloud)  # round 2
    (w0, n0), (w1, n1) = averaged[0][1], averaged[1][1]
    for name, value in sim.server.global_model.items():
        want = (n0 * w0[name].double() + n1 * w1[name].double()) / (n0 + n1)
        assert torch.allclose(value.double(), want, rtol=0, atol=1e-6), name


def test_an_edge_none_of_whose_clients_replied_does_not_pull_the_cloud_back():
    sim = Simulation(fast_config(*HIER, "topology.edges=2", "topology.edge_rounds=1"),
                     progress=False)
    sim.step()
    # what the round does when none of edge 1's clients replies: no aggregate call
    sim.edges[1].aggregate = lambda rnd, step, replies: None
    seen, real = {}, sim.server.aggregate
    sim.server.aggregate = lambda rnd, reports: (seen.update(reports), real(rnd, reports))
    sim.step()
    assert seen[1].meta["num_samples"] == 0
    for name, value in sim.server.global_model.items():  # edge 0's model alone
        assert torch.equal(value, seen[0].tensors[name]), name


def test_edge_cloud_bytes_per_client_round_fall_by_k2():
    _, fed = _run("algorithm.name=fedavg")
    _, k1 = _run(*HIER, "topology.edges=2", "topology.edge_rounds=1")
    _, k2 = _run(*HIER, "topology.edges=2", "topology.edge_rounds=2")
    model_bytes = fed.metrics[0]["bytes_down"] // 6  # FedAvg sends each of 6 clients the model
    for r1, r2 in zip(k1.metrics, k2.metrics, strict=True):
        # one model each way per edge per cloud round, whatever k2 is (plus a few bytes of JSON)
        assert r1["bytes_down_edge"] == r2["bytes_down_edge"] == 2 * model_bytes
        assert abs(r1["bytes_up_edge"] - r2["bytes_up_edge"]) < 16
        # ... while the clients do k2 rounds of work and traffic behind it
        assert r2["bytes_down_client"] == 2 * r1["bytes_down_client"] == 2 * fed.metrics[0]["bytes_down"]
        assert r1["bytes_up"] == r1["bytes_up_client"] + r1["bytes_up_edge"]
    # per client round the backhaul carries 1/k2 of the edge models, against FedAvg's
    # one model per client on its only (cloud) link
    per_client_round_k1 = k1.summary["bytes_down_edge_total"] / 3
    per_client_round_k2 = k2.summary["bytes_down_edge_total"] / (3 * 2)
    assert per_client_round_k2 == per_client_round_k1 / 2
    assert fed.summary["bytes_down_edge_total"] == 0


def test_a_star_has_no_backhaul_and_its_totals_are_the_client_links():
    _, result = _run("algorithm.name=fedavg")
    for row in result.metrics:
        assert row["bytes_up_edge"] == row["bytes_down_edge"] == 0
        assert row["bytes_up"] == row["bytes_up_client"]
        assert row["t_backhaul"] == row["t_edge"] == 0
    s = result.summary
    assert s["bytes_up_total"] == s["bytes_up_client_total"] == sum(s["bytes_up_per_client"])


def test_hierarchical_round_time_adds_backhaul_edge_and_client_phases(tmp_path):
    sim = Simulation(fast_config(*HIER, "topology.edges=2", "topology.edge_rounds=2",
                                 "system.backhaul_mbps=8"), tmp_path, progress=False)
    result = sim.run()
    row = result.metrics[0]
    parts = row["t_backhaul"] + row["t_down"] + row["t_compute"] + row["t_up"] + row["t_edge"] + row["t_server"]
    assert row["t_round"] == pytest.approx(parts)
    # the critical edge's backhaul: its model down and up at 8 Mbit/s = 1 byte per microsecond
    per_edge = result.summary["bytes_down_per_edge"][0] / 3
    assert row["t_backhaul"] >= per_edge / 1e6
    # averaging is element-wise, which FLOP counting leaves at zero (docs/system.md)
    assert row["t_edge"] == 0
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    for col in ["bytes_up_client", "bytes_down_client", "bytes_up_edge", "bytes_down_edge",
                "t_backhaul", "t_edge"]:
        assert col in header
    fed = json.loads((tmp_path / "federation.json").read_text())
    assert {c["parent"] for c in fed["clients"]} == {0, 1}


def test_a_hierarchical_run_resumes_exactly(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, *HIER, "topology.edges=2",
                                             "topology.edge_rounds=2")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    assert resumed.rounds.ledger.edge_bytes_up.tolist() == straight.rounds.ledger.edge_bytes_up.tolist()


def test_per_edge_participation_takes_a_share_of_every_edge():
    sim = Simulation(fast_config(*HIER, "partition.clients=8", "topology.edges=2",
                                 "topology.assignment=contiguous", "train.participation=0.5"),
                     progress=False)
    for rnd in (1, 2, 3):
        chosen = sim.federation.select(0, rnd, 0.5)
        assert sum(1 for c in chosen if c < 4) == 2 and sum(1 for c in chosen if c >= 4) == 2


# -- clients of different architectures ----------------------------------------------------
def test_fedavg_on_two_architectures_averages_each_layer_over_its_holders():
    sim = Simulation(fast_config("algorithm.name=fedavg", "partition.clients=10", *TIERS),
                     progress=False)
    archs = sim.federation.arch
    assert set(archs) == {"cnn_small", "cnn_small_narrow"}
    seen = {}
    aggregate = sim.server.aggregate

    def spy(rnd, replies):
        seen.update({cid: ({k: v.clone() for k, v in m.tensors.items()}, m.meta["num_samples"])
                     for cid, m in replies.items()})
        aggregate(rnd, replies)

    sim.server.aggregate = spy
    sim.step()
    global_model = sim.server.global_model

    def hand_average(param, holders):
        total = sum(seen[c][1] for c in holders)
        return sum(seen[c][0][param].double() * seen[c][1] / total for c in holders).float()

    everyone = sorted(seen)
    for param in ["conv1.weight", "conv1.bias", "conv2.weight", "conv2.bias"]:
        assert param in global_model  # shared: one entry for both architectures
        assert torch.allclose(global_model[param], hand_average(param, everyone), atol=1e-6)
    for arch in ("cnn_small", "cnn_small_narrow"):
        holders = [c for c in everyone if archs[c] == arch]
        for param in ["fc1.weight", "fc2.weight", "fc2.bias"]:
            key = f"{arch}:{param}"
            assert torch.allclose(global_model[key], hand_average(param, holders), atol=1e-6)
    # each client is sent, and predicts with, its own architecture's model
    narrow = next(c for c in everyone if archs[c] == "cnn_small_narrow")
    assert sim.server.eval_message(narrow).tensors["fc1.weight"].shape == (32, 512)
    result = sim.run()
    assert all(not math.isnan(a) for a in result.client_accuracy)


def test_shared_layers_start_from_one_value_and_the_rest_per_architecture():
    sim = Simulation(fast_config("algorithm.name=local", "partition.clients=10", *TIERS),
                     progress=False)
    a, b = (sim.parts.architectures[n].init_model for n in ("cnn_small", "cnn_small_narrow"))
    assert torch.equal(a["conv1.weight"], b["conv1.weight"])
    assert a["fc1.weight"].shape != b["fc1.weight"].shape
    # the clients' stacked state holds both shapes of model.fc1.weight
    shapes = {tuple(sim.clients.row(c)["model.fc1.weight"].shape) for c in range(10)}
    assert shapes == {(64, 512), (32, 512)}


def test_hierfavg_runs_on_two_architectures():
    _, result = _run(*HIER, "partition.clients=10", "topology.edges=2", *TIERS)
    assert result.summary["architectures"] == {"cnn_small": 7, "cnn_small_narrow": 3}
    assert result.summary["acc_mean_final"] > 0.1


@pytest.mark.parametrize("algorithm", ["kapc", "fedamp", "dcpfl"])
def test_algorithms_that_need_one_architecture_refuse_several(algorithm):
    with pytest.raises(ConfigError, match="needs one model architecture.*fedavg"):
        Simulation(fast_config(f"algorithm.name={algorithm}", *TIERS), progress=False)


# -- settings ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["topology.edges=7"], r"topology.edges = 7 is more than the 6 clients; valid: 0 \(star\) to 6"),
    (["topology.edge_rounds=0"], "greater than or equal to 1"),
    (["topology.edges=2", "topology.assignment=explicit", "topology.parents=[0,0,0,0,0,0]"],
     r"edges \[1\] have no clients"),
    (["topology.edges=2", "topology.assignment=explicit", "topology.parents=[0,1]"],
     "one edge per client"),
    (["topology.edges=0"], "hierfavg.*needs edge servers"),
])
def test_nonsense_topologies_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Simulation(fast_config("algorithm.name=hierfavg", *overrides), progress=False)


@pytest.mark.parametrize("key", ["backhaul_mbps=8", "edge_flops=1e9"])
def test_a_star_refuses_the_settings_only_a_hierarchy_reads(key):
    with pytest.raises(ConfigError, match="topology.edges"):
        Simulation(fast_config(f"system.{key}"), progress=False)
    Simulation(fast_config(*HIER, "topology.edges=2", f"system.{key}"), progress=False)


def test_a_star_algorithm_refuses_edges_naming_the_hierarchical_ones():
    with pytest.raises(ConfigError, match="runs on a star.*hierfavg"):
        Simulation(fast_config("algorithm.name=fedavg", "topology.edges=2"), progress=False)


def test_model_tiers_need_device_tiers_and_known_names():
    with pytest.raises(ConfigError, match="system.devices = 'tiers'"):
        Simulation(fast_config("model.tiers.weak=cnn_small_narrow"), progress=False)
    with pytest.raises(ConfigError, match="names tiers.*tiny"):
        Simulation(fast_config("system.devices=tiers", "model.tiers.tiny=cnn_small"), progress=False)
    with pytest.raises(ConfigError, match="not a known model"):
        Simulation(fast_config("system.devices=tiers", "model.tiers.weak=resnet"), progress=False)


def test_edge_assignment_random_is_seeded_and_balanced_contiguous_keeps_order():
    a = assign_edges(10, 3, "random", seed=1)
    assert a == assign_edges(10, 3, "random", seed=1) != assign_edges(10, 3, "random", seed=2)
    assert sorted(a.count(k) for k in range(3)) == [3, 3, 4]
    assert assign_edges(6, 3, "contiguous", seed=0) == [0, 0, 1, 1, 2, 2]
    assert assign_edges(4, 0, "random", seed=0) == [CLOUD] * 4


def test_the_federation_gives_each_client_the_tier_the_system_model_prices():
    sim = Simulation(fast_config("partition.clients=10", *TIERS), progress=False)
    fed: Federation = sim.federation
    assert list(fed.tier) == sim.system.devices.tier
    assert all((a == "cnn_small_narrow") == (t == "weak") for a, t in zip(fed.arch, fed.tier, strict=True))


# -- the helpers ---------------------------------------------------------------------------
def test_stacked_store_holds_rows_of_different_shapes():
    store = StackedStore(3)
    store.set_row(0, {"w": torch.ones(2, 2)})
    store.set_row(1, {"w": torch.full((3,), 2.0)})
    store.set_row(2, {"w": torch.zeros(2, 2, dtype=torch.float64)})
    assert store.row(0)["w"].shape == (2, 2) and store.row(1)["w"].shape == (3,)
    assert store.row(2)["w"].dtype == torch.float64
    store.set_row(0, {"w": torch.ones(3)})  # a client changes shape: only the new one is its
    assert store.row(0)["w"].shape == (3,)
    other = StackedStore(3)
    other.load_state_dict(store.state_dict("c/"), "c/")
    for cid in range(3):
        assert torch.equal(other.row(cid)["w"], store.row(cid)["w"])


def test_param_index_keeps_same_named_layers_of_other_shapes_apart():
    index = ParamIndex({"a": {"x.w": torch.zeros(2), "y.w": torch.zeros(3)},
                        "b": {"x.w": torch.zeros(2), "y.w": torch.zeros(4), "z.w": torch.zeros(1)}})
    assert index.keys == ["x.w", "a:y.w", "b:y.w", "z.w"]
    assert index.shared() == ["x.w"]
    # a layer is the same only if all of it is: fc.bias of one shape under fc.weights of two
    layered = ParamIndex({"a": {"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)},
                          "b": {"fc.weight": torch.zeros(2, 5), "fc.bias": torch.zeros(2)}})
    assert layered.keys == ["a:fc.weight", "a:fc.bias", "b:fc.weight", "b:fc.bias"]
    replies = {0: {"x.w": torch.tensor([1.0, 1.0]), "y.w": torch.ones(3)},
               1: {"x.w": torch.tensor([4.0, 4.0]), "y.w": torch.ones(4), "z.w": torch.ones(1)}}
    previous = {"x.w": torch.zeros(2), "a:y.w": torch.zeros(3), "b:y.w": torch.zeros(4),
                "z.w": torch.zeros(1)}
    out = index.average_over_holders(replies, {0: 1, 1: 2}, ["a", "b"], previous)
    assert torch.allclose(out["x.w"], torch.tensor([3.0, 3.0]))  # (1*1 + 2*4) / 3
    assert torch.equal(out["a:y.w"], torch.ones(3)) and torch.equal(out["z.w"], torch.ones(1))
    only_a = index.average_over_holders({0: replies[0]}, {0: 1}, ["a", "b"], previous)
    assert torch.equal(only_a["b:y.w"], previous["b:y.w"])  # no holder replied: unchanged


def test_width_slices_average_each_element_over_the_clients_that_cover_it():
    previous = {"w": torch.full((2, 3), 9.0)}
    narrow = {"w": torch.ones(1, 2)}
    wide = {"w": torch.full((2, 3), 4.0)}
    out = average_width_slices(previous, [narrow, wide], [3.0, 1.0])["w"]
    assert out[0, 0] == pytest.approx((3 * 1 + 1 * 4) / 4)  # both cover it
    assert out[1, 2] == pytest.approx(4.0)  # only the wide one
    out = average_width_slices(previous, [narrow], [1.0])["w"]
    assert out[1, 2] == 9.0  # nobody covers it: previous value


# -- asynchronous edges --------------------------------------------------------------------
ONE_SPEED = ['system.tiers=[{name="all", flops=5e9, share=1.0}]', "system.devices=tiers",
             "system.profile=fixed_rate", "system.rate_mbps=1000", "partition.scheme=iid"]


def test_the_asynchronous_plan():
    from edgepfl.engine.schedule import async_edge_rounds

    assert async_edge_rounds([None, None], 2) == [2, 2]  # not timed yet: synchronous
    assert async_edge_rounds([1.0, 1.0, 1.0], 3) == [3, 3, 3]
    assert async_edge_rounds([1.0, 1.1, 0.95], 2) == [2, 2, 2]  # within 1 +- 1/(2 k2)
    # fast: more; 5x slower: a free edge starts one round, which outlasts the period
    assert async_edge_rounds([1.0, 0.5, 5.0], 2) == [2, 4, 1]
    assert async_edge_rounds([1.0, 0.5, 5.0], 2, [0.0, 0.0, 3.0]) == [2, 4, 0]  # busy


def test_a_slow_edge_works_its_share_of_the_periods_and_is_never_shut_out():
    from edgepfl.engine.schedule import async_debt, async_edge_rounds

    def rounds_over(times, k2, periods):
        debt, done = [0.0] * len(times), [0] * len(times)
        for _ in range(periods):
            plan = async_edge_rounds(times, k2, debt)
            debt = async_debt(times, k2, plan, debt)
            done = [a + b for a, b in zip(done, plan, strict=True)]
        return done

    # periods of k2 x the median time: an edge t times slower runs k2 x periods / t where
    # its rounds fill whole periods, else up to a third less (a new model, and so a new
    # round, only at a period's start)
    assert rounds_over([1.0, 1.0, 1.0], 2, 30) == [60, 60, 60]
    assert rounds_over([1.0, 1.0, 3.0], 1, 30) == [30, 30, 10]
    assert rounds_over([1.0, 1.0, 8.0], 2, 32) == [64, 64, 8]
    assert rounds_over([1.0, 1.0, 0.5], 1, 10) == [10, 10, 20]
    for k2 in (1, 2, 3):
        for t in np.arange(1.01, 6.0, 0.07):
            ideal = k2 * 120 / t
            assert 2 / 3 * ideal - 1 <= rounds_over([1.0, 1.0, t], k2, 120)[2] <= ideal + 1


def test_the_edges_work_in_hand_survives_a_checkpoint():
    from edgepfl.engine.ledger import Ledger

    sim = Simulation(fast_config(*HIER, "topology.edges=2", "topology.mode=async"),
                     progress=False)
    sim.step()
    led = sim.rounds.ledger
    led.edge_debt = [22.5, 0.0]
    back = Ledger.from_meta(json.loads(json.dumps(led.to_meta())), 6, 2,
                            led.server_state_bytes, "checkpoint.safetensors")
    assert back.edge_debt == [22.5, 0.0]
    bad = {**led.to_meta(), "edge_debt": [-1.0, 0.0]}
    with pytest.raises(EdgepflError, match="not a valid edgepfl checkpoint"):
        Ledger.from_meta(bad, 6, 2, led.server_state_bytes, "checkpoint.safetensors")


def test_asynchronous_edges_of_one_speed_equal_the_synchronous_run_exactly():
    common = [*HIER, "partition.clients=8", "topology.edges=2", "topology.edge_rounds=2",
              *ONE_SPEED]
    _, sync = _run(*common)
    sim, asyn = _run(*common, "topology.mode=async")
    assert all(r["edge_rounds_min"] == r["edge_rounds_max"] == 2 for r in asyn.metrics)
    keep = [k for k in sync.metrics[0] if k != "wall_s"]
    assert [{k: r[k] for k in keep} for r in asyn.metrics] == \
           [{k: r[k] for k in keep} for r in sync.metrics]


def _slow_edge_run() -> tuple[Simulation, list[int]]:
    """Three asynchronous edges; edge 2's clients are 8x slower devices, so it misses whole
    periods. Returns the simulation and the slow clients."""
    probe = Simulation(fast_config("partition.clients=9", "system.devices=tiers",
                                   'system.tiers=[{name="fast", flops=8e9, share=0.6667}, '
                                   '{name="slow", flops=1e9, share=0.3333}]'), progress=False)
    slow = [c for c in range(9) if probe.federation.tier[c] == "slow"]
    fast = [c for c in range(9) if c not in slow]
    parents = [0] * 9
    for i, c in enumerate(fast):
        parents[c] = i % 2
    for c in slow:
        parents[c] = 2
    sim = Simulation(fast_config(*HIER, "partition.clients=9", "topology.edges=3",
                                 "topology.assignment=explicit", f"topology.parents={parents}",
                                 "topology.mode=async", "topology.edge_rounds=1",
                                 "system.devices=tiers", "system.profile=fixed_rate",
                                 "system.rate_mbps=10000", "train.rounds=4",
                                 'system.tiers=[{name="fast", flops=8e9, share=0.6667}, '
                                 '{name="slow", flops=1e9, share=0.3333}]'), progress=False)
    return sim, slow


def test_a_busy_edges_clients_are_not_counted_as_selected():
    # every client takes part (participation 1) unless its edge is busy this period
    sim, slow = _slow_edge_run()
    busy_rounds = 0
    for _ in range(4):
        sim.step()
        row, accs = sim.metrics[-1], sim.rounds.client_acc
        takers = [c for c in range(9) if c not in slow or row["edges_busy"] == 0]
        assert row["acc_mean_selected"] == pytest.approx(float(np.mean([accs[c] for c in takers])))
        if row["edges_busy"]:
            busy_rounds += 1
            assert row["acc_mean_selected"] != pytest.approx(row["acc_mean"])
    assert busy_rounds >= 1


def test_a_slow_edge_is_stale_and_the_cloud_weights_it_down():
    sim, _ = _slow_edge_run()
    seen = []
    aggregate = sim.server.aggregate

    def spy(rnd, reports):
        seen.append({k: dict(m.meta) for k, m in reports.items()})
        aggregate(rnd, reports)

    sim.server.aggregate = spy
    sim.run()
    assert sim.metrics[0]["edges_busy"] == 0  # the first period is synchronous
    later = sim.metrics[1:]
    assert any(r["edges_busy"] == 1 for r in later)
    stale = [m[2] for m in seen[1:] if "staleness" in m[2]]
    assert stale and all(m["staleness"] >= 1 for m in stale)
    assert all("staleness" not in m[k] for m in seen for k in (0, 1))
    # a busy edge took no new model: its backhaul download is smaller than a fast edge's
    assert sim.rounds.ledger.edge_bytes_down[2] < sim.rounds.ledger.edge_bytes_down[0]


def test_a_busy_edge_rejoins_and_its_stale_reports_cross_no_link():
    sim, slow = _slow_edge_run()
    for _ in range(8):
        sim.step()
    busy = [r["edges_busy"] for r in sim.metrics]
    assert busy[0] == 0 and 1 in busy[1:] and 0 in busy[2:]  # busy for a while, then back
    led = sim.rounds.ledger
    periods_worked = 8 - sum(busy)
    # the cloud holds a busy edge's last upload: it is sent once per period worked
    assert led.edge_bytes_up[2] * 8 == led.edge_bytes_up[0] * periods_worked
    assert led.edge_bytes_down[2] * 8 == led.edge_bytes_down[0] * periods_worked


def test_asynchronous_edges_need_the_system_model():
    with pytest.raises(ConfigError, match="count_flops"):
        Simulation(fast_config(*HIER, "topology.edges=2", "topology.mode=async",
                               "system.count_flops=false"), progress=False)


def test_an_asynchronous_run_resumes_exactly(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, *HIER, "topology.edges=2",
                                             "topology.mode=async", "topology.edge_rounds=2")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


def test_report_shows_the_backhaul_of_a_hierarchical_run(tmp_path):
    from edgepfl.engine.simulation import start_run
    from edgepfl.report.tables import report_table

    start_run(fast_config(*HIER, "topology.edges=2", "train.rounds=1"), tmp_path / "h",
              progress=False)
    start_run(fast_config("algorithm.name=fedavg", "train.rounds=1"), tmp_path / "s",
              progress=False)
    text = report_table([tmp_path / "h", tmp_path / "s"])
    assert "| backhaul | edge |" in text and "edge-cloud U (MB)" in text
    star_only = report_table([tmp_path / "s"])
    assert "backhaul" not in star_only
    # U-comm / D-comm are the client links, so the hierarchy's row (the same clients'
    # FedAvg work, k2 = 1) equals the star's; the backhaul has its own columns
    comm = text.split("## Communication and computation per round")[1].split("##")[0]
    hier_row, star_row = [line.split("|")[3:5] for line in comm.splitlines()
                          if line.startswith("| h |") or line.startswith("| s |")]
    assert hier_row == star_row
