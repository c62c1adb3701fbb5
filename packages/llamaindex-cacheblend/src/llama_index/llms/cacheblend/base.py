"""``CacheBlendLLM``: the CacheBlend engine as a LlamaIndex LLM.

Every call goes through :meth:`Engine.start_chat`, which finds the passages it already
knows (ingested, or learned from earlier prompts) inside the formatted prompt by their
text, so any stock LlamaIndex chain that pastes retrieved chunks verbatim reuses their
KV caches without knowing about CacheBlend.  With ``base_url`` the same calls go to a vLLM
server running the CacheBlend connector (:class:`cacheblend.remote.RemoteEngine`).
This module only translates: messages to
dicts, options to engine keywords, results to LlamaIndex responses.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field, PrivateAttr, field_validator, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from cacheblend import METHODS, CacheBlendError, Engine, Result
from cacheblend.aio import iterate_in_thread, run_in_thread
from cacheblend.backend import Backend, GenerationRun
from cacheblend.config import RequestOptions
from cacheblend.prompt import chat_role
from cacheblend.remote import RemoteEngine

_D = RequestOptions()  # the core's defaults: the same options, names and defaults as every entry point
# Request options that are fields here under the core's own name; LlamaIndex names two of them
# its own way: max_tokens (max_new_tokens) and request_timeout (timeout).
_FIELD_OPTIONS = [n for n in RequestOptions.names() if n not in ("max_new_tokens", "timeout")]
# Per-call names of this adapter (and ChatCacheBlend's former name of learn) for core options.
_RENAMED = {"max_tokens": "max_new_tokens", "request_timeout": "timeout", "learn_passages": "learn"}


def raw_of(result: Result) -> dict[str, Any]:
    """``raw`` of a response: OpenAI-style ``usage`` (read by ``TokenCountingHandler``)
    and the blend stats under ``cacheblend``."""
    return {"usage": dict(result.usage), "cacheblend": result.metadata()}


def finish(gen: GenerationRun) -> Result:
    """Run a generation to its end."""
    for _ in gen.pieces:
        pass
    assert gen.result is not None
    return gen.result


def deltas(gen: GenerationRun) -> Iterator[tuple[str, str, dict | None]]:
    """``(text so far, delta, raw)`` per decoded piece; a last item with an empty delta
    carries ``raw`` once the generation is done (stats exist only then)."""
    text = ""
    try:
        for piece in gen.pieces:
            text += piece
            yield text, piece, None
    finally:
        gen.pieces.close()  # a stream abandoned early stops decoding now
    assert gen.result is not None
    yield gen.result.text, "", raw_of(gen.result)


def document_texts(documents: Any) -> list[str]:
    """``documents=`` (strings, or LlamaIndex documents and nodes) as passage texts.  A node
    is read as synthesizers read it, ``get_content(metadata_mode=MetadataMode.LLM)``, which
    is also the text :class:`CacheBlendKVTransform` caches.  Blank texts are left out, as
    the synthesizer and the transform leave out empty nodes."""
    if isinstance(documents, (str, BaseNode, NodeWithScore)):
        documents = [documents]
    out = []
    for d in documents:
        node = d.node if isinstance(d, NodeWithScore) else d
        if isinstance(node, BaseNode):
            text = node.get_content(metadata_mode=MetadataMode.LLM)
        elif isinstance(node, str):
            text = node
        else:
            raise CacheBlendError(f"documents must be strings or LlamaIndex documents/nodes, got {type(d).__name__}")
        if text.strip():
            out.append(text)
    return out


class CacheBlendLLM(CustomLLM):
    """A chat model served by the CacheBlend engine.

    ``CacheBlendLLM()`` uses the core default model (SmolLM2-135M-Instruct) and store
    (memory + disk), shared process-wide with every other object built on them.
    ``complete(prompt)`` sends the prompt as one user message, after
    ``completion_to_prompt`` and with ``system_prompt`` as a system message;
    ``formatted=True`` (what ``LLM.predict`` passes) sends it as is.  The chat template
    is always applied by the engine: there is no raw-prompt path.  Per-call keywords
    override the fields (``max_tokens``, ``method``, ...; ``documents`` adds passages)."""

    model: str | None = Field(default=None, description="HF folder, hub id or .gguf; None: the core default.")
    store: str | None = Field(default=None, description="KV store spec ('memory', a folder, redis://...); "
                                                        "None: the core default (memory + disk).")
    temperature: float = Field(default=_D.temperature, ge=0.0, description="0 decodes greedily.")
    top_p: float = Field(default=_D.top_p, gt=0.0, le=1.0)
    max_tokens: int = Field(default=_D.max_new_tokens, gt=0, description="New tokens at most.")
    method: str = Field(default=_D.method, description=f"One of {METHODS}.")
    recompute_ratio: float | str = Field(default=_D.recompute_ratio,
                                         description="Share of reused tokens recomputed, 'auto' (the loading "
                                                     "controller) or 'guard' (re-prefill risky answers exactly).")
    quality_floor: float = Field(default=_D.quality_floor, description="The least ratio 'auto' may pick.")
    check_layers: tuple[int, ...] = Field(default=tuple(_D.check_layers), description="HKVD check layers.")
    deviation: str = Field(default=_D.deviation, description="Deviation measure: 'v', 'k' or 'kv'.")
    gradual: bool = Field(default=_D.gradual, description="Gradual filtering over the check layers.")
    selection: str = Field(default=_D.selection,
                           description="Token ranking: 'deviation', 'attention', 'impact' or 'probe'.")
    chunk_heads: int = Field(default=_D.chunk_heads, ge=0, description="First tokens of each chunk always "
                                                                       "recomputed.")
    chunk_budget: str = Field(default=_D.chunk_budget, description="'global', or 'attention': spread the "
                                                                   "recompute over chunks by the question's attention.")
    probe_share: float = Field(default=_D.probe_share, ge=0.0, le=1.0, description="With selection='probe': the "
                               "budget's share chosen by the question probe; the rest by deviation.")
    shift_share: float = Field(default=_D.shift_share, ge=0.0, le=1.0, description="Share of each chunk's tokens, "
                               "evenly spaced, recomputed to estimate and correct the chunk's shift (0: off).")
    shift_parts: str = Field(default=_D.shift_parts, description="Which of the keys and values the chunk shift "
                                                                 "moves: 'kv', 'k' or 'v'.")
    shift_values_from: float = Field(default=_D.shift_values_from, ge=0.0, le=1.0, description="The chunk shift "
                                     "moves values only from this fraction of the model's depth on.")
    max_risk: float | None = Field(default=_D.max_risk, description="The quality guard's risk limit (see "
                                                                    "raw['cacheblend']['fidelity']).")
    max_exposure: float | None = Field(default=_D.max_exposure, description="The quality guard's limit on risk "
                                       "× exposure (how much the first token rests on stale K/V).")
    check_pool: float = Field(default=_D.check_pool, ge=0.0, le=1.0, description="Share of the chunk tokens, by "
                              "the deviation hint stored at ingestion, run up to the check layer (1: all).")
    seed: int | None = _D.seed
    stop: list[str] = Field(default_factory=lambda: list(_D.stop), description="Strings that end the answer.")
    ignore_eos: bool = Field(default=_D.ignore_eos, description="Decode past end-of-sequence up to max_tokens "
                                                                "(fixed-length answers, for timing).")
    learn: bool = Field(default=_D.learn, description="Cache long unknown paragraphs of prompts for next time "
                                                      "(also learn_passages, as in ChatCacheBlend).")
    base_url: str | None = Field(default=None, description="An OpenAI-compatible vLLM server with the CacheBlend "
                                                           "connector to answer instead of the in-process engine.")
    # kept out of repr and of to_dict/to_json (a saved configuration must not carry it):
    # LlamaIndex's serialisation cannot write pydantic's SecretStr, which ChatCacheBlend uses
    api_key: str | None = Field(default=None, repr=False, exclude=True,
                                description="The server's API key, with base_url.")
    context_window: int | None = Field(default=None, gt=0, description="Tokens a prompt may fill (None: the "
                                                                        "model's context; capped by it).")
    request_timeout: float | None = Field(default=_D.timeout, gt=0, description="Seconds a call may take, "
                                          "checked between prefill layers and decoded tokens.")
    additional_kwargs: dict[str, Any] = Field(default_factory=dict, description="Further core request options "
                                              "(cacheblend.config.RequestOptions), checked when set.")

    model_config = ConfigDict(extra="forbid")
    _engine: Backend = PrivateAttr()
    _custom_engine: bool = PrivateAttr(default=False)

    def __init__(self, engine: Backend | None = None, **data: Any) -> None:
        """``engine``: use this engine instead of ``Engine.shared(model, store=store)`` (or,
        with ``base_url``, a :class:`RemoteEngine` on that server)."""
        super().__init__(**data)  # the fields first: a misspelt option is named before anything else
        if engine is not None and not callable(getattr(engine, "start_chat", None)):
            raise CacheBlendError(f"CacheBlendLLM(engine=...) takes an Engine or RemoteEngine, got "
                                  f"{type(engine).__name__} {engine!r:.60}; name a model with model=...")
        self._custom_engine = engine is not None
        if engine is not None:
            self._engine = engine
        elif self.base_url:
            self._engine = RemoteEngine.shared(self.base_url, self.model, api_key=self.api_key)
        else:
            self._engine = Engine.shared(self.model, store=self.store)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (``IngestionPipeline(num_workers=...)``, multiprocessing) without its
        engine: the copy is built again from its fields and uses the shared engine for its
        ``model`` and ``store`` (or ``base_url``).  A custom ``engine=`` cannot go along: it
        would be swapped for that shared one without a word, so it is refused."""
        if self._custom_engine:
            raise TypeError("CacheBlendLLM(engine=...) cannot be pickled: an engine holds the model and locks. "
                            "Build it with model=, store= or base_url= and each process gets its own engine")
        return super().__getstate__()

    @model_validator(mode="before")
    @classmethod
    def _former_names(cls, data: Any) -> Any:
        """``learn_passages``: ChatCacheBlend's other name of ``learn``, taken here too (``learn`` wins)."""
        if isinstance(data, dict) and "learn_passages" in data:
            data = dict(data)
            data.setdefault("learn", data.pop("learn_passages"))
        return data

    @model_validator(mode="after")
    def _valid_options(self) -> CacheBlendLLM:
        """Every option checked by the core when the object is built, not at the first call."""
        RequestOptions.parse(self.options())
        return self

    @property
    def learn_passages(self) -> bool:
        """ChatCacheBlend's other name of ``learn``."""
        return self.learn

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        if v not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {v!r}")
        return v

    @field_validator("additional_kwargs")
    @classmethod
    def _known_options(cls, v: dict[str, Any]) -> dict[str, Any]:
        RequestOptions.check_names(v, "CacheBlendLLM(additional_kwargs=...)")
        RequestOptions.parse(v)
        return v

    @classmethod
    def class_name(cls) -> str:
        return "CacheBlendLLM"

    @property
    def engine(self) -> Backend:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        window = min(self.context_window or self._engine.context_length, self._engine.context_length)
        return LLMMetadata(context_window=window, num_output=self.max_tokens, model_name=self.model_name,
                           is_chat_model=True, is_function_calling_model=False)

    @property
    def model_name(self) -> str:
        """The model's one name: what ``model=`` was given, else the name the loaded default reports."""
        return self.model or self._engine.model_name

    # -- what CacheBlend does not do: say so, and what to use instead ----------------------
    def _no_tools(self) -> NotImplementedError:
        return NotImplementedError(
            "CacheBlendLLM does not call tools (is_function_calling_model=False): CacheBlend speeds up the "
            "prefill of RAG answers. Use a function-calling LLM for agents and tool steps, and CacheBlendLLM "
            "for the answer over retrieved nodes.")

    def predict_and_call(self, *args: Any, **kwargs: Any) -> Any:
        raise self._no_tools()

    async def apredict_and_call(self, *args: Any, **kwargs: Any) -> Any:
        raise self._no_tools()

    # -- translation -------------------------------------------------------------------
    def options(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """:class:`~cacheblend.config.RequestOptions` from the fields, with per-call
        overrides (``max_tokens`` and ``request_timeout`` as LlamaIndex names them;
        ``documents`` passes through).  A per-call None sets an option whose unset value is
        None (``max_risk=None``: no limit) and leaves any other at the field's value."""
        overrides = dict(overrides or {})
        documents = overrides.pop("documents", None)
        overrides = RequestOptions.per_call(overrides, _RENAMED, "CacheBlendLLM")
        opts = {name: getattr(self, name) for name in _FIELD_OPTIONS}
        opts |= {"max_new_tokens": self.max_tokens, "timeout": self.request_timeout, "stop": tuple(self.stop)}
        opts |= self.additional_kwargs | overrides
        return opts if documents is None else opts | {"documents": documents}

    @staticmethod
    def to_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
        """Messages as the engine's dicts; roles by the core's one table (tool and unknown
        roles refused), and a block that is not text refused rather than dropped."""
        out = []
        for i, m in enumerate(messages):
            if not isinstance(m, ChatMessage):
                raise CacheBlendError(f"message {i} must be a ChatMessage, got {type(m).__name__}")
            role = chat_role(m.role, f"CacheBlendLLM (message {i})")
            for block in m.blocks:
                if not isinstance(block, TextBlock):
                    kind = getattr(block, "block_type", type(block).__name__)
                    raise CacheBlendError(f"CacheBlendLLM takes text only; message {i} has a content block of "
                                          f"type {kind!r} ({type(block).__name__})")
            if calls := (m.additional_kwargs or {}).get("tool_calls"):  # its text alone would hide the calls
                raise CacheBlendError(f"CacheBlendLLM takes text only; message {i} carries tool_calls "
                                      f"({len(calls)}), which the engine's chat template cannot show")
            out.append({"role": role, "content": m.content or ""})
        return out

    def _start_chat(self, messages: list[dict[str, str]], kwargs: dict[str, Any]) -> GenerationRun:
        opts = self.options(kwargs)
        documents = document_texts(opts.pop("documents", None) or ())
        return self._engine.start_chat(messages, documents, **opts)

    def _start_completion(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> GenerationRun:
        if not isinstance(prompt, str):
            raise CacheBlendError(f"prompt must be a string, got {type(prompt).__name__}")
        to_prompt = self.completion_to_prompt or (lambda text: text)
        messages = [{"role": "user", "content": prompt if formatted else to_prompt(prompt)}]
        if self.system_prompt and not formatted:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self._start_chat(messages, kwargs)

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> CompletionResponse:
        result = finish(self._start_completion(prompt, formatted, kwargs))
        return CompletionResponse(text=result.text, raw=raw_of(result))

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        result = finish(self._start_chat(self.to_dicts(messages), kwargs))
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=result.text), raw=raw_of(result))

    # -- sync ----------------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        gen = self._start_completion(prompt, formatted, kwargs)  # bad input raises here
        return (CompletionResponse(text=t, delta=d, raw=r) for t, d, r in deltas(gen))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        gen = self._start_chat(self.to_dicts(messages), kwargs)
        return (ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=t), delta=d, raw=r)
                for t, d, r in deltas(gen))

    # -- async: the engine's work runs on worker threads, never on the event loop ----------
    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await run_in_thread(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        gen = await run_in_thread(self._start_completion, prompt, formatted, kwargs)

        async def responses() -> CompletionResponseAsyncGen:
            async for t, d, r in iterate_in_thread(lambda: deltas(gen)):
                yield CompletionResponse(text=t, delta=d, raw=r)

        return responses()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await run_in_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        gen = await run_in_thread(self._start_chat, self.to_dicts(messages), kwargs)

        async def responses() -> ChatResponseAsyncGen:
            async for t, d, r in iterate_in_thread(lambda: deltas(gen)):
                yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=t), delta=d, raw=r)

        return responses()
