"""The self-check's RoPE step: vLLM's rotary embedding rotates keys as the core does.

The worker writes keys that the core rotated (a chunk's keys re-positioned, the
recomputed tokens' keys rotated fresh) next to keys vLLM rotates itself (the prompt's
last token, every decoded token).  The layout check and the attention read-back
(:mod:`.readback`) compare the core with itself through vLLM's blocks and kernel, so a
RoPE variant that the two implement differently (a scaling type, the rotary dimension,
the interleaved GPT-J pairing, another base) would pass them and blend wrong keys.  This
step rotates seeded random keys and queries with vLLM's own ``rotary_emb`` module and with
the core's tables (:meth:`.Decoder.rope_tables`, transformers' rotary module) at
positions across vLLM's context, from 0 to ``max_model_len - 1``, where the scaled
variants differ most, and refuses a difference beyond rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from ..models.decoder import Decoder
from .readback import mismatch

# largest |vLLM - core| / max|core| accepted, by the decoder's dtype (float32 tables agree
# to about 1e-6; a wrong base or scaling is off by order one at the far positions)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def vllm_rotary(model: Any) -> Any:
    """vLLM's rotary embedding of the model's first attention layer, or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return None
    return getattr(getattr(layers[0], "self_attn", None), "rotary_emb", None)


def rotary_for(model: Any, vllm_config: Any) -> Any:
    """vLLM's rotary embedding for the served model: its first layer's where the worker
    reaches vLLM's model (``load_format="cacheblend"``), else one built as vLLM's Llama and
    Qwen2 layers build theirs (``get_rope`` over the model config's rope parameters)."""
    rotary = vllm_rotary(model)
    if rotary is not None:
        return rotary
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    hf = vllm_config.model_config.hf_config
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    with set_current_vllm_config(vllm_config):
        return get_rope(head_dim, max_position=hf.max_position_embeddings,
                        rope_parameters=getattr(hf, "rope_parameters", None), is_neox_style=True)


def probe_positions(max_positions: int) -> torch.Tensor:
    """Positions from the start to the end of the context: the first tokens, a chunk's
    usual offsets, and the far end, where a scaled RoPE departs from the plain one."""
    last = max_positions - 1
    picks = {0, 1, 2, 63, 64, 1000, last // 4, last // 2, (3 * last) // 4, last}
    return torch.tensor(sorted(p for p in picks if 0 <= p <= last))


def rope_problem(decoder: Decoder, rotary: Any, max_positions: int) -> str | None:
    """None when ``rotary`` (vLLM's module, called as vLLM's attention calls it:
    ``rotary(positions, q, k)`` on ``[tokens, heads * head_dim]``) rotates queries and keys
    as ``decoder`` does at every probed position up to ``max_positions``; else why not."""
    if rotary is None:
        return "vLLM's model has no rotary_emb on its first attention layer to compare the core's RoPE with"
    s = decoder.shape
    pos = probe_positions(min(max_positions, s.max_positions))
    n = len(pos)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, s.num_heads * s.head_dim, generator=gen)
    k = torch.randn(n, s.num_kv_heads * s.head_dim, generator=gen)
    vq, vk = rotary(pos, q.clone(), k.clone())  # the CPU op rotates in place and returns them
    cos, sin = decoder.rope_tables(pos)
    cos, sin = cos.float(), sin.float()
    tol = TOLERANCE.get(s.dtype, 2e-2)
    for name, x, theirs, heads in (("queries", q, vq, s.num_heads), ("keys", k, vk, s.num_kv_heads)):
        ours = decoder.rope(x.view(n, heads, s.head_dim).transpose(0, 1), cos, sin).transpose(0, 1).reshape(n, -1)
        err = mismatch(theirs, ours)
        if err > tol:
            at = int(pos[int((theirs.float() - ours).abs().amax(dim=1).argmax())])
            return (f"vLLM's rotary embedding ({type(rotary).__name__}) rotates {name} differently from the core's "
                    f"RoPE: {err:.2g} off at position {at} (tolerance {tol:g})")
    return None
