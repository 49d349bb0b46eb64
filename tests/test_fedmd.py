"""FedMD's defining properties (edgepfl.algorithms.fedmd): the consensus is the uniform
mean of the replied logits; only logits and public indices travel; clients of different
architectures take part together; without public training and digest it is local
training; missing replies leave the consensus as it was."""

import math

import pytest
import torch

from edgepfl.algorithms import get_algorithm
from edgepfl.algorithms.fedmd import TRANSFERRED, FedMDHyperparameters, round_subset
from edgepfl.engine.simulation import Simulation, resolve
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message
from tests.conftest import fast_config, resumed_and_straight, without_wall

P, POOL, CLASSES = 48, 300, 10  # public samples per round, public pool (of digits' 1347)
SMALL = ["algorithm.name=fedmd", f"algorithm.public_size={P}", f"algorithm.public_pool={POOL}"]
TIERS = ["system.devices=tiers", "model.tiers.weak=cnn_small_narrow", "partition.clients=10"]
TRAINING = ["acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss"]
DOWN = {"indices", "consensus", "consensus_indices"}


def _sim(*overrides: str) -> Simulation:
    return Simulation(fast_config(*SMALL, *overrides), progress=False)


def _record(sim: Simulation) -> tuple[list, list]:
    """Every message the server sends (per round) and every reply (per client update), of
    every architecture's client part."""
    down, up = [], []
    configure = sim.server.configure

    def configure_(rnd, selected):
        out = configure(rnd, selected)
        down.append({c: Message({k: v.clone() for k, v in m.tensors.items()}, dict(m.meta))
                     for c, m in out.items()})
        return out

    sim.server.configure = configure_
    for client in sim.transport.parts.values():
        def update_(cid, msg, state, data, gen, _update=client.update):
            result = _update(cid, msg, state, data, gen)
            up.append((cid, Message({k: v.clone() for k, v in result.reply.tensors.items()},
                                    dict(result.reply.meta)), dict(result.stats)))
            return result

        client.update = update_
    return down, up


def _spy_aggregate(sim: Simulation) -> list[dict]:
    seen: list[dict] = []
    aggregate = sim.server.aggregate

    def spy(rnd, replies):
        seen.append({c: m.tensors["logits"].clone() for c, m in replies.items()})
        aggregate(rnd, replies)

    sim.server.aggregate = spy
    return seen


# -- aggregate ----------------------------------------------------------------------------

def test_consensus_is_the_uniform_mean_of_the_replied_logits():
    """The paper's f~ = 1/m sum_k f_k (its code divides by the number of parties), over the
    clients that replied; not weighted by their sample counts."""
    sim = _sim("train.participation=0.5")
    seen = _spy_aggregate(sim)
    for _ in range(2):
        sim.step()
        replies = seen[-1]
        assert len(replies) == 3  # half of 6 clients
        by_hand = sum(v.double() for v in replies.values()) / len(replies)
        torch.testing.assert_close(sim.server.consensus, by_hand.float(), rtol=0, atol=1e-6)
        assert sim.server.consensus_round == sim.round
        # the clients hold different amounts of data, so a sample-weighted mean differs
        n = {c: sim.train_data[c].n for c in replies}
        weighted = sum(v.double() * n[c] for c, v in replies.items()) / sum(n.values())
        assert (weighted.float() - sim.server.consensus).abs().max() > 1e-3


def test_aggregate_of_a_subset_and_of_no_reply():
    server = _sim().server
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(P, CLASSES, generator=g), torch.randn(P, CLASSES, generator=g)
    server.aggregate(1, {1: Message({"logits": a}), 4: Message({"logits": b})})
    torch.testing.assert_close(server.consensus, (a + b) / 2, rtol=0, atol=1e-7)
    assert server.round_metrics()["md_parties"] == 2
    before = server.consensus.clone()
    # nobody answered round 2: the consensus of round 1 stands, with round 1's subset
    server.aggregate(2, {})
    assert torch.equal(server.consensus, before) and server.consensus_round == 1
    assert server.round_metrics()["md_parties"] == 0
    assert math.isnan(server.round_metrics()["md_agreement"])
    msg = server.configure(3, [0])[0]
    assert torch.equal(msg.tensors["consensus"], before)
    assert torch.equal(msg.tensors["consensus_indices"], round_subset(0, 1, POOL, P))
    assert torch.equal(msg.tensors["indices"], round_subset(0, 3, POOL, P))


def test_a_malformed_upload_is_refused():
    from edgepfl.federation.messages import MessageError

    server = _sim().server
    with pytest.raises(MessageError, match="unknown tensor 'fc1.weight'"):
        server.check_reply(0, Message({"logits": torch.zeros(P, CLASSES),
                                       "fc1.weight": torch.zeros(3)}))
    with pytest.raises(MessageError, match="expected torch.float32"):
        server.check_reply(0, Message({"logits": torch.zeros(P + 1, CLASSES)}))


def test_an_engine_round_with_every_reply_missing_keeps_the_consensus():
    sim = _sim()
    sim.step()
    before, rnd = sim.server.consensus.clone(), sim.server.consensus_round
    aggregate = sim.server.aggregate
    sim.server.aggregate = lambda r, replies: aggregate(r, {})  # every upload lost
    row = sim.step()
    assert torch.equal(sim.server.consensus, before) and sim.server.consensus_round == rnd == 1
    assert row["md_parties"] == 0


# -- what crosses the link ---------------------------------------------------------------

def test_messages_carry_only_logits_and_public_indices_never_weights():
    sim = _sim("partition.clients=10", *TIERS[:2])
    down, up = _record(sim)
    rows = [sim.step() for _ in range(3)]
    weights = {n: t.shape for a in sim.parts.architectures.values()
               for n, t in a.init_model.items()}
    assert len(set(sim.federation.arch)) == 2

    def no_weights(msg: Message) -> None:
        assert not set(msg.tensors) & set(weights)
        for t in msg.tensors.values():
            assert t.shape not in set(weights.values())

    assert {sim.federation.arch[cid] for cid, _, _ in up} == set(sim.parts.architectures)
    for _, msg, _ in up:
        assert set(msg.tensors) == {"logits"} and not msg.meta
        assert msg.tensors["logits"].shape == (P, CLASSES)
        assert msg.tensors["logits"].dtype == torch.float32
        no_weights(msg)
    for rnd, msgs in enumerate(down, start=1):
        for msg in msgs.values():
            assert not msg.meta
            no_weights(msg)
            # round r: its subset, plus the consensus of round r - 1 and that round's subset
            assert set(msg.tensors) == ({"indices"} if rnd == 1 else DOWN)
            assert torch.equal(msg.tensors["indices"], round_subset(0, rnd, POOL, P))
            assert msg.tensors["indices"].dtype == torch.int32
            if rnd > 1:
                assert torch.equal(msg.tensors["consensus_indices"],
                                   round_subset(0, rnd - 1, POOL, P))
    # bytes: logits up; int32 indices, and from round 2 the float32 consensus, down
    n = 10
    for rnd, row in enumerate(rows, start=1):
        assert row["bytes_up"] == n * P * CLASSES * 4
        assert row["bytes_down"] == n * (P * 4 if rnd == 1 else 2 * P * 4 + P * CLASSES * 4)


# -- clients of different architectures --------------------------------------------------

def test_two_architectures_distil_from_one_consensus():
    sim = _sim(*TIERS)
    seen = _spy_aggregate(sim)
    result = sim.run()
    archs = sim.federation.arch
    assert result.summary["architectures"] == {"cnn_small": 7, "cnn_small_narrow": 3}
    # every party's logits go into one consensus, whatever its architecture
    assert sorted(seen[-1]) == list(range(10))
    assert all(row["md_parties"] == 10 for row in result.metrics)
    # each client keeps and trains its own architecture's model
    for cid in range(10):
        fc1 = sim.clients.row(cid)["model.fc1.weight"]
        assert fc1.shape == ((32, 512) if archs[cid] == "cnn_small_narrow" else (64, 512))
        assert TRANSFERRED in sim.clients.row(cid)
    narrow = next(c for c in range(10) if archs[c] == "cnn_small_narrow")
    init = sim.parts.architectures["cnn_small_narrow"].init_model["fc1.weight"]
    assert not torch.equal(sim.clients.row(narrow)["model.fc1.weight"], init)
    assert all(not math.isnan(a) for a in result.client_accuracy)


# -- the clean limit ---------------------------------------------------------------------

def _training(*overrides: str) -> tuple[list[dict], Simulation]:
    sim = Simulation(fast_config(*overrides), progress=False)
    rows = sim.run().metrics
    return [{k: r[k] for k in TRAINING} for r in rows], sim


def test_without_public_training_and_digest_fedmd_trains_exactly_as_local():
    """With public_epochs = 0 a party's transfer learning is private_epochs (default
    train.local_epochs) of SGD on its data, and with digest_epochs = 0 every later round is
    the revisit alone: the same SGD with the same generator, as Local does every round.
    Computing and uploading logits changes no weight."""
    local, local_sim = _training("algorithm.name=local")
    fedmd, fedmd_sim = _training(*SMALL, "algorithm.public_epochs=0", "algorithm.digest_epochs=0")
    assert fedmd == local
    for cid in range(6):
        a, b = local_sim.clients.row(cid), fedmd_sim.clients.row(cid)
        assert all(torch.equal(a[k], b[k]) for k in a)
    # the digest is what departs from Local: round 1 (no consensus yet) is the same
    digest, _ = _training(*SMALL, "algorithm.public_epochs=0")
    assert digest[0] == local[0] and digest[1:] != local[1:]


def test_digest_moves_a_partys_logits_towards_the_consensus():
    sim = _sim()
    sim.step()
    client, server = sim.client, sim.server
    x = client._public_x(round_subset(0, 1, POOL, P), "indices")
    target = server.consensus

    def distance() -> float:
        return float((client.scores(x) - target).abs().mean())

    client.trainer.load({k[len("model."):]: v for k, v in sim.clients.row(0).items()
                         if k.startswith("model.")})
    before = distance()
    loss = client.digest(x, target, torch.Generator().manual_seed(0))
    assert 0 < loss and distance() < before


def test_transfer_learning_comes_once_before_a_partys_first_upload():
    sim = _sim("train.participation=0.5", "train.rounds=4")
    _, up = _record(sim)
    first: dict[int, int] = {}
    for rnd in range(1, 5):
        n = len(up)
        sim.step()
        for cid, _, stats in up[n:]:
            if cid not in first:  # public, then private data; no consensus to digest yet
                first[cid] = rnd
                assert "public_loss" in stats and "digest_loss" not in stats
            else:  # digest the latest consensus, then revisit
                assert "public_loss" not in stats and "digest_loss" in stats
            assert stats["train_loss"] > 0
    assert any(r > 1 for r in first.values())  # a late party joined after round 1


# -- settings, defaults, resume ----------------------------------------------------------

def test_defaults_are_the_papers_and_resolved_explicitly():
    hp = FedMDHyperparameters()
    assert (hp.digest_epochs, hp.digest_batch_size, hp.digest_loss) == (1, 256, "l1")
    assert get_algorithm("fedmd").heterogeneous
    cfg = resolve(fast_config("algorithm.name=fedmd"))
    values = cfg.algorithm.hyperparameters()
    # synthetic (8x8) private data: scikit-learn's 8x8 digits are public, all 1347 of them
    assert (values["public_dataset"], values["public_pool"], values["public_size"]) == \
        ("digits", 1347, 1347)


def test_mnist_and_fashion_mnist_are_each_others_public_set(shared_data):
    for private, public in (("mnist", "fmnist"), ("fmnist", "mnist")):
        cfg = resolve(fast_config("algorithm.name=fedmd", f"dataset.name={private}"))
        values = cfg.algorithm.hyperparameters()
        assert (values["public_dataset"], values["public_pool"], values["public_size"]) == \
            (public, 60000, 5000)


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm.public_size=400", "algorithm.public_pool=300"], "public_size = 400.*pool of 300"),
    (["algorithm.public_pool=5000"], "public_pool = 5000 is more than the 1347"),
    (["algorithm.public_dataset=synthetic"], "dataset.name itself"),
    (["algorithm.public_dataset=mnist"], r"1x28x28 images but dataset.name = 'synthetic' has 1x8x8"),
    (["algorithm.public_dataset=imagenet"], "not a known data set"),
    (["algorithm.public_dataset=npz"], r"reads dataset.path.*valid public sets: mnist, fmnist"),
    (["dataset.name=cifar10"], "no default for dataset.name = 'cifar10'"),
    (["algorithm.digest_loss=kl"], "digest_loss"),
])
def test_bad_settings_are_refused_clearly(overrides, message):
    with pytest.raises(ConfigError, match=message):
        Simulation(fast_config("algorithm.name=fedmd", *overrides), progress=False)


def test_a_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, *SMALL, "train.participation=0.5")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    assert torch.equal(resumed.server.consensus, straight.server.consensus)
