"""HMPL's three tier models and the SPP layer (Zhang et al., "Device-Performance-Driven
Heterogeneous Multiparty Learning for Arbitrary Images"; Secs. II-B, III-C to III-E, IV-B,
Table II, Figs. 3-5).

* ``SPP``: adaptive max pooling of the last feature map to 1x1, 2x2 and 4x4, flattened and
  concatenated channel by channel: 21 x C features for any input size, no parameters
  (Sec. III-D, Fig. 5).
* ``HMPLOrd`` (Sec. IV-B): three 3x3 convolutions (64, 128, 256), each followed by ReLU
  and 2x2 max pooling; SPP; FC 1024, FC 1024, classifier. Every layer is a BS layer.
* ``HMPLFlat``: the Ord model with the map flattened instead of SPP, the plain FedAvg of
  the regular-size ablation (Sec. IV-D, Fig. 7).
* ``HMPLCom`` (weak devices, Sec. III-C1): the Ord model without ``conv3``; a 1x1 IP
  convolution brings conv2's 128 channels to 256 so that SPP gives the Ord model's 21 x 256
  features and the FC layers keep their shapes (and stay shared).
* ``HMPLSup`` (strong devices, Sec. III-C2): an FPN top-down path over the last pairs of
  block outputs; ``depth`` counts its stages (1: L3 over L2, 2: also over L1). Each stage
  upsamples the map 2x and adds a 1x1 lateral (IP) convolution of the earlier block's
  output; one 3x3 convolution (the CP layer) after the last merge makes the final map.

Roles (Table II, Sec. III-E) are given by the layer's name, ``layer_role``: the Ord
model's layer names are the BS layers, ``ip_*`` the isolated personal layers (kept
local), ``cp_*`` the collaborative personal layer (averaged among Sup models). A BS layer
has the same module path and shape in every tier, so ``ParamIndex`` shares it; IP names
are distinct per purpose, so Com's aligner never meets Sup's laterals.

Growing a Sup model (``grow_sup``) only adds a lateral: the stage-k model's parameters are
a subset, by name and shape, of the stage-(k+1) model's. Choices the paper leaves open
(padding, pooling mode, where L_i is taken, upsampling, activations, what growth adds) are
listed in docs/algorithms.md, "hmpl models".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

SPP_LEVELS = (1, 2, 4)
CHANNELS = (64, 128, 256)  # Sec. IV-B, MNIST / Fashion-MNIST
HIDDEN = 1024
BS_LAYERS = ("conv1", "conv2", "conv3", "fc1", "fc2", "fc3")
# "until all the convolutional layers are considered" (Sec. III-C2): one stage per pair of
# neighbouring blocks, (L3, L2) then (L2, L1)
SUP_MAX_DEPTH = len(CHANNELS) - 1

Role = Literal["bs", "cp", "ip"]


def spp_features(channels: int, levels: tuple[int, ...] = SPP_LEVELS) -> int:
    """Length of the SPP output for a ``channels``-channel map: 21 x channels by default."""
    return channels * sum(n * n for n in levels)


def spp(x: torch.Tensor, levels: tuple[int, ...] = SPP_LEVELS) -> torch.Tensor:
    """[B, C, H, W] -> [B, C * sum(n^2)]: each level's adaptive max pool, coarsest level
    first (Fig. 5's order: 1x1, 2x2, 4x4), concatenated per channel: channel c's
    sum(n^2) bins are features c * sum(n^2) onwards. Channel-major, like a flattened map,
    so that the first k channels are the first features: a width-sliced model (HeteroFL)
    then cuts the next layer's inputs to a prefix. A map smaller than a level (a 3x3 map,
    4x4 bins) is valid: adaptive bins then overlap."""
    return torch.cat([F.adaptive_max_pool2d(x, n).flatten(2) for n in levels], dim=2).flatten(1)


class SPP(nn.Module):
    """The SPP layer as a module (no parameters, so it is no layer of a LayerSpec)."""

    def __init__(self, levels: tuple[int, ...] = SPP_LEVELS):
        super().__init__()
        self.levels = tuple(levels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return spp(x, self.levels)

    def extra_repr(self) -> str:
        return f"levels={self.levels}"


def layer_role(name: str) -> Role:
    """HMPL's role of a layer or parameter of the hmpl models (Table II): ``"bs"``, ``"cp"``
    or ``"ip"``. Accepts a layer name (``"conv1"``), a parameter name (``"conv1.weight"``)
    or a ParamIndex key (``"hmpl_sup:cp_merge.weight"``). An unknown name is an error
    rather than a guess, so a layer added without a role cannot be silently shared."""
    layer = name.rpartition(":")[2].split(".", 1)[0]
    if layer.startswith("ip_"):
        return "ip"
    if layer.startswith("cp_"):
        return "cp"
    if layer in BS_LAYERS:
        return "bs"
    raise KeyError(f"{name!r} is no layer of the hmpl models (BS layers: {', '.join(BS_LAYERS)}; "
                   "personal layers start with 'ip_' or 'cp_')")


def check_depth(depth: int) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= SUP_MAX_DEPTH:
        raise ValueError(f"Sup depth = {depth!r}; it must be an integer in [1, {SUP_MAX_DEPTH}]")
    return depth


def upsample_to(x: torch.Tensor, size: torch.Size | tuple[int, int]) -> torch.Tensor:
    """2x nearest upsampling cropped to ``size``. With ceil-mode pooling a block's output is
    ceil(h / 2) of the one before, so 2x covers it and an odd size is one row or column
    less: the crop keeps every upsampled pixel aligned with the pixels it was pooled from."""
    h, w = size
    return F.interpolate(x, scale_factor=2.0, mode="nearest")[..., :h, :w]


class _HMPLBase(nn.Module):
    """The pieces every tier shares. Layers are registered in forward order (the BS
    convolutions, the personal layers, then the FC layers), because a LayerSpec is in
    registration order and the last layer is the classifier (``classifier_module``)."""

    def _add_convs(self, in_channels: int, count: int) -> None:
        widths = (in_channels, *CHANNELS)
        for i in range(count):
            # padding 1 keeps the size, so only pooling shrinks a map (Sec. IV-B is silent)
            setattr(self, f"conv{i + 1}", nn.Conv2d(widths[i], widths[i + 1], 3, padding=1))

    def _add_head(self, num_classes: int, pool: nn.Module | None = None,
                  features: int = spp_features(CHANNELS[-1])) -> None:
        """SPP (or ``pool``, giving ``features`` values) and the FC layers."""
        self.spp = SPP() if pool is None else pool
        self.fc1 = nn.Linear(features, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.fc3 = nn.Linear(HIDDEN, num_classes)

    def blocks(self, x: torch.Tensor, count: int) -> list[torch.Tensor]:
        """L_1 .. L_count: each block's output after ReLU and 2x2 max pooling. ceil_mode
        keeps an odd border row and lets any map of at least one pixel through three
        poolings (a 16x28 crop: 16 -> 8 -> 4 -> 2)."""
        out = []
        for i in range(count):
            x = torch.relu(getattr(self, f"conv{i + 1}")(x))
            x = F.max_pool2d(x, 2, ceil_mode=True)
            out.append(x)
        return out

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The classifier's input, as in the rest of the zoo (MOON, FedProto read it)."""
        x = self.spp(self.feature_map(x))
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.features(x))


class HMPLOrd(_HMPLBase):
    """The Ord model (Sec. IV-B, Fig. 4a): conv 3x3 64, 128, 256, each with 2x2 max
    pooling; SPP; FC 1024, 1024; classifier. All of its layers are BS layers.
    ``image_size`` is accepted for the zoo's factory signature and ignored: SPP makes the
    model independent of the input size."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self._add_convs(in_channels, 3)
        self._add_head(num_classes)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x, 3)[-1]


class HMPLFlat(_HMPLBase):
    """The Ord model with its last map flattened instead of pooled by SPP: the "traditional
    FedAvg" of Sec. IV-D's regular-size ablation (Fig. 7), beside FedAvg with the SPP layer
    (HMPL_S). Its convolutions are the Ord model's, by name and shape; fc1 reads the
    ceil(s / 8)-square map of an ``image_size``-square input (4 x 4 x 256 at 28), so it
    takes that one size."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self._add_convs(in_channels, 3)
        side = image_size
        for _ in CHANNELS:  # ceil-mode pooling after each block
            side = -(-side // 2)
        self._add_head(num_classes, nn.Flatten(), CHANNELS[-1] * side * side)

    feature_map = HMPLOrd.feature_map


class HMPLCom(_HMPLBase):
    """The Com model (Sec. III-C1, Fig. 4b): the Ord model with the last convolution
    removed; a 1x1 convolution (IP) aligns conv2's 128 channels to the 256 that SPP and
    the shared FC layers expect."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self._add_convs(in_channels, 2)
        self.ip_align = nn.Conv2d(CHANNELS[1], CHANNELS[2], 1)
        self._add_head(num_classes)

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        # ReLU: the shared fc1 reads non-negative pooled maps in the Ord model too
        return torch.relu(self.ip_align(self.blocks(x, 2)[-1]))


class HMPLSup(_HMPLBase):
    """The Sup model (Sec. III-C2, Fig. 4c): the Ord model with an FPN top-down path.

    Stage s (1 <= s <= ``depth``) merges the running map with block L_{3-s}: the map is
    upsampled 2x and added to ``ip_lateral{3-s}`` (a 1x1 convolution of L_{3-s} to 256
    channels). Stage 1 starts from L3, the Ord model's final map. After the last merge, the
    3x3 convolution ``cp_merge`` (the CP layer, one per Sup model, Sec. III-E) makes the
    final map that SPP reads, at L_{3-depth}'s resolution. Growing by one stage adds one
    lateral and nothing else, so ``cp_merge`` and every earlier layer keep their shapes.
    """

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28,
                 depth: int = 1):
        super().__init__()
        self.depth = check_depth(depth)
        self._add_convs(in_channels, 3)
        for level in self.lateral_levels:
            setattr(self, f"ip_lateral{level}", nn.Conv2d(CHANNELS[level - 1], CHANNELS[-1], 1))
        self.cp_merge = nn.Conv2d(CHANNELS[-1], CHANNELS[-1], 3, padding=1)
        self._add_head(num_classes)

    @property
    def lateral_levels(self) -> list[int]:
        """Blocks with a lateral connection, in top-down order: [2], then [2, 1]."""
        return [len(CHANNELS) - s for s in range(1, self.depth + 1)]

    def feature_map(self, x: torch.Tensor) -> torch.Tensor:
        maps = self.blocks(x, 3)
        top = maps[-1]
        for level in self.lateral_levels:
            lateral = getattr(self, f"ip_lateral{level}")(maps[level - 1])
            # FPN: the merge is a plain sum, no activation, before the 3x3 convolution
            top = upsample_to(top, lateral.shape[-2:]) + lateral
        return torch.relu(self.cp_merge(top))

    def extra_repr(self) -> str:
        return f"depth={self.depth}"


def sup_model_name(depth: int) -> str:
    """Zoo name of the Sup model at ``depth``: ``hmpl_sup`` (stage 1), ``hmpl_sup2``, ..."""
    return "hmpl_sup" if check_depth(depth) == 1 else f"hmpl_sup{depth}"


def grow_sup(model: HMPLSup) -> HMPLSup:
    """The Sup model one stage deeper, carrying ``model``'s parameters; the new lateral is
    freshly initialised (from torch's global generator: seed it for a reproducible run).

    A new module rather than one added in place, so that the grown model registers its
    layers in the same order as one built at that depth (its LayerSpec is the same)."""
    if model.depth >= SUP_MAX_DEPTH:
        raise ValueError(f"the Sup model is at its deepest stage ({SUP_MAX_DEPTH}): every "
                         "pair of neighbouring convolutions already has a top-down stage")
    grown = HMPLSup(model.conv1.in_channels, model.fc3.out_features, depth=model.depth + 1)
    loaded = grown.load_state_dict(model.state_dict(), strict=False)
    new = f"ip_lateral{grown.lateral_levels[-1]}."
    if loaded.unexpected_keys or any(not k.startswith(new) for k in loaded.missing_keys):
        raise RuntimeError(f"growing the Sup model did not keep its layers: {loaded}")
    return grown


# the layers a tier adds to the Ord model, and what each is made of
ADDED_LAYERS = ("ip_align", "ip_lateral1", "ip_lateral2", "cp_merge")


def preserving_start(layer: str, ordinary: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The start of ``layer``, a layer a tier adds to the Ord model, under which the new
    model computes what ``ordinary`` (the Ord model's parameters, by name) computes, as
    nearly as its shape allows ("all the personal models are generated by an original
    model", Sec. III-D):

    * ``ip_lateral{1,2}``: zero, so a merge adds nothing to the upsampled map above it;
    * ``cp_merge``: the identity (centre tap 1 on its own channel), so the final map is
      the merged one, which ReLU leaves as it is (it sums non-negative pooled maps);
    * ``ip_align``: conv3 with its 3x3 taps summed into one, and conv3's bias: exactly
      conv3 wherever conv3's window sees one value per channel, the nearest a 1x1
      convolution comes to a 3x3 one without data. Com then differs from Ord by that and
      by pooling: SPP reads conv2's resolution rather than conv3's pooled one.

    A Sup model at generation computes the Ord model's output exactly when every
    upsampled map is twice the one above it with no crop (input sides divisible by 8):
    then each SPP bin of the upsampled map covers whole copies of the original pixels of
    the Ord model's bin. With an odd side the crop moves some bin edges by one pixel."""
    if layer == "ip_align":
        weight, bias = ordinary["conv3.weight"], ordinary["conv3.bias"]
        if weight.shape[-2:] != (3, 3) or weight.shape[:2] != (CHANNELS[2], CHANNELS[1]):
            raise ValueError(f"conv3.weight {tuple(weight.shape)} is not the Ord model's "
                             f"{(CHANNELS[2], CHANNELS[1], 3, 3)}")
        return {"ip_align.weight": weight.detach().sum((2, 3), keepdim=True).clone(),
                "ip_align.bias": bias.detach().clone()}
    if layer in ("ip_lateral1", "ip_lateral2"):
        level = int(layer[-1])
        return {f"{layer}.weight": torch.zeros(CHANNELS[-1], CHANNELS[level - 1], 1, 1),
                f"{layer}.bias": torch.zeros(CHANNELS[-1])}
    if layer == "cp_merge":
        weight = torch.zeros(CHANNELS[-1], CHANNELS[-1], 3, 3)
        weight[:, :, 1, 1] = torch.eye(CHANNELS[-1])
        return {"cp_merge.weight": weight, "cp_merge.bias": torch.zeros(CHANNELS[-1])}
    raise KeyError(f"{layer!r} is no layer a tier adds to the Ord model; those are "
                   f"{', '.join(ADDED_LAYERS)}")


def fitted_align(ordinary: Mapping[str, torch.Tensor], images: list[torch.Tensor],
                 ridge: float = 1e-4) -> dict[str, torch.Tensor]:
    """``ip_align`` fitted on ``images`` (batches of one shape each) to the Ord model in
    ``ordinary``: the 1x1 convolution of L2 (conv1 and conv2 as in the Ord model) whose
    output is nearest, in least squares over every pixel of L2, to conv3's output before
    its ReLU. Without data, ``preserving_start`` can only assume conv3's window sees one
    value per channel; on images the fit is the nearest a 1x1 convolution comes to conv3
    there. ``ridge`` is a share of the mean diagonal of the normal equations added to it, so
    that a channel dead on these images gets a zero weight rather than a singular system."""
    weight, bias = ordinary["conv3.weight"], ordinary["conv3.bias"]
    if weight.shape != (CHANNELS[2], CHANNELS[1], 3, 3):
        raise ValueError(f"conv3.weight {tuple(weight.shape)} is not the Ord model's "
                         f"{(CHANNELS[2], CHANNELS[1], 3, 3)}")
    inputs = CHANNELS[1] + 1  # conv2's channels and a constant for the bias
    gram = torch.zeros(inputs, inputs, dtype=torch.float64)
    cross = torch.zeros(inputs, CHANNELS[2], dtype=torch.float64)
    with torch.no_grad():
        for x in images:
            h = x
            for i in (1, 2):
                h = F.conv2d(h, ordinary[f"conv{i}.weight"], ordinary[f"conv{i}.bias"], padding=1)
                h = F.max_pool2d(torch.relu(h), 2, ceil_mode=True)
            target = F.conv2d(h, weight, bias, padding=1)
            rows = h.permute(0, 2, 3, 1).reshape(-1, CHANNELS[1]).double()
            rows = torch.cat([rows, torch.ones(rows.shape[0], 1, dtype=torch.float64)], 1)
            gram += rows.T @ rows
            cross += rows.T @ target.permute(0, 2, 3, 1).reshape(-1, CHANNELS[2]).double()
    if gram[-1, -1] == 0:
        raise ValueError("fitted_align: no image to fit ip_align on")
    gram += ridge * float(gram.diagonal().mean()) * torch.eye(inputs, dtype=torch.float64)
    solution = torch.linalg.solve(gram, cross).to(weight.dtype)  # [129, 256]
    return {"ip_align.weight": solution[:-1].T.reshape(CHANNELS[2], CHANNELS[1], 1, 1).contiguous(),
            "ip_align.bias": solution[-1].contiguous()}


class CNN2SPP(nn.Module):
    """cnn2's convolutions (two 5x5, 32 and 64 channels, each with 2x2 max pooling) and SPP
    before its FC 512, 128, classifier: the baseline Sec. IV-D builds by "adding the SPP
    layer on the end of the ConV layer", on the repository's default MNIST CNN. Pooling
    in ceil mode, so any side of at least 13 pixels is valid (a floor-mode cnn2 needs 16,
    which a 9:16 crop of 28 can miss)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 5)
        self.conv2 = nn.Conv2d(32, 64, 5)
        self.spp = SPP()
        self.fc1 = nn.Linear(spp_features(64), 512)
        self.fc2 = nn.Linear(512, 128)
        self.fc3 = nn.Linear(128, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(torch.relu(self.conv1(x)), 2, ceil_mode=True)
        x = F.max_pool2d(torch.relu(self.conv2(x)), 2, ceil_mode=True)
        x = torch.relu(self.fc1(self.spp(x)))
        return torch.relu(self.fc2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.features(x))
