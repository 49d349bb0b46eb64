"""LayerSpec: one meaning of "layer" for every algorithm.

KAPC's relation cube is N x L x N, BLS uploads the first Omega layers, DC-PFL aggregates
layers at different frequencies and HMPL aggregates layers by semantics. They only agree
on what a layer is if it is derived once, from the model, in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

# modules that rescale the layer before them rather than transform its input on their own
NORMS = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)


@dataclass(frozen=True)
class Layer:
    name: str
    params: tuple[str, ...]
    numel: int
    norm: bool = False  # a normalisation module (BatchNorm, GroupNorm, LayerNorm)


@dataclass(frozen=True)
class LayerSpec:
    """Ordered layers of a model (input side first) and the parameters each one owns.

    By default a layer is a module that owns parameters directly (weight and bias
    together), in the order the model registers them, which for the models here is the
    order of the forward pass. Buffers (BatchNorm statistics) are listed separately because
    they are state, not trainable parameters, and algorithms treat them differently.
    """

    layers: tuple[Layer, ...]
    buffers: tuple[str, ...] = field(default_factory=tuple)

    @classmethod
    def from_model(cls, model: nn.Module) -> LayerSpec:
        layers = []
        for mod_name, module in model.named_modules():
            own = [n for n, _ in module.named_parameters(recurse=False)]
            if not own:
                continue
            full = tuple(f"{mod_name}.{n}" if mod_name else n for n in own)
            numel = sum(p.numel() for p in module.parameters(recurse=False))
            layers.append(Layer(mod_name or "root", full, numel, isinstance(module, NORMS)))
        buffers = tuple(n for n, _ in model.named_buffers())
        return cls(tuple(layers), buffers)

    def merge_norms(self) -> LayerSpec:
        """The same parameters with every normalisation layer joined to the layer before it.

        A paper that counts "layers" as weight layers, phi(W h), counts a convolution and
        the BatchNorm after it as one (KAPC's ResNet-18 has 21 layers, not the 41
        parameterised modules). The merged layer keeps the weight layer's name, and its
        first parameter is still that layer's weight. A norm with no layer before it
        stays a layer of its own.
        """
        merged: list[Layer] = []
        for layer in self.layers:
            if layer.norm and merged:
                head = merged[-1]
                merged[-1] = Layer(head.name, head.params + layer.params, head.numel + layer.numel,
                                   head.norm)
            else:
                merged.append(layer)
        return LayerSpec(tuple(merged), self.buffers)

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    @property
    def numel(self) -> int:
        return sum(layer.numel for layer in self.layers)

    @property
    def param_names(self) -> list[str]:
        return [p for layer in self.layers for p in layer.params]

    def index(self, layer_name: str) -> int:
        for i, layer in enumerate(self.layers):
            if layer.name == layer_name:
                return i
        raise KeyError(f"no layer {layer_name!r}; layers are {self.names}")

    def layer_of(self, param_name: str) -> int:
        """Index of the layer that owns ``param_name``."""
        for i, layer in enumerate(self.layers):
            if param_name in layer.params:
                return i
        raise KeyError(f"parameter {param_name!r} belongs to no layer")

    def params_of(self, layers: int | str | list[int]) -> list[str]:
        """Parameter names of one layer (by index or name) or of a list of layer indices."""
        if isinstance(layers, str):
            layers = self.index(layers)
        if isinstance(layers, int):
            return list(self.layers[layers].params)
        return [p for i in layers for p in self.layers[i].params]

    def prefix(self, count: int) -> list[str]:
        """Parameter names of the first ``count`` layers (what BLS uploads)."""
        if not 0 <= count <= len(self.layers):
            raise ValueError(f"prefix length {count} outside [0, {len(self.layers)}]")
        return self.params_of(list(range(count)))

    def to_json(self) -> dict:
        return {
            "layers": [{"name": x.name, "params": list(x.params), "numel": x.numel} for x in self.layers],
            "buffers": list(self.buffers),
        }
