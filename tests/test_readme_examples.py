"""The packages' READMEs promise a RAG app you can paste and run: run it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cacheblend import native

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def _example(readme: Path) -> str:
    text = readme.read_text()
    after = text.split("A RAG app you can paste and run", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


@pytest.mark.parametrize("package", ["langchain-cacheblend", "llamaindex-cacheblend"])
def test_readme_rag_example_runs(package, tmp_path, default_model_dir):
    code = _example(ROOT / "packages" / package / "README.md")
    home = tmp_path / "home"  # a store of its own; the converted default model and the built kernels are shared
    home.mkdir()
    (home / "models").symlink_to(default_model_dir.parent)
    kernels = native.build_dir().parent
    kernels.mkdir(parents=True, exist_ok=True)
    (home / "extensions").symlink_to(kernels, target_is_directory=True)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "CACHEBLEND_HOME": str(home)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip()  # the answer and its blend stats were printed
