#!/usr/bin/env bash
# The hierarchical study's last rounds re-scored under the other personalization protocols,
# from each finished run's checkpoint (bench/grid/reevaluate.py): HierFAVG and FedAvg with
# the global model fine-tuned at test time (algorithm.evaluate=finetune, hierbayes'
# protocol without the pull), hierbayes with the fit under psi* (personalize=cloud).
#
#   bench/papers/hier_reevaluate.sh [ROOT] >> ROOT/reevaluated.jsonl   (default runs/hier3)
#   ONLY=finetune (or cloud) re-scores only that protocol's runs.
# A run already in ROOT/reevaluated.jsonl with the same settings is skipped.
set -uo pipefail
root=${1:-runs/hier3}
done_file="$root/reevaluated.jsonl"
touch "$done_file"
for run in "$root"/*/*/; do
  run=${run%/}
  [[ -f $run/summary.json && -f $run/checkpoint.safetensors ]] || continue
  name=$(basename "$run")
  case $name in
    hierfavg*|fedavg*) [[ ${ONLY:-finetune} == finetune ]] || continue
      sets=(--set algorithm.evaluate=finetune) ;;
    hierbayes+topology.edges=1-*) continue ;;  # one edge: cloud and edge_posterior coincide
    *optimizer=adam*) continue ;;  # the Adam pair is compared as trained
    hierbayes*) [[ $name == *personalize=* || ${ONLY:-cloud} != cloud ]] && continue
      sets=(--set algorithm.personalize=cloud) ;;
    *) continue ;;
  esac
  grep -qF "\"run\": \"$run\", \"round\": 20, \"settings\": [\"${sets[1]}\"]" "$done_file" && continue
  python "$(dirname "$0")/../grid/reevaluate.py" "$run" "${sets[@]}" | tail -1
done
