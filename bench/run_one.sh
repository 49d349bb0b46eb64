#!/usr/bin/env bash
# One run of a benchmark grid: bench/run_one.sh DIR SEED SPEC [key=value ...]
#   SPEC is an algorithm name, optionally with hyperparameters: fedprox:evaluate=local,mu=0.1
#   (the run goes to DIR/fedprox+evaluate=local+mu=0.1-seed<SEED>); key=value are config
#   settings for every run of the grid (dataset.name=fmnist, train.rounds=50, ...).
# A finished run (summary.json present) is skipped, an interrupted one resumed from its
# checkpoint, so a grid can be stopped and restarted at will. One torch thread per run:
# two runs side by side beat one run on two threads on the project machine.
set -euo pipefail
dir=$1 seed=$2 spec=$3
shift 3
algo=${spec%%:*}
name=$algo
sets=(--set seed="$seed" --set algorithm.name="$algo")
if [[ "$spec" == *:* ]]; then
  IFS=',' read -ra kvs <<< "${spec#*:}"
  for kv in "${kvs[@]}"; do sets+=(--set "algorithm.$kv"); name+="+$kv"; done
fi
for kv in "$@"; do sets+=(--set "$kv"); done
run="$dir/$name-seed$seed"
if [[ -f "$run/summary.json" ]]; then echo "done already: $run"; exit 0; fi
if [[ -f "$run/checkpoint.safetensors" ]]; then
  echo "resuming $run"
  exec edgepfl run --resume "$run" --quiet --threads 1
fi
rm -rf "$run"
echo "starting $run"
exec edgepfl run --quiet --threads 1 --out "$run" "${sets[@]}"
