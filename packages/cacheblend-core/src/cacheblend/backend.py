"""The protocol both backends implement: the in-process :class:`~cacheblend.engine.Engine`
and :class:`~cacheblend.remote.RemoteEngine` (a vLLM server with the CacheBlend connector).

Framework adapters type against :class:`Backend`, so every adapter feature works on
either; a backend's requests run lazily as a :class:`GenerationRun`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

from .errors import CacheBlendError
from .passages import PassageIndex
from .prompt import PromptBuilder
from .results import BlendStats, ChunkHandle, Result


@runtime_checkable
class GenerationRun(Protocol):
    """One request: iterate ``pieces`` for text; ``result`` is set once they are exhausted."""

    @property
    def pieces(self) -> Generator[str, None, None]: ...

    @property
    def result(self) -> Result | None: ...

    @property
    def stats(self) -> BlendStats: ...


@runtime_checkable
class Backend(Protocol):
    """Ingest chunks, answer prompts built from them, release them.

    ``options`` everywhere are :class:`cacheblend.config.RequestOptions` fields; an
    unknown one raises :class:`cacheblend.CacheBlendError` naming the known ones."""

    @property
    def model_name(self) -> str: ...

    @property
    def context_length(self) -> int: ...

    @property
    def passages(self) -> PassageIndex: ...

    @property
    def prompts(self) -> PromptBuilder:
        """The model's tokenizer and chat template, as prompts are built with them."""
        ...

    @classmethod
    def shared(cls, *args: Any, **kwargs: Any) -> Any:
        """One backend per model/server and settings in a process."""
        ...

    def ingest(self, texts: Iterable[str] | str) -> list[ChunkHandle]:
        """Precompute and store each chunk's KV; returns handles in order."""
        ...

    def release(self, chunks: Any) -> int:
        """Forget chunks (texts, or handles where the backend has them) and delete their caches."""
        ...

    def start(self, query: str, chunks: Sequence[ChunkHandle | str] = (), *, system: str | None = None,
              preamble: str = "", **options: Any) -> GenerationRun:
        """``[system][preamble][chunk 1]…[chunk k][query]``, validated now, run lazily."""
        ...

    def start_chat(self, messages: Sequence[dict[str, str]], documents: Sequence[str] = (),
                   **options: Any) -> GenerationRun:
        """A chat whose messages may hold known passages, formatted any way."""
        ...

    def generate(self, query: str, chunks: Sequence[ChunkHandle | str] = (), **options: Any) -> Result:
        """:meth:`start` run to its end."""
        ...

    def stream(self, query: str, chunks: Sequence[ChunkHandle | str] = (), **options: Any) -> Iterator[str]:
        """:meth:`start`'s text pieces."""
        ...


class Answering:
    """What both backends derive from :meth:`start`: ``generate`` and ``stream``, and the
    check of a request's framing arguments."""

    def start(self, query: str, chunks: Sequence[ChunkHandle | str] = (), *, system: str | None = None,
              preamble: str = "", **options: Any) -> GenerationRun:
        raise NotImplementedError

    def generate(self, query: str, chunks: Sequence[ChunkHandle | str] = (), **options: Any) -> Result:
        """Answer ``query`` over ``chunks`` (handles or raw texts, in prompt order): :meth:`start`
        run to its end."""
        run = self.start(query, chunks, **options)
        for _ in run.pieces:
            pass
        assert run.result is not None
        return run.result

    def stream(self, query: str, chunks: Sequence[ChunkHandle | str] = (), **options: Any) -> Iterator[str]:
        """Yield the answer's text pieces as they are decoded (options as :meth:`start`);
        bad input raises here, before the first piece."""
        return self.start(query, chunks, **options).pieces


def check_request(query: object, system: object, preamble: object) -> None:
    """The framing arguments of :meth:`Backend.start`, named when they are wrong."""
    if not isinstance(query, str) or not query.strip():
        raise CacheBlendError("query must be a non-empty string")
    if system is not None and not isinstance(system, str):
        raise CacheBlendError(f"system must be a string or None, got {type(system).__name__}")
    if not isinstance(preamble, str):
        raise CacheBlendError(f"preamble must be a string, got {type(preamble).__name__}")
