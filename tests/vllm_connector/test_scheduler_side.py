"""The connector's scheduler side, driven as vLLM's scheduler drives it, without vLLM: it
must never raise inside vLLM's step, never keep state for finished requests, and never
report tokens as loaded for a request that needs every position computed.  The whole
connector inside a real vLLM is tested in tests/vllm_connector."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from cacheblend.config import ConnectorConfig  # noqa: E402
from cacheblend.errors import CacheBlendError  # noqa: E402
from cacheblend.integrations.registry import ChunkMatcher, register_passages  # noqa: E402
from cacheblend.integrations.vllm_receipts import ReceiptBox  # noqa: E402
from cacheblend.integrations.vllm_scheduler import SchedulerSide  # noqa: E402
from cacheblend.prompt import PromptBuilder  # noqa: E402
from conftest import PASSAGES  # noqa: E402


def _side(model_dir, receipts: ReceiptBox | None = None, **extra) -> SchedulerSide:
    return SchedulerSide(ConnectorConfig.parse({"store": "memory", **extra}), model_dir=str(model_dir),
                         block_size=16, num_layers=30, chunk_sink="frame", connector="CacheBlendConnector",
                         receipts=receipts)


def _request(req_id: str, ids: list[int], params: dict | None = None, **kw) -> SimpleNamespace:
    """The fields of vLLM's ``Request`` the scheduler side reads."""
    return SimpleNamespace(request_id=req_id, prompt_token_ids=ids, kv_transfer_params=params,
                           sampling_params=SimpleNamespace(prompt_logprobs=kw.pop("prompt_logprobs", None),
                                                           extra_args=None), **kw)


def test_a_receipt_for_a_request_that_finished_already_is_not_kept(default_model_dir):
    """A request without kv_transfer_params, blended and finished in one step (one token):
    vLLM calls ``request_finished`` before it hands over the step's receipts, and the
    receipt used to stay in the scheduler's table for good."""
    side = _side(default_model_dir)
    request = _request("r1", list(range(100)), {"chunks": [[10, 50]]})
    assert side.loaded_tokens(request, 0) == 99
    plain = _request("r2", list(range(100)))
    side.finished(plain)
    side.take_receipts({"r2": {"exact": False}})
    marker = side.finished(request)
    side.take_receipts({"r1": {"exact": False}})
    assert marker is not None and marker["cacheblend"]["fidelity"] == {"exact": False}  # completed in place
    assert side.live_requests() == 0


def test_a_streamed_requests_marker_waits_for_its_client_with_the_workers_receipt(default_model_dir, tmp_path):
    """vLLM streams no kv_transfer_params back: a request tagged ``receipt`` has the marker
    it would have carried kept for the guard to serve, with the worker's receipt, also when
    that receipt comes after ``request_finished`` (a one-token answer)."""
    box = ReceiptBox(tmp_path / "receipts")
    side = _side(default_model_dir, receipts=box)
    one, two = "1" * 32, "2" * 32
    short = _request("s1", list(range(100)), {"chunks": [[10, 50]], "receipt": one})
    assert side.loaded_tokens(short, 0) == 99
    marker = side.finished(short)
    assert marker is not None and marker["cacheblend"]["receipts"] is True and box.take(one) is None  # not yet
    side.take_receipts({"s1": {"exact": False, "escalated": True}})
    assert box.take(one) == marker and marker["cacheblend"]["fidelity"]["escalated"] is True
    long = _request("s2", list(range(100)), {"chunks": [[10, 50]], "receipt": two})
    side.loaded_tokens(long, 0)
    side.take_receipts({"s2": {"exact": True}})  # blended, then decoding: the receipt came first
    assert side.finished(long) == box.take(two) and box.take(two) is None
    side.finished(_request("s3", list(range(100)), {"chunks": [[10, 50]]}))  # untagged: nothing kept
    side.take_receipts({})
    assert list(box.folder.iterdir()) == [] and side.live_requests() == 0
    plain = _side(default_model_dir).finished(_request("s4", list(range(100)), {"receipt": one}))
    assert plain is not None and plain["cacheblend"]["receipts"] is False  # RemoteEngine then tags nothing


def test_a_chunkless_prompt_with_a_prefix_has_it_loaded_from_the_prefix_cache(default_model_dir, caplog):
    """A chat without passages whose system instruction RemoteEngine names as ``prefix``:
    the connector provides the prompt's K/V (the prefix read exactly, the rest computed);
    a prefix that reaches the last token runs the request as plain vLLM."""
    side = _side(default_model_dir)
    request = _request("p1", list(range(100)), {"prefix": 60})
    assert side.loaded_tokens(request, 0) == 99
    side.after_alloc(request, 99)
    (load,) = side.build_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="p1", block_ids=([0, 1, 2, 3, 4, 5, 6],))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[]))).loads
    assert (load.spans, load.prefix, load.start) == ([], 60, 0)
    marker = side.finished(request)
    side.take_receipts({"p1": {"exact": True}})
    assert marker is not None and marker["cacheblend"]["chunks"] == 0
    assert marker["cacheblend"]["fidelity"] == {"exact": True}  # completed in place, as a blend's
    with caplog.at_level(logging.WARNING):
        assert side.loaded_tokens(_request("p2", list(range(100)), {"prefix": 100}), 0) == 0
    assert "prefix of 100 tokens reaches past" in caplog.text
    side.finished(_request("p2", list(range(100)), {"prefix": 100}))
    assert side.live_requests() == 0


@pytest.mark.parametrize("what", ["prompt_logprobs", "skip_reading_prefix_cache"])
def test_a_request_that_needs_every_position_computed_gets_nothing_loaded(default_model_dir, what):
    """vLLM computes every prompt position itself for prompt logprobs (``echo`` scoring) and
    pooling; the connector reported n - 1 tokens loaded for them."""
    side = _side(default_model_dir)
    kw = {"prompt_logprobs": 1} if what == "prompt_logprobs" else {"skip_reading_prefix_cache": True}
    assert side.loaded_tokens(_request("r", list(range(100)), {"chunks": [[10, 50]]}, **kw), 0) == 0
    assert side.loaded_tokens(_request("s", list(range(100)), {"chunks": [[10, 50]]}), 0) == 99


def test_a_registry_that_cannot_be_read_runs_requests_as_plain_vllm(default_model_dir, tmp_path, caplog):
    """A Redis registry that is down raised out of the scheduler, which stops vLLM's engine."""
    side = _side(default_model_dir, passages="redis://127.0.0.1:1/0")
    with caplog.at_level(logging.WARNING, logger="vllm.cacheblend"):
        assert side.loaded_tokens(_request("r", list(range(200))), 0) == 0
    assert "cannot be read" in caplog.text


def test_a_registry_read_before_survives_a_later_failure(default_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    import cacheblend.integrations.registry as registry

    prompts = PromptBuilder(AutoTokenizer.from_pretrained(str(default_model_dir)))
    path = tmp_path / "passages.jsonl"
    register_passages(path, PASSAGES[:1])
    matcher = ChunkMatcher(prompts.encode, prompts.chunk_separator, path)
    matcher.refresh()
    ids = prompts.encode("Question first.\n\n" + PASSAGES[0] + prompts.chunk_separator + "Then the end.")
    found = matcher.find(ids)

    def broken(*args, **kwargs):
        raise OSError("the file is being replaced")

    monkeypatch.setattr(registry, "read_passages", broken)
    path.write_text(path.read_text() + '"another passage"\n')  # changed: the next refresh reads it
    matcher.refresh()
    assert found and matcher.find(ids) == found


def test_without_a_registry_no_tokenizer_is_loaded_in_the_scheduler(default_model_dir, monkeypatch):
    """Only a registry needs the matcher (and its tokenizer, loaded inside vLLM's step)."""
    import cacheblend.integrations.vllm_scheduler as scheduler

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("a tokenizer was loaded")

    monkeypatch.setattr(scheduler.AutoTokenizer, "from_pretrained", no_tokenizer)
    assert _side(default_model_dir).loaded_tokens(_request("r", list(range(200))), 0) == 0


def test_with_vllms_prefix_caching_on_blending_is_off(default_model_dir, caplog):
    """vLLM keeps the blocks a request computed, external ones included, in its prefix cache:
    blended K/V would be reused as exact by later requests, ``method="full"`` ones too.
    Only the docs said to turn it off; offline ``LLM`` turns it on by default."""
    with caplog.at_level(logging.WARNING, logger="vllm.cacheblend"):
        side = SchedulerSide(ConnectorConfig.parse({"store": "memory"}), model_dir=str(default_model_dir),
                             block_size=16, num_layers=30, chunk_sink="frame", connector="CacheBlendConnector",
                             prefix_caching=True)
    assert side.loaded_tokens(_request("r", list(range(100)), {"chunks": [[10, 50]]}), 0) == 0
    assert "prefix caching" in caplog.text


@pytest.mark.parametrize("field, value", [("lora_request", object()), ("prompt_embeds", object()),
                                          ("pooling_params", object())])
def test_a_request_whose_kv_is_not_the_base_models_is_never_blended_nor_saved(default_model_dir, field, value):
    """A LoRA adapter's K/V are not the base model's chunk caches (and an ingest under one
    stored the adapter's K/V under the base model's key); embeddings in a prompt sit where
    its ids hold placeholders; vLLM cannot pool a request it computed one token of."""
    side = _side(default_model_dir)
    assert side.loaded_tokens(_request("r", list(range(100)), {"chunks": [[10, 50]]}, **{field: value}), 0) == 0
    for extra in ({field: value}, {}):
        ingest = _request("i", list(range(100)), {"cacheblend": "ingest", "sink": 3}, **extra)
        side.after_alloc(ingest, 0)
        new = SimpleNamespace(req_id="i", prompt_token_ids=list(range(100)), block_ids=[list(range(7))],
                              num_computed_tokens=0)
        meta = side.build_meta(SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"i": 100},
                                               scheduled_cached_reqs=SimpleNamespace(req_ids=[])))
        assert len(meta.saves) == (0 if extra else 1)  # saved for the base model only
        side.finished(ingest)


def test_a_server_with_lora_or_a_pooling_model_runs_as_plain_vllm(default_model_dir, caplog):
    """With LoRA on, the layers the worker adopts are LoRA wrappers that apply the step's
    adapter mapping to any rows; a pooling model scores whole prompts."""
    from cacheblend.integrations.vllm import _unsupported

    model = SimpleNamespace(runner_type="generate")
    assert _unsupported(SimpleNamespace(lora_config=None, model_config=model)) is None
    assert "LoRA" in _unsupported(SimpleNamespace(lora_config=object(), model_config=model))
    assert "pooling" in _unsupported(SimpleNamespace(lora_config=None, model_config=SimpleNamespace(
        runner_type="pooling")))
    with caplog.at_level(logging.WARNING, logger="vllm.cacheblend"):
        side = SchedulerSide(ConnectorConfig.parse({"store": "memory"}), model_dir=str(default_model_dir),
                             block_size=16, num_layers=30, chunk_sink="frame", connector="CacheBlendConnector",
                             unsupported="LoRA is enabled")
    assert side.loaded_tokens(_request("r", list(range(100)), {"chunks": [[10, 50]]}), 0) == 0
    assert "blending is OFF" in caplog.text and "LoRA" in caplog.text


def test_a_stats_file_that_cannot_be_written_never_stops_the_engine(tmp_path, caplog):
    """The load's stats line was appended outside the step's error handling: a full disk or
    a removed folder raised inside ``start_load_kv``, which stops vLLM's engine."""
    from cacheblend.integrations.vllm_worker import append_stats

    with caplog.at_level(logging.WARNING, logger="vllm.cacheblend"):
        append_stats(str(tmp_path / "gone" / "stats.jsonl"), {"op": "load"})
    assert "cannot append to the stats file" in caplog.text
    append_stats(str(tmp_path / "stats.jsonl"), {"op": "load"})
    assert (tmp_path / "stats.jsonl").read_text() == '{"op": "load"}\n'


def test_a_registry_that_cannot_be_read_is_not_asked_again_for_every_request(default_model_dir, tmp_path, monkeypatch,
                                                                              caplog):
    """The matcher refreshes on vLLM's scheduler thread for each new request: a Redis
    registry that stopped answering cost every request its 2 s timeout, all running
    requests waiting meanwhile."""
    import cacheblend.integrations.registry as registry

    asked: list[int] = []

    def down(*args, **kwargs):
        asked.append(1)
        raise TimeoutError("Timeout reading from 10.0.0.9:6379")

    monkeypatch.setattr(registry, "_registry_version", down)
    matcher = ChunkMatcher(str, "\n\n", "redis://10.0.0.9:6379/0")
    with caplog.at_level(logging.WARNING, logger="vllm.cacheblend"):
        for _ in range(5):
            matcher.refresh()
    assert len(asked) == 1 and "asking again in 5 s" in caplog.text
    monkeypatch.setattr(registry, "RETRY_AFTER_S", 0.0)  # the back-off has passed
    matcher.refresh()
    assert len(asked) == 2


def _step(side: SchedulerSide) -> None:
    """vLLM's end of a scheduling pass: the step's metadata is built (nothing new scheduled)."""
    side.build_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                    scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(),
                                                                          new_block_ids=[])))


def test_a_burst_of_blends_is_spread_over_steps_by_the_blend_budget(default_model_dir):
    """A blended request costs vLLM one scheduled token, but its fused prefill runs before
    the step's forward: three at once run in one step and hold every running decode for all
    three.  With ``max_blend_tokens``, a blend past the step's budget waits (None: vLLM asks
    again next step); the first blend of a step always runs, a plain request is never held,
    and without the option nothing is held."""
    side = _side(default_model_dir, max_blend_tokens=250)
    burst = [_request(f"b{i}", list(range(100)), {"chunks": [[10, 50]]}) for i in range(3)]
    assert side.loaded_tokens(burst[0], 0) == 99
    side.after_alloc(burst[0], 99)
    assert side.loaded_tokens(burst[1], 0) == 99  # 200 of 250
    side.after_alloc(burst[1], 99)
    assert side.loaded_tokens(burst[2], 0) is None  # 300 > 250: next step
    assert side.loaded_tokens(_request("plain", list(range(100))), 0) == 0  # not a blend: never held
    _step(side)
    assert side.loaded_tokens(burst[2], 0) == 99
    side.after_alloc(burst[2], 99)
    big = _request("big", list(range(400)), {"chunks": [[10, 300]]})
    assert side.loaded_tokens(big, 0) is None
    _step(side)
    assert side.loaded_tokens(big, 0) == 399  # alone in its step, though over the budget
    one, unbounded = _side(default_model_dir, max_blend_tokens=1), _side(default_model_dir)
    assert one.loaded_tokens(burst[0], 0) == 99
    one.after_alloc(burst[0], 99)
    assert one.loaded_tokens(burst[1], 0) is None  # one blend per step
    for req in burst:  # the default: no bound
        assert unbounded.loaded_tokens(req, 0) == 99
        unbounded.after_alloc(req, 99)
    for each in (side, one, unbounded):
        for req in [*burst, _request("plain", list(range(100))), big]:
            each.finished(req)
        each.take_receipts({})
        assert each.live_requests() == 0


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "100"])
def test_a_bad_step_budget_is_refused_by_name(value):
    with pytest.raises(CacheBlendError, match="max_blend_tokens must be a positive int"):
        ConnectorConfig.parse({"max_blend_tokens": value})
