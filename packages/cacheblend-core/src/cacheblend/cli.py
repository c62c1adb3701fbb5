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
from typing import TYPE_CHECKING

from .config import METHODS, RequestOptions

if TYPE_CHECKING:
    from .engine import Engine

DEFAULTS = RequestOptions()


def _engine(args: argparse.Namespace) -> Engine:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from .engine import Engine

    return Engine.load(args.model, store=args.store)


def _read_chunks(files: list[Path], split: str | None) -> list[str]:
    texts = []
    for f in files:
        if not f.is_file():
            raise SystemExit(f"cacheblend: no such file: {f}")
        parts = f.read_text(encoding="utf-8")
        texts += [p.strip() for p in (parts.split(split) if split else [parts]) if p.strip()]
    if not texts:
        raise SystemExit("cacheblend: the chunk files hold no text")
    return texts


def _split(value: str | None) -> str | None:
    return value.encode().decode("unicode_escape") if value else None


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
    from .errors import CacheBlendError

    texts = _read_chunks(args.chunks, _split(args.split)) if args.chunks else []
    engine = _engine(args)
    try:
        run = engine.start(args.question, texts, method=args.method, recompute_ratio=args.ratio,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           system=args.system)
    except CacheBlendError as e:
        print(f"cacheblend: error: {e}", file=sys.stderr)
        return 2
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

    store = open_store(_default_store(args.store))
    tiers = store.tiers if isinstance(store, TieredStore) else [store]
    out = []
    for tier in tiers:
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
    print(json.dumps(out, indent=2))
    return 0


def _default_store(spec: str | None) -> str:
    """The CLI's default store is the persistent part of the engine's default."""
    if spec:
        return spec
    from .models.loader import cache_home
    from .store import DEFAULT_DISK

    return f"disk:{cache_home() / 'kv'}:{DEFAULT_DISK}"


def _ratio(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number within [0, 1] or 'auto', got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="cacheblend", description="CacheBlend: fast RAG prefill with reused chunk KV.")
    sub = ap.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--model", default=None, help="HF model folder or .gguf (default: SmolLM2-135M-Instruct)")
        p.add_argument("--store", default=None, help="store spec, e.g. 'memory,disk:/path' (default: memory + disk)")
        p.add_argument("--split", default=None, help="split files into chunks at this string, e.g. '\\n\\n'")

    p = sub.add_parser("ingest", help="precompute and store chunk KV; one JSON line per chunk")
    p.add_argument("files", nargs="+", type=Path, help="text files; each is one chunk unless --split")
    common(p)
    p.set_defaults(func=cmd_ingest)

    p = sub.add_parser("ask", help="answer a question over chunks, streaming the answer")
    p.add_argument("question")
    p.add_argument("--chunks", nargs="+", type=Path, default=[], help="chunk files, in prompt order")
    p.add_argument("--method", default=DEFAULTS.method, choices=list(METHODS))
    p.add_argument("--ratio", type=_ratio, default=DEFAULTS.recompute_ratio,
                   help=f"recompute ratio for blend, or 'auto' (default {DEFAULTS.recompute_ratio})")
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS.max_new_tokens)
    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--no-stats", dest="stats", action="store_false", help="do not print stats JSON on stderr")
    common(p)
    p.set_defaults(func=cmd_ask)

    p = sub.add_parser("store", help="inspect and maintain the KV store")
    p.add_argument("action", choices=["stats", "verify", "gc", "clear"])
    p.add_argument("--store", default=None, help="store spec (default: the disk tier under the cache dir)")
    p.set_defaults(func=cmd_store)

    from .bench.command import add_parser as add_bench  # light: heavy imports happen when it runs

    add_bench(sub)
    return ap


def app(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


def main() -> None:
    sys.exit(app())


if __name__ == "__main__":
    main()
