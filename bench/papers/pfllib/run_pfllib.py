"""Run PFLlib's own main.py on the shared split and write its per-round accuracies as CSV.

Run with PFLlib's virtual environment, from anywhere:

    OMP_NUM_THREADS=1 /work/pfllib-venv/bin/python bench/papers/pfllib/run_pfllib.py \
        --pfllib /work/pfllib-src --dataset MNIST_ep20 --out /work/pfllib-runs/pfllib \
        -- -algo FedAvg -gr 20 -t 3 -lbs 10 -lr 0.005 -ls 1 -nc 20 -jr 1 -dev cpu

Everything after ``--`` is PFLlib's main.py command line, unchanged; ``-t 3`` runs it three
times in one process (PFLlib's repetitions: one ``torch.manual_seed(0)`` at import, so the
three runs draw different initial models and batch orders from one stream). The script
executes ``system/main.py`` as ``__main__`` (``runpy``) with its working directory, so
PFLlib reads ``../dataset/<dataset>/{train,test}/<i>.npz`` and writes
``../results/<dataset>_<algo>_<goal>_<i>.h5`` as it always does; it then copies each run's
``rs_test_acc`` (the sample-weighted test accuracy over all clients, entry 0 before any
training, entry r after r rounds) to ``<out>/<algo>_<i>.csv``.

Four modules main.py imports at its top are absent from this environment and not used by
the eight methods compared (FedAvg, FedPer, Ditto, FedRep, APFL, SCAFFOLD, FedDyn, FedALA):
``torchvision`` (the CPU torch 2.13 here has no torchvision build that loads; main.py uses
it only for the ResNet/GoogLeNet models), ``cvxpy`` (FedPAC), ``matplotlib`` (DLG attack
plots) and ``calmsize`` (the memory report printed at the end). They are replaced by empty
stand-in modules in this process only (``calmsize.size`` returns the number unchanged).

``--keep-last-batch`` (a diagnostic, off by default) replaces PFLlib's training loader,
``DataLoader(train_data, batch_size, drop_last=True, shuffle=True)``, by the same with
``drop_last=False`` (edgepfl's client batches: a short last batch is trained on), so that
that one difference between the two projects can be measured alone.

``--squared-feddyn`` (a diagnostic, off by default) loads PFLlib's
``flcore/clients/clientdyn.py`` with its penalty ``alpha/2 * torch.norm(v1 - w, 2)``
rewritten in this process as ``alpha/2 * torch.norm(v1 - w, 2) ** 2``, the paper's
``alpha/2 ||theta - theta^{t-1}||^2``; nothing else of the file changes and the file on
disk is left as it is.
"""
from __future__ import annotations

import argparse
import csv
import os
import runpy
import sys
import types
from pathlib import Path

STUBS = ("torchvision", "torchvision.models", "torchvision.transforms", "cvxpy",
         "matplotlib", "matplotlib.pyplot", "calmsize")


def install_stubs() -> None:
    for name in STUBS:
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["calmsize"].size = lambda n: float(n)
    sys.modules["torchvision"].models = sys.modules["torchvision.models"]
    sys.modules["torchvision"].transforms = sys.modules["torchvision.transforms"]
    sys.modules["matplotlib"].pyplot = sys.modules["matplotlib.pyplot"]


def keep_last_batch() -> None:
    """PFLlib's clients train on their short last batch too (drop_last=False)."""
    from flcore.clients.clientbase import Client
    from torch.utils.data import DataLoader
    from utils.data_utils import read_client_data

    def load_train_data(self, batch_size=None):
        batch_size = self.batch_size if batch_size is None else batch_size
        data = read_client_data(self.dataset, self.id, is_train=True, few_shot=self.few_shot)
        return DataLoader(data, batch_size, drop_last=False, shuffle=True)

    Client.load_train_data = load_train_data


def squared_feddyn(system: Path) -> None:
    """PFLlib's FedDyn client with the squared norm in its penalty (see the docstring)."""
    path = system / "flcore" / "clients" / "clientdyn.py"
    text = path.read_text()
    norm = "torch.norm(v1 - self.global_model_vector, 2)"
    if text.count(norm) != 2:
        raise SystemExit(f"{path}: expected the penalty {norm!r} twice")
    module = types.ModuleType("flcore.clients.clientdyn")
    module.__file__ = str(path)
    exec(compile(text.replace(norm, f"{norm} ** 2"), str(path), "exec"), module.__dict__)
    sys.modules[module.__name__] = module


def option(argv: list[str], short: str, long: str, default: str) -> str:
    for i, a in enumerate(argv[:-1]):
        if a in (short, long):
            return argv[i + 1]
    return default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pfllib", required=True)
    ap.add_argument("--dataset", required=True, help="folder name under PFLlib's dataset/")
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep-last-batch", action="store_true",
                    help="diagnostic: PFLlib's training loader keeps its short last batch")
    ap.add_argument("--squared-feddyn", action="store_true",
                    help="diagnostic: FedDyn's penalty with the squared norm")
    ap.add_argument("argv", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    argv = [a for a in args.argv if a != "--"]
    system = Path(args.pfllib) / "system"
    install_stubs()
    os.chdir(system)
    sys.path.insert(0, str(system))
    if args.keep_last_batch:
        keep_last_batch()
    if args.squared_feddyn:
        squared_feddyn(system)
    sys.argv = [str(system / "main.py"), "-data", args.dataset, *argv]
    runpy.run_path(str(system / "main.py"), run_name="__main__")

    import h5py  # PFLlib's dependency, after its run

    algo, goal = option(argv, "-algo", "--algorithm", "FedAvg"), option(argv, "-go", "--goal", "test")
    times = int(option(argv, "-t", "--times", "1"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i in range(times):
        with h5py.File(system.parent / "results" / f"{args.dataset}_{algo}_{goal}_{i}.h5") as hf:
            acc = list(hf["rs_test_acc"][()])
            loss = list(hf["rs_train_loss"][()])
        with open(out / f"{algo}_{i}.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["round", "acc_weighted", "train_loss"])
            w.writerows([r, float(a), float(lo)] for r, (a, lo) in enumerate(zip(acc, loss, strict=True)))


if __name__ == "__main__":
    main()
