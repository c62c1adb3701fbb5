"""A long system instruction kept exact in the prompt's prefix, against the same instruction
blended as a learned chunk (what chat prompts got before).

    .venv/bin/python benchmarks/system_instruction.py --skip 60 --limit 20 --rounds 3 \
        --data ../shared/data --out system-instruction.json

A chat application sends the same long system instruction with every request.  Learning
used to make it a chunk after the first call: precomputed behind the sink, then blended
(approximate) on every later answer.  ``Engine.start_chat`` now keeps the system message's
first unknown paragraph in the prompt's prefix, reused exactly from the prefix cache
(``chat.keep_instruction``).  This script asks 6-passage musique dev questions as such a
chat (the instruction as the system message, the passages and the question as the user
message, the passages ingested) in three ways in one process: full prefill; ``old``, the
instruction given as a known passage too (so it is a chunk, as a learned one was); and
``new``, today's plan.  A second pair of rows asks the question with the instruction and
no passages (a chat without retrieval).  It reports first-token agreement and KL against
full prefill (with the paired KL difference new − old and its 95 % bootstrap interval)
and TTFT: the best of ``--rounds`` per prompt, the variants interleaved, every cache
already stored (the first untimed calls of each variant store them).

``--paragraphs 3`` makes the instruction three paragraphs.  ``old`` then names the second
and third as passages, so only the first stays in the prefix (the plan of 2026-12-06);
``new`` keeps all three, as openings seen on earlier requests (``chat.HeadMemory``).

    .venv/bin/python benchmarks/system_instruction.py --paragraphs 3 --skip 87 --limit 13 \
        --rounds 2 --data ../shared/data --out system-instruction-3.json
"""

from __future__ import annotations

import json
import os
import statistics

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from ab_args import switch_arguments

from cacheblend import Engine
from cacheblend.bench.metrics import kl_first_token
from cacheblend.bench.stats import bootstrap, paired
from cacheblend.datasets import load_qa

INSTRUCTION = (
    "You are a research assistant for a public library. Answer the reader's question from the "
    "passages they give you, in one short sentence that names the person, place, date or number "
    "asked for. If the passages do not contain the answer, say that you do not know; never invent "
    "names, dates or numbers, and do not repeat the question."
)


MORE = (
    "Cite the passage you answer from by its title, and never quote more than one sentence of "
    "it. Keep names, dates and numbers exactly as the passage spells them, even where another "
    "spelling is more common, and give units as the passage gives them.",
    "Write for a reader who has not seen the passages: no pronoun without its noun, no "
    "abbreviation the passages do not spell out, no lists, and never more than two sentences. "
    "If two passages disagree, say so and name both.",
)


def _instruction(paragraphs: int) -> list[str]:
    return [INSTRUCTION, *MORE[: paragraphs - 1]]


def _chat(system: list[str], question: str, passages: list[str]) -> list[dict[str, str]]:
    context = "".join(p + "\n\n" for p in passages)
    return [{"role": "system", "content": "\n\n".join(system)},
            {"role": "user", "content": f"{context}Question: {question}"}]


def _variants(system: list[str], passages: list[str]) -> dict[str, dict]:
    """name -> start_chat options.  ``old`` names the instruction as a passage (one
    paragraph: a chunk, as learning made it before 2026-12-06), or its paragraphs after the
    first (several: chunks, as on 2026-12-06)."""
    named = system if len(system) == 1 else system[1:]
    return {"full": {"documents": passages, "method": "full"},
            "old": {"documents": [*named, *passages]},
            "new": {"documents": passages}}


def _ask(engine: Engine, messages: list[dict[str, str]], opts: dict, system: list[str]):
    """One answer; the instruction's paragraphs are known passages only during an ``old``
    call (their caches stay stored between calls), so that ``new`` calls plan them as the
    engine does today."""
    try:
        gen = engine.start_chat(messages, max_new_tokens=1, **opts)
        for _ in gen.pieces:
            pass
        return gen.result
    finally:
        for paragraph in system:
            engine.passages.discard(paragraph)


def _measure(engine: Engine, messages: list[dict[str, str]], variants: dict[str, dict], rounds: int,
             system: list[str]) -> dict:
    for _ in range(2):  # untimed: stores every cache (prefixes, the instruction as chunks)
        for opts in variants.values():
            _ask(engine, messages, opts, system)
    res = {name: _ask(engine, messages, opts, system) for name, opts in variants.items()}
    full = res["full"]
    row = {name: {"agree": float(r.token_ids[0] == full.token_ids[0]),
                  "kl": kl_first_token(full.first_token_logits, r.first_token_logits),
                  "exact": r.stats.exact, "exact_cached": r.stats.exact_cached_tokens, "ttft_s": r.ttft_s}
           for name, r in res.items()}
    for _ in range(rounds):  # interleaved; the best run of each
        for name, opts in variants.items():
            row[name]["ttft_s"] = min(row[name]["ttft_s"], _ask(engine, messages, opts, system).ttft_s)
    return row


def _summary(rows: list[dict]) -> dict:
    out = {}
    for name in ("old", "new"):
        col = [r[name] for r in rows]
        out[name] = {
            "agreement": bootstrap([c["agree"] for c in col]).as_dict(),
            "kl": bootstrap([c["kl"] for c in col]).as_dict(),
            "kl_vs_old": paired([c["kl"] for c in col], [r["old"]["kl"] for r in rows]).as_dict(),
            "exact": sum(c["exact"] for c in col),
            "ttft_s": statistics.median(c["ttft_s"] for c in col),
            "speed_up": statistics.median(r["full"]["ttft_s"] / r[name]["ttft_s"] for r in rows),
            "ttft_vs_old": statistics.median(r[name]["ttft_s"] / r["old"]["ttft_s"] for r in rows),
        }
    out["full_ttft_s"] = statistics.median(r["full"]["ttft_s"] for r in rows)
    return out


def main() -> None:
    args = switch_arguments(__doc__, skip=60, extra=lambda ap: ap.add_argument(
        "--paragraphs", type=int, default=1, choices=(1, 2, 3), help="paragraphs of the system instruction"))
    system = _instruction(args.paragraphs)
    torch.set_num_threads(2)
    engine = Engine.load(args.model, store="memory")
    examples = load_qa("musique", "dev", args.skip + args.limit, 6, args.data)[args.skip:]
    rag, chat = [], []
    for i, ex in enumerate(examples):
        engine.ingest(ex.passages)
        rag.append({"prompt": args.skip + i, **_measure(engine, _chat(system, ex.question, ex.passages),
                                                       _variants(system, ex.passages), args.rounds, system)})
        alone = [{"role": "system", "content": "\n\n".join(system)}, {"role": "user", "content": ex.question}]
        chat.append({"prompt": args.skip + i, **_measure(engine, alone, _variants(system, []), args.rounds, system)})
        print(json.dumps({"rag": rag[-1], "chat": chat[-1]}), flush=True)
    summary = {"rag": _summary(rag), "chat": _summary(chat)}
    for kind, s in summary.items():
        for name in ("old", "new"):
            v = s[name]
            print(f"{kind} {name}: agreement {v['agreement']['mean']:.3f}, KL {v['kl']['mean']:.4f} "
                  f"(paired vs old {v['kl_vs_old']['mean']:+.4f} [{v['kl_vs_old']['low']:+.4f}, "
                  f"{v['kl_vs_old']['high']:+.4f}]), exact {v['exact']}/{len(rag)}, TTFT {v['ttft_s']:.3f} s, "
                  f"{v['speed_up']:.2f}x over full ({s['full_ttft_s']:.3f} s), {v['ttft_vs_old']:.3f} of old")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "instruction": system, "rag": rag, "chat": chat,
                       "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
