"""langchain-tests' standard suites for ChatCacheBlend, run against the real default model.

Opted out (the class property says so, and langchain-tests skips the tests): tool calling,
structured output, JSON mode and multimodal input, which the engine does not provide."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from langchain_cacheblend import ChatCacheBlend  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from cacheblend.datasets import load_qa  # noqa: E402

# the in-process engine is shared per (model, store); keep answers short: ~90 ms a token on 2 cores
# (through the suites' standard parameters: test_standard_params passes max_tokens itself)
PARAMS = {"store": "memory"}


class _ChatCacheBlendParams:
    """What both suites ask: the class, its parameters, and the features it opts out of."""

    @property
    def chat_model_class(self) -> type[ChatCacheBlend]:
        return ChatCacheBlend

    @property
    def chat_model_params(self) -> dict:
        return PARAMS

    @property
    def standard_chat_model_params(self) -> dict:
        return {**super().standard_chat_model_params, "max_tokens": 12}  # type: ignore[misc]

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return False


class TestChatCacheBlendUnit(_ChatCacheBlendParams, ChatModelUnitTests):
    pass


@pytest.mark.slow
class TestChatCacheBlendIntegration(_ChatCacheBlendParams, ChatModelIntegrationTests):
    @property
    def supports_json_mode(self) -> bool:
        return False

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_image_urls(self) -> bool:
        return False

    @property
    def supports_pdf_inputs(self) -> bool:
        return False

    @property
    def supports_audio_inputs(self) -> bool:
        return False

    @property
    def supports_anthropic_inputs(self) -> bool:
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        """A prompt whose passages were cached by a first call: the second reads them."""
        llm = ChatCacheBlend(**PARAMS)
        ex = load_qa("musique", "dev", limit=1, passages=2)[0]
        messages = [HumanMessage(ex.question)]
        llm.invoke(messages, documents=ex.passages)
        if stream:
            out = None
            for chunk in llm.stream(messages, documents=ex.passages):
                out = chunk if out is None else out + chunk
            return out
        out = llm.invoke(messages, documents=ex.passages)
        assert out.usage_metadata["input_token_details"]["cache_read"] > 0
        return out
