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
