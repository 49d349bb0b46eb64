#!/usr/bin/env bash
# How far HMPL's Com model falls from the Ord model it was generated from, by the aligner it
# gets (algorithm.com_align; docs/algorithms.md, "Com's aligner after generation").
#
#   bench/papers/hmpl_com_gap.sh central   an Ord model (hmpl_ord) trained centrally on 3,000
#       MNIST images (batch 20, rate 0.05), at 30, 100 and 450 SGD steps: its test accuracy
#       (1,000 images) and a Com model's made of its layers, with ip_align = conv3's summed
#       taps (generation = preserve) or fitted on 150 training images (com_align = fit)
#   bench/papers/hmpl_com_gap.sh rounds [k=v ...]   HMPL on the 10-round setting of
#       bench/papers/README.md ("With today's defaults"): each round, the Com clients' mean
#       test accuracy with their own aligner, one refitted from the server's conv3 by summed
#       taps or by least squares on the client's images, and the Ord model's on the same
#       clients; k=v are further settings (algorithm.com_align=fit, seed=1)
# One torch thread; MNIST from EDGEPFL_DATA.
set -euo pipefail
mode=${1:?usage: bench/papers/hmpl_com_gap.sh central|rounds [k=v ...]}
shift
exec python - "$mode" "$@" <<'PY'
import sys

import torch
import torch.nn.functional as F

from edgepfl.training.client_data import eval_parts
from edgepfl.algorithms.hmpl import align_batches
from edgepfl.models import build_model
from edgepfl.models.hmpl_nets import fitted_align, preserving_start, spp

torch.set_num_threads(1)
mode, extra = sys.argv[1], sys.argv[2:]


def com_logits(s, align, x):
    """The Com model of the Ord layers ``s`` with the aligner ``align``."""
    h = x
    for i in (1, 2):
        h = F.max_pool2d(torch.relu(F.conv2d(h, s[f"conv{i}.weight"], s[f"conv{i}.bias"], padding=1)),
                         2, ceil_mode=True)
    z = spp(torch.relu(F.conv2d(h, align["ip_align.weight"], align["ip_align.bias"])))
    z = torch.relu(F.linear(torch.relu(F.linear(z, s["fc1.weight"], s["fc1.bias"])),
                            s["fc2.weight"], s["fc2.bias"]))
    return F.linear(z, s["fc3.weight"], s["fc3.bias"])


if mode == "central":
    from edgepfl.data.datasets import load_dataset

    torch.manual_seed(0)
    ds = load_dataset("mnist", fraction=0.1)
    norm = ds.norm or (lambda v: v)
    xtr, ytr = norm(ds.x_train[:3000]), ds.y_train[:3000]
    xte, yte = norm(ds.x_test[:1000]), ds.y_test[:1000]
    model = build_model("hmpl_ord", (1, 28, 28), 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(451):
        if step in (30, 100, 450):
            s = {k: v.detach() for k, v in model.state_dict().items()}
            with torch.no_grad():
                acc = lambda logits: 100 * (logits.argmax(1) == yte).float().mean().item()
                print(f"step {step}: Ord {acc(model(xte)):.1f}  Com, summed taps "
                      f"{acc(com_logits(s, preserving_start('ip_align', s), xte)):.1f}  Com, fitted "
                      f"on 150 images {acc(com_logits(s, fitted_align(s, [xtr[:150]]), xte)):.1f}")
        i = torch.randint(0, 3000, (20,))
        loss = F.cross_entropy(model(xtr[i]), ytr[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    sys.exit(0)

from edgepfl.config import build_config
from edgepfl.engine.simulation import Simulation

P = ["dataset.name=mnist", "dataset.fraction=0.05", "partition.clients=20", "partition.scheme=iid",
     "train.participation=0.5", "train.batch_size=20", "train.local_epochs=1", "train.lr=0.05",
     "system.devices=tiers", "train.rounds=10", "output.plots=false", "algorithm.name=hmpl",
     "model.name=hmpl_tiers", *extra]
sim = Simulation(build_config({}, P), progress=False)
ordinary = build_model("hmpl_ord", (1, 28, 28), 10).eval()


def accuracy(fn, test):
    right = n = 0
    with torch.no_grad():
        for x, y in eval_parts(test):
            right += (fn(x).argmax(1) == y).sum().item()
            n += y.numel()
    return right / n


for rnd in range(1, sim.cfg.train.rounds + 1):
    sim.step()
    shared = sim.server.shared
    coms = [c for c, t in enumerate(sim.server.tiers) if t == "com"]
    ordinary.load_state_dict({n: shared[n] for n in ordinary.state_dict()})
    rows: dict[str, list[float]] = {"own": [], "summed taps": [], "fitted": [], "Ord model": []}
    for c in coms:
        state, test = sim.clients.row(c), sim.test_data[c]
        if "ip_align.weight" in state:  # shrunk already
            rows["own"].append(accuracy(lambda x: com_logits(shared, state, x), test))
        taps = preserving_start("ip_align", shared)
        fit = fitted_align(shared, align_batches(sim.train_data[c], 150))
        rows["summed taps"].append(accuracy(lambda x: com_logits(shared, taps, x), test))
        rows["fitted"].append(accuracy(lambda x: com_logits(shared, fit, x), test))
        rows["Ord model"].append(accuracy(ordinary, test))
    print(f"round {rnd}: Com clients' accuracy, " + ", ".join(
        f"{k} {100 * sum(v) / len(v):.1f}" for k, v in rows.items() if v), flush=True)
PY
