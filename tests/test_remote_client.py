"""RemoteEngine's client side against servers that misbehave at the socket level; no vLLM
server is needed (the real server's tests are in test_remote.py)."""

from __future__ import annotations

import time

import pytest

from cacheblend import CacheBlendError
from cacheblend.integrations.vllm_server import free_port
from cacheblend.remote import RemoteEngine
from cacheblend.results import BlendStats


def test_a_server_that_never_answers_does_not_hold_up_clients_of_other_servers():
    """``RemoteEngine.shared`` built every client under one global lock: a server that
    accepted the connection and never answered held up every other lookup for its timeout."""
    import socket
    import threading
    import time

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held: list[socket.socket] = []

    def accept_and_say_nothing():
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept_and_say_nothing, daemon=True).start()
    silent = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    outcome: list[BaseException] = []

    def wait_for_silent():
        try:
            RemoteEngine.shared(silent, timeout=60.0, max_retries=0)
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome.append(e)

    waiting = threading.Thread(target=wait_for_silent, daemon=True)
    waiting.start()
    while not held:
        time.sleep(0.01)
    t = time.perf_counter()
    with pytest.raises(ConnectionError):
        RemoteEngine.shared(f"http://127.0.0.1:{free_port()}/v1", max_retries=0)
    assert time.perf_counter() - t < 10.0  # not behind the silent server's 60 s
    for conn in held:
        conn.close()
    listener.close()
    waiting.join(timeout=30)
    assert outcome and isinstance(outcome[0], (ConnectionError, CacheBlendError))


class FakeVLLM:
    """Just enough of vLLM's OpenAI API for RemoteEngine, on a loopback port: the ping says
    the connector keeps receipts; ``receipt(path)`` answers the receipt fetch as
    (status, headers, body bytes).  ``sent`` collects each request's ``kv_transfer_params``."""

    def __init__(self, model_dir, receipt, refuse: str | None = None, slow_s: float = 0.0) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sent: list[dict] = []
        self.sent, self.bodies = sent, []
        bodies = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                return

            def _reply(self, status: int, body: bytes, headers: dict | None = None,
                       kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    card = {"id": "m", "object": "model", "created": 0, "owned_by": "t", "root": str(model_dir),
                            "max_model_len": 2048}
                    self._reply(200, json.dumps({"object": "list", "data": [card]}).encode())
                else:
                    self._reply(*receipt(self.path))

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                sent.append(body.get("kv_transfer_params") or {})
                bodies.append(body)
                if body.get("stream"):
                    time.sleep(slow_s)  # a server slow to answer
                if refuse and body.get("stream"):
                    error = {"message": refuse, "type": "BadRequestError", "param": None, "code": 400}
                    self._reply(400, json.dumps({"error": error}).encode())
                    return
                choice = {"index": 0, "text": "Hi", "finish_reason": "length", "logprobs": None}
                reply = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}
                if not body.get("stream"):  # the ping
                    marker = {"connector": "CacheBlendConnector", "chunk_sink": "frame", "receipts": True}
                    self._reply(200, json.dumps(reply | {"kv_transfer_params": {"cacheblend": marker}}).encode())
                    return
                usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
                events = [reply, reply | {"choices": [], "usage": usage}]
                data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
                self._reply(200, data.encode(), kind="text/event-stream")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def ask_twice(url: str) -> list:
    """A full-prefill chat (never tagged), then two chats over a passage; their stats."""
    engine = RemoteEngine(url, max_retries=0)
    "".join(engine.start_chat([{"role": "user", "content": "Hi?"}], method="full", max_new_tokens=1).pieces)
    out = []
    for _ in range(2):
        gen = engine.start_chat([{"role": "user", "content": "Where is Vienna?"}], learn=False, max_new_tokens=1,
                                documents=["Vienna is the capital of Austria, on the Danube."])
        assert "".join(gen.pieces) == "Hi"
        out.append(gen.result.stats)
    return out


def test_a_server_without_the_receipt_route_gets_no_more_tagged_requests(default_model_dir):
    """A server whose connector keeps receipts but whose vLLM runs without the guard
    middleware answers the receipt fetch with vLLM's own 404: the client keeps the receipt
    of what it asked for and stops tagging requests (each tag would leave a file nobody
    fetches)."""
    import json

    server = FakeVLLM(default_model_dir, lambda path: (404, json.dumps({"error": {
        "message": "Not Found", "type": "NotFoundError", "code": 404}}).encode()))
    try:
        stats = ask_twice(server.url)
    finally:
        server.close()
    assert all(s.risk is None for s in stats)  # the asked-for receipt
    sent = server.sent
    assert "receipt" not in sent[1]  # full prefill: nothing loaded, the asked-for receipt is exact
    assert len(sent[2]["receipt"]) == 32 and "receipt" not in sent[3]  # tagged once, then not


def test_the_guards_own_404_or_a_damaged_receipt_keeps_the_answer_and_the_tagging(default_model_dir):
    """The guard's 404 (its header says so: a receipt the worker could not write) is not a
    server without receipts; a receipt that is not JSON, or has fields of the wrong kind,
    leaves the asked-for receipt whole.  None of it fails the answer, given already."""
    import json

    replies = iter([(404, json.dumps({"error": {"message": "none", "type": "NotFoundError", "code": 404}}).encode(),
                     {"x-cacheblend-receipts": "1"}),
                    (200, b"{not json", {"x-cacheblend-receipts": "1"})])
    server = FakeVLLM(default_model_dir, lambda path: next(replies))
    try:
        stats = ask_twice(server.url)
    finally:
        server.close()
    assert all(s.risk is None and s.reused_tokens + s.recomputed_tokens > 0 for s in stats)
    assert len(server.sent[2]["receipt"]) == 32 and len(server.sent[3]["receipt"]) == 32  # still tagged


def test_the_workers_receipt_replaces_what_was_asked_whole_or_not_at_all():
    asked = BlendStats(method="blend", recompute_ratio=0.15, prompt_tokens=100, reused_tokens=60,
                       recomputed_tokens=20, exact=False, ratio_used=0.15, exact_cached_tokens=10,
                       approximate_tokens=50)
    before = asked.as_dict()
    for bad in ({"risk": "high"}, {"exact": 1}, {"reused_tokens": -1}, {"ratio_used": None},
                {"escalated": True, "approximate_tokens": 3.5}):
        with pytest.raises(ValueError, match="receipt field"):
            asked.adopt_receipt(bad)
        assert asked.as_dict() == before  # nothing taken
    # a worker that missed a chunk in its store computed it: its counts are taken as they are
    asked.adopt_receipt({"exact": False, "risk": 0.2, "escalated": False, "ratio_used": 0.15,
                         "exact_cached_tokens": 10, "approximate_tokens": 30, "reused_tokens": 40,
                         "recomputed_tokens": 12, "method": "full"})
    assert (asked.reused_tokens, asked.recomputed_tokens, asked.risk, asked.method) == (40, 12, 0.2, "blend")
    older = BlendStats(method="blend", recompute_ratio=0.15, reused_tokens=60, recomputed_tokens=20)
    older.adopt_receipt({"exact": True, "ratio_used": 1.0, "escalated": True, "exact_cached_tokens": 10,
                         "approximate_tokens": 0})  # an older worker: counts from what was asked
    assert (older.reused_tokens, older.recomputed_tokens, older.escalated) == (10, 70, True)


def test_the_answer_never_asks_for_more_than_the_context_holds_and_a_refusal_is_bad_input(default_model_dir):
    """vLLM answers HTTP 400 when prompt plus ``max_tokens`` outgrows ``max_model_len``; the
    engine stops the answer at the context's end instead, and so does the client now.  A 400
    is bad input (CacheBlendError), which adapters do not retry, not an openai error."""
    import json

    from cacheblend import CacheBlendError

    server = FakeVLLM(default_model_dir, lambda path: (404, b"{}"))
    try:
        engine = RemoteEngine(server.url, max_retries=0)
        gen = engine.start_chat([{"role": "user", "content": "Hi?"}], method="full", max_new_tokens=100_000)
        "".join(gen.pieces)
        body = server.bodies[-1]
        assert 0 < body["max_tokens"] == 2048 - len(body["prompt"])
    finally:
        server.close()
    server = FakeVLLM(default_model_dir, lambda path: (404, b"{}"), refuse="'max_tokens' is too large")
    try:
        with pytest.raises(CacheBlendError, match="the server refused the request: 'max_tokens' is too large"):
            "".join(RemoteEngine(server.url, max_retries=0).start_chat(
                [{"role": "user", "content": "Hi?"}], method="full", max_new_tokens=4).pieces)
    finally:
        server.close()
    assert json.dumps(server.bodies[-1])  # it was asked once


def test_a_cancelled_async_stream_from_a_server_is_closed(default_model_dir):
    """A cancelled ``astream`` with ``base_url`` kept a thread reading the server's stream
    to ``max_tokens``; now the stream is closed at its next chunk (vLLM then aborts it)."""
    from conftest import give_up_on

    server = FakeVLLM(default_model_dir, lambda path: (404, b"{}"))
    try:
        engine = RemoteEngine(server.url, max_retries=0)
        gen = engine.start_chat([{"role": "user", "content": "Hi?"}], method="full", max_new_tokens=4)
        closed: list[bool] = []
        real = gen.pieces

        def pieces():
            try:
                for piece in real:
                    yield piece
                    time.sleep(1.0)  # a slow server
            finally:
                closed.append(True)

        give_up_on(pieces, 0.5)
        assert closed and gen.result is None  # stopped before the stream's end
    finally:
        server.close()


def test_a_remote_requests_timeout_bounds_it_and_raises_timeout_error(default_model_dir):
    """``timeout=`` raised openai's APITimeoutError (not a TimeoutError, as the engine's), and
    only after openai's retries, each waiting the whole timeout again and sending the
    generation again."""
    server = FakeVLLM(default_model_dir, lambda path: (404, b"{}"), slow_s=3.0)
    try:
        engine = RemoteEngine(server.url, max_retries=2)
        t = time.perf_counter()
        with pytest.raises(TimeoutError, match="timeout ran out"):
            "".join(engine.start_chat([{"role": "user", "content": "Hi?"}], method="full", max_new_tokens=4,
                                      timeout=1.0).pieces)
        assert time.perf_counter() - t < 2.5
        assert sum(1 for b in server.bodies if b.get("stream")) == 1  # sent once
    finally:
        server.close()


def test_a_seed_past_int64_reaches_the_server_as_the_same_bits_signed(default_model_dir):
    """The engine takes seeds up to 2**64 - 1; vLLM only the int64 range, so such a seed
    passed the client's checks and failed at the server once the call had begun."""
    server = FakeVLLM(default_model_dir, lambda path: (404, b"{}"))
    try:
        engine = RemoteEngine(server.url, max_retries=0)
        for seed, sent in ((2**64 - 1, -1), (2**63, -(2**63)), (7, 7)):
            "".join(engine.start_chat([{"role": "user", "content": "Hi?"}], method="full", max_new_tokens=1,
                                      seed=seed).pieces)
            assert server.bodies[-1]["seed"] == sent
    finally:
        server.close()
