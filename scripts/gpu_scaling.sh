#!/usr/bin/env bash
# The prepared GPU check of issue 24's CUDA paths (under 5 minutes), which CPU runs cannot reach:
#   1. features from the target with its layers spread over two devices equal one device's,
#      byte for byte (needs two GPUs);
#   2. two ranks over Gloo with CUDA tensors (both on the first GPU) train the weights of one
#      process (max |Δ| printed);
#   3. two ranks over NCCL, one GPU each, the same (needs two GPUs: NCCL refuses two ranks on one).
# DEVICE=cpu runs the same steps on the CPU (cpu,cpu placement, Gloo only): the dry run that checks
# this script where no GPU is lent.
#
# Needs the release binaries (`make build`), the converted target and ShareGPT under HEADWAY_HOME
# (`make model data`) and a python with torch (PYTHON, default python3). A machine whose torch
# 2.11.0 lives elsewhere than the build's venv: set TORCH_LIB to its lib directory.
#
#   scripts/gpu_scaling.sh OUT_DIR
set -euo pipefail

out=${1:?usage: scripts/gpu_scaling.sh OUT_DIR}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
bin=${BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/headway/target}/release}
if [[ -n "${TORCH_LIB:-}" ]]; then
    export LD_LIBRARY_PATH="$TORCH_LIB:${LD_LIBRARY_PATH:-}"
fi
mkdir -p "$out"
step() { echo "== $(date +%T) $*"; }

if [[ $device == cpu ]]; then
    first=cpu second=cpu gpus=0
else
    first=cuda:0 second=cuda:1
    gpus=$(nvidia-smi -L | wc -l)
fi

# Max |Δ| between the `step-N/model.safetensors` weights of two checkpoints (safetensors read by
# hand: the device machine's python may have torch alone).
compare() {
    "$python" - "$1" "$2" <<'EOF'
import json, struct, sys
from pathlib import Path
import torch

def weights(run):
    path = max(Path(run).glob("step-*/model.safetensors"), key=lambda p: int(p.parent.name[5:]))
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    kinds = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        raw = bytearray(data[8 + n + a : 8 + n + b])
        out[name] = torch.frombuffer(raw, dtype=kinds[info["dtype"]]).reshape(info["shape"]).double()
    return out

a, b = weights(sys.argv[1]), weights(sys.argv[2])
assert a.keys() == b.keys(), "different parameters"
print(f"max |Δ| over {len(a)} tensors: {max((a[k] - b[k]).abs().max().item() for k in a):.3e}")
EOF
}

step "features of 24 ShareGPT conversations on $first"
timeout 120 "$bin/headway-train" prepare --data sharegpt --max-seqs 24 --max-len 256 --layers 2,15,27 \
    --device "$first" --dtype f32 --out "$out/features"
if [[ $device == cpu || $gpus -ge 2 ]]; then
    step "the same with the layers over $first,$second"
    timeout 120 "$bin/headway-train" prepare --data sharegpt --max-seqs 24 --max-len 256 \
        --layers 2,15,27 --device "$first,$second" --dtype f32 --out "$out/features-spread"
    for shard in "$out"/features/*.safetensors; do
        cmp "$shard" "$out/features-spread/$(basename "$shard")"
    done
    echo "shards identical"
else
    echo "skipped: one GPU"
fi

train() {  # train OUT WORLD BACKEND [LOCAL_RANK_OF_RANK_1]
    local run=$1 world=$2 backend=$3 local1=${4:-1} port=$((29500 + RANDOM % 1000)) pids=()
    for ((rank = 0; rank < world; rank++)); do
        local local_rank=$((rank == 0 ? 0 : local1))
        RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$local_rank MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
            timeout 180 "$bin/headway-train" eagle --features "$out/features" --out "$run" \
            --device "${device%%:*}" --dist-backend "$backend" --steps 10 --grad-accum 2 \
            --batch-tokens 1024 --lr 1e-3 --warmup 2 --save-every 10 --dist-timeout 60 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
}

step "EAGLE, 10 steps of 2 micro-batches: one process"
train "$out/one" 1 gloo
step "two ranks over Gloo, both on $first"
train "$out/gloo" 2 gloo 0
compare "$out/one" "$out/gloo"
if [[ $gpus -ge 2 ]]; then
    step "two ranks over NCCL, one GPU each"
    train "$out/nccl" 2 nccl 1
    compare "$out/one" "$out/nccl"
else
    echo "NCCL skipped: $gpus GPU(s)"
fi
step "done"
