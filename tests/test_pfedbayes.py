"""pFedBayes: the closed-form pieces, one client step against autograd and against SGD with
a quadratic pull (its sigma -> 0 limit), zeta = 0 is local training, the server's mixing,
a run's figures, exact resume, what crosses the link, and the same run on Flower."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.distributions import Normal, kl_divergence
from torch.func import functional_call

from edgepfl.algorithms.hierbayes import proximal_pull
from edgepfl.algorithms.pfedbayes import (
    MU,
    RHO,
    SGD,
    Adam,
    _split,
    kl,
    kl_grads,
    softplus,
)
from edgepfl.contract.algorithm import model_from_state
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.federation.rng import generator
from tests.conftest import fast_config, resumed_and_straight, without_wall

PFB = ["algorithm.name=pfedbayes"]
D = torch.float64


# -- the closed-form pieces on tiny tensors -------------------------------------------------
def test_kl_and_its_gradients_are_the_gaussian_kl():
    torch.manual_seed(0)
    mu_q, mu_p = torch.randn(4, dtype=D), torch.randn(4, dtype=D)
    rho_q = torch.tensor([-5.0, -2.0, 0.3, 1.0], dtype=D)
    rho_p = torch.tensor([-3.0, -2.0, -1.0, 2.0], dtype=D)
    leaves = [t.clone().requires_grad_(True) for t in (mu_q, rho_q, mu_p, rho_p)]
    ref = kl_divergence(Normal(leaves[0], F.softplus(leaves[1])),
                        Normal(leaves[2], F.softplus(leaves[3])))
    assert torch.allclose(kl(mu_q, rho_q, mu_p, rho_p), ref.detach())
    ref.sum().backward()
    for ours, leaf in zip(kl_grads(mu_q, rho_q, mu_p, rho_p), leaves, strict=True):
        assert torch.allclose(ours, leaf.grad)


def test_without_spread_the_kl_is_a_quadratic_pull():
    """sigma_q = sigma_p -> 0: KL = d^2 / (2 sigma^2), the mean gradient the pull
    d / sigma^2 and no force on either spread from the means alone (float32, rho = -30)."""
    mu_q = torch.tensor([0.1, -0.2, 0.3])
    mu_p = torch.tensor([0.1, -0.1, 0.25])
    rho = torch.full((3,), -30.0)
    s2 = softplus(rho) ** 2
    g_mu_q, g_rho_q, g_mu_p, g_rho_p = kl_grads(mu_q, rho, mu_p, rho)
    assert torch.allclose(g_mu_q * s2, mu_q - mu_p, rtol=1e-5)
    assert torch.equal(g_mu_p, -g_mu_q)
    assert torch.all(g_rho_q == 0)
    # the prior's spread is pushed out by the squared gap: d rho_p = -(d / sigma)^2
    assert torch.allclose(g_rho_p * s2, -((mu_q - mu_p) ** 2), rtol=1e-4)
    assert torch.allclose(kl(mu_q, rho, mu_p, rho) * s2, (mu_q - mu_p) ** 2 / 2, rtol=1e-5)


def test_the_implicit_sgd_step_is_the_proximal_map():
    x, g_rest, anchor = torch.tensor([1.0]), torch.tensor([0.5]), torch.tensor([-2.0])
    prec, lr = torch.tensor([7.0]), 0.1
    stepped = SGD(lr).step(x, g_rest + prec * (x - anchor), prec)
    assert torch.allclose(stepped, (x - lr * g_rest + lr * prec * anchor) / (1 + lr * prec))
    assert torch.allclose(SGD(lr).step(x, g_rest), x - lr * g_rest)


def test_adam_is_torch_adam():
    torch.manual_seed(1)
    x = torch.randn(5, dtype=D)
    ref = x.clone().requires_grad_(True)
    torch_adam = torch.optim.Adam([ref], lr=0.01)
    ours = Adam(0.01)
    for _ in range(6):
        g = torch.randn(5, dtype=D) * 10
        x = ours.step(x, g)
        ref.grad = g.clone()
        torch_adam.step()
    assert torch.allclose(x, ref.detach(), rtol=1e-10, atol=1e-12)


# -- one client step --------------------------------------------------------------------
def _client(*overrides):
    sim = Simulation(fast_config(*PFB, "train.batch_size=1000", *overrides), progress=False)
    return sim, sim.client, sim.train_data[0]


def _gaussians(init, mu_shift, rho, seed):
    gen = torch.Generator().manual_seed(seed)
    mu = {k: v + mu_shift * torch.randn(v.shape, generator=gen) for k, v in init.items()}
    rhos = {k: rho + 0.3 * torch.randn(v.shape, generator=gen) for k, v in init.items()}
    return mu, rhos


def test_one_client_step_is_the_papers_gradient_step():
    """One mini-batch (the whole client) with explicit SGD: the personal q_i takes a step on
    mean NLL under reparameterized draws + zeta / n KL(q_i || global), computed here with
    autograd through functional_call, and the local copy of the global then one step on
    zeta / n KL(q_i' || copy) with its own learning rate."""
    zeta, lr_p, lr_g, k = 5.0, 0.05, 0.03, 2
    sim, client, data = _client("algorithm.optimizer=sgd", "algorithm.pull=explicit",
                                f"algorithm.zeta={zeta}", f"algorithm.personal_lr={lr_p}",
                                f"algorithm.global_lr={lr_g}", f"algorithm.train_mc={k}")
    init = sim.parts.init_model
    mu_i, rho_i = _gaussians(init, 0.01, -4.0, 1)
    mu_g, rho_g = _gaussians(init, 0.0, -3.5, 2)
    state = {**{MU + n: v for n, v in mu_i.items()}, **{RHO + n: v for n, v in rho_i.items()}}
    msg = Message({**{MU + n: v for n, v in mu_g.items()}, **{RHO + n: v for n, v in rho_g.items()}})
    result = client.update(0, msg, state, data, generator(0, "c"))

    names, coef = client.names, zeta / data.n
    (x, y), = list(data.batches(1000, generator(0, "c")))
    noise = generator(generator(0, "c").initial_seed(), "pfedbayes-noise")
    m = {n: mu_i[n].clone().requires_grad_(True) for n in names}
    r = {n: rho_i[n].clone().requires_grad_(True) for n in names}
    nll = 0.0
    for _ in range(k):
        flat = torch.randn(sum(mu_i[n].numel() for n in names), generator=noise)
        eps, i = {}, 0
        for n in names:
            eps[n] = flat[i:i + mu_i[n].numel()].view(mu_i[n].shape)
            i += mu_i[n].numel()
        theta = {n: m[n] + F.softplus(r[n]) * eps[n] for n in names}
        nll = nll + F.cross_entropy(functional_call(client.trainer.model, theta, (x,)), y) / k
    prior = sum(kl_divergence(Normal(m[n], F.softplus(r[n])),
                              Normal(mu_g[n], F.softplus(rho_g[n]))).sum() for n in names)
    (nll + coef * prior).backward()
    mu_new = {n: (m[n] - lr_p * m[n].grad).detach() for n in names}
    rho_new = {n: (r[n] - lr_p * r[n].grad).detach() for n in names}
    gm = {n: mu_g[n].clone().requires_grad_(True) for n in names}
    gr = {n: rho_g[n].clone().requires_grad_(True) for n in names}
    copy_kl = sum(kl_divergence(Normal(mu_new[n], F.softplus(rho_new[n])),
                                Normal(gm[n], F.softplus(gr[n]))).sum() for n in names)
    (coef * copy_kl).backward()
    for n in names:
        assert torch.allclose(result.state[MU + n], mu_new[n], rtol=1e-4, atol=1e-6), n
        assert torch.allclose(result.state[RHO + n], rho_new[n], rtol=1e-4, atol=1e-6), n
        assert torch.allclose(result.reply.tensors[MU + n], gm[n] - lr_g * gm[n].grad,
                              rtol=1e-4, atol=1e-6), n
        assert torch.allclose(result.reply.tensors[RHO + n], gr[n] - lr_g * gr[n].grad,
                              rtol=1e-4, atol=1e-6), n
    assert result.reply.meta == {"num_samples": data.n}
    assert result.stats["steps"] == 1 and result.stats["samples"] == data.n


def test_without_spread_a_client_step_is_sgd_with_a_quadratic_pull():
    """sigma -> 0 (rho = -30): a draw is the mean itself, so the data term is the plain
    mini-batch loss at mu_i, and the KL is the quadratic pull c/2 ||mu_i - mu||^2 with
    c = zeta / (n sigma^2): the step is the trainer's SGD with hierbayes' implicit pull
    towards the global mean; the global copy then moves by its proximal step towards the
    new mu_i, and its spread grows by lr_g c d^2."""
    c, lr_p, lr_g = 0.5, 0.05, 0.02
    sim, client, data = _client("algorithm.optimizer=sgd", "algorithm.rho_init=-30",
                                f"algorithm.personal_lr={lr_p}", f"algorithm.global_lr={lr_g}")
    sigma2 = float(softplus(torch.tensor(-30.0))) ** 2
    client.hp = client.hp.model_copy(update={"zeta": c * data.n * sigma2})
    init, names = sim.parts.init_model, client.names
    mu_g = _gaussians(init, 0.01, 0.0, 3)[0]
    rho = {n: torch.full_like(v, -30.0) for n, v in init.items()}
    msg = Message({**{MU + n: v for n, v in mu_g.items()}, **{RHO + n: v for n, v in rho.items()}})
    result = client.update(0, msg, client.init_state(0, init), data, generator(0, "c"))

    trainer, t = client.trainer, sim.cfg.train
    trainer.load(init)
    hook = proximal_pull(lr_p, [torch.full_like(init[n], c) for n in names], [mu_g[n] for n in names])
    trainer.fit(data, 1, t.batch_size, lr_p, generator(0, "c"), grad_hook=hook)
    expected = trainer.export()
    for n in names:
        mu_new = result.state[MU + n]
        assert torch.allclose(mu_new, expected[n], rtol=1e-4, atol=1e-6), n
        assert torch.allclose(result.state[RHO + n], rho[n])  # no force on sigma_i
        copy = (mu_g[n] + lr_g * c * mu_new) / (1 + lr_g * c)
        assert torch.allclose(result.reply.tensors[MU + n], copy, rtol=1e-4, atol=1e-7), n
        grown = rho[n] + lr_g * c * (mu_new - mu_g[n]) ** 2
        assert torch.allclose(result.reply.tensors[RHO + n], grown, rtol=1e-6, atol=1e-7), n
    assert any(not torch.equal(result.state[MU + n], init[n]) for n in names)


def test_one_draw_without_spread_is_the_deterministic_forward_pass():
    sim = Simulation(fast_config(*PFB, "algorithm.rho_init=-30", "algorithm.mc_samples=1",
                                 "train.rounds=1"), progress=False)
    sim.step()
    state = sim.clients.row(0)
    models = sim.client.predictive(0, state, sim.server.eval_message(0), sim.train_data[0])
    assert set(models) == {"", "global"} and len(models[""]) == len(models["global"]) == 1
    x, y = sim.test_data[0]
    trainer = sim.trainer
    mean = sim.client.personal_model(state, None)
    correct, loss = trainer.evaluate_predictive(models[""], x, y)
    assert correct == trainer.evaluate(mean, x, y)[0]
    assert loss == pytest.approx(trainer.evaluate(mean, x, y)[1], rel=1e-5)
    glob = {n: v for n, v in sim.server.mu.items()}
    assert trainer.evaluate_predictive(models["global"], x, y)[0] == trainer.evaluate(glob, x, y)[0]


def test_zeta_zero_trains_the_personal_mean_as_local_training():
    """No KL: the personal q_i's mean follows local SGD step for step, bit for bit (sigma =
    1e-13 vanishes under float32 rounding; the same mini-batches, since the draws have their
    own stream), over rounds and epochs."""
    # a quarter of the synthetic set: still several mini-batches a client in each epoch
    common = ["train.rounds=2", "train.local_epochs=2", "dataset.fraction=0.25"]
    pfb = Simulation(fast_config(*PFB, *common, "algorithm.zeta=0", "algorithm.optimizer=sgd",
                                 "algorithm.personal_lr=0.05", "algorithm.rho_init=-30"),
                     progress=False)
    local = Simulation(fast_config("algorithm.name=local", *common), progress=False)
    pfb.run()
    local.run()
    for cid in range(pfb.num_clients):
        ours, theirs = _split(pfb.clients.row(cid), MU), model_from_state(local.clients.row(cid))
        for n in theirs:
            assert torch.equal(ours[n], theirs[n]), (cid, n)
    for a, b in zip(pfb.metrics, local.metrics, strict=True):
        assert a["acc_mean"] == b["acc_mean"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)


def test_the_test_time_fit_without_kl_is_local_sgd_from_the_global_mean():
    """personalize = fit, zeta = 0 and no spread: a client is scored on the global mean after
    personal_epochs of plain SGD on its training data (its own generator), whatever q_i it
    keeps, and the fit leaves that kept q_i as it was."""
    sim = Simulation(fast_config(*PFB, "algorithm.personalize=fit", "algorithm.zeta=0",
                                 "algorithm.optimizer=sgd", "algorithm.personal_lr=0.05",
                                 "algorithm.rho_init=-30", "algorithm.mc_samples=1",
                                 "algorithm.personal_epochs=2", "train.rounds=1"),
                     progress=False)
    sim.step()
    cid, msg = 0, sim.server.eval_message(0)
    state = {k: v.clone() for k, v in sim.clients.row(cid).items()}
    fitted = sim.client.predictive(cid, state, msg, sim.train_data[cid])[""][0]
    for k, v in sim.clients.row(cid).items():
        assert torch.equal(v, state[k]), k
    trainer = sim.trainer
    trainer.load({k: v.clone() for k, v in sim.server.mu.items()})
    trainer.fit(sim.train_data[cid], 2, sim.cfg.train.batch_size, 0.05,
                generator(sim.cfg.seed, "personalize", 1, cid))
    expected = trainer.export()
    for k in expected:
        assert torch.allclose(fitted[k], expected[k], atol=1e-6), k
    assert any(not torch.allclose(fitted[k], state[MU + k]) for k in expected)


def test_under_the_test_time_fit_an_unselected_client_is_not_scored_on_its_initial_q():
    common = [*PFB, "partition.clients=8", "train.participation=0.25", "train.rounds=3"]
    kept = Simulation(fast_config(*common), progress=False).run()
    fit = Simulation(fast_config(*common, "algorithm.personalize=fit"), progress=False).run()
    for a, b in zip(kept.metrics, fit.metrics, strict=True):
        assert a["bytes_up"] == b["bytes_up"] and a["acc_global_mean"] == b["acc_global_mean"]
    never = [c for c in range(8) if kept.summary["bytes_up_per_client"][c] == 0]
    assert never, "a client never selected in 3 rounds of 25%"
    assert min(fit.client_accuracy[c] for c in never) > max(kept.client_accuracy[c] for c in never)


# -- the server ------------------------------------------------------------------------------
def _replies(server):
    a = {n: v + 1.0 for n, v in server.mu.items()}
    b = {n: v - 3.0 for n, v in server.mu.items()}
    def reply(mu, rho, n):
        return Message({**{MU + k: v for k, v in mu.items()},
                        **{RHO + k: torch.full_like(v, rho) for k, v in mu.items()}},
                       {"num_samples": n})
    return {0: reply(a, -4.0, 10), 3: reply(b, -6.0, 30)}


@pytest.mark.parametrize("beta,weighting", [(1.0, "uniform"), (0.5, "uniform"), (1.0, "samples")])
def test_the_server_mixes_the_uploaded_distributions(beta, weighting):
    sim = Simulation(fast_config(*PFB, f"algorithm.beta={beta}", f"algorithm.weighting={weighting}"),
                     progress=False)
    server = sim.server
    old_mu = {n: v.clone() for n, v in server.mu.items()}
    old_rho = {n: v.clone() for n, v in server.rho.items()}
    server.aggregate(1, _replies(server))
    w = (0.5, 0.5) if weighting == "uniform" else (0.25, 0.75)
    for n in old_mu:
        mean_mu = w[0] * (old_mu[n] + 1) + w[1] * (old_mu[n] - 3)
        mean_rho = w[0] * -4.0 + w[1] * -6.0
        assert torch.allclose(server.mu[n], (1 - beta) * old_mu[n] + beta * mean_mu, atol=1e-6)
        assert torch.allclose(server.rho[n], (1 - beta) * old_rho[n] + beta * mean_rho, atol=1e-6)
    # what the clients predict with next carries the round (it seeds the MC draws)
    assert server.eval_message(0).meta == {"round": 1}


def test_the_server_refuses_a_reply_without_the_distribution():
    server = Simulation(fast_config(*PFB), progress=False).server
    replies = _replies(server)
    replies[0] = Message({k: v for k, v in replies[0].tensors.items() if k.startswith(MU)},
                         {"num_samples": 10})
    with pytest.raises(MessageError, match="rho"):
        server.check_reply(0, replies[0])


# -- runs ------------------------------------------------------------------------------------
def test_a_run_reports_personal_and_global_accuracy_and_learns():
    result = Simulation(fast_config(*PFB, "train.rounds=3"), progress=False).run()
    for row in result.metrics:
        for key in ("acc_mean", "acc_global_mean", "acc_global_weighted", "global_std",
                    "train_loss"):
            assert key in row and not math.isnan(row[key]), key
    # synthetic has 10 classes: chance is 0.1
    assert result.metrics[-1]["acc_mean"] > 0.4
    assert result.metrics[-1]["acc_global_mean"] > 0.3
    assert result.metrics[-1]["acc_mean"] > result.metrics[0]["acc_mean"]


def test_pfedbayes_resumes_exactly(tmp_path):
    # a quarter of the synthetic set: what is compared is exact equality, at any size
    resumed, straight = resumed_and_straight(tmp_path, *PFB, "dataset.fraction=0.25")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
    for n in straight.server.mu:
        assert torch.equal(resumed.server.mu[n], straight.server.mu[n])
        assert torch.equal(resumed.server.rho[n], straight.server.rho[n])


def test_the_personal_distribution_never_crosses_the_link():
    """Down: the one global distribution, the same for every client; up: the local copy of
    the global and the sample count. The personal (mu_i, rho_i) stays in the client's state."""
    sim = Simulation(fast_config(*PFB, "train.rounds=2", "train.participation=0.5"),
                     progress=False)
    fedavg = Simulation(fast_config("algorithm.name=fedavg", "train.rounds=1",
                                    "train.participation=0.5"), progress=False)
    seen = []
    real_train = sim.transport.train

    def spy(step, messages):
        replies = real_train(step, messages)
        seen.append((messages, replies))
        return replies

    sim.transport.train = spy
    names = sim.client.names
    expected_keys = {MU + n for n in names} | {RHO + n for n in names}
    for _ in range(2):
        sim.step()
        down, up = seen[-1]
        assert len({id(m) for m in down.values()}) == 1  # one broadcast distribution
        for cid, reply in up.items():
            state = sim.clients.row(cid)
            msg = reply.message
            assert set(msg.tensors) == expected_keys
            assert msg.meta == {"num_samples": sim.train_data[cid].n}
            for m in (msg, down[cid]):
                for key, value in m.tensors.items():
                    assert not torch.equal(value, state[key]), (cid, key)
    assert sim.metrics[0]["bytes_down"] == 2 * fedavg.step()["bytes_down"]


def test_pfedbayes_refuses_batchnorm_and_momentum():
    with pytest.raises(ConfigError, match="BatchNorm"):
        Simulation(fast_config(*PFB, "model.name=cnn_small_bn"), progress=False)
    with pytest.raises(ConfigError, match="momentum"):
        Simulation(fast_config(*PFB, "train.momentum=0.9"), progress=False)


def test_flower_run_equals_the_simulation():
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    from edgepfl.engine.flower_local import run_local
    from edgepfl.engine.simulation import METRIC_COLUMNS

    rc = {"dataset.name": "synthetic", "partition.clients": 3, "train.rounds": 2,
          "train.batch_size": 32, "train.local_epochs": 1, "train.lr": 0.05,
          "output.plots": False, "system.count_flops": False, "algorithm.name": "pfedbayes",
          "train.participation": 0.67}
    sets = [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in rc.items()]
    sim = Simulation(fast_config(*sets), progress=False).run()
    result = run_local(rc)
    assert len(result.metrics) == len(sim.metrics) == 2
    figures = set(sim.metrics[-1]) - set(METRIC_COLUMNS)
    assert {"acc_global_mean", "global_std"} <= figures
    for ours, theirs in zip(result.metrics, sim.metrics, strict=True):
        for key in ("acc_mean", "acc_weighted", "acc_min", "loss", "train_loss", "bytes_up",
                    "bytes_down", "clients", *figures):
            assert ours[key] == theirs[key], (ours["round"], key)
