#!/usr/bin/env bash
# KAPC journal paper, Table 1 (MNIST and Fashion-MNIST, 10 clients, 10% of the data,
# Dirichlet alpha 0.1 and 0.3, cnn2, 50 rounds, 5 local epochs, lr 0.01, batch 32).
#
#   bench/papers/kapc_table1.sh [DATASETS] [ALPHAS] [SEEDS] [ALGORITHMS]
#     defaults: "mnist fmnist" "0.1 0.3" "0 1 2" "kapc kapc_bls local fedavg fedprox"
#   An algorithm may carry hyperparameters: fedprox:evaluate=local, kapc:r_grad_scale=sum.
#   JOBS=2     runs two at a time
#   ROUNDS=15  shortens every run (a quick look; the paper uses 50)
#   OUT=dir    root folder (default runs/table1)
#
# Runs go seed-major (every method's seed 0 first) into OUT/<dataset>-a<alpha>-r<rounds>/
# <algorithm>-seed<k>; finished runs are skipped, interrupted ones resumed (bench/grid/run_one.sh).
# One 50-round run takes 8-13 minutes on one core of the project machine; the full grid
# (2 x 2 x 3 x 5 = 60 runs) about 5 hours with JOBS=2.
# Collect with: python bench/papers/collect_table1.py OUT > table.md
set -euo pipefail
datasets=${1:-"mnist fmnist"}
alphas=${2:-"0.1 0.3"}
seeds=${3:-"0 1 2"}
algorithms=${4:-"kapc kapc_bls local fedavg fedprox"}
rounds=${ROUNDS:-50}
for seed in $seeds; do
  for ds in $datasets; do
    for a in $alphas; do
      for algo in $algorithms; do
        echo "${OUT:-runs/table1}/$ds-a$a-r$rounds $seed $algo dataset.name=$ds" \
             "dataset.fraction=0.1 partition.clients=10 partition.alpha=$a model.name=cnn2" \
             "train.rounds=$rounds train.local_epochs=5 train.lr=0.01 train.batch_size=32"
      done
    done
  done
done | xargs -P "${JOBS:-1}" -L 1 bash "$(dirname "$0")/../grid/run_one.sh"
