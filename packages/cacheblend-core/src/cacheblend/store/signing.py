"""Signed entries: an HMAC that ties each stored chunk to the holders of the store secret.

Every tier checks each layer against a sha256 stored beside it.  That catches damage,
not a writer who stores the K/V of their own text, with matching digests, under another
chunk's key (the key is public: ``sha256(fingerprint, policy, ids)``).  With a store
secret (``CACHEBLEND_STORE_KEY``, or ``key=`` in the store spec) every entry carries
HMAC-SHA256(secret, key, meta, layer digests); a tier that has the secret rejects an
entry without a valid signature as it rejects a damaged one (counted, deleted,
recomputed, never promoted).  Without a secret, a shared tier trusts every writer.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from typing import Any

SIGNATURE = "signature"  # the meta field that holds the HMAC (hex)
KEY_ENV = "CACHEBLEND_STORE_KEY"


class Signer:
    """Signs and checks entries with one store secret."""

    def __init__(self, secret: str | bytes) -> None:
        if not secret:
            raise ValueError("the store key must not be empty")
        self._secret = secret.encode() if isinstance(secret, str) else bytes(secret)

    def sign(self, key: str, meta: Mapping[str, Any], digests: Sequence[str]) -> str:
        """The signature of an entry: every meta field but the signature itself is
        covered, so shape, dtype, length and origin cannot be changed either."""
        body = {k: v for k, v in meta.items() if k != SIGNATURE}
        message = json.dumps([key, body, list(digests)], sort_keys=True, separators=(",", ":"), default=str)
        return hmac.new(self._secret, message.encode(), hashlib.sha256).hexdigest()

    def valid(self, key: str, meta: Mapping[str, Any], digests: Sequence[str]) -> bool:
        given = meta.get(SIGNATURE)
        return isinstance(given, str) and hmac.compare_digest(given, self.sign(key, meta, digests))

    def __repr__(self) -> str:  # never the secret
        return "Signer(***)"
