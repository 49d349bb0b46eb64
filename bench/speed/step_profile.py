"""Where a local SGD step's time goes on the CPU, and how far it is from the arithmetic.

One client's steps of ``cnn2`` at batch 10 (PFLlib's MNIST setting), one thread, timed in
the thread's CPU time (which other jobs on a shared machine do not inflate):

1. the step split into forward, backward and update, channels-last (the engine's layout)
   against NCHW, interleaved; FLOPs per step (``torch.utils.flop_counter``) and the
   GFLOP/s achieved;
2. each operator's CPU time and GFLOP/s (a dispatch mode timing every operator in the
   thread's CPU time, by operator and input shapes), against the rate a large single-precision GEMM reaches on this core: is
   the step bound by per-operator overhead or by arithmetic?
3. ``Trainer.fit`` (the engine's local training: 8-bit pixels normalised per batch, index
   gathering, the loss summed on the device) against a bare loop over the same batches
   pre-normalised (``torch.optim.SGD``), and the batches drawn alone.

    python bench/speed/step_profile.py [--batch 10] [--steps 200] [--repeats 5]

Record results in bench/speed/README.md and bench/LOG.md.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from edgepfl.models import build_model
from edgepfl.training.client_data import ClientData
from edgepfl.training.trainer import Trainer

CLOCK = time.thread_time


def step(model, params, x, y, lr, parts=None):
    t0 = CLOCK()
    loss = F.cross_entropy(model(x), y)
    t1 = CLOCK()
    for p in params:
        p.grad = None
    loss.backward()
    t2 = CLOCK()
    with torch.no_grad():
        torch._foreach_add_(params, [p.grad for p in params], alpha=-lr)
    if parts is not None:
        t3 = CLOCK()
        parts[0] += t1 - t0
        parts[1] += t2 - t1
        parts[2] += t3 - t2


class OpTimer(TorchDispatchMode):
    """Every operator's CPU time (this thread's) and FLOPs, by operator and input shapes.

    ``torch.profiler`` times operators by the wall clock, which on a machine shared with
    more jobs than cores mostly measures the waits for a core."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = CLOCK()
        out = func(*args, **kwargs)
        t = CLOCK() - t0
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)][:3]
        row = self.rows[(str(func.overloadpacket), str(shapes))]
        row[0] += t
        row[1] += 1
        count = flop_registry.get(func.overloadpacket)
        if count is not None:
            row[2] += count(*args, **kwargs, out_val=out)
        self.calls += 1
        return out


def gemm_rate(n: int = 1024) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    runs = []
    for _ in range(5):
        t0 = CLOCK()
        for _ in range(10):
            a @ b
        runs.append((CLOCK() - t0) / 10)
    return 2 * n ** 3 / statistics.median(runs) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--model", default="cnn2")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    b, n, lr = args.batch, args.steps, 0.005
    base = build_model(args.model, (1, 28, 28), 10)
    # MNIST-like data: 8-bit pixels normalised per batch, as the engine holds them
    pixels = torch.randint(0, 256, (b * n, 1, 28, 28), dtype=torch.uint8)
    labels = torch.randint(0, 10, (b * n,))
    mean, std = 0.1307, 0.3081

    def norm(x):
        return (x.float() / 255 - mean) / std

    floats = norm(pixels)
    xs = list(floats.split(b))
    ys = list(labels.split(b))
    models = {"channels-last": copy.deepcopy(base).to(memory_format=torch.channels_last),
              "NCHW": copy.deepcopy(base)}
    with FlopCounterMode(display=False) as fc:
        m = models["NCHW"]
        F.cross_entropy(m(xs[0]), ys[0]).backward()
    flops = fc.get_total_flops()
    peak = gemm_rate()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread; {args.model}, batch {b}; "
          f"{flops / 1e6:.1f} MFLOP a step ({flops / b / 1e6:.2f} per sample); a 1024^3 SGEMM "
          f"on this core: {peak:.1f} GFLOP/s")

    # 1. forward / backward / update, the two layouts interleaved
    res: dict[str, list[list[float]]] = {k: [] for k in models}
    for rep in range(args.repeats + 1):
        for name, model in models.items():
            params = list(model.parameters())
            parts = [0.0, 0.0, 0.0]
            lay = torch.channels_last if name == "channels-last" else torch.contiguous_format
            for x, y in zip(xs, ys, strict=True):
                step(model, params, x.contiguous(memory_format=lay), y, lr, parts)
            if rep:  # the first pass warms up
                res[name].append([1e3 * v / n for v in parts])
    print("\n| layout | forward ms | backward ms | update ms | step ms (CPU) | samples/s | GFLOP/s "
          "| of the GEMM rate |\n|---|---|---|---|---|---|---|---|")
    for name, runs in res.items():
        f, bw, u = (statistics.median(c) for c in zip(*runs, strict=True))
        tot = statistics.median(sum(r) for r in runs)
        print(f"| {name} | {f:.2f} | {bw:.2f} | {u:.2f} | {tot:.2f} | {b / tot * 1e3:,.0f} "
              f"| {flops / tot / 1e6:.1f} | {flops / tot / 1e6 / peak:.0%} |")

    # 2. per-operator CPU time and rate (channels-last, the engine's layout)
    model = models["channels-last"]
    params = list(model.parameters())
    ops = OpTimer()
    with ops:
        for x, y in zip(xs, ys, strict=True):
            step(model, params, x.contiguous(memory_format=torch.channels_last), y, lr)
    total = sum(t for t, _, _ in ops.rows.values())
    print(f"\noperators: {1e3 * total / n:.2f} ms of CPU time a step inside {ops.calls / n:.0f} "
          "operators (timed one by one from Python, which adds to the small ones)")
    print("\n| operator | input shapes | ms a step | share | GFLOP/s | of the GEMM rate |"
          "\n|---|---|---|---|---|---|")
    for (name, shapes), (t, _count, fl) in sorted(ops.rows.items(), key=lambda kv: -kv[1][0])[:14]:
        rate = f"{fl / t / 1e9:.1f} | {fl / t / 1e9 / peak:.0%}" if fl else "- | -"
        print(f"| {name} | {shapes} | {1e3 * t / n:.3f} | {t / total:.0%} | {rate} |")
    arith = [(t, fl) for t, _, fl in ops.rows.values() if fl]
    t_ar, fl_ar = sum(t for t, _ in arith), sum(fl for _, fl in arith)
    print(f"\nconvolutions and matrix products: {1e3 * t_ar / n:.2f} ms a step "
          f"({t_ar / total:.0%} of the operators' time) at {fl_ar / t_ar / 1e9:.1f} GFLOP/s; "
          f"every other operator: {1e3 * (total - t_ar) / n:.2f} ms. At the 1024^3 SGEMM's rate "
          f"the step's FLOPs would take {1e3 * flops / peak / 1e9:.2f} ms.")

    # 3. the engine's fit against a bare loop over the same batches
    data = ClientData(pixels, labels, torch.arange(b * n), norm=norm)
    trainer = Trainer(copy.deepcopy(base))
    start = trainer.export()
    bare = copy.deepcopy(base).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(bare.parameters(), lr=lr)
    order = data.order(torch.Generator().manual_seed(0))
    batches = [(floats[i].contiguous(memory_format=torch.channels_last), labels[i])
               for i in order.split(b)]

    def fit():
        trainer.load(start)
        trainer.fit(data, 1, b, lr, torch.Generator().manual_seed(0))

    def loop():
        for x, y in batches:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(bare(x), y).backward()
            opt.step()

    def draw():
        for _ in data.batches(b, torch.Generator().manual_seed(0)):
            pass

    timings: dict[str, list[float]] = {"Trainer.fit": [], "bare loop": [], "batches alone": []}
    for rep in range(args.repeats + 1):
        for name, fn in (("Trainer.fit", fit), ("bare loop", loop), ("batches alone", draw)):
            t0 = CLOCK()
            fn()
            if rep:
                timings[name].append(1e3 * (CLOCK() - t0) / n)
    ref = statistics.median(timings["bare loop"])
    print("\n| local training | ms a step (CPU) | vs the bare loop |\n|---|---|---|")
    for name, runs in timings.items():
        med = statistics.median(runs)
        print(f"| {name} | {med:.3f} | {med / ref:.3f} |")


if __name__ == "__main__":
    main()
