"""The self-check's RoPE step (cacheblend.integrations.rope_check) against vLLM's real
rotary embeddings: the core's RoPE (transformers' rotary module) agrees with vLLM's for
the default model and for every scaling type the core supports, and a RoPE that differs
(another base, the interleaved GPT-J pairing, none at all) is refused by name, before
any request is blended."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

pytest.importorskip("vllm")

import torch  # noqa: E402

from cacheblend import Engine  # noqa: E402
from cacheblend.integrations.rope_check import rope_problem, rotary_for  # noqa: E402


def _vllm_config(folder, max_model_len=None):
    from vllm.config import ModelConfig, VllmConfig

    return VllmConfig(model_config=ModelConfig(model=str(folder), dtype=torch.float32, max_model_len=max_model_len))


def _rope(vllm_config, **change):
    """vLLM's rotary embedding for ``vllm_config``'s model, as rotary_for builds it without
    vLLM's loaded model, with ``change`` made to the arguments vLLM's Llama layer passes."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    hf = vllm_config.model_config.hf_config
    args = dict(head_size=hf.head_dim, max_position=hf.max_position_embeddings,
                rope_parameters=dict(hf.rope_parameters), is_neox_style=True)
    args["rope_parameters"].update(change.pop("rope_parameters", {}))
    args.update(change)
    with set_current_vllm_config(vllm_config):
        return get_rope(**args)


def test_the_default_models_rope_is_vllms(default_model_dir):
    engine = Engine.load(default_model_dir, store="memory")
    cfg = _vllm_config(default_model_dir, max_model_len=8192)
    assert rope_problem(engine.decoder, rotary_for(None, cfg), cfg.model_config.max_model_len) is None


@pytest.mark.parametrize("family", ["llama", "llama-linear", "llama-yarn", "llama-dynamic", "qwen2"])
def test_every_rope_scaling_the_core_supports_is_vllms(tmp_path, default_model_dir, family):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path, family, default_model_dir)
    engine = Engine.load(folder, store="memory")
    cfg = _vllm_config(folder)
    problem = rope_problem(engine.decoder, rotary_for(None, cfg), cfg.model_config.max_model_len)
    assert problem is None, problem


@pytest.mark.parametrize("change, match", [
    (dict(rope_parameters={"rope_theta": 50000.0}), "rotates queries differently"),
    (dict(is_neox_style=False), "rotates queries differently"),
])
def test_a_rope_that_differs_from_the_cores_is_refused(default_model_dir, change, match):
    engine = Engine.load(default_model_dir, store="memory")
    cfg = _vllm_config(default_model_dir, max_model_len=8192)
    problem = rope_problem(engine.decoder, _rope(cfg, **change), 8192)
    assert problem is not None and match in problem and "position" in problem, problem
    assert rope_problem(engine.decoder, None, 8192) is not None


def test_a_failed_rope_check_turns_blending_off_with_its_reason(monkeypatch):
    """Through the worker's start-up check: the layout passes, the RoPE step fails, and the
    verdict carries the RoPE step's reason, with reading vLLM's blocks turned off."""
    from vllm_connector.test_layout import _paged, _probe

    from cacheblend.integrations import readback

    # the read-back needs vLLM's attention metadata: the layout's own round trip stands in
    monkeypatch.setattr(readback, "verify", lambda paged, names, vc, kvc, k, v: readback.self_check(paged, k, v))
    k, v = _probe(9)
    reference = type("Reference", (), {"k": k, "v": v})
    kv = _paged(torch.float32)
    ok = readback.start_up_check(kv, ["a", "b"], None, None, lambda: reference, lambda: None)
    assert ok.ok and "RoPE" in ok.reason and kv.layout is not None, ok
    bad = readback.start_up_check(kv, ["a", "b"], None, None, lambda: reference, lambda: "RoPE differs at 8191")
    assert not bad.ok and bad.reason == "RoPE differs at 8191" and kv.layout is None
