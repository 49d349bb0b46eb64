"""Several clients' local training at once (``train.batch_clients``): their SGD steps
batched with ``torch.func.vmap``, each client ending where its own ``fit`` would."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from edgepfl.training.client_data import ClientData
from edgepfl.training.device import host, to_device
from edgepfl.training.pulls import Pull
from edgepfl.training.sgd import FitRequest, GradHook, State, fit_stats, sgd_update


@dataclass
class _Stack:
    """The clients of a ``fit_many``, stacked ``[clients, ...]`` on the device: their
    weights and momentum buffers, their SGD settings (one for all) and each one's
    gradient hook (``pull``: all of them as one, where they are all pulls of one kind)."""

    names: list[str]
    weights: State
    bufs: State | None
    lr: float
    momentum: float
    weight_decay: float
    repeat: int
    hooks: list[GradHook | None]
    pull: Pull | None

    @classmethod
    def of(cls, requests: Sequence[FitRequest], names: list[str], device: torch.device) -> _Stack:
        first = requests[0]
        weights = {n: torch.stack([r.weights[n] for r in requests]).to(device) for n in names}
        # a buffer starts at zero, so its first step is the gradient itself
        bufs = {n: torch.zeros_like(t) for n, t in weights.items()} if first.momentum else None
        hooks = [r.grad_hook for r in requests]
        return cls(names, weights, bufs, first.lr, first.momentum, first.weight_decay,
                   first.repeat, hooks, Pull.stacked(hooks))

    def take(self, rows: torch.Tensor) -> State:
        """The weights of the clients at ``rows`` (a copy)."""
        return {n: self.weights[n][rows] for n in self.names}

    def update(self, members: list[int], rows: torch.Tensor | slice, params: State,
               grads: State) -> None:
        """One SGD step of the clients ``members``, at ``rows`` of the stack, whose weights
        ``params`` had gradients ``grads``: each one's weight decay, hook and momentum as
        in ``fit``, and the stack holds what they step to."""
        whole = len(members) == len(self.hooks)

        def hooks(p, g):
            if self.pull is not None:
                (self.pull if whole else self.pull.rows(rows))(p, g)
                return
            for j, i in enumerate(members):
                if self.hooks[i] is not None:
                    self.hooks[i]([t[j] for t in p], [t[j] for t in g])

        names, bufs = self.names, self.bufs
        p = [params[n] for n in names]
        b = None if bufs is None else [bufs[n] if whole else bufs[n][rows] for n in names]
        b = sgd_update(p, [grads[n] for n in names], self.lr, self.momentum, self.weight_decay,
                       b, hooks)
        with torch.no_grad():
            if not whole:
                for n, t in zip(names, p, strict=True):
                    self.weights[n][rows] = t
                if bufs is not None and b is not None:
                    for n, t in zip(names, b, strict=True):
                        bufs[n][rows] = t

    def advance(self, members: list[int], rows: torch.Tensor | slice, params: State) -> None:
        """After a batch, the moving anchors of the clients ``members`` (``Pull.follow``)
        step towards their weights ``params``, as ``fit`` moves each one's."""
        p = [params[n] for n in self.names]
        if self.pull is not None:
            if self.pull.follow:
                part = self.pull.rows(rows)
                part.advance(p)
                self.pull.put(rows, part)
            return
        for j, i in enumerate(members):
            advance = getattr(self.hooks[i], "advance", None)
            if advance is not None:
                advance([t[j] for t in p])


def _groups(drawn: dict[int, tuple], own: object) -> list[list[int]]:
    """The clients of ``drawn`` by the shape of their next batch (of each of their batches,
    for a step of their own ``own``): a group is one vmapped step, whose batches stack."""
    groups: dict[tuple, list[int]] = {}
    for i, b in drawn.items():
        groups.setdefault(tuple(t.shape for t in b[0]) if own else tuple(b[0].shape),
                          []).append(i)
    return list(groups.values())


class BatchedTraining:
    """``Trainer``'s fits of several clients at once, on the skeleton ``Trainer`` holds."""

    device: torch.device
    model: nn.Module
    buffers: dict[str, torch.Tensor]
    param_names: list[str]
    _loaded: object | None
    run: Callable[[FitRequest], tuple[State, dict[str, float]]]
    # the data set last trained on, kept on the device: (host x, host y, device x, y, norm)
    _resident: tuple | None = None

    def batchable(self, requests: Sequence[FitRequest]) -> bool:
        """Whether ``fit_many`` can batch ``requests``: two or more, each of this model's
        whole state (parameters and buffers: BatchNorm's statistics move per client), one
        learning rate, momentum, weight decay, ``repeat`` and ``step``, and a model whose train mode
        draws no randomness (dropout: vmap's draws are not each client's own)."""
        if len(requests) < 2:
            return False
        if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in self.model.modules()):
            return False
        first = requests[0]
        names = set(self.param_names) | set(self.buffers)
        settings = ("lr", "momentum", "weight_decay", "repeat", "step")
        return all(set(r.weights) == names and all(getattr(r, s) == getattr(first, s)
                                                   for s in settings) for r in requests)

    def fit_many(self, requests: Sequence[FitRequest]) -> list[tuple[State, dict[str, float]]]:
        """``run`` of every request, their SGD steps batched with ``torch.func.vmap``.

        The clients' weights are stacked; at each step the clients whose next batch has one
        shape take one vmapped step together (all of them when their data are alike), and a
        client whose epochs are done drops out. Every client draws its batches from its own
        generator in ``fit``'s order and gets ``fit``'s weight decay, gradient hook and
        momentum, so the weights equal those of one ``run`` after another within float
        tolerance (batched kernels sum in another order) and the stats are ``fit``'s.
        Requests with a step of their own (``FitRequest.step``) take it vmapped on the
        batch groups their ``draw`` yields, grouped by the shapes of all of them, as
        ``fit_steps`` does one client's. Requests ``batchable`` refuses run one after another.
        """
        if not self.batchable(requests):
            return [self.run(r) for r in requests]
        self._loaded = None
        k, names = len(requests), self.param_names
        stack = _Stack.of(requests, names, self.device)
        # buffers (BatchNorm's running statistics) stacked too: the model updates each
        # client's row in place in its forward pass
        held = {n: torch.stack([r.weights[n] for r in requests]).to(self.device)
                for n in self.buffers}
        own = requests[0].step
        step, draw, inputs = self._vmapped(requests)
        batches = [draw(r) for r in requests]
        loss_sum = torch.zeros(k, device=self.device)
        seen, steps = [0] * k, [0] * k
        active = list(range(k))
        while active:
            drawn = {i: b for i in active if (b := next(batches[i], None)) is not None}
            active = list(drawn)
            for members in _groups(drawn, own):
                count = self._group_step(stack, held, members, [drawn[i] for i in members],
                                         step, inputs, loss_sum)
                for i in members:
                    seen[i] += count
                    steps[i] += 1
        if stack.pull is not None:
            # a stacked pull is made only where every hook is a pull (Pull.stacked)
            stack.pull.unstack(cast(list[Pull], stack.hooks))
        return [({**{n: host(stack.weights[n][i]) for n in names},
                  **{n: host(t[i]) for n, t in held.items()}},
                 fit_stats(float(loss_sum[i]), seen[i], steps[i])) for i in range(k)]

    def _vmapped(self, requests: Sequence[FitRequest]) -> tuple[Callable, Callable, Callable]:
        """``fit_many``'s ``(step, draw, inputs)``: the vmapped step, ``fit``'s gradient of
        the cross-entropy or the requests' own, with the batch source that feeds it
        (``_batch_source``, ``_step_source``)."""
        model = self.model
        model.train()

        def loss(params, buffers, x, y):
            return F.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

        own = requests[0].step
        if own is None:
            step = vmap(grad_and_value(loss))
            draw, inputs = self._batch_source(requests)
        else:
            def one(params, buffers, *batches):
                return own(lambda w, x, y: loss(w, buffers, x, y), params, *batches)

            step = vmap(one)
            draw, inputs = self._step_source()
        return step, draw, inputs

    def _group_step(self, stack: _Stack, held: State, members: list[int], drawn: list[tuple],
                    step: Callable, inputs: Callable, loss_sum: torch.Tensor) -> int:
        """One vmapped step (``repeat`` of them) of the clients ``members`` on their batches
        ``drawn``: the stack and the stacked buffers ``held`` hold where they end, their
        losses are added to ``loss_sum``; returns the number of examples per client."""
        whole = len(members) == len(stack.hooks)
        # the whole stack needs no index (nor its copy to the device every step)
        rows = slice(None) if whole else to_device(torch.tensor(members), self.device)
        params = stack.weights if whole else stack.take(rows)
        buffers = held if whole else {n: t[rows] for n, t in held.items()}
        args, count = inputs(drawn)
        for _ in range(stack.repeat):
            grads, losses = step(params, buffers, *args)
            stack.update(members, rows, params, grads)
        stack.advance(members, rows, params)
        if not whole:
            for n, t in buffers.items():
                held[n][rows] = t
        with torch.no_grad():
            loss_sum[rows] += losses * count
        return count

    def _batch_source(self, requests: Sequence[FitRequest]):
        """How ``fit_many`` draws batches: ``draw(request)`` iterates a client's batches
        (each a tuple whose first tensor's shape groups clients), ``inputs(batches)`` makes
        one step's ``(x, y)`` of shape ``[clients, batch, ...]`` on the device.

        Whole images of one data set (the usual case) are gathered from a copy of the data
        set on the device, with each epoch's order sent once per client: the host draws
        the order as ``fit`` does, and nothing else crosses to the GPU during training. A
        copy from host memory per step costs more than the step itself on a GPU, where a
        vmapped step of a small model is a few launches. Crops, several data sets, or a
        data set too large for a quarter of the free GPU memory are gathered on the host.
        """
        def host_inputs(drawn):
            y = to_device(torch.stack([b[1] for b in drawn]), self.device)
            return (to_device(torch.stack([b[0] for b in drawn]), self.device), y), y.shape[1]

        first = requests[0].data
        alike = all(r.data.boxes is None and r.data.x is first.x and r.data.y is first.y
                    for r in requests)
        resident = self._on_device(first) if alike else None
        if resident is None:
            return FitRequest.epochs_of_batches, host_inputs
        xd, yd, norm = resident

        def draw(r: FitRequest) -> Iterator[tuple[torch.Tensor]]:
            for _ in range(r.epochs):
                order = to_device(r.data.order(r.gen), self.device)  # once an epoch
                for start in range(0, order.numel(), r.batch_size):
                    yield (order[start:start + r.batch_size],)

        def inputs(drawn):
            rows = torch.cat([b[0] for b in drawn])
            x = xd.index_select(0, rows)
            x = x if norm is None else norm(x)
            y = yd.index_select(0, rows).view(len(drawn), -1)
            return (x.view(len(drawn), -1, *x.shape[1:]), y), y.shape[1]
        return draw, inputs

    def _step_source(self):
        """``_batch_source`` for requests with a step of their own: each one's ``draw``,
        and a step's inputs as each of its batches stacked over the clients."""
        def inputs(drawn):
            args = tuple(to_device(torch.stack(group), self.device)
                         for group in zip(*(batches for batches, _ in drawn), strict=True))
            return args, drawn[0][1]
        return (lambda r: r.draw(r)), inputs

    def _on_device(self, data: ClientData) -> tuple | None:
        """(x, y, norm) of ``data``'s data set on this trainer's device, copied once and
        kept while clients of that data set train; None where it would not fit."""
        if self.device.type == "cpu":
            return data.x, data.y, data.norm
        held = self._resident
        if held is not None and held[0] is data.x and held[1] is data.y:
            return held[2:]
        self._resident = None  # the last data set's copy goes before another is made
        need = data.x.numel() * data.x.element_size() + data.y.numel() * data.y.element_size()
        if need > torch.cuda.mem_get_info(self.device)[0] / 4:
            return None
        norm = data.norm
        if norm is not None:
            move = getattr(norm, "to", None)
            if move is None:  # a normalisation that cannot move runs on the host
                return None
            norm = move(self.device)
        self._resident = (data.x, data.y, data.x.to(self.device), data.y.to(self.device), norm)
        return self._resident[2:]
