"""How far a finished hierbayes run's sampled global predictive is from psi*, and why.

The global predictive averages the class probabilities of ``mc_samples`` draws psi ~ q(psi)
= N(m_0, v_0). This re-draws it from the run's checkpoint on every client's test data pooled,
for several numbers of draws S (independent sets of draws each), beside psi* itself, and
prints psi*'s confidence (the median top-1 probability and top-1 minus top-2 margin) and
each layer's posterior std against the rms of its weights. A gap that closes as S grows is
Monte Carlo error of the few-draw average, not a worse Bayesian model average.

    python bench/papers/hier_mc_error.py RUN_DIR [--draws 64] [--sets 8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from edgepfl.config import build_config
from edgepfl.engine.simulation import CHECKPOINT, Simulation
from edgepfl.io import read_tensors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path)
    parser.add_argument("--draws", type=int, default=64, help="draws in all (default 64)")
    parser.add_argument("--sets", type=int, default=8,
                        help="independent sets of S draws averaged per S, at most (default 8)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg_raw = json.loads((args.run / "config.json").read_text())
    if cfg_raw["algorithm"]["name"] != "hierbayes":
        parser.error(f"{args.run} is a {cfg_raw['algorithm']['name']} run; this reads hierbayes'")
    tensors, meta = read_tensors(args.run / CHECKPOINT)
    sim = Simulation(build_config(cfg_raw, []), progress=False)
    sim.load_state(tensors, meta)
    server, layout = sim.server, sim.server.layout
    if server.hp.global_level != "cloud":
        parser.error("the run samples a new edge's or client's model (global_level="
                     f"{server.hp.global_level}); this reads psi ~ q(psi) only")
    model = sim.client.trainer.model
    x = torch.cat([t[0] for t in sim.test_data])
    y = torch.cat([t[1] for t in sim.test_data])

    def probs(flat: torch.Tensor) -> torch.Tensor:
        model.load_state_dict({**model.state_dict(), **layout.model(flat, "")})
        model.eval()
        with torch.no_grad():
            return torch.cat([model(x[i:i + 2048]) for i in range(0, len(x), 2048)]).softmax(1)

    def acc(p: torch.Tensor) -> float:
        return 100 * float((p.argmax(1) == y).float().mean())

    m0, v0 = server.m0, server.v0
    psi = probs(m0)
    top = psi.topk(2, 1).values
    print(f"{args.run} at round {meta['round']}, {len(y)} test samples pooled")
    print(f"psi*: accuracy {acc(psi):.2f}%, NLL {F.nll_loss(psi.log(), y):.4f} "
          f"(uniform {torch.log(torch.tensor(float(psi.shape[1]))):.4f}); median top-1 "
          f"probability {top[:, 0].median():.4f}, median top-1 minus top-2 {(top[:, 0] - top[:, 1]).median():.4f}")
    print("posterior std of psi against the rms of its mean, per tensor:")
    for j, name in enumerate(layout.names):
        part = layout.index == j
        rms, std = m0[part].pow(2).mean().sqrt(), v0[part].sqrt().mean()
        print(f"  {name:24s} rms {rms:.4g}  std {std:.4g}  ratio {std / rms:.3f}")
    gen = torch.Generator().manual_seed(args.seed)
    draws = [probs(m0 + v0.sqrt() * torch.randn(m0.shape, generator=gen, dtype=m0.dtype))
             for _ in range(args.draws)]
    print(f"sampled predictive, the mean of S draws' probabilities (psi*: {acc(psi):.2f}%):")
    s = 1
    while s <= args.draws:
        sets = [torch.stack(draws[i * s:(i + 1) * s]).mean(0)
                for i in range(min(args.sets, args.draws // s))]
        accs = [acc(p) for p in sets]
        nll = sum(float(F.nll_loss(p.log(), y)) for p in sets) / len(sets)
        print(f"  S = {s:3d}: accuracy {sum(accs) / len(accs):.2f}% (min {min(accs):.2f}, "
              f"max {max(accs):.2f} over {len(accs)} sets), NLL {nll:.4f}")
        s *= 4
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
