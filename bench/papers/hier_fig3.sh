#!/usr/bin/env bash
# Wen et al.'s Fig. 3 study, reduced to a federation small enough for the project
# machine: the number of edge networks K = 2, 5, 10 under one cloud, 100 clients in total
# (the paper's S = 100 clients per edge is left to a larger machine), participation
# f = 0.1 of each edge, tau = 1 local epoch, k2 = 2 edge rounds per cloud round, 20 cloud
# rounds, 20% of MNIST / Fashion-MNIST, non-IID by pathological shards (2 classes per
# client) and by Dirichlet 0.1 (at least 5 training samples per client: 10 is not
# reachable for every seed with 100 clients on 20% of the data). Personalized (Eq. 33-34) and global (Algorithm 3)
# accuracy both come out of every run. Links and devices: Wen et al.'s Table 2 (system.profile =
# wen_table2, read with the band noise), for the simulated time.
#
#   bench/papers/hier_fig3.sh [SEEDS] [KS] [SETTINGS] [METHODS]
#     defaults: "0", "2 5 10", "mnist:dirichlet mnist:pathological fmnist:dirichlet fmnist:pathological",
#     METHODS "hierbayes hierfavg flat fedavg local hierbayes_cloud pfedbayes"
#   JOBS=2 runs two at a time; OUT=dir root folder (default runs/hier_fig3); DRY=1 prints
#   the grid's lines instead (one run each, for bench/grid/run_one.sh), to queue them in
#   another order: ... | xargs -P 2 -L 1 bash bench/grid/run_one.sh
#   ASSIGNMENT=random (default) puts clients under edges at random, so an edge's clients
#   share nothing (these splits draw no edges): the grid measures the hierarchy's cost, not
#   its use. ASSIGNMENT=similar (with an OUT of its own: run names do not carry it) groups
#   clients of close label histograms; edges drawn from
#   the data themselves are bench/papers/hier_study.sh's.
#
# METHODS: hierbayes (personalization through the edge posterior, the default), hierbayes_cloud
# (the same fit under psi*), hierfavg: once per K; flat (hierbayes on one edge: the two-level
# model), fedavg, local and pfedbayes: once per setting and seed, K does not apply.
# pfedbayes is matched to hierbayes: SGD at train.lr for both of its distributions, 2 local
# epochs a round (hierbayes' k2 x tau), and scored like hierbayes, by a one-epoch fit of every
# client from the current global distribution (personalize = fit).
# hierbayes_adam and pfedbayes_adam: the same pair both under Adam at 0.001 (pfedbayes' own
# optimizer and rate; hierbayes per K).
# Collect with: python bench/papers/collect_hier.py OUT/* (one table per setting)
set -euo pipefail
# a star (no edges) takes one edge round: the grid's k2 = 2 is for the hierarchies
star="topology.edge_rounds=1"
seeds=${1:-"0"}
ks=${2:-"2 5 10"}
settings=${3:-"mnist:dirichlet mnist:pathological fmnist:dirichlet fmnist:pathological"}
methods=${4:-"hierbayes hierfavg flat fedavg local hierbayes_cloud pfedbayes"}
for s in $settings; do
  ds=${s%%:*} scheme=${s#*:}
  # (no trailing blank on a line: xargs -L would join it with the next)
  extra=$( [[ $scheme == dirichlet ]] && echo " partition.min_size=5" || true )
  for seed in $seeds; do
    for m in $methods; do
      case $m in
        hierbayes|hierfavg) specs=$(for k in $ks; do echo "$m:topology.edges=$k"; done) ;;
        hierbayes_cloud) specs=$(for k in $ks; do echo "hierbayes:topology.edges=$k,personalize=cloud"; done) ;;
        flat) specs="hierbayes:topology.edges=1" ;;
        pfedbayes) specs="pfedbayes:optimizer=sgd,personal_lr=0.01,global_lr=0.01,train.local_epochs=2,personalize=fit,$star" ;;
        hierbayes_adam) specs=$(for k in $ks; do echo "hierbayes:topology.edges=$k,optimizer=adam,train.lr=0.001"; done) ;;
        pfedbayes_adam) specs="pfedbayes:train.local_epochs=2,personalize=fit,$star" ;;
        *) specs="$m:$star" ;;
      esac
      for spec in $specs; do
        echo "${OUT:-runs/hier_fig3}/$ds-$scheme-c100 $seed $spec" \
             "dataset.name=$ds dataset.fraction=0.2 partition.clients=100 partition.scheme=$scheme" \
             "partition.alpha=0.1 partition.classes_per_client=2 train.participation=0.1" \
             "train.local_epochs=1 train.rounds=20 eval.every=5 topology.edge_rounds=2" \
             "topology.assignment=${ASSIGNMENT:-random} system.profile=wen_table2$extra"
      done
    done
  done
done | if [[ -n ${DRY:-} ]]; then cat; else
  xargs -P "${JOBS:-1}" -L 1 bash "$(dirname "$0")/../grid/run_one.sh"; fi
