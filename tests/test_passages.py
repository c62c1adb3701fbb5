"""Chunks found in formatted prompts (``Engine.start_chat``), against full prefill."""

from __future__ import annotations

import pytest
import torch

from cacheblend import CacheBlendError, Engine
from cacheblend.passages import PassageIndex, cut, paragraphs
from cacheblend.store.entry import PrefixView
from conftest import PASSAGES, QUERY

GEN = dict(max_new_tokens=6)


def _run(gen):
    for _ in gen.pieces:
        pass
    return gen.result


def test_index_finds_passages_anywhere_longest_first():
    index = PassageIndex(anchor=8)
    index.add("alpha beta gamma delta")
    index.add("alpha beta gamma delta epsilon zeta")  # same start, longer
    index.add("short")
    text = "x: alpha beta gamma delta epsilon zeta; y: alpha beta gamma delta. short!"
    spans = [text[s.start:s.end] for s in index.find(text)]
    assert spans == ["alpha beta gamma delta epsilon zeta", "alpha beta gamma delta", "short"]
    index.discard("short")
    assert "short" not in index and len(index) == 2


def test_the_question_is_not_learned_when_a_prefilled_answer_follows_it(engine):
    """Only the last message's last paragraph was kept from learning: with an assistant turn
    after the question (a prefilled answer), the question became a chunk."""
    from cacheblend.chat import plan_chat

    question = "Which of these passages says the most about how the violin came to be played? " * 3
    messages = [{"role": "user", "content": "\n\n".join(PASSAGES) + "\n\n" + question},
                {"role": "assistant", "content": "The passage"}]
    plan = plan_chat(engine.prompts, PassageIndex(), messages, learn_min_chars=60)
    assert plan.learned and all(question.strip() not in p for p in plan.learned)


def test_a_passage_is_never_found_inside_a_longer_word():
    """Short passages were found with ``str.find`` anywhere: "art" inside "start", "party"
    and "smart" made three chunks, and the prompt was tokenized around them."""
    index = PassageIndex(anchor=8)
    index.add("art")
    index.add("alpha beta gamma delta")
    text = "The start of the party was smart; art (art)."
    assert [text[s.start:s.end] for s in index.find(text)] == ["art", "art"]
    glued = "['first line\\nalpha beta gamma delta']"  # long passages may touch letters (a repr's "\\n")
    assert [glued[s.start:s.end] for s in index.find(glued)] == ["alpha beta gamma delta"]


def test_paragraphs_and_cut_keep_the_question_and_take_the_blank_line():
    long_a, long_b = "A" * 30, "B" * 30
    text = f"Intro.\n\n{long_a}\n\n{long_b}\n\nQuestion: {'Q' * 40}"
    assert [text[s.start:s.end] for s in paragraphs(text, 25)] == [long_a, long_b, "Question: " + "Q" * 40]
    pieces = cut(text, PassageIndex(), learn_min_chars=25, keep_tail=True)
    assert [p.passage for p in pieces if p.passage] == [long_a, long_b]
    assert [p.text for p in pieces if p.passage] == [long_a + "\n\n", long_b + "\n\n"]
    assert "".join(p.text for p in pieces) == text


def test_the_pieces_join_to_the_text_when_a_passage_begins_with_a_newline():
    """A known text that begins with a newline (loaders leave them) is found one character
    into the blank line after the passage before it; that passage took the whole blank line
    as well, and the prompt gained a newline, for every method."""
    index = PassageIndex()
    long_a, long_b = "A" * 60, "\n" + "B" * 60
    index.add(long_a)
    index.add(long_b)
    text = f"Context:\n{long_a}\n{long_b}\n\nQuestion: what?"  # one blank line, the newline B begins with
    pieces = cut(text, index, learn_min_chars=25, keep_tail=True)
    assert "".join(p.text for p in pieces) == text
    assert [p.passage for p in pieces if p.passage][0] == long_a


@pytest.fixture
def engine(default_model_dir, tmp_path_factory):
    from conftest import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama", default_model_dir)
    return Engine.load(folder, store="memory")


def _chat(context: str) -> list[dict]:
    return [{"role": "system", "content": "Use the sources.\n" + context}, {"role": "user", "content": QUERY}]


def test_found_passages_at_ratio_one_equal_full_prefill(engine):
    engine.ingest(PASSAGES)
    messages = _chat("".join(f"[{i}] {p} |\n" for i, p in enumerate(PASSAGES)))  # no blank lines
    full = _run(engine.start_chat(messages, method="full", **GEN))
    blend1 = _run(engine.start_chat(messages, method="blend", recompute_ratio=1.0, **GEN))
    reuse = _run(engine.start_chat(messages, method="reuse", **GEN))
    assert blend1.stats.chunks == reuse.stats.chunks == len(PASSAGES)
    assert reuse.stats.store_hits == len(PASSAGES) + 1  # every passage (as a prefix view) and the system prefix
    torch.testing.assert_close(blend1.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)
    assert blend1.token_ids == full.token_ids
    assert not torch.allclose(reuse.first_token_logits, full.first_token_logits, atol=1e-3)


def test_prefix_view_is_exactly_the_passage_computed_alone(engine):
    ids = engine.prompts.encode(PASSAGES[0])
    with_sep = engine.prompts.chunk_ids(PASSAGES[0])
    assert with_sep[: len(ids)] == ids
    stored = engine.precompute_chunk(with_sep)
    alone = engine.precompute_chunk(ids)
    view = PrefixView(stored, len(ids))
    for layer in range(view.num_layers):
        k, v = view.layer(layer)
        torch.testing.assert_close(k, alone.k[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, alone.v[layer], atol=1e-5, rtol=1e-5)


def test_documents_go_in_front_of_the_question_like_generate(engine):
    chat = _run(engine.start_chat([{"role": "user", "content": QUERY}], documents=PASSAGES, **GEN))
    plain = engine.generate(QUERY, PASSAGES, **GEN)
    assert chat.token_ids == plain.token_ids
    torch.testing.assert_close(chat.first_token_logits, plain.first_token_logits)


def _user_chat(context: str) -> list[dict]:
    return [{"role": "user", "content": "Use the sources.\n\n" + context + "\n\n" + QUERY}]


def test_learned_paragraphs_are_reused_in_another_order(engine):
    engine.learn_min_chars = 60
    first = _run(engine.start_chat(_user_chat("\n\n".join(PASSAGES)), **GEN))
    assert first.stats.chunks_learned == len(PASSAGES)
    again = _run(engine.start_chat(_user_chat("\n\n".join(reversed(PASSAGES))), **GEN))
    assert again.stats.chunks_learned == 0 and again.stats.store_hits >= len(PASSAGES)


INSTRUCTION = ("You answer questions about people and places. Answer in one short sentence, name the place "
               "or person asked for, and say that you do not know when the sources do not tell.")


def test_a_long_system_instruction_stays_exact_in_the_prefix(engine):
    """The system message's first long paragraph used to be learned as a chunk, so from the
    second call on it was blended (approximate).  It stays in the prompt's prefix: the
    prefix cache makes the second call exact, with or without passages."""
    engine.learn_min_chars = 60
    alone = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": QUERY}]
    first = _run(engine.start_chat(alone, **GEN))
    assert first.stats.chunks_learned == 0 and first.stats.chunks == 0
    again = _run(engine.start_chat(alone, **GEN))
    full = _run(engine.start_chat(alone, method="full", **GEN))
    assert again.stats.exact and again.stats.chunks == 0 and again.stats.store_hits == 1
    assert again.stats.exact_cached_tokens > len(engine.prompts.encode(INSTRUCTION))
    assert again.token_ids == full.token_ids
    torch.testing.assert_close(again.first_token_logits, full.first_token_logits, atol=1e-4, rtol=1e-4)

    engine.ingest(PASSAGES)
    rag = [{"role": "system", "content": INSTRUCTION + "\n\nSources:\n\n" + "\n\n".join(PASSAGES)},
           {"role": "user", "content": QUERY}]
    blend1 = _run(engine.start_chat(rag, recompute_ratio=1.0, **GEN))
    full = _run(engine.start_chat(rag, method="full", **GEN))
    assert blend1.stats.chunks == len(PASSAGES) and blend1.stats.chunks_learned == 0
    assert blend1.token_ids == full.token_ids
    torch.testing.assert_close(blend1.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)


def test_only_the_first_unknown_system_paragraph_is_kept_out_of_the_chunks(engine):
    """Unknown passages pasted into the system message: the first stays in the prefix on
    this call (it may be the instruction), the others are learned; a known passage before
    them keeps every one learnable."""
    engine.learn_min_chars = 60
    first = _run(engine.start_chat(_chat("\n\n" + "\n\n".join(PASSAGES)), **GEN))
    assert first.stats.chunks_learned == len(PASSAGES) - 1 and PASSAGES[0] not in engine.passages
    again = _run(engine.start_chat(_chat("\n\n" + "\n\n".join(reversed(PASSAGES))), **GEN))
    assert again.stats.chunks_learned == 1 and PASSAGES[0] in engine.passages  # learned where it moved to
    assert again.stats.chunks == len(PASSAGES)  # a known passage opens the message: all are chunks


# Three templates as their libraries ship them: LangChain hub's rlm/rag-prompt (the
# question above the context), LlamaIndex's default text_qa (rules round the context, the
# query on a line of its own), LangChain's stuff chat prompt (a rule, then the context).
RLM_RAG = ("You are an assistant for question-answering tasks. Use the following pieces of retrieved context "
           "to answer the question. If you don't know the answer, just say that you don't know. Use three "
           "sentences maximum and keep the answer concise.\nQuestion: {q} \nContext: {c} \nAnswer:")
TEXT_QA = ("Context information is below.\n---------------------\n{c}\n---------------------\nGiven the "
           "context information and not prior knowledge, answer the query.\nQuery: {q}\nAnswer: ")
CHAT_REFINE = ("You are an expert Q&A system that strictly operates in two modes when refining existing answers:\n"
               "1. **Rewrite** an original answer using the new context.\n2. **Repeat** the original answer if the "
               "new context isn't useful.\nNever reference the original answer or context directly in your answer.\n"
               "When in doubt, just repeat the original answer.\nNew Context: {c}\nQuery: {q}\nOriginal Answer: {a}\n"
               "New Answer: ")  # LlamaIndex's refine template for chat models
REFINE = ("The original query is as follows: {q}\nWe have provided an existing answer: {a}\nWe have the "
          "opportunity to refine the existing answer (only if needed) with some more context below.\n------------\n"
          "{c}\n------------\nGiven the new context, refine the original answer to better answer the query. If the "
          "context isn't useful, return the original answer.\nRefined Answer: ")  # ... for completion models
STUFF_SYSTEM = ("Use the following pieces of context to answer the user's question.\nIf you don't know the "
                "answer, just say that you don't know, don't try to make up an answer.\n----------------\n{c}")


@pytest.mark.parametrize("template", [RLM_RAG, TEXT_QA, CHAT_REFINE, REFINE])
def test_a_templates_question_line_is_never_learned_and_its_passages_are(engine, template):
    """The question on a line of its own inside a paragraph ("Question: ...", "Query: ...")
    was learned with the passage or instruction it touched: one new store entry per
    request, never reused, and that passage never found alone again.  The refine
    template glues its instruction to the context ("...answer.\nNew Context: {c}") and
    puts the previous step's answer under the query: both were learned with what they
    touched.  The refine template for completion models states both in prose above a rule
    line: that header was learned."""
    from cacheblend.chat import plan_chat

    index = PassageIndex()
    calls = [(QUERY, PASSAGES), ("Which river flows through Vienna?", PASSAGES[::-1])]
    plans = [plan_chat(engine.prompts, index, [{"role": "user", "content": template.format(
        q=q, c="\n\n".join(docs), a=f"An earlier step answered '{q}' from other passages, and found no name.")}],
        learn_min_chars=60) for q, docs in calls]
    assert all(q not in p for (q, _), plan in zip(calls, plans, strict=True) for p in plan.learned)
    assert set(PASSAGES) <= set(plans[0].learned)
    assert plans[1].learned == [] and len(plans[1].prompt.chunks) == len(plans[0].prompt.chunks)


def test_a_passage_behind_a_rule_in_the_system_message_is_learned_not_kept(engine):
    """LangChain's stuff chat prompt: a short instruction, a rule, the context.  The first
    retrieved passage was kept in the prefix as if it were the instruction (and glued to
    it): it was never cached as a chunk while it came first."""
    from cacheblend.chat import plan_chat

    messages = [{"role": "system", "content": STUFF_SYSTEM.format(c="\n\n".join(PASSAGES))},
                {"role": "user", "content": QUERY}]
    plan = plan_chat(engine.prompts, PassageIndex(), messages, learn_min_chars=60)
    assert plan.learned == PASSAGES and len(plan.prompt.chunks) == len(PASSAGES)


RULES = ("Cite the passage you answer from by its first words, and never quote more than one "
         "sentence of it. Keep names as the passage spells them.")
STYLE = ("Write for a reader who has not seen the passages: no pronoun without its noun, no "
         "abbreviation the passages do not spell out, and no more than two sentences.")


def test_a_system_instruction_of_several_paragraphs_stays_exact(engine):
    """Only the instruction's first paragraph was kept in the prefix: the others, learned
    on the first call, were blended from the second.  Paragraphs that open the system
    message as they did on an earlier request are kept too: exact from the third call
    (the second reads the longer prefix for the first time)."""
    engine.learn_min_chars = 60
    engine.ingest(PASSAGES)
    system = "\n\n".join((INSTRUCTION, RULES, STYLE))
    rag = [{"role": "system", "content": system}, {"role": "user", "content": QUERY}]
    first = _run(engine.start_chat(rag, documents=PASSAGES, **GEN))
    assert first.stats.chunks_learned == 2 and first.stats.chunks == len(PASSAGES) + 2
    for _ in range(2):
        again = _run(engine.start_chat(rag, documents=PASSAGES, recompute_ratio=1.0, **GEN))
    full = _run(engine.start_chat(rag, documents=PASSAGES, method="full", **GEN))
    assert again.stats.chunks == len(PASSAGES) and again.stats.chunks_learned == 0
    assert again.stats.exact_cached_tokens > len(engine.prompts.encode(system))
    assert again.token_ids == full.token_ids
    torch.testing.assert_close(again.first_token_logits, full.first_token_logits, atol=1e-3, rtol=1e-3)
    alone = [{"role": "system", "content": system}, {"role": "user", "content": "Who was Marie Curie?"}]
    for _ in range(2):
        chat = _run(engine.start_chat(alone, **GEN))
    assert chat.stats.exact and chat.stats.chunks == 0


def test_only_an_opening_seen_before_is_kept_and_never_a_document(engine):
    """Passages pasted into a system message are chunks while they change from request to
    request; the same ones opening it again are kept (the prefix cache serves them
    exactly); a passage given as ``documents`` stays a chunk wherever it sits."""
    from cacheblend.chat import HeadMemory, plan_chat

    heads, index = HeadMemory(), PassageIndex()

    def plan(order, documents=()):
        system = INSTRUCTION + "\n\n" + "\n\n".join(order)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": QUERY}]
        return plan_chat(engine.prompts, index, messages, documents, learn_min_chars=60, heads=heads)

    assert len(plan(PASSAGES).prompt.chunks) == len(PASSAGES)  # the instruction kept, the passages learned
    assert len(plan(PASSAGES[::-1]).prompt.chunks) == len(PASSAGES)  # another opening: all chunks
    assert len(plan(PASSAGES[:1] + PASSAGES[:0:-1]).prompt.chunks) == len(PASSAGES) - 1  # PASSAGES[0] opened it before
    assert len(plan(PASSAGES, documents=PASSAGES[:1]).prompt.chunks) == len(PASSAGES)


def test_release_forgets_passages_and_deletes_caches(engine):
    handles = engine.ingest(PASSAGES[:2])
    assert engine.release(PASSAGES[:1]) == 1
    assert engine.store.open(handles[0].key) is None and engine.store.open(handles[1].key) is not None
    assert PASSAGES[0] not in engine.passages


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hello", "non-empty list"),
    ([{"role": "tool", "content": "x"}], "role in"),
    ([{"role": "user", "content": None}], "string content"),
    ([{"role": "user", "content": "  "}], "every message is empty"),
])
def test_bad_messages_are_named(engine, messages, match):
    with pytest.raises(CacheBlendError, match=match):
        engine.start_chat(messages)


def test_documents_without_a_user_message_are_refused(engine):
    with pytest.raises(CacheBlendError, match="need a user message"):
        engine.start_chat([{"role": "system", "content": "s"}], documents=["a passage"])
    with pytest.raises(CacheBlendError, match="non-empty string"):
        engine.start_chat([{"role": "user", "content": "q"}], documents=[""])


@pytest.mark.parametrize("template", [
    "Context: {c}\nQuestion: {q}",  # one paragraph: the question is its last line
    "Source 1:\n{c}\n\nQuestion: {q}",
])
def test_unseen_passage_costs_a_full_prefill_then_is_reused(engine, template):
    """A drop-in prompt's unseen passage is computed in place (as full prefill would: the
    answer IS full prefill's), stored in the background without its label, reused next."""
    engine.learn_min_chars = 60
    messages = [{"role": "user", "content": template.format(c=PASSAGES[2], q=QUERY)}]
    first = _run(engine.start_chat(messages, **GEN))
    full = _run(engine.start_chat(messages, method="full", **GEN))  # the same pieces, all computed
    assert first.stats.chunks_learned == 1 and first.stats.chunks == 1
    assert first.token_ids == full.token_ids  # nothing reused approximately: exact prefix + computed tokens
    torch.testing.assert_close(first.first_token_logits, full.first_token_logits, atol=1e-4, rtol=1e-4)
    assert PASSAGES[2] in engine.passages  # the passage, without the template's label
    again = _run(engine.start_chat(messages, **GEN))  # waits for the background precompute if needed
    assert again.stats.chunks_learned == 0 and again.stats.store_hits >= 2  # the passage and the prefix
    assert engine.store.stats()["learned_entries"] == 1  # marked: evicted before ingested chunks
    assert again.stats.reused_tokens > first.stats.reused_tokens
    engine.release(PASSAGES[2])


def test_a_passage_pasted_without_its_surrounding_whitespace_is_still_found(engine):
    engine.learn_min_chars = 10_000  # nothing learned: only known passages count
    engine.ingest(["\n " + PASSAGES[1] + "\n"])
    messages = [{"role": "user", "content": f"Sources: {PASSAGES[1]}\n\nQuestion: {QUERY}"}]
    first = _run(engine.start_chat(messages, **GEN))
    assert first.stats.chunks == 1 and first.stats.chunks_learned == 0
    again = _run(engine.start_chat(messages, **GEN))  # stored in the background after the first call
    assert again.stats.store_hits >= 2 and again.stats.reused_tokens > first.stats.reused_tokens


def test_a_document_already_in_the_message_is_not_pasted_again_for_its_whitespace(engine):
    """``documents=[doc + " "]`` beside a message holding ``doc``: the document went in a
    second time, and the prompt held the passage twice."""
    from cacheblend.chat import plan_chat

    messages = [{"role": "user", "content": f"Context:\n{PASSAGES[0]}\n\nQuestion: {QUERY}"}]
    for doc in (PASSAGES[0] + " ", " " + PASSAGES[0], PASSAGES[0] + "\r\n"):
        plan = plan_chat(engine.prompts, engine.passages, messages, [doc], learn=False)
        assert len(plan.prompt.chunks) == 1
        assert engine.tokenizer.decode(plan.prompt.all_ids).count(PASSAGES[0]) == 1


def test_a_passage_text_is_tokenized_once_while_it_recurs(engine, monkeypatch):
    """Passages given as strings request after request: the handle of a text seen lately is
    kept (tokenizing and hashing them again cost about 5 ms of each TTFT), and equals a fresh one."""
    text = PASSAGES[0] + " (a text no other test passes)"
    calls = []
    encode = engine.prompts.chunk_ids
    monkeypatch.setattr(engine.prompts, "chunk_ids", lambda t: calls.append(t) or encode(t))
    first, again = engine.chunks.resolve(text), engine.chunks.resolve(text)
    assert again is first and calls == [text]
    assert first == engine.chunks.handle(encode(text))
    with pytest.raises(CacheBlendError, match="non-empty string"):
        engine.chunks.resolve("  ")


def test_the_index_can_be_searched_while_another_thread_adds_and_forgets():
    """The adapters' async paths plan requests on worker threads while others ingest: a
    scan iterating a set that another thread changed raised ``RuntimeError: Set changed
    size during iteration``."""
    import sys
    import threading

    index = PassageIndex()
    for i in range(200):
        index.add(f"short {i}")
    text = " ".join(f"short {i}" for i in range(50)) * 20
    errors: list[BaseException] = []
    stop = threading.Event()

    def search() -> None:
        for _ in range(200):
            try:
                index.find(text)
            except RuntimeError as e:
                errors.append(e)
                break
        stop.set()

    def churn() -> None:
        i = 1000
        while not stop.is_set():
            index.add(f"short {i}")
            index.discard(f"short {i - 1}")
            i += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=search), threading.Thread(target=churn)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not errors
