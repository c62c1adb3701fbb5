"""The vLLM connector tests run only in ``.venv-vllm`` (``make vllm``): the main venv has no
vLLM, and its suite must not even collect them."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
