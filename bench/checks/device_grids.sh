#!/usr/bin/env bash
# The papers' grids that do not fit the project machine, as one call on a lent device
# machine (16 CPU cores beside its GPU): `hmpl` runs the HMPL Tables IV-V runs still wanted
# (hmpl_queue below: the lines of bench/papers/hmpl_tables.sh PRINT=1, the longest first),
# 14 at a time on the one GPU, each tier's clients batched (train.batch_clients); `hier` (or
# `both`) adds cells of the hierarchical Bayesian Fig. 3 study (bench/papers/hier_fig3.sh)
# as one-thread CPU runs side by side (its 136 runs are done: only for more seeds or
# settings); `dcpfl` runs DC-PFL's Table II at the paper's full data (50 clients x 1,200
# images, bench/papers/dcpfl_table2.sh FRACTION=1, three seeds, seven methods: about an hour
# a run on one CPU thread), each run's 50 clients batched on the GPU, DCPFL_JOBS at a time
# (default 12). monitor.log records the GPU's use and the finished count every minute.
# For a dry run of the mechanics on a CPU: DEVICE_SETTINGS=train.device=cpu LONG_ROUNDS=1
# FRACTION=0.02 HMPL_JOBS=2. A 100-round HMPL run beside 13 others needs about 20 minutes
# of an H200, past one call's 10: give fewer runs the GPU (HMPL_JOBS) or fewer SEEDS.
# Runs go to runs/device_grids; what comes back is one archive in $OUT (the device call's
# folder returns at most 8 files) of every finished run's figures, without checkpoints. A run
# cut off by LIMIT (seconds) comes back as its rounds so far (partial.tgz) and
# resumes from its checkpoint in a next call while the machine is still warm.
#
# The device machine reaches nothing outside and ../shared does not travel: copy the data
# into an ignored folder of the checkout first and carry it (about 42 MB), with wheels of
# what its Python may lack (pydantic and its dependencies, for its Python 3.12):
#     pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl pydantic==2.11.7 pydantic-core==2.33.2 \
#       annotated-types==0.7.0 typing-inspection==0.4.1
#     mkdir -p .devdata && cp -r ../shared/data/MNIST ../shared/data/FashionMNIST .devdata/
#     printf '/.devdata/\n/.whl/\n' >> .git/info/exclude
# The tree that travels is limited to 64 MiB, and bench/results alone is 35 MB of tracked
# text: untrack it for the call only (the files stay on disk), and track it again after:
#     git rm -r --cached -q bench/results && echo /bench/results/ >> .git/info/exclude
#     ... the device call (carry [".devdata", ".whl"], timeout_s 600):
#     EDGEPFL_DATA=.devdata LIMIT=540 bash bench/checks/device_grids.sh [hmpl|hier|both]
#     git reset -q bench/results && sed -i '\|^/bench/results/$|d' .git/info/exclude
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
# the machine's own torch; edgepfl from this checkout (no index is reachable from there):
# dependencies it lacks (pydantic) come as wheels in a carried .whl folder
# (/work/.library/device/README.md says how to download them)
if ! python -c "import pydantic" 2>/dev/null && [[ -d .whl ]]; then
  python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! command -v edgepfl >/dev/null; then  # run_one.sh calls the command
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
  mkdir -p /tmp/edgepfl-bin
  printf '#!/bin/sh\nexec python -c "import sys; from edgepfl.cli import main; sys.exit(main())" "$@"\n' \
    > /tmp/edgepfl-bin/edgepfl
  chmod +x /tmp/edgepfl-bin/edgepfl
  export PATH=/tmp/edgepfl-bin:$PATH
fi
python -c "import edgepfl.cli" || { echo "edgepfl does not import here: see above"; exit 1; }
python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.cuda.is_available())"
jobs_pids=()
if [[ $what == hier || $what == both ]]; then
  # the seeds and settings the project machine did not reach (bench/papers/README.md)
  jobs=$((cores - 1)); [[ $what == both ]] && jobs=$((cores - 4))
  ( OUT="$out/hier3" JOBS=$jobs timeout $((limit - 20)) bash "$here/papers/hier_fig3.sh" "${HIER_SEEDS:-1 2}" "2 5 10" \
      "${HIER_SETTINGS:-mnist:pathological fmnist:dirichlet}" "hierbayes hierfavg flat fedavg local pfedbayes" \
      > "$out/hier3.log" 2>&1 ) &
  jobs_pids+=($!)
fi
hmpl_queue() {  # HMPL's runs not done yet (bench/papers/README.md, "Not run"), longest first
  # (2026-11-28 it held the 30-round seed 2, now kept in bench/results/hmpl/*-h800)
  local grid="bash $here/papers/hmpl_tables.sh" dev=${DEVICE_SETTINGS-"train.device=cuda train.batch_clients=true"}
  export OUT="$out/hmpl39" EVERY=5 HORIZON=800 PRINT=1 EXTRA="$dev"
  local r=${LONG_ROUNDS:-100} seeds=${SEEDS:-"0 1 2"}
  # issue 54's deciding experiment first: every client Sup, at most 1 and 2 stages deep,
  # against the kept HMPL_S of *-regular-r30-h800 (the same protocol). With no Com or Ord
  # client there is no time threshold (tiers.json: bound_s null), so a Sup model grows to
  # sup_max_depth unbounded: the Sup model itself, at each depth
  EXTRA="$EXTRA algorithm.tier_ratio=[0,0,1]" TAG=-allsup $grid "${SUP_ROUNDS:-30}" \
    "mnist fmnist" v "$seeds" "hmpl:sup_max_depth=1 hmpl:sup_max_depth=2"
  # then Tables IV-V's HMPL with the bounded Sup (growth_revert, the default since issue
  # 54), at the 30 rounds of the kept rows, and Fig. 7's ablation (every client Com; plain
  # FedAvg on the Ord model without SPP), MNIST and Fashion-MNIST V
  $grid 30 "mnist fmnist" "v iv" "$seeds" "hmpl:growth_revert=true"
  $grid 30 "mnist fmnist" v "$seeds" "fedavg:model.name=hmpl_flat"
  EXTRA="$EXTRA algorithm.tier_ratio=[1,0,0]" TAG=-allcom $grid 30 "mnist fmnist" v "$seeds" hmpl
  $grid "$r" mnist v "$seeds" "hmpl:com_align=fit"  # the name MNIST V's HMPL is kept under
  $grid "$r" mnist iv "$seeds" hmpl
  $grid "$r" fmnist "iv v" "$seeds" hmpl
  $grid "$r" "mnist fmnist" "iv v" "$seeds" "hmpl_s heterofl fedavg fedper"
}
if [[ $what == dcpfl ]]; then
  OUT="$out/table2full" FRACTION=${FRACTION:-1} PRINT=1 \
    EXTRA=${DEVICE_SETTINGS-"train.device=cuda train.batch_clients=true"} \
    bash "$here/papers/dcpfl_table2.sh" "${SEEDS:-0 1 2}" > "$out/dcpfl_queue.txt"
  echo "dcpfl: $(wc -l < "$out/dcpfl_queue.txt") runs queued, ${DCPFL_JOBS:-12} at a time"
  ( timeout $((limit - 20)) xargs -P "${DCPFL_JOBS:-12}" -L 1 \
      bash "$here/grid/run_one.sh" < "$out/dcpfl_queue.txt" > "$out/dcpfl.log" 2>&1 ) &
  jobs_pids+=($!)
fi
if [[ $what == hmpl || $what == both ]]; then
  if [[ -z ${DEVICE_SETTINGS+x} ]]; then
    python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')" ||
      exit 1
  fi
  hmpl_queue > "$out/hmpl_queue.txt"
  echo "hmpl: $(wc -l < "$out/hmpl_queue.txt") runs queued, ${HMPL_JOBS:-$((cores - 2))} at a time"
  # one CPU core a run drives its batched steps on the shared GPU; one core is left over
  ( timeout $((limit - 20)) xargs -P "${HMPL_JOBS:-$((cores - 2))}" -L 1 \
      bash "$here/grid/run_one.sh" < "$out/hmpl_queue.txt" > "$out/hmpl.log" 2>&1 ) &
  jobs_pids+=($!)
fi
( while sleep "${MONITOR_EVERY:-60}"; do  # how busy the GPU and the CPUs were, for the record
    echo "$(( $(date +%s) - start )) s: $(find "$out" -name summary.json | wc -l) finished," \
      "$(find "$out" -name metrics.csv -exec sh -c 'tail -n +2 "$1" | wc -l' _ {} \; |
         awk '{n += $1} END {print n + 0}') rounds done in all;" \
      "GPU $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null);" \
      "load $(cut -d' ' -f1 /proc/loadavg)"
  done >> "$out/monitor.log" ) &
monitor=$!
wait "${jobs_pids[@]}"
kill "$monitor"
# xargs' timeout leaves its runs going: stop them (only this script's, whose --out or
# --resume is under $out) before the figures are packed
pkill -f -- "(--out|--resume) $out/" 2>/dev/null; sleep 2
echo "device_grids: $(( $(date +%s) - start )) s; finished runs:"
find "$out" -name summary.json | sed 's|/summary.json||' | sort
mkdir -p "$back"
cp "$out"/*.log "$back"/ 2>/dev/null
# figures only: checkpoints are large, and a cut-off run cannot resume on a fresh machine
find "$out" -name summary.json -printf '%h\n' | sed "s|^$out/||" |
  tar czf "$back/runs.tgz" -C "$out" --exclude=checkpoint.safetensors --exclude='*.png' -T -
# the runs the limit cut off: their rounds so far (metrics.csv, config), to see the pace and
# to size the next call; they resume only on this machine while it is still warm
find "$out" -name metrics.csv -printf '%h\n' | while read -r d; do
  [[ -f $d/summary.json ]] || echo "${d#"$out"/}"; done > "$out/unfinished.txt"
if [[ -s $out/unfinished.txt ]]; then
  echo "cut off by LIMIT: $(wc -l < "$out/unfinished.txt") runs (partial.tgz)"
  tar czf "$back/partial.tgz" -C "$out" --exclude=checkpoint.safetensors --exclude='*.png' \
    -T "$out/unfinished.txt"
fi
ls -l "$back"