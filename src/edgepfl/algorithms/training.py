"""Local training and evaluation on one module skeleton, shared by every algorithm.

Peers lose most of their time outside the arithmetic: a model object per client, a
DataLoader per client, data re-wrapped every round. Here a client's data is an index
view into the one dataset tensor, batches are gathered by index, and a client's weights
are copied into a single skeleton module before it trains and copied out after. The
optimizer is a hand-written SGD over ``torch._foreach_*`` so that algorithm-specific
gradient terms (proximal pulls, KAPC's coaching term) are added to the gradient in place
instead of being built as autograd graphs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from edgepfl.data.aspect import cut, shape_groups
from edgepfl.errors import ConfigError
from edgepfl.federation.accounting import counted_once, counter_aside
from edgepfl.federation.aggregate import weighted_average  # noqa: F401 (re-exported)
from edgepfl.models.layers import LayerSpec

State = dict[str, torch.Tensor]
GradHook = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None]
LossHook = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Pull:
    """The gradient of coef/2 ||w - anchor||^2, coef (w - anchor), added in place: the
    proximal pull of FedProx, FedAMP, ClusterFL and KAPC's squared coaching loss. A
    ``GradHook`` like any other; ``fit_many`` applies the pulls of a step's clients as one
    operation on their stacked weights instead of one per client."""

    coef: float
    anchor: Sequence[torch.Tensor]

    def __call__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        diffs = torch._foreach_sub(list(params), list(self.anchor))
        torch._foreach_add_(list(grads), diffs, alpha=self.coef)

    @staticmethod
    def stacked(hooks: Sequence[GradHook | None]) -> Pull | None:
        """The clients' pulls as one on their stacked weights (``[clients, ...]`` anchors),
        elementwise as each client's own, so the same bits; None unless every hook is a
        pull of one coefficient."""
        pulls = [h for h in hooks if isinstance(h, Pull)]
        if len(pulls) != len(hooks) or len({p.coef for p in pulls}) != 1:
            return None
        return Pull(pulls[0].coef, [torch.stack(a) for a in zip(*(p.anchor for p in pulls),
                                                                   strict=True)])

    def rows(self, rows: torch.Tensor) -> Pull:
        """A stacked pull for the clients at ``rows`` alone."""
        return Pull(self.coef, [a[rows] for a in self.anchor])


@dataclass
class ClientData:
    """One client's samples: index view into the shared dataset tensors (no copy).

    With ``boxes`` (``dataset.aspect_ratios``: ``[n, 4]`` int16 top, left, height, width,
    aligned with ``idx``) a sample is its image's crop, cut when a batch is drawn. Samples
    then come in as many shapes as crop sizes and do not stack into one tensor: ``gather``
    refuses, ``buckets`` gives one ``(x, y)`` per shape, and every batch is of one shape.
    With ``norm`` (``x`` holds 8-bit pixels) every batch is normalised as it is cut, so
    a batch is the only float copy of the data there is.
    """

    x: torch.Tensor
    y: torch.Tensor
    idx: torch.Tensor
    boxes: torch.Tensor | None = None
    norm: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.boxes is not None and tuple(self.boxes.shape) != (self.n, 4):
            raise ValueError(f"boxes of shape {tuple(self.boxes.shape)} for {self.n} samples; "
                             f"expected ({self.n}, 4)")

    @property
    def n(self) -> int:
        return int(self.idx.numel())

    def work_shape(self) -> tuple:
        """What a client's local training cost depends on besides its messages: the sample
        count, the classes present (per-class work such as prototypes) and the number of
        samples per crop size (batch shapes). Clients alike in it cost the same FLOPs."""
        classes = tuple(torch.unique(self.y.index_select(0, self.idx)).tolist())
        if self.boxes is None:
            return self.n, classes
        sizes, counts = torch.unique(self.boxes[:, 2:].to(torch.int64), dim=0, return_counts=True)
        return self.n, classes, tuple(zip(map(tuple, sizes.tolist()), counts.tolist(), strict=True))

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.boxes is not None:
            raise ConfigError(
                "this client's images are crops of several sizes (dataset.aspect_ratios), "
                "which do not stack into one tensor, but the algorithm asked for all of its "
                "data as one; an algorithm for such data iterates ClientData.buckets() or "
                "batches(), or declares Algorithm(variable_size=False) to refuse them")
        return self.take(self.idx), self.y.index_select(0, self.idx)

    def take(self, idx: torch.Tensor) -> torch.Tensor:
        """Model inputs of data-set rows ``idx`` (whole images)."""
        x = self.x.index_select(0, idx)
        return x if self.norm is None else self.norm(x)

    def buckets(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Every sample once, as one ``(x, y)`` per input shape in a fixed order (crop
        sizes sorted, samples in index order); whole images: ``gather()`` itself."""
        if self.boxes is None:
            yield self.gather()
            return
        for pos in shape_groups(self.boxes):
            yield self._cut(pos)

    def select(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Model inputs and labels of the client's samples at positions ``pos`` (into
        ``idx``); with crops they must all be of one size."""
        if self.boxes is None:
            idx = self.idx[pos]
            return self.take(idx), self.y.index_select(0, idx)
        if torch.unique(self.boxes[pos, 2:].to(torch.int64), dim=0).shape[0] > 1:
            raise ValueError("select(): the samples are crops of several sizes, which do not "
                             "stack into one batch")
        return self._cut(pos)

    def _cut(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.boxes is not None
        idx = self.idx[pos]
        x = cut(self.x, idx, self.boxes[pos])
        return x if self.norm is None else self.norm(x), self.y.index_select(0, idx)

    def order(self, gen: torch.Generator) -> torch.Tensor:
        """One epoch's shuffle of whole images, as data-set rows drawn with ``gen``:
        ``batches`` cuts it into consecutive runs of ``batch_size``."""
        return self.idx[torch.randperm(self.n, generator=gen)]

    def batches(self, batch_size: int, gen: torch.Generator):
        """One epoch of shuffled mini-batches drawn with ``gen``.

        Crops: the epoch's one shuffle is split by crop size (each size's samples keep their
        shuffled order), each size's run is cut into batches, and the batches' order is
        shuffled with ``gen`` too. Every sample comes once per epoch and every batch holds
        one shape, so nothing is padded or resized; a size's last batch may be short (one
        short batch per crop size and epoch, not one per epoch).
        """
        if self.boxes is None:
            order = self.order(gen)
            for start in range(0, self.n, batch_size):
                bidx = order[start:start + batch_size]
                yield self.take(bidx), self.y.index_select(0, bidx)
            return
        perm = torch.randperm(self.n, generator=gen)
        runs: list[torch.Tensor] = []
        for pos in shape_groups(self.boxes[perm]):
            runs += perm[pos].split(batch_size)
        for k in torch.randperm(len(runs), generator=gen).tolist():
            yield self._cut(runs[k])


TestData = tuple[torch.Tensor, torch.Tensor] | ClientData  # whole images: (x, y) gathered


def eval_parts(test: TestData) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A test split as ``(x, y)`` pieces of one input shape each."""
    return list(test.buckets()) if isinstance(test, ClientData) else [test]


def sample_count(test: TestData) -> int:
    return test.n if isinstance(test, ClientData) else int(test[1].numel())


class FeatureTap:
    """The input of a model's classifier in its latest forward pass, i.e. its features.

    A loss on the features (MOON's projection, FedProto's prototype distance) can read
    them from the forward that computed the logits instead of running the body twice: a
    second pass costs a third of a training step and, on a BatchNorm model, updates the
    running statistics twice per batch.
    """

    def __init__(self) -> None:
        self._value: torch.Tensor | None = None

    def _keep(self, module: nn.Module, args: tuple) -> None:
        self._value = args[0]

    def take(self) -> torch.Tensor:
        value, self._value = self._value, None
        if value is None:
            raise RuntimeError("the model's forward did not pass through its classifier")
        return value


def classifier_module(layers: LayerSpec) -> str:
    """Module name of a model's last layer, whose input is its ``features`` in our zoo."""
    return layers.names[-1]


@contextmanager
def tap_features(model: nn.Module, classifier: str) -> Iterator[FeatureTap]:
    """A FeatureTap on ``model``'s submodule ``classifier`` (e.g. "fc3") while in use."""
    tap = FeatureTap()
    handle = model.get_submodule(classifier).register_forward_pre_hook(tap._keep)
    try:
        yield tap
    finally:
        handle.remove()


def host(t: torch.Tensor) -> torch.Tensor:
    """A private, contiguous CPU copy of ``t`` (from any device, in any memory layout)."""
    if t.device.type == "cpu":
        return t.clone(memory_format=torch.contiguous_format)
    return t.to("cpu", memory_format=torch.contiguous_format)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, queued without waiting for the GPU.

    A CUDA copy from pageable host memory first waits until every kernel already queued
    has run (CUDA's "API synchronization behavior"): one such copy per batch would leave a
    launch-bound GPU idle while the host gathers the next batch. Staged in pinned memory,
    the copy is queued like a kernel; PyTorch's caching host allocator keeps the pinned
    block until the copy is done. Anywhere else it is ``t.to(device)``.
    """
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)


def select_device(setting: str) -> torch.device:
    """``train.device``: ``auto`` is CUDA when PyTorch sees a GPU, else the CPU."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"train.device = 'cuda', but PyTorch {torch.__version__} sees no CUDA GPU (a CPU "
            f"build, or no driver); valid here: 'cpu' or 'auto' (the GPU when there is one)")
    if setting not in ("cpu", "cuda"):
        raise ConfigError(f"train.device = {setting!r}; valid: 'auto', 'cpu', 'cuda'")
    device = torch.device(setting)
    if device.type == "cuda":
        # cuDNN's default TF32 convolutions round inputs to 10 mantissa bits: after two
        # rounds of SGD a MOON run's accuracy moved 3 points from the CPU's; in float32
        # every algorithm lands within 1e-5 of it (bench/README.md, "On a GPU")
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    return device


def server_device(setting: str) -> torch.device:
    """Where a server forms what it computes in bulk (KAPC's Gram matrices): the GPU when
    ``train.device`` allows it and this process has one (a Flower ServerApp may not)."""
    return torch.device("cuda" if setting != "cpu" and torch.cuda.is_available() else "cpu")


def _has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


@torch.no_grad()
def sgd_step(params: Sequence[torch.Tensor], lr: float, momentum: float, weight_decay: float,
             bufs: list[torch.Tensor] | None, grad_hook: GradHook | None = None
             ) -> list[torch.Tensor] | None:
    """One step of plain SGD on ``params``' gradients (a missing one counts as zero), with
    weight decay, ``grad_hook``'s in-place terms and heavy-ball momentum; returns the
    momentum buffers to pass to the next step (None without momentum)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    return sgd_update(params, grads, lr, momentum, weight_decay, bufs, grad_hook)


@torch.no_grad()
def sgd_update(params: Sequence[torch.Tensor], grads: list[torch.Tensor], lr: float,
               momentum: float, weight_decay: float, bufs: list[torch.Tensor] | None,
               grad_hook: GradHook | None = None) -> list[torch.Tensor] | None:
    """``sgd_step`` with the gradients given (changed in place)."""
    if weight_decay:
        torch._foreach_add_(grads, params, alpha=weight_decay)
    if grad_hook is not None:
        grad_hook(params, grads)
    if momentum:
        if bufs is None:
            bufs = [g.clone() for g in grads]
        else:
            torch._foreach_mul_(bufs, momentum)
            torch._foreach_add_(bufs, grads)
        grads = bufs
    torch._foreach_add_(params, grads, alpha=-lr)
    return bufs


@dataclass
class FitRequest:
    """One client's local training as data: the weights it starts from and ``Trainer.fit``'s
    arguments. A client part that states its training this way (``Client.fit_request``)
    lets the engine train a step's clients together (``train.batch_clients``)."""

    weights: Mapping[str, torch.Tensor]
    data: ClientData
    epochs: int
    batch_size: int
    lr: float
    gen: torch.Generator
    momentum: float = 0.0
    weight_decay: float = 0.0
    grad_hook: GradHook | None = None

    def epochs_of_batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches ``fit`` draws, in its order, from the request's own generator."""
        for _ in range(self.epochs):
            yield from self.data.batches(self.batch_size, self.gen)


def fit_stats(loss_sum: float, seen: int, steps: int) -> dict[str, float]:
    """What a fit returns: the mean training loss over its samples, its steps and samples."""
    return {"train_loss": loss_sum / max(seen, 1), "steps": float(steps), "samples": float(seen)}


class Trainer:
    """One module skeleton that every client's weights pass through.

    Convolutional models run in channels-last memory layout: oneDNN's NCHW kernels for
    max pooling and convolution backward are up to twice as slow on CPU for the small
    batches of federated clients (bench/README.md). The layout changes strides only,
    never values' meaning; weights leave the skeleton in the default layout, so messages,
    stores and checkpoints never see it.
    """

    def __init__(self, model: nn.Module, eval_batch_size: int = 1024,
                 channels_last: bool | None = None, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
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
        self._resident: tuple | None = None  # (host x, host y, device x, y, norm)

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
        return {n: host((self.params.get(n) if n in self.params else self.buffers[n]).detach())
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

    # -- training ----------------------------------------------------------------------
    def fit(self, data: ClientData, epochs: int, batch_size: int, lr: float,
            gen: torch.Generator, momentum: float = 0.0, weight_decay: float = 0.0,
            grad_hook: GradHook | None = None, loss_hook: LossHook | None = None,
            trainable: Sequence[str] | None = None) -> dict[str, float]:
        """SGD on the loaded weights; returns the mean training loss and step count.

        ``grad_hook(params, grads)`` may add terms to the gradients in place (in the order
        of ``trainable``, default all parameters); ``loss_hook(model, logits, x, y)``
        returns an extra differentiable loss term.
        """
        self._loaded = None
        model = self.model
        model.train()
        names = self.param_names if trainable is None else list(trainable)
        params = [self.params[n] for n in names]
        frozen = [p for n, p in self.params.items() if n not in set(names)]
        for p in frozen:
            p.requires_grad_(False)
        bufs: list[torch.Tensor] | None = None
        loss_sum = torch.zeros((), device=self.device)
        seen = 0
        steps = 0
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
        try:
            with counter_aside():  # drawing batches counts no FLOPs: no dispatch through it
                for _ in range(epochs):
                    for xb, yb in data.batches(batch_size, gen):
                        with counted_once((passes, tuple(xb.shape)), passes_store):
                            xb, yb = self.layout(xb), to_device(yb, self.device)
                            logits = model(xb)
                            loss = F.cross_entropy(logits, yb)
                            total = (loss if loss_hook is None
                                     else loss + loss_hook(model, logits, xb, yb))
                            for p in params:
                                p.grad = None
                            total.backward()
                            loss_sum += loss.detach() * yb.numel()
                        with counted_once((update, bufs is None), update_store):
                            bufs = sgd_step(params, lr, momentum, weight_decay, bufs, grad_hook)
                        seen += yb.numel()
                        steps += 1
        finally:
            for p in frozen:
                p.requires_grad_(True)
            for p in params:
                p.grad = None
        return fit_stats(float(loss_sum), seen, steps)

    def run(self, request: FitRequest) -> tuple[State, dict[str, float]]:
        """``request`` trained on this skeleton: the weights it ends with and fit's stats."""
        self.load(request.weights)
        stats = self.fit(request.data, request.epochs, request.batch_size, request.lr,
                         request.gen, momentum=request.momentum,
                         weight_decay=request.weight_decay, grad_hook=request.grad_hook)
        return self.export(), stats

    def batchable(self, requests: Sequence[FitRequest]) -> bool:
        """Whether ``fit_many`` can batch ``requests``: two or more, of this model's
        parameters, one learning rate, momentum and weight decay, and a model whose train
        mode keeps no per-client buffers or randomness (BatchNorm's statistics, dropout)."""
        if len(requests) < 2 or self.buffers:
            return False
        if any(isinstance(m, nn.modules.dropout._DropoutNd) for m in self.model.modules()):
            return False
        first = requests[0]
        names = set(self.param_names)
        return all(set(r.weights) == names and (r.lr, r.momentum, r.weight_decay)
                   == (first.lr, first.momentum, first.weight_decay) for r in requests)

    def fit_many(self, requests: Sequence[FitRequest]) -> list[tuple[State, dict[str, float]]]:
        """``run`` of every request, their SGD steps batched with ``torch.func.vmap``.

        The clients' weights are stacked; at each step the clients whose next batch has one
        shape take one vmapped step together (all of them when their data are alike), and a
        client whose epochs are done drops out. Every client draws its batches from its own
        generator in ``fit``'s order and gets ``fit``'s weight decay, gradient hook and
        momentum, so the weights equal those of one ``run`` after another within float
        tolerance (batched kernels sum in another order) and the stats are ``fit``'s.
        Requests ``batchable`` refuses run one after another.
        """
        if not self.batchable(requests):
            return [self.run(r) for r in requests]
        self._loaded = None
        first, k, names = requests[0], len(requests), self.param_names
        lr, momentum, weight_decay = first.lr, first.momentum, first.weight_decay
        stacked = {n: torch.stack([r.weights[n] for r in requests]).to(self.device)
                   for n in names}
        bufs = {n: torch.zeros_like(t) for n, t in stacked.items()} if momentum else None
        model = self.model
        model.train()

        def loss(params, x, y):
            return F.cross_entropy(functional_call(model, params, (x,)), y)

        step = vmap(grad_and_value(loss))
        draw, inputs = self._batch_source(requests)
        pull = Pull.stacked([r.grad_hook for r in requests])
        batches = [draw(r) for r in requests]
        loss_sum = torch.zeros(k, device=self.device)
        seen, steps = [0] * k, [0] * k
        active = list(range(k))
        while active:
            drawn = {i: b for i in active if (b := next(batches[i], None)) is not None}
            active = list(drawn)
            groups: dict[tuple, list[int]] = {}
            for i, b in drawn.items():
                groups.setdefault(tuple(b[0].shape), []).append(i)
            for members in groups.values():
                whole = len(members) == k
                # the whole stack needs no index (nor its copy to the device every step)
                rows = slice(None) if whole else to_device(torch.tensor(members), self.device)
                params = stacked if whole else {n: stacked[n][rows] for n in names}
                x, y = inputs([drawn[i] for i in members])
                grads, losses = step(params, x, y)

                def hooks(p, g, members=members, whole=whole, rows=rows):
                    if pull is not None:
                        (pull if whole else pull.rows(rows))(p, g)
                        return
                    for j, i in enumerate(members):
                        if requests[i].grad_hook is not None:
                            requests[i].grad_hook([t[j] for t in p], [t[j] for t in g])

                p = [params[n] for n in names]
                # a buffer starts at zero, so its first step is the gradient itself
                b = None if bufs is None else [bufs[n] if whole else bufs[n][rows] for n in names]
                b = sgd_update(p, [grads[n] for n in names], lr, momentum, weight_decay, b,
                               hooks)
                with torch.no_grad():
                    if not whole:
                        for n, t in zip(names, p, strict=True):
                            stacked[n][rows] = t
                        if bufs is not None and b is not None:
                            for n, t in zip(names, b, strict=True):
                                bufs[n][rows] = t
                    loss_sum[rows] += losses * y.shape[1]
                for i in members:
                    seen[i] += int(y.shape[1])
                    steps[i] += 1
        return [({n: host(stacked[n][i]) for n in names},
                 fit_stats(float(loss_sum[i]), seen[i], steps[i])) for i in range(k)]

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
            return (to_device(torch.stack([b[0] for b in drawn]), self.device),
                    to_device(torch.stack([b[1] for b in drawn]), self.device))

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
            return (x.view(len(drawn), -1, *x.shape[1:]),
                    yd.index_select(0, rows).view(len(drawn), -1))
        return draw, inputs

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
            if not hasattr(norm, "to"):  # a normalisation that cannot move runs on the host
                return None
            norm = norm.to(self.device)
        self._resident = (data.x, data.y, data.x.to(self.device), data.y.to(self.device), norm)
        return self._resident[2:]

    # -- evaluation -------------------------------------------------------------------
    @torch.inference_mode()
    def evaluate(self, state: Mapping[str, torch.Tensor], x: torch.Tensor,
                 y: torch.Tensor) -> tuple[int, float]:
        """(correct predictions, summed cross-entropy) of ``state`` on ``(x, y)``.

        Loading is skipped when the same state object was just evaluated, which makes
        evaluating one global model on N clients cost one copy instead of N. Call
        ``forget()`` before an evaluation pass if states may have changed in place.
        """
        if self._loaded is not state:
            self.load(state)
            self._loaded = state  # a held reference, so identity cannot be recycled
        self.model.eval()
        # summed on the device (in float64, as Python's floats would), read once: reading
        # per batch would wait for the GPU every batch
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for start in range(0, y.numel(), self.eval_batch_size):
            xb = self.layout(x[start:start + self.eval_batch_size])
            yb = to_device(y[start:start + self.eval_batch_size], self.device)
            logits = self.model(xb)
            correct += (logits.argmax(1) == yb).sum()
            loss += F.cross_entropy(logits, yb, reduction="sum").double()
        return int(correct), float(loss)

    @torch.inference_mode()
    def evaluate_predictive(self, states: Sequence[Mapping[str, torch.Tensor]], x: torch.Tensor,
                            y: torch.Tensor) -> tuple[int, float]:
        """(correct, summed negative log-likelihood) of the Monte Carlo predictive
        ``mean_s softmax(f(x; states[s]))``; one state is ``evaluate`` itself."""
        if len(states) == 1:
            return self.evaluate(states[0], x, y)
        self._loaded = None
        self.model.eval()
        probs = torch.zeros(y.numel(), 0, device=self.device)
        for state in states:
            self.load(state)
            chunks = [torch.softmax(self.model(self.layout(x[s:s + self.eval_batch_size])), 1)
                      for s in range(0, y.numel(), self.eval_batch_size)]
            p = torch.cat(chunks) if chunks else torch.zeros(0, 0, device=self.device)
            probs = p if probs.numel() == 0 else probs + p
        self._loaded = None
        probs = (probs / len(states)).cpu()
        correct = int((probs.argmax(1) == y).sum())
        picked = probs.gather(1, y.view(-1, 1)).clamp_min(1e-12)
        return correct, float(-picked.log().sum())


