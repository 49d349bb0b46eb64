#!/usr/bin/env bash
# The GPU checks issue 21 leaves for a session lent a GPU, as one call (about 6-7 minutes
# on an H100): clients batched into one step against one after another, whole rounds
# on the CPU's 16 threads, on the GPU and batched on the GPU (FedAvg, KAPC, DC-PFL), and
# the batched runs' figures against the CPU's, and KAPC's state on disk on the GPU. Logs go to $OUT (default runs/gpu); record
# them in bench/README.md ("On a GPU").
#
#     bash bench/gpu_checks.sh            # needs a CUDA GPU
set -euo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU')"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python bench/vmap_step.py --device cuda --clients 10 --steps 50 --batch 32 --repeats 3 \
    2>&1 | tee "$out/vmap_step.log"
python bench/device_check.py --algorithms fedavg fedprox local kapc dcpfl --rounds 3 \
    --gpu-set train.batch_clients=true --out "$out/device_check_batched.json" \
    2>&1 | tee "$out/device_check_batched.log"
python bench/device_check.py --algorithms kapc --rounds 2 --gpu-set train.store=disk \
    --out "$out/device_check_disk.json" 2>&1 | tee "$out/device_check_disk.log"
python bench/scale.py --clients 100 --algorithms fedavg --rounds 5 --modes seq cuda cuda-vmap \
    --set system.count_flops=false train.local_epochs=5 2>&1 | tee "$out/scale_fedavg.log"
python bench/scale.py --clients 100 --algorithms kapc dcpfl --rounds 4 \
    --modes seq cuda cuda-vmap --set system.count_flops=false train.local_epochs=5 \
    2>&1 | tee "$out/scale_kapc_dcpfl.log"
