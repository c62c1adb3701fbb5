"""Every ``kv_transfer_params`` field the vLLM connector reads is checked, and a bad one is
named: the check the HTTP guard answers 400 with and the connector's scheduler side logs
before running the request as plain vLLM.  No vLLM needed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cacheblend import CacheBlendError, RequestOptions
from cacheblend.integrations.kv_params import (
    KNOWN_FIELDS,
    check_kv_transfer_params,
    fit_prefix,
    fit_spans,
    parse_kv_params,
)

SELECTION = {"check_layers": [1], "deviation": "v", "gradual": False, "selection": "deviation", "chunk_heads": 0,
             "chunk_budget": "global", "probe_share": 1.0, "shift_share": 0.03, "max_risk": None}


@pytest.mark.parametrize("params, match", [
    ({"chunks": [[0, math.inf]]}, r"chunks\[0\] = \[0, inf\]: start and end must be integers"),
    ({"chunks": [[0, 1.5]]}, r"chunks\[0\].*integers"),
    ({"chunks": [["0", 4]]}, r"chunks\[0\].*integers"),
    ({"chunks": [[True, 4]]}, r"chunks\[0\].*integers"),
    ({"chunks": [[4, 4]]}, r"chunks\[0\] = \[4, 4\]: need 0 <= start < end"),
    ({"chunks": [[-1, 4]]}, r"chunks\[0\].*0 <= start < end"),
    ({"chunks": [[0, 5], [3, 8]]}, r"chunks\[1\] = \[3, 8\] starts before chunks\[0\] ends"),
    ({"chunks": [[5, 8], [0, 3]]}, "sorted and disjoint"),
    ({"chunks": [[0, 1, 2]]}, r"chunks\[0\] must be a \[start, end\] pair"),
    ({"chunks": [5]}, r"chunks\[0\] must be a \[start, end\] pair"),
    ({"chunks": "0-5"}, "chunks must be a list"),
    ({"chunks": {"0": 5}}, "chunks must be a list"),
    ({"cacheblend": "release", "ids": ["x"]}, "cacheblend='release' needs ids"),
    ({"cacheblend": "release", "ids": []}, "needs ids"),
    ({"cacheblend": "release", "ids": [-1]}, "needs ids"),
    ({"cacheblend": "release"}, "needs ids"),
    ({"cacheblend": "ingest"}, "cacheblend='ingest' needs sink"),
    ({"cacheblend": "ingest", "sink": -1}, "needs sink"),
    ({"cacheblend": "ingest", "sink": "1"}, "needs sink"),
    ({"cacheblend": "delete"}, r"cacheblend must be one of \('ingest', 'release', 'ping'\), got 'delete'"),
    ({"cacheblend": {"connector": "CacheBlendConnector"}}, "cacheblend must be one of"),
    ({"cacheblend": "ping", "chunks": [[0, 4]]}, r"\['chunks'\] do not go with cacheblend='ping'"),
    ({"cacheblend": "ingest", "sink": 1, "recompute_ratio": 0.5}, "do not go with cacheblend='ingest'"),
    ({"sink": 1}, r"\['sink'\] go only with an operation"),
    ({"ids": [1, 2]}, r"\['ids'\] go only with an operation"),
    ({"recompute_ratio": 1.5}, "recompute_ratio must be within"),
    ({"recompute_ratio": "most"}, "recompute_ratio"),
    ({"recompute_ratio": "auto"}, "'auto' needs the in-process Engine"),
    ({"quality_floor": -0.1}, "quality_floor"),
    ({"quality_floor": True}, "quality_floor"),
    ({"method": "prefix"}, r"method must be one of \('blend', 'reuse', 'full'\) with the vLLM connector"),
    ({"method": "fast"}, "method must be one of"),
    ({"check_layers": [99]}, r"check_layers \(99,\) out of range for a 30-layer model"),
    ({"check_layers": 5}, "check_layers must be a sequence"),
    ({"check_layers": [2, 1]}, "check_layers must be distinct, ascending"),
    ({"check_layers": [1.5]}, "check_layers must be integers"),
    ({"deviation": "q"}, "deviation must be one of"),
    ({"gradual": "false"}, "gradual must be True or False"),
    ({"selection": "random"}, "selection must be one of"),
    ({"chunk_heads": -1}, "chunk_heads"),
    ({"chunk_budget": "even"}, "chunk_budget"),
    ({"max_risk": 2}, "max_risk"),
    ({"prefix": 0}, r"prefix must be the number of prompt tokens \(an int >= 1\)"),
    ({"prefix": 2.5}, "prefix must be the number"),
    ({"prefix": True}, "prefix must be the number"),
    ({"prefix": 6, "chunks": [[5, 9]]}, "prefix of 6 tokens reaches into the first chunk, which starts at token 5"),
    ({"cacheblend": "ping", "prefix": 5}, r"\['prefix'\] do not go with cacheblend='ping'"),
    ({"receipt": "../../etc/passwd0000"}, "receipt must be a tag of 16 to 64 letters, digits"),
    ({"receipt": "short"}, "receipt must be a tag"),
    ({"receipt": 12345678901234567890}, "receipt must be a tag"),
    ({"cacheblend": "ping", "receipt": "a" * 32}, r"\['receipt'\] do not go with cacheblend='ping'"),
    ({"ratio": 0.2}, r"unknown fields \['ratio'\]; CacheBlendConnector reads chunks, prefix, cacheblend"),
    ({"temperature": 0.5}, r"unknown fields \['temperature'\]"),
    ([["chunks"]], "must be a JSON object, got list"),
    ("blend", "must be a JSON object, got str"),
])
def test_a_bad_field_is_named(params, match):
    with pytest.raises(CacheBlendError, match=match) as info:
        check_kv_transfer_params(params, num_layers=30)
    assert str(info.value).startswith("kv_transfer_params: ")


@pytest.mark.parametrize("params", [
    None, {}, {"cacheblend": "ping"}, {"cacheblend": "ingest", "sink": 0}, {"cacheblend": "release", "ids": [5, 6]},
    {"method": "full"}, {"method": "reuse", "chunks": [[1, 4]]}, {"chunks": []}, {"chunks": None},
    {"recompute_ratio": "guard", "max_risk": 0.0}, {"check_layers": [1, 29], "gradual": True},
    # what RemoteEngine sends
    {"method": "blend", "chunks": [[1, 4], [4, 9]], "recompute_ratio": 0.15, **SELECTION},
    {"method": "blend", "prefix": 40}, {"prefix": 40, "chunks": []},  # a chunkless chat's system instruction
    {"prefix": 3, "chunks": [[5, 9]]}, {"prefix": 5, "chunks": [[5, 9]]},  # a chat's system turn, then its lead
    {"chunks": [[1, 4]], "receipt": "0123456789abcdef0123456789abcdef"},  # a streamed request's tag
    {"method": "full", "receipt": "Ab-_" * 16},
    # vLLM's own keys pass
    {"prompt_token_ids": [1, 2], "do_remote_prefill": False, "do_remote_decode": True, "remote_host": "h"},
    {"cacheblend": "ping", "remote_engine_id": "x"},
])
def test_good_params_pass(params):
    check_kv_transfer_params(params, num_layers=30)


def test_parsed_hints_are_what_the_connector_uses():
    hints = parse_kv_params({"chunks": [[1, 4], (np.int64(6), 9)], "recompute_ratio": 0.3, "check_layers": [2]})
    assert hints.blends and hints.chunks == ((1, 4), (6, 9)) and hints.op is None
    assert hints.blend.recompute_ratio == 0.3 and hints.blend.check_layers == (2,)
    full = parse_kv_params({"method": "full"})
    assert not full.blends and full.blend.recompute_ratio == 0
    ingest = parse_kv_params({"cacheblend": "ingest", "sink": 1})
    assert (ingest.op, ingest.sink, ingest.blends) == ("ingest", 1, False)
    assert parse_kv_params({"cacheblend": "release", "ids": [7, 8]}).ids == (7, 8)
    assert parse_kv_params(None).chunks is None  # no spans: the connector searches the registry
    prefix = parse_kv_params({"prefix": np.int64(40)})
    assert (prefix.prefix, prefix.chunks, prefix.blends) == (40, (), True)  # the registry is not searched
    lead = parse_kv_params({"prefix": 3, "chunks": [[5, 9]]})
    assert (lead.prefix, lead.chunks) == (3, ((5, 9),))  # tokens 3 and 4 are the lead, computed
    assert parse_kv_params({"prefix": 3, "receipt": "t" * 16}).receipt == "t" * 16
    assert parse_kv_params({"chunks": [[1, 4]], "receipt": "t" * 16}).receipt == "t" * 16


def test_the_servers_defaults_are_the_base():
    base = RequestOptions.parse({"recompute_ratio": 0.4, "check_layers": [3]})
    assert parse_kv_params({}, base=base).blend.recompute_ratio == 0.4
    assert parse_kv_params({"recompute_ratio": 0.1}, base=base).blend.check_layers == (3,)
    with pytest.raises(CacheBlendError, match="out of range for a 2-layer model"):
        parse_kv_params({}, base=base, num_layers=2)
    parse_kv_params({"check_layers": [99]})  # the layer count unknown: left to the worker


def test_spans_must_end_before_the_last_prompt_token():
    assert fit_spans(((1, 3), (3, 9)), 10) == [(1, 3), (3, 9)]
    assert fit_spans((), 1) == []
    with pytest.raises(CacheBlendError, match="chunks end at token 10, past the last but one token of the "
                                              "10-token prompt"):
        fit_spans(((1, 10),), 10)


def test_a_prefix_must_end_before_the_last_prompt_token():
    assert fit_prefix(9, 10) == 9
    with pytest.raises(CacheBlendError, match="prefix of 10 tokens reaches past the last but one token of the "
                                              "10-token prompt"):
        fit_prefix(10, 10)


def test_every_field_the_docs_list_is_known():
    assert set(KNOWN_FIELDS) >= {"chunks", "prefix", "cacheblend", "sink", "ids", "method", "recompute_ratio",
                                 "quality_floor", *SELECTION}
