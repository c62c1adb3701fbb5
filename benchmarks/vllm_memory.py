"""The vLLM worker's memory with and without the CacheBlend connector (issue 17, deliverable 1).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vllm_memory.py --data ../shared/data --out bench-out/memory

Starts ``vllm serve`` twice on the same model and settings, one at a time: plain, then
with the connector.  Each server answers ``--requests`` musique RAG prompts (6 passages
each; the connector's through :class:`cacheblend.remote.RemoteEngine`, so they are
ingested and then blended), then every process of the server is read with
``psutil.memory_full_info()``: RSS, USS (pages only this process holds), PSS, the
resident file-backed pages (psutil's ``shared``: mapped files such as the weights the core
engine maps from ``model.safetensors``, clean pages the kernel can drop and re-read) and
the rest, anonymous memory (heap, vLLM's own copy of the weights, its KV cache).  The
worker is the process that holds the model and the KV cache (the largest).  Measured
twice per server: idle after start-up, and after the requests.

The connector's store is ``disk:`` only: a ``memory`` tier holds chunk caches up to its
configured capacity by design, which is a cache the operator sizes, not overhead.
Target: the worker's RSS with the connector within 10 % of plain vLLM's.  Writes
``memory.json`` into ``--out``.  Loopback only.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
from load import ROOT, Client, Request, Sample, workload  # the load benchmark's requests and client

from cacheblend.bench.peers import vllm_python
from cacheblend.integrations.registry import register_passages
from cacheblend.integrations.vllm_server import VLLMServer, kv_transfer_config
from cacheblend.models.loader import resolve_model_dir

MiB = 2**20


def processes(server: VLLMServer) -> list[dict]:
    """Every process of the server (front end, engine core, worker), with its memory."""
    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            m = p.memory_full_info()
            out.append({"pid": p.pid, "name": p.name(), "rss_mib": m.rss / MiB, "uss_mib": m.uss / MiB,
                        "pss_mib": m.pss / MiB, "shared_mib": m.shared / MiB,
                        "anon_mib": (m.rss - m.shared) / MiB})
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def worker(procs: list[dict]) -> dict:
    """The process holding the model and the KV cache: the largest resident one."""
    return max(procs, key=lambda p: p["rss_mib"])


def measure(kind: str, model: str, pool: list[str], requests: list[Request], args: argparse.Namespace,
            work: Path, logs: Path) -> dict:
    connector = None
    if kind == "connector":
        connector = kv_transfer_config(f"disk:{work / 'kv'}", passages=str(work / "passages.jsonl"))
    server = VLLMServer(model, connector, python=str(vllm_python(args.vllm_python)),
                        args=("--no-enable-prefix-caching",), log_path=logs / f"vllm-{kind}.log")
    with server.start(timeout=600):
        time.sleep(args.settle)
        idle = processes(server)
        client = Client(server.base_url, remote=kind == "connector", tokens=args.tokens)
        if kind == "connector":
            client.ingest(pool)
        ttfts = []
        for req in requests[: args.requests]:
            sample = Sample(0.0)
            client.ask(req, sample, time.perf_counter())
            if sample.error:
                raise SystemExit(f"{kind}: request failed: {sample.error}")
            ttfts.append(sample.ttft_s)
        time.sleep(args.settle)
        loaded = processes(server)
    report = {"kind": kind, "idle": idle, "after_requests": loaded, "ttft_s": ttfts,
              "worker_idle": worker(idle), "worker_after": worker(loaded)}
    w = report["worker_after"]
    print(f"{kind}: worker {w['name']} RSS {w['rss_mib']:.0f} MiB, USS {w['uss_mib']:.0f}, "
          f"file-backed {w['shared_mib']:.0f}, anonymous {w['anon_mib']:.0f} "
          f"(idle RSS {report['worker_idle']['rss_mib']:.0f})", flush=True)
    return report


def compare(plain: dict, conn: dict) -> dict:
    """Connector minus plain, per figure, idle and after the requests; the target check."""
    out: dict = {}
    for when in ("worker_idle", "worker_after"):
        a, b = plain[when], conn[when]
        out[when] = {k: {"plain": a[k], "connector": b[k], "delta": b[k] - a[k], "ratio": b[k] / a[k]}
                     for k in ("rss_mib", "uss_mib", "pss_mib", "shared_mib", "anon_mib")}
    ratio = max(out[w]["rss_mib"]["ratio"] for w in out)
    anon = max(out[w]["anon_mib"]["ratio"] for w in out)
    out["target"] = {"rss_ratio_max": ratio, "within_10_percent": ratio <= 1.10, "anon_ratio_max": anon}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="the data directory (default: $CACHEBLEND_DATA)")
    ap.add_argument("--model", default=None, help="HF folder or known name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--requests", type=int, default=4, help="requests answered before the second reading")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per answer")
    ap.add_argument("--pool", type=int, default=2, help="musique examples whose passages form the pool")
    ap.add_argument("--passages", type=int, default=6, help="passages per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds to wait before each reading")
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--out", type=Path, default=Path("bench-out/memory"))
    args = ap.parse_args(argv)
    model = str(resolve_model_dir(args.model))
    pool, requests = workload(args)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="cacheblend-memory-") as tmp:  # the chunk store: removed after
        work = Path(tmp)
        register_passages(work / "passages.jsonl", pool)
        runs = {kind: measure(kind, model, pool, requests, args, work, args.out)
                for kind in ("plain", "connector")}
    report = {"command": "benchmarks/vllm_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "model": model, "runs": runs, "compare": compare(runs["plain"], runs["connector"])}
    (args.out / "memory.json").write_text(json.dumps(report, indent=1))
    for when in ("worker_idle", "worker_after"):
        print(f"\n{when}: " + "; ".join(f"{k} {v['plain']:.0f} -> {v['connector']:.0f} MiB "
                                        f"({v['delta']:+.0f}, {v['ratio'] - 1:+.1%})"
                                        for k, v in report["compare"][when].items()))
    print(json.dumps(report["compare"]["target"]))
    print(f"written: {args.out / 'memory.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
