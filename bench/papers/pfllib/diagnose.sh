#!/usr/bin/env bash
# Issue 58, "Against PFLlib": PFLlib's runs again with one difference from edgepfl removed,
# to tell which one makes a gap (bench/papers/README.md). Same split, settings and -t 3 as
# run_all.sh; results in $RUNS/pfllib_<diagnostic>/, compared with
#   .venv/bin/python bench/papers/pfllib/collect.py --pfllib-dir pfllib_<diagnostic> --methods ...
#   bash bench/papers/pfllib/diagnose.sh keeplast "FedAvg Ditto"   # train on the short last batch
#   bash bench/papers/pfllib/diagnose.sh squared FedDyn             # FedDyn's penalty squared
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
PFLLIB=${PFLLIB:-/work/pfllib-src}
PFLPY=${PFLPY:-/work/pfllib-venv/bin/python}
RUNS=${RUNS:-/work/pfllib-runs}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
ROUNDS=${ROUNDS:-15}; LR=${LR:-0.01}
what=$1; methods=$2
case $what in
  keeplast) flag=--keep-last-batch ;;
  squared) flag=--squared-feddyn ;;
  *) echo "diagnostic: keeplast or squared" >&2; exit 2 ;;
esac
declare -A PFL=([FedAvg]="" [FedPer]="" [Ditto]="-mu 0.1 -pls 1" [FedRep]="-pls 1" [APFL]="-al 0.25"
                [SCAFFOLD]="-slr 1.0" [FedDyn]="-al 0.01" [FedALA]="-et 1.0 -s 80 -p 2")
mkdir -p "$RUNS/logs"
for m in $methods; do
  echo "$(date -u +%T) PFLlib $m ($what)"
  # shellcheck disable=SC2086
  "$PFLPY" "$HERE/run_pfllib.py" --pfllib "$PFLLIB" --dataset MNIST_ep20 $flag \
    --out "$RUNS/pfllib_$what" -- -algo "$m" -gr "$ROUNDS" -t 3 -lbs 10 -lr "$LR" -ls 1 -nc 20 \
    -jr 1 -eg 1 -dev cpu -go "$what" ${PFL[$m]} > "$RUNS/logs/pfllib_${what}_$m.log" 2>&1 \
    || echo "  failed, see $RUNS/logs/pfllib_${what}_$m.log"
done
echo "$(date -u +%T) done"
