#!/usr/bin/env bash
# HMPL (Zhang et al., TNNLS 2023), Tables IV (arbitrary image sizes) and V (regular sizes) on
# MNIST and Fashion-MNIST, with the paper's protocol (Sec. IV-B): 60 devices of 1,000
# training images each, IID (the whole training set), 10 devices per round, batch 20, the
# clients' rate decaying from 0.01 to 0.001 over the rounds, early stopping, and the Ord
# model's backbone for every method (hmpl_ord: 3x3 convolutions of 64, 128, 256 channels, SPP,
# FC 1024-1024-10); device speeds from HMPL's three classes (system.devices=tiers, 3:4:3).
#
#   bench/papers/hmpl_tables.sh ROUNDS [DATASETS] [TABLES] [SEEDS] [ALGORITHMS]
#     ROUNDS      communication rounds (the paper: 800 with early stopping; required)
#     defaults:   "mnist fmnist" "iv v" "0" "hmpl hmpl_s"
#     TABLES      iv = images cropped to 16:9, 4:3, 1:1, 3:4, 9:16 (dataset.aspect_ratios),
#                 v = whole images
#     ALGORITHMS  add the baselines, e.g. "hmpl hmpl_s fedavg fedprox l2sgd fedper pfedme
#                 hypcluster fedmd perfedavg heterofl"; fedprox runs with the paper's mu = 0.1,
#                 perfedavg with its beta = 0.005, l2sgd with p = 0.0196 (a round is one
#                 averaging step after (1-p)/p = 50 local steps on average: one epoch of
#                 1,000 images in batches of 20, the other methods' local work; the
#                 paper gives no p) and fedmd with a public pool of 5,000 MNIST / Fashion-
#                 MNIST images and 1,000 a round (the paper's 60,000 would cost each
#                 client 60 epochs of its own data in transfer learning alone),
#                 unless the spec gives settings: fedprox:mu=1;
#                 hmpl:com_align=fit runs HMPL with Com's aligner refitted every round;
#                 an algorithm that takes whole images only (Algorithm.variable_size; none
#                 of the registered ones) is left out of Table IV with a note
#   JOBS=2         runs two at a time
#   OUT=dir        root folder (default runs/hmpl)
#   DECAY=exponential  the decay's form, linear or cosine (the paper says only "from 0.01 to 0.001")
#   HORIZON=       train.lr_decay_rounds: the rounds the decay spreads over (default ROUNDS;
#                  HORIZON=800 runs the beginning of the paper's 800-round schedule)
#   PATIENCE=20    train.early_stopping, evaluated rounds without a gain (0: off; the paper gives none)
#   DELTA=0        train.early_stopping_delta
#   EPOCHS=1       local epochs per round (the paper states E = 1, for FedProx)
#   EVERY=1        evaluate every this many rounds (early stopping counts evaluated rounds)
#   FRACTION=1     share of the data (a smoke test: FRACTION=0.02 gives 20 images a client)
#   MODEL=hmpl_ord the baselines' model (hmpl runs hmpl_tiers, hmpl_s hmpl_ord)
#   (hmpl and hmpl_s train every client in round 1, algorithm.first_round = all, so that the
#   tiers are tier_ratio of all 60; the baselines train round 1's 10, as in every round)
#   PRINT=1        print the grid's lines (bench/grid/run_one.sh's arguments) instead of
#                  running them, to queue several grids as one (bench/checks/device_grids.sh)
#   EXTRA="k=v ..." further settings for every run, TAG=-name appended to the grid's folder:
#                  the tier-ratio study (Figs. 8-9) is one grid per ratio, e.g.
#                  EXTRA="algorithm.tier_ratio=[0.1,0.5,0.4]" TAG=-com0.1-ord0.5 \
#                      bench/papers/hmpl_tables.sh 30 mnist iv 0 hmpl
#
# Participation 0.1667 of 60 clients is round(10.002) = 10 a round. Runs go seed-major into
# OUT/<dataset>-<arbitrary|regular>-r<rounds>/<algorithm>-seed<k>; finished runs (early
# stopped ones included) are skipped, interrupted ones resumed (bench/grid/run_one.sh). A run
# whose decay spreads over ROUNDS cannot be extended to more rounds: start a new grid (one
# with HORIZON set can be).
# Collect with: python bench/papers/collect_hmpl.py OUT > table.md
set -euo pipefail
rounds=${1:?usage: bench/papers/hmpl_tables.sh ROUNDS [DATASETS] [TABLES] [SEEDS] [ALGORITHMS]}
datasets=${2:-"mnist fmnist"}
tables=${3:-"iv v"}
seeds=${4:-"0"}
algorithms=${5:-"hmpl hmpl_s"}
whole_only=$(python -c "from edgepfl.algorithms import ALGORITHMS
print(' '.join(k for k, a in ALGORITHMS.items() if not a.variable_size))")
protocol="partition.clients=60 partition.scheme=iid train.participation=0.1667"
protocol+=" train.batch_size=20 train.lr=0.01 train.lr_decay=${DECAY:-exponential}"
protocol+=" train.lr_final=0.001 train.early_stopping=${PATIENCE:-20}"
protocol+=" train.early_stopping_delta=${DELTA:-0} train.local_epochs=${EPOCHS:-1}"
protocol+=" train.rounds=$rounds eval.every=${EVERY:-1} dataset.fraction=${FRACTION:-1}"
protocol+=" system.devices=tiers"
[[ -z ${HORIZON:-} ]] || protocol+=" train.lr_decay_rounds=$HORIZON"
for seed in $seeds; do
  for ds in $datasets; do
    for table in $tables; do
      case $table in
        iv) kind=arbitrary crops="dataset.aspect_ratios=16:9,4:3,1:1,3:4,9:16" ;;
        v) kind=regular crops="" ;;
        *) echo "unknown table $table: iv or v" >&2; exit 2 ;;
      esac
      for spec in $algorithms; do
        algo=${spec%%:*}
        if [[ $kind == arbitrary && " $whole_only " == *" $algo "* ]]; then
          echo "# $algo takes whole images only: left out of Table IV" >&2
          continue
        fi
        if [[ $spec != *:* ]]; then
          case $algo in
            fedprox) spec="fedprox:mu=0.1" ;;
            perfedavg|perfedavg_hf) spec="$algo:beta=0.005" ;;
            l2sgd) spec="l2sgd:p=0.0196" ;;
            fedmd) spec="fedmd:public_pool=5000,public_size=1000" ;;
          esac
        fi
        line="${OUT:-runs/hmpl}/$ds-$kind-r$rounds${TAG:-} $seed $spec dataset.name=$ds $protocol"
        [[ -z ${EXTRA:-} ]] || line+=" $EXTRA"
        [[ -z $crops ]] || line+=" $crops"
        [[ $algo == hmpl || $algo == hmpl_s ]] || line+=" model.name=${MODEL:-hmpl_ord}"
        echo "$line"  # no trailing blank: xargs -L would join it to the next line
      done
    done
  done
done | if [[ -n ${PRINT:-} ]]; then cat; else
  xargs -P "${JOBS:-1}" -L 1 bash "$(dirname "$0")/../grid/run_one.sh"; fi
