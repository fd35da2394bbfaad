#!/usr/bin/env bash
# make exactness (issue 21): greedy plain decoding against every speculative method, each alone and
# with prompt lookup grafted on, at trees (chains for the draft model and lookup) of 1, 8, 32 and
# 64 tokens, on the Spec-Bench questions (first turns, 128 new tokens); prints how many prompts
# give identical outputs per method and size, and exits 1 if any differ. Speed is not measured:
# no baseline runs beside the methods.
#
#   scripts/exactness.sh OUT_DIR QUESTIONS MEDUSA_HEADS DRAFT_MODEL
# Environment: BIN (release binaries), LIMIT (questions, 0: all 480), SIZES, METHODS, THREADS.
set -euo pipefail

out=${1:?usage: scripts/exactness.sh OUT_DIR QUESTIONS MEDUSA_HEADS DRAFT_MODEL}
questions=${2:?questions file}
medusa_heads=${3:?Medusa heads}
draft_model=${4:?draft model directory}
bin=${BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/headway/target}/release}
limit=${LIMIT:-0}
sizes=${SIZES:-1 8 32 64}
methods=${METHODS:-eagle eagle3 medusa draft lookup}
mkdir -p "$out"
bench() {
    "$bin/headway-serve" bench --questions "$questions" --limit "$limit" --turns 1 \
        --max-new-tokens 128 --threads "${THREADS:-2}" --no-baseline "$@"
}

# The drafting flags of METHOD at SIZE tokens.
method_args() {
    local method=$1 size=$2
    case $method in
        eagle) echo --method eagle --heads pretrained/smollm2-135m-eagle --depth 6 --tree-top-k 8 --tree-tokens "$size" ;;
        eagle3) echo --method eagle3 --heads pretrained/smollm2-135m-eagle3 --depth 6 --tree-top-k 8 --tree-tokens "$size" ;;
        medusa) echo --method medusa --heads "$medusa_heads" --tree-tokens "$size" ;;
        draft) echo --method draft --draft-model "$draft_model" --draft-tokens "$size" ;;
        lookup) echo --method lookup --draft-tokens "$size" ;;
        *) echo "unknown method $method" >&2; return 1 ;;
    esac
}

# Plain decoding once (kept between runs: the reference does not change with the methods).
[[ -f "$out/ar.json" ]] || bench --method ar --json "$out/ar.json" >"$out/ar.log" 2>&1
differing=0
summary=$out/summary.txt
: >"$summary"
for size in $sizes; do
    for method in $methods; do
        for lookup in "" --with-lookup; do
            [[ $method == lookup && -n $lookup ]] && continue
            name=$method${lookup:+-with-lookup}-$size
            # shellcheck disable=SC2046 # method_args prints separate flags
            bench $(method_args "$method" "$size") $lookup --json "$out/$name.json" >"$out/$name.log" 2>&1 ||
                { echo "$name: the bench failed, see $out/$name.log" | tee -a "$summary"; differing=1; continue; }
            line=$("$bin/headway-serve" compare "$out/ar.json" "$out/$name.json" 2>&1 | grep "prompts identical") ||
                differing=1
            echo "$name: $line" | tee -a "$summary"
        done
    done
done
exit $differing
