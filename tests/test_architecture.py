"""The boundaries between modules: one config, one backend protocol, no torch for a
server's client, no private names reached across modules.  No model is loaded here."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cacheblend import CacheBlendError
from cacheblend.backend import Backend
from cacheblend.config import ConnectorConfig, EngineConfig, RequestOptions, chunk_sink_for
from cacheblend.engine import Engine
from cacheblend.remote import RemoteEngine

ROOT = Path(__file__).resolve().parents[1]
DEFAULTS = RequestOptions()


def test_a_servers_client_does_not_import_torch():
    code = ("import sys, cacheblend.remote, cacheblend.config, cacheblend.results, cacheblend.backend; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("backend", [Engine, RemoteEngine])
def test_both_backends_implement_the_protocol(backend):
    for name, member in inspect.getmembers(Backend):
        if name.startswith("_") or isinstance(inspect.getattr_static(Backend, name), property):
            continue
        theirs = getattr(backend, name, None)
        assert callable(theirs), f"{backend.__name__} lacks {name}"
        wanted = [p for p in inspect.signature(member).parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "cls")]
        have = inspect.signature(theirs).parameters
        for p in wanted:
            assert p.name in have, f"{backend.__name__}.{name} lacks parameter {p.name}"


def test_adapters_expose_the_core_options_with_the_core_defaults():
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM

    for adapter, timeout in ((ChatCacheBlend, "timeout"), (CacheBlendLLM, "request_timeout")):
        core = DEFAULTS.as_dict()  # under the frameworks' own names for two of them
        core["max_tokens"] = core.pop("max_new_tokens")
        core[timeout] = core.pop("timeout")
        fields = adapter.model_fields
        for name, value in core.items():
            assert name in fields, f"{adapter.__name__} has no option {name}"
            default = fields[name].get_default(call_default_factory=True)
            if isinstance(value, (tuple, list)) or isinstance(default, (tuple, list)):
                value, default = list(value or ()), list(default or ())
            assert default == value, f"{adapter.__name__}.{name} defaults to {default!r}, the core to {value!r}"


def test_one_error_names_an_unknown_option():
    with pytest.raises(CacheBlendError, match=r"unknown options \['ratio'\]; known: method, recompute_ratio"):
        RequestOptions.parse({"ratio": 0.2})
    with pytest.raises(CacheBlendError, match=r"kv_connector_extra_config: unknown options \['ratio'\]"):
        ConnectorConfig.parse({"store": "memory", "ratio": 0.2})
    with pytest.raises(CacheBlendError, match="unknown engine setting"):
        Engine.load("no-such-model", prefetchh=False)
    with pytest.raises(CacheBlendError, match="chunk_sink"):
        EngineConfig(chunk_sink="eos")


def test_the_chunk_sink_defaults_to_the_model_familys(tmp_path, default_model_dir):
    """Unset, the sink is the family's measured choice (Qwen2 and Llama: the chat frame;
    unlisted families: BOS); set, it is what was set.  The store keys differ with the
    sink, so caches computed behind one sink are never served to an engine that uses the
    other."""
    assert chunk_sink_for(None, "qwen2") == "frame" and chunk_sink_for(None, "llama") == "frame"
    assert chunk_sink_for(None, "gpt2") == "bos"
    assert chunk_sink_for("bos", "qwen2") == "bos"
    from conftest import make_tiny_model

    qwen = make_tiny_model(tmp_path / "qwen2", "qwen2", default_model_dir)
    text = "The chunk sink test: a passage long enough to be a chunk of its own."
    keys = {}
    for folder, sink in ((qwen, None), (qwen, "bos"), (default_model_dir, None), (default_model_dir, "bos")):
        engine = Engine.load(folder, store="memory", chunk_sink=sink)
        assert engine.chunks.sink == tuple(engine.prompts.sink_ids(engine.chunk_sink))
        keys[(str(folder), sink)] = (engine.chunk_sink, engine.handle(text).key)
    assert keys[(str(qwen), None)][0] == "frame" and keys[(str(qwen), "bos")][0] == "bos"
    assert keys[(str(default_model_dir), None)][0] == "frame"
    for folder in (qwen, default_model_dir):
        assert keys[(str(folder), None)][1] != keys[(str(folder), "bos")][1]


@pytest.mark.parametrize("options, match", [
    ({"recompute_ratio": "most"}, "recompute_ratio"),
    ({"recompute_ratio": 1.5}, "recompute_ratio"),
    ({"check_layers": (1.5,)}, "integers"),
    ({"temperature": float("nan")}, "temperature"),
    ({"seed": "abc"}, "seed"),
    ({"learn": "yes"}, "learn"),
    ({"method": "fast"}, "method must be one of"),
])
def test_bad_option_values_fail_when_parsed(options, match):
    with pytest.raises(CacheBlendError, match=match):
        RequestOptions.parse(options)


def test_connector_config_takes_request_defaults():
    config = ConnectorConfig.parse({"store": "memory", "recompute_ratio": 0.3, "min_tokens": 8})
    assert config.defaults.recompute_ratio == 0.3 and config.min_tokens == 8 and config.store == "memory"
    with pytest.raises(CacheBlendError, match="auto"):
        ConnectorConfig.parse({"recompute_ratio": "auto"})


def test_no_module_touches_another_modules_private_names():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed (make install adds it)")
    out = subprocess.run([ruff, "check", "--isolated", "--select", "SLF001", "--output-format", "concise",
                          "packages", "tests", "examples", "benchmarks"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_adapters_refuse_unknown_constructor_arguments():
    from langchain_cacheblend import ChatCacheBlend
    from llama_index.llms.cacheblend import CacheBlendLLM
    from pydantic import ValidationError

    for bad in ({"max_token": 3}, {"num_predict": 3}, {"model_kwargs": {"top_k": 3}}):
        with pytest.raises(ValidationError, match="max_token|num_predict|top_k"):
            ChatCacheBlend(**bad)
    assert ChatCacheBlend(model_kwargs={"gradual": True}).model_kwargs == {"gradual": True}
    with pytest.raises(ValidationError, match="contxt_window"):
        CacheBlendLLM(engine=object(), contxt_window=1024)
    with pytest.raises(ValidationError, match="top_k"):
        CacheBlendLLM(engine=object(), additional_kwargs={"top_k": 3})
