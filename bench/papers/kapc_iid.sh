#!/usr/bin/env bash
# KAPC's coaching weight lambda over a run, on the IID split where a new user met it:
# Fashion-MNIST, 10 clients, 10% of the data, IID, 10 rounds of 2 local
# epochs, cnn2, evaluation every round; KAPC at lambda = 1 (default), 0.1, 0.01 and 0
# (no coaching: each client trains alone, plus R's updates), against Local and FedAvg.
#
#   bench/papers/kapc_iid.sh [SEEDS] [METHODS]     defaults: "0 1 2", the methods above
#   JOBS=2 runs two at a time; OUT=dir root folder (default runs/kapc_iid)
# Collect with: python bench/papers/collect_table1.py OUT
set -euo pipefail
seeds=${1:-"0 1 2"}
methods=${2:-"kapc kapc:lam=0.1 kapc:lam=0.01 kapc:lam=0 local fedavg"}
for seed in $seeds; do
  for m in $methods; do
    echo "${OUT:-runs/kapc_iid}/fmnist-iid-r10 $seed $m dataset.name=fmnist dataset.fraction=0.1" \
         "partition.clients=10 partition.scheme=iid train.rounds=10 train.local_epochs=2" \
         "model.name=cnn2 eval.every=1"
  done
done | xargs -P "${JOBS:-1}" -L 1 bash "$(dirname "$0")/../grid/run_one.sh"
