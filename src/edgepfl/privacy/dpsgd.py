"""Sample-level DP: DP-SGD (Abadi et al., CCS 2016) in every client's local training.

``PrivateTrainer`` is the engine's trainer when ``privacy.level = "sample"``: the same
skeleton, its ``fit`` replaced by DP-SGD, so a client part that trains through its trainer
(``fit``, ``run``) trains privately without knowing it. One step:

* Poisson sampling: each of the client's n samples joins the step's batch independently
  with probability q = min(1, batch_size / n), drawn from the client's batch generator;
  a step's batch has a random size (empty included). An epoch is ceil(n / batch_size)
  steps, so ``train.local_epochs`` epochs see every sample that many times in expectation.
  Shuffled fixed-size batches, the non-private path, have no accounting the libraries
  implement; Poisson sampling is what ``PoissonSampledDpEvent`` accounts for exactly.
* per-sample gradients of the cross-entropy by ``torch.func`` (``vmap`` of ``grad`` over
  the skeleton through ``functional_call``), each clipped to ``privacy.clip`` in L2 over
  all trained parameters (factor clip / (norm + 1e-6), at most 1, as Opacus);
* their sum plus N(0, (noise_multiplier * clip)^2) per coordinate, divided by the expected
  batch size q n (the fixed denominator, as Opacus does for Poisson batches);
* the run's SGD step on that gradient: weight decay, the algorithm's gradient hook
  (a proximal pull reads the weights and the server's message, not the data) and
  momentum act on the privatized gradient, so they are post-processing.

Each update's steps and rate are counted (``steps``, ``rate``) and reported with the reply
(``accounted``), so that the server accounts each client's epsilon from what it ran.
The noise comes from torch's seeded generator, so that runs reproduce: a simulation's
noise, not a deployment's (one would draw from a cryptographically secure source).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from edgepfl.contract.algorithm import Client, UpdateResult
from edgepfl.federation.accounting import counted_once, counter_aside
from edgepfl.privacy.dp_fedavg import PrivacyError
from edgepfl.training.client_data import ClientData
from edgepfl.training.device import to_device
from edgepfl.training.sgd import FitRequest, GradHook, LossHook, fit_stats, sgd_update
from edgepfl.training.trainer import Trainer

# what a reply's stats carry to the server's accountant
STEPS, RATE = "dp_steps", "dp_rate"


def poisson_plan(n: int, batch_size: int, epochs: int) -> tuple[float, int]:
    """(sampling rate, steps) of ``epochs`` passes of DP-SGD over ``n`` samples."""
    if n <= 0 or epochs <= 0:
        return 0.0, 0
    return min(1.0, batch_size / n), epochs * math.ceil(n / batch_size)


class PrivateTrainer(Trainer):
    """A ``Trainer`` whose ``fit`` is DP-SGD with Poisson sampling (module docstring)."""

    def __init__(self, model: torch.nn.Module, eval_batch_size: int = 1024,
                 channels_last: bool | None = None, device: torch.device | str = "cpu", *,
                 clip: float, noise_multiplier: float):
        super().__init__(model, eval_batch_size, channels_last, device)
        self.clip = clip
        self.noise_multiplier = noise_multiplier
        self.steps = 0
        self.rates: set[float] = set()

    def fit_steps(self, request: FitRequest) -> dict[str, float]:
        raise PrivacyError("privacy.level = 'sample': this algorithm's local step is its own "
                           "(FitRequest.step), not a gradient of per-sample losses that "
                           "DP-SGD can clip; it must not be declared PrivacySupport(sample=True)")

    def fit(self, data: ClientData, epochs: int, batch_size: int, lr: float,
            gen: torch.Generator, momentum: float = 0.0, weight_decay: float = 0.0,
            grad_hook: GradHook | None = None, loss_hook: LossHook | None = None,
            trainable: Sequence[str] | None = None, repeat: int = 1) -> dict[str, float]:
        if repeat != 1:
            # several steps on one Poisson-sampled batch would spend the privacy budget of
            # several batches that the accountant does not see
            raise PrivacyError("privacy.level = 'sample': this algorithm takes several steps "
                               "on each batch, which DP-SGD's accounting of one step per "
                               "sampled batch does not cover; it must not be declared "
                               "PrivacySupport(sample=True)")
        if loss_hook is not None:
            # a loss on more than one sample at a time (a contrastive or prototype term)
            # has no per-sample gradient to clip
            raise PrivacyError("privacy.level = 'sample': this algorithm adds a loss term to "
                               "local training, which DP-SGD's per-sample clipping cannot "
                               "bound; it must not be declared PrivacySupport(sample=True)")
        if data.boxes is not None:
            raise PrivacyError("privacy.level = 'sample' with images of several sizes: a "
                               "Poisson-sampled batch mixes them, and they do not stack into "
                               "one tensor; use images of one size")
        self._loaded = None
        rate, steps = poisson_plan(data.n, batch_size, epochs)
        names = self.param_names if trainable is None else list(trainable)
        params = [self.params[n] for n in names]
        loss_sum, seen = 0.0, 0
        if steps:
            self.rates.add(rate)
            self.steps += steps
            step = self._step(names)
            bufs: list[torch.Tensor] | None = None
            expected = rate * data.n
            key = ("dpsgd", tuple(names))
            self.model.train()
            with counter_aside():
                for _ in range(steps):
                    pos = (torch.rand(data.n, generator=gen) < rate).nonzero().squeeze(1)
                    noise = [torch.randn(p.shape, generator=gen).mul_(
                        self.noise_multiplier * self.clip) for p in params]
                    x, y = data.select(pos)
                    with counted_once((key, tuple(x.shape)), self._step_flops):
                        summed, losses = step(self.layout(x), to_device(y, self.device))
                        grads = torch._foreach_add(summed, self.place(noise))
                        torch._foreach_div_(grads, expected)
                        bufs = sgd_update(params, grads, lr, momentum, weight_decay, bufs,
                                          grad_hook)
                    loss_sum += float(losses)
                    seen += int(pos.numel())
        return fit_stats(loss_sum, seen, steps)

    def _step(self, names: list[str]) -> Callable[[torch.Tensor, torch.Tensor],
                                                  tuple[list[torch.Tensor], torch.Tensor]]:
        """(batch x, y) -> (the sum of its clipped per-sample gradients of ``names``, the
        sum of its losses), at the skeleton's current weights."""
        model, clip = self.model, self.clip
        fixed = {n: t for n, t in {**self.params, **self.buffers}.items() if n not in names}

        def loss(weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor):
            logits = functional_call(model, {**fixed, **weights}, (x.unsqueeze(0),))
            return F.cross_entropy(logits, y.unsqueeze(0))

        per_sample = vmap(grad_and_value(loss), in_dims=(None, 0, 0), randomness="different")

        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
            weights = {n: self.params[n].detach() for n in names}
            if y.numel() == 0:
                return [torch.zeros_like(w) for w in weights.values()], torch.zeros(())
            grads, losses = per_sample(weights, x, y)
            flat = [grads[n].flatten(1) for n in names]
            norms = torch.sqrt(sum(g.pow(2).sum(1) for g in flat))
            factor = (clip / (norms + 1e-6)).clamp(max=1.0)
            return ([torch.einsum("b,b...->...", factor, grads[n]) for n in names],
                    losses.detach().sum())

        return step

    # -- what an update ran -----------------------------------------------------------
    def begin(self) -> None:
        self.steps, self.rates = 0, set()


def accounted(part: Client, run: Callable[[], UpdateResult]) -> UpdateResult:
    """``run()``, a client's update; on a private trainer, its result's stats report the
    DP-SGD steps it ran and their sampling rate (``STEPS``, ``RATE``) for the server's
    accountant. An update that trained without DP-SGD is an error, not a reply."""
    trainer = part.trainer
    if not isinstance(trainer, PrivateTrainer):
        return run()
    trainer.begin()
    result = run()
    if result.stats.get("steps", 0) > 0 and trainer.steps == 0:
        raise PrivacyError(f"privacy.level = 'sample': {type(part).__name__}'s update trained "
                           "without the engine's DP-SGD trainer (a trainer of its own); it "
                           "must not be declared PrivacySupport(sample=True)")
    if len(trainer.rates) > 1:
        raise PrivacyError(f"privacy.level = 'sample': one update of {type(part).__name__} "
                           f"trained at sampling rates {sorted(trainer.rates)}; the accountant "
                           "takes one rate per update (one batch size)")
    stats = {**result.stats, STEPS: float(trainer.steps),
             RATE: float(next(iter(trainer.rates), 0.0))}
    return UpdateResult(result.reply, result.state, stats)
