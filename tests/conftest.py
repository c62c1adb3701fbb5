"""Shared fixtures: the real default model, and tiny random models of each family."""

from __future__ import annotations

import contextlib
import os
import subprocess

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The paper's data beside the checkout (the Makefile sets CACHEBLEND_DATA to the same folder).
_DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "shared", "data")
if os.path.isdir(_DATA):
    os.environ.setdefault("CACHEBLEND_DATA", os.path.normpath(_DATA))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

from cacheblend import Engine  # noqa: E402
from cacheblend.models.loader import load_model, resolve_model_dir  # noqa: E402

PASSAGES = [
    "Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity. "
    "She was the first woman to win a Nobel Prize.",
    "The Danube is Europe's second-longest river. It flows through Vienna, Budapest and Belgrade "
    "before reaching the Black Sea.",
    "Mount Kilimanjaro is a dormant volcano in Tanzania. Its summit, Uhuru Peak, is 5,895 metres high.",
    "The violinist Ida Haendel was born in Chelm, Poland, and later lived in Miami, Florida.",
]
QUERY = "Where did Ida Haendel live later in life?"

TINY_CONFIGS = {
    "llama": dict(model_type="llama", rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                  "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 256}),
    "llama-linear": dict(model_type="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                         "factor": 2.0}),
    "llama-yarn": dict(model_type="llama", rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                       "factor": 4.0, "original_max_position_embeddings": 256}),
    "llama-dynamic": dict(model_type="llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                          "factor": 2.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", sliding_window=None),
    "mistral-window": dict(model_type="mistral", sliding_window=24),
    "qwen2": dict(model_type="qwen2"),
    "qwen2-window": dict(model_type="qwen2", use_sliding_window=True, sliding_window=24, max_window_layers=2),
    "qwen3": dict(model_type="qwen3"),
}


@pytest.fixture(scope="session")
def default_model_dir():
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def default_engine(default_model_dir):
    return Engine.load(default_model_dir, store="memory")


_REFERENCES: dict[str, object] = {}


def reference_model(engine):
    """transformers' own model for ``engine``'s folder, loaded apart and kept per folder: the
    engine's decoder takes the projection weights away from the copy it runs on
    (``models/onednn.py``), so the reference forward needs its own."""
    key = str(engine.model_dir)
    if key not in _REFERENCES:
        _REFERENCES[key] = load_model(engine.model_dir).model.eval()
    return _REFERENCES[key]


def make_tiny_model(folder, family: str, tokenizer_dir, dtype=torch.float32, tie: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    spec = dict(TINY_CONFIGS[family])
    model_type = spec.pop("model_type")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        initializer_range=0.2,
        tie_word_embeddings=tie,
        **spec,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    if hasattr(model.config, "attention_bias") and model_type == "qwen2":
        for layer in model.model.layers:  # qwen2 has q/k/v bias: make it non-zero
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", params=list(TINY_CONFIGS))
def tiny_engine(request, tmp_path_factory, default_model_dir):
    folder = make_tiny_model(tmp_path_factory.mktemp(request.param), request.param, default_model_dir)
    engine = Engine.load(folder, store="memory")
    engine.family = request.param
    return engine


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free loopback port, stopped after the session."""
    import shutil

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed (make test installs it: scripts/ensure-redis.sh)")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


class RedisServer:
    def __init__(self, binary, folder):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.binary, self.folder, self.proc = binary, folder, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self):
        import subprocess
        import time

        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", str(self.folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None


def kill_mid_write(writer: str, root, temp_glob: str) -> None:
    """Run ``writer`` (Python source writing to a store at argv[1] in a loop, printing
    "ready" first) in a child process and SIGKILL it once a temp file matching ``temp_glob``
    under ``root`` holds bytes, so it is mid-write (or after 60 s).  Killing it as soon as the
    file existed sometimes left only empty files, and nothing for a test to see reclaimed."""
    import signal
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-c", writer, str(root)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    def mid_write() -> bool:  # a temp file with bytes in it: one killed at its creation is empty
        for path in root.glob(temp_glob):
            try:
                if path.stat().st_size > 0:
                    return True
            except FileNotFoundError:  # renamed into place meanwhile
                continue
        return False

    deadline = time.time() + 60
    while not mid_write() and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def immutable(*paths):
    """Make paths read-only even for root (``chattr +i``), as a read-only mount would."""
    done = []
    try:
        for p in paths:
            if subprocess.run(["chattr", "+i", str(p)], capture_output=True).returncode != 0:
                pytest.skip("chattr +i is not available here (needs root on ext4/xfs)")
            done.append(p)
        yield
    finally:
        for p in done:
            subprocess.run(["chattr", "-i", str(p)], capture_output=True)


def give_up_on(make, after_s: float) -> None:
    """Consume ``iterate_in_thread(make)`` and cancel it after ``after_s`` seconds, as
    ``asyncio.wait_for`` around an ``astream`` does."""
    import asyncio

    from cacheblend.aio import iterate_in_thread

    async def consume():
        async for _ in iterate_in_thread(make):
            pass

    async def give_up():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(consume(), timeout=after_s)

    asyncio.run(give_up())
