# Two commands on a fresh machine: `make demo` (the main job on the embedded default) and `make test`.
VENV   := .venv
BIN    := $(VENV)/bin
TORCH  := $(shell grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
# optional extras to install (.ci/run: `make test EXTRAS=test,ray`)
EXTRAS ?= test
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: install demo score-example test test-fast server bench clean

$(BIN)/slmsql: pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, from the pinned CPU/CUDA-agnostic wheel, so nothing pulls a multi-GB CUDA build
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e '.[$(EXTRAS)]'
	touch $@

install: $(BIN)/slmsql

demo: install
	$(BIN)/slmsql pipeline

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

clean:
	rm -rf outputs mlruns mlflow.db mlartifacts
