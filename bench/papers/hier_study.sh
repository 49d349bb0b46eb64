#!/usr/bin/env bash
# Wen et al.'s question on edges that mean something (issue 55): does the edge posterior
# beat the cloud prior when an edge's clients share a class mix, and does hierbayes beat
# HierFAVG fine-tuned? 40 clients, 20% of MNIST / Fashion-MNIST, partition.scheme =
# hierarchical (each of K edges draws a class mix ~ Dir(0.3), each of its clients a mix ~
# Dir(1.0 x the edge's)), K = 2, 5, 10; participation 0.25 of each edge, k2 = 2 edge rounds
# of one local epoch per cloud round, 20 cloud rounds, evaluation every 5.
# The control: the same split and clients under edges drawn at random
# (topology.assignment = random), for hierbayes and HierFAVG. FedAvg and Local run on a star
# over the same split (partition.edges = K), with 2 local epochs a round: the hierarchies'
# k2 x one epoch. The last round is re-scored by bench/papers/hier_reevaluate.sh: hierbayes
# under psi* (the cloud prior), HierFAVG and FedAvg fine-tuned at test time.
#
#   bench/papers/hier_study.sh [SEEDS] [KS] [DATASETS] [METHODS]
#     defaults: "0 1 2", "2 5 10", "mnist fmnist", "hierbayes hierfavg fedavg local";
#     hierbayes_samples adds hierbayes with weighting = samples on the split's edges
#   JOBS=2 runs two at a time; OUT=dir root folder (default runs/hier_study); DRY=1 prints
#   the grid's lines (one run each, for bench/grid/run_one.sh). Seeds are the outer loop, so
#   a grid cut short has every cell of its first seeds.
# Then:
#   bench/papers/hier_reevaluate.sh OUT >> OUT/reevaluated.jsonl
#   python bench/papers/collect_hier_study.py OUT
set -euo pipefail
seeds=${1:-"0 1 2"}
ks=${2:-"2 5 10"}
datasets=${3:-"mnist fmnist"}
methods=${4:-"hierbayes hierfavg fedavg local"}
for seed in $seeds; do
  for ds in $datasets; do
    for k in $ks; do
      for m in $methods; do
        case $m in
          hierbayes|hierfavg)
            specs="$m:topology.edges=$k $m:topology.edges=$k,topology.assignment=random" ;;
          hierbayes_samples)  # the edge and cloud means weighted by samples (the split's edges)
            specs="hierbayes:topology.edges=$k,weighting=samples" ;;
          *) specs="$m:topology.edge_rounds=1,train.local_epochs=2" ;;
        esac
        for spec in $specs; do
          # (no trailing blank on a line: xargs -L would join it with the next)
          echo "${OUT:-runs/hier_study}/$ds-hier-K$k $seed $spec" \
               "dataset.name=$ds dataset.fraction=0.2 partition.clients=40" \
               "partition.scheme=hierarchical partition.edge_alpha=0.3 partition.alpha=1.0" \
               "partition.edges=$k train.participation=0.25 train.local_epochs=1" \
               "train.rounds=20 eval.every=5 topology.edge_rounds=2 system.profile=wen_table2"
        done
      done
    done
  done
done | if [[ -n ${DRY:-} ]]; then cat; else
  xargs -P "${JOBS:-1}" -L 1 bash "$(dirname "$0")/../grid/run_one.sh"; fi
