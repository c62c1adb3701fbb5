"""What the two adapters take from the caller, and that they take it the same way: roles,
content blocks, per-call options (None, stop=[], per-call timeouts), documents, construction
checks, and chat templates that refuse a conversation.  Real default model, short answers."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_cacheblend")
pytest.importorskip("llama_index.llms.cacheblend")

from langchain_cacheblend import ChatCacheBlend  # noqa: E402
from langchain_cacheblend.messages import chat_messages  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage  # noqa: E402
from langchain_core.messages import ChatMessage as LCChatMessage  # noqa: E402
from llama_index.core import Document as LIDocument  # noqa: E402
from llama_index.core.base.llms.types import ChatMessage, ImageBlock, MessageRole, TextBlock  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402
from llama_index.llms.cacheblend import CacheBlendLLM, CacheBlendSynthesizer  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from cacheblend import CacheBlendError  # noqa: E402
from cacheblend.prompt import chat_role  # noqa: E402

pytestmark = pytest.mark.slow

STRICT = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('System message must be first') }}{% endif %}"
          "<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>")


@pytest.fixture
def calls(default_engine, monkeypatch):
    """What the engine's ``start_chat`` and ``start`` were called with (they still run)."""
    seen: list[dict] = []
    start_chat, start = default_engine.start_chat, default_engine.start

    def spy_chat(messages, documents=(), **opts):
        seen.append({"messages": messages, "documents": list(documents), **opts})
        return start_chat(messages, documents, **opts)

    def spy(query, chunks=(), **opts):
        seen.append({"query": query, **opts})
        return start(query, chunks, **opts)

    monkeypatch.setattr(default_engine, "start_chat", spy_chat)
    monkeypatch.setattr(default_engine, "start", spy)
    return seen


def test_a_chat_template_that_refuses_the_roles_is_bad_input_not_retried(default_engine, calls, monkeypatch):
    monkeypatch.setattr(default_engine.prompts.tokenizer, "chat_template", STRICT)
    lc = ChatCacheBlend(engine=default_engine, max_tokens=2, max_retries=2)
    with pytest.raises(CacheBlendError, match=r"roles \['user', 'assistant', 'system', 'user'\]: System message"):
        lc.invoke([HumanMessage("a"), AIMessage("b"), SystemMessage("c"), HumanMessage("d")])
    assert len(calls) == 1  # no retry of bad input
    li = CacheBlendLLM(engine=default_engine, max_tokens=2)
    with pytest.raises(CacheBlendError, match="System message must be first"):
        li.chat([ChatMessage(role="user", content="a"), ChatMessage(role="system", content="c")])


def test_one_role_policy_in_both_adapters():
    lc = chat_messages([LCChatMessage(role="developer", content="d"), LCChatMessage(role="human", content="h"),
                        LCChatMessage(role="ai", content="a"), SystemMessage("s"), HumanMessage("u"), AIMessage("x")])
    assert [m["role"] for m in lc] == ["system", "user", "assistant", "system", "user", "assistant"]
    li = CacheBlendLLM.to_dicts([ChatMessage(role=r, content="t") for r in (
        MessageRole.DEVELOPER, MessageRole.SYSTEM, MessageRole.USER, MessageRole.ASSISTANT, MessageRole.MODEL)])
    assert [m["role"] for m in li] == ["system", "system", "user", "assistant", "assistant"]
    for bad in ([ToolMessage("42", tool_call_id="1")], [LCChatMessage(role="function", content="42")]):
        with pytest.raises(CacheBlendError, match="message: tool calling is not supported"):
            chat_messages(bad)
    for role in (MessageRole.TOOL, MessageRole.FUNCTION):
        with pytest.raises(CacheBlendError, match=f"'{role.value}' message: tool calling is not supported"):
            CacheBlendLLM.to_dicts([ChatMessage(role="user", content="q"), ChatMessage(role=role, content="42")])
    with pytest.raises(CacheBlendError, match="unknown message role 'wizard'"):
        chat_messages([LCChatMessage(role="wizard", content="w")])
    with pytest.raises(CacheBlendError, match=r"AI message with tool calls.*\['lookup'\]"):
        chat_messages([HumanMessage("q"), AIMessage("", tool_calls=[{"name": "lookup", "args": {}, "id": "1"}])])
    with pytest.raises(CacheBlendError, match="unknown message role 'wizard'"):
        chat_role("wizard", "CacheBlendLLM")


def test_llamaindex_refuses_non_text_blocks_and_joins_text_blocks():
    message = ChatMessage(role="user", blocks=[TextBlock(text="Describe"), ImageBlock(url="http://x/y.png")])
    with pytest.raises(CacheBlendError, match="text only; message 0 has a content block of type 'image'"):
        CacheBlendLLM.to_dicts([message])
    joined = CacheBlendLLM.to_dicts([ChatMessage(role="user", blocks=[TextBlock(text="a"), TextBlock(text="b")])])
    assert joined == [{"role": "user", "content": "a\nb"}]


def test_per_call_none_and_timeouts_mean_the_same_in_both_adapters(default_engine, calls):
    lc = ChatCacheBlend(engine=default_engine, max_tokens=3, max_risk=0.5, seed=3, timeout=30)
    lc.invoke("Hi", max_risk=None, seed=None, max_tokens=None, temperature=None, timeout=None)
    assert (calls[-1]["max_risk"], calls[-1]["seed"], calls[-1]["timeout"]) == (None, None, None)
    assert (calls[-1]["max_new_tokens"], calls[-1]["temperature"]) == (3, 0.0)  # None: the object's own value
    li = CacheBlendLLM(engine=default_engine, max_tokens=3, max_risk=0.5, seed=3, request_timeout=30)
    li.complete("Hi", max_risk=None, seed=None, max_tokens=None, temperature=None, request_timeout=None)
    assert (calls[-1]["max_risk"], calls[-1]["seed"], calls[-1]["timeout"]) == (None, None, None)
    assert (calls[-1]["max_new_tokens"], calls[-1]["temperature"]) == (3, 0.0)
    li.complete("Hi", request_timeout=5, learn_passages=False)
    assert (calls[-1]["timeout"], calls[-1]["learn"]) == (5, False)
    with pytest.raises(CacheBlendError, match="unknown options"):
        lc.invoke("Hi", temprature=None)


def test_stop_empty_list_clears_the_fields_stops(default_engine, calls):
    lc = ChatCacheBlend(engine=default_engine, max_tokens=2, stop=["e"])
    lc.invoke("Hi", stop=[])
    assert calls[-1]["stop"] == ()
    assert "ls_stop" not in lc._get_ls_params(stop=[])  # noqa: SLF001
    lc.invoke("Hi")
    assert calls[-1]["stop"] == ("e",)


def test_llamaindex_documents_take_its_own_documents_and_nodes(default_engine, calls):
    node = TextNode(text="Paris is the capital of France.", metadata={"source": "atlas"})
    li = CacheBlendLLM(engine=default_engine, max_tokens=2)
    li.complete("Capital?", documents=[LIDocument(text="Rome is in Italy."), NodeWithScore(node=node), "Plain."])
    assert calls[-1]["documents"] == ["Rome is in Italy.", node.get_content(metadata_mode=MetadataMode.LLM),
                                      "Plain."]
    assert "atlas" in calls[-1]["documents"][1]  # the text synthesizers and the ingestion transform use
    with pytest.raises(CacheBlendError, match="documents must be strings or LlamaIndex documents/nodes, got int"):
        li.complete("Capital?", documents=[3])


def test_bad_field_values_fail_at_construction_naming_the_field(default_engine):
    for bad, name in (({"temperature": -1}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
                      ({"top_p": 0}, "top_p"), ({"recompute_ratio": 3.0}, "recompute_ratio")):
        with pytest.raises(ValidationError, match=name):
            ChatCacheBlend(engine=default_engine, **bad)
        with pytest.raises(ValidationError, match=name):
            CacheBlendLLM(engine=default_engine, **bad)
    assert ChatCacheBlend(engine=default_engine, max_tokens=None).max_tokens is None


def test_learn_passages_is_one_option_in_both_adapters(default_engine):
    for llm in (ChatCacheBlend(engine=default_engine, learn_passages=False),
                CacheBlendLLM(engine=default_engine, learn_passages=False)):
        assert llm.learn is False and llm.learn_passages is False
    assert CacheBlendLLM(engine=default_engine).learn is ChatCacheBlend(engine=default_engine).learn is True


def test_synthesizer_uses_the_llms_system_prompt_unless_given_its_own(default_engine, calls):
    llm = CacheBlendLLM(engine=default_engine, max_tokens=2, system_prompt="You are a pirate.")
    nodes = [NodeWithScore(node=TextNode(text="Kilimanjaro is in Tanzania."), score=1.0)]
    CacheBlendSynthesizer(llm).synthesize("Where is Kilimanjaro?", nodes)
    assert calls[-1]["system"] == "You are a pirate."
    CacheBlendSynthesizer(llm, system="Be brief.").synthesize("Where is Kilimanjaro?", nodes)
    assert calls[-1]["system"] == "Be brief."
