"""Defining properties of FedDyn (edgepfl.algorithms.feddyn)."""

import pytest
import torch
import torch.nn.functional as F

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.feddyn import GRAD
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

PART = "train.participation=0.5"
ALPHA = "algorithm.alpha=0.1"
FULL_BATCH = "train.batch_size=10000"
FIGURES = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss",
           "bytes_up", "bytes_down"]


def _sim(name: str = "feddyn", *overrides: str) -> Simulation:
    return Simulation(fast_config(f"algorithm.name={name}", *overrides), progress=False)


def _grads(sim: Simulation) -> dict[str, torch.Tensor]:
    """Every client's grad_i, stacked: name -> [clients, ...]."""
    return {n: sim.clients.stack(GRAD + n) for n in sim.trainer.param_names}


def _full_gradient(sim: Simulation, cid: int, weights: dict) -> dict[str, torch.Tensor]:
    """grad L_i at ``weights`` over client ``cid``'s whole training data."""
    data, trainer = sim.train_data[cid], sim.trainer
    xb, yb = data.select(torch.arange(data.n))
    trainer.load(weights)
    trainer.model.train()
    loss = F.cross_entropy(trainer.model(trainer.layout(xb)), yb)
    names = trainer.param_names
    grads = torch.autograd.grad(loss, [trainer.params[n] for n in names])
    trainer.forget()
    return dict(zip(names, grads, strict=True))


def test_registered_with_a_small_alpha_and_fedavgs_weighting():
    assert "feddyn" in ALGORITHMS
    hp = get_algorithm("feddyn").hyperparameters()
    assert hp.alpha == 0.01 and hp.weighting == "samples"


@pytest.mark.parametrize("momentum", ["train.momentum=0", "train.momentum=0.5"])
def test_alpha_zero_is_fedavg_bit_for_bit(momentum):
    """No regulariser, no correction, and the new model is the mean itself."""
    feddyn = _sim("feddyn", "algorithm.alpha=0", PART, momentum)
    fedavg = _sim("fedavg", PART, momentum)
    rows = [[{k: r[k] for k in FIGURES} for r in s.run().metrics] for s in (feddyn, fedavg)]
    assert rows[0] == rows[1]
    for k, v in fedavg.server.global_model.items():
        assert torch.equal(feddyn.server.global_model[k], v), k
    assert all(not bool(h.abs().sum()) for h in feddyn.server.h.values())
    assert all(not bool(g.abs().sum()) for g in _grads(feddyn).values())


def test_after_a_round_grad_i_h_and_the_server_model_follow_algorithm_1():
    sim = _sim("feddyn", ALPHA, PART)
    down, up = _record(sim)
    before = {k: v.clone() for k, v in sim.server.global_model.items()}
    sim.step()
    alpha, m = 0.1, sim.num_clients
    trained = {cid: msg for cid, msg in up}
    assert len(trained) == 3
    grads = _grads(sim)
    for cid in range(m):
        moved = any(bool(g[cid].abs().sum() > 0) for g in grads.values())
        assert moved == (cid in trained), cid
        for n, g in grads.items():
            if cid in trained:  # grad_i <- 0 - alpha (theta_i - theta_server)
                torch.testing.assert_close(g[cid], -alpha * (trained[cid].tensors[n] - before[n]))
    weights = torch.tensor([float(m_.meta["num_samples"]) for m_ in trained.values()],
                           dtype=torch.float64)
    for n, h in sim.server.h.items():
        drift = sum(msg.tensors[n] - before[n] for msg in trained.values())
        torch.testing.assert_close(h, -alpha / m * drift)
        torch.testing.assert_close(h, grads[n].mean(0))  # h is the mean of all m grad_i
        mean = sum(w * msg.tensors[n].double() for w, msg in zip(weights, trained.values(),
                                                                 strict=True)) / weights.sum()
        torch.testing.assert_close(sim.server.global_model[n], (mean - h.double() / alpha).float())
    # round 2 sends that corrected model, not FedAvg's mean
    corrected = {k: v.clone() for k, v in sim.server.global_model.items()}
    sim.step()
    sent = next(iter(down[1].values())).tensors
    assert all(torch.equal(sent[k], v) for k, v in corrected.items())
    fedavg = _sim("fedavg", PART, "train.rounds=1")
    fedavg.run()
    assert any(not torch.equal(sent[k], v) for k, v in fedavg.server.global_model.items())


def test_the_local_steps_take_the_regulariser_and_the_correction():
    """Full-batch steps. Round 1 (grad_i = 0), two steps from theta_s:
    theta_1 = theta_s - lr g(theta_s), theta_2 = theta_1 - lr (g(theta_1) + alpha (theta_1 -
    theta_s)). Round 2, one step from the new theta_s: theta_s - lr (g(theta_s) - grad_i)."""
    lr, alpha = 0.05, 0.1
    sim = _sim("feddyn", ALPHA, FULL_BATCH, "train.local_epochs=2")
    _, up = _record(sim)
    start = {k: v.clone() for k, v in sim.server.global_model.items()}
    sim.step()
    for cid, msg in up:
        g0 = _full_gradient(sim, cid, start)
        one = {**start, **{n: start[n] - lr * g for n, g in g0.items()}}
        g1 = _full_gradient(sim, cid, one)
        for n, g in g1.items():
            want = one[n] - lr * (g + alpha * (one[n] - start[n]))
            torch.testing.assert_close(msg.tensors[n], want, atol=2e-5, rtol=1e-4)
    once = _sim("feddyn", ALPHA, FULL_BATCH)
    once.step()
    server = {k: v.clone() for k, v in once.server.global_model.items()}
    grads = {n: g.clone() for n, g in _grads(once).items()}
    _, up = _record(once)
    once.step()
    for cid, msg in up:
        g = _full_gradient(once, cid, server)
        for n in g:
            want = server[n] - lr * (g[n] - grads[n][cid])
            torch.testing.assert_close(msg.tensors[n], want, atol=2e-5, rtol=1e-4)


def test_uniform_weighting_is_the_plain_mean_less_h_over_alpha():
    sim = _sim("feddyn", ALPHA, "algorithm.weighting=uniform", "train.rounds=1")
    _, up = _record(sim)
    sim.run()
    for k, v in sim.server.global_model.items():
        want = torch.stack([m.tensors[k] for _, m in up]).mean(0)
        if k in sim.server.h:
            want = want - sim.server.h[k] / 0.1
        torch.testing.assert_close(v, want)


def test_a_rate_times_alpha_of_two_is_refused():
    with pytest.raises(ConfigError, match=r"algorithm.alpha = 40.0 with train.lr = 0.05"):
        _sim("feddyn", "algorithm.alpha=40.0")


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=feddyn", ALPHA, PART)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    for n, h in straight.server.h.items():
        assert torch.equal(resumed.server.h[n], h), n


def test_batched_clients_give_the_sequential_run(monkeypatch):
    from edgepfl.training.trainer import Trainer
    from tests.test_batch_clients import assert_same_run

    batched, fit_many = [], Trainer.fit_many

    def spy(self, reqs):
        batched.append(len(reqs) if self.batchable(reqs) else 0)
        return fit_many(self, reqs)

    monkeypatch.setattr(Trainer, "fit_many", spy)
    runs = [_sim("feddyn", ALPHA, f"train.batch_clients={b}", "train.momentum=0.5")
            for b in ("false", "true")]
    for sim in runs:
        sim.run()
    assert batched and all(n == 6 for n in batched)  # rounds 2-3: all six at once
    assert_same_run(*runs, atol=1e-5)


def test_both_privacy_levels_run():
    for level in ("client", "sample"):
        sim = _sim("feddyn", ALPHA, f"privacy.level={level}", "privacy.noise_multiplier=0.5",
                   "train.rounds=1")
        sim.run()
        assert any(bool(h.abs().sum() > 0) for h in sim.server.h.values()), level
