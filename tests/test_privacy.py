"""Differential privacy (``privacy.*``, ``edgepfl.privacy``): DP-FedAvg at the aggregator,
DP-SGD on the clients, the accounting against dp-accounting itself, the budget's stop and
the refusals."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS
from edgepfl.config import build_config, parse_value
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.aggregate import weighted_average
from edgepfl.federation.messages import Message
from edgepfl.privacy import PrivacyError
from edgepfl.privacy.accountant import calibrate, client_epsilon, sample_epsilon
from edgepfl.privacy.dp_fedavg import private_replies
from edgepfl.privacy.dpsgd import PrivateTrainer, accounted
from edgepfl.training.client_data import ClientData
from edgepfl.training.trainer import Trainer
from tests.conftest import resumed_and_straight, without_wall

dp = pytest.importorskip("dp_accounting")

# synthetic data cut to a fifth: 4 clients of 100 training samples (iid: equal sizes)
BASE = ["dataset.name=synthetic", "dataset.fraction=0.2", "partition.clients=4",
        "partition.scheme=iid", "train.rounds=2", "train.batch_size=25",
        "train.local_epochs=1", "train.lr=0.05", "output.plots=false",
        "system.count_flops=false"]


def run(*overrides: str, out=None) -> Simulation:
    sim = Simulation(build_config({}, BASE + list(overrides)), out, progress=False)
    sim.run()
    return sim


def spy_aggregate(sim: Simulation) -> list[tuple[dict, dict[int, Message]]]:
    """Every aggregation's (server model before, replies it was handed)."""
    seen: list[tuple[dict, dict[int, Message]]] = []
    server = sim.server
    original = server.aggregate

    def aggregate(rnd, replies):
        seen.append(({k: v.clone() for k, v in server.global_model.items()}, replies))
        return original(rnd, replies)

    server.aggregate = aggregate
    return seen


def update_norm(reply: Message, before: dict) -> float:
    return math.sqrt(sum(float((reply.tensors[k] - before[k]).double().pow(2).sum())
                         for k, t in reply.tensors.items() if t.is_floating_point()))


# -- the aggregator's mechanism -----------------------------------------------------------
def _model(gen, scale=1.0) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(300, 200, generator=gen) * scale,
            "b": torch.randn(200, generator=gen) * scale,
            "count": torch.tensor(3)}


def test_without_noise_and_an_unreached_clip_the_aggregate_is_the_equal_weight_mean():
    gen = torch.Generator().manual_seed(0)
    sent = Message(_model(gen))
    replies = {c: Message({k: (v + 0.01 * torch.randn(v.shape, generator=gen)
                               if v.is_floating_point() else v + 1)
                           for k, v in sent.tensors.items()}, {"num_samples": 10 + c})
               for c in range(4)}
    out = private_replies(replies, dict.fromkeys(replies, sent), 4, 1e9, 0.0,
                          torch.Generator().manual_seed(1), "test")
    private = weighted_average([m.tensors for m in out.values()], [1.0] * 4)
    plain = weighted_average([m.tensors for m in replies.values()], [1.0] * 4)
    for k in ("w", "b"):
        torch.testing.assert_close(private[k], plain[k], rtol=0, atol=1e-6)
    # the clients' counters and sample counts never reach the algorithm
    assert int(private["count"]) == 3
    assert all(m.meta == {"num_samples": 1} for m in out.values())


def test_clipping_bounds_every_update_and_the_denominator_is_the_sample():
    gen = torch.Generator().manual_seed(0)
    sent = Message(_model(gen))
    replies = {c: Message({k: v + torch.randn(v.shape, generator=gen) if v.is_floating_point()
                           else v for k, v in sent.tensors.items()}) for c in range(3)}
    # 3 replies from 5 sampled: each clipped update enters as 3/5 of itself
    out = private_replies(replies, dict.fromkeys(replies, sent), 5, 0.5, 0.0,
                          torch.Generator(), "test")
    for c, m in out.items():
        assert update_norm(m, sent.tensors) == pytest.approx(0.5 * 3 / 5, rel=1e-5)
        assert update_norm(replies[c], sent.tensors) > 10


def test_the_noise_on_the_sum_has_the_configured_std():
    gen = torch.Generator().manual_seed(0)
    sent = Message(_model(gen))
    same = {c: Message(dict(sent.tensors)) for c in range(4)}
    noise, clip, sampled = 1.3, 0.7, 4
    out = private_replies(same, dict.fromkeys(same, sent), sampled, clip, noise,
                          torch.Generator().manual_seed(5), "test")
    delta = torch.cat([(out[0].tensors[k] - sent.tensors[k]).flatten() for k in ("w", "b")])
    # one draw for the aggregate: every reply carries the same noise / K
    assert torch.equal(out[0].tensors["w"], out[3].tensors["w"])
    std = float(delta.double().std()) * sampled  # the noise on the sum
    assert std == pytest.approx(noise * clip, rel=0.01)
    assert abs(float(delta.double().mean())) * sampled < 0.01 * noise * clip


def test_clients_sent_different_models_are_refused():
    gen = torch.Generator().manual_seed(0)
    a, b = Message(_model(gen)), Message(_model(gen))
    with pytest.raises(PrivacyError, match="sent the same model"):
        private_replies({0: a, 1: b}, {0: a, 1: b}, 2, 1.0, 1.0, torch.Generator(), "test")


# -- runs at client level -----------------------------------------------------------------
def test_a_private_run_without_noise_equals_the_equal_weight_run():
    """Noise 0 and a clip no update reaches: DP-FedAvg's estimator with equal weights; on
    an iid split of equal client sizes that is FedAvg's sample-weighted mean, so the run is
    the non-private run to float rounding."""
    plain = run("algorithm.name=fedavg")
    sizes = plain.transport.train_sizes
    assert len(set(sizes)) == 1, sizes
    private = run("algorithm.name=fedavg", "privacy.level=client",
                  "privacy.noise_multiplier=0", "privacy.clip=1e6")
    for a, b in zip(plain.metrics, private.metrics, strict=True):
        assert a["acc_mean"] == pytest.approx(b["acc_mean"], abs=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
        assert b["dp_clipped"] == 0.0 and b["epsilon"] == math.inf
    for k, v in plain.server.global_model.items():
        torch.testing.assert_close(private.server.global_model[k], v, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [a.name for a in ALGORITHMS.values()
                                  if a.privacy.client == "mean" and a.edge is None])
def test_no_algorithm_declared_for_client_level_sees_an_unclipped_update(name):
    """What is never to be aggregated unclipped is never handed to the aggregate."""
    # FedBABU's test-time fine-tuning is outside the accounting: without it, it takes privacy
    own = ["algorithm.finetune_epochs=0"] if name == "fedbabu" else []
    sim = Simulation(build_config({}, BASE + [f"algorithm.name={name}", "train.rounds=1",
                                              "privacy.level=client", "privacy.clip=0.01",
                                              "privacy.noise_multiplier=0", *own]), progress=False)
    seen = spy_aggregate(sim)
    sim.run()
    assert seen
    for before, replies in seen:
        for reply in replies.values():
            model = {k: before[k] for k in reply.tensors}
            assert update_norm(reply, model) <= 0.01 * (1 + 1e-5)
            assert reply.meta == {"num_samples": 1}


def test_a_hierarchy_noises_at_each_edge_and_accounts_the_largest_edge():
    over = ["algorithm.name=hierfavg", "topology.edges=2", "topology.edge_rounds=2",
            "topology.assignment=contiguous", "partition.clients=5",
            "train.participation=0.5", "privacy.level=client", "privacy.noise_multiplier=2"]
    sim = run(*over)
    # edges of 2 and 3 clients; each samples round(0.5 n): 1 of 2, 2 of 3 (Python rounds half
    # to even), the same sample for both edge rounds of a cloud round
    direct = []
    for n, k in ((2, 1), (3, 2)):
        acc = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
        acc.compose(dp.SampledWithoutReplacementDpEvent(
            n, k, dp.SelfComposedDpEvent(dp.GaussianDpEvent(1.0), 2)), 2)
        direct.append(acc.get_epsilon(1 / 5))
    assert sim.summary()["epsilon"] == pytest.approx(max(direct), rel=1e-12)
    assert sim.summary()["privacy"]["noise_at"] == "edge"


# -- accounting ---------------------------------------------------------------------------
def test_client_epsilon_is_the_librarys():
    acc = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
    # the library's noise multiplier is std / sensitivity; replace-one: sensitivity 2 clip
    acc.compose(dp.SampledWithoutReplacementDpEvent(100, 10, dp.GaussianDpEvent(1.5 / 2)), 30)
    assert client_epsilon(((100, 10),), 1.5, 1, 30, 1e-3) == acc.get_epsilon(1e-3)


@pytest.mark.parametrize("kind", ["rdp", "pld"])
def test_sample_epsilon_is_the_librarys(kind):
    acc = (dp.pld.PLDAccountant() if kind == "pld" else dp.rdp.RdpAccountant())
    acc.compose(dp.PoissonSampledDpEvent(0.05, dp.GaussianDpEvent(1.1)), 400)
    assert sample_epsilon(((0.05, 400),), 1.1, 1e-4, kind) == acc.get_epsilon(1e-4)


def test_sample_level_can_account_under_replace_one():
    """With a client's sample count public (it leaves in every reply), the matching relation
    is replace-one: the run's epsilon is the library's under it, above add-or-remove's."""
    acc = dp.pld.PLDAccountant(dp.NeighboringRelation.REPLACE_ONE)
    acc.compose(dp.PoissonSampledDpEvent(0.05, dp.GaussianDpEvent(1.1)), 400)
    replace = sample_epsilon(((0.05, 400),), 1.1, 1e-4, "pld", "replace_one")
    assert replace == acc.get_epsilon(1e-4) > sample_epsilon(((0.05, 400),), 1.1, 1e-4, "pld")
    over = ["algorithm.name=fedavg", "privacy.level=sample", "privacy.noise_multiplier=1.1",
            "privacy.delta=1e-3", "privacy.accountant=pld"]
    plain, replaced = run(*over).summary(), run(*over, "privacy.relation=replace_one").summary()
    assert replaced["epsilon"] > plain["epsilon"]
    assert replaced["privacy"]["relation"] == "replace_one"
    assert "replace-one" in replaced["privacy"]["sampling"]
    assert plain["privacy"]["relation"] == "add_remove"


def test_the_headline_epsilon_comes_with_its_own_delta():
    """At sample level with privacy.delta unset each client has its own delta (1 / its
    samples): the summary's pair is the worst client's epsilon with that client's delta."""
    summary = run("algorithm.name=fedavg", "privacy.level=sample", "partition.scheme=dirichlet",
                  "partition.alpha=0.3").summary()
    eps, deltas = summary["epsilon_per_client"], summary["privacy"]["delta_per_client"]
    worst = eps.index(max(eps))
    assert summary["epsilon"] == eps[worst] and summary["delta"] == deltas[worst]
    assert len(set(deltas)) > 1


@pytest.mark.parametrize("over,words", [
    (["privacy.level=sample", "privacy.relation=replace_one"], ["replace_one", "pld"]),
    (["privacy.level=client", "privacy.relation=add_remove"], ["add_remove", "replace_one"]),
])
def test_a_relation_the_accounting_cannot_take_is_refused(over, words):
    with pytest.raises(ConfigError) as err:
        run("algorithm.name=fedavg", *over)
    for word in words:
        assert word in str(err.value), word


def test_calibrated_noise_is_the_smallest_within_the_budget():
    def epsilon_of(noise):
        return client_epsilon(((50, 5),), noise, 1, 20, 0.02)

    noise = calibrate(epsilon_of, 4.0, tol=1e-2)
    assert epsilon_of(noise) <= 4.0 < epsilon_of(noise - 2e-2)


def test_a_runs_epsilon_column_is_the_librarys_for_its_rounds():
    sim = run("algorithm.name=fedavg", "train.participation=0.5", "privacy.level=client",
              "privacy.noise_multiplier=3", "privacy.delta=1e-3")
    for row in sim.metrics:
        acc = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE)
        acc.compose(dp.SampledWithoutReplacementDpEvent(4, 2, dp.GaussianDpEvent(1.5)),
                    row["round"])
        assert row["epsilon"] == acc.get_epsilon(1e-3)
    assert sim.summary()["epsilon"] == sim.metrics[-1]["epsilon"]


def test_sample_level_accounts_each_clients_own_steps():
    sim = run("algorithm.name=fedavg", "privacy.level=sample", "privacy.noise_multiplier=1.2")
    summary = sim.summary()
    steps = summary["privacy"]["steps_per_client"]
    # 100 samples, batches of 25 expected: 4 steps an epoch, one epoch a round, 2 rounds
    assert steps == [8, 8, 8, 8]
    acc = dp.rdp.RdpAccountant()
    acc.compose(dp.PoissonSampledDpEvent(0.25, dp.GaussianDpEvent(1.2)), 8)
    assert summary["epsilon_per_client"] == [acc.get_epsilon(1 / 100)] * 4
    assert summary["epsilon"] == sim.metrics[-1]["epsilon"]


def test_sample_level_resumes_with_the_steps_counted_so_far(tmp_path):
    over = ["algorithm.name=fedper", "privacy.level=sample", "train.participation=0.5",
            "train.rounds=3"]
    straight = run(*over)
    first = Simulation(build_config({}, BASE + over), tmp_path, progress=False)
    first.step()
    first.step()
    first.save_checkpoint()
    resumed = Simulation(build_config({}, BASE + over), tmp_path, progress=False)
    resumed.load_checkpoint(tmp_path / "checkpoint.safetensors")
    resumed.step()
    assert resumed.summary()["epsilon_per_client"] == straight.summary()["epsilon_per_client"]


def test_sample_level_resumed_run_counts_the_flops_of_a_straight_one(tmp_path):
    """DP-SGD's batches have random sizes: a round's FLOPs are counted, not an earlier
    round's reused (which a resumed run's empty meter had not kept), so every column but
    wall_s equals the straight run's, flops_client and the round times included."""
    resumed, straight = resumed_and_straight(
        tmp_path, "algorithm.name=fedavg", "privacy.level=sample",
        "privacy.noise_multiplier=1.0", "dataset.fraction=0.2")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    assert resumed.metrics[-1]["flops_client"] > 0


# -- the budget ---------------------------------------------------------------------------
def test_target_epsilon_stops_before_the_round_that_would_pass_it(caplog):
    eps = [client_epsilon(((4, 2),), 3.0, 1, r, 0.25) for r in range(1, 5)]
    target = (eps[1] + eps[2]) / 2  # rounds 1 and 2 fit, round 3 would pass it
    with caplog.at_level(logging.WARNING, logger="edgepfl"):
        sim = run("algorithm.name=fedavg", "train.participation=0.5", "train.rounds=4",
                  "privacy.level=client", "privacy.noise_multiplier=3",
                  f"privacy.target_epsilon={target}")
    summary = sim.summary()
    assert sim.round == 2 and summary["stopped_round"] == 2
    assert "round 3 would spend epsilon" in summary["stop_reason"]
    assert summary["epsilon"] == eps[1] <= target
    assert any("stops after round 2" in r.message for r in caplog.records)
    assert not math.isnan(sim.metrics[-1]["acc_mean"])  # the last round is evaluated


def test_a_budget_that_round_one_passes_is_refused():
    with pytest.raises(ConfigError, match="round 1 alone spends epsilon"):
        run("algorithm.name=fedavg", "privacy.level=client", "privacy.target_epsilon=0.01")


def test_sample_level_budget_stops_on_the_worst_clients_forecast():
    # every client every round: 4 steps at rate 1/4 a round, delta 1/100
    eps = [sample_epsilon(((0.25, 4 * r),), 1.0, 0.01) for r in range(1, 6)]
    sim = run("algorithm.name=fedavg", "train.rounds=5", "privacy.level=sample",
              "privacy.noise_multiplier=1.0", f"privacy.target_epsilon={(eps[1] + eps[2]) / 2}")
    assert sim.summary()["stopped_round"] == sim.round == 2
    assert sim.summary()["epsilon"] == eps[1]


# -- refusals -----------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, match", [
    (["algorithm.name=kapc", "privacy.level=client"], "relation cube"),
    (["algorithm.name=dcpfl", "privacy.level=sample"], "un-noised"),
    (["algorithm.name=fedbn", "privacy.level=sample"], "BatchNorm"),
    (["algorithm.name=fedavg", "model.name=cnn_small_bn", "privacy.level=sample"], "BatchNorm"),
    (["algorithm.name=fedavg", "privacy.level=sample", "train.batch_clients=true"],
     "batch_clients"),
    (["algorithm.name=fedavg", "privacy.level=client", "privacy.accountant=pld"],
     "only rdp"),
    (["algorithm.name=fedbabu", "privacy.level=client"],
     "test-time fine-tuning trains on each client's data outside the accounting"),
    (["algorithm.name=hierfavg", "topology.edges=2", "privacy.level=client",
      "privacy.noise_at=cloud"], "noise_at = 'cloud' is refused"),
    (["algorithm.name=hierfavg", "topology.edges=2", "topology.mode=async",
      "privacy.level=client"], "topology.mode"),
    (["algorithm.name=hierfavg", "topology.edges=2", "topology.mode=async",
      "privacy.level=sample", "privacy.target_epsilon=50"], "topology.mode"),
])
def test_what_cannot_be_accounted_is_refused_at_set_up(overrides, match):
    with pytest.raises(ConfigError, match=match):
        Simulation(build_config({}, BASE + overrides), progress=False)


def test_every_algorithm_states_what_it_supports_or_why_not():
    for algo in ALGORITHMS.values():
        declared = algo.privacy
        if declared.client is None or not declared.sample:
            assert declared.refused, algo.name


# -- DP-SGD -------------------------------------------------------------------------------
def _data(n=40) -> ClientData:
    gen = torch.Generator().manual_seed(0)
    return ClientData(torch.randn(n, 1, 8, 8, generator=gen),
                      torch.randint(0, 3, (n,), generator=gen), torch.arange(n))


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def test_dpsgd_without_noise_clipping_or_sampling_is_full_batch_sgd():
    """Rate 1 (a batch as large as the data), noise 0 and a clip no gradient reaches: the
    sum of per-sample gradients over n is the full-batch gradient, so the plain fit."""
    data = _data()
    plain, private = Trainer(_net()), PrivateTrainer(_net(), clip=1e9, noise_multiplier=0.0)
    plain.fit(data, 3, 64, 0.1, torch.Generator().manual_seed(1))
    private.fit(data, 3, 64, 0.1, torch.Generator().manual_seed(1))
    assert private.steps == 3 and private.rates == {1.0}
    for name, value in plain.export().items():
        torch.testing.assert_close(private.export()[name], value, rtol=1e-5, atol=1e-6)


def test_dpsgd_clips_each_samples_gradient():
    trainer = PrivateTrainer(_net(), clip=1e-3, noise_multiplier=0.0)
    data = _data(8)
    x, y = data.select(torch.arange(8))
    summed, _ = trainer._step(trainer.param_names)(x, y)
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in summed))
    assert norm <= 8 * 1e-3
    single, _ = trainer._step(trainer.param_names)(x[:1], y[:1])
    assert math.sqrt(sum(float(g.pow(2).sum()) for g in single)) == pytest.approx(1e-3, rel=1e-3)


def test_an_update_that_trains_outside_dpsgd_is_refused():
    from edgepfl.contract.algorithm import UpdateResult

    class Part:
        trainer = PrivateTrainer(_net(), clip=1.0, noise_multiplier=1.0)

    with pytest.raises(PrivacyError, match="without the engine's DP-SGD trainer"):
        accounted(Part(), lambda: UpdateResult(Message(), {}, {"steps": 4.0}))


def test_dpsgd_refuses_steps_it_cannot_account():
    """Several steps on one sampled batch (pFedMe's inner steps) and a step of an
    algorithm's own (Per-FedAvg's MAML step) are refused, not run outside DP-SGD."""
    from edgepfl.algorithms.perfedavg import MetaStep, meta_batches
    from edgepfl.training.sgd import FitRequest

    trainer = PrivateTrainer(_net(), clip=1.0, noise_multiplier=1.0)
    g = torch.Generator().manual_seed(0)
    data = ClientData(torch.randn(8, 1, 4, 4, generator=g), torch.randint(0, 2, (8,),
                      generator=g), torch.arange(8))
    weights = trainer.export()
    with pytest.raises(PrivacyError, match="several steps on each batch"):
        trainer.run(FitRequest(weights, data, 1, 4, 0.1, g, repeat=3))
    with pytest.raises(PrivacyError, match="local step is its own"):
        trainer.run(FitRequest(weights, data, 1, 4, 0.1, g, step=MetaStep(0.01, False, 1e-3),
                               draw=meta_batches(2)))


# -- Flower -------------------------------------------------------------------------------
@pytest.mark.parametrize("level", ["client", "sample"])
def test_flower_accounts_as_the_simulation(level):
    """Client level runs in the ServerApp, sample level on each ClientApp, whose replies
    carry the DP-SGD steps it ran: the same figures as the simulation's."""
    pytest.importorskip("flwr")
    from edgepfl.engine.flower_local import run_local

    over = [*BASE, "algorithm.name=fedavg", f"privacy.level={level}",
            "privacy.noise_multiplier=1.5"]
    ours = run_local({k: parse_value(v) for k, v in (s.split("=", 1) for s in over)})
    sim = run("algorithm.name=fedavg", f"privacy.level={level}", "privacy.noise_multiplier=1.5")
    for a, b in zip(ours.metrics, sim.metrics, strict=True):
        assert a["epsilon"] == b["epsilon"]
        assert a["acc_mean"] == b["acc_mean"]
        # the un-noised training loss stays on the devices; the simulation measures it
        assert math.isnan(a["train_loss"]) and math.isfinite(b["train_loss"])
    assert ours.summary["epsilon"] == sim.summary()["epsilon"]
