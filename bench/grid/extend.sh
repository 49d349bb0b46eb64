#!/usr/bin/env bash
# Extend the finished runs of one grid folder to more rounds, into another grid folder:
#   bench/grid/extend.sh SRC_GRID DST_GRID ROUNDS [RUN ...]
#   e.g. bench/grid/extend.sh runs/table2/fmnist-f0.2-r60-lr0.05 runs/table2/fmnist-f0.2-r90-lr0.05 90
# Each run (all of SRC_GRID's, or the RUN names given) is copied with its checkpoint and
# continued with `edgepfl run --resume DST --set train.rounds=ROUNDS`, which gives exactly
# what a run started with ROUNDS rounds gives (tests/test_engine.py). The source stays as it
# is; a copy already at ROUNDS (or that stopped early on its way there: train.early_stopping)
# is skipped and an interrupted one continued. JOBS=2 runs two at a time.
set -euo pipefail
src=$1 dst=$2 rounds=$3
shift 3
if [[ $# -gt 0 ]]; then runs=("$@"); else mapfile -t runs < <(ls "$src"); fi
mkdir -p "$dst"
for name in "${runs[@]}"; do
  if [[ ! -f "$src/$name/checkpoint.safetensors" ]]; then
    echo "no checkpoint to extend: $src/$name" >&2
    continue
  fi
  echo "$name"
done | xargs -P "${JOBS:-1}" -I{} bash -c '
  set -euo pipefail
  src=$1 dst=$2 rounds=$3 name=$4
  run="$dst/$name"
  if [[ -f "$run/summary.json" ]] && python -c "import json, sys
s = json.load(open(sys.argv[1]))
sys.exit(s.get(\"rounds_planned\", s.get(\"rounds\")) != int(sys.argv[2]))" "$run/summary.json" "$rounds"; then
    echo "done already: $run"; exit 0
  fi
  if [[ ! -d "$run" ]]; then
    rm -rf "$run.tmp" && cp -r "$src/$name" "$run.tmp" && mv "$run.tmp" "$run"
  fi
  echo "extending $run to $rounds rounds"
  edgepfl run --resume "$run" --set train.rounds="$rounds" --quiet --threads 1
' _ "$src" "$dst" "$rounds" {}
