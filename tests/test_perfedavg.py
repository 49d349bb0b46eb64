"""Defining properties of Per-FedAvg (edgepfl.algorithms.perfedavg)."""

import torch
import torch.nn.functional as F

from edgepfl.algorithms import ALGORITHMS
from edgepfl.engine.messages import Message
from edgepfl.engine.simulation import Simulation
from tests.conftest import fast_config


def _sim(name: str, *more: str) -> Simulation:
    return Simulation(fast_config(f"algorithm.name={name}", "dataset.fraction=0.4", *more),
                      progress=False)


def test_registered_both_variants():
    assert {"perfedavg", "perfedavg_hf"} <= set(ALGORITHMS)


def test_evaluated_after_one_adaptation_step():
    sim = _sim("perfedavg", "train.rounds=1")
    sim.step()
    cid = 0
    state = sim.clients.row(cid)
    glob = sim.server.eval_message(cid)
    personal = sim.client.personal_model(state, glob)
    # by hand: one SGD step of size alpha on the client's stored adaptation batch
    sim.trainer.load(glob.tensors)
    loss = F.cross_entropy(sim.trainer.model(state["adapt.x"]), state["adapt.y"])
    names = sim.trainer.param_names
    grads = torch.autograd.grad(loss, [sim.trainer.params[n] for n in names])
    for n, g in zip(names, grads, strict=True):
        assert torch.allclose(personal[n], glob.tensors[n] - sim.client.hp.alpha * g, atol=1e-6)
    assert any(not torch.equal(personal[n], glob.tensors[n]) for n in names)


def test_hf_differs_from_fo_only_by_hessian_term():
    fo = _sim("perfedavg", "train.rounds=1")
    hf = _sim("perfedavg_hf", "train.rounds=1")
    for s in (fo, hf):
        s.step()
    a, b = fo.server.global_model, hf.server.global_model
    assert any(not torch.allclose(a[n], b[n]) for n in a)
    # the finite-difference Hessian-vector product is exact on a quadratic f = p^T A p / 2
    client = hf.client
    params = [torch.zeros(4)]
    a = torch.tensor([[2.0, 1.0, 0.0, 0.0], [1.0, 3.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.5],
                      [0.0, 0.0, 0.5, 4.0]])
    client._grads = lambda ps, x, y: [a @ ps[0]]
    w, v = [torch.tensor([0.3, -1.0, 2.0, 0.5])], [torch.tensor([1.0, -2.0, 0.5, 3.0])]
    hv = client._hvp(params, w, v, None, None)
    assert torch.allclose(hv[0], a @ v[0], atol=1e-2)
    assert torch.equal(params[0], w[0])  # weights restored after probing


def test_server_is_fedavg_bytes():
    sim = _sim("perfedavg", "train.rounds=1")
    row = sim.step()
    model_bytes = sum(v.numel() * v.element_size() for v in sim.server.global_model.values())
    assert row["bytes_down"] == 6 * model_bytes
    assert 6 * model_bytes < row["bytes_up"] < 6 * model_bytes + 6 * 40
    assert Message().nbytes == 0
