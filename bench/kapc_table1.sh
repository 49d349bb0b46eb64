#!/usr/bin/env bash
# KAPC journal paper, Table 1 (MNIST and Fashion-MNIST, 10 clients, 10% of the data,
# Dirichlet alpha 0.1 and 0.3, cnn2, 50 rounds, 5 local epochs, lr 0.01, batch 32).
# Usage: bench/kapc_table1.sh [DATASETS] [ALPHAS] [SEEDS] [ALGORITHMS]
#   defaults: "mnist fmnist" "0.1 0.3" "0,1,2" "local,fedavg,fedprox,kapc,kapc_bls"
# ROUNDS=15 shortens every run (for a quick look; the paper uses 50).
# Each (dataset, alpha) writes runs/table1/<dataset>-a<alpha>/comparison.md.
# One run takes about 8 minutes on one core of the project machine; the full grid is
# 4 x 5 x 3 = 60 runs (about 8 hours on 1 core).
set -euo pipefail
datasets=${1:-"mnist fmnist"}
alphas=${2:-"0.1 0.3"}
seeds=${3:-"0,1,2"}
algorithms=${4:-"local,fedavg,fedprox,kapc,kapc_bls"}
for ds in $datasets; do
  for a in $alphas; do
    edgepfl compare --algorithms "$algorithms" --seeds "$seeds" --quiet --threads 1 \
      --set dataset.name="$ds" --set dataset.fraction=0.1 --set partition.clients=10 \
      --set partition.alpha="$a" --set model.name=cnn2 --set train.rounds="${ROUNDS:-50}" \
      --set train.local_epochs=5 --set train.lr=0.01 --set train.batch_size=32 \
      --out "runs/table1/$ds-a$a-r${ROUNDS:-50}"
  done
done
