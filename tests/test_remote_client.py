"""RemoteEngine's client side against servers that misbehave at the socket level; no vLLM
server is needed (the real server's tests are in test_remote.py)."""

from __future__ import annotations

import pytest

from cacheblend import CacheBlendError
from cacheblend.integrations.vllm_server import free_port
from cacheblend.remote import RemoteEngine


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


def test_a_server_without_the_receipt_route_gets_no_more_tagged_requests(default_model_dir):
    """A server whose connector keeps receipts but whose vLLM runs without the guard
    middleware answers the receipt fetch with 404: the client keeps the receipt of what it
    asked for and stops tagging requests (each tag would leave a file nobody fetches).
    The server here speaks just enough of vLLM's OpenAI API for RemoteEngine."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sent: list[dict] = []

    class Server(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            return

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                card = {"id": "m", "object": "model", "created": 0, "owned_by": "t", "root": str(default_model_dir),
                        "max_model_len": 2048}
                self._json(200, {"object": "list", "data": [card]})
            else:  # no guard middleware: vLLM itself answers the receipt route
                self._json(404, {"error": {"message": "Not Found", "type": "NotFoundError", "code": 404}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            sent.append(body.get("kv_transfer_params") or {})
            choice = {"index": 0, "text": "Hi", "finish_reason": "length", "logprobs": None}
            reply = {"id": "c", "object": "text_completion", "created": 0, "model": "m", "choices": [choice]}
            if not body.get("stream"):  # the ping
                marker = {"connector": "CacheBlendConnector", "chunk_sink": "frame", "receipts": True}
                self._json(200, reply | {"kv_transfer_params": {"cacheblend": marker}})
                return
            usage = {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}
            events = [reply, reply | {"choices": [], "usage": usage}]
            data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(data.encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        engine = RemoteEngine(f"http://127.0.0.1:{server.server_address[1]}/v1", max_retries=0)
        "".join(engine.start_chat([{"role": "user", "content": "Hi?"}], method="full", max_new_tokens=1).pieces)
        for _ in range(2):
            gen = engine.start_chat([{"role": "user", "content": "Where is Vienna?"}], learn=False, max_new_tokens=1,
                                    documents=["Vienna is the capital of Austria, on the Danube."])
            assert "".join(gen.pieces) == "Hi" and gen.result.stats.risk is None  # the asked-for receipt
    finally:
        server.shutdown()
        server.server_close()
    assert "receipt" not in sent[1]  # full prefill: nothing loaded, the asked-for receipt is exact
    assert len(sent[2]["receipt"]) == 32 and "receipt" not in sent[3]  # tagged once, then not
