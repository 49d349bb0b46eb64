"""Evaluation of K clients one after another against batched: is batched evaluation worth
building (issue 43)?

Every client has a test set of N samples. Two cases, as the engine meets them:

* one model for every client (a global model, hierbayes' global draws): "per client" runs
  the model on each client's test set in turn (what ``Evaluation.evaluate`` does today, the
  model loaded once); "concatenated" runs it once on all K test sets stacked, in batches
  of ``--eval-batch`` (the trainer's evaluation batch, 1024), and splits the predictions;
* one model per client (personalized models): "per client" loads each client's weights
  into one module and runs its test set; "vmap" stacks the K clients' weights and runs one
  vmapped forward over ``[K, N, ...]`` (in chunks of ``--chunk`` clients, to bound memory).

Both sides of each case must predict the same classes (checked), and are timed alternating,
medians of ``--repeats``, in the thread's CPU time on a CPU (``time.thread_time``: other
jobs on the machine inflate it only through shared caches) and in wall time on a GPU (with
a synchronize).

    python bench/speed/eval_batched.py [--clients 100] [--samples 50] [--model cnn2]
                                       [--device cpu|cuda] [--repeats 5] [--chunk 25]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.func import functional_call, vmap

from edgepfl.models import build_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--samples", type=int, default=50, help="test samples per client")
    parser.add_argument("--model", default="cnn2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=25, help="clients per vmapped forward")
    parser.add_argument("--eval-batch", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = build_model(args.model, (1, 28, 28), 10).to(device).eval()
    k, n = args.clients, args.samples
    xs = [torch.randn(n, 1, 28, 28, device=device) for _ in range(k)]
    base = {name: t.detach() for name, t in model.state_dict().items()}
    states = [{name: t + 0.01 * torch.randn_like(t) for name, t in base.items()} for _ in range(k)]
    stacked = {name: torch.stack([s[name] for s in states]) for name in base}
    xstack = torch.stack(xs)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

    @torch.inference_mode()
    def same_per_client():
        model.load_state_dict(base)
        return torch.cat([model(x).argmax(1) for x in xs])

    @torch.inference_mode()
    def same_concatenated():
        model.load_state_dict(base)
        x = torch.cat(xs)
        return torch.cat([model(x[i:i + args.eval_batch]).argmax(1)
                          for i in range(0, len(x), args.eval_batch)])

    @torch.inference_mode()
    def own_per_client():
        out = []
        for s, x in zip(states, xs, strict=True):
            model.load_state_dict(s)
            out.append(model(x).argmax(1))
        return torch.cat(out)

    @torch.inference_mode()
    def own_vmap():
        def forward(params, x):
            return functional_call(model, params, (x,))
        out = [vmap(forward)({name: t[i:i + args.chunk] for name, t in stacked.items()},
                             xstack[i:i + args.chunk]).argmax(-1).reshape(-1)
               for i in range(0, k, args.chunk)]
        return torch.cat(out)

    what = "CPU s (thread)" if device.type == "cpu" else "s (wall)"
    print(f"{args.model}, {k} clients x {n} test samples, {args.device}, {args.threads} thread(s), "
          f"medians of {args.repeats}")
    for label, plain, batched in (("one model for all", same_per_client, same_concatenated),
                                  ("a model per client", own_per_client, own_vmap)):
        a, b = plain(), batched()
        agree = float((a == b).float().mean())
        if agree < 0.999:
            raise SystemExit(f"{label}: the batched predictions differ ({agree:.4f} agree)")
        times: dict[str, list[float]] = {"plain": [], "batched": []}
        for _ in range(args.repeats):
            for key, fn in (("plain", plain), ("batched", batched)):
                t = clock()
                fn()
                times[key].append(clock() - t)
        p, q = statistics.median(times["plain"]), statistics.median(times["batched"])
        print(f"  {label}: per client {p:.3f} {what}, batched {q:.3f}: "
              f"batched runs at {p / q:.2f}x (predictions agree {agree:.4f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
