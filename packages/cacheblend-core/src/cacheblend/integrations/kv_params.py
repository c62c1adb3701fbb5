"""What a request may ask of the vLLM connector (its ``kv_transfer_params``), checked in one place.

Two places read these hints and must agree on what they mean: the HTTP guard
(:mod:`.vllm_http`), which answers a bad request with HTTP 400 before vLLM sees it, and the
connector's scheduler side (:mod:`.vllm`), which must never raise (an exception there kills
vLLM's engine core), so it runs a request with bad hints as plain vLLM and logs why.  Both
call :func:`parse_kv_params`.  The option values are checked by
:meth:`~cacheblend.config.RequestOptions.parse`, as for every other entry point.

What needs the prompt is checked only where the prompt is known (the scheduler side):
chunk spans must end before the last prompt token (:func:`fit_spans`) and an ingest's sink
must be shorter than the prompt.  This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config import SELECTION_FIELDS, BlendConfig, RequestOptions
from ..errors import CacheBlendError
from .vllm_receipts import valid_tag

__all__ = ["CONNECTOR_METHODS", "KNOWN_FIELDS", "OPERATIONS", "KVParams", "check_kv_transfer_params", "fit_prefix",
           "fit_spans", "parse_kv_params"]

OPERATIONS = ("ingest", "release", "ping")
CONNECTOR_METHODS = ("blend", "reuse", "full")  # "prefix" is vLLM's prefix caching, off with the connector
OPTION_FIELDS = ("method", "recompute_ratio", "quality_floor", *SELECTION_FIELDS)
_OP_FIELDS = {"ingest": "sink", "release": "ids"}  # the field each operation needs
KNOWN_FIELDS = ("chunks", "prefix", "cacheblend", "sink", "ids", "receipt", *OPTION_FIELDS)
# Each span costs a store lookup (and, on a miss, a precompute) inside the step that loads
# the request, which every other request of the server waits on: a client's thousands of
# tiny spans would stall the server.  RAG prompts carry tens.
MAX_CHUNKS = 256
# vLLM's own keys, passed through untouched: pre-tokenized chat prompts (``prompt_token_ids``)
# and the disaggregated-prefill handshake (``do_remote_*``, ``remote_*``).
_VLLM_FIELDS = ("prompt_token_ids", "do_remote_prefill", "do_remote_decode")
_VLLM_PREFIX = "remote_"


@dataclass(frozen=True)
class KVParams:
    """A request's checked hints: an operation (``op``: ``ingest`` with ``sink``, ``release``
    with ``ids``, ``ping``), or the chunk spans (None: not given, so the connector searches
    the passage registry) and the selection to blend them with.  ``prefix``: a prompt
    without chunks whose first tokens (a long system instruction) the connector reads
    exactly from the prefix cache; with chunks the prefix is what comes before the first,
    unless ``prefix`` names fewer tokens (a chat's system turn: what follows it up to the
    first chunk, earlier turns, is computed rather than stored as a prefix).  ``receipt``: the
    tag a streaming client fetches the request's receipt by (:mod:`.vllm_receipts`)."""

    op: str | None = None
    sink: int | None = None
    ids: tuple[int, ...] | None = None
    chunks: tuple[tuple[int, int], ...] | None = None
    prefix: int | None = None
    receipt: str | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
    blend: BlendConfig = field(default_factory=BlendConfig)

    @property
    def blends(self) -> bool:
        """Whether the connector loads chunk caches for this request at all."""
        return self.op is None and self.options.method in ("blend", "reuse")


def _fail(message: str) -> CacheBlendError:
    return CacheBlendError(f"kv_transfer_params: {message}")


def _int(value: Any) -> int | None:
    """``value`` as an int if it is one (numpy integers too), never a bool, float or string."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_names(params: Mapping[Any, Any]) -> None:
    unknown = sorted(str(k) for k in params
                     if k not in KNOWN_FIELDS and k not in _VLLM_FIELDS and not str(k).startswith(_VLLM_PREFIX))
    if unknown:
        raise _fail(f"unknown fields {unknown}; CacheBlendConnector reads {', '.join(KNOWN_FIELDS)} "
                    f"(and passes vLLM's own {', '.join(_VLLM_FIELDS)}, {_VLLM_PREFIX}*)")


def _spans(value: Any) -> tuple[tuple[int, int], ...]:
    """Client-given chunk spans: ``[start, end)`` integer pairs, non-empty, sorted, disjoint."""
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise _fail(f"chunks must be a list of [start, end] token spans, got {value!r}")
    out: list[tuple[int, int]] = []
    for i, span in enumerate(value):
        if i == MAX_CHUNKS:
            raise _fail(f"chunks: at most {MAX_CHUNKS} spans per request")
        pair = list(span) if isinstance(span, (list, tuple)) else None
        if pair is None or len(pair) != 2:
            raise _fail(f"chunks[{i}] must be a [start, end] pair, got {span!r}")
        a, b = _int(pair[0]), _int(pair[1])
        if a is None or b is None:
            raise _fail(f"chunks[{i}] = {span!r}: start and end must be integers")
        if not 0 <= a < b:
            raise _fail(f"chunks[{i}] = {span!r}: need 0 <= start < end")
        if out and a < out[-1][1]:
            raise _fail(f"chunks[{i}] = {span!r} starts before chunks[{i - 1}] ends: spans must be sorted "
                        "and disjoint")
        out.append((a, b))
    return tuple(out)


def fit_spans(spans: tuple[tuple[int, int], ...], num_tokens: int) -> list[tuple[int, int]]:
    """``spans`` if they end before the last of ``num_tokens`` prompt tokens (which vLLM
    must compute itself); a :class:`CacheBlendError` that says where they end otherwise."""
    if spans and spans[-1][1] > num_tokens - 1:
        raise _fail(f"chunks end at token {spans[-1][1]}, past the last but one token of the "
                    f"{num_tokens}-token prompt")
    return list(spans)


def fit_prefix(prefix: int, num_tokens: int) -> int:
    """``prefix`` if it ends before the last of ``num_tokens`` prompt tokens, as :func:`fit_spans`."""
    if prefix > num_tokens - 1:
        raise _fail(f"prefix of {prefix} tokens reaches past the last but one token of the {num_tokens}-token prompt")
    return prefix


def _prefix(value: Any, chunks: tuple[tuple[int, int], ...] | None) -> int:
    prefix = _int(value)
    if prefix is None or prefix < 1:
        raise _fail(f"prefix must be the number of prompt tokens (an int >= 1) read from the prefix cache, "
                    f"got {value!r}")
    if chunks and prefix > chunks[0][0]:
        raise _fail(f"prefix of {prefix} tokens reaches into the first chunk, which starts at token "
                    f"{chunks[0][0]}: with chunks, the prefix is at most the tokens before the first")
    return prefix


def _operation(op: Any, params: Mapping[Any, Any]) -> KVParams:
    """``{"cacheblend": op, ...}``: the operation's own field and vLLM's, nothing else."""
    if not isinstance(op, str) or op not in OPERATIONS:
        raise _fail(f"cacheblend must be one of {OPERATIONS}, got {op!r}")
    own = _OP_FIELDS.get(op)
    extra = sorted(k for k in KNOWN_FIELDS if k in params and k not in ("cacheblend", own))
    if extra:
        raise _fail(f"{extra} do not go with cacheblend={op!r}" + (f" (it takes {own!r})" if own else ""))
    if op == "ingest":
        sink = _int(params.get("sink"))
        if sink is None or sink < 0:
            raise _fail(f"cacheblend='ingest' needs sink: the number of sink ids (an int >= 0) before the "
                        f"chunk, got {params.get('sink')!r}")
        return KVParams(op=op, sink=sink)
    if op == "release":
        ids = params.get("ids")
        tokens = [_int(t) for t in ids] if isinstance(ids, (list, tuple)) else []
        if not tokens or any(t is None or t < 0 for t in tokens):
            raise _fail(f"cacheblend='release' needs ids: the chunk's token ids (a non-empty list of ints "
                        f">= 0), got {ids!r}")
        return KVParams(op=op, ids=tuple(t for t in tokens if t is not None))
    return KVParams(op=op)


def _options(params: Mapping[Any, Any], base: RequestOptions | None,
             num_layers: int | None) -> tuple[RequestOptions, BlendConfig]:
    method = params.get("method", "blend")
    if not isinstance(method, str) or method not in CONNECTOR_METHODS:
        raise _fail(f"method must be one of {CONNECTOR_METHODS} with the vLLM connector, got {method!r}")
    try:
        options = RequestOptions.parse({k: params[k] for k in OPTION_FIELDS if k in params}, base=base)
        if options.auto:
            raise CacheBlendError("recompute_ratio='auto' needs the in-process Engine; the vLLM connector "
                                  "takes a share within [0, 1] or 'guard'")
        return options, options.blend(num_layers)
    except CacheBlendError as e:
        raise _fail(str(e)) from None


def parse_kv_params(params: Any, *, base: RequestOptions | None = None,
                    num_layers: int | None = None) -> KVParams:
    """``params`` (a request's ``kv_transfer_params``; None: none) checked and read.

    ``base``: the server's default options (the connector's extra config); ``num_layers``:
    the model's, so that ``check_layers`` past the last layer is refused here rather than
    failing the load.  Raises :class:`CacheBlendError` naming the first bad field."""
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise _fail(f"must be a JSON object, got {type(params).__name__} {params!r}")
    _check_names(params)
    if params.get("cacheblend") is not None:
        return _operation(params["cacheblend"], params)
    stray = sorted(k for k in _OP_FIELDS.values() if params.get(k) is not None)
    if stray:
        raise _fail(f"{stray} go only with an operation (cacheblend='ingest' takes sink, 'release' takes ids)")
    options, blend = _options(params, base, num_layers)
    chunks = None if params.get("chunks") is None else _spans(params["chunks"])
    receipt = params.get("receipt")
    if receipt is not None and not valid_tag(receipt):
        raise _fail(f"receipt must be a tag of 16 to 64 letters, digits, '-' or '_' (e.g. a uuid4 hex), "
                    f"got {receipt!r}")
    if params.get("prefix") is None:
        return KVParams(chunks=chunks, receipt=receipt, options=options, blend=blend)
    return KVParams(chunks=chunks or (), prefix=_prefix(params["prefix"], chunks), receipt=receipt,
                    options=options, blend=blend)


def check_kv_transfer_params(params: Any, *, base: RequestOptions | None = None,
                             num_layers: int | None = None) -> None:
    """Raise :class:`CacheBlendError` if ``params`` holds a hint the connector would refuse
    (see :func:`parse_kv_params`); what only the prompt can tell is left to the connector."""
    parse_kv_params(params, base=base, num_layers=num_layers)
