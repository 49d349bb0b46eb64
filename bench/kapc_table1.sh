#!/usr/bin/env bash
# KAPC journal paper, Table 1 (MNIST and Fashion-MNIST, 10 clients, 10% of the data,
# Dirichlet alpha 0.1 and 0.3, cnn2, 50 rounds, 5 local epochs, lr 0.01, batch 32).
#
#   bench/kapc_table1.sh [DATASETS] [ALPHAS] [SEEDS] [ALGORITHMS]
#     defaults: "mnist fmnist" "0.1 0.3" "0 1 2" "kapc kapc_bls local fedavg fedprox"
#   An algorithm may carry hyperparameters: fedprox:evaluate=local, kapc:r_grad_scale=sum
#   (the run folder is then fedprox+evaluate=local-seed0).
#   JOBS=2     runs two at a time (one torch thread each: faster than one run on two threads)
#   ROUNDS=15  shortens every run (a quick look; the paper uses 50)
#   OUT=dir    root folder (default runs/table1)
#
# Runs go seed-major (every method's seed 0 first) into OUT/<dataset>-a<alpha>-r<rounds>/
# <algorithm>-seed<k>. A finished run (summary.json present) is skipped and an interrupted
# one resumed from its checkpoint, so the grid can be stopped and restarted at will.
# One 50-round run takes 8-13 minutes on one core of the project machine; the full grid
# (2 x 2 x 3 x 5 = 60 runs) about 5 hours with JOBS=2.
# Collect with: python bench/collect_table1.py OUT > table.md
set -euo pipefail

if [[ "${1:-}" == "--one" ]]; then
  ds=$2 a=$3 seed=$4 spec=$5
  algo=${spec%%:*}
  name=$algo
  sets=(--set algorithm.name="$algo")
  if [[ "$spec" == *:* ]]; then
    IFS=',' read -ra kvs <<< "${spec#*:}"
    for kv in "${kvs[@]}"; do sets+=(--set "algorithm.$kv"); name+="+$kv"; done
  fi
  dir="${OUT:-runs/table1}/$ds-a$a-r${ROUNDS:-50}/$name-seed$seed"
  if [[ -f "$dir/summary.json" ]]; then echo "done already: $dir"; exit 0; fi
  if [[ -f "$dir/checkpoint.safetensors" ]]; then
    echo "resuming $dir"
    exec edgepfl run --resume "$dir" --quiet --threads 1
  fi
  rm -rf "$dir"
  echo "starting $dir"
  exec edgepfl run --quiet --threads 1 --out "$dir" --set seed="$seed" "${sets[@]}" \
    --set dataset.name="$ds" --set dataset.fraction=0.1 --set partition.clients=10 \
    --set partition.alpha="$a" --set model.name=cnn2 --set train.rounds="${ROUNDS:-50}" \
    --set train.local_epochs=5 --set train.lr=0.01 --set train.batch_size=32
fi

datasets=${1:-"mnist fmnist"}
alphas=${2:-"0.1 0.3"}
seeds=${3:-"0 1 2"}
algorithms=${4:-"kapc kapc_bls local fedavg fedprox"}
for seed in $seeds; do
  for ds in $datasets; do
    for a in $alphas; do
      for algo in $algorithms; do echo "$ds $a $seed $algo"; done
    done
  done
done | xargs -P "${JOBS:-1}" -L 1 bash "$0" --one
