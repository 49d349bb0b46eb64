"""Adaptive clipping for client-level DP (``privacy.clip = "adaptive"``,
``edgepfl.privacy.adaptive``; Andrew et al. 2021): the clip's update, the update noise that
keeps the total at ``privacy.noise_multiplier``, the accounting, resume and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message
from edgepfl.federation.topology import CLOUD
from edgepfl.privacy.adaptive import delta_multiplier, next_clip
from tests.conftest import resumed_and_straight, without_wall

dp = pytest.importorskip("dp_accounting")

# synthetic data cut to a fifth: 4 clients of 100 training samples
BASE = ["dataset.name=synthetic", "dataset.fraction=0.2", "partition.clients=4",
        "partition.scheme=iid", "train.rounds=2", "train.batch_size=25",
        "train.local_epochs=1", "train.lr=0.05", "output.plots=false",
        "system.count_flops=false", "algorithm.name=fedavg", "privacy.level=client"]
ADAPTIVE = ["privacy.clip=adaptive"]
# no noise anywhere: the clip's path is a function of the update norms alone
EXACT = [*ADAPTIVE, "privacy.noise_multiplier=0", "privacy.clip_count_stddev=0"]


def config(*overrides: str):
    return build_config({}, BASE + list(overrides))


def run(*overrides: str) -> Simulation:
    sim = Simulation(config(*overrides), progress=False)
    sim.run()
    return sim


def test_the_clip_follows_the_geometric_update_of_the_unclipped_fraction():
    """Known update norms 0.05, 0.2, 0.5 and 1: after each aggregation the clip is
    C exp(-clip_lr (fraction of norms <= C - target_quantile)), exactly."""
    sim = Simulation(config(*EXACT, "privacy.clip_initial=0.1", "privacy.clip_lr=0.5",
                            "privacy.target_quantile=0.6"), progress=False)
    privacy, ledger = sim.rounds.privacy, sim.rounds.ledger
    privacy.trained(ledger, None)
    norms = [0.05, 0.2, 0.5, 1.0]
    sent = {c: Message({"w": torch.zeros(3)}) for c in range(4)}
    arrived = {c: Message({"w": torch.tensor([n, 0.0, 0.0])}) for c, n in enumerate(norms)}
    clip, expected = 0.1, []
    for step in range(1, 31):
        fraction = sum(n <= clip for n in norms) / 4
        expected.append((clip, fraction))
        clip = clip * math.exp(-0.5 * (fraction - 0.6))
        privacy.replies(step, CLOUD, sent, arrived, 4)
        assert privacy.adaptive.clip(CLOUD) == clip
        assert ledger.privacy["clip"] == [clip] * 4  # each client's: its aggregator's
        row = privacy.row(ledger, step)
        assert (row["clip"], row["clip_quantile_est"]) == expected[-1]
    # from 0.1 to the norms' 0.6 quantile (0.5 to 1: 0.6 of them at or under 0.5), where it
    # stays within a step of 0.5
    assert 0.46 < clip < 0.53


@pytest.mark.parametrize("initial, grows", [(100.0, False), (1e-7, True)])
def test_the_clip_shrinks_when_nothing_is_clipped_and_grows_when_everything_is(initial, grows):
    sim = run(*EXACT, f"privacy.clip_initial={initial}", "train.rounds=3",
              "privacy.target_quantile=0.3")
    clips = [r["clip"] for r in sim.metrics]
    fraction = 0.0 if grows else 1.0
    assert [r["clip_quantile_est"] for r in sim.metrics] == [fraction] * 3
    assert [r["dp_clipped"] for r in sim.metrics] == [1.0 - fraction] * 3
    want = [initial]
    for _ in range(3):
        want.append(next_clip(want[-1], fraction, 0.3, 0.2))
    assert clips == want[:3]
    assert sim.summary()["privacy"]["clip_final"] == want[3]
    assert (clips[-1] > clips[0]) == grows


def test_the_update_noise_leaves_the_total_at_the_noise_multiplier():
    """z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2); the clipped sum (sensitivity 2 C under
    replace-one) and the count (sensitivity 1) together spend what one query of z does."""
    z, sigma_b = 1.0, 0.8
    z_delta = delta_multiplier(z, sigma_b)
    assert z_delta == pytest.approx((z ** -2 - (2 * sigma_b) ** -2) ** -0.5, rel=1e-15)
    assert delta_multiplier(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="at most privacy.noise_multiplier / 2"):
        delta_multiplier(1.0, 0.5)

    def epsilon(*events):
        acc = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
        for event in events:
            acc.compose(dp.SampledWithoutReplacementDpEvent(20, 5, event), 10)
        return acc.get_epsilon(1e-3)

    both = dp.ComposedDpEvent([dp.GaussianDpEvent(z_delta / 2), dp.GaussianDpEvent(sigma_b)])
    assert epsilon(both) == pytest.approx(epsilon(dp.GaussianDpEvent(z / 2)), rel=1e-9)
    sim = Simulation(config(*ADAPTIVE, "privacy.clip_count_stddev=0.8"), progress=False)
    assert sim.rounds.privacy.adaptive.multiplier == [z_delta]


def test_epsilon_is_the_fixed_clips_with_the_same_noise_multiplier(monkeypatch):
    from edgepfl.privacy import per_round

    used = []
    real = per_round.private_replies

    def spy(arrived, sent, expected, clip, noise_multiplier, *rest):
        used.append((clip, noise_multiplier))
        return real(arrived, sent, expected, clip, noise_multiplier, *rest)

    monkeypatch.setattr(per_round, "private_replies", spy)
    adaptive = run(*ADAPTIVE, "privacy.noise_multiplier=1.5", "privacy.clip_count_stddev=1")
    # each round's sum clipped at that round's clip, noised at z_delta
    assert used == [(r["clip"], delta_multiplier(1.5, 1.0)) for r in adaptive.metrics]
    fixed = run("privacy.noise_multiplier=1.5", "privacy.clip=0.3")
    assert [r["epsilon"] for r in adaptive.metrics] == [r["epsilon"] for r in fixed.metrics]
    assert adaptive.summary()["epsilon"] == fixed.summary()["epsilon"]
    assert "clip" not in fixed.metrics[-1] and "clip_final" not in fixed.summary()["privacy"]
    info = adaptive.summary()["privacy"]
    assert info["clip"] == "adaptive" and info["clip_count_stddev"] == 1.0
    assert info["update_noise_multiplier"] == delta_multiplier(1.5, 1.0)


def test_a_resumed_run_goes_on_from_the_clip_it_had(tmp_path):
    resumed, straight = resumed_and_straight(
        tmp_path, "algorithm.name=fedavg", "privacy.level=client", *ADAPTIVE,
        "privacy.noise_multiplier=0.5", "dataset.fraction=0.2", "system.count_flops=false")
    def rows(sim):  # NaN (the unmeasured times) compared as None
        return [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
                for r in without_wall(sim.metrics)]

    assert rows(resumed) == rows(straight)
    assert resumed.rounds.ledger.privacy == straight.rounds.ledger.privacy
    clips = [r["clip"] for r in straight.metrics]
    assert len(set(clips)) == 3  # it moved every round


def test_each_edge_has_its_own_clip():
    sim = run("algorithm.name=hierfavg", "topology.edges=2", "topology.edge_rounds=2",
              "topology.assignment=contiguous", "partition.clients=5", *ADAPTIVE,
              "privacy.noise_multiplier=0", "privacy.clip_count_stddev=0.3")
    info = sim.summary()["privacy"]
    assert len(info["clip_final"]) == 2 and info["clip_final"][0] != info["clip_final"][1]
    ledger = sim.rounds.ledger.privacy["clip"]
    edge = sim.rounds.federation.parent
    assert all(ledger[c] == info["clip_final"][edge[c]] for c in range(5))


@pytest.mark.parametrize("overrides, named", [
    (["privacy.clip=adaptiv"], "privacy.clip = 'adaptiv'"),
    (["privacy.clip=-1"], "privacy.clip = -1"),
    ([*ADAPTIVE, "privacy.target_quantile=1"], "target_quantile"),
    ([*ADAPTIVE, "privacy.clip_lr=0"], "clip_lr"),
    ([*ADAPTIVE, "privacy.clip_initial=0"], "clip_initial"),
    ([*ADAPTIVE, "privacy.clip_count_stddev=-1"], "clip_count_stddev"),
    (["privacy.target_quantile=0.3"], "privacy.target_quantile given with privacy.clip = 1"),
    (["privacy.clip=0.5", "privacy.clip_lr=0.1"], "privacy.clip_lr given"),
    ([*ADAPTIVE, "privacy.level=sample"], "privacy.clip = 'adaptive' with privacy.level"),
])
def test_bad_settings_are_refused_naming_them(overrides, named):
    with pytest.raises(ConfigError) as err:
        config(*overrides)
    assert named in str(err.value)


@pytest.mark.parametrize("overrides, named", [
    (["privacy.clip_count_stddev=0.4"], "privacy.clip_count_stddev above 0.5"),
    ([], "its default, 4 sampled clients / 20"),  # 0.2 <= 1 / 2
])
def test_a_count_noise_too_small_for_the_noise_multiplier_is_refused(overrides, named):
    with pytest.raises(ConfigError) as err:
        Simulation(config(*ADAPTIVE, "privacy.noise_multiplier=1", *overrides), progress=False)
    assert named in str(err.value)


def test_a_flower_run_clips_as_the_simulation_does():
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    from edgepfl.engine.flower_local import run_local
    from tests.conftest import fast_config

    rc = {"dataset.name": "synthetic", "partition.clients": 3, "train.rounds": 2,
          "train.batch_size": 32, "train.local_epochs": 1, "train.lr": 0.05,
          "output.plots": False, "system.count_flops": False, "algorithm.name": "fedavg",
          "privacy.level": "client", "privacy.clip": "adaptive",
          "privacy.noise_multiplier": 0.5, "privacy.clip_count_stddev": 0.5}
    sets = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in rc.items()]
    sim = Simulation(fast_config(*sets), progress=False).run()
    result = run_local(rc)
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("clip", "clip_quantile_est", "dp_clipped", "epsilon", "acc_mean", "loss"):
            assert ours[key] == theirs[key], (ours["round"], key)
    assert result.summary["privacy"]["clip_final"] == sim.summary["privacy"]["clip_final"]
