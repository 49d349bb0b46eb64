#!/usr/bin/env bash
# Wen et al.'s Fig. 3 study, reduced to a federation small enough for the project
# machine: the number of edge networks K = 2, 5, 10 under one cloud, 100 clients in total
# (the paper's S = 100 clients per edge is left to a larger machine), participation
# f = 0.1 of each edge, tau = 1 local epoch, k2 = 2 edge rounds per cloud round, 20 cloud
# rounds, 20% of MNIST / Fashion-MNIST, non-IID by pathological shards (2 classes per
# client) and by Dirichlet 0.1 (at least 5 training samples per client: 10 is not
# reachable for every seed with 100 clients on 20% of the data). Personalized (Eq. 33-34) and global (Algorithm 3)
# accuracy both come out of every run.
#
#   bench/papers/hier_fig3.sh [SEEDS] [KS] [SETTINGS]
#     defaults: "0", "2 5 10", "mnist:dirichlet mnist:pathological fmnist:dirichlet fmnist:pathological"
#   JOBS=2 runs two at a time; OUT=dir root folder (default runs/hier_fig3)
# Collect with: python bench/papers/collect_hier.py OUT/* (one table per setting)
set -euo pipefail
seeds=${1:-"0"}
ks=${2:-"2 5 10"}
settings=${3:-"mnist:dirichlet mnist:pathological fmnist:dirichlet fmnist:pathological"}
for s in $settings; do
  ds=${s%%:*} scheme=${s#*:}
  for seed in $seeds; do
    for k in $ks; do
      echo "${OUT:-runs/hier_fig3}/$ds-$scheme-c100 $seed hierbayes:topology.edges=$k" \
           "dataset.name=$ds dataset.fraction=0.2 partition.clients=100 partition.scheme=$scheme" \
           "partition.alpha=0.1 partition.classes_per_client=2 train.participation=0.1" \
           "train.local_epochs=1 train.rounds=20 eval.every=5 topology.edge_rounds=2" \
           "topology.assignment=random $( [[ $scheme == dirichlet ]] && echo partition.min_size=5 )"
    done
  done
done | xargs -P "${JOBS:-1}" -L 1 bash "$(dirname "$0")/../grid/run_one.sh"
