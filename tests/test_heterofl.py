"""Defining properties of HeteroFL (edgepfl.algorithms.heterofl) and of the width-sliced
submodels it is built on (edgepfl.models.width)."""

import pytest
import torch
import torch.nn.functional as F

from edgepfl.algorithms.heterofl import HeteroFLServer
from edgepfl.engine.simulation import Simulation
from edgepfl.errors import ConfigError
from edgepfl.federation.messages import Message, MessageError
from edgepfl.models import LayerSpec, build_model
from edgepfl.models.width import (
    SLICEABLE,
    check_sliceable,
    embed_state,
    fold_scaler,
    slice_state,
    width,
    width_model,
    width_shapes,
)
from tests.conftest import fast_config, resumed_and_straight, without_wall

HETERO = ["algorithm.name=heterofl", "system.devices=tiers"]
PLAIN = "model.name=cnn_small"  # no BatchNorm: nothing but slicing and the scaler
ALL_ONE = "algorithm.rates={weak=1.0, ordinary=1.0, superior=1.0}"


def _sim(*overrides: str) -> Simulation:
    return Simulation(fast_config(*overrides), progress=False)


INPUT = {"cnn2": (1, 28, 28), "cnn2_bn": (1, 28, 28), "mlp": (1, 28, 28),
         "cnn_cifar": (3, 32, 32), "hmpl_ord": (1, 28, 28), "cnn2_spp": (1, 28, 28)}


# -- the submodel --------------------------------------------------------------------------

@pytest.mark.parametrize("name", SLICEABLE)
@pytest.mark.parametrize("rate", [0.25, 0.3])
def test_a_submodel_is_the_full_model_cut_to_its_leading_channels(name, rate):
    shape = INPUT.get(name, (1, 8, 8))
    torch.manual_seed(0)
    full = build_model(name, shape, 10)
    layers = LayerSpec.from_model(full)
    params = dict(full.named_parameters())
    narrow = width_model(full, layers, rate)
    shapes = width_shapes(layers, {n: p.shape for n, p in params.items()}, rate)
    assert {n: tuple(p.shape) for n, p in narrow.named_parameters()} == shapes
    first, *_, last = [layer.name for layer in layers.layers if params[f"{layer.name}.weight"].dim() > 1]
    assert shapes[f"{first}.weight"][1] == params[f"{first}.weight"].shape[1]  # input whole
    assert shapes[f"{last}.weight"][0] == 10  # every class
    hidden = params[f"{first}.weight"].shape[0]
    assert shapes[f"{first}.weight"][0] == width(rate, hidden) < hidden
    sub = slice_state({n: p.detach() for n, p in params.items()}, shapes)
    narrow.load_state_dict(sub, strict=False)
    # the same submodel written into the full-width module (zeros elsewhere, the scaler
    # folded into the weights) computes the same function: the cut is a true prefix
    full.load_state_dict(embed_state(fold_scaler(sub, layers, rate), {n: p.shape for n, p in params.items()}),
                         strict=False)
    x = torch.randn(4, *shape)
    narrow.train(), full.train()  # batch statistics on both sides (sBN)
    assert torch.allclose(narrow(x), full(x), rtol=1e-4, atol=1e-5)


def test_the_scaler_divides_every_hidden_output_by_the_rate_and_not_the_classifier():
    torch.manual_seed(0)
    full = build_model("cnn_small", (1, 8, 8), 10)
    layers = LayerSpec.from_model(full)
    narrow = width_model(full, layers, 0.25)
    x = torch.randn(3, 1, 8, 8)
    seen = {}
    for name in ("conv1", "fc2"):
        narrow.get_submodule(name).register_forward_hook(
            lambda m, args, out, name=name: seen.__setitem__(name, (args[0], out)))
    narrow(x)
    conv1 = narrow.conv1
    assert torch.allclose(seen["conv1"][1], F.conv2d(x, conv1.weight, conv1.bias, padding=1) / 0.25)
    fc2_in, fc2_out = seen["fc2"]
    assert torch.allclose(fc2_out, F.linear(fc2_in, narrow.fc2.weight, narrow.fc2.bias))


def test_width_rounds_up_and_keeps_one_channel():
    assert width(0.25, 32) == 8
    assert width(0.3, 10) == 3  # 0.3 * 10 is 3.0000000000000004 in binary
    assert width(0.25, 10) == 3
    assert width(0.01, 10) == 1


def test_models_that_cannot_be_sliced_are_refused_by_name():
    check_sliceable("cnn2")
    with pytest.raises(ConfigError, match="cnn2, cnn2_bn"):
        check_sliceable("resnet18")


# -- the federation ------------------------------------------------------------------------

def test_every_client_at_rate_one_is_fedavg_exactly():
    common = [PLAIN, "system.devices=tiers", "train.rounds=2", "train.participation=0.5"]
    fed = _sim("algorithm.name=fedavg", *common)
    fed_result = fed.run()
    het = _sim("algorithm.name=heterofl", ALL_ONE, *common)
    het_result = het.run()
    assert set(het.server.rates) == {1.0}
    assert set(het.server.global_model) == set(fed.server.global_model)
    for name, value in fed.server.global_model.items():
        assert torch.equal(value, het.server.global_model[name]), name
    same = ["acc_mean", "loss", "train_loss", "bytes_up_client"]
    rate = Message(meta={"rate": 1.0}).meta_bytes  # the one thing HeteroFL adds
    for a, b in zip(fed_result.metrics, het_result.metrics, strict=True):
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
        assert b["bytes_down_client"] == a["bytes_down_client"] + 3 * rate  # 3 selected


def test_without_tiers_every_client_has_algorithm_rate():
    sim = _sim("algorithm.name=heterofl", PLAIN, "algorithm.rate=0.5")
    assert sim.server.rates == (0.5,) * 6
    assert sim.federation.tier == (None,) * 6


def _server_and_clients(*extra: str) -> tuple[HeteroFLServer, dict[float, list[int]]]:
    sim = _sim(*HETERO, PLAIN, *extra)
    by_rate: dict[float, list[int]] = {}
    for cid, r in enumerate(sim.server.rates):
        by_rate.setdefault(r, []).append(cid)
    assert sorted(by_rate) == [0.25, 0.5, 1.0]
    return sim, by_rate


def _reply(server, cid, value_of, n):
    """Client ``cid``'s slice of the full tensors ``value_of`` (what its upload holds)."""
    return Message(slice_state(value_of, server.shapes[server.rates[cid]]), {"num_samples": n})


@pytest.mark.parametrize("weighting", ["samples", "clients"])
def test_each_entry_is_the_mean_over_the_replies_whose_slice_covers_it(weighting):
    sim, by_rate = _server_and_clients(f"algorithm.weighting={weighting}")
    server = sim.server
    weak, mid, strong = by_rate[0.25][0], by_rate[0.5][0], by_rate[1.0][0]
    shape = {k: v.shape for k, v in server.global_model.items()}
    filled = {a: {k: torch.full(s, a) for k, s in shape.items()} for a in (1.0, 2.0, 7.0)}
    replies = {weak: _reply(server, weak, filled[1.0], 10),
               mid: _reply(server, mid, filled[2.0], 30),
               strong: _reply(server, strong, filled[7.0], 60)}
    server.aggregate(1, replies)
    w = server.global_model["conv2.weight"]  # full [32, 16, 3, 3]; 0.25: [8, 4], 0.5: [16, 8]
    if weighting == "samples":
        assert w[0, 0, 0, 0] == pytest.approx((10 * 1 + 30 * 2 + 60 * 7) / 100)
        assert w[10, 5, 1, 1] == pytest.approx((30 * 2 + 60 * 7) / 90)
    else:
        assert w[0, 0, 0, 0] == pytest.approx((1 + 2 + 7) / 3)
        assert w[10, 5, 1, 1] == pytest.approx((2 + 7) / 2)
    assert w[7, 3, 2, 2] == w[0, 0, 0, 0]  # last entry of the weak slice
    assert w[8, 3, 0, 0] == w[10, 5, 1, 1]  # one row past it
    assert w[20, 12, 0, 0] == 7.0 and w[16, 0, 0, 0] == 7.0  # only the full model's
    fc2 = server.global_model["fc2.weight"]  # classifier [10, 64]: every class kept
    assert fc2[9, 15] == w[0, 0, 0, 0] and fc2[9, 16] == w[10, 5, 1, 1]


def test_an_entry_no_reply_holds_keeps_its_value_and_no_reply_changes_nothing():
    sim, by_rate = _server_and_clients()
    server = sim.server
    before = {k: v.clone() for k, v in server.global_model.items()}
    server.aggregate(1, {})
    assert all(torch.equal(before[k], v) for k, v in server.global_model.items())
    weak = by_rate[0.25]
    value = {k: v + 1.0 for k, v in before.items()}
    server.aggregate(1, {cid: _reply(server, cid, value, 5) for cid in weak})
    for name, new in server.global_model.items():
        region = tuple(slice(0, n) for n in server.shapes[0.25][name])
        covered = torch.zeros_like(new, dtype=torch.bool)
        covered[region] = True
        assert torch.equal(new[~covered], before[name][~covered]), name
        assert torch.allclose(new[covered], before[name][covered] + 1.0), name
        assert not covered.all() or name == "fc2.bias"  # fc2.bias: the classes, all held


def test_a_quarter_width_client_moves_a_sixteenth_of_the_conv_weights():
    sim, by_rate = _server_and_clients()
    weak, strong = by_rate[0.25][0], by_rate[1.0][0]
    down = sim.server.configure(1, [weak, strong])
    up = {cid: sim.client.update(cid, down[cid].delivered(), {}, sim.train_data[cid],
                                 torch.Generator().manual_seed(cid)).reply
          for cid in (weak, strong)}
    for msgs in (down, up):
        conv2 = [msgs[c].tensors["conv2.weight"] for c in (weak, strong)]
        assert 16 * conv2[0].numel() * conv2[0].element_size() == \
            conv2[1].numel() * conv2[1].element_size()
        ratio = msgs[weak].nbytes / msgs[strong].nbytes
        assert 1 / 16 < ratio < 1 / 12, ratio  # conv1 (input whole) and the classifier: 1/4
    assert set(up[weak].tensors) == set(sim.server.global_model)  # nothing but the slice


def test_the_engine_counts_the_slice_bytes_per_client():
    sim = _sim(*HETERO, PLAIN, "train.rounds=1")
    sim.step()
    rates = torch.tensor(sim.server.rates)
    up = torch.as_tensor(sim.bytes_up, dtype=torch.float64)
    assert (up[rates == 0.25] < up[rates == 1.0].min() / 12).all()
    assert (up[rates == 0.5] < up[rates == 1.0].min() / 3).all()


# -- static BatchNorm ----------------------------------------------------------------------

def test_sbn_sends_no_statistics_and_queries_them_on_the_clients_data():
    sim = _sim(*HETERO, "model.name=cnn_small_bn", "train.rounds=1")
    assert not any("running" in k or "batches" in k for k in sim.server.global_model)
    sim.step()
    server, client = sim.server, sim.client
    cid = server.rates.index(0.25)
    data = sim.train_data[cid]
    down = server.configure(2, [cid])[cid]
    up = client.update(cid, down.delivered(), {}, data, torch.Generator()).reply
    assert set(down.tensors) == set(up.tensors) == set(server.global_model)
    assert {"bn1.weight", "bn1.bias"} <= set(up.tensors)  # the affine part is shared
    sub = slice_state(server.global_model, server.shapes[0.25])
    stats = client.statistics(sub, 0.25, data)
    x = data.x.index_select(0, data.idx)
    assert data.n <= client.trainer.eval_batch_size  # one batch: exact statistics
    conv1 = F.conv2d(x, sub["conv1.weight"], sub["conv1.bias"], padding=1) / 0.25
    assert torch.allclose(stats["bn1.running_mean"], conv1.mean((0, 2, 3)), atol=1e-5)
    assert torch.allclose(stats["bn1.running_var"], conv1.var((0, 2, 3)), rtol=1e-4)
    # the evaluated model: the full-width skeleton in eval mode runs the submodel with them
    model = client.predictive(cid, {}, server.eval_message(cid), data)[""][0]
    assert model["bn1.running_mean"][:4].equal(stats["bn1.running_mean"])
    assert not model["conv1.weight"][4:].any()


# -- settings and messages -----------------------------------------------------------------

@pytest.mark.parametrize("bad", ["algorithm.rates={weak=0.0, ordinary=0.5, superior=1.0}",
                                 "algorithm.rates={weak=0.25, ordinary=1.5, superior=1.0}",
                                 "algorithm.rate=0", "algorithm.rate=1.01"])
def test_rates_outside_zero_to_one_are_refused(bad):
    with pytest.raises(ConfigError, match=r"not a width rate; valid: \(0, 1\]"):
        _sim("algorithm.name=heterofl", bad)


def test_a_tier_without_a_rate_and_a_single_rate_with_tiers_are_refused():
    with pytest.raises(ConfigError, match=r"no rate for device tier\(s\) \['superior'\]"):
        _sim(*HETERO, "algorithm.rates={weak=0.25, ordinary=0.5}")
    with pytest.raises(ConfigError, match="no rate for device tier"):
        _sim(*HETERO, "algorithm.rates={week=0.25, ordinary=0.5, superior=1.0}")
    with pytest.raises(ConfigError, match="set algorithm.rates"):
        _sim(*HETERO, "algorithm.rate=0.5")


def test_a_message_with_a_bad_rate_or_the_wrong_slice_is_refused():
    sim, by_rate = _server_and_clients()
    weak = by_rate[0.25][0]
    msg = sim.server.configure(1, [weak])[weak]
    gen = torch.Generator()
    with pytest.raises(MessageError, match="must be in"):
        sim.client.update(weak, Message(msg.tensors, {"rate": 0.0}), {}, sim.train_data[weak], gen)
    with pytest.raises(MessageError, match="a rate-0.5 model"):
        sim.client.update(weak, Message(msg.tensors, {"rate": 0.5}), {}, sim.train_data[weak], gen)
    strong = by_rate[1.0][0]
    with pytest.raises(MessageError, match="expected torch.float32"):
        sim.server.check_reply(strong, Message(msg.tensors, {"num_samples": 3}))


def test_resumed_run_gives_identical_metrics(tmp_path):
    resumed, straight = resumed_and_straight(tmp_path, *HETERO, "train.participation=0.5")
    assert without_wall(resumed.metrics) == without_wall(straight.metrics)


def test_a_flower_run_equals_the_simulation():
    pytest.importorskip("flwr", reason="the flower extra is part of the dev set-up")
    from edgepfl.engine.flower_local import run_local

    rc = {"dataset.name": "synthetic", "partition.clients": 4, "train.rounds": 2,
          "train.batch_size": 32, "train.local_epochs": 1, "train.lr": 0.05,
          "output.plots": False, "system.count_flops": False, "algorithm.name": "heterofl",
          "system.devices": "tiers"}
    sim = _sim(*(f"{k}={v}" for k, v in rc.items()))
    assert len(set(sim.server.rates)) == 3  # every width crosses Flower's records
    expected = sim.run().metrics
    result = run_local(rc)
    assert len(result.metrics) == len(expected) == 2
    for ours, theirs in zip(result.metrics, expected, strict=True):
        for key in ("acc_mean", "acc_global_mean", "loss", "train_loss", "bytes_up_client",
                    "bytes_down_client"):
            assert ours[key] == theirs[key], (ours["round"], key)
