"""Clients' SGD steps one after another against K clients' steps batched into one with
``torch.func`` (``functional_call`` + ``vmap``): is batching worth building?

Every client has its own weights and its own batch; a step is forward, cross-entropy,
backward and the SGD update. "sequential" is what the engine does today (one skeleton
module, each client's weights copied in, its step, copied out); "vmap" stacks the K
clients' weights and runs one vmapped gradient of the K losses, then one update of the
stacked weights. Both start from the same weights and see the same batches; the script
checks that the K models they end with agree (float tolerance), then times each,
alternating, and prints the medians and their ratio.

    python bench/speed/vmap_step.py [--clients 10] [--steps 20] [--batch 32] [--model cnn2]
                              [--device cpu|cuda] [--threads N] [--repeats 5]
                              [--channels-last] [--profile]

``--channels-last``: the sequential steps in the layout the engine trains convolutional
models in (vmap's batched convolutions take NCHW). ``--profile`` (CPU): every operator of
one vmapped step and of one sequential client step, in the thread's CPU time
(``step_profile.OpTimer``), to see what the batched step is made of.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call, grad_and_value, vmap

from edgepfl.models import build_model


def sequential(model, weights, xs, ys, lr):
    """K clients one after another through one module, as the engine trains them."""
    names = list(weights[0])
    params = dict(model.named_parameters())
    out = []
    for k, w in enumerate(weights):
        with torch.no_grad():
            for n in names:
                params[n].copy_(w[n])
        for x, y in zip(xs[k], ys[k], strict=True):
            for p in params.values():
                p.grad = None
            F.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                torch._foreach_add_(list(params.values()), [p.grad for p in params.values()],
                                    alpha=-lr)
        out.append({n: params[n].detach().clone() for n in names})
    return out


def batched(model, weights, xs, ys, lr):
    """The K clients' steps as one: stacked weights, one vmapped gradient per step."""
    names = list(weights[0])
    stacked = {n: torch.stack([w[n] for w in weights]) for n in names}

    def loss(p, x, y):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    step = vmap(grad_and_value(loss))
    for s in range(len(xs[0])):
        x = torch.stack([xs[k][s] for k in range(len(weights))])
        y = torch.stack([ys[k][s] for k in range(len(weights))])
        grads, _ = step(stacked, x, y)
        with torch.no_grad():
            torch._foreach_add_(list(stacked.values()), [grads[n] for n in names], alpha=-lr)
    return [{n: stacked[n][k].clone() for n in names} for k in range(len(weights))]


def profile(seq_model, model, weights, seq_xs, xs, ys, lr) -> None:
    """The operators of the clients' steps one after another against vmapped, per client
    step (torch's FLOP formulas ignore a convolution's groups: no rates for vmap's)."""
    from step_profile import OpTimer  # this folder's script (run as a script: on the path)

    k, steps = len(weights), len(xs[0])
    for name, run in (("sequential", lambda: sequential(seq_model, weights, seq_xs, ys, lr)),
                      ("vmap", lambda: batched(model, weights, xs, ys, lr))):
        run()  # warm
        ops = OpTimer()
        with ops:
            run()
        total = sum(t for t, _, _ in ops.rows.values())
        per = 1e3 / (k * steps)
        print(f"\n{name}: {per * total:.2f} ms of CPU time a client step in operators "
              f"({ops.calls / steps:.0f} operators a step of all {k} clients)\n"
              "| operator | input shapes | ms a client step | share |\n|---|---|---|---|")
        for (op, shapes), (t, _n, _fl) in sorted(ops.rows.items(), key=lambda kv: -kv[1][0])[:10]:
            print(f"| {op} | {shapes} | {per * t:.3f} | {t / total:.0%} |")
    print()


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--model", default="cnn2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--channels-last", action="store_true")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    model = build_model(args.model, (1, 28, 28), 10).to(device)
    weights = []
    for _ in range(args.clients):
        fresh = build_model(args.model, (1, 28, 28), 10)
        weights.append({n: p.detach().to(device) for n, p in fresh.named_parameters()})
    xs = [[torch.randn(args.batch, 1, 28, 28, device=device) for _ in range(args.steps)]
          for _ in range(args.clients)]
    ys = [[torch.randint(0, 10, (args.batch,), device=device) for _ in range(args.steps)]
          for _ in range(args.clients)]
    lr = 0.01

    seq_model, seq_xs = model, xs
    if args.channels_last:
        seq_model = copy.deepcopy(model).to(memory_format=torch.channels_last)
        seq_xs = [[x.contiguous(memory_format=torch.channels_last) for x in c] for c in xs]
    if args.profile:
        profile(seq_model, model, weights, seq_xs, xs, ys, lr)
    a = sequential(seq_model, weights, seq_xs, ys, lr)
    b = batched(model, weights, xs, ys, lr)
    diff = max(float((a[k][n] - b[k][n]).abs().max()) for k in range(args.clients) for n in a[k])
    print(f"max |sequential - vmap| over every client's weights after {args.steps} steps: "
          f"{diff:.2e}")

    seq, vm = [], []
    for _ in range(args.repeats):  # alternating, so that drifting load hits both alike
        seq.append(timed(lambda: sequential(seq_model, weights, seq_xs, ys, lr), device))
        vm.append(timed(lambda: batched(model, weights, xs, ys, lr), device))
    s, v = statistics.median(seq), statistics.median(vm)
    steps = args.clients * args.steps
    print(f"{args.model} on {device} ({torch.get_num_threads()} threads), {args.clients} clients "
          f"x {args.steps} steps of batch {args.batch}, median of {args.repeats}:")
    print(f"  sequential {s:.3f} s ({steps / s:.0f} client steps/s)")
    print(f"  vmap       {v:.3f} s ({steps / v:.0f} client steps/s)  -> {s / v:.2f}x")


if __name__ == "__main__":
    main()
