#!/usr/bin/env bash
# The checks that need a GPU (about 13 minutes on an H200, more than one device call's 10:
# name the steps a call runs, e.g. `gpu_checks.sh algorithm_rounds_cuda eval_batched`):
# whole rounds of ten clients on the CPU's 16 threads, on the GPU and batched on the GPU
# (FedAvg, KAPC, DC-PFL), the batched runs' figures against the CPU's, KAPC's
# state on disk on the GPU, clients batched into one step against one after another, and
# every algorithm's round on the GPU, sequential and batched.
# The most wanted figures come first, and a failing step does not stop the ones after it
# (a device call's time is short and a late step may be cut off). Logs go to $OUT
# (default runs/gpu); record them in bench/checks/README.md, bench/speed/README.md ("On a GPU")
# and bench/LOG.md.
#
#     bash bench/checks/gpu_checks.sh [STEP ...]   # needs a CUDA GPU; no STEP: all of them
set -uo pipefail
only=" $* "
out=${OUT:-runs/gpu}
bench=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')" || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
failed=()
known=" "
step() {  # step NAME COMMAND...: the command's output to the screen and to $out/NAME.log
    local name=$1; shift
    known+="$name "
    [[ "$only" == "  " || "$only" == *" $name "* ]] || return 0
    echo "== $name: $*" | tee "$out/$name.log"
    "$@" 2>&1 | tee -a "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || { echo "== $name failed ($rc)" | tee -a "$out/$name.log"; failed+=("$name"); }
}
step scale_fedavg python "$bench/speed/scale.py" --clients 100 --algorithms fedavg --rounds 5 \
    --modes seq cuda cuda-vmap --set system.count_flops=false train.local_epochs=5
# every algorithm whose client declares itself batchable (the others: docs/architecture.md)
batchable=$(python -c "from edgepfl.algorithms import ALGORITHMS as A
print(' '.join(n for n, a in sorted(A.items()) if a.client.batchable))")
step device_check_batched python "$bench/checks/device_check.py" \
    --algorithms $batchable --rounds 3 \
    --gpu-set train.batch_clients=true --out "$out/device_check_batched.json"
step scale_kapc_dcpfl python "$bench/speed/scale.py" --clients 100 --algorithms kapc dcpfl --rounds 4 \
    --modes seq cuda cuda-vmap --set system.count_flops=false train.local_epochs=5
step device_check_disk python "$bench/checks/device_check.py" --algorithms kapc --rounds 2 \
    --gpu-set train.store=disk --out "$out/device_check_disk.json"
step vmap_step python "$bench/speed/vmap_step.py" --device cuda --clients 10 --steps 50 --batch 32 \
    --repeats 3
step eval_batched python "$bench/speed/eval_batched.py" --device cuda --clients 100 --samples 50 \
    --chunk 100 --repeats 5
# the per-algorithm table's GPU columns (bench/speed/README.md, "Each algorithm's round"):
# every algorithm but fedmd (whose first round alone is minutes of transfer learning),
# sequential (with train.compile on the plain fits: the compiled GPU column) and batched
# (`--compiled` naming none: no compiled runs there); read the wall-clock column
every=$(python -c "from edgepfl.algorithms import ALGORITHMS as A
print(' '.join(n for n in sorted(A) if n != 'fedmd'))")
step algorithm_rounds_cuda python "$bench/speed/algorithm_rounds.py" --fraction 0.03 --rounds 1 \
    --repeats 1 --algorithms $every --set train.device=cuda
step algorithm_rounds_cuda_batched python "$bench/speed/algorithm_rounds.py" --fraction 0.03 \
    --rounds 1 --repeats 1 --algorithms $every --compiled --set train.device=cuda \
    train.batch_clients=true
for name in "$@"; do  # a mistyped step would otherwise pass having run nothing
    [[ "$known" == *" $name "* ]] || { echo "no step $name; the steps:$known"; exit 2; }
done
[ ${#failed[@]} -eq 0 ] || { echo "failed: ${failed[*]}"; exit 1; }
