"""``ChatCacheBlend``: a LangChain chat model on the CacheBlend engine.

It translates LangChain messages and documents into the engine's chat request and the
engine's result back into an ``AIMessage``; finding passages in the prompt, caching and
blending all happen in the core (:meth:`cacheblend.Engine.start_chat`), or, with
``base_url``, on a vLLM server running the CacheBlend connector
(:class:`cacheblend.remote.RemoteEngine`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import AliasChoices, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from cacheblend import Engine, Result
from cacheblend.aio import iterate_in_thread, run_in_thread
from cacheblend.backend import Backend, GenerationRun
from cacheblend.config import RequestOptions
from cacheblend.models.names import DEFAULT_MODEL_NAMES
from cacheblend.remote import RemoteEngine

from .messages import chat_messages, document_texts

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_D = RequestOptions()  # the core's defaults: the same options, names and defaults as every entry point
# Request options that are fields here under the core's own name (max_tokens and stop are LangChain's names).
_FIELD_OPTIONS = [n for n in RequestOptions.names() if n not in ("max_new_tokens", "stop")]

_T = TypeVar("_T")


class ChatCacheBlend(BaseChatModel):
    """Chat model whose prompts reuse the KV caches of retrieved passages (CacheBlend).

    ``ChatCacheBlend()`` loads the default model (SmolLM2-135M-Instruct) with the default
    store (memory, then disk under ``$CACHEBLEND_HOME``).  Passages reach the model three
    ways: ``invoke(messages, documents=[...])`` (or ``.bind(documents=...)``), the chain
    from :func:`create_cacheblend_retrieval_chain`, or unchanged in a formatted prompt: the
    engine finds every passage it has cached by its text, and caches long paragraphs it has
    not seen (``learn_passages``) so the next prompt that holds them reuses them.

    Every response carries ``usage_metadata`` (``input_token_details.cache_read``: prompt
    tokens read from exact caches; ``cacheblend_approximate``: tokens reused from chunk
    caches without recompute) and ``response_metadata["cacheblend"]`` (TTFT, stats and the
    fidelity receipt under ``"fidelity"``: exact or approximate, ratio used, risk, guard).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True, extra="forbid")

    model: str | None = Field(default=None, alias="model_name")
    """HF folder or ``.gguf`` file; None for the default model."""
    store: str | None = None
    """Store spec (``"memory"``, ``"disk:PATH"``, ``"redis://…"``, comma-joined tiers); None: default."""
    temperature: float = Field(default=_D.temperature, ge=0.0)
    """0 decodes greedily."""
    max_tokens: int | None = Field(default=_D.max_new_tokens, gt=0,
                                   validation_alias=AliasChoices("max_tokens", "max_new_tokens"))
    """New tokens at most (None: the core's default)."""
    top_p: float = Field(default=_D.top_p, gt=0.0, le=1.0)
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    timeout: float | None = Field(default=_D.timeout, gt=0)
    """Seconds a call may take; checked between the layers of the prefill and between decoded tokens."""
    max_retries: int = 2
    """Retries of a call that failed for a reason other than bad input (e.g. a store error)."""
    seed: int | None = _D.seed
    streaming: bool = False
    base_url: str | None = Field(default=None, alias="openai_api_base")
    """An OpenAI-compatible vLLM server with ``CacheBlendConnector`` (e.g.
    ``http://127.0.0.1:8000/v1``) to answer instead of the in-process engine; ``model``
    then names a model it serves (None: its first)."""
    api_key: SecretStr | None = None
    """The server's API key, with ``base_url``; the in-process engine needs none."""

    method: Literal["blend", "full", "prefix", "reuse"] = _D.method  # type: ignore[assignment]
    recompute_ratio: float | Literal["auto", "guard"] = _D.recompute_ratio  # type: ignore[assignment]
    """Share of reused chunk tokens recomputed; ``"auto"`` (the loading controller) or
    ``"guard"`` (blend, and prefill exactly when the answer's risk is above ``max_risk``)."""
    quality_floor: float = _D.quality_floor
    check_layers: tuple[int, ...] = tuple(_D.check_layers)
    deviation: Literal["v", "k", "kv"] = _D.deviation  # type: ignore[assignment]
    gradual: bool = _D.gradual
    selection: Literal["deviation", "attention", "impact", "probe"] = _D.selection  # type: ignore[assignment]
    chunk_heads: int = Field(default=_D.chunk_heads, ge=0)
    chunk_budget: Literal["global", "attention"] = _D.chunk_budget  # type: ignore[assignment]
    probe_share: float = Field(default=_D.probe_share, ge=0.0, le=1.0)
    """With ``selection="probe"``: the budget's share chosen by the question probe; the rest by deviation."""
    shift_share: float = Field(default=_D.shift_share, ge=0.0, le=1.0)
    """Share of each chunk's tokens, evenly spaced, recomputed to estimate and correct the chunk's shift (0: off)."""
    shift_parts: Literal["kv", "k", "v"] = _D.shift_parts  # type: ignore[assignment]
    """Which of the keys and values the chunk shift moves."""
    shift_values_from: float = Field(default=_D.shift_values_from, ge=0.0, le=1.0)
    """The chunk shift moves values only from this fraction of the model's depth on."""
    max_risk: float | None = _D.max_risk
    """The quality guard's risk limit (see ``response_metadata["cacheblend"]["fidelity"]``)."""
    max_exposure: float | None = _D.max_exposure
    """The quality guard's limit on risk × exposure (how much the first token rests on stale K/V)."""
    check_pool: float = Field(default=_D.check_pool, ge=0.0, le=1.0)
    """Share of the chunk tokens, by the deviation hint stored at ingestion, run up to the check layer (1: all)."""
    ignore_eos: bool = _D.ignore_eos
    """Decode past end-of-sequence up to ``max_tokens`` (fixed-length answers, for timing)."""
    learn: bool = Field(default=_D.learn, validation_alias=AliasChoices("learn", "learn_passages"))
    """Cache long paragraphs of the prompt that are not known passages yet (also ``learn_passages``)."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Further core request options (:class:`cacheblend.config.RequestOptions`), checked here."""

    engine: Backend | None = Field(default=None, exclude=True)
    """A backend (``Engine`` or ``RemoteEngine``) to use instead of the shared one for ``model``/``store``."""
    _engine: Backend | None = PrivateAttr(default=None)

    # -- what LangChain asks of a chat model ---------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "cacheblend"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """What makes two instances answer alike: LangChain's LLM cache (``set_llm_cache``)
        keys on it, so every request option is in it, not only the model's name."""
        return {"model": self.model_label, "store": self.store, "base_url": self.base_url,
                **self._field_options(), "model_kwargs": sorted(self.model_kwargs.items())}

    @property
    def model_label(self) -> str | None:
        """The model's name as far as it is known without loading or connecting: ``model``,
        else the engine's once there is one, else the default's (None for a server's first
        model not asked for yet)."""
        if self.model:
            return self.model
        engine = self._engine if self._engine is not None else self.engine
        if engine is not None:
            return engine.model_name
        return None if self.base_url else DEFAULT_MODEL_NAME

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        # LangChain calls this on the event loop before an async call: it must not load the model
        params = LangSmithParams(ls_provider="cacheblend", ls_model_type="chat",
                                 ls_temperature=_or(kwargs.get("temperature"), self.temperature))
        if name := kwargs.get("model") or self.model_label:
            params["ls_model_name"] = name
        if (max_tokens := _or(kwargs.get("max_tokens"), self.max_tokens)) is not None:
            params["ls_max_tokens"] = max_tokens
        if stop := stop if stop is not None else self.stop:
            params["ls_stop"] = stop
        return params

    @model_validator(mode="after")
    def _valid_options(self) -> ChatCacheBlend:
        """Every option checked when the object is built, as ``CacheBlendLLM`` does, so a
        bad value fails here and not at the first call (the field constraints name the
        LangChain field; the core checks the rest under the same names)."""
        RequestOptions.check_names(self.model_kwargs, "ChatCacheBlend(model_kwargs=...)")
        RequestOptions.parse(self.model_kwargs)
        RequestOptions.parse(self._field_options())
        return self

    def _field_options(self) -> dict[str, Any]:
        """The fields as core request options (``max_tokens`` as ``max_new_tokens``)."""
        options: dict[str, Any] = {name: getattr(self, name) for name in _FIELD_OPTIONS}
        options["stop"] = tuple(self.stop or ())
        options["max_new_tokens"] = self.max_tokens if self.max_tokens is not None else _D.max_new_tokens
        return options

    @property
    def model_name(self) -> str:
        """The model's one name: what ``model=`` was given, else the name the loaded default
        reports (``ChatCacheBlend(model=llm.model_name)`` loads the same model)."""
        return self.model or self.get_engine().model_name

    def _same_model(self, name: Any) -> bool:
        if name is None or name == self.model_name:
            return True
        default = self.model is None and str(name).lower() in DEFAULT_MODEL_NAMES
        return default or (self.model is not None and str(name).lower() == self.model.lower())

    # -- what CacheBlend does not do: say so, and what to use instead ----------------------
    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> Any:
        raise NotImplementedError(
            "ChatCacheBlend does not call tools: CacheBlend speeds up the prefill of RAG answers, and its "
            "models are not tool-calling models. Use a tool-calling chat model for the agent's tool steps and "
            "ChatCacheBlend for the answer over retrieved documents.")

    def with_structured_output(self, schema: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "ChatCacheBlend has no structured-output (tool or JSON) mode. Ask for the format in the prompt and "
            "parse the text (e.g. `llm | JsonOutputParser()` or `PydanticOutputParser`).")

    @property
    def learn_passages(self) -> bool:
        """The former name of ``learn``."""
        return self.learn

    def __getstate__(self) -> dict[Any, Any]:
        """Pickled (multiprocessing, Ray) without its engine, which holds the model and locks:
        the copy loads, or connects to, its own on first use."""
        if self.engine is not None:
            raise TypeError("ChatCacheBlend(engine=...) cannot be pickled: an engine holds the model and locks. "
                            "Build it with model=, store= or base_url= and each process gets its own engine")
        state = super().__getstate__()
        state["__pydantic_private__"] = {**(state.get("__pydantic_private__") or {}), "_engine": None}
        return state

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> ChatCacheBlend:
        """A copy that shares the engine (a process-wide resource), not a copy of it."""
        memo = {} if memo is None else memo
        for engine in (self.engine, self._engine):
            if engine is not None:
                memo[id(engine)] = engine
        return super().__deepcopy__(memo)

    def get_engine(self) -> Backend:
        """The engine, loaded (or connected to) on first use, so constructing costs nothing."""
        if self._engine is None:
            if self.engine is not None:
                self._engine = self.engine
            elif self.base_url:
                key = self.api_key.get_secret_value() if self.api_key else None
                self._engine = RemoteEngine.shared(self.base_url, self.model, api_key=key)
            else:
                self._engine = Engine.shared(self.model, store=self.store)
        return self._engine

    def get_token_ids(self, text: str) -> list[int]:
        """Token ids by the model's own tokenizer (``get_num_tokens``, ``trim_messages(token_counter=llm)``
        and memory classes count with it; LangChain's fallback downloads GPT-2's)."""
        return self.get_engine().prompts.encode(text)

    # -- ingestion -----------------------------------------------------------------------
    def ingest(self, texts: Sequence[str]) -> list[str]:
        """Precompute and store the passages' KV now; returns their cache keys."""
        return [h.key for h in self.get_engine().ingest(list(texts))]

    def release(self, texts: Sequence[str]) -> int:
        """Forget passages and delete their caches; returns how many were stored."""
        return self.get_engine().release(list(texts))

    # -- requests ------------------------------------------------------------------------
    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> GenerationRun:
        kwargs = {name: value for name, value in kwargs.items() if not name.startswith("ls_")}  # tracing only
        kwargs.pop("stream", None)  # LangChain's per-call streaming switch, already applied by its caller
        documents = document_texts(kwargs.pop("documents", None) or ())
        model = kwargs.pop("model", None)
        if not self._same_model(model):
            raise ValueError(f"ChatCacheBlend serves {self.model_name!r}, not {model!r}: one object per model; "
                             f"build ChatCacheBlend(model={model!r}) for another")
        for name in ("response_format", "format"):
            if kwargs.pop(name, None) is not None:
                raise ValueError(f"ChatCacheBlend has no JSON mode ({name}=...): ask for JSON in the prompt and "
                                 "parse the text (JsonOutputParser)")
        options = self._field_options()
        if stop is not None:  # [] clears the field's stops
            options["stop"] = tuple(stop)
        return self.get_engine().start_chat(chat_messages(messages), documents,
                                            **(options | self.model_kwargs | _per_call(kwargs)))

    def _retried(self, once: Callable[[], _T]) -> _T:
        """``once()`` under the retry policy: bad input (a ValueError; CacheBlendError is one)
        and a timeout raise at once, other failures are tried again up to ``max_retries`` times."""
        attempts = 1 + max(0, self.max_retries)
        for attempt in range(attempts):
            try:
                return once()
            except (TimeoutError, ValueError):
                raise
            except Exception:
                if attempt + 1 == attempts:
                    raise
        raise AssertionError("unreachable")

    def _started(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> tuple[GenerationRun, Iterator[str]]:
        """A streamed call's run and its pieces.  Its start and first piece are retried as
        :meth:`_generate` retries a call (nothing has reached the caller yet); after the
        first piece an error ends the stream."""

        def once() -> tuple[GenerationRun, str | None]:
            gen = self._start(messages, stop, kwargs)
            return gen, next(gen.pieces, None)

        gen, first = self._retried(once)
        return gen, itertools.chain(() if first is None else (first,), gen.pieces)

    def _timeout(self, kwargs: dict[str, Any]) -> float | None:
        """The call's time limit: a per-call ``timeout`` (None: none) over the field."""
        return kwargs["timeout"] if "timeout" in kwargs else self.timeout

    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        timeout = self._timeout(kwargs)
        deadline = time.monotonic() + timeout if timeout else None

        def once() -> GenerationRun:
            gen = self._start(messages, stop, kwargs)
            for _ in gen.pieces:
                _check(deadline, timeout)
            _check(deadline, timeout)
            return gen

        gen = self._retried(once)
        assert gen.result is not None
        message = AIMessage(content=gen.result.text, **self._metadata(gen.result))
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        timeout = self._timeout(kwargs)
        deadline = time.monotonic() + timeout if timeout else None
        gen, pieces = self._started(messages, stop, kwargs)
        for piece in pieces:
            _check(deadline, timeout)
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert gen.result is not None
        yield self._last_chunk(gen.result)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await run_in_thread(self._generate, messages, stop, None, **kwargs)

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        timeout = self._timeout(kwargs)
        deadline = time.monotonic() + timeout if timeout else None
        started: list[GenerationRun] = []

        def start() -> Iterator[str]:
            gen, pieces = self._started(messages, stop, kwargs)
            started.append(gen)
            return pieces

        async for piece in iterate_in_thread(start):
            _check(deadline, timeout)
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                await run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        assert started and started[0].result is not None
        yield self._last_chunk(started[0].result)

    # -- results -------------------------------------------------------------------------
    def _metadata(self, result: Result) -> dict[str, Any]:
        usage = result.usage
        # cache_read: exact cache reads (the prefix); CacheBlend's approximate reuse of chunk
        # caches is counted apart, so no one mistakes it for an exact hit.
        details = {"cache_read": usage["cached_tokens"], "cacheblend_approximate": usage["approximate_tokens"]}
        return {
            "usage_metadata": UsageMetadata(
                input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
                total_tokens=usage["total_tokens"], input_token_details=details,  # type: ignore[typeddict-item]
                output_token_details={},
            ),
            "response_metadata": {"model_name": self.model_name,
                                  "model_provider": "cacheblend", "finish_reason": result.finish_reason,
                                  "ttft_s": result.ttft_s, "cacheblend": result.metadata()},
        }

    def _last_chunk(self, result: Result) -> ChatGenerationChunk:
        """The closing chunk: no text, the usage and metadata of the whole response."""
        return ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last", **self._metadata(result)))


def _check(deadline: float | None, timeout: float | None) -> None:
    if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError(f"ChatCacheBlend call took longer than timeout={timeout} s")


def _or(value: Any, field: Any) -> Any:
    """A per-call value, or the field's where the call passed None."""
    return field if value is None else value


def _per_call(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Per-call options under the core's names (:meth:`RequestOptions.per_call`)."""
    return RequestOptions.per_call(kwargs, {"max_tokens": "max_new_tokens", "learn_passages": "learn"},
                                   "ChatCacheBlend")
