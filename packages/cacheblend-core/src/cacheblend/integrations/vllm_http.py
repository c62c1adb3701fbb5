"""HTTP 400 for bad CacheBlend hints, before vLLM's OpenAI server takes the request.

vLLM hands a request's ``kv_transfer_params`` to the connector unread, and the connector's
scheduler side cannot refuse a request (it runs a bad one as plain vLLM, or the load fails
later with an HTTP 500 that gives no reason).  :class:`KVParamsGuard` is an ASGI middleware
that checks them up front with :func:`~.kv_params.check_kv_transfer_params` and answers
HTTP 400 with an OpenAI-style error naming the field.  Load it with

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware cacheblend.integrations.vllm_http.KVParamsGuard

(:class:`~.vllm_server.VLLMServer` adds the flag whenever the connector is configured).
It is plain ASGI, not Starlette's ``BaseHTTPMiddleware``: the body is read once, replayed
to vLLM unchanged, and later ``receive`` calls (client disconnects) and streamed responses
pass straight through.  Any POST with a JSON body is checked, whatever its path (the
completions, chat, responses and messages routes all carry ``kv_transfer_params``);
bodies that are not JSON objects are left to vLLM.

It also answers ``GET /v1/cacheblend/receipts/TAG``: the marker of a streamed request that
carried ``"receipt": TAG`` (vLLM returns ``kv_transfer_params`` in non-streamed responses
only; :mod:`.vllm_receipts`), once, or HTTP 404.  A receipt can be written a step after the
stream ends (a stop string is found in the API server, which then aborts the request in
the engine), so for a tag whose request went through here the answer waits up to
:data:`RECEIPT_WAIT_S` for it.

vLLM adds ``--middleware`` classes outside its own, so this one sees requests before
vLLM's API-key check (``--api-key``, ``VLLM_API_KEY``): a request without a valid key is
passed on unread, for vLLM to refuse.  This module does not import vLLM.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from ..config import ConnectorConfig, RequestOptions
from ..errors import CacheBlendError
from .kv_params import check_kv_transfer_params
from .vllm_receipts import RECEIPT_HEADER, RECEIPT_ROUTE, RECEIPT_WAIT_S, TTL_S, ReceiptBox, receipt_dir, valid_tag

__all__ = ["KVParamsGuard", "error_body"]

_UNSEEN_WAIT_S = 0.5  # ... and for a tag this process did not see (another API server's request)
_POLL_S = 0.02
_SEEN_MAX = 100_000  # tags of requests passed on, kept until fetched or older than the TTL
_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # the routes vLLM's API-key check covers

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

log = logging.getLogger("vllm.cacheblend")


@dataclass(frozen=True)
class _Server:
    """What the guard knows of the server it runs in: whether CacheBlend is its connector,
    its default options, the model's layer count (None where unknown) and where the
    connector keeps streamed requests' receipts."""

    active: bool = True
    base: RequestOptions | None = None
    num_layers: int | None = None
    receipts: ReceiptBox | None = None
    keys: tuple[bytes, ...] = ()  # SHA-256 of the server's API keys; empty: no key is asked for

    def authorized(self, scope: Scope) -> bool:
        """Whether vLLM's API-key check would let this request through (its own rule)."""
        if not self.keys or not _route(scope).startswith(_GUARDED):
            return True
        scheme, _, token = _header(scope, b"authorization").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        return any([secrets.compare_digest(digest, key) for key in self.keys])  # every key compared


def _route(scope: Scope) -> str:
    return str(scope.get("path", "")).removeprefix(str(scope.get("root_path", "")))


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return ""


def _api_keys(state: Any) -> tuple[bytes, ...]:
    """The keys vLLM checks (``--api-key`` before ``VLLM_API_KEY``), hashed as vLLM does."""
    keys = getattr(getattr(state, "args", None), "api_key", None) or [os.environ.get("VLLM_API_KEY")]
    if isinstance(keys, str):
        keys = [keys]
    return tuple(hashlib.sha256(k.encode()).digest() for k in keys if k)


def _server(scope: Scope) -> _Server:
    """Read from vLLM's app state (``app.state.vllm_config``); outside vLLM, check the
    hints alone."""
    state = getattr(scope.get("app"), "state", None)
    config = getattr(state, "vllm_config", None)
    if config is None:
        return _Server(keys=_api_keys(state))
    kv = getattr(config, "kv_transfer_config", None)
    if kv is None or getattr(kv, "kv_connector", None) != "CacheBlendConnector":
        return _Server(active=False, keys=_api_keys(state))  # another connector's hints are not ours to judge
    try:
        base = ConnectorConfig.parse(getattr(kv, "kv_connector_extra_config", None)).defaults
    except CacheBlendError:
        base = None
    try:
        num_layers: int | None = int(config.model_config.get_total_num_hidden_layers())
    except Exception:  # noqa: BLE001 - an unknown model layout: check_layers is then checked by the worker
        num_layers = None
    engine_id = getattr(kv, "engine_id", None)
    return _Server(base=base, num_layers=num_layers, receipts=ReceiptBox(receipt_dir(engine_id)) if engine_id else None,
                   keys=_api_keys(state))


def error_body(message: str, *, kind: str = "BadRequestError", code: int = 400,
               param: str | None = "kv_transfer_params") -> bytes:
    """vLLM's own error shape (``ErrorResponse``), which OpenAI clients raise as ``BadRequestError``
    (or ``NotFoundError`` for ``kind="NotFoundError", code=404``)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def _answer(send: Send, status: int, payload: bytes, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


def _is_json(scope: Scope) -> bool:
    kind = _header(scope, b"content-type")
    return "json" in kind.lower() if kind else True  # no content type: vLLM parses the body as JSON


async def _read_body(receive: Receive) -> tuple[bytes, list[Message]]:
    """The whole request body, and the messages it came in (ending with a disconnect if the
    client left before sending all of it)."""
    parts, messages = [], []
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return b"", messages
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(parts), messages


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that gives ``messages`` again, then the client's own."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def _problem(body: bytes, server: _Server) -> tuple[str | None, str | None]:
    """Why the request's ``kv_transfer_params`` are refused (or None), and its receipt tag."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON: vLLM answers that itself
        return None, None
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if params is None:
        return None, None
    try:
        check_kv_transfer_params(params, base=server.base, num_layers=server.num_layers)
    except CacheBlendError as e:
        return str(e), None
    except Exception:  # noqa: BLE001 - a bug here must not take requests down: the connector checks again
        log.exception("CacheBlend: could not check kv_transfer_params; passing the request to vLLM")
    tag = params.get("receipt") if isinstance(params, dict) else None
    return None, tag if valid_tag(tag) else None


class KVParamsGuard:
    """ASGI middleware: a POST whose JSON body has invalid ``kv_transfer_params`` gets HTTP
    400 (``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``)
    and never reaches vLLM; every other request passes through unchanged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._server_info: _Server | None = None  # read from the app on the first request
        self._seen: dict[str, float] = {}  # receipt tags of requests passed on -> when

    def _info(self, scope: Scope) -> _Server:
        if self._server_info is None:
            self._server_info = _server(scope)
        return self._server_info

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._clearing_receipts(scope, send))
            return
        if scope["type"] != "http" or scope.get("method") not in ("GET", "POST") \
                or not self._info(scope).authorized(scope):  # vLLM answers 401 (or whatever it does)
            await self.app(scope, receive, send)
            return
        if scope.get("method") == "GET":
            if _route(scope).startswith(RECEIPT_ROUTE):
                await self._receipt(scope, send)
            else:
                await self.app(scope, receive, send)
            return
        if not _is_json(scope) or not self._info(scope).active:
            await self.app(scope, receive, send)
            return
        body, messages = await _read_body(receive)
        problem, tag = _problem(body, self._info(scope)) if messages[-1]["type"] == "http.request" else (None, None)
        if problem is None:
            if tag is not None:
                self._saw(tag)
            await self.app(scope, _replay(messages, receive), send)
            return
        log.info("CacheBlend: HTTP 400 for %s %s: %s", scope.get("method"), scope.get("path"), problem)
        await _answer(send, 400, error_body(problem))

    def _clearing_receipts(self, scope: Scope, send: Send) -> Send:
        """The lifespan's ``send``: it reads the server's settings once started, and removes
        the receipt folder once shut down (vLLM kills its engine core, whose connector cannot;
        and it has deleted ``app.state`` by then)."""

        async def sending(message: Message) -> None:
            if message.get("type") == "lifespan.startup.complete" and self._server_info is None:
                self._server_info = _server(scope)
            if message.get("type") == "lifespan.shutdown.complete" and self._server_info is not None:
                if self._server_info.receipts is not None:
                    self._server_info.receipts.close()
            await send(message)

        return sending

    def _saw(self, tag: str) -> None:
        """Remember a tagged request passed on (its receipt may come a step after its stream)."""
        now = time.monotonic()
        self._seen[tag] = now
        while self._seen:
            oldest, when = next(iter(self._seen.items()))
            if len(self._seen) <= _SEEN_MAX and now - when < TTL_S:
                break
            del self._seen[oldest]

    async def _receipt(self, scope: Scope, send: Send) -> None:
        """The marker kept for a streamed request's tag, once; 404 if there is none (not
        tagged, fetched already, older than the TTL, or a server without the connector)."""
        tag = _route(scope)[len(RECEIPT_ROUTE):]
        info = self._info(scope)
        box = info.receipts if info.active and valid_tag(tag) else None
        marker = box.take(tag) if box is not None else None
        if marker is None and box is not None and box.usable:
            until = time.monotonic() + (RECEIPT_WAIT_S if tag in self._seen else _UNSEEN_WAIT_S)
            while marker is None and time.monotonic() < until:
                await asyncio.sleep(_POLL_S)
                marker = box.take(tag)
        self._seen.pop(tag, None)
        ours = ((RECEIPT_HEADER.encode(), b"1"),)  # the guard answered, not a server without it
        if marker is None:
            shown = tag if valid_tag(tag) else "(not a receipt tag)"
            await _answer(send, 404, error_body(f"no CacheBlend receipt {shown} on this server", kind="NotFoundError",
                                                code=404, param=None), ours)
            return
        await _answer(send, 200, json.dumps(marker).encode(), ours)
