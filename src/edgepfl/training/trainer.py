"""Local training on one module skeleton, shared by every algorithm.

Peers lose most of their time outside the arithmetic: a model object per client, a
DataLoader per client, data re-wrapped every round. Here a client's data is an index
view into the one dataset tensor (``client_data``), and a client's weights are copied
into a single skeleton module before it trains and copied out after.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value
from torch.utils._python_dispatch import _get_current_dispatch_mode

from edgepfl.federation.accounting import counted_once, counter_aside
from edgepfl.training.batched import BatchedTraining
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import host, to_device
from edgepfl.training.evaluation import Evaluation
from edgepfl.training.sgd import (
    FitRequest,
    GradHook,
    LossHook,
    State,
    fit_stats,
    sgd_step,
    sgd_update,
)


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


COMPILE_MODES = ("off", "default", "reduce-overhead", "max-autotune-no-cudagraphs")

PassesFn = Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor],
                    tuple[dict[str, torch.Tensor], torch.Tensor]]


class Trainer(BatchedTraining, Evaluation):
    """One module skeleton that every client's weights pass through: one client's fit
    here, several clients' fits at once (``fit_many``) in ``batched``, evaluation in
    ``evaluation``.

    Convolutional models run in channels-last memory layout: oneDNN's NCHW kernels for
    max pooling and convolution backward are up to twice as slow on CPU for the small
    batches of federated clients (bench/speed/README.md). The layout changes strides only,
    never values' meaning; weights leave the skeleton in the default layout, so messages,
    stores and checkpoints never see it.
    """

    def __init__(self, model: nn.Module, eval_batch_size: int = 1024,
                 channels_last: bool | None = None, device: torch.device | str = "cpu",
                 compile: str = "off"):
        if compile not in COMPILE_MODES:
            raise ValueError(f"compile = {compile!r}; valid: {', '.join(COMPILE_MODES)}")
        self.device = torch.device(device)
        # ``train.compile``: a plain fit's forward, loss and backward as one graph compiled
        # by torch.compile in this mode (``_passes``); "off" = eager
        self.compile = compile
        self._compiled: dict[tuple[str, ...], PassesFn] = {}
        self.channels_last = _has_conv(model) if channels_last is None else channels_last
        model = model.to(self.device)
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.model = model
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.param_names = list(self.params)
        self.state_names = self.param_names + list(self.buffers)
        self.eval_batch_size = eval_batch_size
        self._loaded: object | None = None
        # (FLOPs, the part left out) of a step's hook-free passes per (parameters with
        # gradients, batch shape) and update per (parameters, first step): functions of
        # this skeleton's architecture and those alone, shared by clients (``counted_once``)
        self._step_flops: dict[object, tuple[int, int]] = {}

    # -- weights in and out of the skeleton ---------------------------------------
    def load(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``state`` into the skeleton (a partial state needs ``strict=False``)."""
        if strict:
            missing = [n for n in self.state_names if n not in state]
            if missing:
                raise KeyError(f"model state lacks {missing}")
        with torch.no_grad():
            for name, value in state.items():
                target = self.params.get(name)
                if target is None:
                    target = self.buffers.get(name)
                if target is None:
                    raise KeyError(f"model has no parameter or buffer {name!r}")
                target.copy_(value)
        self._loaded = None

    def export(self, names: Sequence[str] | None = None) -> State:
        names = self.state_names if names is None else names
        return {n: host((self.params[n] if n in self.params else self.buffers[n]).detach())
                for n in names}

    def layout(self, x: torch.Tensor) -> torch.Tensor:
        """A batch on the skeleton's device and in its memory layout (the layout is a no-op
        for one-channel images)."""
        x = to_device(x, self.device)
        if self.channels_last and x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x

    def place(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` (anchors from a message, targets of a loss) on the skeleton's device,
        for a hook that meets them with its parameters; on the CPU, the same tensors."""
        return [to_device(t, self.device) for t in tensors]

    def forget(self) -> None:
        self._loaded = None

    def _passes(self, names: Sequence[str]) -> PassesFn | None:
        """``train.compile``'s step for a plain fit of the parameters ``names``: the
        gradients of the batch's mean cross-entropy and the loss, ``(grads, loss)``, from
        one graph that torch.compile made of the forward, the loss and the backward. None
        where the fit runs eagerly: compile off, a model with dropout (a compiled graph
        draws other random numbers than eager PyTorch, and results are to be equal), or a
        model with buffers (BatchNorm's running statistics are updated in place, which
        ``torch.func.grad`` refuses for tensors the function does not take as inputs). The
        update stays eager (``sgd_update``), so gradient hooks, weight decay and momentum
        are fit's.
        """
        if self.compile == "off":
            return None
        key = tuple(names)
        fn = self._compiled.get(key)
        if fn is None:
            if self.buffers or any(isinstance(m, nn.modules.dropout._DropoutNd)
                                   for m in self.model.modules()):
                return None
            model = self.model
            fixed = {n: p for n, p in self.params.items() if n not in set(names)}

            def loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
                return F.cross_entropy(functional_call(model, {**fixed, **params}, (x,)), y)

            fn = torch.compile(grad_and_value(loss), mode=self.compile, dynamic=False)
            self._compiled[key] = fn
        return fn

    # -- training ----------------------------------------------------------------------
    def fit(self, data: ClientData, epochs: int, batch_size: int, lr: float,
            gen: torch.Generator, momentum: float = 0.0, weight_decay: float = 0.0,
            grad_hook: GradHook | None = None, loss_hook: LossHook | None = None,
            trainable: Sequence[str] | None = None, repeat: int = 1) -> dict[str, float]:
        """SGD on the loaded weights; returns the mean training loss and step count.

        ``grad_hook(params, grads)`` may add terms to the gradients in place (in the order
        of ``trainable``, default all parameters); a hook with an ``advance(params)``
        (``Pull``) is told the weights after each batch. ``loss_hook(model, logits, x, y)``
        returns an extra differentiable loss term. ``repeat`` steps are taken on each batch
        (the last one's loss counts; a batch is one step in the stats).
        """
        self._loaded = None
        self.model.train()
        names = self.param_names if trainable is None else list(trainable)
        params = [self.params[n] for n in names]
        frozen = [p for n, p in self.params.items() if n not in set(names)]
        for p in frozen:
            p.requires_grad_(False)
        loss_sum = torch.zeros((), device=self.device)
        seen = 0
        steps = 0
        step = self._stepper(names, params, batch_size, lr, momentum, weight_decay, grad_hook,
                             loss_hook)
        advance = getattr(grad_hook, "advance", None)
        try:
            with counter_aside():  # drawing batches counts no FLOPs: no dispatch through it
                for _ in range(epochs):
                    for xb, yb in data.batches(batch_size, gen):
                        for _ in range(repeat):
                            xb, yb, loss = step(xb, yb)
                        loss_sum += loss.detach() * yb.numel()
                        if advance is not None:
                            advance(params)
                        seen += yb.numel()
                        steps += 1
        finally:
            for p in frozen:
                p.requires_grad_(True)
            for p in params:
                p.grad = None
        return fit_stats(float(loss_sum), seen, steps)

    def _stepper(self, names: list[str], params: list[torch.Tensor], batch_size: int,
                 lr: float, momentum: float, weight_decay: float, grad_hook: GradHook | None,
                 loss_hook: LossHook | None
                 ) -> Callable[[torch.Tensor, torch.Tensor],
                               tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``fit``'s SGD step, ``step(x, y) -> (x, y, loss)`` with the batch as laid out on
        the device: a closure, so that the momentum buffers and the FLOP meter's keys last
        from one step of a fit to the next. The parameters outside ``names`` must be frozen
        already: the keys name those that get gradients."""
        # A fit's steps differ only in batch shape (and momentum's first step): the FLOP
        # meter counts one step per shape and lets the rest run outside its counter. The
        # forward and backward passes of a step without a loss hook depend on nothing else
        # but which parameters get gradients, and the update without a gradient hook on
        # nothing at all, so those counts are shared across clients; a hook may do work of
        # its own, so the part with a hook keeps its counts to this fit.
        graded = tuple(n for n, p in self.params.items() if p.requires_grad)
        shared = self._step_flops
        passes, passes_store = (("passes", graded), shared) if loss_hook is None else (object(), None)
        update, update_store = (("update", graded), shared) if grad_hook is None else (object(), None)
        compiled = self._passes(names) if loss_hook is None else None
        bufs: list[torch.Tensor] | None = None

        def step(xb: torch.Tensor, yb: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            nonlocal bufs
            with counted_once((passes, tuple(xb.shape)), passes_store):
                xb, yb, grads, loss = self._backward(xb, yb, names, params, compiled,
                                                     batch_size, loss_hook)
            with counted_once((update, bufs is None), update_store):
                if grads is None:
                    bufs = sgd_step(params, lr, momentum, weight_decay, bufs, grad_hook)
                else:
                    bufs = sgd_update(params, [grads[n] for n in names], lr, momentum,
                                      weight_decay, bufs, grad_hook)
            return xb, yb, loss

        return step

    def _backward(self, xb: torch.Tensor, yb: torch.Tensor, names: list[str],
                  params: list[torch.Tensor], compiled: PassesFn | None, batch_size: int,
                  loss_hook: LossHook | None
                  ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None,
                             torch.Tensor]:
        """A step's forward and backward passes: ``(x, y, grads, loss)``, the batch as laid
        out on the device. ``grads`` is None where the eager backward left them in the
        parameters' ``.grad`` (for ``sgd_step``); a compiled graph returns them instead."""
        xb, yb = self.layout(xb), to_device(yb, self.device)
        # the FLOP counter (a dispatch mode) sees eager operators only
        # the full batches only: a short last batch runs eagerly rather than compiling a
        # graph per size (or one of dynamic shape, whose kernels are the slower)
        if (compiled is not None and xb.shape[0] == batch_size
                and _get_current_dispatch_mode() is None):
            grads, loss = compiled({n: p.detach() for n, p in zip(names, params, strict=True)},
                                   xb, yb)
            return xb, yb, grads, loss
        model = self.model
        logits = model(xb)
        loss = F.cross_entropy(logits, yb)
        total = loss if loss_hook is None else loss + loss_hook(model, logits, xb, yb)
        for p in params:
            p.grad = None
        total.backward()
        return xb, yb, None, loss

    def fit_steps(self, request: FitRequest) -> dict[str, float]:
        """``request``'s own steps (``FitRequest.step``) on the loaded weights: for each
        group of batches ``draw`` yields, the step's gradient, applied by ``fit``'s SGD."""
        self._loaded = None
        model, names = self.model, self.param_names
        model.train()
        params = [self.params[n] for n in names]
        buffers = dict(self.buffers)

        def loss(weights, x, y):
            return F.cross_entropy(functional_call(model, (weights, buffers), (x,)), y)

        bufs: list[torch.Tensor] | None = None
        loss_sum = torch.zeros((), device=self.device)
        seen = steps = 0
        assert request.step is not None and request.draw is not None
        for batches, count in request.draw(request):
            batches = tuple(self.layout(b) if i % 2 == 0 else to_device(b, self.device)
                            for i, b in enumerate(batches))  # x1, y1, x2, y2, ...
            grads, value = request.step(loss, {n: p.detach() for n, p in zip(names, params,
                                                                              strict=True)},
                                        *batches)
            bufs = sgd_update(params, [grads[n] for n in names], request.lr, request.momentum,
                              request.weight_decay, bufs, request.grad_hook)
            loss_sum += value.detach() * count
            seen += count
            steps += 1
        return fit_stats(float(loss_sum), seen, steps)

    def run(self, request: FitRequest) -> tuple[State, dict[str, float]]:
        """``request`` trained on this skeleton: the weights it ends with and fit's stats."""
        self.load(request.weights)
        if request.step is not None:
            stats = self.fit_steps(request)
            return self.export(), stats
        stats = self.fit(request.data, request.epochs, request.batch_size, request.lr,
                         request.gen, momentum=request.momentum,
                         weight_decay=request.weight_decay, grad_hook=request.grad_hook,
                         repeat=request.repeat)
        return self.export(), stats
