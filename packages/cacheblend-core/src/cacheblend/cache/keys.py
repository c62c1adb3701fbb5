"""Chunk identity: a cache is served only to the same model, tokens and precompute policy."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np


def chunk_key(model_fingerprint: str, token_ids: Sequence[int], policy: str) -> str:
    """sha256 of (model fingerprint, precompute policy, token ids) as hex.

    The fingerprint covers architecture, weights, dtype and KV layout, so an entry made
    by another model can never match."""
    h = hashlib.sha256()
    h.update(model_fingerprint.encode())
    h.update(b"\0")
    h.update(policy.encode())
    h.update(b"\0")
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.hexdigest()


def is_entry_key(key: object) -> bool:
    """A key :func:`chunk_key` makes: 64 lowercase hex digits (a pattern or a name is not)."""
    return isinstance(key, str) and len(key) == 64 and all(c in "0123456789abcdef" for c in key)
