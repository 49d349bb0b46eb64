"""torch.compile of a local SGD step on the CPU, which part and which mode, against eager.

One client's steps of ``cnn2`` at batch 10 (PFLlib's MNIST setting), one thread. Variants:
eager in channels-last (the engine's layout) and NCHW; the module compiled (its forward
and, through AOTAutograd, its backward; the loss, ``backward()`` call and update eager);
the whole step compiled as one graph (``torch.func.grad_and_value`` of the loss, what
``train.compile`` does), in the modes ``default`` and ``max-autotune-no-cudagraphs``, and
``default`` with Inductor's C++ wrapper (``cpp_wrapper``: the graph's calls made from C++
instead of Python). Every variant starts from the same weights and sees the same batches;
the script prints each one's largest weight difference from eager after the steps, its
first call (the compile), then times all of them in turn, ``--repeats`` times, in the
thread's CPU time, and prints the medians and ratios against eager channels-last.

    python bench/speed/compile_step.py [--steps 60] [--repeats 7] [--batch 10]

Record results in bench/speed/README.md and bench/LOG.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch._inductor.config as inductor
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value

from edgepfl.models import build_model

LR = 0.005


def eager_fit(model, batches):
    params = list(model.parameters())
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        for p in params:
            p.grad = None
        loss.backward()
        with torch.no_grad():
            torch._foreach_add_(params, [p.grad for p in params], alpha=-LR)


def whole_step(model, mode: str, cpp_wrapper: bool = False):
    """A fit whose steps are one compiled graph each: gradients and loss, then the update.
    (Two definitions of the loss: a graph dynamo compiled for one code object would be
    reused for another model under the other Inductor setting.)"""
    if cpp_wrapper:
        def loss(p, x, y):
            return F.cross_entropy(functional_call(model, p, (x,)), y)
    else:
        def loss(p, x, y):
            return F.cross_entropy(functional_call(model, p, (x,)), y)

    passes = torch.compile(grad_and_value(loss), mode=mode, dynamic=False)
    params = dict(model.named_parameters())

    def fit(batches):
        for x, y in batches:
            grads, _ = passes({n: p.detach() for n, p in params.items()}, x, y)
            with torch.no_grad():
                torch._foreach_add_(list(params.values()), [grads[n] for n in params], alpha=-LR)
    return fit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--batch", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = build_model("cnn2", (1, 28, 28), 10)
    xs = [torch.randn(args.batch, 1, 28, 28) for _ in range(args.steps)]
    ys = [torch.randint(0, 10, (args.batch,)) for _ in range(args.steps)]
    batches = {fmt: [(x.contiguous(memory_format=fmt), y) for x, y in zip(xs, ys, strict=True)]
               for fmt in (torch.channels_last, torch.contiguous_format)}
    cl = batches[torch.channels_last]

    def model(fmt=torch.channels_last):
        return copy.deepcopy(base).to(memory_format=fmt)

    variants = {}  # name: (model, fit over batches)
    m = model()
    variants["eager, channels-last"] = (m, lambda b=cl, m=m: eager_fit(m, b))
    m = model(torch.contiguous_format)
    nchw = batches[torch.contiguous_format]
    variants["eager, NCHW"] = (m, lambda b=nchw, m=m: eager_fit(m, b))
    m = model()
    cm = torch.compile(m, dynamic=False)
    variants["module compiled, default"] = (m, lambda b=cl, cm=cm: eager_fit(cm, b))
    for mode in ("default", "max-autotune-no-cudagraphs"):
        m = model()
        variants[f"whole step compiled, {mode}"] = (m, lambda b=cl, f=whole_step(m, mode): f(b))
    m = model()
    variants["whole step compiled, default, cpp_wrapper"] = (
        m, lambda b=cl, f=whole_step(m, "default", cpp_wrapper=True): f(b))

    start = {n: p.detach().clone() for n, p in base.named_parameters()}
    ref = None
    print(f"torch {torch.__version__}, 1 thread; cnn2, batch {args.batch}, {args.steps} steps")
    for name, (m, fit) in variants.items():
        inductor.cpp_wrapper = name.endswith("cpp_wrapper")  # read when a graph compiles
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.copy_(start[n])
        t0 = time.perf_counter()
        fit()
        first = time.perf_counter() - t0
        got = {n: p.detach().clone() for n, p in m.named_parameters()}
        ref = ref or got
        diff = max(float((got[n] - ref[n]).abs().max()) for n in got)
        print(f"{name}: first call {first:.1f} s, largest weight difference from eager "
              f"{diff:.1e}", flush=True)
    inductor.cpp_wrapper = False
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (_m, fit) in variants.items():
            t0 = time.thread_time()
            fit()
            times[name].append(1e3 * (time.thread_time() - t0) / args.steps)
    ref_t = statistics.median(times["eager, channels-last"])
    print(f"\n| variant | ms a step (CPU, median of {args.repeats}) | runs | "
          "eager channels-last / this |\n|---|---|---|---|")
    for name, runs in times.items():
        med = statistics.median(runs)
        print(f"| {name} | {med:.2f} | {', '.join(f'{r:.2f}' for r in runs)} | {ref_t / med:.2f}x |")


if __name__ == "__main__":
    main()
