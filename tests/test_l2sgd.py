"""Defining properties of L2SGD (edgepfl.algorithms.l2sgd)."""

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.l2sgd import LOCAL_STEPS, L2SGDHyperparameters, floating
from edgepfl.contract.algorithm import model_from_state, model_to_state
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message
from tests.conftest import fast_config, resumed_and_straight, without_wall

SMALL = ["dataset.fraction=0.4"]


def _sim(*more: str) -> Simulation:
    return Simulation(fast_config("algorithm.name=l2sgd", *SMALL, *more), progress=False)


def _models(sim: Simulation) -> list[dict]:
    return [{k: v.clone() for k, v in model_from_state(sim.clients.row(c)).items()}
            for c in range(sim.num_clients)]


def _random_like(model: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
            for k, v in model.items()}


def test_registered_with_documented_defaults():
    assert "l2sgd" in ALGORITHMS
    hp = get_algorithm("l2sgd").hyperparameters()
    assert (hp.p, hp.lamda) == (0.2, None)


@pytest.mark.parametrize("participation", [1.0, 0.5])
def test_lamda_zero_is_local_training_exactly(participation):
    """With lamda = 0 the averaging step is the identity: given the same number of SGD steps
    per round (the coins fixed at train.local_epochs steps, each a whole epoch since a
    batch holds a client's data) every client's model is `local`'s to the last bit."""
    common = ["train.batch_size=1000", "train.local_epochs=2", "train.rounds=3",
              f"train.participation={participation}", *SMALL]
    local = Simulation(fast_config("algorithm.name=local", *common), progress=False)
    local.run()

    def l2sgd(lamda: str) -> Simulation:
        sim = Simulation(fast_config("algorithm.name=l2sgd", f"algorithm.lamda={lamda}", *common),
                         progress=False)
        sim.server.local_steps = lambda rnd: 2
        sim.run()
        return sim

    zero = l2sgd("0")
    for a, b in zip(_models(zero), _models(local), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert [r["acc_mean"] for r in zero.metrics] == [r["acc_mean"] for r in local.metrics]
    # it still communicated: the averaging steps happen, they just do not move anyone
    assert zero.metrics[-1]["bytes_up"] > 0
    # and a positive lamda does move the models
    pulled = l2sgd("1")
    assert any(not torch.equal(a["fc1.weight"], b["fc1.weight"])
               for a, b in zip(_models(pulled), _models(local), strict=True))


@pytest.mark.parametrize(("lamda", "weight"), [(1.0, 0.05 * 1.0 * 0.8 / 0.2), (None, 0.5)])
def test_averaging_step_by_hand(lamda, weight):
    """x_i <- x_i - (alpha lamda / (n p)) (x_i - x_bar), alpha / (n (1 - p)) = train.lr."""
    lamda_set = [] if lamda is None else [f"algorithm.lamda={lamda}"]
    sim = _sim(*lamda_set, "algorithm.p=0.2", "train.lr=0.05")
    x = _random_like(sim.trainer.export(), 1)
    bar = floating(_random_like(x, 2))
    result = sim.client.update(0, Message(bar, {LOCAL_STEPS: 0}), model_to_state(x),
                               sim.train_data[0], torch.Generator())
    want = {k: x[k] - weight * (x[k] - bar[k]) for k in bar}
    assert set(result.reply.tensors) == set(want)
    for k in want:
        torch.testing.assert_close(result.reply.tensors[k], want[k])
        torch.testing.assert_close(model_from_state(result.state)[k], want[k])
    assert result.reply.meta == {}  # nothing but the model goes up


def test_local_steps_are_sgd_steps_at_train_lr():
    sim = _sim("algorithm.lamda=0", "train.lr=0.05")
    x = sim.trainer.export()
    data = sim.train_data[0]
    result = sim.client.update(0, Message({}, {LOCAL_STEPS: 3}), model_to_state(x), data,
                               torch.Generator().manual_seed(5))
    assert result.stats["steps"] == 3.0
    # by hand: three plain SGD steps on consecutive batches of shuffled epochs
    gen = torch.Generator().manual_seed(5)
    batches = []
    while len(batches) < 3:
        batches += list(data.batches(32, gen))
    sim.trainer.load(x)
    model = sim.trainer.model
    params = [sim.trainer.params[n] for n in sim.trainer.param_names]
    for xb, yb in batches[:3]:
        loss = torch.nn.functional.cross_entropy(model(sim.trainer.layout(xb)), yb)
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):
                p.sub_(0.05 * g)
    for n, p in zip(sim.trainer.param_names, params, strict=True):
        torch.testing.assert_close(result.reply.tensors[n], p.detach())


def test_server_mean_is_the_plain_mean_of_the_replies_and_completes_next_round():
    sim = _sim()
    server = sim.server
    x = floating(sim.trainer.export())
    a, b = _random_like(x, 1), _random_like(x, 2)
    server.configure(1, [0, 1, 2])
    # the paper's x_bar weighs devices equally, whatever their sample counts
    server.aggregate(1, {2: Message(a), 5: Message(b)})
    for k in x:
        torch.testing.assert_close(server.mean_model[k], (a[k] + b[k]) / 2)
    down = server.configure(2, [1, 4])
    assert set(down) == {1, 4}
    assert all(torch.equal(m.tensors[k], server.mean_model[k]) for m in down.values() for k in x)
    assert server.round_metrics()["l2sgd_averaged"] == 1.0
    # a round nobody replied in leaves the state as it was, and the next round has no
    # averaging step to complete
    before = server.mean_model
    server.aggregate(2, {})
    assert server.mean_model is before and server.mean_round == 1
    down = server.configure(3, [0])
    assert down[0].tensors == {} and LOCAL_STEPS in down[0].meta
    assert server.round_metrics()["l2sgd_averaged"] == 0.0


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_share_of_averaging_steps_is_p(p):
    sim = _sim(f"algorithm.p={p}")
    steps = [sim.server.local_steps(rnd) for rnd in range(1, 3001)]
    # each round is a run of local coins closed by one averaging coin
    share = len(steps) / (len(steps) + sum(steps))
    assert abs(share - p) < 0.02, share
    # the first coin of a round is an averaging one with probability p
    assert abs(sum(s == 0 for s in steps) / len(steps) - p) < 0.03
    assert sim.server.local_steps(7) == sim.server.local_steps(7)  # seeded per round


def test_bytes_are_counted_only_for_averaging_steps():
    sim = _sim("algorithm.p=0.3", "train.rounds=5", "system.cache_flops=false")
    result = sim.run()
    rows = result.metrics
    steps = [int(r["l2sgd_local_steps"]) for r in rows]
    assert len(set(steps)) > 1, steps  # the test needs rounds of different local work
    model = sum(v.numel() * v.element_size() for v in floating(sim.trainer.export()).values())
    n = sim.num_clients
    for r, s in zip(rows, steps, strict=True):
        meta = Message({}, {LOCAL_STEPS: s}).meta_bytes
        # round 1 has no averaging step to complete: the coins only
        down = meta if r["round"] == 1 else model + meta
        assert r["bytes_down"] == n * down
        assert r["bytes_up"] == n * model
        assert r["l2sgd_averaged"] == float(r["round"] > 1)
    # the local steps are work, not traffic
    flops = {s: r["flops_client"] for s, r in zip(steps, rows, strict=True)}
    assert flops[max(steps)] > flops[min(steps)]
    assert result.summary["l2sgd_averaging_share"] == len(steps) / (len(steps) + sum(steps))


def test_absent_clients_neither_average_nor_step():
    sim = _sim("train.participation=0.5", "train.rounds=3")
    sim.server.local_steps = lambda rnd: 2  # a round without local steps moves nobody
    for rnd in (1, 2, 3):
        selected = set(sim.federation.select(sim.cfg.seed, rnd, 0.5))
        before = _models(sim)
        sim.step()
        after = _models(sim)
        moved = {c for c in range(sim.num_clients)
                 if any(not torch.equal(before[c][k], after[c][k]) for k in after[c])}
        assert moved == selected and len(selected) == 3


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match=r"valid: lamda <= p / \(lr \(1-p\)\) = 5"):
        _sim("algorithm.lamda=10", "train.lr=0.05", "algorithm.p=0.2")
    for bad in ("algorithm.p=0", "algorithm.p=1", "algorithm.lamda=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            _sim(bad)
    with pytest.raises(ConfigError, match=r"train.momentum = 0.5 must be 0"):
        _sim("train.momentum=0.5")
    assert L2SGDHyperparameters(lamda=5.0, p=0.2)  # the largest valid at lr 0.05 is allowed
    _sim("algorithm.lamda=5", "train.lr=0.05", "algorithm.p=0.2")


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=l2sgd", *SMALL,
                                             "train.participation=0.5")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
