"""Defining properties of SCAFFOLD (edgepfl.algorithms.scaffold)."""

import pytest
import torch
import torch.nn.functional as F

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.scaffold import CONTROL, DELTA
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import EdgepflError
from tests.conftest import fast_config, resumed_and_straight, without_wall
from tests.test_baselines import _record

TRAINING = ["round", "acc_mean", "acc_weighted", "acc_min", "loss", "train_loss"]


def _sim(name: str = "scaffold", *overrides: str) -> Simulation:
    return Simulation(fast_config(f"algorithm.name={name}", *overrides), progress=False)


def _controls(sim: Simulation) -> dict[str, torch.Tensor]:
    return {n: sim.clients.stack(CONTROL + n) for n in sim.trainer.param_names}


def test_registered_with_the_papers_global_step():
    assert "scaffold" in ALGORITHMS
    hp = get_algorithm("scaffold").hyperparameters()
    assert hp.eta_g == 1.0 and hp.weighting == "samples"


def test_with_all_control_variates_zero_a_round_is_fedavgs_bit_for_bit():
    """Round 1 starts from c = c_i = 0: the correction adds exact zeros, and eta_g = 1
    takes the clients' mean as it is. Same round, same model, same figures."""
    for local in ("train.local_epochs=1", "train.batch_size=10000"):  # epochs; one step
        scaffold = _sim("scaffold", local, "train.rounds=1", "train.participation=0.5")
        fedavg = _sim("fedavg", local, "train.rounds=1", "train.participation=0.5")
        rows = [[{k: r[k] for k in TRAINING} for r in s.run().metrics]
                for s in (scaffold, fedavg)]
        assert rows[0] == rows[1]
        for k, v in fedavg.server.global_model.items():
            assert torch.equal(scaffold.server.global_model[k], v), k


def test_the_control_variates_move_and_c_is_the_mean_of_every_clients_c_i():
    sim = _sim("scaffold", "train.participation=0.5")
    down, up = _record(sim)
    sim.step()
    trained = {cid for cid, _ in up}
    controls = _controls(sim)
    for cid in range(sim.num_clients):
        moved = any(bool(c[cid].abs().sum() > 0) for c in controls.values())
        assert moved == (cid in trained), cid
    for n, c in sim.server.control.items():
        assert bool(c.abs().sum() > 0), n
        torch.testing.assert_close(c, controls[n].mean(0))
    # round 2 sends the new c, and clients correct with it: SCAFFOLD leaves FedAvg's path
    sim.step()
    assert all(DELTA + n in m.tensors for _, m in up for n in sim.server.control)
    sent = down[1][next(iter(down[1]))]
    assert any(bool(sent.tensors[CONTROL + n].abs().sum() > 0) for n in sim.server.control)
    fedavg = _sim("fedavg", "train.participation=0.5", "train.rounds=2")
    fedavg.run()
    assert any(not torch.equal(sim.server.global_model[k], v)
               for k, v in fedavg.server.global_model.items())


def test_with_one_full_batch_step_option_ii_gives_each_client_its_gradient_at_x():
    """K = 1 on the whole local data: (x - y_i) / eta_l is grad f_i(x) + c - c_i, which
    option II turns into c_i+ = grad f_i(x) (c = c_i = 0 in round 1)."""
    sim = _sim("scaffold", "train.batch_size=10000", "train.rounds=1")
    x = {k: v.clone() for k, v in sim.server.global_model.items()}
    sim.step()
    controls = _controls(sim)
    trainer = sim.trainer
    for cid in range(sim.num_clients):
        data = sim.train_data[cid]
        xb, yb = data.select(torch.arange(data.n))
        trainer.load(x)
        trainer.model.train()
        loss = F.cross_entropy(trainer.model(trainer.layout(xb)), yb)
        grads = torch.autograd.grad(loss, [trainer.params[n] for n in trainer.param_names])
        for n, g in zip(trainer.param_names, grads, strict=True):
            torch.testing.assert_close(controls[n][cid], g, atol=2e-4, rtol=1e-3)


def test_a_global_step_below_one_moves_part_of_the_way():
    half = _sim("scaffold", "algorithm.eta_g=0.5", "train.rounds=1")
    x0 = {k: v.clone() for k, v in half.server.global_model.items()}
    half.run()
    full = _sim("scaffold", "train.rounds=1")
    full.run()
    for k, v in full.server.global_model.items():
        torch.testing.assert_close(half.server.global_model[k], x0[k] + 0.5 * (v - x0[k]))


def test_uniform_weighting_is_the_plain_mean_of_the_replies():
    sim = _sim("scaffold", "algorithm.weighting=uniform", "train.rounds=1")
    _, up = _record(sim)
    sim.run()
    for k, v in sim.server.global_model.items():
        want = torch.stack([m.tensors[k] for _, m in up]).mean(0)
        torch.testing.assert_close(v, want)


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, "algorithm.name=scaffold",
                                             "train.participation=0.5")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    for n, c in straight.server.control.items():
        assert torch.equal(resumed.server.control[n], c), n


def test_batched_clients_give_the_sequential_run(monkeypatch):
    from edgepfl.training.trainer import Trainer
    from tests.test_batch_clients import assert_same_run

    batched, fit_many = [], Trainer.fit_many

    def spy(self, reqs):
        batched.append(len(reqs) if self.batchable(reqs) else 0)
        return fit_many(self, reqs)

    monkeypatch.setattr(Trainer, "fit_many", spy)
    # a decaying rate: option II divides by the rate the fit took, also where the engine
    # finishes a batched fit after the round's rate was lent
    runs = [_sim("scaffold", f"train.batch_clients={b}", "train.momentum=0.5",
                 "train.lr_decay=linear", "train.lr_final=0.01") for b in ("false", "true")]
    for sim in runs:
        sim.run()
    assert batched and all(n == 6 for n in batched)  # rounds 2-3: all six at once
    # option II divides a model difference by K eta_l: the batched kernels' float
    # differences in y_i (1e-5 at most here, the layout effect test_batch_clients
    # describes) reach the control variates 1.2e-4 apart (measured), the metrics not at all
    assert_same_run(*runs, atol=3e-4)


def test_sample_level_privacy_runs_and_client_level_is_refused():
    sim = _sim("scaffold", "privacy.level=sample", "privacy.noise_multiplier=1",
               "train.rounds=1")
    sim.run()
    assert any(bool(c.abs().sum() > 0) for c in sim.server.control.values())
    with pytest.raises(EdgepflError, match="control variate"):
        _sim("scaffold", "privacy.level=client", "privacy.noise_multiplier=1")


def test_flower_run_equals_the_simulation():
    """What a client keeps lives in each node's Context.state on Flower."""
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    import json

    from edgepfl.engine.flower_local import run_local
    from tests.test_flower import run_config

    rc = {**run_config(algorithm__name="scaffold"), "train.participation": 0.67}
    sim = Simulation(fast_config(*[f"{k}={json.dumps(v) if isinstance(v, bool) else v}"
                                  for k, v in rc.items()]), progress=False).run()
    result = run_local(rc)
    assert len(result.metrics) == len(sim.metrics) == 2
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_min", "loss", "train_loss", "bytes_up", "bytes_down"):
            assert ours[key] == theirs[key], (ours["round"], key)
