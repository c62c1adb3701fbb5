"""The deviation hint: which of a chunk's tokens will deviate, known before the prompt.

HKVD (paper §4.2) ranks a chunk's tokens by how far their cached values move once the
chunk sits behind other chunks, and to read that at the check layer every reused token
runs the layers before it in full: on a 6-passage prompt, layer 0 alone is about a sixth
of a 15 % blend's time.  Measured on dev prompts, which tokens deviate is mostly a
property of the chunk itself, not of what precedes it: the chunk precomputed once behind
an unrelated passage (:data:`cacheblend.cache.hint.FILLER`) and compared with its own
cache ranks the tokens so that the prompt's top 15 % by deviation fall 94–100 % within the
top 40 % of all chunk tokens by that score (docs/internals/fidelity-study.md, round 18).

So ingestion stores this score with the chunk (``meta["deviation_hint"]``; the vLLM
connector computes it for the K/V it saves), and a blend with ``check_pool`` below 1 runs
the layers up to the check layer only for the top ``check_pool`` share of the chunk tokens
by hint (the *check pool*, over all chunks at once); the check layer then ranks the pool by
its real deviation in this prompt, as before.  The other tokens keep their caches from
layer 0 on, where the caches are exact (a token's layer-0 keys and values depend on the
token alone), moved by the chunk shift from the check layer on.  A chunk without a hint
(stored by an older version) makes the whole prompt run the full check.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["HINT_FIELD", "check_pool", "decode_hint", "encode_hint"]

HINT_FIELD = "deviation_hint"  # the meta field: base64 of one float16 per token


def encode_hint(score: Tensor) -> str:
    """A per-token score [n] as meta text (float16: the hint ranks, it need not be exact)."""
    half = score.detach().float().clamp(max=6e4).to(torch.float16).contiguous()
    return base64.b64encode(half.view(torch.uint8).numpy().tobytes()).decode("ascii")


def decode_hint(meta: Mapping[str, str], num_tokens: int) -> Tensor | None:
    """The hint of a stored chunk's first ``num_tokens`` tokens, or None when it has none or
    the text is not one float16 per token of the entry (never an error: a hint only saves
    time, and a chunk without one is checked in full)."""
    text = meta.get(HINT_FIELD)
    if not isinstance(text, str):
        return None
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, UnicodeEncodeError):
        return None
    if len(raw) % 2 or len(raw) // 2 < num_tokens:
        return None
    score = torch.frombuffer(bytearray(raw), dtype=torch.float16)[:num_tokens].float()
    return score if bool(torch.isfinite(score).all()) else None


def check_pool(spans: Sequence[tuple[int, int, Mapping[str, str] | None]], share: float, length: int,
               device: torch.device) -> Tensor | None:
    """A bool mask over ``length`` positions: the top ``share`` of the approximately reused
    tokens (spans ``[a, b)``, each with its cache's meta) by hint, over all spans at once:
    a short chunk behind long ones deviates in nearly every token, which a share per chunk
    would cut off.  None when a span has no usable hint (the prompt then runs the full check)."""
    scores, positions = [], []
    for a, b, meta in spans:
        score = None if meta is None else decode_hint(meta, b - a)
        if score is None:
            return None
        scores.append(score)
        positions.append(torch.arange(a, b))
    mask = torch.zeros(length, dtype=torch.bool, device=device)
    if scores:
        score, position = torch.cat(scores), torch.cat(positions)
        mask[position[torch.topk(score, max(1, round(share * score.numel()))).indices].to(device)] = True
    return mask
