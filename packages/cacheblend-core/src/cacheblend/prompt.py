"""Prompt assembly: ``[system prefix][chunk 1]…[chunk k][question suffix]`` as token ids.

The model's chat template frames the user turn; we render it once around a sentinel and
split there, so the system prefix (everything up to the user's content) is identical in
every prompt and can be reused exactly, and the suffix (the question plus the end of the
user turn and the assistant header) is always computed fresh.  Chunks are tokenized on
their own, which is what makes their caches reusable at any position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CacheBlendError

_SENTINEL = "\u2063CACHEBLEND_CONTENT\u2063"

# The roles a chat message may have, under every name the frameworks give them, and the
# role the chat template knows it by.  One table, so both adapters take the same roles.
CHAT_ROLES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "ai": "assistant", "chatbot": "assistant", "model": "assistant",
}
# Roles of tool calling, which the engine does not do: refused, never passed off as user turns.
TOOL_ROLES = ("tool", "function")


def chat_role(role: object, where: str = "") -> str:
    """The chat template's role for a framework's ``role``.

    Tool and function results are refused rather than sent as user turns: the model would
    read a tool's output as something the user said, and the answer would not say so."""
    at = f"{where}: " if where else ""
    name = str(getattr(role, "value", role)).lower()
    if name in TOOL_ROLES:
        raise CacheBlendError(f"{at}cannot take a {name!r} message: tool calling is not supported "
                              "(use a tool-calling model for tool steps)")
    if name not in CHAT_ROLES:
        raise CacheBlendError(f"{at}unknown message role {name!r}; known: {', '.join(CHAT_ROLES)}")
    return CHAT_ROLES[name]


@dataclass(frozen=True)
class PromptIds:
    """``[prefix][lead][chunk 1][gap 1]…[chunk k][suffix]``: the prefix is reused exactly,
    chunks are blended, the lead, gaps (text a template puts between passages) and the
    suffix are computed.  The lead is a chat's text between its system turn and the first
    chunk (earlier turns, a question asked above the context): it changes from request to
    request, so it is computed in place rather than stored as part of the prefix."""

    prefix: list[int]
    chunks: list[list[int]]
    suffix: list[int]
    gaps: tuple[list[int], ...] = ()
    lead: list[int] = field(default_factory=list)

    def body(self) -> list[tuple[list[int], bool]]:
        """Everything after the prefix as ``(ids, is_chunk)`` runs, in prompt order."""
        runs: list[tuple[list[int], bool]] = [(self.lead, False)] if self.lead else []
        for i, chunk in enumerate(self.chunks):
            runs.append((chunk, True))
            if i < len(self.gaps) and self.gaps[i]:
                runs.append((self.gaps[i], False))
        return runs + [(self.suffix, False)]

    @property
    def all_ids(self) -> list[int]:
        return self.prefix + [t for ids, _ in self.body() for t in ids]


class PromptBuilder:
    """Tokenizes chunks, frames prompts with the chat template, picks the chunk sink."""

    def __init__(self, tokenizer, chunk_separator: str = "\n\n", use_chat_template: bool = True) -> None:
        self.tokenizer = tokenizer
        self.chunk_separator = chunk_separator
        self.use_chat_template = use_chat_template and bool(getattr(tokenizer, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate: tokenizers would fail with a TypeError
            raise CacheBlendError(f"text is not valid Unicode: {e.reason} at character {e.start} "
                                  f"({text[max(0, e.start - 20):e.start]!r}...)") from None
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chunk_ids(self, text: str) -> list[int]:
        if not isinstance(text, str) or not text.strip():
            raise ValueError("a chunk must be a non-empty string")
        return self.encode(text + self.chunk_separator)

    def frame(self, system: str | None) -> tuple[str, str]:
        """Text before and after the user's content."""
        if self.use_chat_template:
            messages = [{"role": "system", "content": system}] if system is not None else []
            messages.append({"role": "user", "content": _SENTINEL})
            text = self.render(messages)
            before, after = text.split(_SENTINEL)
            return before, after
        bos = self.tokenizer.bos_token or ""
        return bos + (f"{system}\n\n" if system else ""), "\n"

    def render(self, messages: list[dict[str, str]]) -> str:
        """The chat template applied to ``messages``.

        A template may refuse a conversation (roles that do not alternate, a system message
        not first, no system role at all): jinja2 raises a ``TemplateError``, which is bad
        input, not a failure to retry, so it becomes a :class:`CacheBlendError` naming the roles."""
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            from jinja2.exceptions import TemplateError  # transformers renders chat templates with jinja2

            if not isinstance(e, TemplateError):
                raise
            roles = [m["role"] for m in messages]
            raise CacheBlendError(f"the model's chat template refuses messages with roles {roles}: {e}") from e

    def build(self, query: str, chunks: list[list[int]], system: str | None, preamble: str = "") -> PromptIds:
        before, after = self.frame(system)
        return PromptIds(
            prefix=self.encode(before + preamble),
            chunks=chunks,
            suffix=self.encode(query + after),
        )

    def chat_parts(self, messages: list[dict[str, str]]) -> list[tuple[str, int | None]]:
        """The rendered chat prompt as ``(text, message index)`` parts: the template's own
        text has index None, each message's content its index.  Rendered once around
        sentinels so that chunks are looked for in the contents only."""
        marks = [f"\u2063CB{i}\u2063" for i in range(len(messages))]
        if self.use_chat_template:
            marked = [{"role": m["role"], "content": mark} for m, mark in zip(messages, marks, strict=True)]
            text = self.render(marked)
        else:
            text = (self.tokenizer.bos_token or "") + "".join(f"{mark}\n" for mark in marks)
        parts: list[tuple[str, int | None]] = []
        pos = 0
        for i, (m, mark) in enumerate(zip(messages, marks, strict=True)):
            at = text.find(mark, pos)
            if at < 0:
                raise ValueError(f"the chat template dropped message {i} (role {m['role']!r})")
            parts += [(text[pos:at], None), (m["content"], i)]
            pos = at + len(mark)
        return parts + [(text[pos:], None)]

    def sink_ids(self, policy: str = "bos") -> list[int]:
        """The tokens a chunk is precomputed behind (their K/V then dropped).

        Without an attention sink at position 0 the chunk's first tokens absorb the
        attention mass and their K/V are far from what they are inside a full prompt.
        ``"bos"``: the BOS token (else the chat template's first token, else EOS).
        ``"frame"``: the whole default chat frame up to the user's content, so a chunk
        is precomputed in the context it usually follows."""
        if policy == "frame" and self.use_chat_template:
            return self.encode(self.frame(None)[0])
        if policy not in ("bos", "frame"):
            raise ValueError(f"chunk sink policy must be 'bos' or 'frame', got {policy!r}")
        tok = self.tokenizer
        if tok.bos_token_id is not None:
            return [tok.bos_token_id]
        if self.use_chat_template:
            first = self.encode(self.frame(None)[0])
            if first:
                return first[:1]
        if tok.eos_token_id is not None:
            return [tok.eos_token_id]
        raise ValueError("tokenizer has neither BOS, a chat template nor EOS to use as a sink")
