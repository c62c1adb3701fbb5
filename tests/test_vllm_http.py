"""The HTTP guard in front of vLLM's OpenAI server (``--middleware
cacheblend.integrations.vllm_http.KVParamsGuard``): bad ``kv_transfer_params`` get HTTP
400 with a message and never reach the app; everything else reaches it unchanged, streamed
bodies and responses included.  Driven as a plain ASGI callable, with a fake app; the real
server is in test_remote.py."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from types import SimpleNamespace

import pytest

from cacheblend.integrations.vllm_http import KVParamsGuard
from cacheblend.integrations.vllm_receipts import RECEIPT_HEADER, RECEIPT_ROUTE, ReceiptBox, receipt_dir
from cacheblend.integrations.vllm_server import VLLMServer, kv_transfer_config


class FakeApp:
    """Records the body it read and what came after it; answers 200 in two streamed parts."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.state = SimpleNamespace()

    async def __call__(self, scope, receive, send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        after = await receive()  # what the client sends next: here, its disconnect
        self.calls.append({"path": scope.get("path"), "body": body, "after": after["type"]})
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def call(guard, body: bytes | dict, *, method: str = "POST", path: str = "/v1/completions", parts: int = 1,
         content_type: bytes | None = b"application/json", app=None,
         headers: tuple = ()) -> tuple[int, bytes, list[dict]]:
    """One request through ``guard``; (status, response body, sent messages)."""
    raw = json.dumps(body).encode() if isinstance(body, dict) else body
    size = max(1, -(-len(raw) // parts))
    pieces = [raw[i:i + size] for i in range(0, len(raw), size)] or [b""]
    incoming = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]
    incoming.append({"type": "http.disconnect"})
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    sent_headers = [(b"content-type", content_type)] if content_type else []
    scope = {"type": "http", "method": method, "path": path, "headers": sent_headers + list(headers), "app": app}
    asyncio.run(guard(scope, receive, send))
    status = sent[0]["status"]
    return status, b"".join(m.get("body", b"") for m in sent[1:]), sent


@pytest.mark.parametrize("params, field", [
    ({"chunks": [[0, float("inf")]]}, "chunks[0]"),
    ({"chunks": [[i, i + 1] for i in range(257)]}, "at most 256 spans"),
    ({"cacheblend": "release", "ids": ["x"]}, "ids"),
    ({"check_layers": [1.5]}, "check_layers"),
    ({"deviation": "q"}, "deviation"),
    ({"recompute_ratio": 2}, "recompute_ratio"),
    ({"method": "prefix"}, "method"),
    ({"selection": "random"}, "selection"),
    ({"ratio": 0.2}, "unknown fields ['ratio']"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/responses"])
def test_bad_params_get_400_and_never_reach_vllm(params, field, path):
    app = FakeApp()
    status, body, sent = call(KVParamsGuard(app), {"model": "m", "prompt": [1, 2], "kv_transfer_params": params},
                              path=path)
    error = json.loads(body)["error"]
    assert status == 400 and app.calls == []
    assert field in error["message"] and error["message"].startswith("kv_transfer_params: ")
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", "kv_transfer_params", 400)
    assert (b"content-type", b"application/json") in sent[0]["headers"]


def test_json_that_python_reads_as_infinity_gets_400():
    app = FakeApp()
    raw = b'{"prompt": [1, 2], "kv_transfer_params": {"chunks": [[0, 1e400]]}}'
    status, body, _ = call(KVParamsGuard(app), raw, parts=3)
    assert status == 400 and "chunks[0] = [0, inf]" in json.loads(body)["error"]["message"] and not app.calls


@pytest.mark.parametrize("body", [
    {"prompt": [1, 2], "kv_transfer_params": {"chunks": [[0, 1]], "recompute_ratio": 0.15}},
    {"prompt": [1, 2], "kv_transfer_params": {"cacheblend": "ping"}},
    {"prompt": [1, 2], "kv_transfer_params": None},
    {"prompt": [1, 2]},
    {"messages": [{"role": "user", "content": "hi " * 5000}], "stream": True},
])
def test_good_requests_reach_vllm_unchanged_in_pieces(body):
    app = FakeApp()
    raw = json.dumps(body).encode()
    status, answer, sent = call(KVParamsGuard(app), raw, parts=4)
    assert status == 200 and app.calls == [{"path": "/v1/completions", "body": raw, "after": "http.disconnect"}]
    assert answer == b"data: 1\n\ndata: [DONE]\n\n" and sent[1]["more_body"]  # the stream is not buffered


@pytest.mark.parametrize("raw, kwargs", [
    (b'{"prompt": [1, 2], "kv_transfer_params": {"chunks": ', {}),  # not JSON: vLLM's own 400
    (b'[{"kv_transfer_params": {"chunks": "x"}}]', {}),  # not an object
    (b'{"kv_transfer_params": {"chunks": "x"}}', {"method": "GET"}),
    (b'{"kv_transfer_params": {"chunks": "x"}}', {"content_type": b"multipart/form-data; boundary=x"}),
])
def test_what_is_not_a_json_post_is_left_to_vllm(raw, kwargs):
    app = FakeApp()
    status, _, _ = call(KVParamsGuard(app), raw, **kwargs)
    assert status == 200 and app.calls[0]["body"] == raw


def test_no_content_type_is_read_as_json():
    app = FakeApp()
    status, _, _ = call(KVParamsGuard(app), {"kv_transfer_params": {"chunks": "x"}}, content_type=None)
    assert status == 400 and not app.calls


def test_a_client_gone_mid_body_reaches_vllm_as_it_came():
    incoming = [{"type": "http.request", "body": b'{"kv_transfer_params": {"chunks": "x"', "more_body": True},
                {"type": "http.disconnect"}]
    seen = []

    async def inner(scope, receive, send):
        seen.extend([await receive(), await receive()])

    async def receive():
        return incoming.pop(0)

    async def send(message):
        raise AssertionError("the guard answered a gone client")

    asyncio.run(KVParamsGuard(inner)({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []},
                                     receive, send))
    assert [m["type"] for m in seen] == ["http.request", "http.disconnect"] and seen[0]["more_body"]


def vllm_state(connector: str | None, layers: int = 30, extra: dict | None = None,
               engine_id: str | None = None, api_key: list[str] | None = None) -> SimpleNamespace:
    """What vLLM keeps in ``app.state``: the parts the guard reads."""
    kv = None if connector is None else SimpleNamespace(kv_connector=connector, kv_connector_extra_config=extra or {},
                                                        engine_id=engine_id)
    model = SimpleNamespace(get_total_num_hidden_layers=lambda: layers)
    return SimpleNamespace(state=SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=kv, model_config=model),
                                                 args=SimpleNamespace(api_key=api_key)))


def test_inside_vllm_the_models_layers_and_server_defaults_count():
    body = {"prompt": [1, 2], "kv_transfer_params": {"check_layers": [29]}}
    status, answer, _ = call(KVParamsGuard(FakeApp()), body, app=vllm_state("CacheBlendConnector", layers=24))
    assert status == 400 and "out of range for a 24-layer model" in json.loads(answer)["error"]["message"]
    assert call(KVParamsGuard(FakeApp()), body, app=vllm_state("CacheBlendConnector", layers=30))[0] == 200
    defaults = vllm_state("CacheBlendConnector", layers=24, extra={"store": "memory", "check_layers": [28]})
    assert call(KVParamsGuard(FakeApp()), {"prompt": [1], "kv_transfer_params": {}}, app=defaults)[0] == 400


@pytest.mark.parametrize("connector", [None, "NixlConnector"])
def test_another_connectors_params_are_not_judged(connector):
    app = FakeApp()
    body = {"prompt": [1, 2], "kv_transfer_params": {"do_remote_decode": True, "anything": [0, 1e300]}}
    assert call(KVParamsGuard(app), body, app=vllm_state(connector))[0] == 200 and len(app.calls) == 1


def test_non_http_scopes_pass_through():
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["type"])

    async def nothing():
        return {}

    async def ignore(message):
        return None

    asyncio.run(KVParamsGuard(inner)({"type": "lifespan"}, nothing, ignore))
    assert seen == ["lifespan"]


def test_the_servers_command_loads_the_guard():
    cmd = VLLMServer("m", kv_transfer_config("memory"), port=1).command()
    assert cmd[cmd.index("--middleware") + 1] == "cacheblend.integrations.vllm_http.KVParamsGuard"
    assert "--middleware" not in VLLMServer("m", None, port=1).command()


def test_the_servers_command_recomputes_failed_loads_and_refuses_prefix_caching():
    """A load that fails must cost the request its prefill, not the request (vLLM's default
    policy fails it); and prefix caching would reuse blended blocks as exact."""
    config = kv_transfer_config("memory")
    assert config["kv_load_failure_policy"] == "recompute"
    with pytest.raises(ValueError, match="prefix caching"):
        VLLMServer("m", config, port=1, args=("--enable-prefix-caching",)).command()
    assert "--enable-prefix-caching" in VLLMServer("m", None, port=1, args=("--enable-prefix-caching",)).command()


@pytest.mark.parametrize("args", [("--port", "9000"), ("--port=9000",), ("--host", "0.0.0.0"), ("--model", "x"),
                                  ("--enable_prefix_caching",)])
def test_vllm_arguments_cannot_override_what_the_server_sets(args):
    """vLLM takes the last of a repeated flag: ``--port`` sent the health check to the wrong
    port for the whole start timeout, ``--host`` opened the server beyond loopback, and
    ``--enable_prefix_caching`` (vLLM reads ``_`` as ``-``) passed the prefix-caching check."""
    with pytest.raises(ValueError, match="cannot be given|prefix caching"):
        VLLMServer("m", kv_transfer_config("memory"), port=1, args=args).command()


def test_secrets_reach_vllm_through_its_environment_never_its_command_line(monkeypatch):
    """A Redis password or signing key in the store spec (or a registry URL) was in vLLM's
    command line, which every local user can read, and in vLLM's log of its arguments."""
    from cacheblend.config import ConnectorConfig
    from cacheblend.errors import CacheBlendError

    store, passages = "memory,redis://:hunter2@127.0.0.1:6379/0,key=s3cret", "redis://:pw9@127.0.0.1:6379/1"
    server = VLLMServer("m", kv_transfer_config(store, passages=passages), port=1)
    cmd = " ".join(server.command())
    assert "hunter2" not in cmd and "s3cret" not in cmd and "pw9" not in cmd
    extra = json.loads(cmd.split("--kv-transfer-config ", 1)[1].split(" --", 1)[0])["kv_connector_extra_config"]
    monkeypatch.setenv("CACHEBLEND_CONNECTOR_STORE", store)
    monkeypatch.setenv("CACHEBLEND_CONNECTOR_PASSAGES", passages)
    config = ConnectorConfig.parse(extra)  # as vLLM's processes read it, with the server's environment
    assert (config.store, config.passages) == (store, passages)
    assert "disk:/kv" in " ".join(VLLMServer("m", kv_transfer_config("disk:/kv"), port=1).command())  # no secret
    monkeypatch.delenv("CACHEBLEND_CONNECTOR_STORE")
    with pytest.raises(CacheBlendError, match="CACHEBLEND_CONNECTOR_STORE.*not set"):
        ConnectorConfig.parse(extra)


def test_an_ipv6_servers_url_has_its_address_in_brackets():
    assert VLLMServer("m", None, host="::1", port=8000).base_url == "http://[::1]:8000/v1"
    assert VLLMServer("m", None, host="0.0.0.0", port=8000).base_url == "http://127.0.0.1:8000/v1"


def test_a_server_does_not_start_on_a_port_something_listens_on():
    """Something already on the port answered the health check while our server was still
    starting (and then failed to bind): it was taken for ours."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        server = VLLMServer("m", kv_transfer_config("memory"), python="/nonexistent/python",
                            port=busy.getsockname()[1])
        with pytest.raises(RuntimeError, match="in use"):
            server.start(timeout=5)
        assert server.proc is None


def test_a_streamed_requests_receipt_is_served_once_and_only_its_own():
    """vLLM streams no ``kv_transfer_params`` back: the connector keeps a tagged request's
    marker in the server's receipt folder, and the guard answers ``GET`` for it, once."""
    engine_id = f"test-{os.getpid()}-receipts"
    box = ReceiptBox(receipt_dir(engine_id))
    try:
        tag = "0123456789abcdef" * 2
        box.put(tag, {"cacheblend": {"fidelity": {"escalated": True}}})
        app = vllm_state("CacheBlendConnector", engine_id=engine_id)
        status, answer, _ = call(KVParamsGuard(FakeApp()), b"", method="GET", path=RECEIPT_ROUTE + tag, app=app)
        assert status == 200 and json.loads(answer) == {"cacheblend": {"fidelity": {"escalated": True}}}
        status, answer, _ = call(KVParamsGuard(FakeApp()), b"", method="GET", path=RECEIPT_ROUTE + tag, app=app)
        assert status == 404 and json.loads(answer)["error"]["type"] == "NotFoundError"  # once
        box.put(tag, {"cacheblend": {}})
        for path in (RECEIPT_ROUTE + "..%2F" + tag, RECEIPT_ROUTE + "../" + tag, RECEIPT_ROUTE):
            assert call(KVParamsGuard(FakeApp()), b"", method="GET", path=path, app=app)[0] == 404
        other = vllm_state("NixlConnector", engine_id=engine_id)  # not our connector: nothing served
        assert call(KVParamsGuard(FakeApp()), b"", method="GET", path=RECEIPT_ROUTE + tag, app=other)[0] == 404
        app = FakeApp()  # every other GET reaches vLLM
        assert call(KVParamsGuard(app), b"", method="GET", path="/v1/models")[0] == 200 and len(app.calls) == 1

        async def lifespan(scope, receive, send):
            await send({"type": "lifespan.startup.complete"})
            del scope["app"].state  # as vLLM's lifespan does when it ends
            await send({"type": "lifespan.shutdown.complete"})

        async def ignore(message):
            return None

        scope = {"type": "lifespan", "app": vllm_state("CacheBlendConnector", engine_id=engine_id)}
        asyncio.run(KVParamsGuard(lifespan)(scope, None, ignore))
        assert not receipt_dir(engine_id).exists()  # the server stopped: its receipts went with it
    finally:
        box.close()


def test_a_receipt_written_after_the_stream_ended_is_still_served():
    """A stop string ends a stream in vLLM's API server, which then aborts the request in the
    engine: the receipt is written a step after the client saw the stream end.  The guard
    waits for the tag of a request it passed on; a 404 it gives says it is the guard's, so a
    client does not take it for a server without receipts."""
    engine_id = f"test-{os.getpid()}-late"
    box = ReceiptBox(receipt_dir(engine_id))
    try:
        tag, app = "late-receipt-0123456789", vllm_state("CacheBlendConnector", engine_id=engine_id)
        guard = KVParamsGuard(FakeApp())
        assert call(guard, {"prompt": [1, 2], "kv_transfer_params": {"receipt": tag}}, app=app)[0] == 200
        threading.Timer(0.4, box.put, (tag, {"cacheblend": {"fidelity": {"exact": False}}})).start()
        status, answer, sent = call(guard, b"", method="GET", path=RECEIPT_ROUTE + tag, app=app)
        assert status == 200 and json.loads(answer)["cacheblend"]["fidelity"] == {"exact": False}
        assert (RECEIPT_HEADER.encode(), b"1") in sent[0]["headers"]
        t0 = time.monotonic()  # a tag no request here carried: a short wait, then the guard's own 404
        status, _, sent = call(guard, b"", method="GET", path=RECEIPT_ROUTE + "n" * 16, app=app)
        assert status == 404 and (RECEIPT_HEADER.encode(), b"1") in sent[0]["headers"]
        assert time.monotonic() - t0 < 3
    finally:
        box.close()


def test_with_an_api_key_only_a_client_holding_it_reaches_the_guards_answers():
    """vLLM puts ``--middleware`` outside its API-key check: the guard must not serve a
    receipt, nor judge a request, for a caller vLLM would refuse; it passes them on."""
    engine_id = f"test-{os.getpid()}-keys"
    box = ReceiptBox(receipt_dir(engine_id))
    try:
        tag = "k" * 20
        box.put(tag, {"cacheblend": {}})
        app = vllm_state("CacheBlendConnector", engine_id=engine_id, api_key=["sk-right"])
        for headers in ((), ((b"authorization", b"Bearer sk-wrong"),), ((b"authorization", b"Basic sk-right"),)):
            inner = FakeApp()
            status, answer, _ = call(KVParamsGuard(inner), b"", method="GET", path=RECEIPT_ROUTE + tag, app=app,
                                     headers=headers)
            assert len(inner.calls) == 1 and answer == b"data: 1\n\ndata: [DONE]\n\n"  # vLLM's to answer
            inner = FakeApp()
            bad = {"prompt": [1], "kv_transfer_params": {"deviation": "q"}}
            assert call(KVParamsGuard(inner), bad, app=app, headers=headers)[0] == 200 and len(inner.calls) == 1
        key = ((b"authorization", b"Bearer sk-right"),)
        status, answer, _ = call(KVParamsGuard(FakeApp()), b"", method="GET", path=RECEIPT_ROUTE + tag, app=app,
                                 headers=key)
        assert status == 200 and json.loads(answer) == {"cacheblend": {}}
        bad = {"prompt": [1], "kv_transfer_params": {"deviation": "q"}}
        assert call(KVParamsGuard(FakeApp()), bad, app=app, headers=key)[0] == 400
        os.environ["VLLM_API_KEY"] = "sk-env"  # vLLM's fallback when no --api-key is given
        try:
            inner = FakeApp()
            call(KVParamsGuard(inner), bad, app=vllm_state("CacheBlendConnector"))
            assert len(inner.calls) == 1
        finally:
            del os.environ["VLLM_API_KEY"]
    finally:
        box.close()
