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
