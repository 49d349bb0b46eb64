"""Write one MNIST client split for both PFLlib and edgepfl (issue 58, "Against PFLlib").

Run with PFLlib's virtual environment (its dataset code is called, not copied):

    /work/pfllib-venv/bin/python bench/papers/pfllib/write_split.py \
        --pfllib /work/pfllib-src --samples 4000 --out /work/pfllib-runs/split

PFLlib's own MNIST generator (dataset/generate_MNIST.py noniid - dir) pools MNIST's 70,000
train and test images, draws each client's share with ``separate_data`` (Dirichlet, its
alpha = 0.1) and splits every client 75/25 with ``split_data``. This script does the same
on a seeded random subset of ``--samples`` pooled images (CPU-small), with PFLlib's own two
functions, then standardises every pixel with the mean and std of all clients' training
images (what edgepfl does to its inputs) and writes

* ``<out>/pfllib/{train,test}/<i>.npz`` and ``config.json`` with PFLlib's ``save_file``
  (its format: ``data = {'x': float32 [n, 1, 28, 28], 'y': int64 [n]}``, an object array);
* ``<out>/edgepfl.npz``: ``x, y, x_test, y_test, client, client_test`` (float32 images,
  plain arrays, no pickle) for ``dataset.name = npz`` with ``partition.scheme = natural``.

Both projects therefore train and test every client on the same images with the same
values. Nothing of PFLlib is imported by edgepfl; this file is not part of edgepfl.
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
from pathlib import Path

import numpy as np


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load_mnist(root: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = root / "MNIST" / "raw"
    x = np.concatenate([_idx(raw / "train-images-idx3-ubyte.gz"), _idx(raw / "t10k-images-idx3-ubyte.gz")])
    y = np.concatenate([_idx(raw / "train-labels-idx1-ubyte.gz"), _idx(raw / "t10k-labels-idx1-ubyte.gz")])
    return x, y.astype(np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pfllib", required=True, help="PFLlib's source tree (holds dataset/utils)")
    ap.add_argument("--data", default=os.environ.get("EDGEPFL_DATA", "/work/shared/data"))
    ap.add_argument("--samples", type=int, default=4000, help="pooled MNIST images used")
    ap.add_argument("--clients", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1, help="PFLlib's generators seed numpy with 1")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    sys.path.insert(0, str(Path(args.pfllib) / "dataset"))
    from utils.dataset_utils import save_file, separate_data, split_data  # PFLlib's code

    np.random.seed(args.seed)
    x, y = load_mnist(Path(args.data))
    keep = np.random.permutation(len(y))[: args.samples]
    x = (x[keep].astype(np.float32) / 255.0)[:, None]  # [n, 1, 28, 28]
    y = y[keep]
    xs, ys, stats = separate_data((x, y), args.clients, 10, niid=True, balance=False,
                                  partition="dir")
    train, test = split_data(xs, ys)
    pixels = np.concatenate([t["x"] for t in train])
    mean, std = float(pixels.mean()), float(pixels.std())
    for part in train + test:
        part["x"] = ((part["x"] - mean) / std).astype(np.float32)
        part["y"] = part["y"].astype(np.int64)

    out = Path(args.out)
    for sub in ("pfllib/train", "pfllib/test"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    save_file(str(out / "pfllib/config.json"), str(out / "pfllib/train") + "/",
              str(out / "pfllib/test") + "/", train, test, args.clients, 10, stats,
              niid=True, balance=False, partition="dir")
    np.savez(out / "edgepfl.npz",
             x=np.concatenate([t["x"] for t in train]), y=np.concatenate([t["y"] for t in train]),
             x_test=np.concatenate([t["x"] for t in test]), y_test=np.concatenate([t["y"] for t in test]),
             client=np.concatenate([np.full(len(t["y"]), i) for i, t in enumerate(train)]),
             client_test=np.concatenate([np.full(len(t["y"]), i) for i, t in enumerate(test)]))
    print(f"mean {mean:.6f} std {std:.6f}; train {[len(t['y']) for t in train]}; "
          f"test {[len(t['y']) for t in test]}")


if __name__ == "__main__":
    main()
