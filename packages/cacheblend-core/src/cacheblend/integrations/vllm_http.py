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
bodies that are not JSON objects are left to vLLM.  This module does not import vLLM.
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
    its default options and the model's layer count (None where unknown)."""

    active: bool = True
    base: RequestOptions | None = None
    num_layers: int | None = None


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
    return _Server(base=base, num_layers=num_layers)


def error_body(message: str) -> bytes:
    """vLLM's own error shape (``ErrorResponse``), which OpenAI clients raise as ``BadRequestError``."""
    return json.dumps({"error": {"message": message, "type": "BadRequestError", "param": "kv_transfer_params",
                                 "code": 400}}).encode()


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
        payload = error_body(problem)
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})
