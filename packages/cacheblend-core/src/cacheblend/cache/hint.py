"""Computing a chunk's deviation hint at ingestion (:mod:`cacheblend.blend.hint`).

The chunk runs once more behind the sink and an unrelated passage, :data:`FILLER`, up to
the check layer's values; a token's hint is how far those values are from its own cache's.
A token whose values move under one foreign context moves under others: the hint ranks
the tokens the prompt's check layer will find deviating.  The extra run covers layer 0
and one layer's K/V of about 120 + n tokens: 4–7 % of the chunk's 30-layer precompute.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..blend.fusor import KVCache, Segment, fused_prefill
from ..blend.hint import HINT_FIELD
from ..config import BlendConfig
from ..models.decoder import Decoder
from ..store import ChunkKV, Tier

__all__ = ["FILLER", "HINT_LAYER", "add_hint", "deviation_score"]

KEPT_META = ("origin",)  # meta of the old entry that the entry with a hint keeps (eviction order)

HINT_LAYER = 1  # the paper's (and the default) check layer
# Any passage unrelated to the chunks serves; this one was written for the purpose (it is
# not from the study's data), and its wording was never tuned.
FILLER = (
    "The old harbour town grew around a narrow bay where fishing boats once landed their catch "
    "each morning. In the nineteenth century a railway line reached the coast, and the town "
    "became a market for the farms of the valley behind it. Warehouses were built along the "
    "quay, and a stone bridge replaced the wooden one that floods had carried away twice. "
    "Today most of the warehouses hold shops and small museums, the railway carries more "
    "visitors than goods, and the bay is used by sailing clubs in summer. The town hall keeps "
    "records of its markets, its harbour dues and its population since the first census."
)


class _Reached(Exception):
    """Raised from the capture once the hint layer's values are in hand."""


def layer_values(decoder: Decoder, ids: Sequence[int], layer: int, device: torch.device) -> Tensor:
    """The values ``[kv_heads, len(ids), head_dim]`` that a plain prefill of ``ids`` computes
    at ``layer``; the layers after it are not run."""
    out: list[Tensor] = []

    def capture(index: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        if index == layer:
            out.append(v.clone())
            raise _Reached

    try:
        with torch.inference_mode():
            fused_prefill(decoder, [Segment(list(ids))], KVCache(decoder.shape, len(ids), device), BlendConfig(),
                          capture=capture)
    except _Reached:
        pass
    return out[0]


def deviation_score(decoder: Decoder, sink: Sequence[int], filler: Sequence[int], ids: Sequence[int],
                    cached_values: Tensor, device: torch.device) -> Tensor:
    """Per token of ``ids``: the squared distance between its :data:`HINT_LAYER` values
    behind ``sink + filler`` and ``cached_values`` (``[kv_heads, n, head_dim]``, its values
    behind ``sink`` alone)."""
    v = layer_values(decoder, [*sink, *filler, *ids], HINT_LAYER, device)[:, len(sink) + len(filler):]
    return (v.float() - cached_values.float()).pow(2).sum(dim=(0, 2))


def add_hint(store: Tier, key: str, ids: Sequence[int], hinted_meta: Callable[[Sequence[int], Tensor], dict[str, str]]
             ) -> bool:
    """Give the stored chunk ``ids`` under ``key``, stored without a hint (by a version before
    hints), its hint: computed from the entry's own hint-layer values, so its K/V are written
    back unchanged under a meta with the hint (``hinted_meta(ids, values)``).  False when there
    is nothing to add (no trusted entry, a hint already, a chunk too long for the filler) or
    the store did not take it; the entry then stays as it was, served with the full check."""
    kv = store.get(key)
    if kv is None or HINT_FIELD in kv.meta or kv.num_tokens != len(ids):
        return False
    meta = hinted_meta(ids, kv.v[HINT_LAYER])
    if HINT_FIELD not in meta:
        return False
    meta |= {k: kv.meta[k] for k in KEPT_META if k in kv.meta}
    return bool(store.put(key, ChunkKV(kv.k, kv.v, meta)))
