#!/usr/bin/env bash
# Hierarchical Bayesian FL (Wen et al.) against its peers, a reduced federation small enough
# for the project machine: MNIST (10% of the data), Dirichlet alpha 0.1, 20 clients
# on 2 edges (10 each), participation 0.5 of each edge, k2 = 2 edge rounds per cloud round,
# tau = 1 local epoch (Table 2), 20 cloud rounds, evaluation every 2 rounds.
#
#   bench/papers/hier_table.sh [SEEDS] [METHODS]
#     defaults: "0 1 2" and every method below
#   JOBS=2  runs two at a time;  OUT=dir  root folder (default runs/hier)
#
# Star methods run on the same clients without edges; the hierarchical ones on 2 edges;
# "flat" is hierbayes with one edge. Finished runs are skipped, interrupted ones resumed
# (bench/grid/run_one.sh). Collect with: python bench/papers/collect_hier.py OUT [bench/results/hier]
set -euo pipefail
seeds=${1:-"0 1 2"}
edges="topology.edges=2,topology.edge_rounds=2"
methods=${2:-"hierbayes:$edges hierbayes:$edges,topology.mode=async hierbayes:topology.edges=1,topology.edge_rounds=2 hierfavg:$edges fedavg fedprox local pfedbayes"}
for seed in $seeds; do
  for m in $methods; do
    echo "${OUT:-runs/hier}/mnist-a0.1-c20 $seed $m dataset.name=mnist dataset.fraction=0.1" \
         "partition.clients=20 partition.alpha=0.1 train.participation=0.5" \
         "train.local_epochs=1 train.rounds=20 eval.every=2 topology.assignment=contiguous"
  done
done | xargs -P "${JOBS:-1}" -L 1 bash "$(dirname "$0")/../grid/run_one.sh"
