#!/usr/bin/env bash
# The papers' grids that do not fit the project machine, as one call on a lent device
# machine (16 CPU cores beside its GPU): HMPL's Tables
# IV-V with today's defaults (bench/papers/hmpl_tables.sh) on the GPU, several at a time,
# each tier's clients batched (train.batch_clients); `hier` (or `both`) adds cells of the
# hierarchical Bayesian Fig. 3 study (bench/papers/hier_fig3.sh) as one-thread CPU runs side
# by side (its 136 runs are done: only for more seeds or settings).
# Runs go to runs/device_grids; what comes back is one archive in $OUT (the device call's
# folder returns at most 8 files) of every finished run's figures, without checkpoints. A run
# cut off by LIMIT (seconds) is lost.
#
# The device machine reaches nothing outside and ../shared does not travel: copy the data
# into an ignored folder of the checkout first and carry it (about 42 MB; the tree's limit
# is 64 MiB):
#     mkdir -p .devdata && cp -r ../shared/data/MNIST ../shared/data/FashionMNIST .devdata/
#     echo /.devdata/ >> .git/info/exclude
# then, as the device call (carry [".devdata"], timeout_s 600):
#     EDGEPFL_DATA=.devdata LIMIT=540 bash bench/checks/device_grids.sh [hmpl|hier|both]
# HIER_SEEDS and HIER_SETTINGS choose the hierarchical cells (default: seeds "1 2" of
# "mnist:pathological fmnist:dirichlet").
#
# Back on the project machine: copy $OUT's runs under runs/, collect them
# (bench/papers/collect_hier.py, collect_hmpl.py), keep them (bench/grid/keep_results.py)
# and say in bench/papers/README.md which machine ran which cells.
set -uo pipefail
what=${1:-hmpl}
back=${OUT:-runs/device_grids_out}
out=runs/device_grids
limit=${LIMIT:-540}
cores=$(nproc)
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
export EDGEPFL_DATA=${EDGEPFL_DATA:-$(cd "$here/.." && pwd)/../shared/data}
start=$(date +%s)
# the machine's own torch; edgepfl from this checkout (no index is reachable from there)
python -c "import edgepfl" 2>/dev/null || pip install --quiet --no-deps --no-build-isolation -e . \
  || export PYTHONPATH=$PWD/src
python -c "import edgepfl.cli" || { echo "edgepfl does not import here: see above"; exit 1; }
if [[ $what == hier || $what == both ]]; then
  # the seeds and settings the project machine did not reach (bench/papers/README.md)
  jobs=$((cores - 1)); [[ $what == both ]] && jobs=$((cores - 4))
  ( OUT="$out/hier3" JOBS=$jobs timeout $((limit - 20)) bash "$here/papers/hier_fig3.sh" "${HIER_SEEDS:-1 2}" "2 5 10" \
      "${HIER_SETTINGS:-mnist:pathological fmnist:dirichlet}" "hierbayes hierfavg flat fedavg local pfedbayes" \
      > "$out/hier3.log" 2>&1 ) &
fi
if [[ $what == hmpl || $what == both ]]; then
  python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')" &&
  ( OUT="$out/hmpl" JOBS=3 EVERY=5 HORIZON=800 EXTRA="train.device=cuda train.batch_clients=true" \
      timeout $((limit - 20)) bash "$here/papers/hmpl_tables.sh" 100 mnist "v iv" "0 1 2" \
      "hmpl hmpl_s" > "$out/hmpl.log" 2>&1 ) &
fi
wait
echo "device_grids: $(( $(date +%s) - start )) s; finished runs:"
find "$out" -name summary.json | sed 's|/summary.json||' | sort
mkdir -p "$back"
cp "$out"/*.log "$back"/ 2>/dev/null
# figures only: checkpoints are large, and a cut-off run cannot resume on a fresh machine
find "$out" -name summary.json -printf '%h\n' | sed "s|^$out/||" |
  tar czf "$back/runs.tgz" -C "$out" --exclude=checkpoint.safetensors --exclude='*.png' -T -
ls -l "$back"