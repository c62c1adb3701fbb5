"""``cacheblend serve``: two replicas started by the command, on one Redis tier and one
Redis passage registry, answering a stock OpenAI client; the second reuses the chunks the
first computed; Ctrl-C (and SIGTERM) stop each one with its whole vLLM process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from cacheblend.datasets import load_qa
from cacheblend.integrations.registry import register_passages
from cacheblend.integrations.vllm_server import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("CACHEBLEND_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))


def _serve(model: str, port: int, store: str, passages: str, root: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cacheblend.cli", "serve", model, "--store", store, "--passages", passages,
         "--port", str(port), "--stats", str(root / f"stats-{port}.jsonl"), "--log", str(root / f"vllm-{port}.log"),
         "--vllm-python", str(VLLM_PYTHON), "--start-timeout", "500"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def _url_of(proc: subprocess.Popen, root: Path, port: int) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the command prints one line once the server is healthy
    if not line.startswith("cacheblend serve: http"):
        proc.kill()
        log = (root / f"vllm-{port}.log").read_text(errors="replace")[-3000:] if (root / f"vllm-{port}.log").exists() \
            else ""
        pytest.fail(f"no URL line: {line!r} {proc.stderr.read() if proc.stderr else ''} {log}")
    return line.split()[2]


def _last_load(root: Path, port: int) -> dict:
    lines = (root / f"stats-{port}.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["op"] == "load"][-1]


def _wait_for_entries(url: str, count: int, root: Path, timeout_s: float = 60.0) -> None:
    """The memory tier takes a chunk at once and Redis on a background writer (write-behind),
    so a replica's reply can come back before its chunks are in Redis; wait for them.  On
    failure, say what the replicas' Redis tiers logged (a timeout, a refusal)."""
    import redis

    r, deadline = redis.Redis.from_url(url), time.monotonic() + timeout_s
    while sum(1 for _ in r.scan_iter(match="*:meta")) < count:
        if time.monotonic() > deadline:
            said = [line for log in root.glob("vllm-*.log") for line in log.read_text(errors="replace").splitlines()
                    if "redis tier" in line]
            pytest.fail(f"fewer than {count} chunks reached Redis in {timeout_s:.0f} s; the tiers said: {said}")
        time.sleep(0.1)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _servers_on(port: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info.get("cmdline") or []
        if "vllm.entrypoints.openai.api_server" in cmd and str(port) in cmd:
            out.append(p)
    return out


def test_replicas_started_by_cacheblend_serve_share_chunks_and_stop_cleanly(tmp_path, default_model_dir,
                                                                          redis_server):
    if not VLLM_PYTHON.exists():
        if os.environ.get("CACHEBLEND_REQUIRE_VLLM") == "1":
            pytest.fail(f"{VLLM_PYTHON} is missing: `make vllm` builds the vLLM venv")
        pytest.skip("no vLLM venv (make vllm)")
    import redis
    from openai import OpenAI

    url = redis_server.url.rsplit("/", 1)[0] + "/3"  # a database of its own
    redis.Redis.from_url(url).flushdb()
    ports = [free_port(), free_port()]
    # signed with a key: it reaches vLLM's processes through their environment (env:NAME)
    procs = [_serve(str(default_model_dir), port, f"memory,{url},key=replicas-share-it", url, tmp_path)
             for port in ports]
    try:
        urls = [_url_of(p, tmp_path, port) for p, port in zip(procs, ports, strict=True)]
        assert urls == [f"http://127.0.0.1:{port}/v1" for port in ports]
        ex = load_qa("musique", "dev", limit=1, passages=4)[0]
        passages = [p.strip() for p in ex.passages]
        register_passages(url, passages)  # once, in the registry every replica reads
        content = "\n\n".join(passages) + f"\n\nQuestion: {ex.question}"
        replies = []
        for base_url in urls:
            client = OpenAI(base_url=base_url, api_key="EMPTY")
            model = client.models.list().data[0].id
            replies.append(client.chat.completions.create(
                model=model, max_tokens=4, temperature=0.0, messages=[{"role": "user", "content": content}]))
            _wait_for_entries(url, len(passages), tmp_path)  # A's write-behind to Redis lands before B asks
        first, second = _last_load(tmp_path, ports[0]), _last_load(tmp_path, ports[1])
        assert first["chunks"] == second["chunks"] == len(passages)
        assert first["store_misses"] == len(passages)  # replica A computed the chunks and stored them in Redis ...
        assert second["store_hits"] == len(passages) and second["store_misses"] == 0  # ... B reused them all
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
        from langchain_cacheblend import ChatCacheBlend  # the framework adapter on the same URL

        reply = ChatCacheBlend(base_url=urls[1], max_tokens=4, learn_passages=False).invoke(
            ex.question, documents=passages)
        assert reply.content and reply.response_metadata["cacheblend"]["chunks"] == len(passages)
    finally:
        for proc, sig in zip(procs, (signal.SIGINT, signal.SIGTERM), strict=True):  # Ctrl-C, and a service stop
            if proc.poll() is None:
                proc.send_signal(sig)
        codes = [proc.wait(timeout=120) for proc in procs]
    assert codes == [0, 0]
    for base_url, port in zip(urls, ports, strict=True):
        assert not _healthy(base_url)
        assert _servers_on(port) == []


def test_serve_names_what_is_missing(tmp_path):
    env = {**os.environ, "CACHEBLEND_VLLM_PYTHON": ""}
    out = subprocess.run([sys.executable, "-m", "cacheblend.cli", "serve", "--store", f"disk:{tmp_path}"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "no vLLM interpreter" in out.stderr
    out = subprocess.run([sys.executable, "-m", "cacheblend.cli", "serve", "--store", "tape:/x",
                          "--vllm-python", sys.executable], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "tape" in out.stderr


_STAND_IN = """#!/bin/sh
# Stands in for vLLM's interpreter in the process-handling tests: whatever it is asked to
# run, it answers /health on the --port it is given and, like vLLM, keeps a child process
# (its engine core) in the same process group.
port=$(echo "$@" | sed -n 's/.*--port \\([0-9]*\\).*/\\1/p')
echo "$@" > "$(dirname "$0")/args-$port"
env > "$(dirname "$0")/env-$port"
sleep "9$port" &
exec "{python}" -c "
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()
" "$port"
"""


def _serve_stand_in(tmp_path: Path, store: str, **popen) -> tuple[subprocess.Popen, int, str]:
    """``cacheblend serve`` on the stand-in; the process, its port and the URL line it printed."""
    stand_in = tmp_path / "python"
    stand_in.write_text(_STAND_IN.format(python=sys.executable))
    stand_in.chmod(0o755)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cacheblend.cli", "serve", "--store", store,
                             "--port", str(port), "--vllm-python", str(stand_in), "--start-timeout", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("cacheblend serve: http"):
        proc.kill()
        pytest.fail(f"no URL line: {line!r} {proc.stderr.read() if proc.stderr else ''}")
    return proc, port, line


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_hang_up_or_a_stop_takes_the_servers_whole_process_group_down(tmp_path, sig):
    """``cacheblend serve`` had no SIGHUP handler: a closed terminal killed it without its
    cleanup, and vLLM, in a session of its own, kept running with the port and the memory."""
    proc, port, _ = _serve_stand_in(tmp_path, f"disk:{tmp_path / 'kv'}")
    try:
        group = [p for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-2:] == ["sleep", f"9{port}"]]
        assert group  # the stand-in's "engine core"
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not _healthy(f"http://127.0.0.1:{port}/v1")
    gone, alive = psutil.wait_procs([p for p in group if p.is_running()], timeout=10)
    assert not alive


def test_under_nohup_a_hang_up_leaves_the_server_running(tmp_path):
    """``nohup cacheblend serve ... &``: the hang-up its user asked to ignore stopped vLLM
    when the SSH session closed."""
    proc, port, _ = _serve_stand_in(tmp_path, f"disk:{tmp_path / 'kv'}",
                                    preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    try:
        proc.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert proc.poll() is None and _healthy(f"http://127.0.0.1:{port}/v1")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_stores_secrets_are_in_neither_the_output_nor_vllms_command_line(tmp_path):
    """A Redis password and a signing key were printed in the URL line, and put in vLLM's
    command line (``ps`` shows it to every local user); vLLM now gets them in its environment."""
    store = "memory,redis://:hunter2@127.0.0.1:1/0,key=s3cret"  # port 1: the tier is unreachable, so degraded
    proc, port, line = _serve_stand_in(tmp_path, store)
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    said = line + out + err + (tmp_path / f"args-{port}").read_text()
    assert "hunter2" not in said and "s3cret" not in said and "***" in line
    assert f"CACHEBLEND_CONNECTOR_STORE={store}" in (tmp_path / f"env-{port}").read_text()


def test_a_port_in_use_is_one_line_not_a_started_server(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        out = subprocess.run([sys.executable, "-m", "cacheblend.cli", "serve", "--store", f"disk:{tmp_path}",
                              "--port", str(busy.getsockname()[1]), "--vllm-python", sys.executable],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "in use" in out.stderr and "http" not in out.stdout
