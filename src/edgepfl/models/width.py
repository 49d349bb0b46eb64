"""Width-sliced submodels (HeteroFL's channel prefixes) of the zoo's chain models.

A model at width rate r keeps the first ceil(r * C) output channels (units) of every hidden
layer; the first layer keeps all its input channels and the classifier all its classes.
Every parameter of the narrow model is then the leading slice of the full one in every
dimension, which is what lets a server average narrow and wide clients entry by entry
(``edgepfl.federation.aggregate.average_width_slices``).

Shapes are derived from the full model's LayerSpec and parameter shapes alone, so a server
that holds no module can cut the slices it sends. That derivation assumes the layers form
a chain (each layer reads the previous layer's output, a fully connected layer after a
convolution reads it flattened channel-major), which holds for the models in ``SLICEABLE``
and is tested for each; any other model is refused rather than guessed at.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping

import torch
from torch import nn

from edgepfl.errors import ConfigError
from edgepfl.models.layers import LayerSpec

Shape = tuple[int, ...]

# Chains of Conv2d / Linear layers, a BatchNorm after some convolutions, flattened
# channel-major before the first fully connected layer (tests/test_heterofl.py checks
# every one: a zero-padded submodel computes exactly what the narrow module computes).
# hmpl_ord and cnn2_spp: their SPP layer is channel-major (edgepfl.models.hmpl_nets.spp), so the
# fully connected layer after it reads the kept channels as a prefix too.
SLICEABLE = ("cnn2", "cnn2_bn", "cnn_cifar", "cnn_small", "cnn_small_bn", "cnn_small_narrow",
             "mlp", "hmpl_ord", "cnn2_spp")

_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d)


def check_sliceable(name: str) -> None:
    if name not in SLICEABLE:
        raise ConfigError(f"model.name = {name!r} cannot be width-sliced (its layers are not a "
                          f"known chain); models that can: {', '.join(SLICEABLE)}")


def check_rate(rate: object, what: str = "rate") -> float:
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate <= 1:
        raise ValueError(f"{what} = {rate!r}; a width rate must be in (0, 1]")
    return float(rate)


def width(rate: float, channels: int) -> int:
    """ceil(rate * channels), at least 1; rounded to 9 digits first so that 0.3 * 10
    (3.0000000000000004 in binary) is 3 channels, not 4."""
    return max(1, math.ceil(round(rate * channels, 9)))


def width_shapes(layers: LayerSpec, full: Mapping[str, torch.Size | Shape],
                 rate: float) -> dict[str, Shape]:
    """The shape of every parameter of the model at width ``rate``, given its full shapes.

    A weight of two or more dimensions is a Conv2d / Linear layer [out, in, ...]: its
    output is cut to ``width(rate, out)`` (the last such layer, the classifier, keeps all
    of it) and its input to the previous layer's cut, times the spatial size when a
    fully connected layer reads a flattened convolution. A one-dimensional weight is a
    normalization layer over the current width.
    """
    rate = check_rate(rate)
    shape = {name: tuple(full[name]) for layer in layers.layers for name in layer.params}
    weighted = [layer for layer in layers.layers if len(shape.get(f"{layer.name}.weight", ())) >= 2]
    if not weighted:
        raise ValueError("the model has no Conv2d or Linear layer to slice")
    last = weighted[-1].name
    out: dict[str, Shape] = {}
    full_w = cut = None  # width of the features entering the next layer: full, kept
    for layer in layers.layers:
        w = shape.get(f"{layer.name}.weight")
        if w is None or any(not p.endswith((".weight", ".bias")) for p in layer.params):
            raise ValueError(f"layer {layer.name!r} ({', '.join(layer.params)}) is neither a "
                             "Conv2d / Linear nor a normalization layer")
        if len(w) >= 2:
            n_out, n_in = w[0], w[1]
            if full_w is None:
                n_in_cut = n_in
            elif n_in == full_w:
                n_in_cut = cut
            elif n_in % full_w == 0:  # a flattened [C, H, W] map: C-major, so a prefix
                n_in_cut = cut * (n_in // full_w)
            else:
                raise ValueError(f"layer {layer.name!r} reads {n_in} features after a layer "
                                 f"of width {full_w}: not a chain")
            n_out_cut = n_out if layer.name == last else width(rate, n_out)
            sizes = {"weight": (n_out_cut, n_in_cut, *w[2:]), "bias": (n_out_cut,)}
            full_w, cut = n_out, n_out_cut
        else:
            if w[0] != full_w:
                raise ValueError(f"normalization layer {layer.name!r} has {w[0]} features "
                                 f"after a layer of width {full_w}")
            sizes = {"weight": (cut,), "bias": (cut,)}
        for p in layer.params:
            out[p] = sizes[p.rsplit(".", 1)[1]]
    return out


def slice_state(full: Mapping[str, torch.Tensor], shapes: Mapping[str, Shape]) -> dict[str, torch.Tensor]:
    """The leading slice of each entry of ``full`` named in ``shapes`` (a contiguous copy:
    what crosses a link is the slice, not a view into the full tensor)."""
    return {name: full[name][tuple(slice(0, n) for n in s)].contiguous()
            for name, s in shapes.items()}


def embed_state(sub: Mapping[str, torch.Tensor],
                full: Mapping[str, torch.Size | Shape]) -> dict[str, torch.Tensor]:
    """``sub`` written into zero tensors of the full shapes (a 0-dim entry is copied).

    The zero rows and columns make the full-width module compute exactly what the narrow
    one does: a hidden unit with zero weights and bias outputs 0 (through ReLU, pooling
    and a BatchNorm whose affine weight and bias are 0), and the next layer's zero
    columns ignore it.
    """
    out = {}
    for name, s in full.items():
        t = sub[name]
        if t.dim() != len(s) or any(a > b for a, b in zip(t.shape, s, strict=True)):
            raise ValueError(f"{name!r} of shape {tuple(t.shape)} is not a slice of {tuple(s)}")
        big = torch.zeros(tuple(s), dtype=t.dtype)
        big[tuple(slice(0, n) for n in t.shape)] = t
        out[name] = big
    return out


def hidden_layers(layers: LayerSpec, shapes: Mapping[str, Shape]) -> list[str]:
    """The Conv2d / Linear layers before the classifier (whose outputs the scaler divides)."""
    weighted = [layer.name for layer in layers.layers
                if len(shapes.get(f"{layer.name}.weight", ())) >= 2]
    return weighted[:-1]


def fold_scaler(sub: Mapping[str, torch.Tensor], layers: LayerSpec,
                rate: float) -> dict[str, torch.Tensor]:
    """``sub`` with the scaler folded into it: each hidden layer's weight and bias divided
    by ``rate``, since (W x + b) / r = (W / r) x + b / r. A module without scaler hooks
    then computes what the submodel with them computes."""
    out = dict(sub)
    if rate == 1:
        return out
    for name in hidden_layers(layers, {k: tuple(v.shape) for k, v in sub.items()}):
        for p in layers.params_of(name):
            out[p] = sub[p] / rate
    return out


def width_model(model: nn.Module, layers: LayerSpec, rate: float, *,
                track_running_stats: bool = False) -> nn.Module:
    """A copy of ``model`` at width ``rate``: every parametric layer rebuilt narrower, and
    a scaler (HeteroFL's 1 / rate on the output of every hidden Conv2d / Linear layer,
    before its normalization) as forward hooks, in training and evaluation alike.

    BatchNorm layers are static (HeteroFL's sBN): by default they track no running
    statistics and always normalize with the batch's; ``track_running_stats=True`` with
    ``momentum=None`` gives the cumulative statistics a query pass collects.
    """
    full = {n: tuple(p.shape) for n, p in model.named_parameters()}
    shapes = width_shapes(layers, full, rate)
    narrow = copy.deepcopy(model)
    for layer in layers.layers:
        old = narrow.get_submodule(layer.name)
        w = shapes[f"{layer.name}.weight"]
        bias = f"{layer.name}.bias" in shapes
        if isinstance(old, nn.Conv2d) and old.groups == 1:
            new: nn.Module = nn.Conv2d(w[1], w[0], old.kernel_size, old.stride, old.padding,
                                       old.dilation, 1, bias, old.padding_mode)
        elif isinstance(old, nn.Linear):
            new = nn.Linear(w[1], w[0], bias)
        elif isinstance(old, _NORMS) and old.affine:
            new = type(old)(w[0], eps=old.eps, momentum=None, affine=True,
                            track_running_stats=track_running_stats)
        else:
            raise ValueError(f"layer {layer.name!r} is a {type(old).__name__}; width slicing "
                             "handles Conv2d (groups = 1), Linear and affine BatchNorm")
        parent, _, child = layer.name.rpartition(".")
        setattr(narrow.get_submodule(parent) if parent else narrow, child, new)
    left = [n for n, m in narrow.named_modules() if isinstance(m, _NORMS)
            and n not in set(layers.names)]
    if left:
        raise ValueError(f"normalization layers without parameters {left} cannot be sliced")
    if rate != 1:
        for name in hidden_layers(layers, shapes):
            narrow.get_submodule(name).register_forward_hook(
                lambda module, args, output, r=rate: output / r)
    return narrow
