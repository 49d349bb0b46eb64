"""Defining properties of the KAPC papers' baselines: FedBN, FedBABU, MOON, FedAMP, FedProto,
pFedLA (edgepfl.algorithms.<name>)."""

import functools
import math

import pytest
import torch

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.engine.simulation import Simulation
from edgepfl.federation.messages import Message
from tests.conftest import fast_config, resumed_and_straight, without_wall

BN_MODEL = "model.name=cnn_small_bn"
TRAINING = ["round", "acc_mean", "acc_weighted", "acc_std", "acc_min", "loss", "train_loss"]


def _sim(*overrides: str) -> Simulation:
    return Simulation(fast_config(*overrides), progress=False)


def _rows(metrics, drop=("wall_s",)):
    return [{k: v for k, v in r.items() if k not in drop} for r in metrics]


@functools.cache
def _training(*overrides: str) -> tuple[tuple[tuple[str, float], ...], ...]:
    """The training columns of a short run (2 rounds), cached: the FedAvg and local
    reference runs are shared by several tests."""
    result = _sim(*overrides, "train.rounds=2").run()
    return tuple(tuple((k, r[k]) for k in TRAINING) for r in result.metrics)


def _record(sim: Simulation) -> tuple[list, list]:
    """Wrap configure and update to keep every message sent (down: per round, up: per reply)."""
    down, up = [], []
    configure, update = sim.server.configure, sim.client.update

    def configure_(rnd, selected):
        out = configure(rnd, selected)
        down.append({cid: Message({k: v.clone() for k, v in m.tensors.items()}, dict(m.meta))
                     for cid, m in out.items()})
        return out

    def update_(cid, msg, state, data, gen):
        result = update(cid, msg, state, data, gen)
        up.append((cid, Message({k: v.clone() for k, v in result.reply.tensors.items()},
                                dict(result.reply.meta))))
        return result

    sim.server.configure = configure_
    sim.client.update = update_
    return down, up


# -- every baseline: resumable, registered ------------------------------------------------

RESUME_CASES = [
    ("fedbn", [BN_MODEL]),
    ("fedbabu", ["algorithm.finetune_epochs=1"]),
    ("moon", ["algorithm.proj_dim=16"]),
    ("fedamp", ["algorithm.alphaK=0.01", "algorithm.sigma=100", "algorithm.lamda=0.01"]),
    ("fedproto", []),
    ("pfedla", ["algorithm.hn_lr=0.5", "algorithm.hidden_dim=16", "algorithm.embedding_dim=8"]),
]


@pytest.mark.parametrize(("name", "extra"), RESUME_CASES, ids=[c[0] for c in RESUME_CASES])
def test_resumed_run_gives_identical_metrics(tmp_path, name, extra):
    resumed, straight = resumed_and_straight(
        tmp_path, f"algorithm.name={name}", "train.participation=0.5", *extra)
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


# -- FedBN --------------------------------------------------------------------------------

def test_fedbn_never_sends_batchnorm_tensors_and_keeps_them_per_client():
    from edgepfl.algorithms.fedbn import batchnorm_names

    sim = _sim("algorithm.name=fedbn", BN_MODEL)
    bn = batchnorm_names(sim.layers)
    assert bn == ["bn1.weight", "bn1.bias", "bn2.weight", "bn2.bias",
                  "bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked",
                  "bn2.running_mean", "bn2.running_var", "bn2.num_batches_tracked"]
    down, up = _record(sim)
    sim.run()
    sent = {k for rnd in down for m in rnd.values() for k in m.tensors}
    sent |= {k for _, m in up for k in m.tensors}
    assert sent == set(sim.trainer.state_names) - set(bn)
    assert not set(sim.server.global_model) & set(bn)  # nor held by the server
    # the BatchNorm tensors live in client state and differ between clients
    for name in ("bn1.weight", "bn2.running_mean"):
        stack = sim.clients.stack(f"bn.{name}")
        assert not torch.equal(stack[0], stack[1])
    # the shared layers really are shared: every client predicts with the server's copy
    for cid in range(sim.num_clients):
        model = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        assert torch.equal(model["conv1.weight"], sim.server.global_model["conv1.weight"])
        assert torch.equal(model["bn1.weight"], sim.clients.stack("bn.bn1.weight")[cid])


def test_fedbn_bytes_are_the_shared_tensors_only():
    sim = _sim("algorithm.name=fedbn", BN_MODEL)
    from edgepfl.algorithms.fedbn import batchnorm_names

    bn = set(batchnorm_names(sim.layers))
    shared = sum(t.numel() * t.element_size() for n, t in sim.trainer.export().items()
                 if n not in bn)
    row = sim.step()
    assert row["bytes_down"] == row["clients"] * shared
    meta = sum(Message({}, {"num_samples": sim.train_data[c].n}).meta_bytes
               for c in range(sim.num_clients))
    assert row["bytes_up"] == row["clients"] * shared + meta


def test_fedbn_without_batchnorm_is_exactly_fedavg_and_says_so():
    with pytest.warns(UserWarning, match="no BatchNorm layers.*cnn2_bn.*resnet18_bn"):
        fedbn = _training("algorithm.name=fedbn", "model.name=cnn_small")
    assert fedbn == _training("algorithm.name=fedavg", "model.name=cnn_small")


@pytest.mark.parametrize(("dataset", "default", "fedbn"), [
    ("synthetic", "cnn_small", "cnn_small_bn"), ("mnist", "cnn2", "cnn2_bn"),
    ("cifar10", "cnn_cifar", "cnn_cifar")])
def test_fedbn_defaults_to_the_batchnorm_variant_of_the_data_sets_model(dataset, default, fedbn):
    from edgepfl.engine.simulation import resolve

    def model(*overrides):
        return resolve(fast_config(f"dataset.name={dataset}", *overrides)).model.name

    assert model("algorithm.name=fedavg") == default
    # without a BatchNorm variant (cnn_cifar has none) the default stays, and FedBN warns
    assert model("algorithm.name=fedbn") == fedbn
    # a model the user names is kept, even without BatchNorm
    assert model("algorithm.name=fedbn", "model.name=mlp") == "mlp"


# -- FedBABU ------------------------------------------------------------------------------

def test_fedbabu_head_never_changes_during_federated_rounds():
    from edgepfl.algorithms.fedbabu import head_names

    sim = _sim("algorithm.name=fedbabu", "algorithm.finetune_epochs=1")
    head = head_names(sim.layers)
    assert head == ["fc2.weight", "fc2.bias"]
    init = sim.trainer.export()
    down, up = _record(sim)
    update, trained_heads = sim.client.update, []

    def update_(cid, msg, state, data, gen):
        result = update(cid, msg, state, data, gen)
        # what local training left in the trainer: the head must not have moved
        trained_heads.append({n: sim.client.trainer.export()[n].clone() for n in head})
        return result

    sim.client.update = update_
    sim.run()
    assert len(trained_heads) == 3 * sim.num_clients
    assert all(torch.equal(h[n], init[n]) for h in trained_heads for n in head)
    # the head is never sent, never held by the server, and identical on every client
    assert not {k for rnd in down for m in rnd.values() for k in m.tensors} & set(head)
    assert not {k for _, m in up for k in m.tensors} & set(head)
    assert not set(sim.server.global_model) & set(head)
    for n in head:
        assert all(torch.equal(row, init[n]) for row in sim.clients.stack(f"head.{n}"))
    # while the body did train
    assert not torch.equal(sim.server.global_model["fc1.weight"], init["fc1.weight"])


def test_fedbabu_evaluates_each_client_on_the_latest_global_body_fine_tuned():
    from edgepfl.federation.rng import generator

    sim = _sim("algorithm.name=fedbabu", "algorithm.finetune_epochs=2", "train.rounds=2")
    init = sim.trainer.export()
    sim.run()
    body = {k: v.clone() for k, v in sim.server.global_model.items()}
    tuned = []
    for cid in (0, 1):
        msg = sim.server.eval_message(cid)
        model = sim.client.predictive(cid, sim.clients.row(cid), msg, sim.train_data[cid])[""][0]
        # by hand: the final global body with the common head, fine-tuned whole
        sim.trainer.load({**body, "fc2.weight": init["fc2.weight"], "fc2.bias": init["fc2.bias"]})
        t = sim.cfg.train
        sim.trainer.fit(sim.train_data[cid], 2, t.batch_size, t.lr,
                        generator(sim.cfg.seed, "fedbabu-finetune", cid), momentum=t.momentum,
                        weight_decay=t.weight_decay)
        expected = sim.trainer.export()
        assert all(torch.equal(model[k], expected[k]) for k in expected)
        tuned.append(model)
    assert not torch.equal(tuned[0]["fc2.weight"], init["fc2.weight"])  # the head moved too
    assert not torch.equal(tuned[0]["fc2.weight"], tuned[1]["fc2.weight"])


def test_fedbabu_finetuning_leaves_the_rounds_training_as_it_is():
    def body(epochs: int) -> dict:
        sim = _sim("algorithm.name=fedbabu", f"algorithm.finetune_epochs={epochs}", "train.rounds=2")
        sim.run()
        return sim.server.global_model

    zero, two = body(0), body(2)
    assert all(torch.equal(zero[k], two[k]) for k in zero)


def test_fedbabu_without_finetuning_predicts_with_global_body_and_initial_head():
    sim = _sim("algorithm.name=fedbabu", "algorithm.finetune_epochs=0")
    init = sim.trainer.export()
    sim.step()
    sim.step()
    body = {k: v.clone() for k, v in sim.server.global_model.items()}
    model = sim.client.predictive(0, sim.clients.row(0), sim.server.eval_message(0),
                                  sim.train_data[0])[""][0]
    assert torch.equal(model["fc2.weight"], init["fc2.weight"])
    assert torch.equal(model["conv1.weight"], body["conv1.weight"])  # the latest body


def test_fedbabu_finetuning_for_evaluation_is_not_a_cost_of_the_round():
    # the paper fine-tunes once, at test time: only the body's training is the round's work
    def client_flops(epochs: int) -> list[float]:
        sim = _sim("algorithm.name=fedbabu", f"algorithm.finetune_epochs={epochs}",
                   "system.cache_flops=false")
        return [r["flops_client"] for r in sim.run().metrics]

    without = client_flops(0)
    assert all(f > 0 for f in without)
    assert client_flops(2) == without


def test_fedbabu_defaults_finetune_as_the_paper():
    assert get_algorithm("fedbabu").hyperparameters().finetune_epochs == 5


# -- MOON ---------------------------------------------------------------------------------

def test_moon_with_mu_zero_trains_exactly_as_fedavg():
    assert _training("algorithm.name=moon", "algorithm.mu=0", "algorithm.proj_dim=16") == \
        _training("algorithm.name=fedavg")


def test_moon_with_positive_mu_differs_and_trains_the_projection_head():
    sim = _sim("algorithm.name=moon", "algorithm.proj_dim=16", "train.rounds=2")
    init_proj = {k: v.clone() for k, v in sim.server.global_model.items() if k.startswith("proj.")}
    moon = sim.run()
    fedavg = _training("algorithm.name=fedavg")
    assert [r["train_loss"] for r in moon.metrics] != [dict(r)["train_loss"] for r in fedavg]
    assert any(not torch.equal(sim.server.global_model[k], v) for k, v in init_proj.items())


def test_moon_contrastive_loss_is_the_papers_and_has_a_gradient():
    from edgepfl.algorithms.moon import contrastive_loss

    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 8, generator=g, requires_grad=True)
    zg, zp = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    loss = contrastive_loss(z, zg, zp, 0.5)
    cos = torch.nn.functional.cosine_similarity
    pos, neg = torch.exp(cos(z, zg) / 0.5), torch.exp(cos(z, zp) / 0.5)
    torch.testing.assert_close(loss, (-torch.log(pos / (pos + neg))).mean())
    loss.backward()
    assert z.grad is not None and z.grad.abs().sum() > 0
    # pulled towards the global representation: a step along -grad raises sim(z, z_glob)
    with torch.no_grad():
        assert (cos(z - 0.1 * z.grad, zg) > cos(z, zg)).float().mean() > 0.5


def test_moon_keeps_the_previous_local_model_per_client():
    sim = _sim("algorithm.name=moon", "algorithm.proj_dim=16")
    down, up = _record(sim)
    init = sim.trainer.export()
    assert all(torch.equal(sim.clients.row(c)["prev.fc1.weight"], init["fc1.weight"])
               for c in range(sim.num_clients))
    sim.step()
    for cid, reply in up:
        row = sim.clients.row(cid)
        assert set(reply.tensors) == {k[len("prev."):] for k in row}
        assert all(torch.equal(row[f"prev.{k}"], v) for k, v in reply.tensors.items())
    # the evaluated model is the global model without the projection head
    msg = sim.server.eval_message(0)
    assert set(msg.tensors) == set(sim.trainer.state_names)


def test_moon_local_evaluation_predicts_with_the_clients_last_trained_model():
    sim = _sim("algorithm.name=moon", "algorithm.proj_dim=16", "algorithm.evaluate=local",
               "train.participation=0.5")
    _, up = _record(sim)
    sim.step()
    trained = dict(up)
    init = sim.trainer.export()
    for cid in range(sim.num_clients):
        model = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        assert set(model) == set(sim.trainer.state_names)
        source = trained[cid].tensors if cid in trained else init  # never selected: initial
        assert all(torch.equal(v, source[k]) for k, v in model.items()), cid
    glob = sim.server.eval_message(0).tensors
    some = next(iter(trained))
    assert not torch.equal(sim.client.personal_model(sim.clients.row(some), None)["fc1.weight"],
                           glob["fc1.weight"])


@pytest.mark.parametrize("name", ["moon", "fedproto"])
@pytest.mark.parametrize("model", ["cnn_small", "cnn_small_bn"])
def test_feature_losses_train_as_with_a_second_pass_through_the_body(monkeypatch, name, model):
    """MOON and FedProto read the features from the forward that made the logits; a local
    update must be the one that recomputes ``features(x)`` for the loss (up to summation
    order), on a plain and on a BatchNorm model, through the wrapper MOON trains."""
    import contextlib

    import edgepfl.algorithms.fedproto as fedproto
    import edgepfl.algorithms.moon as moon
    from edgepfl.federation.rng import generator

    @contextlib.contextmanager
    def second_pass(module, classifier):
        body = module.net if hasattr(module, "net") else module
        batch = []
        handle = module.register_forward_pre_hook(lambda m, args: batch.__setitem__(
            slice(None), [args[0]]))

        class Tap:
            @staticmethod
            def take():
                return body.features(batch[0])

        try:
            yield Tap()
        finally:
            handle.remove()

    extra = ["algorithm.proj_dim=16"] if name == "moon" else []
    sim = _sim(f"algorithm.name={name}", f"model.name={model}", *extra)
    sim.step()  # FedProto's feature loss needs the global prototypes of a first round
    msg = sim.server.configure(2, [0])[0]

    def update():
        result = sim.client.update(0, msg, sim.clients.row(0), sim.train_data[0],
                                   generator(0, "client", 2, 0))
        return {**{f"up.{k}": v for k, v in result.reply.tensors.items()}, **result.state}

    tapped = update()
    for module in (moon, fedproto):
        monkeypatch.setattr(module, "tap_features", second_pass)
    recomputed = update()
    assert tapped.keys() == recomputed.keys()
    moved_twice = ("running", "num_batches") + (("up.protos",) if model.endswith("_bn") else ())
    for key, value in tapped.items():
        if any(m in key for m in moved_twice):
            continue  # the second pass moved the running statistics (and so the eval-mode
            # prototypes) a second time per batch: the defect the tap removes
        torch.testing.assert_close(value, recomputed[key], rtol=1e-5, atol=1e-6, msg=key)
    kept = "prev.conv1.weight" if name == "moon" else "model.conv1.weight"
    assert not torch.equal(tapped[kept], sim.clients.row(0)[kept])  # the update trained


def test_moon_defaults_are_the_papers():
    hp = get_algorithm("moon").hyperparameters()
    assert (hp.mu, hp.temperature, hp.proj_dim) == (5.0, 0.5, 256)


# -- FedAMP -------------------------------------------------------------------------------

def test_fedamp_weights_rows_sum_to_one_and_favour_close_clients():
    from edgepfl.algorithms.fedamp import attention_weights, squared_distances

    flat = torch.tensor([[0.0, 0.0], [0.1, 0.0], [3.0, 0.0], [0.0, 0.2]])
    d = squared_distances(flat)
    torch.testing.assert_close(d[0, 2], torch.tensor(9.0, dtype=torch.float64))
    xi = attention_weights(d, 0.05, 1.0)
    torch.testing.assert_close(xi.sum(1), torch.ones(4, dtype=torch.float64))
    assert xi[0, 1] > xi[0, 3] > xi[0, 2] > 0
    torch.testing.assert_close(xi[0, 1], torch.tensor(0.05 * math.exp(-0.01), dtype=torch.float64))


def test_fedamp_with_sigma_to_infinity_approaches_equal_weights():
    from edgepfl.algorithms.fedamp import attention_weights, squared_distances

    flat = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    d = squared_distances(flat)
    for sigma in (1e2, 1e6):
        # alpha_k = sigma / N keeps the off-diagonal weights finite as sigma grows
        xi = attention_weights(d, sigma / 5, sigma)
        err = float((xi - 0.2).abs().max())
        assert err < 20 / sigma
    assert err < 1e-4


def test_fedamp_cloud_model_is_the_weighted_combination_of_client_models():
    sim = _sim("algorithm.name=fedamp", "algorithm.alphaK=0.05", "algorithm.sigma=50")
    sim.step()
    xi = sim.server.weights()
    assert not torch.allclose(xi, torch.eye(sim.num_clients, dtype=xi.dtype))
    msgs = sim.server.configure(2, [0, 3])
    stack = sim.server.models["fc1.weight"]
    for cid in (0, 3):
        expected = sum(float(xi[cid, j]) * stack[j] for j in range(sim.num_clients))
        torch.testing.assert_close(msgs[cid].tensors["fc1.weight"], expected)
    # round 1 starts from one initial model (all distances 0): self-weight 1 - alpha_k (N-1) / sigma
    assert sim.metrics[0]["amp_self_weight_min"] == pytest.approx(1 - 0.05 * (sim.num_clients - 1) / 50)
    # and the logged figure is the smallest self-weight of the round's clients
    assert sim.server.round_metrics()["amp_self_weight_min"] == pytest.approx(
        min(float(xi[0, 0]), float(xi[3, 3])))


def test_fedamp_with_lamda_zero_is_local_training_and_positive_lamda_is_not():
    local = _training("algorithm.name=local")
    assert _training("algorithm.name=fedamp", "algorithm.lamda=0") == local
    assert _training("algorithm.name=fedamp", "algorithm.lamda=0.05", "algorithm.alphaK=0.05",
                     "algorithm.sigma=100") != local


def test_fedamp_defaults_do_not_switch_the_method_off():
    # at the defaults the proximal pull (lamda / alpha_k = 1) changes training measurably,
    # and the defaults follow the federation's size within the self-weight bound
    from edgepfl.engine.parts import resolve
    for n, alpha in [(6, 0.25), (21, 0.25), (30, 5.0 / 29), (1000, 5.0 / 999)]:
        hp = resolve(fast_config("algorithm.name=fedamp", f"partition.clients={n}")).algorithm
        assert (hp.alphaK, hp.lamda) == (alpha, alpha)
        assert hp.alphaK * (n - 1) / hp.sigma <= 1
    assert _training("algorithm.name=fedamp") != _training("algorithm.name=local")


def _self_weight_after(rounds: int, *overrides: str) -> float:
    sim = _sim("algorithm.name=fedamp", "dataset.name=digits", "train.local_epochs=2",
               f"train.rounds={rounds}", "eval.every=1000", *overrides)
    for _ in range(rounds):
        row = sim.step()
    return row["amp_self_weight_min"]


def test_fedamp_defaults_keep_passing_messages_over_a_long_run():
    """Messages must still flow after many rounds: if sigma is small against the distances
    local training opens up, every weight on another client decays to zero and FedAMP
    turns into local training (as the earlier defaults 0.05 / 0.05 / 1 did)."""
    assert _self_weight_after(20) < 0.9  # every client keeps >= 10% on the others
    assert _self_weight_after(20, "algorithm.alphaK=0.05", "algorithm.lamda=0.05",
                              "algorithm.sigma=1") > 0.99


def test_fedamp_rejects_steps_that_make_self_weights_negative():
    from edgepfl.errors import ConfigError

    # 6 clients: alpha_k (N - 1) / sigma = 0.3 * 5 / 1 > 1
    with pytest.raises(ConfigError, match=r"alphaK = 0.3 .* valid: alphaK <= sigma / \(N - 1\) = 0.2"):
        _sim("algorithm.name=fedamp", "algorithm.alphaK=0.3", "algorithm.sigma=1")
    _sim("algorithm.name=fedamp", "algorithm.alphaK=0.2", "algorithm.sigma=1")  # the boundary is allowed


def test_fedamp_proximal_gradient_is_that_of_the_regularizer():
    sim = _sim("algorithm.name=fedamp", "algorithm.lamda=0.3", "algorithm.alphaK=0.1")
    hooks = []
    real = sim.client.trainer.fit

    def fit_(*args, grad_hook=None, **kw):
        hooks.append(grad_hook)
        return real(*args, grad_hook=grad_hook, **kw)

    sim.client.trainer.fit = fit_
    init = sim.trainer.export()
    sim.step()
    # round 1: every cloud model u_i is the initial model; the hook's gradient term at w
    # must be that of lamda / (2 alpha_k) ||w - u||^2, checked against autograd
    names = sim.trainer.param_names
    w = [torch.randn_like(init[n], requires_grad=True) for n in names]
    reg = sum((wi - init[n]).pow(2).sum() for wi, n in zip(w, names, strict=True))
    (0.3 / (2 * 0.1) * reg).backward()
    grads = [torch.zeros_like(wi) for wi in w]
    hooks[0]([wi.detach() for wi in w], grads)
    for g, wi in zip(grads, w, strict=True):
        torch.testing.assert_close(g, wi.grad)


# -- FedProto -----------------------------------------------------------------------------

def test_fedproto_sends_only_prototypes_and_its_bytes_reflect_that():
    sim = _sim("algorithm.name=fedproto")
    down, up = _record(sim)
    dim = sim.trainer.params["fc2.weight"].shape[1]
    row = sim.step()
    assert row["bytes_down"] == 0  # no global prototypes exist before the first round
    expected_up = 0
    for cid, msg in up:
        assert set(msg.tensors) == {"protos"}
        _, y = sim.train_data[cid].gather()
        classes = sorted(set(y.tolist()))
        assert msg.meta["classes"] == classes
        assert msg.meta["counts"] == [int((y == c).sum()) for c in classes]
        assert msg.tensors["protos"].shape == (len(classes), dim)
        expected_up += len(classes) * dim * 4 + msg.meta_bytes
    assert row["bytes_up"] == expected_up
    row = sim.step()
    m = down[1][0]
    assert set(m.tensors) == {"protos"}
    assert row["bytes_down"] == sum(d.nbytes for d in down[1].values())
    assert row["bytes_down"] == row["clients"] * (len(m.meta["classes"]) * dim * 4 + m.meta_bytes)
    model_bytes = sum(t.numel() * t.element_size() for t in sim.trainer.export().values())
    assert row["bytes_up"] < row["clients"] * model_bytes / 10


def test_fedproto_global_prototypes_are_the_sample_weighted_class_means():
    sim = _sim("algorithm.name=fedproto")
    _, up = _record(sim)
    sim.step()
    num = torch.zeros_like(sim.server.protos, dtype=torch.float64)
    den = torch.zeros(num.shape[0], dtype=torch.float64)
    for _, msg in up:
        for c, n, p in zip(msg.meta["classes"], msg.meta["counts"], msg.tensors["protos"],
                           strict=True):
            num[c] += n * p.double()
            den[c] += n
    seen = den > 0
    torch.testing.assert_close(sim.server.protos[seen], (num[seen] / den[seen, None]).float())
    assert torch.equal(sim.server.present, seen)


def test_fedproto_predicts_with_the_nearest_global_prototype():
    sim = _sim("algorithm.name=fedproto")
    sim.step()
    x, y = sim.test_data[0]
    model = sim.client.personal_model(sim.clients.row(0), sim.server.eval_message(0))
    sim.trainer.forget()
    sim.trainer.load(model)
    sim.trainer.model.eval()
    with torch.no_grad():
        feats = sim.trainer.model.features(x)
        logits = sim.trainer.model(x)
    protos, present = sim.server.protos, sim.server.present
    dist = torch.cdist(feats, protos).pow(2)
    dist[:, ~present] = float("inf")
    assert torch.equal(logits.argmax(1), dist.argmin(1))
    correct, _ = sim.trainer.evaluate(model, x, y)
    assert correct == int((dist.argmin(1) == y).sum())


def test_fedproto_regularizer_has_a_gradient_and_lamda_zero_is_local_training():
    from edgepfl.algorithms.fedproto import prototype_loss

    f = torch.randn(4, 3, requires_grad=True)
    protos = torch.randn(2, 3)
    y = torch.tensor([0, 1, 1, 0])
    present = torch.tensor([True, False])
    loss = prototype_loss(f, y, protos, present)
    expected = ((f[[0, 3]] - protos[0]).pow(2).sum()) / 12
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert f.grad[[0, 3]].abs().sum() > 0 and f.grad[[1, 2]].abs().sum() == 0

    local = _training("algorithm.name=local")
    classifier = "algorithm.predict=classifier"
    assert _training("algorithm.name=fedproto", "algorithm.lamda=0", classifier) == local
    assert _training("algorithm.name=fedproto", classifier) != local


def test_fedproto_defaults_are_the_papers():
    hp = get_algorithm("fedproto").hyperparameters()
    assert (hp.lamda, hp.predict) == (1.0, "prototypes")


# -- pFedLA -------------------------------------------------------------------------------

def _pfedla_server(hn_lr: float, clients: int = 3):
    from edgepfl.algorithms.pfedla import PFedLAHyperparameters, PFedLAServer
    from edgepfl.config import TrainConfig
    from edgepfl.contract.algorithm import ServerContext
    from edgepfl.models import LayerSpec

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    hp = PFedLAHyperparameters(hn_lr=hn_lr, embedding_dim=8, hidden_dim=16)
    server = PFedLAServer(ServerContext(clients, LayerSpec.from_model(net), init, TrainConfig(), 0), hp)
    g = torch.Generator().manual_seed(1)
    for stack in server.models.values():
        stack.copy_(torch.randn(stack.shape, generator=g))  # distinct client models
    return server


def test_pfedla_weights_per_layer_are_non_negative_and_sum_to_one():
    sim = _sim("algorithm.name=pfedla", "algorithm.hn_lr=0.5", "algorithm.hidden_dim=16",
               "algorithm.embedding_dim=8")
    n, layers = sim.num_clients, len(sim.layers)
    start = sim.server.alpha(0)
    torch.testing.assert_close(start, torch.full((layers, n), 1 / n))  # uniform at start
    sim.run()
    moved = False
    for cid in range(n):
        alpha = sim.server.alpha(cid)
        assert alpha.shape == (layers, n)
        assert (alpha >= 0).all()
        torch.testing.assert_close(alpha.sum(1), torch.ones(layers))
        moved |= not torch.allclose(alpha, start)
    assert moved  # the hypernetworks did learn


def test_pfedla_aggregate_is_the_layerwise_weighted_combination():
    server = _pfedla_server(0.1)
    alpha = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    bar = server.aggregate_for(1, alpha)
    expected0 = sum(alpha[0, j] * server.models["0.weight"][j] for j in range(3))
    torch.testing.assert_close(bar["0.weight"], expected0)
    torch.testing.assert_close(bar["1.bias"], server.models["1.bias"][0])


def test_pfedla_hypernetwork_steps_in_the_descent_direction():
    """Local training that moves bar theta towards client 2's model (delta = -eta grad of
    1/2 ||theta - target||^2) must make the next aggregate closer to it and raise the
    weight on client 2; the opposite sign of the hypernetwork gradient would do neither."""
    server = _pfedla_server(hn_lr=0.05)
    target = {k: v[2].clone() for k, v in server.models.items()}

    def distance() -> float:
        bar = server.aggregate_for(0, server.alpha(0))
        return sum(float((bar[k] - target[k]).pow(2).sum()) for k in bar)

    before, weight_before = distance(), server.alpha(0)[:, 2].clone()
    for _ in range(5):
        bar = server.aggregate_for(0, server.alpha(0))
        server.update_hypernetwork(0, {k: 0.5 * (target[k] - bar[k]) for k in bar})
    assert distance() < before
    assert (server.alpha(0)[:, 2] > weight_before).all()


def test_pfedla_hypernetwork_learns_from_trainable_parameters_only():
    """BatchNorm running statistics are combined with the layer weights too, but a change
    in them alone must not move the hypernetwork."""
    from edgepfl.algorithms.pfedla import PFedLAHyperparameters, PFedLAServer
    from edgepfl.config import TrainConfig
    from edgepfl.contract.algorithm import ServerContext
    from edgepfl.models import LayerSpec

    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    server = PFedLAServer(ServerContext(3, LayerSpec.from_model(net), init, TrainConfig(), 0),
                          PFedLAHyperparameters(hn_lr=0.5, embedding_dim=8, hidden_dim=16))
    g = torch.Generator().manual_seed(1)
    for stack in server.models.values():
        if stack.is_floating_point():
            stack.copy_(torch.randn(stack.shape, generator=g))
    before = {k: v.clone() for k, v in server.hn_params.items()}
    bar = server.aggregate_for(0, server.alpha(0))
    stats = {k for k in bar if "running" in k}
    assert stats, "the model needs BatchNorm statistics for this test"
    server.update_hypernetwork(0, {k: (torch.ones_like(v) if k in stats else torch.zeros_like(v))
                                   for k, v in bar.items()})
    for k, v in server.hn_params.items():
        torch.testing.assert_close(v, before[k])
    server.update_hypernetwork(0, {k: torch.ones_like(v) for k, v in bar.items()})
    assert any(not torch.equal(v, before[k]) for k, v in server.hn_params.items())


def test_pfedla_stores_the_trained_models_and_sends_full_models():
    sim = _sim("algorithm.name=pfedla")
    down, up = _record(sim)
    init = sim.trainer.export()
    sim.step()
    for cid, msg in up:
        for k, v in msg.tensors.items():
            assert torch.equal(sim.server.models[k][cid], v)
    # round 1: uniform weights over identical initial models -> the initial model
    torch.testing.assert_close(down[0][0].tensors["fc1.weight"], init["fc1.weight"])


def test_pfedla_defaults_keep_the_method_on():
    hp = get_algorithm("pfedla").hyperparameters()
    assert (hp.embedding_dim, hp.hidden_dim) == (100, 100)  # the public implementation's

    def moved(*hn_lr: str) -> float:
        rows = _sim("algorithm.name=pfedla", *hn_lr, "train.rounds=3").run().metrics
        assert rows[0]["la_weight_dev_max"] < 1e-6  # round 1: every stored model is the init
        return rows[-1]["la_weight_dev_max"]

    # at the public implementation's hn_lr = 5e-3 the weights stay uniform to 1e-4 (pFedLA
    # is then an unweighted average of all models); the default must move them
    assert moved("algorithm.hn_lr=5e-3") < 1e-4
    assert moved() > 2e-3


def test_all_baselines_are_registered():
    assert {"fedbn", "fedbabu", "moon", "fedamp", "fedproto", "pfedla"} <= set(ALGORITHMS)


def test_pfedla_evaluates_the_trained_or_the_aggregated_model_as_asked():
    for mode in ("local", "aggregate"):
        sim = _sim("algorithm.name=pfedla", f"algorithm.evaluate={mode}", "train.rounds=2")
        sim.step()
        sim.step()
        msg = sim.server.eval_message(0)
        personal = sim.client.personal_model(sim.clients.row(0), msg)
        if mode == "local":
            assert msg is None
            want = {k: v[0] for k, v in sim.server.models.items()}  # the uploaded theta_0
            assert set(personal) == set(want)
            assert all(torch.equal(personal[k], want[k]) for k in want)
        else:
            want = sim.server.aggregate_for(0, sim.server.alpha(0))
            assert set(personal) == set(want)
            assert all(torch.equal(personal[k], want[k]) for k in want)
            # the aggregate is not the client's own trained model
            assert any(not torch.equal(personal[k], sim.server.models[k][0]) for k in want)
