#!/usr/bin/env bash
# Issue 48's training campaign: the target's own replies to ShareGPT's openings, then EAGLE-3
# heads on growing slices of them (the data-scaling curve, every head evaluated on the same
# held-out conversations), EAGLE-1 and Medusa on all of it, the heads packed as pretrained/ ships
# them. On the lent GPU (`scripts/device.sh` brings binaries, GGUF and ShareGPT there); DEVICE=cpu
# with SCALE=dry runs every step at toy sizes here, the check before device time is spent.
#
# Resumable: every step's output lives under WORK and a finished step is skipped, so a call cut off
# by its time limit is continued by running the same command again (while the machine is warm, or
# on a machine given WORK back). Results go to OUT as results.tar.part-NN (15 MiB pieces: a device
# call returns at most 8 files of 16 MiB) and summary.md.
#
#   scripts/gpu_campaign.sh OUT_DIR
#
# Environment: DEVICE (cuda | cpu), SCALE (full | dry), WORK (default $HEADWAY_HOME/campaign), BIN
# (release binaries), GGUF (the Q4_1 file; converted into the default target when that is
# missing), TORCH_LIB (the lib directory of a torch 2.11.0 elsewhere than the build's venv). Sizes
# can be overridden one by one: CONVS, SUBSETS, REPLY_TOKENS, MAX_LEN, REGEN_BATCH, EPOCHS, HELD_OUT
# (every slice needs held-out conversations: the trainers report on them).
set -euo pipefail

out=${1:?usage: scripts/gpu_campaign.sh OUT_DIR}
device=${DEVICE:-cuda}
scale=${SCALE:-full}
home=${HEADWAY_HOME:-$HOME/.cache/headway}
work=${WORK:-$home/campaign}
bin=${BIN:-${CARGO_TARGET_DIR:-$home/target}/release}
if [[ -n "${TORCH_LIB:-}" ]]; then
    export LD_LIBRARY_PATH="$TORCH_LIB:${LD_LIBRARY_PATH:-}"
fi
case $scale in
    full) convs=${CONVS:-all} subsets=${SUBSETS:-1000 2000 4000 8000} reply_tokens=${REPLY_TOKENS:-128}
          max_len=${MAX_LEN:-448} regen_batch=${REGEN_BATCH:-256} epochs=${EPOCHS:-2}
          held_out=${HELD_OUT:-0.04} ;;
    dry) convs=${CONVS:-24} subsets=${SUBSETS:-8 16} reply_tokens=${REPLY_TOKENS:-12}
         max_len=${MAX_LEN:-96} regen_batch=${REGEN_BATCH:-8} epochs=${EPOCHS:-1}
         held_out=${HELD_OUT:-0.3} ;;
    *) echo "SCALE is full or dry, not $scale" >&2; exit 2 ;;
esac
taps=2,15,27
mkdir -p "$work" "$out"
step() { echo "== $(date +%T) $*"; }
# Runs the command unless the step's marker says it finished; writes the marker after.
once() {
    local marker=$work/done.$1
    shift
    if [[ -f $marker ]]; then
        step "done before: ${marker##*/done.}"
        return
    fi
    "$@"
    touch "$marker"
}

target_dir=$home/models/SmolLM2-135M-Instruct
convert() {
    step "target: converting ${GGUF:?GGUF names the Q4_1 file to convert} into $target_dir"
    "$bin/headway-train" convert --gguf "$GGUF" --out "$target_dir"
}
if [[ ! -f $target_dir/converted_from.json ]]; then
    convert
fi

max_seqs() { [[ $1 == all ]] || echo "--max-seqs $1"; }

# The target's greedy replies to the first turn of each conversation, as a journal of replies
# (`{"id", "replies"}` lines: the rest of each conversation is ShareGPT's). Its features are not
# the ones trained on (see below), so they are dropped.
regenerate() {
    step "replies: $convs conversations, $reply_tokens new tokens each, batches of $regen_batch on $device"
    # shellcheck disable=SC2046
    "$bin/headway-train" prepare --data sharegpt $(max_seqs "$convs") --max-len "$max_len" \
        --regenerate --regen-turns 1 --regen-max-new-tokens "$reply_tokens" \
        --regen-batch "$regen_batch" --device "$device" --out "$work/regen" \
        --json "$work/regen.json"
    cp "$work/regen/regenerated.jsonl" "$work/replies.jsonl.tmp"
    mv "$work/replies.jsonl.tmp" "$work/replies.jsonl"
    rm -f "$work/regen"/*.safetensors
}
once replies regenerate

# Every slice's features come from ShareGPT with replies.jsonl's replies (`--replies`: the first n
# conversations it records, in corpus order) with the same held-out fraction, and the held-out
# split is a hash of each conversation's id: a conversation held out of the whole is held out of
# every slice, so all heads are evaluated on the whole's held-out split without having seen it.
features() {
    local n=$1
    step "features: $n conversations, taps $taps"
    # shellcheck disable=SC2046
    "$bin/headway-train" prepare --data sharegpt --replies "$work/replies.jsonl" $(max_seqs "$n") \
        --max-len "$max_len" --held-out "$held_out" --layers "$taps" --device "$device" \
        --out "$work/features-$n" --json "$work/features-$n.json"
}

train_eval() {
    local kind=$1 n=$2
    shift 2
    step "$kind on $n conversations ($epochs epochs)"
    "$bin/headway-train" "$kind" --features "$work/features-$n" --out "$work/$kind-$n" \
        --device "$device" --epochs "$epochs" --save-every 100000 --json "$work/train-$kind-$n.json" "$@"
    "$bin/headway-train" eval --heads "$work/$kind-$n" --features "$work/features-all" \
        --device "$device" --json "$work/eval-$kind-$n.json"
}

once features-all features all
for n in $subsets; do
    once "features-$n" features "$n"
done
for n in $subsets all; do
    once "eagle3-$n" train_eval eagle3 "$n" --draft-vocab 8192 --lr 1e-3 --warmup 50 --taps "$taps"
done
once eagle-all train_eval eagle all --draft-vocab 8192 --lr 1e-3 --warmup 50
once medusa-all train_eval medusa all --lr 1e-3 --warmup 50 --shared-lm-head

results() {
    step "results into $out"
    local pack=$work/results
    rm -rf "$pack" && mkdir -p "$pack/heads"
    for kind in eagle3 eagle medusa; do
        "$bin/headway-train" pack --heads "$work/$kind-all" --out "$pack/heads/$kind"
    done
    cp "$work"/*.json "$pack/"
    # Python's lzma: the device's image may lack the xz tool.
    "${PYTHON:-python3}" -c 'import lzma, shutil, sys
shutil.copyfileobj(open(sys.argv[1], "rb"), lzma.open(sys.argv[2], "wb", preset=6))' \
        "$work/replies.jsonl" "$pack/replies.jsonl.xz"
    "${PYTHON:-python3}" - "$pack" "$subsets" >"$pack/summary.md" <<'EOF'
import json, sys
from pathlib import Path
pack, subsets = Path(sys.argv[1]), sys.argv[2].split() + ["all"]
def figures(name):
    path = pack / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}
print("| head | conversations | steps | tokens trained | tokens/s | held-out acceptance |")
print("|---|---:|---:|---:|---:|---|")
for kind, sizes in [("eagle3", subsets), ("eagle", ["all"]), ("medusa", ["all"])]:
    for n in sizes:
        train, held_out = figures(f"train-{kind}-{n}"), figures(f"eval-{kind}-{n}").get("held_out", {})
        accepted = " ".join(f"{k} {v:.3f}" for k, v in held_out.items() if "acc" in k or "top1" in k)
        print(f"| {kind} | {n} | {train.get('steps', '?')} | {train.get('tokens', '?')} "
              f"| {train.get('tokens_per_s', 0):.0f} | {accepted} |")
EOF
    cat "$pack/summary.md"
    cp "$pack/summary.md" "$out/"
    tar -C "$work" -cf - results | split -b 15M -d -a 2 - "$out/results.tar.part-"
    ls -la "$out"
    local parts
    parts=$(ls "$out"/results.tar.part-* | wc -l)
    if ((parts > 7)); then
        echo "results take $parts pieces: a device call returns 8 files in all" >&2
        exit 1
    fi
}
results
step "campaign finished"
