"""``compile=True``: the layers' elementwise parts run through torch.compile.

Compiled kernels reorder float operations, so they are held to the same tolerance as
every other path against transformers' own forward, and the identities between methods
must hold inside the compiled engine.  Where compiling fails the engine answers eagerly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cacheblend import Engine
from conftest import PASSAGES, QUERY, make_tiny_model

pytestmark = pytest.mark.slow
GEN = dict(max_new_tokens=12)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def compiled_pair(request, tmp_path_factory, default_model_dir):
    folder = make_tiny_model(tmp_path_factory.mktemp(f"compiled-{request.param}"), request.param, default_model_dir)
    return Engine.load(folder, store="memory", compile=True), Engine.load(folder, store="memory")


def test_compiled_engine_matches_transformers_and_the_eager_engine(compiled_pair):
    compiled, eager = compiled_pair
    assert compiled.decoder.kernels.compiled and not eager.decoder.kernels.compiled
    handles = compiled.ingest(PASSAGES)
    eager.ingest(PASSAGES)
    full = compiled.generate(QUERY, handles, method="full", **GEN)
    ids = torch.tensor([compiled.prompts.build(QUERY, [list(h.token_ids) for h in handles], None).all_ids])
    with torch.inference_mode():
        ref = compiled.decoder.hf_model(ids).logits[0, -1].float()
    torch.testing.assert_close(full.first_token_logits, ref, atol=1e-3, rtol=1e-3)
    assert full.token_ids == eager.generate(QUERY, PASSAGES, method="full", **GEN).token_ids
    for ratio in (0.0, 0.15):  # blend and reuse: the eager engine's greedy answers
        mine = compiled.generate(QUERY, handles, recompute_ratio=ratio, **GEN)
        theirs = eager.generate(QUERY, PASSAGES, recompute_ratio=ratio, **GEN)
        assert mine.token_ids == theirs.token_ids
        torch.testing.assert_close(mine.first_token_logits, theirs.first_token_logits, atol=1e-3, rtol=1e-3)


def test_compiled_identities_hold(compiled_pair):
    compiled, _ = compiled_pair
    handles = compiled.ingest(PASSAGES)
    full = compiled.generate(QUERY, handles, method="full", **GEN)
    one = compiled.generate(QUERY, handles, recompute_ratio=1.0, **GEN)
    assert one.token_ids == full.token_ids
    torch.testing.assert_close(one.first_token_logits, full.first_token_logits, atol=1e-4, rtol=1e-4)


def test_without_a_compiler_the_engine_answers_eagerly(tmp_path, default_model_dir):
    """A machine where inductor cannot build its C++ (here: the compiler is a missing file)
    gets one warning and eager answers equal to an eager engine's."""
    folder = make_tiny_model(tmp_path / "m", "llama", default_model_dir)
    script = textwrap.dedent(f"""
        import logging, torch._inductor.config as ic
        logging.basicConfig(level=logging.WARNING)
        ic.cpp.cxx = ("/nonexistent/c++",)
        from cacheblend import Engine
        compiled = Engine.load({str(folder)!r}, store="memory", compile=True)
        eager = Engine.load({str(folder)!r}, store="memory")
        a = compiled.generate("Where is the Danube?", max_new_tokens=6).token_ids
        b = eager.generate("Where is the Danube?", max_new_tokens=6).token_ids
        assert a == b, (a, b)
        assert not compiled.decoder.kernels.compiled
        print("EAGER-OK")
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "EAGER-OK" in out.stdout
    assert "torch.compile is unavailable here" in out.stderr
    assert out.stderr.count("torch.compile is unavailable here") == 1


def test_compile_setting_is_checked():
    from cacheblend.config import EngineConfig
    from cacheblend.errors import CacheBlendError

    with pytest.raises(CacheBlendError, match="compile must be True or False"):
        EngineConfig(compile="yes")  # type: ignore[arg-type]
