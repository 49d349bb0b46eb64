"""HMPL's tier models in one module (``hmpl_tiers``): the architecture an HMPL federation
is built and evaluated on.

The engine builds one architecture per client, from ``model.name``, before round 1, and
evaluates every client's personal model on it. HMPL decides a client's model after round
1 from its round time (Com, Ord or Sup, Sec. III-C) and grows a Sup model later, so no
one tier model can be that architecture. ``HMPLTiers`` holds the layers of every tier
under their own names (the BS layers once, Com's ``ip_align``, Sup's laterals and
``cp_merge``) and a ``stage`` buffer that says which tier a state is: -1 Com, 0 Ord,
k >= 1 the Sup model at depth k. Its forward *is* that tier's own module (``HMPLCom``,
``HMPLOrd``, ``HMPLSup(depth=k)``) whose layers are this module's layers, so a state
computes here exactly what it computes on its tier's model, with no second copy of the
forward pass to drift. Layers a state's tier does not have are never read.

The BS layers are drawn first, by an ``HMPLOrd`` built as the zoo builds ``hmpl_ord``, so
under one seed they start where ``hmpl_ord``'s do: HMPL on this model and HMPL_S (or
FedAvg) on ``hmpl_ord`` start from the same shared model.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from edgepfl.models.hmpl_nets import SUP_MAX_DEPTH, HMPLCom, HMPLOrd, HMPLSup, sup_model_name

STAGE = "stage"
COM, ORD = -1, 0
STAGES = (COM, ORD, *range(1, SUP_MAX_DEPTH + 1))


def stage_model(stage: int) -> str:
    """Zoo name of the tier model of ``stage``: hmpl_com, hmpl_ord, hmpl_sup, hmpl_sup2."""
    if stage == COM:
        return "hmpl_com"
    if stage == ORD:
        return "hmpl_ord"
    return sup_model_name(stage)


def tier_module(stage: int, in_channels: int, num_classes: int) -> nn.Module:
    """The tier model of ``stage``, as the zoo builds ``stage_model(stage)``; of any image
    size (its SPP takes every size)."""
    if stage == COM:
        return HMPLCom(in_channels, num_classes)
    if stage == ORD:
        return HMPLOrd(in_channels, num_classes)
    return HMPLSup(in_channels, num_classes, depth=check_stage(stage))


def tier_name(stage: int) -> str:
    return "com" if stage == COM else "ord" if stage == ORD else "sup"


@cache
def _tier_entries(stage: int, in_channels: int, num_classes: int) -> tuple[tuple[str, torch.Tensor], ...]:
    with torch.device("meta"):  # names, shapes and dtypes only
        model = tier_module(stage, in_channels, num_classes)
    return tuple((n, p.detach()) for n, p in model.named_parameters())


def tier_params(stage: int, dims: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The tier model's parameters (meta tensors: names, shapes, dtypes) in its order."""
    return dict(_tier_entries(stage, *dims))


def check_stage(stage: object) -> int:
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ValueError(f"HMPL stage {stage!r}; valid: -1 (Com), 0 (Ord), 1..{SUP_MAX_DEPTH} "
                         "(Sup at that depth)")
    return stage


class HMPLTiers(nn.Module):
    """Every HMPL tier in one module; the ``stage`` buffer picks the one that runs."""

    def __init__(self, in_channels: int = 1, num_classes: int = 10, image_size: int = 28):
        super().__init__()
        ordinary = HMPLOrd(in_channels, num_classes)  # first: the seed draws hmpl_ord's BS
        with torch.device("meta"):  # only their structure: their BS layers are replaced
            others = {COM: HMPLCom(in_channels, num_classes),
                      **{k: HMPLSup(in_channels, num_classes, depth=k)
                         for k in range(SUP_MAX_DEPTH, 0, -1)}}
        own = dict(ordinary.named_children())
        extra: dict[str, nn.Module] = {}
        for model in others.values():
            for name, module in model.named_children():
                if name not in own and name not in extra:
                    extra[name] = module.to_empty(device="cpu")
                    extra[name].reset_parameters()
        # registration order is a LayerSpec's order: the classifier (fc3) must come last
        head = list(own).index("spp")
        for name in [*list(own)[:head], *extra, *list(own)[head:]]:
            setattr(self, name, own[name] if name in own else extra[name])
        self.register_buffer(STAGE, torch.tensor(ORD))
        for model in others.values():
            for name, _ in list(model.named_children()):
                setattr(model, name, getattr(self, name))
        # a plain dict, so the tier modules are not registered twice: they are views
        # of this module's layers
        self._tiers: dict[int, nn.Module] = {ORD: ordinary, **others}

    def _apply(self, fn, recurse=True):
        # The stage is read on every forward to pick the tier: it stays in host memory
        # when the module moves to a GPU, so that reading it never waits for the device.
        stage = self._buffers[STAGE]
        out = super()._apply(fn, recurse)
        if stage is not None and stage.device.type == "cpu":
            self._buffers[STAGE] = stage
        return out

    def tier(self) -> nn.Module:
        """The tier module of the current ``stage``."""
        stage = int(self.stage)
        if stage not in self._tiers:
            raise ValueError(f"hmpl_tiers: stage = {stage}; valid: -1 (Com), 0 (Ord), "
                             f"1..{SUP_MAX_DEPTH} (Sup at that depth)")
        return self._tiers[stage]

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.tier().features(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tier()(x)
