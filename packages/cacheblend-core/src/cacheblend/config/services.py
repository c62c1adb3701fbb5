"""The settings of an engine and of the vLLM connector, each default defined once.

* :class:`EngineConfig` — settings of an engine (device, dtype, chunk sink, pipelining,
  passage learning, the kernels);
* :func:`chunk_sink_for` — the chunk sink a model family gets unless told one;
* :class:`ConnectorConfig` — the vLLM connector's ``kv_connector_extra_config``.

Imports neither torch nor transformers, so clients of a server can use it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..errors import CacheBlendError
from .options import CHUNK_SINKS, KV_DTYPES, RequestOptions

# ``"store": "env:NAME"`` (or ``"passages"``): the value is read from the environment variable
# NAME of vLLM's processes, so a password or signing key stays out of the command line and
# vLLM's log of its arguments (``cacheblend serve`` passes secrets this way).
ENV_PREFIX = "env:"

# A model family's chunk sink unless told one, chosen on dev (docs/fidelity.md); unlisted: "bos".
MODEL_CHUNK_SINKS: Mapping[str, str] = {"qwen2": "frame", "llama": "frame"}


@dataclass(frozen=True)
class EngineConfig:
    """Settings of one engine (not of a request).

    ``dtype``: what the model computes in (None: float32); ``"bfloat16"`` prefills about 3×
    faster on CPUs with AMX, with answers of its own (docs/performance.md);
    ``chunk_sink``: the precompute policy, see :meth:`PromptBuilder.sink_ids`; None: the
    model family's measured choice (:func:`chunk_sink_for`);
    ``prefetch``: pipelined layer loading; None: where a core is free beside torch's
    compute threads, or for reads from Redis, which wait on a socket
    (:func:`cacheblend.blend.loader.pipelined` says why);
    ``learn_min_chars``: paragraphs at least this long in a chat prompt become chunks;
    ``kv_dtype``: the dtype chunk caches are stored in (None: the model's); ``"bfloat16"``
    or ``"float16"`` halve the store's bytes of a float32 model (exact prefix caches keep
    the model's dtype); ``compile``: the layers' elementwise parts through ``torch.compile``
    (cached on disk; eager where compiling fails); ``pack_weights``: re-lay the projection
    weights for one-row products (``models/packed.py``: a sixth faster decode, prefill no
    slower, same memory) — off where the weights must stay views of the memory-mapped
    safetensors file (the vLLM connector's worker, which shares those pages with other
    processes), and left unpacked in bfloat16 where the CPU has no bf16 products (AVX2:
    ``packing_pays``, the packed layout is about 12x slower there); ``onednn_weights``: with
    packed weights and no ``compile``, run every product on weights reordered once for oneDNN
    (``models/onednn.py``; 0.14 GB more memory on SmolLM2-135M); None: where a one-row pass,
    timed at load, is faster through oneDNN than through MKL (the winner varies by CPU and
    dtype; unpacked weights: oneDNN on them as they are, unless False); ``compile_decode``: one
    compiled graph per decode step (:mod:`.generate.compiled`: 3–6 % faster per token; 12–20 s
    to compile once per machine, then about 3 s per process); ``native_attention``: decode
    steps, and float32 prefill, attend through our C++ kernels (:mod:`cacheblend.native`: about
    30 s to build once per machine; None: where they build);
    ``reuse_kv_buffer``: keep the last request's fused KV buffer (:mod:`cacheblend.generate.kv_pool`)."""

    device: str = "cpu"
    dtype: str | None = None
    chunk_sink: str | None = None
    prefetch: bool | None = None
    learn_min_chars: int = 200
    kv_dtype: str | None = None
    compile: bool = False
    pack_weights: bool = True
    onednn_weights: bool | None = None
    compile_decode: bool = False
    native_attention: bool | None = None
    reuse_kv_buffer: bool = True

    def __post_init__(self) -> None:
        for name in ("compile", "pack_weights", "compile_decode", "reuse_kv_buffer"):
            if not isinstance(getattr(self, name), bool):
                raise CacheBlendError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, unset in (("prefetch", "by the cores"), ("onednn_weights", "measured at load"),
                            ("native_attention", "where it builds")):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), bool):
                raise CacheBlendError(f"{name} must be True or False (None: {unset}), got {getattr(self, name)!r}")
        if self.chunk_sink is not None and self.chunk_sink not in CHUNK_SINKS:
            raise CacheBlendError(f"chunk_sink must be one of {CHUNK_SINKS} or None, got {self.chunk_sink!r}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise CacheBlendError(f"kv_dtype must be one of {KV_DTYPES} or None, got {self.kv_dtype!r}")
        if isinstance(self.learn_min_chars, bool) or not isinstance(self.learn_min_chars, int) \
                or self.learn_min_chars < 1:
            raise CacheBlendError(f"learn_min_chars must be a positive int, got {self.learn_min_chars!r}")


def chunk_sink_for(policy: str | None, model_type: str) -> str:
    """The chunk sink an engine on a ``model_type`` model uses: ``policy`` where one was
    set, else the family's choice from :data:`MODEL_CHUNK_SINKS` ("bos" if unlisted).
    The engine, the vLLM connector's scheduler and its worker all resolve it here, so they
    precompute and match chunks behind the same tokens."""
    return policy if policy is not None else MODEL_CHUNK_SINKS.get(model_type, "bos")


@dataclass(frozen=True)
class ConnectorConfig:
    """The vLLM connector's ``kv_connector_extra_config``: ``store`` (a store spec),
    ``passages`` (a registry: JSON-lines path or ``redis://`` URL), ``stats`` (a file for
    one JSON line per worker operation), ``min_tokens`` (shorter prompts are not searched
    for chunks; default two KV blocks), ``chunk_sink`` and ``kv_dtype`` (as :class:`EngineConfig`),
    and any :class:`RequestOptions` field as the server's default for requests (e.g.
    ``recompute_ratio``).  ``store`` or ``passages`` given as ``"env:NAME"`` is read from
    the environment variable NAME.

    ``max_blend_tokens`` bounds what one scheduler step blends: a blended request costs
    vLLM one scheduled token, but its fused prefill runs before the step's forward, so a
    burst of blends holds up every running decode for all of them.  Blended prompt tokens
    beyond it wait for the next step (the first blend of a step always runs).  Default: no
    bound; under open-loop load on 2 cores, a bound of vLLM's step budget gave no better
    TTFT or end-to-end latency and fewer answers per minute at saturation (docs/vllm.md)."""

    store: str | None = None
    passages: str | None = None
    stats: str | None = None
    min_tokens: int | None = None
    max_blend_tokens: int | None = None
    chunk_sink: str | None = EngineConfig.chunk_sink
    kv_dtype: str | None = EngineConfig.kv_dtype
    defaults: RequestOptions = field(default_factory=RequestOptions)

    def __post_init__(self) -> None:
        for name in ("min_tokens", "max_blend_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise CacheBlendError(f"{name} must be a positive int or None, got {value!r}")

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        own = {f.name for f in fields(cls)} - {"defaults"}
        mine = {k: extra.pop(k) for k in list(extra) if k in own}
        for name in ("store", "passages"):
            value = mine.get(name)
            if isinstance(value, str) and value.startswith(ENV_PREFIX):
                var = value[len(ENV_PREFIX):]
                if var not in os.environ:
                    raise CacheBlendError(f"{name} is read from the environment variable {var!r}, which is not set")
                mine[name] = os.environ[var]
        try:
            RequestOptions.check_names(extra, "kv_connector_extra_config")
        except CacheBlendError as e:
            raise CacheBlendError(f"{e}, {', '.join(sorted(own))}") from None
        config = cls(**mine, defaults=RequestOptions.parse(extra))
        if config.defaults.auto:
            raise CacheBlendError("recompute_ratio='auto' needs the in-process Engine, not the vLLM connector")
        return config
