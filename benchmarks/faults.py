"""Fault-injection run: clients share one disk + Redis store while a chaos loop attacks it.

    python benchmarks/faults.py --clients 3 --minutes 5 --out faults.json

N client processes loop over mixed ingest / generate / release on a shared store
(``disk:DIR:CAP,redis://...``, no memory tier, so every request reads the shared tiers),
and check every answer against the answer the same engine gives with a private
memory store (greedy decoding is deterministic, so any difference is a wrong answer).
Meanwhile the chaos loop, every few seconds, does one of:

- ``kill``: ``kill -9`` a client (often mid-write) and start a new one;
- ``redis``: kill redis-server and start it again on the same port (its data is gone);
- ``damage``: flip bytes in disk entries and overwrite Redis layer values;
- ``index``: overwrite pages of the disk index;
- ``fill``: fill the disk (a tmpfs mounted for the run; needs root) for a few seconds.

It reports requests served, wrong answers, failed requests, client crashes (exits that
were not our kills), and recovery times (from the end of a fault to the first request
that uses the attacked part again).  Needs ``redis-server`` on PATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FAULTS = ("kill", "redis", "damage", "index", "fill")
QUESTIONS = ["Who founded the company?", "Where is the river?", "What year was it built?",
             "Which team won the final?", "What is the password?", "Who wrote the letter?"]


def passages(n: int) -> list[str]:
    """Distinct, deterministic passages (no data set needed)."""
    rng = random.Random(7)
    words = ("river harbour council archive engine founder bridge mountain treaty ledger season "
             "captain orchard library signal canal market ferry tower garden").split()
    return [f"Passage {i}. " + " ".join(rng.choice(words) for _ in range(60)) + "." for i in range(n)]


def prompts(n_passages: int, n_prompts: int) -> list[tuple[str, list[str]]]:
    texts, rng = passages(n_passages), random.Random(11)
    return [(QUESTIONS[i % len(QUESTIONS)], rng.sample(texts, 3)) for i in range(n_prompts)]


# -- one client ----------------------------------------------------------------------------
def client(args: argparse.Namespace) -> None:
    """Loop until killed or the deadline; one JSON line per request on stdout."""
    import torch

    from cacheblend import Engine
    from cacheblend.store import tier_total

    torch.set_num_threads(args.threads)  # several clients on few cores: no oversubscription
    gen = dict(max_new_tokens=args.tokens, recompute_ratio=args.ratio)
    pool = prompts(args.passages, args.prompts)
    index = {text: n for n, text in enumerate(passages(args.passages))}
    reference = Engine.load(args.model, store="memory")
    expected = [reference.generate(q, chunks, **gen).token_ids for q, chunks in pool]
    engine = Engine.load(args.model, store=args.store)
    rng = random.Random(os.getpid())
    print(json.dumps({"op": "ready", "t": time.time(), "left_s": args.deadline - time.time()}), flush=True)
    disk, redis_tier = engine.store.tiers
    while time.time() < args.deadline:
        op = rng.choices(["generate", "ingest", "release"], weights=[8, 1, 1])[0]
        i = rng.randrange(len(pool))
        write_errors = disk.write_errors
        hits0 = list(engine.store.stats_counts.hits)
        rec: dict = {"op": op, "t": time.time()}
        try:
            rec["passages"] = [index[t] for t in pool[i][1]]
            if op == "generate":
                rec["wrong"] = engine.generate(pool[i][0], pool[i][1], **gen).token_ids != expected[i]
            elif op == "ingest":
                engine.ingest(pool[i][1])
            else:
                gone = rng.choice(pool[i][1])
                rec["passages"] = [index[gone]]
                engine.release(engine.handle(gone))
            rec["ok"] = True
        except Exception as e:  # a failed request: what this run exists to count
            rec |= {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
        rec["hits"] = [a - b for a, b in zip(engine.store.stats_counts.hits, hits0, strict=True)]
        rec["disk_write_errors"] = disk.write_errors - write_errors
        rec["rejected"] = tier_total(engine.store, "corrupt")
        rec["index_rebuilds"] = disk.index.rebuilds
        rec["redis_up"] = redis_tier.available
        rec["s"] = round(time.time() - rec["t"], 3)
        print(json.dumps(rec), flush=True)


# -- the run -------------------------------------------------------------------------------
class Redis:
    def __init__(self, folder: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.folder, self.proc = folder, None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--dir", str(self.folder)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            time.sleep(0.025)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


class Run:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work, self.rng = args, work, random.Random(args.seed)
        self.redis = Redis(work)
        self.disk = work / "disk"
        self.mounted = args.fill and _mount_tmpfs(self.disk, args.disk_mb)
        self.store = f"disk:{self.disk / 'kv'}:{args.capacity_mb}MB,{self.redis.url}"
        self.clients: list[tuple[subprocess.Popen, Path]] = []
        self.events: list[dict] = []
        self.kills: set[int] = set()

    def spawn(self) -> None:
        log = self.work / f"client-{len(self.clients)}.jsonl"
        cmd = [sys.executable, __file__, "--client", "--store", self.store, "--deadline", str(self.deadline),
               *_forward(self.args)]
        env = os.environ | {"OMP_NUM_THREADS": str(self.args.threads)}
        err = open(log.with_suffix(".err"), "w")  # noqa: SIM115
        self.clients.append((subprocess.Popen(cmd, stdout=open(log, "w"), stderr=err, env=env), log))  # noqa: SIM115

    def chaos(self, kind: str) -> dict:
        event: dict = {"kind": kind, "t": time.time()}
        if kind == "kill":
            alive = [p for p, _ in self.clients if p.poll() is None]
            if alive:
                victim = self.rng.choice(alive)
                self.kills.add(victim.pid)
                victim.send_signal(signal.SIGKILL)
                self.spawn()
        elif kind == "redis":
            self.redis.kill()
            time.sleep(1.0)
            self.redis.start()
        elif kind == "damage":
            event["damaged"] = _damage_entries(self.disk / "kv", self.redis.url, self.rng)
        elif kind == "index":
            _damage_index(self.disk / "kv" / "index.sqlite3")
        elif kind == "fill" and self.mounted:
            filler = self.disk / "filler"
            with open(filler, "wb") as f, contextlib.suppress(OSError):  # until the disk is full
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            time.sleep(self.args.interval / 2)
            filler.unlink()
        event["end"] = time.time()
        return event

    def go(self) -> dict:
        self.redis.start()
        self.deadline = time.time() + 60 * self.args.minutes + 120  # clients stop by themselves
        for _ in range(self.args.clients):
            self.spawn()
        _wait_ready(self.clients)
        stop = time.time() + 60 * self.args.minutes
        kinds = ["kill", "redis", "damage", "index"] + (["fill"] if self.mounted else [])
        while time.time() < stop:
            time.sleep(self.rng.uniform(0.5, 1.5) * self.args.interval)
            self.events.append(self.chaos(kinds[len(self.events) % len(kinds)]))
        for p, _ in self.clients:
            p.send_signal(signal.SIGTERM if p.poll() is None else 0)
        for p, _ in self.clients:
            p.wait()
        report = self.report()
        report["after"] = self.after(report.pop("kept"))
        self.redis.kill()
        return report

    def after(self, kept: list[int]) -> dict:
        """The store once the clients are gone: entries lost (a passage whose last use
        was not a release, stored in neither tier), then what ``verify`` drops (entries
        damaged by the chaos loop that no request read afterwards)."""
        from cacheblend import Engine

        engine = Engine.load(self.args.model, store=self.store)
        disk, red = engine.store.tiers
        texts = passages(self.args.passages)
        held = set(disk.keys()) | set(red.keys())
        lost = [n for n in kept if engine.handle(texts[n]).key not in held]
        verified = {t.stats()["tier"]: t.verify() for t in (disk, red)}
        return {"passages_kept": len(kept), "entries_lost": len(lost), "verify": verified,
                "disk_entries": len(disk), "redis_entries": len(red.keys()),
                "index_rebuilds_at_open": disk.index.rebuilds}

    def report(self) -> dict:
        recs = [json.loads(line) for _, log in self.clients for line in log.read_text().splitlines()
                if line.startswith("{")]
        reqs = [r for r in recs if r["op"] != "ready"]
        crashes = [p.returncode for p, _ in self.clients
                   if p.pid not in self.kills and p.returncode not in (0, -signal.SIGTERM)]
        errors = [r["error"] for r in reqs if not r["ok"]]
        last: dict[int, str] = {}
        for r in sorted((r for r in reqs if r["ok"]), key=lambda r: r["t"]):
            for n in r.get("passages", []):
                last[n] = r["op"]
        by_client = [[json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
                     for _, log in self.clients]
        return {
            "clients": self.args.clients, "minutes": self.args.minutes, "store": self.store.split(",")[0] + ",redis",
            "requests": len(reqs), "served": sum(r["ok"] for r in reqs),
            "generate": sum(r["op"] == "generate" and r["ok"] for r in reqs),
            "wrong_answers": sum(bool(r.get("wrong")) for r in reqs),
            "failed_requests": len(errors),
            "errors": sorted(set(errors))[:10], "client_crashes": len(crashes),
            "wrong": [r for r in reqs if r.get("wrong")][:5],  # the records, to read next to the fault events
            "events": self.events if any(r.get("wrong") for r in reqs) or errors else [],
            "faults": {k: sum(e["kind"] == k for e in self.events) for k in FAULTS},
            "disk_full_tested": bool(self.mounted),
            "recovery_s": _recovery(self.events, reqs),
            "median_request_s": round(statistics.median(r["s"] for r in reqs), 3) if reqs else None,
            "entries_rejected": sum(max((r.get("rejected", 0) for r in c), default=0) for c in by_client),
            "index_rebuilds": sum(max((r.get("index_rebuilds", 0) for r in c), default=0) for c in by_client),
            "kept": sorted(n for n, op in last.items() if op != "release"),
        }


def _recovery(events: list[dict], reqs: list[dict]) -> dict:
    """Median seconds from a fault's end to the first request that uses the attacked part:
    one that finds the Redis tier reachable again (it rests 5 s after a failure), an ingest
    without a disk write error after the disk was full, a disk hit after index damage, any
    served request after a kill or damage to entries."""
    uses = {"redis": lambda r: r["ok"] and r.get("redis_up"),
            "fill": lambda r: r["ok"] and r["disk_write_errors"] == 0 and r["op"] == "ingest",
            "kill": lambda r: r["ok"], "index": lambda r: r["ok"] and r["hits"][0] > 0,
            "damage": lambda r: r["ok"] and r["op"] == "generate"}
    out: dict = {}
    for kind, used in uses.items():
        waits = []
        for e in (e for e in events if e["kind"] == kind):
            first = min((r["t"] + r["s"] for r in reqs if r["t"] >= e["end"] and used(r)), default=None)
            if first is not None:
                waits.append(first - e["end"])
        out[kind] = {"median": round(statistics.median(waits), 2), "max": round(max(waits), 2)} if waits else None
    return out


def _damage_entries(root: Path, url: str, rng: random.Random) -> int:
    import redis

    n = 0
    files = sorted(root.glob("??/*.safetensors"))
    for f in rng.sample(files, min(3, len(files))):
        try:
            with open(f, "r+b") as fh:
                fh.seek(f.stat().st_size // 2)
                fh.write(os.urandom(64))
            n += 1
        except OSError:
            pass
    try:
        client = redis.Redis.from_url(url, socket_timeout=1)
        names = [k for k in client.scan_iter(match="cacheblend:*:0", count=1000)][:50]
        for name in rng.sample(names, min(3, len(names))):
            client.setrange(name, 10, os.urandom(16))
            n += 1
    except Exception:
        pass
    return n


def _damage_index(index: Path) -> None:
    """Overwrite part of every page (past the file header, so SQLite finds the damage
    when it reads a page, as after a torn write)."""
    try:
        with open(index, "r+b") as f:
            for page in range(index.stat().st_size // 4096):
                f.seek(page * 4096 + 100)
                f.write(os.urandom(256))
    except OSError:
        pass


def _mount_tmpfs(path: Path, size_mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}M", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _stderr_files(clients: list[tuple[subprocess.Popen, Path]]) -> str:
    return ", ".join(str(log.with_suffix(".err")) for _, log in clients)


def _wait_ready(clients: list[tuple[subprocess.Popen, Path]], timeout: float = 600) -> None:
    """Until every client has printed "ready"; a client that exits first fails the run."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(log.exists() and '"ready"' in log.read_text() for _, log in clients):
            return
        dead = [p for p, _ in clients if p.poll() is not None]
        if dead:
            raise RuntimeError(f"{len(dead)} client(s) exited before they were ready; see {_stderr_files(clients)}")
        time.sleep(0.5)
    raise TimeoutError("clients did not start")


def _forward(args: argparse.Namespace) -> list[str]:
    out = ["--threads", str(args.threads), "--passages", str(args.passages), "--prompts", str(args.prompts),
           "--tokens", str(args.tokens),
           "--ratio", str(args.ratio)]
    return out + (["--model", str(args.model)] if args.model else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--interval", type=float, default=6.0, help="mean seconds between faults")
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per client")
    ap.add_argument("--passages", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=8, help="greedy tokens per answer")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--capacity-mb", type=int, default=40, help="disk tier capacity (evictions send reads to Redis)")
    ap.add_argument("--disk-mb", type=int, default=64, help="size of the tmpfs the disk tier lives on")
    ap.add_argument("--no-fill", dest="fill", action="store_false", help="do not mount a tmpfs to fill")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.client:
        client(args)
        return 0
    work = Path(tempfile.mkdtemp(prefix="cacheblend-faults-"))
    run = Run(args, work)
    try:
        report = run.go()
    finally:
        if run.mounted:
            subprocess.run(["umount", "-l", str(run.disk)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)  # the run's stores and logs: it used to stay in the temp folder
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if report["wrong_answers"] == 0 and report["client_crashes"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
