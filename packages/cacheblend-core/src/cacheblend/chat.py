"""From chat messages to a CacheBlend prompt: which text is a chunk, and its token ids.

Shared by the in-process :class:`~cacheblend.engine.Engine` and the
:class:`~cacheblend.remote.RemoteEngine` (a client of a vLLM server with the CacheBlend
connector), so that both lay a chat out the same way and a chunk gets the same ids, hence
the same cache, whichever of them sends it."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import CacheBlendError
from .passages import PassageIndex, Piece, cut, has_rule
from .prompt import PromptBuilder, PromptIds

ROLES = ("system", "user", "assistant")


@dataclass
class ChatPlan:
    """The prompt, and the passages of it that were learned (not known before)."""

    prompt: PromptIds
    learned: list[str]


MAX_OPENING_PARAGRAPHS = 16  # of a system message, kept in the prefix or remembered
MIN_RECURRING_LEAD_CHARS = 100  # a shorter lead ("Context: ") costs less computed than a prefix entry


class HeadMemory:
    """The openings of the system messages seen lately (hashes of their text up to the end
    of each of their first :data:`MAX_OPENING_PARAGRAPHS` paragraphs), bounded: a paragraph that an earlier request's
    system message also opened with, after the same text, is part of the application's
    fixed instruction (:func:`keep_instruction`); and the prompts' texts before their first
    chunk (:func:`recurring_opening`).  One per engine; the adapters plan
    requests on worker threads, so it holds a lock."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(opening: str) -> bytes:
        return hashlib.blake2b(opening.encode(), digest_size=16).digest()

    def seen(self, opening: str) -> bool:
        with self._lock:
            return self._key(opening) in self._seen

    def remember(self, openings: Iterable[str]) -> None:
        with self._lock:
            for opening in openings:
                key = self._key(opening)
                self._seen[key] = None
                self._seen.move_to_end(key)
            while len(self._seen) > self.capacity:
                self._seen.popitem(last=False)


def check_messages(messages) -> list[dict[str, str]]:
    if isinstance(messages, (str, dict)) or not messages:
        raise CacheBlendError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise CacheBlendError(f"message {i} must be a dict with role in {ROLES} and string content, got {m!r:.80}")
        out.append({"role": m["role"], "content": m["content"]})
    if not any(m["content"].strip() for m in out):
        raise CacheBlendError("every message is empty")
    return out


def check_documents(documents) -> list[str]:
    if isinstance(documents, str):
        documents = [documents]
    docs = []
    for d in documents:
        if not isinstance(d, str) or not d.strip():
            raise CacheBlendError(f"a document must be a non-empty string, got {d!r:.80}")
        docs.append(d)
    return docs


def plan_chat(
    prompts: PromptBuilder,
    passages: PassageIndex,
    messages: Sequence[dict[str, str]],
    documents: Sequence[str] = (),
    *,
    learn: bool = True,
    learn_min_chars: int = 200,
    heads: HeadMemory | None = None,
) -> ChatPlan:
    """Known passages (in ``passages``, or given as ``documents``) are found in the message
    contents by their text; with ``learn``, long paragraphs of system and user contents
    become chunks too, except the last paragraph of the last user message (the question)
    and the system message's opening (:func:`keep_instruction`, with ``heads``, the
    openings seen before).  ``documents`` not
    already in the messages go in front of the last user message.  Adds the documents and
    learned paragraphs to ``passages``."""
    msgs = check_messages(messages)
    docs = check_documents(documents)
    for d in docs:
        passages.add(d)
    # stripped, as the index finds them: a document given with a trailing space or newline
    # that the message already holds was pasted in a second time
    missing = [d for d in docs if not any(d.strip() in m["content"] for m in msgs)]
    if missing:
        users = [i for i, m in enumerate(msgs) if m["role"] == "user"]
        if not users:
            raise CacheBlendError("documents need a user message to go in front of")
        last = users[-1]
        msgs[last] = {"role": "user", "content": "".join(d + "\n\n" for d in missing) + msgs[last]["content"]}
    pieces: list[Piece] = []
    head = 0  # pieces[:head] hold the system instruction kept in the prompt's prefix
    lead = None  # pieces[lead:] start with the first user message's content
    # the question is the last paragraph of the last user message, also when an assistant
    # turn follows it (a prefilled answer): it used to be learned as a chunk there
    question = {len(msgs) - 1, max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)}
    for text, i in prompts.chat_parts(msgs):
        if i is None:
            pieces.append(Piece(text))
            continue
        if lead is None and msgs[i]["role"] == "user":
            lead = len(pieces)
        learnable = learn and msgs[i]["role"] in ("system", "user")
        cut_pieces = cut(text, passages, learn_min_chars if learnable else None, keep_tail=i in question)
        if i == 0 and msgs[0]["role"] == "system":
            ingested = {p.passage.strip() for p in cut_pieces
                        if p.passage is not None and not p.learned and not passages.learned(p.passage)}
            kept = keep_instruction(cut_pieces, heads, ingested)
            head = len(pieces) + kept + 1 if kept is not None else 0
        pieces += cut_pieces
    prompt = layout(prompts, pieces, head, recurring_opening(pieces, lead, heads))
    learned = [p.passage for p in pieces if p.learned and p.passage]
    for passage in learned:
        passages.add(passage, learned=True)
    return ChatPlan(prompt, learned)


def recurring_opening(pieces: list[Piece], lead: int | None, heads: HeadMemory | None) -> int | None:
    """``lead`` (where the first user message starts, :func:`layout`), or None when the
    text before the first chunk, the user message's part included, opened an earlier
    request the same way (remembered in ``heads``): a template's fixed text above the
    context is then prefix, read exactly from the prefix cache from the third request on,
    while a conversation's earlier turns, new on every turn, stay the computed lead.  A
    lead under :data:`MIN_RECURRING_LEAD_CHARS` (a template's label) is always computed."""
    first = next((j for j, p in enumerate(pieces) if p.passage is not None), None)
    if lead is None or heads is None or first is None or first <= lead:
        return lead
    if sum(len(p.text) for p in pieces[lead:first]) < MIN_RECURRING_LEAD_CHARS:
        return lead
    opening = "lead\0" + "".join(p.text for p in pieces[:first])  # its own namespace among the openings
    seen = heads.seen(opening)
    heads.remember([opening])
    return None if seen else lead


def keep_instruction(pieces: list[Piece], heads: HeadMemory | None = None,
                     ingested: set[str] | frozenset[str] = frozenset()) -> int | None:
    """Keep the system message's opening out of the chunks: its first learned paragraph,
    when no known passage and no rule line (``-----``) comes before it, and each paragraph
    after it that an earlier system message in ``heads`` also opened with.  Returns the
    index of the last piece made plain text, or None; remembers this message's openings.

    The first paragraph is, in almost every chat, the application's fixed instruction.
    Learned, it was blended from the second call on: precomputed behind the sink rather
    than behind the system turn's opening, approximate on every answer (on dev, the answer
    changed).  Left in the prompt's prefix it is reused exactly from the prefix cache, as
    fast.  An instruction of several paragraphs had only its first kept: the others,
    learned on the first call, were blended from the second.  A paragraph that follows
    the same text as on an earlier request is kept too; retrieved passages pasted into a
    system message change from request to request, so they stay chunks, learned and
    reused, unless the same ones open it again (then the prefix cache serves them exactly).
    A paragraph behind a rule is the pasted context of a template that separates it so
    (LangChain's stuff prompt: a short instruction, ``----------------``, the context).
    Passages in ``ingested`` (ingested, or given as documents: not learned) are always
    chunks, and the opening ends before the first of them."""
    before, kept, keeping, ruled = "", None, True, False
    openings: list[str] = []
    for j, p in enumerate(pieces):
        if p.passage is None:
            before += p.text
            ruled = ruled or has_rule(p.text)
            continue
        if ruled or p.passage.strip() in ingested or len(openings) >= MAX_OPENING_PARAGRAPHS:
            break
        opening = before + p.text
        if not openings and not p.learned:
            return None  # a known passage opens the message: the prefix ends before it anyway
        # the prefix is contiguous: past the first, a paragraph is kept while all before it were
        keeping = not openings or (keeping and heads is not None and heads.seen(opening))
        if keeping:
            pieces[j] = Piece(p.text)
            kept = j
        openings.append(opening)
        before = opening
    if heads is not None:
        heads.remember(openings)
    return kept


def layout(prompts: PromptBuilder, pieces: list[Piece], head: int = 0, lead: int | None = None) -> PromptIds:
    """Token ids of the pieces, each tokenized on its own: text before the first chunk
    is the exact prefix, text between chunks gaps, the rest the suffix.  A prompt without
    chunks is computed, except its first ``head`` pieces (a kept system instruction,
    :func:`keep_instruction`): they are the prefix, reused exactly from the prefix cache.

    The prefix stops where the first user message's content starts (piece ``lead``): what
    comes after it and before the first chunk (earlier turns of a conversation, a question
    a template asks above the context) is the prompt's lead, computed in place.  Kept in
    the prefix, it made the prefix new on every request: one prefix-cache entry per turn,
    computed apart and written to the store on the request's path, and never read again."""
    pieces = list(pieces)
    head_chars = sum(len(p.text) for p in pieces[:head])
    lead_chars = sum(len(p.text) for p in pieces[:lead]) if lead is not None else None
    while pieces and pieces[-1].passage is not None:  # the last token must be computed
        pieces[-1] = Piece(pieces[-1].text)
    runs: list[tuple[str, bool]] = []
    for p in pieces:
        chunk = p.passage is not None
        if runs and not chunk and not runs[-1][1]:
            runs[-1] = (runs[-1][0] + p.text, False)
        elif p.text:
            runs.append((p.text, chunk))
    if not any(chunk for _, chunk in runs):
        text = "".join(t for t, _ in runs)
        if 0 < head_chars < len(text):
            return PromptIds(prompts.encode(text[:head_chars]), [], prompts.encode(text[head_chars:]))
        return PromptIds([], [], prompts.encode(text))
    opening = runs.pop(0)[0] if not runs[0][1] else ""
    cut_at = len(opening) if lead_chars is None else min(lead_chars, len(opening))  # a kept head is before it
    prefix, lead_ids = prompts.encode(opening[:cut_at]), prompts.encode(opening[cut_at:])
    chunks: list[list[int]] = []
    gaps: list[list[int]] = []
    for text, chunk in runs[:-1]:
        if chunk:
            chunks.append(prompts.encode(text))
            gaps.append([])
        else:
            gaps[-1] = prompts.encode(text)
    return PromptIds(prefix, chunks, prompts.encode(runs[-1][0]), tuple(gaps), lead_ids)


def chunk_spans(prompt: PromptIds) -> list[tuple[int, int]]:
    """``[start, end)`` of each chunk in ``prompt.all_ids``."""
    spans, pos = [], len(prompt.prefix)
    for ids, chunk in prompt.body():
        if chunk:
            spans.append((pos, pos + len(ids)))
        pos += len(ids)
    return spans
