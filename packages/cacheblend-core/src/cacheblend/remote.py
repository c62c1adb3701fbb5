"""``RemoteEngine``: the engine's chat interface, answered by a vLLM server with CacheBlend.

When one process is not enough, the model runs in ``vllm serve`` with
:class:`~cacheblend.integrations.vllm.CacheBlendConnector` and the chunk caches live in a
store the servers share (disk, Redis).  This client is what the framework adapters
(``ChatCacheBlend(base_url=...)``, ``CacheBlendLLM(base_url=...)``) use instead of the
in-process :class:`~cacheblend.engine.Engine`: it lays the chat out exactly as the engine
does (:mod:`cacheblend.chat`, the same passage index and tokenizer, so a chunk gets the same
token ids and hence the same cache), sends the prompt's token ids to the server's
OpenAI-compatible ``/v1/completions`` with the chunks' spans in ``kv_transfer_params``,
and streams the answer back.  The chat template is applied here, not by the server, because
the spans must index the very ids the server sees.

Ingestion goes through the server too: each chunk is sent once, behind the chunk sink, as
an ``{"cacheblend": "ingest"}`` request, and the connector stores the K/V *vLLM* computed
for it.  The model's tokenizer must be loadable here (``tokenizer=``; by default the
folder the server reports as the model's root, or the model id)."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

from .aio import raise_if_cancelled
from .backend import Answering, check_request
from .cache.keys import chunk_key
from .chat import HeadMemory, chunk_spans, plan_chat
from .config import CHUNK_SINKS, METHODS, SELECTION_FIELDS, EngineConfig, RequestOptions
from .errors import CacheBlendError
from .integrations.vllm_receipts import RECEIPT_HEADER, RECEIPT_WAIT_S
from .integrations.vllm_server import GUARD_MIDDLEWARE
from .passages import PassageIndex
from .prompt import PromptBuilder, PromptIds
from .results import BlendStats, ChunkHandle, Result

REMOTE_METHODS = ("blend", "reuse", "full")  # "prefix" is vLLM's own prefix caching, off with the connector
_SHARED: dict[tuple, RemoteEngine] = {}
_SHARED_LOCK = threading.Lock()
_KEY_LOCKS: dict[tuple, threading.Lock] = {}

log = logging.getLogger(__name__)


class RemoteGeneration:
    """One streamed answer: iterate ``pieces`` for text, then read ``result``."""

    def __init__(self, stream_fn: Callable[[], Any], stats: BlendStats, t0: float,
                 timeout: float | None = None,
                 receipt: Callable[[float | None], dict | None] | None = None) -> None:
        self.stats = stats
        self._receipt = receipt  # fetches the server's receipt once the stream has ended
        self.result: Result | None = None
        self._t0 = t0
        self._deadline = None if timeout is None else t0 + timeout
        self.pieces: Generator[str, None, None] = self._pieces(stream_fn)

    def _pieces(self, stream_fn: Callable[[], Any]) -> Generator[str, None, None]:
        from openai import APITimeoutError, BadRequestError

        try:
            stream = stream_fn()
        except BadRequestError as e:  # bad input, as the engine's own checks raise it: never retried
            said = e.body.get("message") if isinstance(e.body, dict) else None
            raise CacheBlendError(f"the server refused the request: {said or e.message}") from e
        except APITimeoutError as e:  # the request's timeout, as the engine raises it (not an openai error)
            raise TimeoutError("the request's timeout ran out before the server answered") from e
        try:
            yield from self._read(stream)
        except APITimeoutError as e:
            raise TimeoutError("the request's timeout ran out while the server answered") from e

    def _read(self, stream: Any) -> Generator[str, None, None]:
        """The stream's text pieces; then ``result``, with the server's receipt."""
        text, ttft, finish, usage = "", None, "length", None
        try:
            for chunk in stream:
                raise_if_cancelled()  # a cancelled async call closes the stream (below): vLLM stops decoding
                if self._deadline is not None and time.perf_counter() > self._deadline:
                    raise TimeoutError("the request's timeout ran out while the server answered")
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    if ttft is None:
                        ttft = time.perf_counter() - self._t0
                    if choice.finish_reason:
                        finish = choice.finish_reason
                    if choice.text:
                        text += choice.text
                        yield choice.text
        finally:
            stream.close()  # an abandoned stream stops decoding on the server
        s = self.stats
        s.seconds["ttft"] = ttft or 0.0
        s.seconds["total"] = time.perf_counter() - self._t0  # the answer's, not the receipt's round trip
        fidelity = self._receipt(self._deadline) if self._receipt is not None else None
        if fidelity:
            try:
                s.adopt_receipt(fidelity)
            except ValueError as e:  # a damaged receipt: the answer stands, with what was asked for
                log.warning("the server's receipt of an answer is malformed (%s); keeping the asked-for one", e)
        if usage is not None:
            s.prompt_tokens, s.new_tokens = usage.prompt_tokens, usage.completion_tokens
        s.computed_tokens = s.prompt_tokens - s.reused_tokens - s.recomputed_tokens
        self.result = Result(text=text, token_ids=[], ttft_s=ttft or 0.0, stats=s, finish_reason=finish)


class RemoteEngine(Answering):
    """Chat with CacheBlend on a vLLM server (``vllm serve MODEL --kv-transfer-config
    '{"kv_connector": "CacheBlendConnector", ...}'``, see docs/vllm.md).

    >>> engine = RemoteEngine("http://127.0.0.1:8000/v1")
    >>> engine.ingest(["Paris is the capital of France."])
    >>> engine.start_chat([{"role": "user", "content": "Capital of France?"}],
    ...                   documents=["Paris is the capital of France."])
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        tokenizer: str | os.PathLike | None = None,
        timeout: float = 600.0,
        max_retries: int = 2,
    ) -> None:
        from openai import APIConnectionError, OpenAI
        from transformers import AutoTokenizer

        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise CacheBlendError(f"base_url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
        self.base_url = base_url
        self.client = OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY",
                             timeout=timeout, max_retries=max_retries)
        try:
            cards = {c.id: c for c in self.client.models.list().data}
        except APIConnectionError as e:
            raise ConnectionError(f"no OpenAI-compatible server answers at {base_url}: {e}") from e
        if model is None and cards:
            model = next(iter(cards))
        if model not in cards:
            raise CacheBlendError(f"the server at {base_url} serves {sorted(cards)}, not {model!r}")
        card = cards[model]
        self.model_name: str = model
        extra = card.model_extra or {}
        self.context_length: int = int(extra.get("max_model_len") or 0) or 2048
        source = tokenizer or extra.get("root") or model
        self.tokenizer = AutoTokenizer.from_pretrained(str(source))
        self.prompts = PromptBuilder(self.tokenizer)
        self.passages = PassageIndex()
        self.heads = HeadMemory()  # system-message openings seen before: the fixed instruction
        self.config = EngineConfig()
        self.chunk_sink, self._exact_behind_sink, self._receipts = self._check_connector()
        self._sink = self.prompts.sink_ids(self.chunk_sink)

    @classmethod
    def shared(cls, base_url: str, model: str | None = None, *, api_key: str | None = None,
               **options: Any) -> RemoteEngine:
        """One client per server, model and key in this process, so that every adapter
        object on that server sees the passages any of them ingested (as ``Engine.shared``)."""
        key = (base_url, model, api_key, tuple(sorted(options.items())))
        with _SHARED_LOCK:  # held for a dict lookup only: a client is built under its key's own lock,
            lock = _KEY_LOCKS.setdefault(key, threading.Lock())  # so one server that does not answer
        with lock:  # (its model list, the tokenizer) never holds up clients of the others
            if key not in _SHARED:
                _SHARED[key] = cls(base_url, model, api_key=api_key, **options)
            return _SHARED[key]

    # -- ingestion -------------------------------------------------------------------
    def _op(self, ids: list[int], params: dict[str, Any]) -> dict[str, Any]:
        """Send a one-token request carrying ``params``; the connector's answer."""
        reply = self.client.completions.create(model=self.model_name, prompt=ids, max_tokens=1, temperature=0.0,
                                               extra_body={"kv_transfer_params": params})
        answer = (reply.model_extra or {}).get("kv_transfer_params") or {}
        return answer.get("cacheblend") or {}

    def _check_connector(self) -> tuple[str, bool, bool]:
        """Without the connector a vLLM server ignores our parameters and answers with
        full prefill, silently: refuse such a server up front.  Returns the server's chunk
        sink, which ingestion must use (the connector refuses chunks behind another),
        whether the worker reuses a chunk right behind that sink exactly (for the receipt),
        and whether it keeps streamed requests' receipts for their clients."""
        answer = self._op(self.prompts.sink_ids("bos"), {"cacheblend": "ping"})
        if answer.get("connector") != "CacheBlendConnector":
            raise CacheBlendError(
                f"the server at {self.base_url} answers but does not run CacheBlendConnector; start vLLM with "
                "--kv-transfer-config (cacheblend.integrations.vllm_server.kv_transfer_config, docs/vllm.md)")
        sink = answer.get("chunk_sink", "bos")
        if sink not in CHUNK_SINKS:
            raise CacheBlendError(f"the server at {self.base_url} names an unknown chunk sink {sink!r}")
        return str(sink), answer.get("exact_behind_sink") is True, answer.get("receipts") is True

    def _fetch_receipt(self, tag: str, deadline: float | None = None) -> dict | None:
        """The worker's receipt of the streamed request tagged ``tag`` (the guard middleware
        serves it: vllm_receipts.py), fetched within the request's ``deadline``; None if the
        server has none to give.  Nothing raises: the answer has been given already."""
        from openai import NotFoundError

        wait = RECEIPT_WAIT_S + 5.0  # the guard waits that long for a receipt written late
        if deadline is not None:
            wait = min(wait, deadline - time.perf_counter())
            if wait <= 0:
                return None
        try:
            answer = self.client.get(f"/cacheblend/receipts/{tag}", cast_to=object,
                                     options={"max_retries": 0, "timeout": wait})
        except NotFoundError as e:
            if e.response.headers.get(RECEIPT_HEADER) is None:
                # Not the guard's 404: vLLM runs without the middleware that serves receipts,
                # so each tag would leave a file nobody fetches: stop tagging requests.
                log.info("%s keeps no receipts for streamed answers (vLLM started without --middleware %s?); "
                         "answers carry the receipt of what was asked for", self.base_url, GUARD_MIDDLEWARE)
                self._receipts = False
            else:  # the guard has none (the worker could not write it): this answer keeps the asked-for one
                log.debug("no receipt for %s on %s", tag, self.base_url)
            return None
        except Exception as e:  # noqa: BLE001 - gone, a timeout, a body that is not JSON: the asked-for receipt stands
            log.debug("no receipt for %s from %s: %s", tag, self.base_url, e)
            return None
        marker = answer.get("cacheblend") if isinstance(answer, dict) else None
        fidelity = marker.get("fidelity") if isinstance(marker, dict) else None
        return fidelity if isinstance(fidelity, dict) else None

    def ingest(self, texts: Iterable[str] | str) -> list[ChunkHandle]:
        """Have the server compute and store each chunk's KV (vLLM's own, saved by the
        connector); chunks already stored cost one short request.  A handle's ``key`` is
        the hash of the chunk's token ids (the store key also holds the model fingerprint,
        which only the server knows)."""
        if isinstance(texts, str):
            texts = [texts]
        handles = []
        for text in texts:
            try:
                ids = self.prompts.chunk_ids(text)
            except ValueError as e:
                raise CacheBlendError(str(e)) from e
            self._op(self._sink + ids, {"cacheblend": "ingest", "sink": len(self._sink)})
            self.passages.add(text)
            handles.append(ChunkHandle(key=chunk_key("", ids, ""), num_tokens=len(ids), token_ids=tuple(ids)))
        return handles

    def release(self, chunks: Iterable[ChunkHandle | str] | ChunkHandle | str) -> int:
        """Forget passages (texts, or handles from :meth:`ingest`) here and have the server
        delete their caches; returns how many deletions were sent (whether an entry existed
        is known only to the server)."""
        if isinstance(chunks, (str, ChunkHandle)):
            chunks = [chunks]
        sent = 0
        for chunk in chunks:
            if isinstance(chunk, str):
                self.passages.discard(chunk)
                ids = self.prompts.chunk_ids(chunk)
            elif isinstance(chunk, ChunkHandle) and chunk.token_ids:
                ids = list(chunk.token_ids)
            else:
                raise CacheBlendError(f"release takes passage texts or ChunkHandles, got {type(chunk).__name__}")
            self._op(self._sink, {"cacheblend": "release", "ids": ids})
            sent += 1
        return sent

    # -- answering -------------------------------------------------------------------
    def start(
        self,
        query: str,
        chunks: Sequence[ChunkHandle | str] | ChunkHandle | str = (),
        *,
        system: str | None = None,
        preamble: str = "",
        **options: Any,
    ) -> RemoteGeneration:
        """As :meth:`Engine.start`: ``[system][preamble][chunk 1]…[chunk k][query]``, with
        each chunk's span sent to the server, whose connector reuses its cache."""
        t0 = time.perf_counter()
        check_request(query, system, preamble)
        if isinstance(chunks, (str, ChunkHandle)):
            chunks = [chunks]
        ids = [self._chunk_ids(c) for c in chunks]
        return self._send(self.prompts.build(query, ids, system, preamble), 0, options, t0)

    def _chunk_ids(self, chunk: ChunkHandle | str) -> list[int]:
        if isinstance(chunk, str):
            if not chunk.strip():
                raise CacheBlendError("a chunk must be a non-empty string")
            self.passages.add(chunk)
            return self.prompts.chunk_ids(chunk)
        if isinstance(chunk, ChunkHandle) and chunk.token_ids:
            return list(chunk.token_ids)
        raise CacheBlendError(f"chunks take ChunkHandle or str, got {type(chunk).__name__}")

    def start_chat(
        self,
        messages: Sequence[dict[str, str]],
        documents: Sequence[str] = (),
        **options: Any,
    ) -> RemoteGeneration:
        """As :meth:`Engine.start_chat` (options: :class:`RequestOptions`); the request is
        sent when ``pieces`` is first read.  Passages the server has not stored yet are
        computed there and stored (the connector's store lookups), so learning needs
        nothing more here."""
        t0 = time.perf_counter()
        opts = RequestOptions.parse(options)
        plan = plan_chat(self.prompts, self.passages, messages, documents, learn=opts.learn,
                         learn_min_chars=self.config.learn_min_chars, heads=self.heads)
        return self._send(plan.prompt, len(plan.learned), opts, t0)

    def _send(self, prompt: PromptIds, learned: int, options: RequestOptions | dict[str, Any],
              t0: float) -> RemoteGeneration:
        """The completion request for ``prompt``'s token ids, with its chunk spans and the
        selection in ``kv_transfer_params``; streamed when ``pieces`` is first read."""
        opts = options if isinstance(options, RequestOptions) else RequestOptions.parse(options)
        if opts.method not in REMOTE_METHODS:
            raise CacheBlendError(f"method must be one of {REMOTE_METHODS} with a vLLM server "
                                  f"(of the engine's {METHODS}), got {opts.method!r}")
        if opts.auto:
            raise CacheBlendError("recompute_ratio='auto' (the loading controller) needs the in-process Engine")
        blend, sampling = opts.blend(), opts.sampling()
        ids = prompt.all_ids
        if len(ids) >= self.context_length:
            raise CacheBlendError(f"prompt of {len(ids)} tokens does not fit the server's context of "
                                  f"{self.context_length} tokens")
        # vLLM refuses a prompt whose answer could outgrow the context; the engine's rule: the answer stops there
        budget = min(sampling.max_new_tokens, self.context_length - len(ids))
        spans = chunk_spans(prompt) if opts.method != "full" else []
        # the prompt's prefix, read by the worker from the prefix cache: what comes before
        # the first user message's content (a chat's lead is computed: :func:`chat.layout`),
        # or a chunkless chat's system instruction.  The worker computes
        # the rest inside one step, holding up every other request's decode, so a chunkless
        # prompt whose rest is longer than its prefix is left to vLLM's own chunked prefill.
        head = len(prompt.prefix) if opts.method != "full" else 0
        lead = bool(spans) and head < spans[0][0]  # the prefix is sent: it is not all before the first chunk
        if not spans and 2 * head < len(ids):
            head = 0
        if spans and not lead and self._exact_behind_sink and ids[:head] == list(self._sink):
            head = spans[0][1]  # and the first chunk, right behind the sink: reused exactly
        chunk_tokens = sum(b - a for a, b in spans if a >= head)  # reused approximately
        recomputed = round(blend.recompute_ratio * chunk_tokens) if not blend.gradual else 0
        stats = BlendStats(method=opts.method, recompute_ratio=blend.recompute_ratio, prompt_tokens=len(ids),
                           reused_tokens=chunk_tokens - recomputed + head, recomputed_tokens=recomputed,
                           chunks=len(spans), chunks_learned=learned, exact_cached_tokens=head,
                           approximate_tokens=chunk_tokens - recomputed)
        # The receipt of what was asked for; the worker's replaces it once the stream ends
        # (where the server keeps receipts: vLLM streams no kv_transfer_params back).
        stats.exact = not chunk_tokens or blend.recompute_ratio >= 1.0
        stats.ratio_used = 1.0 if head and not chunk_tokens else blend.recompute_ratio  # as the worker's
        stats.risk = 0.0 if stats.exact else None
        params: dict[str, Any] = {"method": opts.method}
        if head and (lead or not spans):
            params["prefix"] = head
        if spans:
            params |= {"chunks": [list(s) for s in spans], "recompute_ratio": blend.recompute_ratio,
                       **{f: getattr(blend, f) for f in SELECTION_FIELDS}}
            params["check_layers"] = list(blend.check_layers)
        # the worker's receipt, where it loads anything (else what was asked for is exact)
        tag = uuid.uuid4().hex if self._receipts and (spans or "prefix" in params) else None
        if tag:
            params["receipt"] = tag

        def stream():
            # with a timeout, one try within the time left (openai would retry each with the whole
            # timeout again); the stream's reads wait at most that long too
            client = self.client if opts.timeout is None else self.client.with_options(
                max_retries=0, timeout=max(0.001, t0 + opts.timeout - time.perf_counter()))
            return client.completions.create(
                model=self.model_name, prompt=ids, max_tokens=budget,
                temperature=sampling.temperature, top_p=sampling.top_p, seed=_int64(sampling.seed),
                stop=list(sampling.stop) or None, stream=True,
                stream_options={"include_usage": True},
                extra_body={"kv_transfer_params": params, "ignore_eos": sampling.ignore_eos})

        return RemoteGeneration(stream, stats, t0, opts.timeout,
                                receipt=(lambda deadline: self._fetch_receipt(tag, deadline)) if tag else None)


def _int64(seed: int | None) -> int | None:
    """A seed as vLLM takes it (a signed 64-bit int): the engine takes any 64-bit pattern,
    signed or not, and a seed of 2**63 or more was refused by the server after the call
    began.  The same bits, read as signed, keep distinct seeds distinct."""
    return seed - 2**64 if seed is not None and seed >= 2**63 else seed
