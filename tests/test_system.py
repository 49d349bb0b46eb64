"""The system model: link times by hand, monotonicity, FLOP counts, round timing rules."""

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from edgepfl.errors import ConfigError
from edgepfl.federation.topology import tier_counts
from edgepfl.system import (
    COST_COLUMNS,
    FlopMeter,
    SystemModel,
    build_system_config,
    cost_totals,
    count_flops,
    late_clients,
    not_counted,
    peak_rss_bytes,
    shannon_rate,
    state_bytes,
    transfer_time,
    work_signature,
)
from edgepfl.system.cost import EdgeStep

# One deterministic link: every range collapsed to a point, no interference.
POINT_LINK = {"profile": "custom", "client_bandwidth_mhz": [20, 20], "client_power_dbm": [30, 30],
              "distance_m": [100, 100], "up_interference_mean": 0.0, "up_interference_std": 0.0,
              "down_interference_mean": 0.0, "down_interference_std": 0.0}


def model(n=4, seed=0, epochs=None, **cfg):
    return SystemModel.build(build_system_config(cfg), n, seed, epochs=epochs)


# -- link times -------------------------------------------------------------------------
def test_fixed_rate_time_is_bytes_over_rate():
    m = model(profile="fixed_rate", rate_mbps=2)  # DC-PFL: 2 Mbps per client
    costs = m.round_costs([0], {0: 1_000_000}, {0: 250_000}, {0: 0}, 0)
    assert costs["t_down"] == pytest.approx(4.0)  # 8e6 bit / 2e6 bit/s
    assert costs["t_up"] == pytest.approx(1.0)


def test_shannon_link_matches_hand_computation():
    # B = 20 MHz, p = 30 dBm = 1 W, h = 1e-4 * 100^-4 = 1e-12, N0 = -174 dBm/Hz, I = 0
    n0 = 10 ** ((-174 - 30) / 10)
    rate = 20e6 * math.log2(1 + 1.0 * 1e-12 / (20e6 * n0))  # = 75.25 Mbit/s
    assert rate == pytest.approx(75.25e6, rel=1e-3)
    m = model(**POINT_LINK)
    assert m.uplink_bps[0] == pytest.approx(rate, rel=1e-9)
    costs = m.round_costs([0], {}, {0: 1_000_000}, {0: 0}, 0)
    assert costs["t_up"] == pytest.approx(8e6 / rate, rel=1e-9)  # 0.1063 s
    # downlink: the server's 50 MHz and 30 dBm, full band
    down = 50e6 * math.log2(1 + 1e-12 / (50e6 * n0))
    assert m.downlink_bps[0] == pytest.approx(down, rel=1e-9)


def test_interference_in_noise_units_adds_noise_powers():
    cfg = {**POINT_LINK, "up_interference_mean": 1.0}  # I = 1 x B*N0: SINR halves
    n0 = 10 ** ((-174 - 30) / 10)
    expected = 20e6 * math.log2(1 + 1e-12 / (2 * 20e6 * n0))
    assert model(**cfg).uplink_bps[0] == pytest.approx(expected, rel=1e-9)
    watts = {**cfg, "interference_unit": "pW"}  # I = 1 pW
    expected = 20e6 * math.log2(1 + 1e-12 / (1e-12 + 20e6 * n0))
    assert model(**watts).uplink_bps[0] == pytest.approx(expected, rel=1e-9)


def test_negative_interference_draws_are_clipped_to_zero():
    m = model(n=200, profile="custom", up_interference_mean=-100.0, up_interference_std=1.0)
    assert (m.links.params["up_interference"] == 0).all()


@pytest.mark.parametrize("unit", ["noise", "W", "pW"])
def test_lower_bandwidth_never_gives_less_time(unit):
    rng = np.random.default_rng(0)
    n0 = 10 ** ((-174 - 30) / 10)
    b = np.sort(rng.uniform(1e5, 1e8, size=(500, 2)), axis=1)  # b[:, 0] <= b[:, 1]
    p, h, x = rng.uniform(0.01, 2, 500), 10 ** rng.uniform(-16, -8, 500), rng.uniform(0, 5, 500)
    interference = (lambda bw: x * bw * n0) if unit == "noise" else (lambda bw: x * {"W": 1, "pW": 1e-12}[unit])
    slow = shannon_rate(b[:, 0], p, h, interference(b[:, 0]), n0)
    fast = shannon_rate(b[:, 1], p, h, interference(b[:, 1]), n0)
    for r_lo, r_hi in zip(slow, fast, strict=True):
        assert transfer_time(10_000, r_lo) >= transfer_time(10_000, r_hi)
    # and through the whole model: narrower client bands, same seed -> no faster upload
    narrow = model(n=20, seed=3, profile="custom", client_bandwidth_mhz=[5, 10])
    wide = model(n=20, seed=3, profile="custom", client_bandwidth_mhz=[20, 40])
    assert (narrow.uplink_bps <= wide.uplink_bps).all()


def test_empty_transfer_takes_no_time_and_negative_bytes_are_refused():
    assert transfer_time(0, 0.0) == 0.0
    assert transfer_time(1, 0.0) == math.inf
    with pytest.raises(ValueError):
        transfer_time(-1, 1e6)


# -- rounds -----------------------------------------------------------------------------
def _round(timing):
    # client 0: slow link; client 1: slow device; client 2: fast everything
    m = model(n=3, profile="fixed_rate", rate_mbps=8, round_timing=timing)
    m.devices.flops_per_s[:] = 1e9
    down = {0: 4_000_000, 1: 1_000_000, 2: 1_000_000}  # 4 s, 1 s, 1 s at 8 Mbit/s
    up = {0: 3_000_000, 1: 1_000_000, 2: 1_000_000}  # 3 s, 1 s, 1 s
    flops = {0: 10**9, 1: 6 * 10**9, 2: 10**9}  # 1 s, 6 s, 1 s
    return m, m.round_costs([0, 1, 2], down, up, flops, 2 * 10**10)  # server: 0.2 s


def test_phase_round_takes_the_slowest_client_of_every_phase():
    m, c = _round("phase")
    times = m.client_times([0, 1, 2], {0: 4_000_000, 1: 1_000_000, 2: 1_000_000},
                           {0: 3_000_000, 1: 10**6, 2: 10**6}, {0: 10**9, 1: 6 * 10**9, 2: 10**9})
    assert c["t_down"] == pytest.approx(max(d for d, _, _ in times.values())) == pytest.approx(4.0)
    assert c["t_compute"] == pytest.approx(6.0)
    assert c["t_up"] == pytest.approx(3.0)
    assert c["t_server"] == pytest.approx(0.2)
    assert c["t_round"] == pytest.approx(4 + 6 + 3 + 0.2)
    assert c["flops_client"] == 8 * 10**9 and c["flops_server"] == 2 * 10**10
    assert set(c) == set(COST_COLUMNS)


def test_chain_round_is_the_max_over_client_chains():
    _, phase = _round("phase")
    _, c = _round("chain")
    # chains: client 0: 4+1+3 = 8 s, client 1: 1+6+1 = 8 s (tie: lowest id), client 2: 3 s
    assert c["t_round"] == pytest.approx(max(8, 8, 3) + 0.2)
    assert (c["t_down"], c["t_compute"], c["t_up"]) == pytest.approx((4.0, 1.0, 3.0))
    assert c["t_round"] <= phase["t_round"]


def test_a_deadline_decides_lateness_on_the_rounds_own_clock():
    """Under phase timing every phase waits for its slowest client, so three clients whose
    own chains (6 s) fit a 7 s deadline still cannot all be on time: their phases take
    12 s. Dropping clients until the phases fit keeps the priced round within the deadline;
    under chain timing a reply arrives after its client's own chain."""
    times = {0: (4.0, 1.0, 1.0), 1: (1.0, 4.0, 1.0), 2: (1.0, 1.0, 4.0)}
    assert late_clients(times, 7.0, "chain") == frozenset()
    late = late_clients(times, 7.0, "phase")
    rest = [times[c] for c in times if c not in late]
    assert late == {1, 2}  # equal chains: the highest id first
    assert sum(max(t[i] for t in rest) for i in range(3)) <= 7.0
    assert late_clients(times, 12.0, "phase") == frozenset()
    assert late_clients(times, 5.0, "chain") == late_clients(times, 5.0, "phase") == {0, 1, 2}
    rng = np.random.default_rng(0)
    for _ in range(200):
        drawn = {c: tuple(rng.exponential(1.0, 3)) for c in range(int(rng.integers(1, 8)))}
        deadline = float(rng.uniform(0.5, 6.0))
        for timing in ("phase", "chain"):
            late = late_clients(drawn, deadline, timing)
            assert late >= {c for c, t in drawn.items() if sum(t) > deadline}
            on_time = [drawn[c] for c in drawn if c not in late]
            if on_time and timing == "phase":
                assert sum(max(t[i] for t in on_time) for i in range(3)) <= deadline + 1e-12
            if on_time and timing == "chain":
                assert max(sum(t) for t in on_time) <= deadline


def test_a_late_receiver_still_takes_its_share_of_the_band():
    fdma = model(n=4, **{**POINT_LINK, "downlink_sharing": "fdma"})
    down = {c: 10**6 for c in range(4)}
    four = fdma.round_costs([0, 1, 2, 3], down, {}, {}, 0)
    late = fdma.round_costs([0, 1, 2, 3], down, {}, {}, 0, late=frozenset({3}), deadline=1e9)
    assert late["t_down"] == pytest.approx(four["t_down"])
    assert late["t_round"] == pytest.approx(1e9)


def test_fdma_splits_the_server_band_among_receivers():
    full = model(n=4, **POINT_LINK)
    fdma = model(n=4, **{**POINT_LINK, "downlink_sharing": "fdma"})
    one = fdma.round_costs([0], {0: 10**6}, {}, {0: 0}, 0)
    assert one["t_down"] == pytest.approx(full.round_costs([0], {0: 10**6}, {}, {0: 0}, 0)["t_down"])
    four = fdma.round_costs([0, 1, 2, 3], {c: 10**6 for c in range(4)}, {}, {}, 0)
    n0 = 10 ** ((-174 - 30) / 10)
    rate = 12.5e6 * math.log2(1 + 0.25 * 1e-12 / (12.5e6 * n0))  # B/4, P/4
    assert four["t_down"] == pytest.approx(8e6 / rate)
    # a client that receives nothing does not take a share of the band
    assert fdma.round_costs([0, 1], {0: 10**6, 1: 0}, {}, {}, 0)["t_down"] == pytest.approx(one["t_down"])


def test_without_flop_counts_compute_and_round_time_are_unknown():
    m = model(profile="fixed_rate")
    c = m.round_costs([0, 1], {0: 10, 1: 10}, {0: 10, 1: 10}, None, None)
    assert math.isnan(c["t_compute"]) and math.isnan(c["t_server"]) and math.isnan(c["t_round"])
    assert c["t_down"] > 0 and c["t_up"] > 0


def test_cost_totals_sum_rounds():
    rows = [dict.fromkeys(COST_COLUMNS, 1.0), dict.fromkeys(COST_COLUMNS, 2.0)]
    totals = cost_totals(rows)
    assert totals["t_round_total"] == 3.0 and totals["flops_server_total"] == 3.0
    rows[1]["t_compute"] = math.nan
    assert math.isnan(cost_totals(rows)["t_compute_total"])


def test_client_outside_federation_is_refused():
    with pytest.raises(ValueError, match="outside"):
        model(n=2).round_costs([5], {}, {}, {}, 0)


# -- profiles: seeded, deterministic, described -----------------------------------------
def test_profiles_are_seeded_and_stable_under_more_clients():
    a, b, c = model(n=10, seed=1), model(n=10, seed=1), model(n=10, seed=2)
    assert json.dumps(a.describe()) == json.dumps(b.describe())
    assert not np.allclose(a.uplink_bps, c.uplink_bps)
    bigger = model(n=15, seed=1)
    assert np.array_equal(bigger.uplink_bps[:10], a.uplink_bps)
    assert np.array_equal(bigger.flops_per_s[:10], a.flops_per_s)


def test_default_profile_is_kapc_table4():
    m = model(n=50)
    p = m.links.params
    assert ((p["bandwidth_hz"] >= 10e6) & (p["bandwidth_hz"] <= 30e6)).all()
    assert ((p["power_dbm"] >= 23) & (p["power_dbm"] <= 30)).all()
    assert ((p["distance_m"] >= 100) & (p["distance_m"] <= 500)).all()
    assert m.links.server_bandwidth_hz == 50e6 and m.links.server_power_w == pytest.approx(1.0)
    assert np.allclose(p["gain"], 1e-4 * p["distance_m"] ** -4)
    assert (m.uplink_bps > 0).all() and np.isfinite(m.downlink_bps).all()
    assert ((m.flops_per_s >= 1e9) & (m.flops_per_s <= 1e10)).all()
    described = json.loads(json.dumps(m.describe()))
    assert described["profile"] == "kapc_table4" and len(described["clients"]) == 50
    assert {"uplink_bps", "downlink_bps", "flops_per_s", "distance_m"} <= set(described["clients"][0])


def test_tiers_follow_their_shares_exactly():
    assert tier_counts(build_system_config({}).tiers, 10) == [3, 4, 3]
    assert sum(tier_counts(build_system_config({}).tiers, 7)) == 7
    m = model(n=10, devices="tiers")
    assert sorted(m.devices.tier) == sorted(["weak"] * 3 + ["ordinary"] * 4 + ["superior"] * 3)
    speed = {"weak": 2e9, "ordinary": 5e9, "superior": 1e10}
    assert [speed[t] for t in m.devices.tier] == m.flops_per_s.tolist()
    assert "tier" in m.describe()["clients"][0]


@pytest.mark.parametrize("data, words", [
    ({"client_bandwidth_mhz": [5, 10]}, ["client_bandwidth_mhz = [5, 10]", "custom"]),
    ({"profile": "custom", "distance_m": [500, 100]}, ["distance_m", "0 < lo <= hi"]),
    ({"rate_mbps": 5}, ["rate_mbps = 5", "fixed_rate"]),
    ({"profile": "fixed_rate", "downlink_sharing": "fdma"}, ["downlink_sharing", "Shannon"]),
    ({"profile": "fixed_rate", "rate_mbps": 0}, ["system.rate_mbps = 0", "greater than 0"]),
    ({"profile": "nope"}, ["system.profile", "kapc_table4"]),
    ({"devices": "tiers", "tiers": [{"name": "a", "flops": 1e9, "share": 0.4}]}, ["sum to 1"]),
    ({"device_flops": [0, 1e9]}, ["device_flops", "0 < lo"]),
    ({"bandwidth": 3}, ["unknown setting 'system.bandwidth'", "client_bandwidth_mhz"]),
    # wen_table2: its channel is fixed, its compute is not priced by FLOP/s ...
    ({"profile": "wen_table2", "noise_dbm_per_hz": -174},
     ["noise_dbm_per_hz = -174", "profile value -185", "'band_noise'", "'custom'"]),
    ({"profile": "wen_table2", "wen_reading": "density_dbm", "noise_dbm_per_hz": -185},
     ["noise_dbm_per_hz = -185", "profile value -125", "'density_dbm'"]),
    ({"profile": "wen_table2", "wen_reading": "watts"}, ["wen_reading", "band_noise", "density_watts"]),
    ({"wen_reading": "density_dbm"}, ["wen_reading = 'density_dbm'", "only to profile = 'wen_table2'"]),
    ({"profile": "wen_table2", "client_power_dbm": [44.77, 44.77]},
     ["client_power_dbm = [44.77, 44.77] (profile value [30, 30])", "Table 2"]),
    ({"profile": "wen_table2", "downlink_sharing": "fdma"}, ["downlink_sharing = 'fdma'", "wen_table2"]),
    ({"profile": "wen_table2", "devices": "tiers"}, ["devices = 'tiers'", "CPU cycles", "do not apply"]),
    ({"profile": "wen_table2", "device_flops": [1e9, 2e9]}, ["device_flops = [1e+09, 2e+09]", "do not apply"]),
    ({"profile": "wen_table2", "rate_mbps": 5}, ["rate_mbps = 5", "only to profile = 'fixed_rate'"]),
    ({"profile": "wen_table2", "cpu_ghz": [1.0, 0.5]}, ["cpu_ghz", "0 < lo <= hi"]),
    ({"profile": "wen_table2", "data_mb": 0}, ["system.data_mb = 0", "greater than 0"]),
    # ... and its compute settings apply to it alone
    ({"cycles_per_bit": 20}, ["cycles_per_bit = 20", "only to profile = 'wen_table2'", "'kapc_table4'"]),
    ({"profile": "custom", "cpu_ghz": [1, 2]}, ["cpu_ghz = [1, 2] (default [0.5, 1])", "'custom'"]),
    ({"profile": "fixed_rate", "data_mb": 4}, ["data_mb = 4", "'wen_table2'", "counted FLOPs"]),
])
def test_bad_settings_name_the_value_and_the_valid_range(data, words):
    with pytest.raises(ConfigError) as exc:
        build_system_config(data)
    for word in words:
        assert word in str(exc.value)


@pytest.mark.parametrize("data", [{}, {"devices": "tiers"}, {"profile": "fixed_rate", "rate_mbps": 3},
                                  {"profile": "custom", "distance_m": [10, 20]},
                                  {"profile": "wen_table2"}, {"profile": "wen_table2", "data_mb": 1.5}])
def test_config_survives_its_json_copy_unchanged(data):
    # resume compares a run's config with the JSON it stored: tuples would differ from lists
    dumped = build_system_config(data).model_dump()
    assert json.loads(json.dumps(dumped)) == dumped
    assert build_system_config(json.loads(json.dumps(dumped))).model_dump() == dumped


# -- wen_table2 (Wen et al. Table 2) ----------------------------------------------------
N0_WEN = 10 ** ((-125 - 30) / 10)  # -125 dBm/Hz in W/Hz
N0_BAND = 10 ** ((-125 - 30) / 10) / 1e6  # -125 dBm over 1 MHz, per Hz


def test_wen_table2_config_carries_the_profile_values():
    cfg = build_system_config({"profile": "wen_table2"})
    assert cfg.client_bandwidth_mhz == [1.0, 1.0] and cfg.server_bandwidth_mhz == 1.0
    assert cfg.client_power_dbm == [30.0, 30.0] and cfg.server_power_dbm == 30.0  # 1 W
    assert cfg.wen_reading == "band_noise" and cfg.noise_dbm_per_hz == -185.0
    assert (cfg.up_interference_mean, cfg.up_interference_std) == (0.0, 0.0)
    assert (cfg.down_interference_mean, cfg.down_interference_std) == (0.0, 0.0)
    assert cfg.distance_m == [100.0, 500.0] and cfg.path_loss_db == -40.0  # KAPC Table 4's
    assert (cfg.cpu_ghz, cfg.cycles_per_bit, cfg.data_mb) == ([0.5, 1.0], 15.0, 2.0)
    # restating a profile value is fine; so is changing its compute settings
    build_system_config({"profile": "wen_table2", "noise_dbm_per_hz": -185, "cpu_ghz": [0.6, 0.9]})
    # the literal readings, by name
    dbm = build_system_config({"profile": "wen_table2", "wen_reading": "density_dbm"})
    assert dbm.noise_dbm_per_hz == -125.0 and dbm.client_power_dbm == [30.0, 30.0]
    watts = build_system_config({"profile": "wen_table2", "wen_reading": "density_watts"})
    assert watts.noise_dbm_per_hz == -125.0 and watts.client_power_dbm == [44.77, 44.77]
    # the profile is filled in when the whole run config is built, too
    from edgepfl.config import build_config
    assert build_config({}, ["system.profile=wen_table2"]).system == cfg
    # the FLOP profiles keep their values
    kapc = build_system_config({})
    assert kapc.client_bandwidth_mhz == [10.0, 30.0] and kapc.noise_dbm_per_hz == -174.0


def test_wen_table2_rates_match_hand_computation():
    # the worked example in docs/system.md: B = 1 MHz, p = 30 dBm = 1 W, -125 dBm of noise
    # over the band, h = 1e-4 * d^-4, no interference: 11.6 Mbit/s at 100 m, 2.6 at 500 m
    at_100m = 1e6 * math.log2(1 + 1.0 * 1e-12 / (1e6 * N0_BAND))
    at_500m = 1e6 * math.log2(1 + 1.0 * (1e-4 * 500.0 ** -4) / (1e6 * N0_BAND))
    assert at_100m == pytest.approx(11.63e6, rel=1e-3) and at_500m == pytest.approx(2.59e6, rel=1e-2)
    assert shannon_rate(1e6, 1.0, 1e-12, 0.0, N0_BAND) == pytest.approx(at_100m, rel=1e-12)
    m = model(n=4, epochs=1, profile="wen_table2")
    p = m.links.params
    d = float(p["distance_m"][0])
    assert 100 <= d <= 500 and p["bandwidth_hz"][0] == 1e6 and p["power_dbm"][0] == 30.0
    rate = 1e6 * math.log2(1 + 1.0 * (1e-4 * d ** -4) / (1e6 * N0_BAND))
    assert m.uplink_bps[0] == pytest.approx(rate, rel=1e-9)
    assert m.downlink_bps[0] == pytest.approx(rate, rel=1e-9)  # the server: 1 MHz, 1 W too
    costs = m.round_costs([0], {0: 1_000_000}, {0: 1_000_000}, {0: 0}, 0)
    assert costs["t_up"] == pytest.approx(8e6 / rate) and costs["t_down"] == pytest.approx(8e6 / rate)
    # the literal readings: -125 dBm/Hz as a density, with 30 dBm (57 bit/s at the median
    # 300 m) and 30 W as printed (1.7 kbit/s there)
    dbm = model(n=4, epochs=1, profile="wen_table2", wen_reading="density_dbm")
    d = float(dbm.links.params["distance_m"][0])
    assert dbm.uplink_bps[0] == pytest.approx(
        1e6 * math.log2(1 + 1.0 * (1e-4 * d ** -4) / (1e6 * N0_WEN)), rel=1e-9)
    assert 1e6 * math.log2(1 + 1e-4 * 300.0 ** -4 / (1e6 * N0_WEN)) == pytest.approx(56.3, rel=1e-2)
    watts = model(n=4, epochs=1, profile="wen_table2", wen_reading="density_watts")
    assert watts.links.params["power_dbm"][0] == pytest.approx(44.77)
    assert 1e6 * math.log2(1 + 30.0 * 1e-4 * 300.0 ** -4 / (1e6 * N0_WEN)) == pytest.approx(1.69e3, rel=1e-2)


def test_wen_table2_compute_is_epochs_cycles_bits_over_frequency():
    m = model(n=5, epochs=3, profile="wen_table2")
    f = m.devices.cpu_hz
    assert ((f >= 0.5e9) & (f <= 1e9)).all() and len(set(f.tolist())) == 5
    expected = {cid: 3 * 15 * (2e6 * 8) / f[cid] for cid in range(5)}  # 0.72-1.44 s
    # FLOPs do not price it: any count, or none at all, gives the same compute time
    times = m.client_times([0, 1, 2], {}, {}, {0: 123, 1: 0, 2: 10**12})
    assert {cid: c for cid, (_, c, _) in times.items()} == pytest.approx(
        {cid: expected[cid] for cid in range(3)}, rel=1e-12)
    costs = m.round_costs([0, 1, 2], {}, {}, None, None)
    assert costs["t_compute"] == pytest.approx(max(expected[c] for c in range(3)), rel=1e-12)
    assert math.isnan(costs["t_server"]) and math.isnan(costs["flops_client"])
    # a point CPU and the other settings: 2 epochs x 20 cycles/bit x 4e6 bit / 1 GHz = 0.16 s
    point = model(n=2, epochs=2, profile="wen_table2", cpu_ghz=[1, 1], cycles_per_bit=20, data_mb=0.5)
    assert point.round_costs([1], {}, {}, {1: 0}, 0)["t_compute"] == pytest.approx(0.16, rel=1e-12)
    # a hierarchy pays it once per edge round (each edge round is train.local_epochs)
    step = EdgeStep([1], {}, {}, None, 0)
    h = point.hierarchical_costs({0: [step, step]}, {}, {}, 0)
    assert h["t_compute"] == pytest.approx(0.32, rel=1e-12)
    # seeded per client, from a stream of its own
    assert np.array_equal(model(n=9, epochs=3, profile="wen_table2").devices.cpu_hz[:5], f)
    described = json.loads(json.dumps(m.describe()))
    assert described["devices"] == "cpu_cycles" and described["epochs"] == 3
    assert described["data_bits"] == 16e6 and described["cycles_per_bit"] == 15
    row = described["clients"][0]
    assert "flops_per_s" not in row and row["compute_s"] == pytest.approx(expected[0])


def test_wen_table2_needs_the_local_epochs():
    with pytest.raises(ConfigError, match=r"epochs=cfg\.train\.local_epochs"):
        SystemModel.build(build_system_config({"profile": "wen_table2"}), 3, 0)


def test_epochs_do_not_change_the_flop_profiles():
    for cfg in [{}, {"profile": "fixed_rate"}, {"devices": "tiers"}]:
        plain, told = model(n=5, **cfg), model(n=5, epochs=7, **cfg)
        assert plain.compute_s is None and plain.devices.cpu_hz is None
        assert json.dumps(plain.describe()) == json.dumps(told.describe())
        args = ([0, 1], {0: 10**5, 1: 10**5}, {0: 10**5, 1: 10**5}, {0: 10**9, 1: 2 * 10**9}, 10**9)
        assert plain.round_costs(*args) == told.round_costs(*args)


def test_at_least_one_client():
    with pytest.raises(ConfigError, match="at least 1 client"):
        SystemModel.build(build_system_config({}), 0, 0)


# -- FLOPs ------------------------------------------------------------------------------
def test_linear_layer_flops_match_the_formula():
    b, i, o = 8, 32, 16
    layer = nn.Linear(i, o)
    x = torch.randn(b, i)
    _, fwd = count_flops(layer, x)
    assert fwd == 2 * b * i * o  # one multiply-add = 2 FLOPs; the bias add is not counted

    def step(inp):
        layer(inp).sum().backward()

    _, train = count_flops(step, x)
    assert train == 2 * b * i * o + 2 * b * i * o  # forward + weight gradient
    _, train_with_input_grad = count_flops(step, x.clone().requires_grad_(True))
    assert train_with_input_grad == 3 * 2 * b * i * o  # ... + input gradient


def _train(meter=None, key=None):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = torch.randn(16, 1, 8, 8), torch.randint(0, 3, (16,))

    def run():
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

    if meter is None:
        run()
        return net, None
    with meter.measure(key) as m:
        run()
    return net, m


def test_meter_counts_once_per_key_and_reuses_the_count():
    meter = FlopMeter()
    _, first = _train(meter, key=("client", 0))
    _, again = _train(meter, key=("client", 0))
    _, other = _train(meter, key=("client", 1))
    assert first.flops > 0 and not first.cached
    assert again.flops == first.flops and again.cached
    assert other.flops == first.flops and not other.cached
    assert (meter.hits, meter.misses) == (1, 2)
    _, uncached = _train(meter, key=None)
    assert not uncached.cached and uncached.flops == first.flops
    _, off = _train(FlopMeter(enabled=False), key=("client", 0))
    assert off.flops is None


def test_counting_does_not_change_training():
    plain, _ = _train()
    counted, _ = _train(FlopMeter(cache=False))
    for a, b in zip(plain.parameters(), counted.parameters(), strict=True):
        assert torch.equal(a, b)


def test_failed_block_is_not_cached():
    meter = FlopMeter()
    with pytest.raises(RuntimeError), meter.measure(key="k"):
        torch.ones(2, 2) @ torch.ones(2, 2)
        raise RuntimeError("client crashed")
    with meter.measure(key="k") as m:
        torch.ones(2, 2) @ torch.ones(2, 2)
    assert not m.cached and m.flops == 16


def test_not_counted_work_is_left_out_of_the_count():
    a, b = torch.ones(2, 3), torch.ones(3, 4)
    meter = FlopMeter(cache=False)
    with meter.measure() as m:
        a @ b  # 2 * 2 * 3 * 4 = 48 FLOPs, counted
        with not_counted():
            b.T @ a.T  # the same 48 again, left out
            with not_counted():  # nested: left out once, not twice
                a @ b
    assert (m.flops, m.excluded) == (48, 96)
    with not_counted():  # outside a measured block it only runs the block
        assert torch.equal(a @ b, torch.full((2, 4), 3.0))
    with pytest.raises(RuntimeError), meter.measure(), not_counted():
        a @ b
        raise RuntimeError("failed inside the excluded block")
    with meter.measure() as after:  # the failure left no active exclusion behind
        a @ b
    assert (after.flops, after.excluded) == (48, 0)


def test_work_signature_sees_shapes_and_metadata_not_values():
    class Msg:  # duck-typed like engine.messages.Message
        def __init__(self, tensors, meta):
            self.tensors, self.meta = tensors, meta

    a = work_signature(Msg({"w": torch.zeros(3, 2)}, {"layers": [0, 1]}), {"s": torch.ones(4)})
    b = work_signature(Msg({"w": torch.ones(3, 2)}, {"layers": [0, 1]}), {"s": torch.zeros(4)})
    assert a == b and hash(a) == hash(b)
    assert a != work_signature(Msg({"w": torch.zeros(3, 3)}, {"layers": [0, 1]}), {"s": torch.ones(4)})
    assert a != work_signature(Msg({"w": torch.zeros(3, 2)}, {"layers": [0]}), {"s": torch.ones(4)})
    with pytest.raises(TypeError):
        work_signature(object())


# -- memory -----------------------------------------------------------------------------
def test_state_bytes_counts_each_storage_once():
    stack = torch.zeros(10, 4)  # 160 bytes
    assert state_bytes({"stack": stack, "row": stack[3], "other": torch.zeros(2, dtype=torch.float64)}) == 176
    assert state_bytes([]) == 0
    with pytest.raises(TypeError):
        state_bytes({"x": 1})


def test_peak_rss_is_plausible():
    assert 10 * 2**20 < peak_rss_bytes() < 2**40


def test_a_training_step_holds_weights_gradients_and_the_activations_saved_for_backward():
    import torch

    from edgepfl.system.memory import training_step_bytes

    linear = torch.nn.Linear(8, 4)
    # Linear saves its input (the weight is a parameter, already counted)
    assert training_step_bytes(linear, (8,), 5) == {
        "weights": 36 * 4, "gradients": 36 * 4, "activations": 5 * 8 * 4, "total": 2 * 144 + 160}
    deeper = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    held = training_step_bytes(deeper, (8,), 5)
    # the input, the first layer's output (for ReLU) and ReLU's output (for the last layer)
    assert held["activations"] >= 5 * (8 + 16) * 4
