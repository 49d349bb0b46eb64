#!/usr/bin/env bash
# Hierarchical Bayesian FL, second pass (learned per-layer variances, personalization
# through the edge posterior): the defaults against their alternatives and the peers, on the
# federation of bench/papers/hier_table.sh (MNIST 10%, Dirichlet 0.1, 20 clients on 2 edges of 10,
# participation 0.5, k2 = 2 edge rounds of 1 local epoch, 20 cloud rounds, eval every 2).
#
#   bench/papers/hier_second_pass.sh [SEEDS]      (default "0"; JOBS=2 runs two at a time)
#   python bench/papers/collect_hier.py runs/hier2
#
# pfedbayes is matched to hierbayes' optimizer (SGD at train.lr = 0.01 for both of its
# distributions) and to its client work per cloud round (2 local epochs = k2 x 1).
set -euo pipefail
seeds=${1:-"0"}
edges="topology.edges=2,topology.edge_rounds=2"
methods=${2:-"hierbayes:$edges hierbayes:$edges,personalize=cloud hierbayes:$edges,client_var=fixed hierbayes:topology.edges=1,topology.edge_rounds=2 hierfavg:$edges pfedbayes:optimizer=sgd,personal_lr=0.01,global_lr=0.01,train.local_epochs=2 fedavg local"}
for seed in $seeds; do
  for m in $methods; do
    echo "${OUT:-runs/hier2}/mnist-a0.1-c20 $seed $m dataset.name=mnist dataset.fraction=0.1" \
         "partition.clients=20 partition.alpha=0.1 train.participation=0.5" \
         "train.local_epochs=1 train.rounds=20 eval.every=2 topology.assignment=contiguous"
  done
done | xargs -P "${JOBS:-1}" -L 1 bash "$(dirname "$0")/../grid/run_one.sh"
