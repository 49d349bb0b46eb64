"""The hierarchical Bayesian cloud's aggregation, on sufficient statistics against row by row.

    python bench/speed/hierbayes_cloud.py [--edges 2 5 10] [--repeats 3] [--threads 1]

One cloud aggregation (``upper_blocks = joint``) is JOINT_SWEEPS passes of the edges'
Gaussian block (Eq. 25) and the cloud's closed-form block (Eq. 28, ``inner_iters`` sweeps).
``direct`` is that algebra written row by row, as the library had it: every sweep forms
(m_k - m)^2 for every edge, a fresh tensor of K models of float64. ``library`` is
``HierBayesServer.aggregate``'s code path: mean_k (m_k - m)^2 = spread + (mean - m)^2, so
an inner sweep touches one row, and the per-edge tensors of a pass are written into
buffers allocated once (on Linux a fresh tensor of tens of MB is a fresh mapping whose
page faults cost more than the arithmetic). Inputs are the ``cnn2`` model's size (643,850
parameters, per-layer variances), the edges' reports random but of the real scales. Each
cell is the median over repeats; the ratio is taken within one process run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgepfl.algorithms import hierbayes as hb
from edgepfl.models.zoo import build_model


def direct(ybar, meas, m0, a, b, a_p, b_p, layout, iters, psi_prior_var=1.0):
    count = ybar.shape[0]
    for _ in range(hb.JOINT_SWEEPS):
        lam_e = a / b
        prec = meas + lam_e
        means, variances = (meas * ybar + lam_e * m0) / prec, 1.0 / prec
        for _ in range(iters):
            lam = a / b
            p = count * lam + 1.0 / psi_prior_var
            m0, v0 = lam * count * means.mean(0) / p, 1.0 / p
            sq = ((means - m0) ** 2 + variances).mean(0) + v0
            a, b = hb.gamma_block(layout.pool(sq), count, a_p, b_p, layout.dim)
    return m0, v0, a, b


def library(ybar, meas, m0, a, b, a_p, b_p, layout, iters, psi_prior_var=1.0):
    weighted = meas * ybar
    buffers, scratch = (torch.empty_like(ybar), torch.empty_like(ybar)), torch.empty_like(ybar)
    for _ in range(hb.JOINT_SWEEPS):
        means, variances = hb.edge_posteriors(ybar, meas, m0, a / b, weighted, buffers)
        m0, v0, a, b = hb.cloud_update(means, variances, psi_prior_var, a, b, a_p, b_p, iters,
                                       None, layout, scratch)
    return m0, v0, a, b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edges", type=int, nargs="+", default=[2, 5, 10])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model("cnn2", (1, 28, 28), 10)
    init = {n: p.detach() for n, p in model.state_dict().items()}
    layout = hb.Layout(init, list(init), per_layer=True)
    n = int(layout.sizes.sum())
    print(f"cnn2: {n} parameters, {hb.JOINT_SWEEPS} joint sweeps x 5 inner sweeps, "
          f"{args.threads} thread(s)")
    print("| edges | direct (s) | library (s) | speed-up | max rel. difference of m_0 |")
    print("|---|---|---|---|---|")
    for k in args.edges:
        g = torch.Generator().manual_seed(k)
        flat = layout.flat(init)
        ybar = flat + 0.01 * torch.randn(k, n, generator=g, dtype=torch.float64)
        meas = torch.rand(k, n, generator=g, dtype=torch.float64) * 1e4 + 10
        b_p = layout.pool(torch.full((n,), 1e-3, dtype=torch.float64))
        a_p = 2.0 + layout.dim / 2
        inputs = (ybar, meas, flat, a_p, b_p.clone(), a_p, b_p, layout, 5)
        times, outs = {}, {}
        for name, fn in (("direct", direct), ("library", library)):
            runs = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                outs[name] = fn(*inputs)
                runs.append(time.perf_counter() - t)
            times[name] = statistics.median(runs)
        diff = float(((outs["direct"][0] - outs["library"][0]).abs()
                      / outs["direct"][0].abs().max()).max())
        print(f"| {k} | {times['direct']:.2f} | {times['library']:.2f} | "
              f"{times['direct'] / times['library']:.1f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
