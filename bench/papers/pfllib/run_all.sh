#!/usr/bin/env bash
# Issue 58, "Against PFLlib": 8 methods x 3 seeds x 2 projects on one client split, one core,
# one run at a time. PFLlib runs in its own venv (never imported by edgepfl); edgepfl runs from
# a clean export of its commit (EDGEPFL_SRC) so that edits in progress in the work tree do
# not enter the runs. Logs and results under $RUNS. See bench/papers/README.md, "Against PFLlib".
#   bash bench/papers/pfllib/run_all.sh [method ...]      (default: all eight)
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../../.." && pwd)
PFLLIB=${PFLLIB:-/work/pfllib-src}
PFLPY=${PFLPY:-/work/pfllib-venv/bin/python}
RUNS=${RUNS:-/work/pfllib-runs}
EDGEPFL_SRC=${EDGEPFL_SRC:-$REPO/src}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 EDGEPFL_DATA=${EDGEPFL_DATA:-/work/shared/data}
ROUNDS=${ROUNDS:-20}; LR=${LR:-0.01}; BATCH=10; SEEDS=${SEEDS:-"0 1 2"}
DATA=MNIST_ep20                       # PFLlib's dataset/MNIST_ep20 -> $RUNS/split/pfllib
mkdir -p "$RUNS/logs"

# PFLlib's main.py options per method (common: below), edgepfl's --set per method
declare -A PFL EDGE
PFL[FedAvg]="";                       EDGE[FedAvg]="algorithm.name=fedavg"
PFL[FedPer]="";                       EDGE[FedPer]="algorithm.name=fedper algorithm.personal_layers=1"
PFL[Ditto]="-mu 0.1 -pls 1";          EDGE[Ditto]="algorithm.name=ditto algorithm.lamda=0.1 algorithm.personal_epochs=1"
PFL[FedRep]="-pls 1";                 EDGE[FedRep]="algorithm.name=fedrep algorithm.personal_layers=1 algorithm.head_epochs=1 algorithm.body_epochs=1"
PFL[APFL]="-al 0.25";                 EDGE[APFL]="algorithm.name=apfl algorithm.alpha=0.25 algorithm.alpha_learned=true"
PFL[SCAFFOLD]="-slr 1.0";             EDGE[SCAFFOLD]="algorithm.name=scaffold algorithm.eta_g=1.0 algorithm.weighting=uniform"
PFL[FedDyn]="-al 0.01";               EDGE[FedDyn]="algorithm.name=feddyn algorithm.alpha=0.01 algorithm.weighting=uniform"
PFL[FedALA]="-et 1.0 -s 80 -p 2";     EDGE[FedALA]="algorithm.name=fedala algorithm.eta=1.0 algorithm.rand_percent=80 algorithm.layer_idx=1"

ln -sfn "$RUNS/split/pfllib" "$PFLLIB/dataset/$DATA"
METHODS=${*:-FedAvg FedPer Ditto FedRep APFL SCAFFOLD FedDyn FedALA}
for m in $METHODS; do
  echo "$(date -u +%T) PFLlib $m"
  # shellcheck disable=SC2086
  "$PFLPY" "$HERE/run_pfllib.py" --pfllib "$PFLLIB" --dataset $DATA --out "$RUNS/pfllib" -- \
    -algo "$m" -gr "$ROUNDS" -t 3 -lbs $BATCH -lr "$LR" -ls 1 -nc 20 -jr 1 -eg 1 -dev cpu \
    -go ep ${PFL[$m]} > "$RUNS/logs/pfllib_$m.log" 2>&1 || echo "  failed, see $RUNS/logs/pfllib_$m.log"
  for s in $SEEDS; do
    echo "$(date -u +%T) edgepfl $m seed $s"
    sets=()
    for kv in ${EDGE[$m]}; do sets+=(--set "$kv"); done
    rm -rf "$RUNS/edgepfl/${m}_$s"
    PYTHONPATH="$EDGEPFL_SRC" "$REPO/.venv/bin/python" -m edgepfl.cli run \
      --plugin "$HERE/fedavgcnn_plugin.py" --set dataset.name=npz \
      --set dataset.path="$RUNS/split/edgepfl.npz" --set partition.scheme=natural \
      --set model.name=pfllib_fedavgcnn --set train.rounds="$ROUNDS" --set train.local_epochs=1 \
      --set train.batch_size=$BATCH --set train.lr="$LR" --set train.threads=1 \
      --set output.plots=false --set output.checkpoint_every=never --set seed="$s" "${sets[@]}" \
      --out "$RUNS/edgepfl/${m}_$s" > "$RUNS/logs/edgepfl_${m}_$s.log" 2>&1 \
      || echo "  failed, see $RUNS/logs/edgepfl_${m}_$s.log"
  done
done
echo "$(date -u +%T) done"
