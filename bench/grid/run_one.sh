#!/usr/bin/env bash
# One run of a benchmark grid: bench/grid/run_one.sh DIR SEED SPEC [key=value ...]
#   SPEC is an algorithm name, optionally with settings of its own: fedprox:evaluate=local,mu=0.1
#   sets algorithm.evaluate and algorithm.mu, fedbn:model.name=cnn2_bn a full config key
#   (the run goes to DIR/fedprox+evaluate=local+mu=0.1-seed<SEED>); key=value are config
#   settings for every run of the grid (dataset.name=fmnist, train.rounds=50, ...); the
#   SPEC's own settings win over them.
# A finished run (summary.json present, here or kept under bench/results/ with the settings
# asked: bench/grid/kept_matches.py) is skipped, an interrupted one resumed from its
# checkpoint, so a grid can be stopped and restarted at will. One torch thread per run:
# two runs side by side beat one run on two threads on the project machine.
set -euo pipefail
dir=$1 seed=$2 spec=$3
shift 3
algo=${spec%%:*}
name=$algo
sets=(--set seed="$seed" --set algorithm.name="$algo")
for kv in "$@"; do sets+=(--set "$kv"); done
if [[ "$spec" == *:* ]]; then  # after the grid's settings, so that they win
  IFS=',' read -ra kvs <<< "${spec#*:}"
  for kv in "${kvs[@]}"; do
    key=${kv%%=*}
    if [[ "$key" == *.* ]]; then sets+=(--set "$kv"); else sets+=(--set "algorithm.$kv"); fi
    name+="+$kv"
  done
fi
run="$dir/$name-seed$seed"
if [[ -f "$run/summary.json" ]]; then echo "done already: $run"; exit 0; fi
# a run kept in the repository from an earlier machine (bench/grid/keep_results.py) is done too
kept="$(cd "$(dirname "$0")/.." && pwd)/results/${run#runs/}"
# (with the same settings: a default changed since then makes it another method)
if [[ "$run" == runs/* && -f "$kept/summary.json" ]]; then
  if python "$(dirname "$0")/kept_matches.py" "$kept" "${sets[@]}"; then
    echo "kept already: $kept"; exit 0
  fi
  echo "not run: rename the kept run or this grid line's (above)" >&2; exit 1
fi
if [[ -f "$run/checkpoint.safetensors" ]]; then
  echo "resuming $run"
  exec edgepfl run --resume "$run" --quiet --threads 1
fi
rm -rf "$run"
echo "starting $run"
exec edgepfl run --quiet --threads 1 --out "$run" "${sets[@]}"
