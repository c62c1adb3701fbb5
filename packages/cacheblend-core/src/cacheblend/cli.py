"""Command line: ``cacheblend ingest FILES...`` and ``cacheblend ask QUESTION --chunks FILES...``.

Chunk caches persist in the store (default: memory plus a disk tier under the cache
dir), so ``ask`` after ``ingest`` in another process reuses them.  argparse rather than
typer because ``--chunks a.txt b.txt`` (an option taking several values) is the natural
spelling here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ._version import __version__
from .config import KV_DTYPES, METHODS, RATIO_MODES, RequestOptions

if TYPE_CHECKING:
    from .engine import Engine

DEFAULTS = RequestOptions()


def _quiet() -> None:
    """No model-loading bars or warnings from transformers on a command line."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _engine(args: argparse.Namespace) -> Engine:
    _quiet()
    from .engine import Engine

    return Engine.load(args.model, store=args.store, kv_dtype=args.kv_dtype, dtype=args.dtype)


def _read_chunks(files: list[Path], split: str | None) -> list[str]:
    texts = []
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"no such file: {f}")
        parts = f.read_text(encoding="utf-8")
        texts += [p.strip() for p in (parts.split(split) if split else [parts]) if p.strip()]
    if not texts:
        raise ValueError("the chunk files hold no text")
    return texts


def _split(value: str | None) -> str | None:
    """``--split`` with backslash escapes (``'\\n\\n'``) turned into the characters they name.

    ``unicode_escape`` reads bytes as Latin-1, so every character it cannot encode goes in
    as its own ``\\uXXXX`` escape: an em dash or ``§`` comes back as itself, not as mojibake."""
    if not value:
        return None
    try:
        return value.encode("latin-1", "backslashreplace").decode("unicode_escape")
    except UnicodeDecodeError as e:
        raise ValueError(f"--split {value!r} has a bad backslash escape: {e.reason}") from None


def cmd_ingest(args) -> int:
    from tqdm import tqdm

    texts = _read_chunks(args.files, _split(args.split))
    engine = _engine(args)
    for text in tqdm(texts, desc="ingest", unit="chunk", file=sys.stderr, disable=len(texts) < 4):
        ((handle, computed),) = engine.ingest_status([text])
        print(json.dumps({"key": handle.key, "tokens": handle.num_tokens, "stored": computed,
                          "text": text[:60]}), flush=True)
    return 0


def cmd_ask(args) -> int:
    texts = _read_chunks(args.chunks, _split(args.split)) if args.chunks else []
    engine = _engine(args)
    run = engine.start(args.question, texts, method=args.method, recompute_ratio=args.ratio,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature, system=args.system,
                       preamble=args.preamble, seed=args.seed, stop=tuple(args.stop), timeout=args.timeout,
                       max_risk=args.max_risk, max_exposure=args.max_exposure)
    for piece in run.pieces:
        print(piece, end="", flush=True)
    print()
    if args.stats and run.result is not None:
        print(json.dumps(run.result.stats.as_dict() | {"ttft_s": run.result.ttft_s}), file=sys.stderr)
    return 0


def cmd_store(args) -> int:
    """stats | verify | gc | clear over every tier of the store."""
    from tqdm import tqdm

    from .store import TieredStore, open_store

    store = open_store(_default_store(args.store), create=False)
    tiers = store.tiers if isinstance(store, TieredStore) else [store]
    if args.action == "clear" and not args.yes:  # one answer for every tier, before any is touched
        names = ", ".join(_where(tier) for tier in tiers)
        if not _confirm(f"delete every entry of {names}?"):
            print("cacheblend: nothing deleted (pass --yes to clear without asking)", file=sys.stderr)
            return 1
    out, failed = [], []
    for tier in tiers:
        failures = _failures(tier)
        name = tier.stats().get("tier", type(tier).__name__)
        if args.action == "stats":
            out.append(tier.stats())
        elif args.action == "verify":
            if hasattr(tier, "verify"):
                bar = lambda keys, n=name: tqdm(keys, desc=f"verify {n}", unit="entry", file=sys.stderr)  # noqa: E731
                out.append({"tier": name} | tier.verify(progress=bar))
        elif args.action == "gc":
            if hasattr(tier, "gc"):
                out.append({"tier": name} | tier.gc())
        elif args.action == "clear":
            tier.clear()
            out.append({"tier": name, "cleared": True})
        if _failures(tier) > failures:  # a tier that degrades on the request path must not look done here
            failed.append(f"the {name} tier could not be reached or refused ({getattr(tier, 'last_error', None)})")
            out.append({"tier": name, "error": failed[-1]})
    print(json.dumps(out, indent=2))
    for message in failed:
        print(f"cacheblend: error: {message}", file=sys.stderr)
    return 1 if failed else 0


def _failures(tier: object) -> int:
    """Commands a tier could not carry out: a Redis tier counts them (unreachable, refused)
    instead of raising, which is right for a request and wrong for a maintenance command."""
    return int(getattr(tier, "unreachable", 0)) + int(getattr(tier, "refused", 0))


def cmd_ui(args) -> int:
    """Serve the explorer until interrupted."""
    try:
        import gradio  # noqa: F401
    except ImportError as e:
        raise ImportError("cacheblend ui needs Gradio: pip install 'cacheblend[ui]'") from e
    from .ui import Explorer, launch

    backend: Any
    if args.base_url:
        from .remote import RemoteEngine

        backend, engine = RemoteEngine(args.base_url, args.model), None
    else:
        from .engine import Engine

        engine = Engine.load(args.model, store=args.store)
        backend = engine
    print(f"cacheblend ui: http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    launch(Explorer(backend, engine, args.data, args.bench_json), host=args.host, port=args.port)
    return 0


def _where(tier: object) -> str:
    """A tier as a person tells it apart: its kind and its folder or (redacted) URL."""
    stats = tier.stats()  # type: ignore[attr-defined]
    place = stats.get("path") or stats.get("url")
    return f"the {stats.get('tier', type(tier).__name__)} tier" + (f" {place}" if place else "")


def _confirm(question: str) -> bool:
    """Ask on the terminal; the question goes to stderr, so stdout stays the JSON report."""
    if not sys.stdin.isatty():
        return False
    print(f"cacheblend: {question} [y/N] ", end="", file=sys.stderr, flush=True)
    return input().strip().lower() in ("y", "yes")


def _default_store(spec: str | None) -> str:
    """The CLI's default store is the persistent part of the engine's default."""
    if spec:
        return spec
    from .models.loader import cache_home
    from .store import DEFAULT_DISK

    return f"disk:{cache_home() / 'kv'}:{DEFAULT_DISK}"


def _ratio(text: str) -> float | str:
    if text in RATIO_MODES:
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number within [0, 1], 'auto' or 'guard', got {text!r}") from None


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported in one line (the usage is one ``--help`` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="cacheblend", description="CacheBlend: fast RAG prefill with reused chunk KV.")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--model", default=None, help="HF model folder or .gguf (default: SmolLM2-135M-Instruct)")
        p.add_argument("--store", default=None, help="store spec, e.g. 'memory,disk:/path' (default: memory + disk)")
        p.add_argument("--split", default=None, help="split files into chunks at this string, e.g. '\\n\\n'")
        p.add_argument("--kv-dtype", default=None, choices=list(KV_DTYPES),
                       help="dtype chunk caches are stored in (default: the model's; bfloat16 halves the store)")
        p.add_argument("--dtype", default=None, choices=list(KV_DTYPES),
                       help="dtype the model computes in (default: float32; bfloat16 is about 3x faster on "
                            "CPUs with AMX, with answers of its own)")

    p = sub.add_parser("ingest", help="precompute and store chunk KV; one JSON line per chunk")
    p.add_argument("files", nargs="+", type=Path, help="text files; each is one chunk unless --split")
    common(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("ask", help="answer a question over chunks, streaming the answer")
    p.add_argument("question")
    p.add_argument("--chunks", nargs="+", type=Path, default=[], help="chunk files, in prompt order")
    p.add_argument("--method", default=DEFAULTS.method, choices=list(METHODS))
    p.add_argument("--ratio", type=_ratio, default=DEFAULTS.recompute_ratio,
                   help=f"recompute ratio for blend, 'auto' (the loading controller) or 'guard' (escalate risky "
                        f"prompts, see --max-risk) (default {DEFAULTS.recompute_ratio})")
    p.add_argument("--max-risk", type=float, default=DEFAULTS.max_risk, metavar="RISK",
                   help="risk limit of the quality guard (with --ratio guard, or alone): a riskier answer "
                        "is recomputed at larger ratios, up to full prefill")
    p.add_argument("--max-exposure", type=float, default=DEFAULTS.max_exposure, metavar="LIMIT",
                   help="the guard's limit on risk × exposure (how much the first token rests on stale "
                        "K/V); with --ratio guard the default is the guard's own")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--preamble", default="", help="text before the chunks in the user turn")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help="seed for sampling (with --temperature > 0)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end the answer here (repeatable)")
    p.add_argument("--timeout", type=float, default=DEFAULTS.timeout, help="seconds the answer may take")
    p.add_argument("--no-stats", dest="stats", action="store_false", help="do not print stats JSON on stderr")
    common(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("store", help="inspect and maintain the KV store")
    p.add_argument("action", choices=["stats", "verify", "gc", "clear"])
    p.add_argument("--store", default=None, help="store spec (default: the disk tier under the cache dir)")
    p.add_argument("--yes", action="store_true", help="clear without asking")
    p.set_defaults(func=cmd_store)

    p = sub.add_parser("ui", help="the explorer web app: answers, KV deviation, attention, speed (needs [ui])")
    p.add_argument("--model", default=None, help="HF model folder or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--store", default=None, help="store spec (default: memory + disk)")
    p.add_argument("--base-url", default=None, help="answer through a vLLM server with the connector instead")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--data", default=None, help="data folder: offers musique dev examples")
    p.add_argument("--bench-json", default=None, help="cacheblend bench --json output for the Speed tab")
    p.set_defaults(func=cmd_ui)

    from .bench.command import add_parser as add_bench  # light: heavy imports happen when it runs
    from .integrations.serve import add_parser as add_serve

    add_bench(sub)
    add_serve(sub)
    return ap


def app(argv: list[str] | None = None) -> int:
    """Run a command; bad input of any kind is one line on stderr and exit code 2
    (``--debug`` shows the traceback instead)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError, TimeoutError, ImportError) as e:  # CacheBlendError is a ValueError
        if args.debug:
            raise
        print(f"cacheblend: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cacheblend: interrupted", file=sys.stderr)
        return 130


def main() -> None:
    sys.exit(app())


if __name__ == "__main__":
    main()
