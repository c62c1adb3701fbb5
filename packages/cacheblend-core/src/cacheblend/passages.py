"""Finding chunks inside an already formatted prompt, by their text.

Framework chains (LangChain's stuff chain, LlamaIndex's synthesizers, a plain
``prompt | llm``) hand the model one formatted prompt, with the retrieved passages pasted
in with whatever separators and labels the template uses.  To reuse their caches we must
find where each passage sits without relying on a separator convention: the engine
remembers the text of every chunk it has cached (:class:`PassageIndex`) and looks for
those texts in the prompt.  Text a prompt holds that is not a known passage can be
*learned*: paragraphs long enough to be worth caching become new chunks, so the next
prompt that carries them reuses them (:func:`paragraphs`).

Matching is by text, not token ids, because a passage is tokenized differently inside a
prompt (a BPE merge across its first or last character) than on its own; the engine
tokenizes the prompt piece by piece instead, which is what makes a chunk's cache valid
at any position.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
# A rule between a template's parts ("-----", "=====", "***" on a line of its own), a
# paragraph break as much as a blank line: LlamaIndex's text_qa template and LangChain's
# stuff prompt put one between their text and the context, with no blank line around it
_RULE = re.compile(r"^[ \t]*([-=_*])\1{2,}[ \t]*(?:\n|$)", re.M)
# The line a template puts the question on, wherever it sits ("Question: {question}" above
# the context in LangChain hub's rlm/rag-prompt, "Query: {query_str}" in LlamaIndex's), with
# the answer lines right under it: LlamaIndex's chat refine template pastes the answer of
# the previous step there ("Query: {query_str}\nOriginal Answer: {existing_answer}")
_QUESTION_LINE = re.compile(r"^[ \t]*(?:(?:user(?:'s)? )?(?:question|query)|q)[ \t]*:[^\n]*(?:\n|$)"
                            r"(?:[ \t]*(?:(?:[a-z']+[ \t]+){0,3}answer|a)[ \t]*:[^\n]*(?:\n|$))*", re.I | re.M)
# A template's label naming the context at a line's start ("Context: {context}", "New
# Context: {context_msg}"): the context starts after it, even when a single newline glues
# the template's own text above it (LlamaIndex's chat refine template)
_CONTEXT_LABEL = re.compile(r"^[ \t]*(?:[a-z]+[ \t]+)?context(?:[ \t]+information)?[ \t]*:[ \t]*", re.I | re.M)
# A template's label in front of a passage: "Context:", "Source 1:", "Document [2]:", ...
_LABEL = re.compile(r"[A-Z][A-Za-z]*(?: [A-Za-z]+){0,3}(?: ?[#\[(]?\d+[\])]?)?:[ \t]*\n?[ \t]*")


@dataclass(frozen=True)
class Span:
    """``text[start:end]`` is a chunk; ``learned`` when it was not known before."""

    start: int
    end: int
    learned: bool = False


class PassageIndex:
    """The texts of cached chunks, found again in any prompt by content.

    Texts are indexed by their first ``anchor`` characters, so a scan costs one dict
    lookup per prompt position however many passages are known; shorter texts are
    searched for directly.  The oldest texts are forgotten past ``capacity`` (their
    caches stay in the store and are still found by key when the text recurs).

    One index serves every request of an engine, and the adapters' async paths plan
    requests on worker threads while others ingest, so every public method holds one lock:
    a scan that iterated a bucket while another thread added to it raised
    ``RuntimeError: Set changed size during iteration``."""

    def __init__(self, anchor: int = 48, capacity: int = 200_000) -> None:
        self.anchor = anchor
        self.capacity = capacity
        self._texts: OrderedDict[str, bool] = OrderedDict()  # text -> learned (not ingested or given)
        self._by_anchor: dict[str, set[str]] = {}
        self._short: set[str] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._texts)

    def __contains__(self, text: object) -> bool:
        with self._lock:
            return text in self._texts

    def add(self, text: str, learned: bool = False) -> None:
        """Remember ``text``; stripped of leading and trailing whitespace too, since a
        template may paste it either way (its cache is then the stripped text's own).
        ``learned``: found in a prompt, not ingested or given as a document; a text added
        both ways counts as ingested."""
        with self._lock:
            for variant in dict.fromkeys((text, text.strip())):
                self._add(variant, learned)

    def learned(self, text: str) -> bool:
        """Whether ``text`` is known only as a paragraph learned from prompts."""
        with self._lock:
            return self._texts.get(text, False)

    def _add(self, text: str, learned: bool) -> None:
        if not text.strip():
            return
        if text in self._texts:
            self._texts[text] = self._texts[text] and learned
            self._texts.move_to_end(text)
            return
        self._texts[text] = learned
        if len(text) >= self.anchor:
            self._by_anchor.setdefault(text[: self.anchor], set()).add(text)
        else:
            self._short.add(text)
        while len(self._texts) > self.capacity:
            self._discard(next(iter(self._texts)))

    def discard(self, text: str) -> None:
        with self._lock:
            for variant in dict.fromkeys((text, text.strip())):
                self._discard(variant)

    def _discard(self, text: str) -> None:
        if text not in self._texts:
            return
        del self._texts[text]
        bucket = self._by_anchor.get(text[: self.anchor])
        if bucket is not None:
            bucket.discard(text)
            if not bucket:
                del self._by_anchor[text[: self.anchor]]
        self._short.discard(text)

    def find(self, text: str) -> list[Span]:
        """Non-overlapping spans of known passages in ``text``, left to right; where two
        candidates start at the same place the longer wins."""
        with self._lock:
            starts = self._starts(text)
        spans, pos = [], 0
        for start in sorted(starts):
            if start >= pos:
                spans.append(Span(start, starts[start]))
                pos = starts[start]
        return spans

    def _starts(self, text: str) -> dict[int, int]:
        """Where known passages start in ``text``, each start to the longest one's end."""
        starts: dict[int, int] = {}
        if self._by_anchor:
            a = self.anchor
            for i in range(len(text) - a + 1):
                bucket = self._by_anchor.get(text[i : i + a])
                if bucket:
                    for cand in bucket:
                        if text.startswith(cand, i):
                            starts[i] = max(starts.get(i, 0), i + len(cand))
        for cand in self._short:
            i = text.find(cand)
            while i >= 0:
                if _whole(text, i, i + len(cand)):
                    starts[i] = max(starts.get(i, 0), i + len(cand))
                i = text.find(cand, i + 1)
        return starts


def _whole(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` is not cut out of a longer word: a short passage ("art")
    was found inside "start" and "party", and the prompt tokenized around it.  Only short
    passages are held to it: a long one is not found by accident, and templates do glue
    passages to letters (a Python list's repr joins lines with an escaped "\\n")."""
    cut_before = 0 < start and text[start - 1].isalnum() and text[start].isalnum()
    cut_after = end < len(text) and text[end - 1].isalnum() and text[end].isalnum()
    return not (cut_before or cut_after)


def paragraphs(text: str, min_chars: int, questions: bool = False) -> list[Span]:
    """Paragraphs of ``text`` (split at blank lines and at rule lines such as ``-----``) of
    at least ``min_chars`` characters, as learned spans; with ``questions``, a question line
    (``Question: ...``, ``Query: ...``, with any answer lines right under it) splits them
    too and is never part of one, and so does a context label at a line's start
    (``New Context: ...``): the text above it is the template's own.  Used only
    on text that holds no known passage: this is a guess at chunk boundaries, made so that
    a passage seen once is reused the next time.  A paragraph glued to a template's header
    or question by single newlines was learned with them: never reused (the question
    changes on every call), and one new store entry per request."""
    spans, pos = [], 0
    for start, end in [*_breaks(text, questions), (len(text), len(text))]:
        body = text[pos:start]
        lead = len(body) - len(body.lstrip())
        core = body.strip()
        if len(core) >= min_chars:
            spans.append(Span(pos + lead, pos + lead + len(core), learned=True))
        pos = end
    return spans


def has_rule(text: str) -> bool:
    """Whether ``text`` holds a rule line (``-----``): in a template, what follows one is
    the pasted context, not the template's own text."""
    return _RULE.search(text) is not None


def _breaks(text: str, questions: bool) -> list[tuple[int, int]]:
    """The ``[start, end)`` of every paragraph break in ``text``, merged where they touch."""
    found = [m.span() for m in _PARAGRAPH_BREAK.finditer(text)] + [m.span() for m in _RULE.finditer(text)]
    if questions:
        found += [m.span() for m in _QUESTION_LINE.finditer(text)]
        found += [m.span() for m in _CONTEXT_LABEL.finditer(text)]
    merged: list[tuple[int, int]] = []
    for start, end in sorted(found):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


@dataclass(frozen=True)
class Piece:
    """A run of prompt text; ``passage`` is set when the run is a chunk (its text without
    the blank line that may follow it)."""

    text: str
    passage: str | None = None
    learned: bool = False


def cut(text: str, index: PassageIndex, learn_min_chars: int | None, keep_tail: bool) -> list[Piece]:
    """``text`` as pieces: known passages, then (when
    ``learn_min_chars``) long paragraphs of the rest.  A chunk piece takes the blank line
    after it, as :meth:`PromptBuilder.chunk_ids` does, so a passage ingested on its own and
    one found in a prompt share a cache.  With ``keep_tail`` (the message that asks the
    question) the last paragraph, any question line and the text above the first rule line
    (a template's header: the refine prompt for completion models states the question and
    the previous answer there, in prose) are never learned."""
    found = index.find(text)
    if learn_min_chars:
        gaps, pos = [], 0
        for s in [*found, Span(len(text), len(text))]:
            gaps.append((pos, s.start))
            pos = s.end
        tail = _tail_start(text) if keep_tail else len(text)
        rule = _RULE.search(text) if keep_tail else None
        head = rule.end() if rule is not None else 0
        for a, b in gaps:
            a = max(a, head)
            for s in paragraphs(text[a:min(b, tail)] if a < tail else "", learn_min_chars, keep_tail):
                span = _unlabelled(text, a + s.start, a + s.end, learn_min_chars)
                if span is not None:
                    found.append(span)
        found.sort(key=lambda s: s.start)
    pieces: list[Piece] = []
    pos = 0
    for i, s in enumerate(found):
        # the blank line after a chunk goes with it, unless the next chunk starts inside it
        # (a known text that begins with a newline): the pieces must join to the text
        following = found[i + 1].start if i + 1 < len(found) else len(text)
        end = s.end + 2 if text.startswith("\n\n", s.end) and s.end + 2 <= following else s.end
        if s.start > pos:
            pieces.append(Piece(text[pos : s.start]))
        pieces.append(Piece(text[s.start : end], text[s.start : s.end], s.learned))
        pos = end
    if pos < len(text):
        pieces.append(Piece(text[pos:]))
    return pieces


def _tail_start(text: str) -> int:
    """Where the question starts: the last paragraph, or the last line of it when it has
    several (a one-paragraph template such as ``"Context: {c}\nQuestion: {q}"``)."""
    breaks = list(_PARAGRAPH_BREAK.finditer(text))
    start = breaks[-1].end() if breaks else 0
    line = text.rfind("\n", start, len(text.rstrip()))
    return line + 1 if line >= 0 else start


def _unlabelled(text: str, start: int, end: int, min_chars: int) -> Span | None:
    """The learned span ``text[start:end]`` without a template's label in front of it
    (``"Context: "``, ``"Source 1:\n"``), if what remains is still long enough."""
    label = _LABEL.match(text, start, end)
    if label is not None and label.end() < end:
        start = label.end()
    return Span(start, end, learned=True) if end - start >= min_chars else None
