#!/usr/bin/env bash
# `make soak`: the server under 64 concurrent clients (issue 23). Starts the server under test and
# a plain-decoding reference server (`--method ar`) on the same target, runs `headway-serve load
# --mix` against them (greedy whole and streamed, stop strings, sampling, cancellation mid-stream;
# 429s retried), then stops both. Fails on any error, any greedy answer that differs from plain
# decoding, or resident memory growing more than 5 % after warm-up.
#
#   SOAK_TARGET   target (default: the embedded SmolLM2 Q4_1 GGUF, run as stored)
#   SOAK_SERVER   options of the server under test (default: --method lookup)
#   SOAK_LOAD     options of the load (default: 3000 requests, 64 clients, 64 tokens)
set -euo pipefail

: "${BIN:?set BIN to the directory of the release binaries}"
QUESTIONS=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
TARGET=${SOAK_TARGET:-$("${PYTHON:-python3}" scripts/smollm2_gguf_path.py)}
SERVER=${SOAK_SERVER:---method lookup}
LOAD=${SOAK_LOAD:---requests 3000 --concurrency 64 --max-tokens 64}
PORT=${SOAK_PORT:-8141}
LOGS=$(mktemp -d)

serve() { # port, options...
    local port=$1
    shift
    # shellcheck disable=SC2068
    "$BIN/headway-serve" http --target "$TARGET" --port "$port" $@ \
        >/dev/null 2>"$LOGS/$port.log" &
    echo $!
}
under_test=$(serve "$PORT" "$SERVER")
# The reference answers only after the load: one thread leaves the cores to the server under test;
# it decodes one request at a time, as plain single-stream decoding.
reference=$(serve $((PORT + 1)) --method ar --threads 1 --max-batch 1)
trap 'kill $under_test $reference 2>/dev/null || true' EXIT
for port in "$PORT" $((PORT + 1)); do
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
        if ! kill -0 "$under_test" "$reference" 2>/dev/null; then
            cat "$LOGS"/*.log >&2
            exit 1
        fi
        sleep 0.5
    done
done
echo "server under test: $SERVER (pid $under_test); reference: --method ar; target $TARGET"
# shellcheck disable=SC2086
"$BIN/headway-serve" load --mix --url "http://127.0.0.1:$PORT" \
    --reference-url "http://127.0.0.1:$((PORT + 1))" --server-pid "$under_test" \
    --max-rss-growth 0.05 --questions "$QUESTIONS" $LOAD
if grep -l panicked "$LOGS"/*.log; then
    echo "a server panicked" >&2
    exit 1
fi
