"""Every option and its default, defined once.

* :class:`BlendConfig` — the HKVD selection of one fused prefill (paper §4.2);
* :class:`SamplingConfig` — decoding;
* :class:`RequestOptions` — what a request may set: the method, the selection and
  decoding, validated and named the same way by the in-process
  :class:`~cacheblend.engine.Engine`, the :class:`~cacheblend.remote.RemoteEngine`, the
  CLI, both framework adapters and the vLLM connector (:mod:`.options`);
* :class:`EngineConfig` — settings of an engine (device, dtype, chunk sink, pipelining,
  passage learning);
* :class:`ConnectorConfig` — the vLLM connector's ``kv_connector_extra_config``
  (:mod:`.services`).

Imports neither torch nor transformers, so clients of a server can use it.
"""

from .options import (
    CHUNK_BUDGETS,
    CHUNK_SINKS,
    DEVIATIONS,
    GUARD_MAX_EXPOSURE,
    GUARD_MAX_RISK,
    KV_DTYPES,
    METHODS,
    RATIO_MODES,
    SELECTION_FIELDS,
    SELECTIONS,
    SHIFT_PARTS,
    BlendConfig,
    RequestOptions,
    SamplingConfig,
)
from .services import MODEL_CHUNK_SINKS, ConnectorConfig, EngineConfig, chunk_sink_for

__all__ = ["CHUNK_BUDGETS", "CHUNK_SINKS", "DEVIATIONS", "GUARD_MAX_EXPOSURE", "GUARD_MAX_RISK", "KV_DTYPES",
           "METHODS", "MODEL_CHUNK_SINKS", "RATIO_MODES", "SELECTIONS", "SELECTION_FIELDS", "SHIFT_PARTS",
           "BlendConfig", "ConnectorConfig", "EngineConfig", "RequestOptions", "SamplingConfig", "chunk_sink_for"]
