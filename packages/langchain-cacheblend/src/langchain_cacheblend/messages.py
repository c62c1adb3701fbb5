"""LangChain messages and documents as the engine's inputs.

Only translation lives here: which role a message has (by the core's one table,
:func:`cacheblend.prompt.chat_role`, so ``CacheBlendLLM`` takes the same roles) and the
text of its content.  Anything the engine cannot read (tool messages, images) is refused
with an error that names it, rather than dropped, so an answer never silently ignores
part of its input.
"""

from __future__ import annotations

from typing import Any

from langchain_core.documents import Document
from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from cacheblend import CacheBlendError
from cacheblend.prompt import chat_role

# A message's role by its class; the ``...MessageChunk`` classes (what ``full = full + chunk``
# over a stream builds, then kept in a chat history) are subclasses, with types of their own.
_ROLES = ((SystemMessage, "system"), (HumanMessage, "human"), (AIMessage, "ai"), (ToolMessage, "tool"),
          (FunctionMessage, "function"))


def document_texts(documents: Any) -> list[str]:
    """``documents=`` (one or a list of ``Document`` or strings) as passage texts.  Blank
    ones are left out (an image-only PDF page, an empty file): LangChain's stuff chain
    pastes them as nothing, and they are no passage to reuse."""
    if isinstance(documents, (str, Document)):
        documents = [documents]
    out = []
    for d in documents:
        if isinstance(d, Document):
            text = d.page_content
        elif isinstance(d, str):
            text = d
        else:
            raise CacheBlendError(f"documents must be Document objects or strings, got {type(d).__name__}")
        if text.strip():
            out.append(text)
    return out


def message_role(m: BaseMessage) -> str:
    """A ``ChatMessage``'s ``role`` string, any other message's role by its class."""
    if isinstance(m, ChatMessage):
        return m.role
    return next((role for kind, role in _ROLES if isinstance(m, kind)), m.type)


def chat_messages(messages: list[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as the engine's ``{"role", "content"}`` dicts (text only).

    A ``ChatMessage`` is taken by its ``role`` string (``"developer"``, ``"human"``, ...),
    any other message by its type (``"system"``, ``"human"``, ``"ai"``, ``"tool"``)."""
    out = []
    for m in messages:
        role = message_role(m)
        if isinstance(m, AIMessage) and m.tool_calls:  # its text alone would hide the calls it made
            raise CacheBlendError("ChatCacheBlend cannot take an AI message with tool calls: tool calling is not "
                                  f"supported (calls {[c.get('name') for c in m.tool_calls]})")
        out.append({"role": chat_role(role, "ChatCacheBlend"), "content": message_text(m)})
    return out


def message_text(message: BaseMessage) -> str:
    """The text of a message; a content block that is not text is an error naming its type."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise CacheBlendError(f"ChatCacheBlend takes text only; got a {kind!r} content block")
    return "".join(parts)
