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
only; :mod:`.vllm_receipts`), once, or HTTP 404.  This module does not import vLLM.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from ..config import ConnectorConfig, RequestOptions
from ..errors import CacheBlendError
from .kv_params import check_kv_transfer_params
from .vllm_receipts import RECEIPT_ROUTE, ReceiptBox, receipt_dir

__all__ = ["KVParamsGuard", "error_body"]

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


def _server(scope: Scope) -> _Server:
    """Read from vLLM's app state (``app.state.vllm_config``); outside vLLM, check the
    hints alone."""
    config = getattr(getattr(scope.get("app"), "state", None), "vllm_config", None)
    if config is None:
        return _Server()
    kv = getattr(config, "kv_transfer_config", None)
    if kv is None or getattr(kv, "kv_connector", None) != "CacheBlendConnector":
        return _Server(active=False)  # another connector's hints are not ours to judge
    try:
        base = ConnectorConfig.parse(getattr(kv, "kv_connector_extra_config", None)).defaults
    except CacheBlendError:
        base = None
    try:
        num_layers: int | None = int(config.model_config.get_total_num_hidden_layers())
    except Exception:  # noqa: BLE001 - an unknown model layout: check_layers is then checked by the worker
        num_layers = None
    engine_id = getattr(kv, "engine_id", None)
    return _Server(base=base, num_layers=num_layers, receipts=ReceiptBox(receipt_dir(engine_id)) if engine_id else None)


def error_body(message: str, *, kind: str = "BadRequestError", code: int = 400,
               param: str | None = "kv_transfer_params") -> bytes:
    """vLLM's own error shape (``ErrorResponse``), which OpenAI clients raise as ``BadRequestError``
    (or ``NotFoundError`` for ``kind="NotFoundError", code=404``)."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def _answer(send: Send, status: int, payload: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


def _is_json(scope: Scope) -> bool:
    for name, value in scope.get("headers") or ():
        if name.lower() == b"content-type":
            return b"json" in value.lower()
    return True  # no content type: vLLM parses the body as JSON


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


def _problem(body: bytes, server: _Server) -> str | None:
    """Why the request's ``kv_transfer_params`` are refused, or None."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # not JSON: vLLM answers that itself
        return None
    if not isinstance(data, dict) or data.get("kv_transfer_params") is None:
        return None
    try:
        check_kv_transfer_params(data["kv_transfer_params"], base=server.base, num_layers=server.num_layers)
    except CacheBlendError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - a bug here must not take requests down: the connector checks again
        log.exception("CacheBlend: could not check kv_transfer_params; passing the request to vLLM")
    return None


class KVParamsGuard:
    """ASGI middleware: a POST whose JSON body has invalid ``kv_transfer_params`` gets HTTP
    400 (``{"error": {"message", "type": "BadRequestError", "param", "code": 400}}``)
    and never reaches vLLM; every other request passes through unchanged."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._server_info: _Server | None = None  # read from the app on the first request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._clearing_receipts(scope, send))
            return
        receipt = scope["type"] == "http" and scope.get("method") == "GET"
        if receipt and str(scope.get("path")).startswith(RECEIPT_ROUTE):
            await self._receipt(scope, send)
            return
        if scope["type"] != "http" or scope.get("method") != "POST" or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        if self._server_info is None:
            self._server_info = _server(scope)
        if not self._server_info.active:
            await self.app(scope, receive, send)
            return
        body, messages = await _read_body(receive)
        problem = _problem(body, self._server_info) if messages[-1]["type"] == "http.request" else None
        if problem is None:
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

    async def _receipt(self, scope: Scope, send: Send) -> None:
        """The marker kept for a streamed request's tag, once; 404 if there is none (not
        tagged, fetched already, older than the TTL, or a server without the connector)."""
        if self._server_info is None:
            self._server_info = _server(scope)
        tag = str(scope["path"])[len(RECEIPT_ROUTE):]
        box = self._server_info.receipts if self._server_info.active else None
        marker = box.take(tag) if box is not None else None
        if marker is None:
            await _answer(send, 404, error_body(f"no CacheBlend receipt {tag!r} on this server", kind="NotFoundError",
                                                code=404, param=None))
            return
        await _answer(send, 200, json.dumps(marker).encode())
