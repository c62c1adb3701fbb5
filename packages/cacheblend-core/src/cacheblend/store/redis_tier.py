"""Redis/Valkey tier through redis-py: the store that many engine processes on many
machines share (the scale-out path).

Each chunk is ``PREFIX:{key}:meta`` (JSON: shape, dtype, who made it, a digest per
layer, BLAKE3 or, in older entries, SHA-256) plus one value per layer ``PREFIX:{key}:L``
holding that layer's K then V bytes, so layers stream one GET at a time.  A write sets
every layer and the meta in one MULTI/EXEC transaction, so a reader sees the whole entry
or none of it; every layer is checked against its digest as it is read.  A server that
is down or restarted costs a request nothing but a quick miss: the tier backs off for a
few seconds, then redis-py reconnects on the next command.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import torch

from ..cache.keys import is_entry_key
from .entry import (
    DIGEST,
    DIGESTS_FIELD,
    ChunkKV,
    CorruptEntry,
    digest_of,
    layer_bytes,
    layer_digest,
    read_entry,
    verify_entries,
)
from .signing import SIGNATURE, Signer
from .spec import hide_password_query

log = logging.getLogger("cacheblend.store")
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}
_REFUSED = object()  # what ``call`` returns when the server refused a command
_MISSING = object()  # a GET that found no value (None from ``call`` means unreachable)
# Server answers that mean the tier is unusable as configured, not that one entry is bad.
_UNUSABLE = ("DB index", "NOAUTH", "WRONGPASS", "NOPERM", "invalid DB")


class RedisSource:
    tier = "redis"

    def __init__(self, tier: RedisStore, key: str, meta: dict) -> None:
        self._tier, self.key = tier, key
        self.num_layers = int(meta["layers"])
        self.num_tokens = int(meta["tokens"])
        self._shape = tuple(int(n) for n in meta["shape"])  # per layer: kv_heads, tokens, head_dim
        self._dtype = _DTYPES[meta["dtype"]]
        self._algorithm, digests_field = digest_of(meta)
        self._digests = list(meta[digests_field])
        if len(self._digests) != self.num_layers or len(self._shape) != 3 or self._shape[1] != self.num_tokens:
            raise ValueError("meta does not describe its layers")
        if tier.signer is not None and not tier.signer.valid(key, meta, self._digests):
            tier.unsigned += 1
            raise ValueError("no valid signature")
        self.meta = {k: str(v) for k, v in meta.items() if k not in (digests_field, "shape")}

    def layer(self, index: int):
        name = self._tier.entry_name(self.key, index)
        blob = self._tier.call(lambda r: _MISSING if (got := r.get(name)) is None else got, refused=_REFUSED)
        if blob is _MISSING:  # evicted by Redis (maxmemory) or its TTL: the rest of the entry goes too,
            self._tier.delete(self.key)  # so that the next lookup is a miss, not this read again
            raise CorruptEntry(f"{self.key}: layer {index} missing (evicted)")
        if blob is None:
            raise CorruptEntry(f"{self.key}: layer {index} unreachable")
        try:
            if blob is _REFUSED:  # e.g. WRONGTYPE: something else sits under our name
                raise ValueError("not a string value")
            flat = torch.frombuffer(bytearray(blob), dtype=self._dtype)
            half = flat.numel() // 2
            k, v = flat[:half].view(self._shape), flat[half:].view(self._shape)
        except (ValueError, RuntimeError) as e:  # a size that is no whole layer, a wrong type
            self._tier.condemn(self.key)
            raise CorruptEntry(f"{self.key}: layer {index} has the wrong size or type: {e}") from e
        if layer_digest(k, v, self._algorithm) != self._digests[index]:
            self._tier.condemn(self.key)
            raise CorruptEntry(f"{self.key}: layer {index} fails its checksum")
        return k, v


class RedisStore:
    """A tier on a Redis server given as ``redis://HOST:PORT/DB``.

    Reads sit on the request path, so they give up after ``timeout_s`` and the request
    computes instead.  A write sends a whole chunk (tens of MB in float32) and usually runs
    on the tiered store's background writer, while the engine's own threads hold the cores:
    a server starved of CPU for half a second is then normal, not a failure, so writes
    wait up to ``write_timeout_s`` before they give up (a dropped write is a chunk every
    other replica has to compute again)."""

    def __init__(self, url: str, prefix: str = "cacheblend", ttl_s: int | None = None,
                 timeout_s: float = 0.5, backoff_s: float = 5.0, signer: Signer | None = None,
                 write_timeout_s: float = 10.0) -> None:
        import redis

        self.url, self.prefix, self.ttl_s, self.backoff_s, self.signer = url, prefix, ttl_s, backoff_s, signer
        self.safe_url = redact(url)  # what logs and stats show: never the password
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._write_client = redis.Redis.from_url(url, socket_timeout=max(write_timeout_s, timeout_s),
                                                  socket_connect_timeout=timeout_s)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self._refusal = redis.exceptions.ResponseError
        self._other = redis.exceptions.RedisError  # e.g. InvalidResponse: not a Redis at that address
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.corrupt = 0
        self.unsigned = 0
        self.unreachable = 0
        self.refused = 0
        self.condemning = True  # entries that fail verification are deleted
        self.last_error: str | None = None

    def _is_entry_name(self, name: bytes) -> bool:
        """``PREFIX:{64 hex}:{meta or a layer index}``: a name this tier wrote."""
        text = name.decode(errors="replace")
        if not text.startswith(self.prefix + ":"):
            return False
        key, _, part = text[len(self.prefix) + 1:].partition(":")
        return is_entry_key(key) and (part == "meta" or part.isdigit())

    def entry_name(self, key: str, part: int | str) -> str:
        return f"{self.prefix}:{key}:{part}"

    def call(self, fn, refused=None, *, write: bool = False):
        """Run ``fn(client)``; a connection failure is a miss, and the tier rests a while.
        A command the server refuses (out of memory under ``noeviction``, a wrong type, a
        bad DB index) is counted and logged and returns ``refused``: never an exception.
        ``write=True`` runs it on the client with the longer write timeout."""
        if time.monotonic() < self._down_until:
            return None
        try:
            return fn(self._write_client if write else self._client)
        except self._errors as e:
            self._failed("unreachable", e, self.backoff_s)
            return None
        except self._refusal as e:
            unusable = any(s in str(e) for s in _UNUSABLE)
            self._failed("refused", e, self.backoff_s if unusable else 0.0)
            return None if unusable else refused
        except self._other as e:
            self._failed("unreachable", e, self.backoff_s)
            return None

    def _failed(self, counter: str, e: Exception, rest_s: float) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + 1)
            first = self.last_error is None or not self.last_error.endswith(str(e))
            self.last_error = f"{type(e).__name__}: {e}"
            if rest_s:
                self._down_until = time.monotonic() + rest_s
        if rest_s or first:  # a refusal repeated on every request is logged once
            log.warning("redis tier %s %s (%s); local tiers serve%s", self.safe_url,
                        "unreachable" if counter == "unreachable" else "refused a command", self.last_error,
                        f", retry in {rest_s:.0f} s" if rest_s else "")

    @property
    def available(self) -> bool:
        return self.call(lambda r: r.ping()) is True

    def open(self, key: str) -> RedisSource | None:
        raw = self.call(lambda r: r.get(self.entry_name(key, "meta")), refused=_REFUSED)
        if raw is None:
            return None
        try:
            if raw is _REFUSED:
                raise ValueError("meta is not a string value")
            meta = json.loads(raw)
            if meta.get("key") != key:
                raise ValueError("meta names another key")
            return RedisSource(self, key, meta)
        except (ValueError, KeyError, TypeError, AttributeError, CorruptEntry) as e:  # e.g. a digest unknown here
            self.last_error = f"bad meta for {key}: {e}"
            self.condemn(key)
            return None

    def get(self, key: str) -> ChunkKV | None:
        return read_entry(self.open(key))

    def put(self, key: str, kv: ChunkKV) -> bool:
        digests = [layer_digest(*kv.layer(i)) for i in range(kv.num_layers)]
        meta: dict[str, object] = {str(k): str(v) for k, v in kv.meta.items() if k != SIGNATURE} | {
            "key": key, "layers": kv.num_layers, "tokens": kv.num_tokens, "dtype": str(kv.k.dtype),
            "shape": list(kv.k.shape[1:]), "digest": DIGEST, DIGESTS_FIELD: digests,
        }
        if self.signer is not None:
            meta[SIGNATURE] = self.signer.sign(key, meta, digests)

        def write(r):
            pipe = r.pipeline(transaction=True)
            for i in range(kv.num_layers):
                pipe.set(self.entry_name(key, i), layer_bytes(*kv.layer(i)), ex=self.ttl_s)
            pipe.set(self.entry_name(key, "meta"), json.dumps(meta), ex=self.ttl_s)
            pipe.execute()
            return True

        return self.call(write, write=True) is True

    def condemn(self, key: str) -> None:
        """Count and remove an entry that failed verification (unless ``condemning`` is
        off: ``cacheblend store verify``'s look at a sample before it drops anything)."""
        if not self.condemning:
            return
        with self._lock:
            self.corrupt += 1
        self.delete(key)

    def delete(self, key: str) -> bool:
        """Delete the entry ``key`` (an exact chunk key; a pattern deletes nothing)."""
        if not is_entry_key(key):
            return False

        def drop(r):
            # The entry's meta says how many layers it has: delete exactly those, without a SCAN
            # of the whole keyspace (seconds on a large shared Redis, on the request path that
            # drops a damaged entry).  Meta that cannot be read: SCAN for the entry's names.
            layers = _layer_count(r.get(self.entry_name(key, "meta")))
            if layers is None:
                names = list(r.scan_iter(match=self.entry_name(key, "*"), count=1000))
            else:
                names = [self.entry_name(key, i) for i in range(layers)]
            return r.delete(self.entry_name(key, "meta"), *names) > 0

        return bool(self.call(drop))

    def keys(self) -> list[str]:
        found = self.call(lambda r: list(r.scan_iter(match=f"{self.prefix}:*:meta", count=1000))) or []
        return [n.decode().split(":")[-2] for n in found if self._is_entry_name(n)]

    def clear(self) -> None:
        """Delete every entry of this tier, and nothing else under its prefix (the vLLM
        passage registry, other data)."""
        def drop_all(r):
            names = [n for n in r.scan_iter(match=f"{self.prefix}:*", count=1000) if self._is_entry_name(n)]
            for i in range(0, len(names), 1000):
                r.delete(*names[i : i + 1000])

        self.call(drop_all)

    def verify(self, progress=None) -> dict[str, int]:
        """Read every entry fully; drop the ones that fail. Returns counts."""
        return verify_entries(self, progress)

    def gc(self) -> dict[str, int]:
        """Drop layer values whose entry has no meta (a writer cannot leave these, since
        writes are transactions, but TTLs or manual deletes can)."""
        def sweep(r):
            orphans = 0
            for name in r.scan_iter(match=f"{self.prefix}:*", count=1000):
                if not self._is_entry_name(name):
                    continue  # not ours: the passage registry, other data
                parts = name.decode().split(":")
                if parts[-1] != "meta" and not r.exists(self.entry_name(parts[-2], "meta")):
                    r.delete(name)
                    orphans += 1
            return orphans

        return {"orphan_layers_removed": self.call(sweep) or 0}

    def stats(self) -> dict:
        info = self.call(lambda r: r.info("memory")) or {}
        return {"tier": "redis", "url": self.safe_url, "prefix": self.prefix, "signed": self.signer is not None,
                "entries": len(self.keys()), "bytes": info.get("used_memory"), "corrupt": self.corrupt,
                "unsigned": self.unsigned, "unreachable": self.unreachable, "refused": self.refused,
                "last_error": self.last_error}


def _layer_count(raw: bytes | None) -> int | None:
    """The number of layers a stored meta names; None where it names none it can be trusted for."""
    try:
        layers = json.loads(raw)["layers"] if raw is not None else None
        return int(layers) if isinstance(layers, (int, str)) and 0 < int(layers) <= 4096 else None
    except (ValueError, KeyError, TypeError):
        return None


def redact(url: str) -> str:
    """``url`` with its password, if any, replaced by ``***``: in the user info, or a
    ``password=`` query argument (redis-py takes either)."""
    parts = urlsplit(url)
    netloc = parts.netloc if parts.password is None else parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit((parts.scheme, netloc, parts.path, hide_password_query(parts.query), parts.fragment))
