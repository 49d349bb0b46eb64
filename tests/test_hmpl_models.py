"""HMPL's SPP layer and tier models (Ord, Com, Sup at each stage) and cnn2_spp."""

import pytest
import torch

from edgepfl.federation.aggregate import ParamIndex
from edgepfl.models import MODELS, VARIABLE_SIZE_MODELS, LayerSpec, build_model
from edgepfl.models.hmpl_nets import (
    BS_LAYERS,
    SPP,
    SUP_MAX_DEPTH,
    HMPLOrd,
    HMPLSup,
    grow_sup,
    layer_role,
    preserving_start,
    spp,
    sup_model_name,
    upsample_to,
)
from edgepfl.system.flops import count_flops

HMPL = ["hmpl_com", "hmpl_ord", "hmpl_sup", "hmpl_sup2"]  # cheapest first
# 28x28 and crops of the paper's aspect ratios (Sec. IV-B: 16:9 ... 9:16), odd sides too
SIZES = [(28, 28), (16, 28), (28, 16), (21, 28), (15, 27)]


def _model(name, seed=0):
    torch.manual_seed(seed)
    return build_model(name, (1, 28, 28), 10)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("size", [*SIZES, (4, 4), (1, 1), (3, 5)])
def test_spp_gives_21_values_per_channel_for_any_map_size(size):
    x = torch.randn(2, 3, *size)
    out = SPP()(x)
    assert out.shape == (2, 21 * 3)
    assert not list(SPP().parameters())
    # channel-major, the 1x1 level first: each channel's 21 bins open with its maximum
    torch.testing.assert_close(out.view(2, 3, 21)[:, :, 0], x.amax(dim=(2, 3)))


def test_spp_levels_are_the_adaptive_max_pools_in_fig5_order():
    x = torch.randn(2, 5, 4, 4)
    per_channel = spp(x).view(2, 5, 21)
    # on a 4x4 map the 4x4 level is the map itself and each 2x2 bin a quadrant's maximum
    torch.testing.assert_close(per_channel[:, :, 5:], x.flatten(2))
    quadrants = x.unfold(2, 2, 2).unfold(3, 2, 2).amax(dim=(-1, -2))
    torch.testing.assert_close(per_channel[:, :, 1:5], quadrants.flatten(2))


def test_spp_of_the_first_channels_is_a_prefix_of_the_features():
    """What lets HeteroFL cut a width-sliced hmpl_ord: the features of the first k
    channels are the first 21 k features."""
    x = torch.randn(2, 6, 7, 5)
    torch.testing.assert_close(spp(x[:, :4]), spp(x)[:, :21 * 4])


def test_ord_model_is_the_papers_mnist_cnn():
    model = _model("hmpl_ord")
    spec = LayerSpec.from_model(model)
    assert spec.names == list(BS_LAYERS)
    convs = [model.conv1, model.conv2, model.conv3]
    assert [c.out_channels for c in convs] == [64, 128, 256]
    assert all(c.kernel_size == (3, 3) for c in convs)
    assert (model.fc1.in_features, model.fc1.out_features, model.fc2.out_features,
            model.fc3.out_features) == (21 * 256, 1024, 1024, 10)


def test_flat_model_is_the_ord_model_with_the_map_flattened_instead_of_spp():
    """Fig. 7's plain FedAvg: the Ord model's layers but for fc1, which reads the 4x4x256
    map of a 28x28 image (4,096 values) rather than SPP's 21 x 256; it equals the Ord model
    wherever fc1 is given the same numbers, so only the pooling differs."""
    flat, ordinary = _model("hmpl_flat"), _model("hmpl_ord")
    assert LayerSpec.from_model(flat).names == list(BS_LAYERS)
    assert flat.fc1.in_features == 256 * 4 * 4
    assert {k: v.shape for k, v in _state(flat).items() if k != "fc1.weight"} == \
        {k: v.shape for k, v in _state(ordinary).items() if k != "fc1.weight"}
    assert "hmpl_flat" not in VARIABLE_SIZE_MODELS
    x = torch.randn(3, 1, 28, 28)
    flat.load_state_dict({k: v for k, v in _state(ordinary).items() if k != "fc1.weight"},
                         strict=False)
    flat_map = ordinary.feature_map(x).flatten(1)
    with torch.no_grad():  # an fc1 that reads each bin of the 4x4 level as flat reads the map
        pick = torch.zeros(256 * 21, 256 * 16)
        for c in range(256):
            pick[c * 21 + 5: c * 21 + 21, c * 16: c * 16 + 16] = torch.eye(16)
        ordinary.fc1.weight.copy_(torch.randn(1024, 256 * 16) @ pick.T)
        flat.fc1.weight.copy_(ordinary.fc1.weight @ pick)
    torch.testing.assert_close(flat(x), ordinary(x))
    assert flat_map.shape == (3, 4096)
    with pytest.raises(Exception, match="needs square images"):
        build_model("hmpl_flat", (1, 16, 28), 10)


@pytest.mark.parametrize("name", [*HMPL, "cnn2_spp"])
def test_every_model_trains_on_every_size(name):
    model = _model(name)
    for size in SIZES:
        model.zero_grad()
        x = torch.randn(2, 1, *size)
        out = model(x)
        assert out.shape == (2, 10), size
        torch.nn.functional.cross_entropy(out, torch.tensor([1, 2])).backward()
        for p_name, p in model.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), (size, p_name)
            assert p.grad.abs().sum() > 0, (size, p_name)


def test_smallest_inputs_each_model_accepts():
    """Ceil-mode pooling: the hmpl models take any map of one pixel or more, cnn2_spp any
    side of 13 or more (its 5x5 convolutions are unpadded, as in cnn2)."""
    x = torch.zeros(1, 1, 1, 2)
    for name in HMPL:
        assert _model(name)(x).shape == (1, 10), name
    model = _model("cnn2_spp")
    assert model(torch.zeros(1, 1, 13, 13)).shape == (1, 10)
    with pytest.raises(RuntimeError):
        model(torch.zeros(1, 1, 12, 28))


@pytest.mark.parametrize("name", HMPL)
def test_channels_last_layout_computes_the_same(name):
    """The engine's skeleton runs channels-last; the odd-size crop of the upsampled map
    must mean the same in that layout."""
    model = _model(name).eval()
    x = torch.randn(2, 1, 21, 27)
    ref = model(x)
    fast = model.to(memory_format=torch.channels_last)
    torch.testing.assert_close(fast(x.contiguous(memory_format=torch.channels_last)), ref,
                               rtol=1e-4, atol=1e-5)


def test_final_feature_maps_are_256_channels_at_the_described_resolutions():
    x = torch.randn(2, 1, 28, 28)
    side = {name: tuple(_model(name).feature_map(x).shape[1:]) for name in HMPL}
    # blocks: 28 -> L1 14 -> L2 7 -> L3 4 (ceil); Com ends at L2, Sup at stage k at L_{3-k}
    assert side == {"hmpl_ord": (256, 4, 4), "hmpl_com": (256, 7, 7),
                    "hmpl_sup": (256, 7, 7), "hmpl_sup2": (256, 14, 14)}


def test_upsampling_is_2x_nearest_cropped_to_the_lateral():
    x = torch.arange(16.0).reshape(1, 1, 4, 4)
    up = upsample_to(x, (7, 8))
    expected = x.repeat_interleave(2, dim=2).repeat_interleave(2, dim=3)[..., :7, :8]
    assert torch.equal(up, expected)


def test_com_is_cheaper_and_sup_dearer_than_ord_at_28x28():
    """Sec. III-C: the Com model cuts computation for weak devices, the Sup model spends
    more on strong ones, and each Sup stage more than the last."""
    flops, params = [], []
    for name in HMPL:
        model = _model(name)

        def step(model=model):
            model(torch.randn(2, 1, 28, 28)).sum().backward()

        flops.append(count_flops(step)[1])
        params.append(sum(p.numel() for p in model.parameters()))
    assert flops == sorted(flops) and len(set(flops)) == len(flops), dict(zip(HMPL, flops, strict=True))
    assert params == sorted(params) and len(set(params)) == len(params), dict(zip(HMPL, params, strict=True))


def test_bs_layers_are_identical_across_tiers_and_personal_layers_are_not():
    states = {name: _state(_model(name)) for name in ["hmpl_ord", "hmpl_com", "hmpl_sup"]}
    ord_shapes = {k: v.shape for k, v in states["hmpl_ord"].items()}
    for name, state in states.items():
        bs = {k: v.shape for k, v in state.items() if layer_role(k) == "bs"}
        expected = {k: s for k, s in ord_shapes.items()
                    if not (name == "hmpl_com" and k.startswith("conv3."))}
        assert bs == expected, name
    index = ParamIndex(states)
    # every layer is one thing: no "<arch>:<name>" keys, so no BS layer was split
    assert all(":" not in key for key in index.keys)
    assert set(index.shared()) == set(ord_shapes)
    assert index.holders("conv3.weight") == ["hmpl_ord", "hmpl_sup"]
    assert index.holders("ip_align.weight") == ["hmpl_com"]
    assert index.holders("ip_lateral2.weight") == ["hmpl_sup"]
    assert index.holders("cp_merge.weight") == ["hmpl_sup"]
    # Com's aligner and Sup's stage-1 lateral are both 1x1 128 -> 256: only their names
    # keep them apart
    assert states["hmpl_com"]["ip_align.weight"].shape == states["hmpl_sup"]["ip_lateral2.weight"].shape


def test_sup_models_of_different_stages_share_the_cp_layer():
    states = {name: _state(_model(name)) for name in ["hmpl_ord", "hmpl_sup", "hmpl_sup2"]}
    index = ParamIndex(states)
    assert index.holders("cp_merge.weight") == ["hmpl_sup", "hmpl_sup2"]
    # ParamIndex sees a lateral of the same shape in two stages as one layer; keeping IP
    # layers local is the algorithm's rule, by layer_role, not ParamIndex's
    assert "ip_lateral2.weight" in index.shared()
    assert layer_role("ip_lateral2.weight") == "ip"


@pytest.mark.parametrize("depth", range(1, SUP_MAX_DEPTH))
def test_growing_a_sup_model_keeps_its_parameters(depth):
    torch.manual_seed(0)
    small = HMPLSup(depth=depth)
    big = HMPLSup(depth=depth + 1)
    small_shapes = {k: v.shape for k, v in small.state_dict().items()}
    big_shapes = {k: v.shape for k, v in big.state_dict().items()}
    assert small_shapes.items() < big_shapes.items()
    new = set(big_shapes) - set(small_shapes)
    assert {layer_role(k) for k in new} == {"ip"}
    grown = grow_sup(small)
    assert grown.depth == depth + 1
    assert LayerSpec.from_model(grown) == LayerSpec.from_model(big)
    grown_state = grown.state_dict()
    for k, v in small.state_dict().items():
        assert torch.equal(grown_state[k], v), k
    # the name the zoo builds each stage under
    built = build_model(sup_model_name(depth + 1), (1, 28, 28), 10)
    assert isinstance(built, HMPLSup) and built.depth == depth + 1


def test_sup_depth_is_checked():
    with pytest.raises(ValueError, match="deepest"):
        grow_sup(HMPLSup(depth=SUP_MAX_DEPTH))
    for bad in (0, SUP_MAX_DEPTH + 1, True, 1.0):
        with pytest.raises(ValueError, match="depth"):
            HMPLSup(depth=bad)
        with pytest.raises(ValueError, match="depth"):
            sup_model_name(bad)
    assert sup_model_name(1) == "hmpl_sup"


@pytest.mark.parametrize("name", HMPL)
def test_layer_role_classifies_every_parameter(name):
    spec = LayerSpec.from_model(_model(name))
    roles = {layer.name: layer_role(layer.name) for layer in spec.layers}
    for layer in spec.layers:
        assert {layer_role(p) for p in layer.params} == {roles[layer.name]}
        assert layer_role(f"{name}:{layer.params[0]}") == roles[layer.name]
    personal = {k: r for k, r in roles.items() if r != "bs"}
    expected = {"hmpl_ord": {}, "hmpl_com": {"ip_align": "ip"},
                "hmpl_sup": {"ip_lateral2": "ip", "cp_merge": "cp"},
                "hmpl_sup2": {"ip_lateral2": "ip", "ip_lateral1": "ip", "cp_merge": "cp"}}
    assert personal == expected[name]


def test_layer_role_refuses_unknown_layers():
    for bad in ("conv4.weight", "head.bias", "spp", "hmpl_sup:lateral2.weight"):
        with pytest.raises(KeyError, match="no layer of the hmpl models"):
            layer_role(bad)


def test_variable_size_models_are_registered():
    assert VARIABLE_SIZE_MODELS <= set(MODELS)
    assert {"cnn2_spp", *HMPL} <= VARIABLE_SIZE_MODELS
    # cnn2_spp keeps cnn2's convolutions, so the two can share them
    a, b = _state(_model("cnn2")), _state(_model("cnn2_spp"))
    assert {k: v.shape for k, v in a.items() if k.startswith("conv")} == \
        {k: v.shape for k, v in b.items() if k.startswith("conv")}


def test_the_tier_models_stage_stays_in_host_memory_when_the_module_moves():
    """The stage is read (int) on every forward: on a GPU that read would wait for the
    device each batch, so the buffer stays on the host while the layers move."""
    from edgepfl.models.hmpl_tiers import HMPLTiers

    model = HMPLTiers().to("meta").to(memory_format=torch.channels_last)
    assert model.stage.device.type == "cpu"
    assert model.fc3.weight.device.type == "meta" and model.conv1.weight.device.type == "meta"
    model.stage.fill_(-1)
    assert model.tier() is model._tiers[-1]
    assert model(torch.empty(2, 1, 28, 28, device="meta")).shape == (2, 10)


def test_fitted_align_is_the_least_squares_1x1_convolution_nearest_conv3_on_the_images():
    from edgepfl.models.hmpl_nets import fitted_align

    torch.manual_seed(0)
    ordinary = {n: p.detach() for n, p in HMPLOrd(1, 10).named_parameters()}
    x = torch.rand(16, 1, 28, 28)
    with torch.no_grad():
        h = x
        for i in (1, 2):  # L2, as the Ord model computes it
            h = torch.nn.functional.conv2d(h, ordinary[f"conv{i}.weight"],
                                           ordinary[f"conv{i}.bias"], padding=1)
            h = torch.nn.functional.max_pool2d(torch.relu(h), 2, ceil_mode=True)
        target = torch.nn.functional.conv2d(h, ordinary["conv3.weight"], ordinary["conv3.bias"],
                                            padding=1)

        def error(start):
            out = torch.nn.functional.conv2d(h, start["ip_align.weight"], start["ip_align.bias"])
            return float(((out - target) ** 2).mean())

        fit = fitted_align(ordinary, [x[:8], x[8:]])  # batches add up to one fit
        assert fit["ip_align.weight"].shape == (256, 128, 1, 1)
        torch.testing.assert_close(fit["ip_align.weight"], fitted_align(ordinary, [x])["ip_align.weight"])
        assert error(fit) < error(preserving_start("ip_align", ordinary)) / 2
        # where conv3 is a 1x1 convolution (centre taps only), the fit computes conv3 itself
        centre = torch.zeros_like(ordinary["conv3.weight"])
        centre[:, :, 1, 1] = ordinary["conv3.weight"][:, :, 1, 1]
        target = torch.nn.functional.conv2d(h, centre, ordinary["conv3.bias"], padding=1)
        exact = fitted_align({**ordinary, "conv3.weight": centre}, [x], ridge=1e-9)
        assert error(exact) < 1e-8 * float((target ** 2).mean())
