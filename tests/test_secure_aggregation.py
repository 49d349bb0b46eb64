"""Secure aggregation (privacy.secure_aggregation): on Flower the server learns only each
aggregator's sum (Flower's SecAgg+), equal to the simulation's aggregate up to SecAgg+'s
quantization; under client-level DP the clients clip and noise; what the protocol cannot
carry is refused clearly."""

import json
import math
import re

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")

from flwr.common import bytes_to_ndarray  # noqa: E402

from edgepfl.config import build_config  # noqa: E402
from edgepfl.engine import flower_local, flower_secagg  # noqa: E402
from edgepfl.engine.flower_local import LocalGrid, run_local  # noqa: E402
from edgepfl.engine.simulation import Simulation  # noqa: E402
from edgepfl.engine.transport import NothingTrained  # noqa: E402
from edgepfl.errors import ConfigError  # noqa: E402
from edgepfl.federation.messages import Message  # noqa: E402
from edgepfl.io import read_tensors  # noqa: E402
from edgepfl.privacy.secure_sum import (  # noqa: E402
    SecureSumError,
    client_vector,
    summed_replies,
    threshold,
)

BASE = {"dataset.name": "synthetic", "partition.clients": 3, "train.rounds": 2,
        "train.batch_size": 32, "train.local_epochs": 1, "train.lr": 0.05,
        "output.plots": False, "system.count_flops": False, "algorithm.name": "fedavg"}
SECURE = {"privacy.secure_aggregation": True}


def simulation(rc, out=None):
    sets = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in rc.items()]
    return Simulation(build_config({}, sets), out, progress=False).run()


class Recording(LocalGrid):
    """A LocalGrid that keeps every reply the ServerApp receives."""

    received: list = []

    def pull_messages(self, message_ids):
        got = list(super().pull_messages(message_ids))
        Recording.received.extend(got)
        return got


def _numbers(reply):
    """Every array a reply carries: its ArrayRecords' and whatever its config records'
    bytes decode to."""
    out = [a.numpy() for rec in reply.content.array_records.values() for a in rec.values()]
    for rec in reply.content.config_records.values():
        for value in rec.values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, bytes):
                    try:
                        out.append(bytes_to_ndarray(item))
                    except Exception:  # keys and ciphertexts are not arrays
                        pass
    return out


@pytest.mark.parametrize("algorithm,extra", [
    ("fedavg", {}),
    ("hierfavg", {"partition.clients": 6, "topology.edges": 2}),  # one sum per edge
    ("fedbn", {}),  # the BatchNorm layers stay local; batch counters are not summed
    ("fedper", {}),  # the shared layers alone
])
def test_the_server_sees_no_update_and_the_sum_is_the_simulations(
        algorithm, extra, tmp_path, monkeypatch):
    Recording.received = []
    vectors = []  # what each client put into the sum, before masking
    real = flower_secagg.client_vector

    def spy(sent, reply, weight, *args):
        vector = real(sent, reply, weight, *args)
        vectors.append((weight, [v.double().numpy().ravel() for v in vector]))
        return vector

    monkeypatch.setattr(flower_secagg, "client_vector", spy)
    monkeypatch.setattr(flower_local, "LocalGrid", Recording)
    # one round: SecAgg+'s quantization is then seen alone; training amplifies it (after a
    # second round of this run, 1.4e-4 at most)
    rc = {**BASE, "algorithm.name": algorithm, "train.rounds": 1, **extra}
    flower = run_local({**rc, **SECURE, "out": str(tmp_path / "flower")})
    sim = simulation(rc, tmp_path / "sim")
    for ours, theirs in zip(flower.metrics, sim.metrics, strict=True):
        assert ours["acc_mean"] == theirs["acc_mean"]
        assert ours["bytes_up"] == theirs["bytes_up"]
    # the server's and edges' state (the simulation's checkpoint holds its clients' too)
    mine = read_tensors(tmp_path / "flower" / "checkpoint.safetensors")[0]
    exact = {k: v for k, v in read_tensors(tmp_path / "sim" / "checkpoint.safetensors")[0].items()
             if not k.startswith("client")}
    assert mine.keys() == exact.keys() and mine
    # SecAgg+ quantizes [-8, 8] to 2^22 levels: a few 1e-6 per entry (4.2e-6 measured)
    worst = max(float((mine[k].double() - exact[k].double()).abs().max()) for k in mine)
    assert worst < 2e-5, worst
    # what crossed to the server: no array of any client's update, in clear or quantized
    train = [r for r in Recording.received if r.metadata.message_type == "train"]
    assert len(vectors) >= rc["partition.clients"]
    assert train and all(not a for r in train for rec in r.content.array_records.values()
                         for a in rec.values())
    seen = [a.astype(np.float64).ravel() for r in train for a in _numbers(r)]
    for weight, vector in vectors:
        for part in vector:
            if part.size < 8:
                continue
            # SecAgg+'s unmasked integers for this part: (w u + 8) * 2^22 / 16
            quantized = (weight * part + 8.0) * 2**22 / 16
            for a in seen:
                if a.size == part.size:
                    assert not np.allclose(a, part, atol=1e-6)
                    assert np.mean(np.abs(a - quantized) < 4) < 0.01


def test_under_client_dp_the_clients_clip_and_noise_and_epsilon_is_the_simulations():
    rc = {**BASE, "partition.clients": 4, "train.rounds": 2, "privacy.level": "client",
          "privacy.noise_multiplier": 0.5, "privacy.clip": 0.5}
    flower = run_local({**rc, **SECURE})
    sim = simulation({**rc, **SECURE})
    for ours, theirs in zip(flower.metrics, sim.metrics, strict=True):
        assert ours["epsilon"] == theirs["epsilon"] > 0
        assert ours["bytes_up"] == theirs["bytes_up"]  # what the clients sent, not the sum
        assert math.isnan(ours["dp_clipped"])  # the server clips nothing: it sees no update
        assert 0 < ours["acc_mean"] < 1


def test_the_client_clips_to_the_bound_and_adds_noise_for_the_threshold():
    sent = Message({"w": torch.zeros(400), "n": torch.tensor(3)})
    reply = Message({"w": torch.full((400,), 0.5), "n": torch.tensor(5)}, {"num_samples": 9})
    plain = client_vector(sent, reply, 1.0, None, 0.0, 8.0)
    assert torch.equal(plain[0], torch.full((400,), 0.5))  # the integer entry stays out
    clipped = client_vector(sent, reply, 1.0, 1.0, 0.0, 8.0)
    assert math.isclose(float(clipped[0].norm()), 1.0, rel_tol=1e-6)
    gen = torch.Generator().manual_seed(0)
    noised = client_vector(sent, reply, 1.0, 1.0, 0.2, 8.0, gen)
    assert 0.17 < float((noised[0] - clipped[0]).std()) < 0.23
    # SecAgg+'s threshold, as Flower computes it with every client a neighbour
    assert [threshold(k, 0.5) for k in (2, 3, 5, 10)] == [2, 2, 2, 5]


@pytest.mark.parametrize("reply,why", [
    ({"w": torch.full((4,), math.nan)}, "NaN or Inf"),
    ({"w": torch.full((4,), 20.0)}, "privacy.secagg_range = 8"),
    ({"w": torch.zeros(4), "extra": torch.zeros(1)}, "it was not sent"),
    ({}, "lacks ['w']"),
])
def test_what_the_server_cannot_check_the_client_refuses(reply, why):
    sent = Message({"w": torch.zeros(4)})
    with pytest.raises(SecureSumError, match=re.escape(why)):
        client_vector(sent, Message(reply), 1.0, None, 0.0, 8.0)


def test_the_summed_replies_average_to_the_sum_and_keep_the_total_weight():
    sent = Message({"w": torch.ones(3), "n": torch.tensor(7)})
    replies = summed_replies(sent, [torch.tensor([0.5, -1.0, 0.0], dtype=torch.float64)],
                             {1: ["w", "n"], 4: ["w"]}, weights={1: 10, 4: 30})
    assert torch.equal(replies[1].tensors["w"], torch.tensor([1.5, 0.0, 1.0]))
    assert replies[1].tensors["n"] is sent.tensors["n"] and list(replies[4].tensors) == ["w"]
    assert [r.meta["num_samples"] for r in replies.values()] == [10, 30]
    dp = summed_replies(sent, [torch.tensor([0.5, -1.0, 0.0])], {1: ["w"]}, scale=0.5)
    assert torch.equal(dp[1].tensors["w"], torch.tensor([1.25, 0.5, 1.0]))
    assert dp[1].meta["num_samples"] == 1


def test_a_client_set_for_secure_aggregation_never_sends_its_update_in_clear():
    rc = {**BASE}
    grid = LocalGrid(flower_local.client_app, 3, {**rc, **SECURE})
    with flower_local._server_identity(), pytest.raises(NothingTrained) as err:
        flower_local.run_server(grid, {**rc, "wait": 0})
    assert "sends its update only into a SecAgg+ sum" in str(err.value)


@pytest.mark.parametrize("sets,why", [
    ({"algorithm.name": "kapc"}, "refused by algorithm.name = 'kapc'"),
    ({"algorithm.name": "feddyn"}, "FedDyn's h sums each participant's drift"),
    ({"partition.clients": 5, "system.devices": "tiers", "model.tiers.weak": "cnn_small_narrow"},
     "one architecture"),
])
def test_algorithms_that_need_more_than_the_mean_are_refused(sets, why):
    with pytest.raises(ConfigError, match=why):
        run_local({**BASE, **SECURE, **sets})


@pytest.mark.parametrize("sets,why", [
    (["privacy.secagg_range=2"], "privacy.secagg_range given without privacy.secure_agg"),
    (["privacy.secure_aggregation=true", "privacy.level=client", "privacy.clip=adaptive"],
     "not implemented"),
])
def test_settings_that_do_not_fit_are_refused(sets, why):
    with pytest.raises(ConfigError, match=why):
        build_config({}, sets)


class _SlowGrid:
    """Replies that are ready only after a number of asks, on a fake clock."""

    def __init__(self, ready_after):
        self.ready_after, self.asks = ready_after, 0

    def push_messages(self, messages):
        return [f"m{k}" for k, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.asks += 1
        if self.asks < self.ready_after:
            return []
        return [type("Reply", (), {"metadata": type("M", (), {"reply_to_message_id": i})()})()
                for i in ids]


@pytest.mark.parametrize("ready_after,timeout,got", [(3, 10.0, 2), (100, 1.0, 0), (5, None, 2)])
def test_replies_are_asked_for_every_quarter_second_until_the_timeout(
        ready_after, timeout, got, monkeypatch):
    from edgepfl.engine import flower_wire

    clock = [0.0]
    monkeypatch.setattr(flower_wire.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(flower_wire.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    grid = _SlowGrid(ready_after)
    replies = flower_wire.Polled(grid).send_and_receive(["a", "b"], timeout=timeout)
    assert len(replies) == got
    # Flower's own grid asks every 3 s; the last ask is at the reply or the timeout
    assert clock[0] == pytest.approx(flower_wire.REPLY_POLL_S * (grid.asks - 1))
    assert grid.asks == (ready_after if got else 1 + int(timeout / flower_wire.REPLY_POLL_S))


def test_without_noise_the_clients_clipped_sum_is_the_servers_dp_fedavg(tmp_path):
    """Client-level DP with noise 0: the clients' clipped updates, summed by SecAgg+ and
    divided by the clients sampled, are the simulation's DP-FedAvg aggregate."""
    rc = {**BASE, "partition.clients": 4, "train.rounds": 1, "train.participation": 0.75,
          "privacy.level": "client", "privacy.noise_multiplier": 0.0, "privacy.clip": 0.05}
    flower = run_local({**rc, **SECURE, "out": str(tmp_path / "flower")})
    sim = simulation({**rc, **SECURE}, tmp_path / "sim")
    assert flower.metrics[0]["acc_mean"] == sim.metrics[0]["acc_mean"]
    assert sim.metrics[0]["dp_clipped"] > 0  # the clip acts
    mine = read_tensors(tmp_path / "flower" / "checkpoint.safetensors")[0]
    exact = read_tensors(tmp_path / "sim" / "checkpoint.safetensors")[0]
    worst = max(float((mine[k].double() - exact[k].double()).abs().max()) for k in mine)
    assert worst < 2e-5, worst
