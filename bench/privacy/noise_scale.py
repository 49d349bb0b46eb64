"""How much noise client-level DP costs as the federation grows: for N clients of which
K = participation x N are sampled each round, the noise multiplier that keeps a run of
``--rounds`` rounds within epsilon (delta = 1 / N), calibrated by dp-accounting over the
engine's accounting (fixed-size sampling without replacement, replace-one), and the
std of the noise on the averaged update in multiples of the clip, noise multiplier / K.
No training: accounting only.

    .venv/bin/python bench/privacy/noise_scale.py --rounds 50 --participation 0.1
"""

from __future__ import annotations

import argparse

from edgepfl.federation.rng import select_clients
from edgepfl.privacy.accountant import calibrate, client_epsilon


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", nargs="+", type=int, default=[20, 100, 1000, 10000])
    ap.add_argument("--epsilons", nargs="+", type=float, default=[1.0, 4.0, 8.0])
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--participation", type=float, default=0.1)
    args = ap.parse_args()
    head = ["clients N", "sampled K"] + [f"ε={e:g}: σ, σ/K" for e in args.epsilons]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for n in args.clients:
        k = len(select_clients(0, 1, n, args.participation))
        cells = [str(n), str(k)]
        for eps in args.epsilons:
            noise = calibrate(lambda s, n=n, k=k: client_epsilon(((n, k),), s, 1, args.rounds,
                                                                1.0 / n), eps)
            cells.append(f"{noise:.2f}, {noise / k:.4f}")
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
