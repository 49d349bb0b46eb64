"""Defining properties of pFedMe (edgepfl.algorithms.pfedme)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgepfl.algorithms import ALGORITHMS, get_algorithm
from edgepfl.algorithms.fedavg import FedAvgClient, FedAvgHyperparameters, FedAvgServer
from edgepfl.algorithms.pfedme import PFedMeClient, PFedMeHyperparameters, PFedMeServer
from edgepfl.config import TrainConfig
from edgepfl.contract.algorithm import ClientContext, ServerContext, model_from_state
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message
from edgepfl.models import LayerSpec
from edgepfl.training.client_data import ClientData
from edgepfl.training.trainer import Trainer
from tests.conftest import fast_config, resumed_and_straight, without_wall

# train.lr 0.02: eta lamda = 0.4 (at eta lamda = 1 the local model would land on theta)
SMALL = ["algorithm.name=pfedme", "dataset.fraction=0.4", "algorithm.K=2", "train.lr=0.02"]


def _sim(*more: str) -> Simulation:
    return Simulation(fast_config(*SMALL, *more), progress=False)


def _record_updates(sim: Simulation) -> list[dict]:
    """Per round, client -> (reply, new state) of its update."""
    rounds: list[dict] = []
    update = sim.client.update

    def update_(cid, msg, state, data, gen):
        result = update(cid, msg, state, data, gen)
        rounds[-1][cid] = ({k: v.clone() for k, v in result.reply.tensors.items()},
                           {k: v.clone() for k, v in result.state.items()})
        return result

    configure = sim.server.configure

    def configure_(rnd, selected):
        rounds.append({})
        return configure(rnd, selected)

    sim.client.update = update_
    sim.server.configure = configure_
    return rounds


# -- the parts on a tiny linear model (the paper's strongly convex MLR case), in float64 --

def _linear_parts(server_cls, client_cls, hp, lr=0.05, batch_size=16, epochs=1):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(16, 5)).double()
    init = {k: v.detach().clone() for k, v in net.state_dict().items()}
    train = TrainConfig(lr=lr, batch_size=batch_size, local_epochs=epochs)
    layers = LayerSpec.from_model(net)
    server = server_cls(ServerContext(1, layers, init, train, 0), hp)
    client = client_cls(ClientContext(Trainer(net, channels_last=False), layers, train, 5, 0), hp)
    return server, client


def _data(n=48, seed=1) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 4, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (n,), generator=g)
    return ClientData(x, y, torch.arange(n))


def _one_round(server, client, data):
    msg = server.configure(1, [0])[0].delivered()
    result = client.update(0, msg, {}, data, torch.Generator().manual_seed(3))
    server.aggregate(1, {0: result.reply.delivered()})
    return result


def _distance(a, b) -> float:
    return sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5


def test_registered_with_the_hmpl_defaults():
    assert "pfedme" in ALGORITHMS
    hp = get_algorithm("pfedme").hyperparameters()
    assert (hp.K, hp.beta, hp.lamda, hp.personal_lr) == (5, 1.0, 20.0, 0.01)


def test_one_local_step_is_algorithm_1_by_hand():
    """K inner gradient steps on f(theta; D) + lamda/2 ||theta - w||^2, then
    w <- w - eta lamda (w - theta); the reply is w, the kept personal model theta."""
    hp = PFedMeHyperparameters(lamda=4.0, K=3, personal_lr=0.1, beta=1.0)
    server, client = _linear_parts(PFedMeServer, PFedMeClient, hp, lr=0.05, batch_size=16)
    data = _data(n=16)  # one batch: one local step
    w0 = {k: v.clone() for k, v in server.global_model.items()}
    result = _one_round(server, client, data)

    (xb, yb), = data.batches(16, torch.Generator().manual_seed(3))
    theta = {k: v.clone().requires_grad_(True) for k, v in w0.items()}
    for _ in range(3):
        out = F.linear(xb.flatten(1), theta["1.weight"], theta["1.bias"])
        grads = torch.autograd.grad(F.cross_entropy(out, yb), list(theta.values()))
        with torch.no_grad():
            theta = {k: (v - 0.1 * (g + 4.0 * (v - w0[k]))).requires_grad_(True)
                     for (k, v), g in zip(theta.items(), grads, strict=True)}
    w1 = {k: w0[k] - 0.05 * 4.0 * (w0[k] - theta[k].detach()) for k in w0}
    personal = model_from_state(result.state)
    for k in w0:
        torch.testing.assert_close(personal[k], theta[k].detach())
        torch.testing.assert_close(result.reply.tensors[k], w1[k])
    # the personalized model stays on the client: what is uploaded is w, not theta
    assert _distance(result.reply.tensors, personal) > 1e-3
    assert result.reply.meta == {"num_samples": 16}


def test_large_lamda_with_beta_one_tends_to_fedavg():
    """Moreau envelope gradient lamda (w - theta(w)) -> grad f(w) as lamda -> infinity:
    with one client and beta = 1 the global model after a round tends to FedAvg's, the
    gap shrinking like 1/lamda (personal_lr = 1/lamda: each inner step solves the proximal
    part exactly)."""
    fed_server, fed_client = _linear_parts(FedAvgServer, FedAvgClient, FedAvgHyperparameters())
    data = _data()
    start = {k: v.clone() for k, v in fed_server.global_model.items()}
    _one_round(fed_server, fed_client, data)
    fedavg = fed_server.global_model
    moved = _distance(fedavg, start)
    assert moved > 0.05

    gaps = []
    for lamda in (1e2, 1e3, 1e4):
        hp = PFedMeHyperparameters(lamda=lamda, personal_lr=1 / lamda, K=5, beta=1.0)
        server, client = _linear_parts(PFedMeServer, PFedMeClient, hp)
        _one_round(server, client, data)
        gaps.append(_distance(server.global_model, fedavg))
    assert gaps[0] > 1e-4 * moved  # not trivially equal
    assert gaps[1] < 0.2 * gaps[0] and gaps[2] < 0.2 * gaps[1], gaps
    assert gaps[2] < 1e-3 * moved


def test_server_mix_by_hand():
    hp = PFedMeHyperparameters(beta=0.5)
    server, _ = _linear_parts(PFedMeServer, PFedMeClient, hp)
    g = {k: v.clone() for k, v in server.global_model.items()}
    w1 = {k: torch.randn_like(v) for k, v in g.items()}
    w2 = {k: torch.randn_like(v) for k, v in g.items()}
    replies = {0: Message(w1, {"num_samples": 10}), 3: Message(w2, {"num_samples": 30})}
    server.aggregate(1, replies)
    for k in g:  # sample-weighted mean of the replies, mixed with beta
        torch.testing.assert_close(server.global_model[k],
                                   0.5 * g[k] + 0.5 * (0.25 * w1[k] + 0.75 * w2[k]))
    # beta > 1 extrapolates (the paper's beta = 2 runs)
    server.hp = PFedMeHyperparameters(beta=2.0)
    before = {k: v.clone() for k, v in server.global_model.items()}
    server.aggregate(2, {3: Message(w2, {"num_samples": 30})})
    for k in g:
        torch.testing.assert_close(server.global_model[k], -before[k] + 2 * w2[k])
    # no reply, or none with samples: the state is left as it was
    before = server.global_model
    server.aggregate(3, {})
    server.aggregate(4, {1: Message(w1, {"num_samples": 0})})
    assert server.global_model is before


def test_beta_zero_never_moves_the_global_model():
    sim = _sim("algorithm.beta=0", "train.rounds=2")
    init = {k: v.clone() for k, v in sim.server.global_model.items()}
    updates = _record_updates(sim)
    sim.run()
    assert all(torch.equal(sim.server.global_model[k], v) for k, v in init.items())
    # while the clients did train, against that same global model in both rounds
    reply, _ = updates[1][0]
    assert _distance(reply, init) > 1e-3


def test_personal_model_is_the_one_solved_in_the_latest_training():
    sim = _sim("train.participation=0.5", "train.rounds=2")
    updates = _record_updates(sim)
    sim.step()
    first = {c for c in updates[0]}
    sim.step()
    second = {c for c in updates[1]}
    assert second - first and first - second, "the test needs clients selected once"
    glob = sim.server.global_model
    for cid in range(sim.num_clients):
        personal = sim.client.personal_model(sim.clients.row(cid), sim.server.eval_message(cid))
        if cid in second:
            want = model_from_state(updates[1][cid][1])
        elif cid in first:  # not trained this round: its theta of round 1
            want = model_from_state(updates[0][cid][1])
        else:  # never trained: no theta solved yet, the global model
            want = glob
        assert set(personal) == set(want)
        assert all(torch.equal(personal[k], want[k]) for k in want), cid
    for cid in first & second:  # a previous round's theta would not do
        old = model_from_state(updates[0][cid][1])
        personal = sim.client.personal_model(sim.clients.row(cid), None)
        assert _distance(personal, old) > 1e-4
    some = next(iter(second))
    personal = sim.client.personal_model(sim.clients.row(some), None)
    assert _distance(personal, glob) > 1e-4 and _distance(personal, updates[1][some][0]) > 1e-4


def test_bytes_are_fedavgs_and_theta_is_never_sent():
    sim = _sim("train.rounds=1")
    updates = _record_updates(sim)
    row = sim.step()
    model_bytes = sum(v.numel() * v.element_size() for v in sim.server.global_model.values())
    meta = sum(Message({}, {"num_samples": sim.train_data[c].n}).meta_bytes
               for c in range(sim.num_clients))
    assert row["bytes_down"] == sim.num_clients * model_bytes
    assert row["bytes_up"] == sim.num_clients * model_bytes + meta
    for reply, state in updates[0].values():
        assert _distance(reply, model_from_state(state)) > 1e-3


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match=r"personal_lr < 2 / lamda = 0\.1"):
        _sim("algorithm.personal_lr=0.1")  # lamda = 20: the inner steps diverge
    with pytest.raises(ConfigError, match="beta"):
        _sim("algorithm.beta=-0.5")
    with pytest.raises(ConfigError, match="lamda"):
        _sim("algorithm.lamda=0")
    with pytest.raises(ConfigError, match=r"train.momentum = 0.9 must be 0"):
        _sim("train.momentum=0.9")


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, *SMALL, "train.participation=0.5")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)
