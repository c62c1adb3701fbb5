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
from langchain_core.messages import AIMessage, BaseMessage, ChatMessage

from cacheblend import CacheBlendError
from cacheblend.prompt import chat_role


def document_texts(documents: Any) -> list[str]:
    """``documents=`` (one or a list of ``Document`` or strings) as passage texts."""
    if isinstance(documents, (str, Document)):
        documents = [documents]
    out = []
    for d in documents:
        if isinstance(d, Document):
            out.append(d.page_content)
        elif isinstance(d, str):
            out.append(d)
        else:
            raise CacheBlendError(f"documents must be Document objects or strings, got {type(d).__name__}")
    return out


def chat_messages(messages: list[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as the engine's ``{"role", "content"}`` dicts (text only).

    A ``ChatMessage`` is taken by its ``role`` string (``"developer"``, ``"human"``, ...),
    any other message by its type (``"system"``, ``"human"``, ``"ai"``, ``"tool"``)."""
    out = []
    for m in messages:
        role = m.role if isinstance(m, ChatMessage) else m.type
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
