"""The OpenAI-compatible routes, in process, on a real engine over the tiny random Llama.

Driven by httpx over ASGI and by the official `openai` client. NOTE: httpx's ASGITransport buffers a whole
response, so what depends on timing (chunks sent while the request still runs, a client that disconnects
mid-stream) is tested by calling the ASGI app directly and once over a real socket with uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil

import httpx
import openai
import pytest
from api_helpers import (
    HELLO, KEY, MAX_LEN, MODEL, call_asgi, error_of, http_client, mount, openai_client, sse_events, tiny_engine,
    wait_idle,
)

from bento_pagedllm import SamplingParams
from bento_pagedllm.faults import FaultInjection
from bento_pagedllm.tokenizer import apply_chat_template


@pytest.fixture(autouse=True)
async def no_leaks(engine):
    """Every test leaves no request and no used KV block behind."""
    yield
    assert await wait_idle(engine)


@pytest.fixture
def aborted(engine, monkeypatch) -> list[str]:
    """Ids of the requests the engine aborted while they ran (not those that had finished already)."""
    ids: list[str] = []
    real = engine.engine.abort_request

    def spy(request_id: str) -> bool:
        found = real(request_id)
        if found:
            ids.append(request_id)
        return found

    monkeypatch.setattr(engine.engine, "abort_request", spy)
    return ids


async def engine_token_ids(engine, prompt, **params) -> list[int]:
    """What the engine itself generates (greedy), to check the API against."""
    async for out in engine.generate(prompt, SamplingParams(temperature=0.0, **params)):
        last = out
    return last.outputs[0].token_ids


# ---- models ------------------------------------------------------------------------------------------


async def test_models(http, oai):
    r = await http.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    card = body["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and isinstance(card["created"], int)
    assert card["max_model_len"] == MAX_LEN  # vLLM's field: the context window
    assert [m.id for m in (await oai.models.list()).data] == [MODEL]
    assert (await oai.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        await oai.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"


# ---- chat ---------------------------------------------------------------------------------------------


async def test_chat_non_streamed_and_streamed_agree(engine, http, oai):
    request = dict(model=MODEL, messages=HELLO, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = await oai.chat.completions.create(**request)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion" and full.model == MODEL
    assert isinstance(full.created, int) and full.system_fingerprint is None
    (choice,) = full.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.logprobs is None
    prompt_ids = apply_chat_template(engine.tokenizer, HELLO)
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 20 and full.usage.total_tokens == len(prompt_ids) + 20
    # the API answers what the engine generates
    expected = await engine_token_ids(engine, prompt_ids, max_tokens=20, ignore_eos=True)
    assert choice.message.content == engine.tokenizer.decode(expected, skip_special_tokens=True)

    chunks = [c async for c in await oai.chat.completions.create(**request, stream=True)]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.created >= full.created for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and last.delta.content is None and last.delta.role is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert sum(1 for c in chunks if c.choices[0].delta.content) > 5  # token by token, not one lump

    # the raw stream: SSE framing, no usage key unless asked for, [DONE] last
    r = await http.post("/v1/chat/completions", json={**request.pop("extra_body"), **request, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])
    assert events[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
    assert events[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length",
                                      "stop_reason": None}]  # vLLM's stop_reason: no stop string or id ended it


async def test_chat_content_parts_and_extras(oai, http):
    common = dict(model=MODEL, max_tokens=8, temperature=0)
    plain = await oai.chat.completions.create(messages=HELLO, **common)
    parts = await oai.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": HELLO[0]["content"]}]}], **common)
    assert parts.choices[0].message.content == plain.choices[0].message.content
    # max_completion_tokens wins over max_tokens; unknown fields and `user` are ignored; vLLM's extensions
    r = await http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "developer", "content": "Be brief."}] + HELLO, "max_tokens": 50,
        "max_completion_tokens": 3, "ignore_eos": True, "user": "someone", "some_future_field": {"x": 1},
        "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    })
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_chat_n2_streams_interleave(oai):
    request = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=1.0, seed=3, n=2,
                   extra_body={"ignore_eos": True})
    full = await oai.chat.completions.create(**request)
    assert [c.index for c in full.choices] == [0, 1]
    assert full.choices[0].message.content != full.choices[1].message.content
    assert full.usage.completion_tokens == 24  # both choices; the prompt counted once
    chunks = [c async for c in await oai.chat.completions.create(**request, stream=True)]
    texts, finish, first = {0: "", 1: ""}, {}, {}
    for c in chunks:
        (ch,) = c.choices
        first.setdefault(ch.index, ch.delta.role)
        assert ch.index not in finish  # nothing after a choice's finish_reason
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            finish[ch.index] = ch.finish_reason
    assert first == {0: "assistant", 1: "assistant"}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert texts == {c.index: c.message.content for c in full.choices}  # seeded: the same two answers
    indices = [c.choices[0].index for c in chunks]
    assert indices != sorted(indices)  # interleaved, as generated


async def test_seed_reproducibility(oai):
    async def sample(seed):
        r = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=16, temperature=1.0,
                                              top_p=0.95, seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].message.content

    a, b, c, d = await asyncio.gather(sample(42), sample(42), sample(7), sample(8))
    assert a == b
    assert len({a, c, d}) > 1


async def test_chat_logprobs(oai, http):
    request = dict(model=MODEL, messages=HELLO, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
                   extra_body={"ignore_eos": True})
    full = await oai.chat.completions.create(**request)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 10
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert entry.token == entry.top_logprobs[0].token  # greedy: the chosen token is the most likely
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token or entry.token.startswith("bytes:")
    text = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert text == full.choices[0].message.content
    chunks = [c async for c in await oai.chat.completions.create(**request, stream=True)]
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    # top_logprobs needs logprobs
    r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "top_logprobs": 2})
    assert error_of(r, 400)["param"] == "top_logprobs"


async def test_include_usage(oai, http):
    request = dict(model=MODEL, messages=HELLO, max_tokens=6, temperature=0)
    full = await oai.chat.completions.create(**request)
    chunks = [c async for c in await oai.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True})]
    streamed = chunks[-1].usage
    assert chunks[-1].choices == [] and streamed.model_dump(exclude={"prompt_tokens_details"}) == \
        full.usage.model_dump(exclude={"prompt_tokens_details"})
    # the same prompt again: its full blocks came from the prefix cache (the last token is always computed)
    assert streamed.prompt_tokens_details.cached_tokens == (streamed.prompt_tokens - 1) // 16 * 16 > 0
    assert all(c.usage is None for c in chunks[:-1])
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Once upon", "max_tokens": 5, "n": 2,
                                                 "ignore_eos": True, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 10 and usage["prompt_tokens_details"] == {"cached_tokens": 0}  # < a block
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert all(e["usage"] is None for e in events[:-2])
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream_options": {
        "include_usage": True}})
    assert error_of(r, 400)["param"] == "stream_options"


async def test_continuous_usage_stats(http):
    """vLLM's `continuous_usage_stats`: with include_usage every choice's chunk carries its usage so far (its
    prompt's tokens, its own tokens), then the usual usage chunk; without include_usage it changes nothing."""
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "ignore_eos": True, "stream": True, "n": 2,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events((await http.post("/v1/chat/completions", json=request)).text)
    assert events[-1] == "[DONE]"
    chunks, final = events[:-2], events[-2]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 8
    prompt_tokens = final["usage"]["prompt_tokens"]
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        counts = [c["usage"]["completion_tokens"] for c in mine]
        assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 4, counts  # the role chunk first
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["usage"]["prompt_tokens"] == prompt_tokens and c["usage"]["total_tokens"] ==
                   prompt_tokens + c["usage"]["completion_tokens"] for c in mine)
    # completions, two prompts: each choice counts its own prompt
    r = await http.post("/v1/completions", json={
        "model": MODEL, "prompt": ["Once upon", "Once upon a time there"], "max_tokens": 2, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    events = sse_events(r.text)
    by_choice = {c["choices"][0]["index"]: c["usage"]["prompt_tokens"] for c in events[:-2]}
    assert by_choice[0] < by_choice[1] and sum(by_choice.values()) == events[-2]["usage"]["prompt_tokens"]
    plain = sse_events((await http.post("/v1/chat/completions", json={
        **request, "stream_options": {"continuous_usage_stats": True}})).text)
    assert all("usage" not in e for e in plain[:-1])


# ---- completions --------------------------------------------------------------------------------------


async def test_completions_non_streamed_and_streamed_agree(oai):
    request = dict(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0)
    full = await oai.completions.create(**request)
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == MODEL
    (choice,) = full.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = [c async for c in await oai.completions.create(**request, stream=True)]
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason and chunks[-1].choices[0].text == ""
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    # one chunk per generated token (each step yields one), then the finish chunk: clients time tokens by them
    assert len(chunks) == full.usage.completion_tokens + 1


async def test_completions_logprobs(oai):
    request = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, logprobs=2,
                   extra_body={"ignore_eos": True})
    full = await oai.completions.create(**request)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    offset = 0
    for token, logprob, top, at in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert at == offset
        offset += len(token)
        assert len(top) == 2 and top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    assert "".join(lp.tokens) == full.choices[0].text
    chunks = [c async for c in await oai.completions.create(**request, stream=True)]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


async def test_text_offsets_count_the_texts_characters_where_a_token_is_part_of_one(oai, engine):
    """An emoji split over byte tokens (`bytes:\\xf0\\x9f`...): each token's offset is where its text starts
    in the answer's text, the split character counted once, when complete."""
    prompt = "Party 🎉 time: ¡olé!"
    out = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       logprobs=1, extra_body={"ignore_eos": True})
    text, lp = out.choices[0].text, out.choices[0].logprobs
    assert any(token.startswith("bytes:") for token in lp.tokens)  # the case at hand
    ids = engine.tokenizer(prompt).input_ids  # the prompt's tokens lead
    # where each token starts: the characters its predecessors complete (a partial one decodes as U+FFFD)
    starts = [len(engine.tokenizer.decode(ids[:i]).replace("\ufffd", "")) for i in range(len(ids))]
    assert lp.text_offset[: len(ids)] == starts
    assert all(a <= b <= len(text) for a, b in zip(lp.text_offset, lp.text_offset[1:]))
    assert text.startswith(prompt)


async def test_echo(oai, engine):
    prompt = "Once upon a time"
    plain = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    echoed = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    chunks = [c async for c in await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                                            temperature=0, echo=True, stream=True)]
    assert chunks[0].choices[0].text == prompt
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
    ids = engine.tokenizer(prompt).input_ids
    by_ids = await oai.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert by_ids.choices[0].text == echoed.choices[0].text


async def engine_prompt_scores(engine, prompt_ids, k):
    async for out in engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k)):
        last = out
    return last.prompt_logprobs


async def test_echo_with_logprobs_scores_the_prompt_then_the_output(oai, engine):
    """OpenAI's legacy scoring request (lm-evaluation-harness's loglikelihood): echo, logprobs, a token or
    none generated; the prompt's tokens lead the log-probabilities, the first without any."""
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = engine.tokenizer(prompt).input_ids
    scores = await engine_prompt_scores(engine, ids, 2)
    for max_tokens in (1, 0):
        out = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                           echo=True, logprobs=2)
        choice = out.choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + max_tokens and out.usage.completion_tokens == max_tokens
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1 : len(ids)] == pytest.approx([s.logprob for s in scores[1:]], abs=1e-5)
        # the top 2, and the prompt's token where it is not among them
        assert [len(top) for top in lp.top_logprobs[1 : len(ids)]] == [2 + (s.rank > 2) for s in scores[1:]]
        assert all(top[t] == logprob for t, top, logprob in zip(lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:]))
        assert len(lp.tokens[0]) and lp.text_offset[0] == 0
        assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
        assert choice.text.startswith(prompt)
        if max_tokens == 0:
            assert choice.text == prompt and choice.finish_reason == "length"
        else:
            generated = await engine_token_ids(engine, ids, max_tokens=1)
            assert choice.text == prompt + engine.tokenizer.decode(generated)
    stream = [c async for c in await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3,
                                                            temperature=0, echo=True, logprobs=2, stream=True)]
    full = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                        logprobs=2)
    first = stream[0].choices[0]
    assert first.text.startswith(prompt) and first.logprobs.token_logprobs[0] is None
    streamed = [c.choices[0].logprobs for c in stream if c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == full.choices[0].logprobs.tokens
    assert sum((s.text_offset for s in streamed), []) == full.choices[0].logprobs.text_offset
    assert "".join(c.choices[0].text for c in stream) == full.choices[0].text
    zero = [c async for c in await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, temperature=0,
                                                          echo=True, logprobs=1, stream=True)]
    assert "".join(c.choices[0].text for c in zero) == prompt
    assert zero[-1].choices[0].finish_reason == "length"


async def test_vllm_prompt_logprobs_field(http, engine):
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: logprob, rank, decoded_token},
    the prompt's token first; on each completions choice, beside the choices of a chat answer."""
    ids = engine.tokenizer("Once upon a time there was").input_ids
    scores = await engine_prompt_scores(engine, ids, 3)
    response = await http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 2,
                                                          "temperature": 0, "prompt_logprobs": 3})
    assert response.status_code == 200
    field = response.json()["choices"][0]["prompt_logprobs"]
    assert len(field) == len(ids) and field[0] is None
    for position, (entry, score) in enumerate(zip(field[1:], scores[1:]), start=1):
        first_id, first = next(iter(entry.items()))
        assert int(first_id) == ids[position] and first["rank"] == score.rank
        assert first["logprob"] == pytest.approx(score.logprob, abs=1e-5)
        assert first["decoded_token"] == engine.tokenizer.convert_ids_to_tokens(ids[position]).replace("Ġ", " ")
        ranked = [v["rank"] for k, v in entry.items() if int(k) != ids[position] or v["rank"] <= 3]
        assert 3 <= len(entry) <= 4 and set(range(1, 4)) <= set(ranked)
    chat = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "prompt_logprobs": 0})
    body = chat.json()
    assert chat.status_code == 200 and body["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in body["prompt_logprobs"][1:])
    plain = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert "prompt_logprobs" not in plain.json()


async def test_token_id_prompts_and_batches(oai, engine):
    texts = ["Once upon a time", "The quick brown fox jumps"]
    ids = [engine.tokenizer(t).input_ids for t in texts]
    common = dict(model=MODEL, max_tokens=6, temperature=0.8, seed=11, n=2)
    by_text = await oai.completions.create(prompt=texts[0], **common)
    by_ids = await oai.completions.create(prompt=ids[0], **common)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage.model_dump() == by_text.usage.model_dump()
    second = await oai.completions.create(prompt=ids[1], **common)
    for batch in (texts, ids):
        out = await oai.completions.create(prompt=batch, **common)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt_index * n + choice_index
        assert [c.text for c in out.choices] == [c.text for c in by_text.choices + second.choices]
        assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])
        assert out.usage.completion_tokens == by_text.usage.completion_tokens + second.usage.completion_tokens
    chunks = [c async for c in await oai.completions.create(prompt=ids, stream=True, **common)]
    streamed: dict[int, str] = {}
    for c in chunks:
        streamed[c.choices[0].index] = streamed.get(c.choices[0].index, "") + c.choices[0].text
    assert streamed == {i: c.text for i, c in enumerate(by_text.choices + second.choices)}


async def test_logit_bias(oai, engine):
    """OpenAI's logit_bias: +100 makes a token every greedy choice, -100 keeps the greedy one out, as the
    engine's sampler gives them; the reported log-probabilities stay the model's (before the bias)."""
    ids = engine.tokenizer("Once upon a time there was").input_ids
    free = await engine_token_ids(engine, ids, max_tokens=6, ignore_eos=True)
    forced = ids[1]
    out = await oai.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=0,
                                       logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == engine.tokenizer.decode([forced] * 6, skip_special_tokens=True)
    assert all(lp < -0.1 for lp in out.choices[0].logprobs.token_logprobs)  # ~0 had the bias been counted
    banned = await engine_token_ids(engine, ids, max_tokens=6, ignore_eos=True, logit_bias={free[0]: -100})
    assert banned[0] != free[0]
    out = await oai.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                       logit_bias={str(free[0]): -100}, extra_body={"ignore_eos": True})
    assert out.choices[0].text == engine.tokenizer.decode(banned, skip_special_tokens=True)
    chat = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=3, temperature=0,
                                             logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == engine.tokenizer.decode([forced] * 3, skip_special_tokens=True)


async def test_allowed_token_ids_and_bad_words(oai, engine):
    """vLLM's allowed_token_ids and bad_words reach the sampler from both endpoints: the answers are the
    engine's own under the same restriction."""
    ids = engine.tokenizer("Once upon a time there was").input_ids
    free = await engine_token_ids(engine, ids, max_tokens=8, ignore_eos=True)
    allowed = sorted(set(free[2:]) | {ids[1]})
    restricted = await engine_token_ids(engine, ids, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed)
    assert set(restricted) <= set(allowed) and restricted != free
    out = await oai.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert out.choices[0].text == engine.tokenizer.decode(restricted, skip_special_tokens=True)
    word = engine.tokenizer.decode(free[:2])
    unsaid = await engine_token_ids(engine, ids, max_tokens=8, ignore_eos=True, bad_words=[word])
    assert unsaid != free
    out = await oai.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True, "bad_words": [word]})
    assert out.choices[0].text == engine.tokenizer.decode(unsaid, skip_special_tokens=True)
    chat_ids = engine.prompts.chat_prompt_ids(HELLO)
    expected = await engine_token_ids(engine, chat_ids, max_tokens=4, allowed_token_ids=allowed)
    chat = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, temperature=0,
                                             extra_body={"allowed_token_ids": allowed})
    assert chat.choices[0].message.content == engine.tokenizer.decode(expected, skip_special_tokens=True)


async def test_cache_salt_shares_the_prefix_cache_only_within_a_salt(http):
    """vLLM's cache_salt: a prompt sent again finds its blocks cached under its own salt only (usage's
    cached_tokens); the outputs are the same either way."""
    prompt = "A prompt of several blocks for the salted cache: " + " ".join(str(i) for i in range(40))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}

    async def cached(**extra) -> tuple[int, str]:
        out = (await http.post("/v1/completions", json={**body, **extra})).json()
        return out["usage"]["prompt_tokens_details"]["cached_tokens"], out["choices"][0]["text"]

    first, text = await cached(cache_salt="tenant-a")
    assert first == 0
    again, same = await cached(cache_salt="tenant-a")
    assert again > 0 and same == text
    for other in ({"cache_salt": "tenant-b"}, {}):
        assert await cached(**other) == (0, text)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 2, "cache_salt": "c"}
    usages = [(await http.post("/v1/chat/completions", json=chat)).json()["usage"] for _ in range(2)]
    assert usages[0]["prompt_tokens_details"]["cached_tokens"] == 0 < usages[1]["prompt_tokens_details"]["cached_tokens"]


async def test_beam_search_answers_the_offline_engines_beams(oai, engine, tiny_llama3_dir):
    """vLLM's use_beam_search: the n choices are the n best beams, as `LLM.beam_search` finds them (itself
    checked against transformers: test_beam_search.py), on completions and chat."""
    from bento_pagedllm import LLM, BeamSearchParams

    offline = LLM(tiny_llama3_dir, dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=MAX_LEN)
    prompt = "Beams of the tiny model:"
    chat_ids = apply_chat_template(engine.tokenizer, HELLO, True)
    expected = offline.beam_search([prompt, chat_ids], BeamSearchParams(width=3, max_tokens=6, length_penalty=0.5))
    completion = await oai.completions.create(model=MODEL, prompt=prompt, n=3, max_tokens=6,
                                              extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert [c.text for c in completion.choices] == [c.text for c in expected[0].outputs]
    assert [c.finish_reason for c in completion.choices] == [c.finish_reason for c in expected[0].outputs]
    assert completion.usage.completion_tokens == sum(len(c.token_ids) for c in expected[0].outputs)
    chat = await oai.chat.completions.create(model=MODEL, messages=HELLO, n=3, max_tokens=6,
                                             extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.message.content for c in chat.choices] == [c.text for c in expected[1].outputs]
    # a batch of prompts: each prompt's beams, as choices n * prompt + beam
    batch = await oai.completions.create(model=MODEL, prompt=[prompt, "Another"], n=3, max_tokens=6,
                                         extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [c.index for c in batch.choices] == list(range(6))
    assert [c.text for c in batch.choices[:3]] == [c.text for c in expected[0].outputs]
    assert await wait_idle(engine)


async def test_priority_orders_the_queue_under_the_priority_policy(tiny_llama3_dir):
    """vLLM's `priority` (the server's scheduling_policy "priority"): with the one seat taken, a request of a
    lower value sent after one of a higher value runs first; chat, completions and responses take the field."""
    engine = tiny_engine(tiny_llama3_dir, max_num_seqs=1, scheduling_policy="priority")
    scheduler = engine.engine.scheduler
    finished: list[str] = []

    async def until(condition) -> None:
        while not condition():
            await asyncio.sleep(0.001)

    try:
        async with http_client(mount(lambda: engine)) as http:
            async def complete(name: str, priority: int, max_tokens: int) -> None:
                body = {"model": MODEL, "prompt": name, "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "priority": priority}
                assert (await http.post("/v1/completions", json=body)).status_code == 200
                finished.append(name)

            holder = asyncio.create_task(complete("holder", 0, MAX_LEN - 16))
            await until(lambda: scheduler.num_running == 1)
            low = asyncio.create_task(complete("low", 5, 4))
            await until(lambda: scheduler.num_waiting == 1)
            high = asyncio.create_task(complete("high", -5, 4))
            await until(lambda: scheduler.num_waiting == 2)
            assert not finished, "the holder ended before both were queued: the test proves nothing"
            await asyncio.gather(holder, low, high)
            assert finished == ["holder", "high", "low"]
            chat = {"model": MODEL, "messages": HELLO, "max_tokens": 2, "priority": 3}
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            responses = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "priority": -1}
            assert (await http.post("/v1/responses", json=responses)).status_code == 200
        assert await wait_idle(engine)
    finally:
        engine.shutdown()


PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                                "age": {"type": "integer", "minimum": 0, "maximum": 150}},
                 "required": ["name", "age"], "additionalProperties": False}


async def test_structured_outputs(oai, engine):
    """OpenAI's response_format (json_schema, json_object) and vLLM's structured_outputs (regex, choice,
    grammar) through the `openai` client, on a model with random weights: every answer fits, streamed text
    equals the non-streamed text, and n choices each fit."""
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    chat = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=60, temperature=0,
                                             response_format=person)
    text = chat.choices[0].message.content
    value = json.loads(text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 10
    assert chat.choices[0].finish_reason == "stop"
    stream = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=60, temperature=0,
                                               response_format=person, stream=True)
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == text
    sampled = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=60, temperature=1, n=3,
                                                seed=4, response_format={"type": "json_object"})
    for choice in sampled.choices:  # NOTE: any object: a random model may still be inside a string at max_tokens
        text = choice.message.content
        assert isinstance(json.loads(text), dict) if choice.finish_reason == "stop" else text.startswith("{")
    for extension, fits in [({"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
                            ({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                            ({"grammar": 'start: "x" ("+" "x")*'}, lambda t: re.fullmatch(r"x(\+x)*", t))]:
        out = await oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=1, seed=1,
                                           n=2, extra_body={"structured_outputs": extension})
        assert all(fits(c.text) and c.finish_reason == "stop" for c in out.choices), (extension, out.choices)
        # vLLM's older guided_* fields: the same constraint, the same answer
        ((kind, value),) = extension.items()
        guided = await oai.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=1, seed=1,
                                              n=2, extra_body={f"guided_{kind}": value})
        assert [c.text for c in guided.choices] == [c.text for c in out.choices]
    plain = await oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5, temperature=0,
                                              response_format={"type": "text"})
    assert plain.choices[0].message.content == engine.tokenizer.decode(
        await engine_token_ids(engine, apply_chat_template(engine.tokenizer, HELLO), max_tokens=5),
        skip_special_tokens=True)


async def test_max_tokens_left_out(http):
    """Completions: 16 tokens (OpenAI's legacy default, and vLLM's), null too, at most the rest of the window;
    chat: the rest of the window."""
    completion = {"model": MODEL, "ignore_eos": True, "temperature": 0}
    for extra in ({}, {"max_tokens": None}):
        short = (await http.post("/v1/completions", json={**completion, **extra, "prompt": [5] * 8})).json()
        assert short["usage"]["completion_tokens"] == 16 and short["choices"][0]["finish_reason"] == "length"
    r = await http.post("/v1/completions", json={**completion, "prompt": [5] * (MAX_LEN - 4)})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    chat = (await http.post("/v1/chat/completions", json={**CHAT, "ignore_eos": True, "temperature": 0})).json()
    assert chat["usage"]["total_tokens"] == MAX_LEN and chat["choices"][0]["finish_reason"] == "length"


async def test_the_models_generation_config_sets_the_sampling_defaults(tiny_llama3_dir, tmp_path):
    """As vLLM's `--generation-config auto`: a request that leaves sampling fields out gets the model's
    recommendation (here top_k 1, so greedy whatever the temperature, and at most 6 tokens); with the
    defaults off (PAGEDLLM_GENERATION_CONFIG=none), OpenAI's (temperature 1, no filter, the rest of the window)."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama3_dir, model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps(
        {**config, "do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 1.0, "max_new_tokens": 6}))
    engine = tiny_engine(str(model_dir))
    try:
        assert engine.prompts.sampling_defaults == {"temperature": 0.7, "top_k": 1, "max_tokens": 6}
        chat = {"model": MODEL, "messages": HELLO, "ignore_eos": True, "seed": 3}
        for defaults in (True, False):
            async with http_client(mount(lambda: engine, model_sampling_defaults=defaults)) as client:
                left_out = (await client.post("/v1/chat/completions", json=chat)).json()
                greedy = (await client.post("/v1/chat/completions", json={**chat, "temperature": 0,
                                                                          "max_tokens": 6})).json()
                explicit = (await client.post("/v1/chat/completions", json={**chat, "top_k": -1,
                                                                            "max_tokens": 6})).json()
                response = (await client.post("/v1/responses", json={"model": MODEL, "input": "Hi",
                                                                     "max_output_tokens": 2})).json()
            # a response repeats the sampling it got: the model's temperature, or OpenAI's default
            assert response["temperature"] == (0.7 if defaults else 1.0) and response["top_p"] == 1.0
            if defaults:
                assert left_out["usage"]["completion_tokens"] == 6
                assert left_out["choices"][0]["message"] == greedy["choices"][0]["message"]
                # a field the request gives wins over the model's (top_k -1: no filter, so sampled at 0.7)
                assert explicit["choices"][0]["message"] != greedy["choices"][0]["message"]
            else:
                assert left_out["usage"]["completion_tokens"] > 6  # the rest of the window
                assert left_out["choices"][0]["message"]["content"] != greedy["choices"][0]["message"]["content"]
        assert await wait_idle(engine)
    finally:
        engine.shutdown()


async def test_a_chat_template_for_a_model_without_one(tiny_llama3_dir, tmp_path):
    """vLLM's --chat-template (EngineArgs.chat_template, PAGEDLLM_CHAT_TEMPLATE): a base model without a template
    answers chat requests with a 400 saying how to give one; given one, inline or as a file, chats render by it."""
    from bento_pagedllm import EngineArgs, LLMEngine

    model_dir = tmp_path / "base"
    shutil.copytree(tiny_llama3_dir, model_dir)
    (model_dir / "chat_template.jinja").unlink()
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    engine = tiny_engine(str(model_dir))
    try:
        async with http_client(mount(lambda: engine)) as client:
            r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 2})
            assert "PAGEDLLM_CHAT_TEMPLATE" in error_of(r, 400)["message"]
            ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        engine.shutdown()
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    (tmp_path / "plain.jinja").write_text(template)
    for given in (template, str(tmp_path / "plain.jinja")):
        chats = LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64,
                                     chat_template=given))
        rendered = chats.tokenizer.decode(chats.chat_prompt_ids(HELLO))
        assert rendered == "<user>Hello there, how are you?\n>", rendered
    with pytest.raises(ValueError, match="neither a Jinja template nor a readable file"):
        LLMEngine(EngineArgs(model=str(model_dir), dtype="float32", device="cpu", chat_template="missing.jinja"))


async def test_add_special_tokens_false_leaves_the_bos_out(tiny_llama3_dir, tmp_path):
    """vLLM's add_special_tokens on completions: a tokenizer that writes a BOS before a text prompt (here
    SmolLM2's, told to) does so unless the request says false; /tokenize counts the same."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama3_dir, model_dir)
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    bos = {"id": "<|im_start|>", "type_id": 0}
    spec["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": bos},
                                                                      {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"SpecialToken": bos}, {"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 0}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                                  "tokens": ["<|im_start|>"]}}}
    (model_dir / "tokenizer.json").write_text(json.dumps(spec))
    engine = tiny_engine(str(model_dir))
    try:
        plain = engine.tokenizer("Once upon a time", add_special_tokens=False).input_ids
        assert engine.tokenizer("Once upon a time").input_ids == [1] + plain
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        async with http_client(mount(lambda: engine)) as client:
            for add, ids in ((True, [1] + plain), (False, plain)):
                extra = {} if add else {"add_special_tokens": False}
                out = (await client.post("/v1/completions", json={**body, **extra})).json()
                assert out["usage"]["prompt_tokens"] == len(ids)
                expected = await engine_token_ids(engine, ids, max_tokens=3, ignore_eos=True)
                assert out["choices"][0]["text"] == engine.tokenizer.decode(expected, skip_special_tokens=True)
        assert await wait_idle(engine)
    finally:
        engine.shutdown()


async def test_vllms_output_and_prompt_options(engine, http):
    """vLLM's include_stop_str_in_output (the matched stop string kept), skip_special_tokens (false: their text
    kept) and truncate_prompt_tokens (the prompt's last k tokens only)."""
    base = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = (await http.post("/v1/completions", json=base)).json()["choices"][0]["text"]
    stop = text[4:7]
    cut = text.find(stop)
    for keep, expected in ((False, text[:cut]), (True, text[:cut + len(stop)])):
        r = await http.post("/v1/completions", json={**base, "stop": [stop], "include_stop_str_in_output": keep})
        assert r.json()["choices"][0]["text"] == expected and r.json()["choices"][0]["finish_reason"] == "stop"
        assert r.json()["choices"][0]["stop_reason"] == stop  # vLLM's: which stop ended it
    # a stop token id is named too, streamed as well (in the chunk with the finish reason)
    second = (await engine_token_ids(engine, base["prompt"], max_tokens=3, ignore_eos=True))[1]
    by_id = {**base, "stop_token_ids": [second]}
    assert (await http.post("/v1/completions", json=by_id)).json()["choices"][0]["stop_reason"] == second
    events = sse_events((await http.post("/v1/completions", json={**by_id, "stream": True})).text)
    assert [c["stop_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == [second]

    eos = engine.tokenizer.eos_token_id
    forced = {**base, "max_tokens": 2, "logit_bias": {str(eos): 100}}  # the end-of-text token, twice
    skipped = (await http.post("/v1/completions", json=forced)).json()["choices"][0]["text"]
    kept = (await http.post("/v1/completions", json={**forced, "skip_special_tokens": False})).json()
    assert skipped == "" and kept["choices"][0]["text"] == engine.tokenizer.eos_token * 2

    ids = engine.tokenizer(base["prompt"]).input_ids
    cut_short = await http.post("/v1/completions", json={**base, "truncate_prompt_tokens": 3})
    from_ids = await http.post("/v1/completions", json={**base, "prompt": ids[-3:]})
    assert cut_short.json()["usage"]["prompt_tokens"] == 3
    assert cut_short.json()["choices"][0]["text"] == from_ids.json()["choices"][0]["text"]
    whole = await http.post("/v1/completions", json={**base, "truncate_prompt_tokens": 1000})
    assert whole.json()["usage"]["prompt_tokens"] == len(ids)
    chat = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 1,
                                                         "truncate_prompt_tokens": 5})
    assert chat.json()["usage"]["prompt_tokens"] == 5
    # -1: the model's context length (vLLM's): a longer prompt is cut to the window, which then leaves no room
    longest = await http.post("/v1/completions", json={**base, "prompt": [5] * (MAX_LEN + 50), "max_tokens": 1,
                                                        "truncate_prompt_tokens": -1})
    assert f"({MAX_LEN} in the prompt, 1 in the completion)" in error_of(longest, 400)["message"]
    fits = await http.post("/v1/completions", json={**base, "prompt": ids, "truncate_prompt_tokens": -1})
    assert fits.json()["usage"]["prompt_tokens"] == len(ids)
    for refused in (0, -2):
        assert error_of(await http.post("/v1/completions", json={**base, "truncate_prompt_tokens": refused}),
                        400)["param"] == "truncate_prompt_tokens"


async def test_return_tokens_as_token_ids(engine, http):
    """vLLM's return_tokens_as_token_ids: log-probabilities name tokens `token_id:N` (chat and completions), the
    ids the answer is made of; the text is the same."""
    base = {"model": MODEL, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    chat = {**base, "messages": HELLO, "logprobs": True, "top_logprobs": 2}
    plain = (await http.post("/v1/chat/completions", json=chat)).json()["choices"][0]
    named = (await http.post("/v1/chat/completions", json={**chat, "return_tokens_as_token_ids": True})).json()
    named = named["choices"][0]
    assert named["message"] == plain["message"]
    ids = [int(t["token"].removeprefix("token_id:")) for t in named["logprobs"]["content"]]
    assert engine.tokenizer.decode(ids) == plain["message"]["content"]
    for entry in named["logprobs"]["content"]:
        assert entry["bytes"] == list(entry["token"].encode())
        assert all(top["token"].startswith("token_id:") for top in entry["top_logprobs"])
    completion = {**base, "prompt": "Once upon", "logprobs": 1, "return_tokens_as_token_ids": True}
    r = (await http.post("/v1/completions", json=completion)).json()["choices"][0]
    ids = [int(t.removeprefix("token_id:")) for t in r["logprobs"]["tokens"]]
    assert engine.tokenizer.decode(ids) == r["text"]
    assert all(key.startswith("token_id:") for top in r["logprobs"]["top_logprobs"] for key in top)


async def test_chat_template_options(engine, http):
    """vLLM's add_generation_prompt, continue_final_message and chat_template_kwargs reach the template."""
    opened = [*HELLO, {"role": "assistant", "content": "Well, I think"}]
    body = {"model": MODEL, "messages": opened, "max_tokens": 3, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    r = await http.post("/v1/chat/completions", json=body)
    expected = apply_chat_template(engine.tokenizer, opened, add_generation_prompt=False, continue_final_message=True)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(expected)
    assert engine.tokenizer.decode(expected).endswith("Well, I think")  # the turn left open
    r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": HELLO, "max_tokens": 1,
                                                      "add_generation_prompt": False})
    assert r.json()["usage"]["prompt_tokens"] == len(apply_chat_template(engine.tokenizer, HELLO, False))

    tokenizer = engine.prompts.tokenizer
    template = tokenizer.chat_template
    tokenizer.chat_template = "{{ greeting | default('') }}{% for m in messages %}{{ m.content }}{% endfor %}"
    request = {"model": MODEL, "messages": HELLO, "max_tokens": 1}
    try:
        plain = (await http.post("/v1/chat/completions", json=request)).json()
        greeted = (await http.post("/v1/chat/completions", json={
            **request, "chat_template_kwargs": {"greeting": "Hello hello hello. "}})).json()
    finally:
        tokenizer.chat_template = template
    assert greeted["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]


async def test_stop(oai, engine):
    prompt = "Once upon a time there was"
    ids = engine.tokenizer(prompt).input_ids
    expected = await engine_token_ids(engine, ids, max_tokens=24, ignore_eos=True)
    free = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                        extra_body={"ignore_eos": True})
    text = free.choices[0].text
    assert text == engine.tokenizer.decode(expected, skip_special_tokens=True)
    stop = text[6:9]
    cut = text[: text.find(stop)]
    for stops in (stop, [stop, "never appears zzz"]):
        out = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stops,
                                           extra_body={"ignore_eos": True})
        assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
        chunks = [c async for c in await oai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stops, stream=True,
            extra_body={"ignore_eos": True})]
        assert "".join(c.choices[0].text for c in chunks) == cut
        assert chunks[-1].choices[0].finish_reason == "stop"
    # vLLM's stop_token_ids: ends at (and counts) the first occurrence of that token
    out = await oai.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True, "stop_token_ids": [expected[3]]})
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == expected.index(expected[3]) + 1


# ---- errors -------------------------------------------------------------------------------------------

CHAT = {"model": MODEL, "messages": HELLO}
BAD_REQUESTS = [
    # (path, body, status, param, code)
    ("/chat/completions", {**CHAT, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("/chat/completions", {**CHAT, "temperature": 2.5}, 400, "temperature", "invalid_value"),
    ("/chat/completions", {**CHAT, "n": 0}, 400, "n", "invalid_value"),
    ("/chat/completions", {**CHAT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/chat/completions", {**CHAT, "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/chat/completions", {**CHAT, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs", "invalid_value"),
    ("/chat/completions", {**CHAT, "presence_penalty": -3}, 400, "presence_penalty", "invalid_value"),
    ("/chat/completions", {**CHAT, "stream": "yes"}, 400, "stream", "invalid_type"),
    ("/chat/completions", {**CHAT, "stop": 5}, 400, "stop", "invalid_type"),
    ("/chat/completions", {**CHAT, "logit_bias": {"five": 1.0}}, 400, "logit_bias", None),
    ("/chat/completions", {**CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value"),
    ("/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"49152": 1}}, 400, "logit_bias", None),
    ("/chat/completions", {"model": 5, "messages": HELLO}, 400, "model", "invalid_type"),
    ("/chat/completions", {"model": MODEL}, 400, "messages", "missing_required_parameter"),
    ("/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "invalid_value"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, 400,
     "messages[0].role", "invalid_value"),
    ("/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages[0].content[0].type",
     "invalid_value"),
    ("/completions", {"model": MODEL, "prompt": 5}, 400, "prompt", "invalid_type"),
    ("/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "prompt[1]", "invalid_value"),
    ("/completions", {"model": MODEL, "prompt": []}, 400, "prompt", None),
    ("/completions", {"model": MODEL, "prompt": [49152]}, 400, "prompt", None),  # beyond the vocabulary
    ("/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", None),  # the engine: empty prompt
    ("/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("/completions", {"model": MODEL, "prompt": "x", "stop_token_ids": [10 ** 6]}, 400, "stop_token_ids", None),
    ("/completions", {"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix", None),
    ("/completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "stream": True}, 400, "stream", None),
    ("/completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "logprobs": 1}, 400, "logprobs", None),
    ("/completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "n": 11}, 400, "n", None),
    ("/chat/completions", {**CHAT, "use_beam_search": True, "response_format": {"type": "json_object"}}, 400,
     "use_beam_search", None),
    ("/chat/completions", {**CHAT, "use_beam_search": True, "length_penalty": "long"}, 400, "length_penalty",
     "invalid_type"),
    ("/completions", {"model": MODEL, "prompt": "x", "cache_salt": ""}, 400, "cache_salt", "invalid_value"),
    ("/completions", {"model": MODEL, "prompt": "x", "priority": 1}, 400, "priority", None),  # FCFS: 0 only
    ("/chat/completions", {**CHAT, "priority": -1}, 400, "priority", None),
    ("/chat/completions", {**CHAT, "priority": "high"}, 400, "priority", "invalid_type"),
    ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),  # echo only
    ("/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ("/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs", "invalid_value"),
    ("/completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs",
     None),
    ("/chat/completions", {**CHAT, "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs", None),
    ("/completions", {"model": MODEL, "prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", None),
    ("/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": [49152]}, 400, "allowed_token_ids", None),
    ("/completions", {"model": MODEL, "prompt": "x", "allowed_token_ids": []}, 400, "allowed_token_ids",
     "invalid_value"),
    ("/chat/completions", {**CHAT, "bad_words": ["w"] * 65}, 400, "bad_words", "invalid_value"),
    ("/chat/completions", {**CHAT, "bad_words": "w"}, 400, "bad_words", "invalid_type"),
    ("/chat/completions", {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format.type", "invalid_value"),
    ("/chat/completions", {**CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format", None),
    ("/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objectx"}}}}, 400, "response_format", None),
    ("/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": 5}}},
     400, "response_format.json_schema.schema", "invalid_type"),
    ("/chat/completions", {**CHAT, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     400, "structured_outputs", None),
    ("/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "(a"}}, 400,
     "structured_outputs", None),
    ("/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"choice": []}}, 400,
     "structured_outputs.choice", "invalid_value"),
    ("/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"regex": "a", "grammar": "start: \"a\""}},
     400, "structured_outputs", None),
    ("/completions", {"model": MODEL, "prompt": "x", "structured_outputs": {"grammar": "start: nothing"}}, 400,
     "structured_outputs", None),
    ("/chat/completions", {**CHAT, "continue_final_message": True}, 400, "continue_final_message", None),
    ("/chat/completions", {**CHAT, "continue_final_message": True, "add_generation_prompt": False}, 400,
     "continue_final_message", None),
    ("/chat/completions", {**CHAT, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs", None),
    ("/chat/completions", {**CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template", None),
    ("/tokenize", {"model": MODEL, "messages": HELLO, "chat_template": "{{ messages }}"}, 400, "chat_template", None),
    ("/chat/completions", {**CHAT, "chat_template_kwargs": {"return_tensors": "pt"}}, 400, "chat_template_kwargs",
     None),
    # messages OpenAI refuses: no content (an assistant's may hold tool calls instead), a tool's answer to no call
    ("/chat/completions", {**CHAT, "messages": [{"role": "user", "content": None}]}, 400, "messages[0].content",
     "missing_required_parameter"),
    ("/chat/completions", {**CHAT, "messages": [*HELLO, {"role": "assistant"}]}, 400, "messages[1].content",
     "missing_required_parameter"),
    ("/chat/completions", {**CHAT, "messages": [*HELLO, {"role": "tool", "content": "42"}]}, 400,
     "messages[1].tool_call_id", "missing_required_parameter"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "system"}]}, 400, "messages[0].content",
     "missing_required_parameter"),
    ("/completions", {"model": "gpt-4o", "prompt": "x"}, 404, None, "model_not_found"),
    ("/chat/completions", {"model": "gpt-4o", "messages": HELLO}, 404, None, "model_not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD_REQUESTS)
async def test_bad_requests(http, path, body, status, param, code):
    error = error_of(await http.post("/v1" + path, json=body), status)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code and error["message"]


async def test_a_request_without_a_model_is_for_the_served_one(http):
    """vLLM's: `model` left out (or null) names the served model, in the answer too."""
    for path, body in (("/v1/chat/completions", {"messages": HELLO}), ("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/responses", {"input": "Hi"}), ("/v1/chat/completions", {"model": None, "messages": HELLO})):
        r = await http.post(path, json={**body, "max_tokens" if "responses" not in path else "max_output_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == MODEL, r.text


async def test_the_clients_request_id_names_the_answer(http):
    """vLLM's: the answer's id from X-Request-Id (echoed back), else from the body's `request_id`; the same id
    twice at once still runs as two requests; an id unfit for a header or an id is not used."""
    async def ask(path, body, headers=None):
        r = await http.post(path, json={**body, "max_tokens": 2}, headers=headers or {})
        assert r.status_code == 200, r.text
        return r

    both = await asyncio.gather(*(ask("/v1/chat/completions", CHAT, {"X-Request-Id": "trace-42"}) for _ in range(2)))
    assert [r.json()["id"] for r in both] == ["chatcmpl-trace-42"] * 2
    assert all(r.headers["x-request-id"] == "trace-42" for r in both)
    streamed = await ask("/v1/completions", {"model": MODEL, "prompt": "Hi", "stream": True}, {"X-Request-Id": "s-1"})
    assert streamed.headers["x-request-id"] == "s-1"
    assert all(e["id"] == "cmpl-s-1" for e in sse_events(streamed.text)[:-1])
    by_body = await ask("/v1/completions", {"model": MODEL, "prompt": "Hi", "request_id": "job-7"})
    assert by_body.json()["id"] == "cmpl-job-7" and "x-request-id" not in by_body.headers
    odd = await ask("/v1/completions", {"model": MODEL, "prompt": "Hi", "request_id": "a b/c"})
    assert odd.json()["id"].startswith("cmpl-") and "a b" not in odd.json()["id"]


async def test_return_token_ids(http, engine):
    """vLLM's return_token_ids: the prompt's and each choice's token ids beside the text (completions name the
    prompt on each choice, chat beside the choices); a stream asking for them gets a 400."""
    ids = engine.tokenizer("Once upon a time").input_ids
    out = (await http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 4, "n": 2,
                                                     "temperature": 0, "return_token_ids": True})).json()
    greedy = await engine_token_ids(engine, ids, max_tokens=4)
    assert [(c["prompt_token_ids"], c["token_ids"]) for c in out["choices"]] == [(ids, greedy)] * 2
    chat = (await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "temperature": 0,
                                                           "return_token_ids": True})).json()
    assert chat["prompt_token_ids"] == apply_chat_template(engine.tokenizer, HELLO)
    assert engine.tokenizer.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    plain = (await http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1})).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "stream": True,
                                                 "return_token_ids": True})
    assert error_of(r, 400)["param"] == "return_token_ids"


async def test_a_seed_outside_64_bits_is_refused_in_plain_words(http):
    for seed in (1 << 64, -(1 << 63) - 1):
        error = error_of(await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "seed": seed}), 400)
        assert error["param"] == "seed" and error["code"] == "invalid_value"
        assert error["message"] == "Invalid value for 'seed': Input should be at least -2**63 and below 2**64."
    for seed in ((1 << 64) - 1, -(1 << 63)):
        ok = await http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "seed": seed, "max_tokens": 1})
        assert ok.status_code == 200, ok.text


async def test_malformed_json_and_non_objects(http):
    for content in (b"{not json", b"", b'[1, 2]', b'"text"'):
        r = await http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
        error = error_of(r, 400)
        assert error["type"] == "invalid_request_error" and error["param"] is None


async def test_json_in_any_encoding_json_loads_reads(http):
    """A body with a UTF-8 byte-order mark, or in UTF-16 or UTF-32 (RFC 8259's encodings, which Python's
    `json.loads`, vLLM's parser, reads): the same answer as plain UTF-8."""
    body = json.dumps({"model": MODEL, "prompt": "Olé ☕", "max_tokens": 3, "temperature": 0}, ensure_ascii=False)
    plain = (await http.post("/v1/completions", content=body.encode())).json()["choices"][0]["text"]
    for encoded in (b"\xef\xbb\xbf" + body.encode(), body.encode("utf-16"), body.encode("utf-16-le"),
                    body.encode("utf-32")):
        r = await http.post("/v1/completions", content=encoded, headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain, r.text
    r = await http.post("/v1/completions", content=b"\xff\xfe{\x00", headers={"content-type": "application/json"})
    assert error_of(r, 400)["type"] == "invalid_request_error"  # cut-short UTF-16: still a 400


async def test_context_window(engine, http, oai):
    prompt_tokens = len(apply_chat_template(engine.tokenizer, HELLO))
    r = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1000})
    error = error_of(r, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    requested, over = prompt_tokens + 1000, prompt_tokens + 1000 - MAX_LEN
    assert f"maximum context length is {MAX_LEN} tokens" in error["message"]
    assert f"you requested {requested} tokens ({prompt_tokens} in the messages, 1000 in the completion)" in (
        error["message"])
    assert f"by {over} tokens" in error["message"]
    # a prompt that fills the window leaves no room when max_tokens is absent
    r = await http.post("/v1/completions", json={"model": MODEL, "prompt": [5] * (MAX_LEN + 10)})
    error = error_of(r, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert f"resulted in {MAX_LEN + 10} tokens" in error["message"] and "by 11 tokens" in error["message"]
    # through the official client
    with pytest.raises(openai.BadRequestError) as info:
        await oai.completions.create(model=MODEL, prompt=[5] * 1000, max_tokens=100)
    assert info.value.status_code == 400 and info.value.body["code"] == "context_length_exceeded"


async def test_body_too_large(engine):
    app = mount(lambda: engine, max_body_bytes=1000)
    async with http_client(app) as client:
        error = error_of(await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2000}), 413)
        assert error["type"] == "invalid_request_error"
        ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


async def test_unknown_routes(http):
    assert error_of(await http.post("/v1/embeddings", json={}), 404)["type"] == "invalid_request_error"
    error_of(await http.get("/v1/completions"), 405)


async def test_server_errors(engine, app):
    def no_engine():
        raise RuntimeError("secret internal detail")

    async with http_client(mount(no_engine)) as client:
        error = error_of(await client.post("/v1/chat/completions", json=CHAT), 500)
        assert error["type"] == "server_error" and "secret" not in error["message"]
    # a request that fails inside the engine (the fault-injection hook: a sampling error at its 3rd token)
    engine.engine.token_hook = FaultInjection(seed=666, after_tokens=3)
    try:
        async with http_client(app) as client:
            body = {**CHAT, "max_tokens": 50, "ignore_eos": True, "seed": 666}
            error_of(await client.post("/v1/chat/completions", json=body), 500)
            r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    finally:
        engine.engine.token_hook = None
    assert r.status_code == 200  # the status line was sent before the failure
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert set(events[-1]) == {"error"} and events[-1]["error"]["type"] == "server_error"
    assert "[DONE]" not in events and "InjectedFault" not in r.text  # internals stay in the log


async def test_api_key(engine):
    app = mount(lambda: engine, api_key=KEY)
    async with http_client(app) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                        {"Authorization": f"Basic {KEY}"}):
            # every path behind /v1, unknown ones and the API's description included
            for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/v1/nope"),
                                 ("GET", "/v1/openapi.json")):
                r = await client.request(method, path, json=CHAT, headers=headers)
                error = error_of(r, 401)
                assert error["code"] == "invalid_api_key" and KEY not in r.text
        assert (await client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
    good, bad = openai_client(app, KEY), openai_client(app, "sk-wrong")
    r = await good.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
    assert r.choices[0].message.role == "assistant"
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await good.close()
    await bad.close()


# ---- disconnects --------------------------------------------------------------------------------------


LONG = {"max_tokens": 800, "ignore_eos": True, "temperature": 0, "stream": True}


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
async def test_disconnect_mid_stream_aborts(app, engine, aborted, spec_version):
    status, chunks, running = await call_asgi(app, "/chat/completions", {**CHAT, **LONG}, disconnect_after=4,
                                              spec_version=spec_version, engine=engine)
    # the engine stream is closed by the time the app returns (not later, by garbage collection)
    assert not engine._active_ids
    assert status == 200 and 4 <= len(chunks) < 10
    # the role chunk goes out at once, every content chunk while the request is still generating: streamed,
    # not buffered
    assert all(running[1:])
    assert await wait_idle(engine)
    assert len(aborted) == 1 and aborted[0].startswith("chatcmpl-")


async def test_disconnect_aborts_every_engine_stream(app, engine, aborted):
    payload = {"model": MODEL, "prompt": ["Once upon a time", "The quick brown fox"], "n": 3, **LONG}
    status, chunks, running = await call_asgi(app, "/completions", payload, disconnect_after=3, engine=engine)
    assert not engine._active_ids
    assert status == 200 and max(running) == 2  # one engine request per prompt, each with its 3 choices
    assert await wait_idle(engine)
    assert len(aborted) == 2


async def test_disconnect_before_a_non_streamed_answer_aborts(app, engine, aborted):
    payload = {**CHAT, **LONG, "stream": False, "n": 2}
    status, chunks, _ = await call_asgi(app, "/chat/completions", payload, disconnect_delay=0.3, engine=engine)
    assert not engine._active_ids
    assert status == 499 and not any(chunks)  # the work was cancelled: no answer
    assert await wait_idle(engine)
    assert len(aborted) == 1


async def test_disconnect_during_a_beam_search_aborts_its_step(app, engine, aborted):
    """A beam search's client gone: the search stops (no next step), its step's requests are closed, nothing
    is left running. NOTE: a one-token request is usually done in the engine by then: an abort is not counted."""
    payload = {**CHAT, "max_tokens": 800, "n": 4, "use_beam_search": True}
    status, chunks, _ = await call_asgi(app, "/chat/completions", payload, disconnect_delay=0.3, engine=engine)
    assert not engine._active_ids
    assert status == 499 and not any(chunks)
    assert await wait_idle(engine)
    assert len(aborted) <= 4  # at most the beams of the step in flight


async def test_real_server_disconnect(app, engine, aborted):
    uvicorn = pytest.importorskip("uvicorn")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            async with client.stream("POST", "/v1/chat/completions", json={**CHAT, **LONG}) as r:
                assert r.status_code == 200
                lines = []
                async for line in r.aiter_lines():
                    if line:
                        lines.append(line)
                    if len(lines) == 3:
                        assert engine.engine.requests  # still generating while we read
                        break
        assert await wait_idle(engine)
        assert len(aborted) == 1
    finally:
        server.should_exit = True
        await serving


async def test_a_stream_interval_writes_fewer_times_and_the_same_events(engine, app):
    """PAGEDLLM_STREAM_INTERVAL=4: the first token at once, then a write per 4 tokens and the last; the events
    (one per token, then the finish) and their text are those of interval 1."""
    payload = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 17, "temperature": 0,
               "ignore_eos": True, "stream": True}
    answers = {}
    for interval in (1, 4):
        status, writes, _ = await call_asgi(mount(lambda: engine, stream_interval=interval), "/completions", payload)
        assert status == 200
        events = sse_events(b"".join(writes).decode())
        answers[interval] = (len(writes), [e if e == "[DONE]" else e["choices"] for e in events])
    (writes_1, events_1), (writes_4, events_4) = answers[1], answers[4]
    assert events_4 == events_1 and len(events_1) == 17 + 2  # 17 tokens, the finish chunk, [DONE]
    # interval 1: a write per token (the last with the finish chunk), then [DONE]; interval 4: the first
    # token, 16 more in fours (the last with the finish chunk), then [DONE]. NOTE: at most: outputs that
    # queued while the loop was busy share a write
    assert writes_4 <= 1 + 4 + 1 < writes_1 <= 17 + 1
    with pytest.raises(ValueError):
        mount(lambda: engine, stream_interval=0)


async def test_outputs_queued_behind_a_busy_loop_share_one_write(engine, app):
    """A loop that fell behind the engine writes what queued meanwhile at once (the same events)."""
    payload = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 17, "temperature": 0,
               "ignore_eos": True, "stream": True}
    def choices(writes):
        return [e if e == "[DONE]" else e["choices"] for e in sse_events(b"".join(writes).decode())]

    _, plain, _ = await call_asgi(app, "/completions", payload)
    status, writes, _ = await call_asgi(app, "/completions", payload, block_after_first_s=1.0)
    assert status == 200 and choices(writes) == choices(plain)
    # the first token, everything generated while the loop was blocked (the rest, with the finish), [DONE]
    assert len(writes) == 3, [w[:60] for w in writes]


def test_the_engine_process_setting():
    """PAGEDLLM_ENGINE_PROCESS: unset means on with CUDA only; true and false override it."""
    from bento_pagedllm import EngineArgs
    from bento_pagedllm.settings import ServiceSettings

    cpu, cuda = EngineArgs(model="m", device="cpu"), EngineArgs(model="m", device="cuda")
    auto = ServiceSettings.from_env({})
    assert auto.engine_process is None and not auto.use_engine_process(cpu) and auto.use_engine_process(cuda)
    assert ServiceSettings.from_env({"PAGEDLLM_ENGINE_PROCESS": "true"}).use_engine_process(cpu)
    assert not ServiceSettings.from_env({"PAGEDLLM_ENGINE_PROCESS": "false"}).use_engine_process(cuda)
    with pytest.raises(ValueError, match="ENGINE_PROCESS"):
        ServiceSettings.from_env({"PAGEDLLM_ENGINE_PROCESS": "sometimes"})


@pytest.mark.parametrize("machine_has_gpus", [False, True])
def test_the_resources_follow_the_device_then_the_bento_argument(monkeypatch, machine_has_gpus):
    """What the service asks BentoML for: PAGEDLLM_DEVICE when it names one, else the bento argument
    `accelerator` (so a bento built on a CPU machine asks for its GPU), else the machine's GPUs."""
    from bento_pagedllm.settings import ServiceSettings

    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if machine_has_gpus else None)
    on_cpus = {"cpu": str(os.cpu_count() or 1)}
    machine = {"gpu": 1} if machine_has_gpus else on_cpus
    assert ServiceSettings.from_env({}).resources == machine
    assert ServiceSettings.from_env({"PAGEDLLM_DEVICE": "cuda"}).resources == {"gpu": 1}
    assert ServiceSettings.from_env({"PAGEDLLM_DEVICE": "cuda:0", "PAGEDLLM_TENSOR_PARALLEL_SIZE": "2"}).resources == {"gpu": 2}
    assert ServiceSettings.from_env({"PAGEDLLM_DEVICE": "cpu"}, accelerator="gpu").resources == on_cpus
    assert ServiceSettings.from_env({}, accelerator="gpu").resources == {"gpu": 1}
    assert ServiceSettings.from_env({}, accelerator="cpu").resources == on_cpus
    assert "device" not in ServiceSettings.from_env({}, accelerator="gpu").engine  # the engine's device: its own
    with pytest.raises(ValueError, match="accelerator='tpu'"):
        ServiceSettings.from_env({}, accelerator="tpu")


def test_the_api_key_setting_takes_vllms_variable_too():
    from bento_pagedllm.settings import ServiceSettings

    assert ServiceSettings.from_env({}).api_key is None
    assert ServiceSettings.from_env({"VLLM_API_KEY": "v"}).api_key == "v"
    assert ServiceSettings.from_env({"VLLM_API_KEY": "v", "PAGEDLLM_API_KEY": "p"}).api_key == "p"


def test_the_chat_template_setting():
    from bento_pagedllm.settings import ServiceSettings

    assert ServiceSettings.from_env({}).engine_args("/m").chat_template is None
    given = ServiceSettings.from_env({"PAGEDLLM_CHAT_TEMPLATE": "/etc/templates/llama.jinja"})
    assert given.engine_args("/m").chat_template == "/etc/templates/llama.jinja"


def test_the_trace_requests_setting():
    """PAGEDLLM_TRACE_REQUESTS: unset or false keeps /v1 out of BentoML's tracing (a span per streamed chunk);
    true leaves BentoML's tracing config alone."""
    from bento_pagedllm.settings import ServiceSettings

    assert ServiceSettings.from_env({}).tracing_config == {"excluded_urls": ["/v1/"]}
    assert ServiceSettings.from_env({"PAGEDLLM_TRACE_REQUESTS": "true"}).tracing_config == {}
    with pytest.raises(ValueError, match="TRACE_REQUESTS"):
        ServiceSettings.from_env({"PAGEDLLM_TRACE_REQUESTS": "maybe"})


def test_the_scheduling_policy_setting(tiny_llama3_dir):
    from bento_pagedllm.config import SchedulingPolicy
    from bento_pagedllm.prompts import PromptProcessor
    from bento_pagedllm.settings import ServiceSettings

    settings = ServiceSettings.from_env({"PAGEDLLM_SCHEDULING_POLICY": "priority"})
    assert PromptProcessor(settings.engine_args(tiny_llama3_dir)).configs.scheduler.policy is SchedulingPolicy.PRIORITY
    assert "scheduling_policy" not in ServiceSettings.from_env({}).engine  # the engine's default: fcfs
    with pytest.raises(ValueError, match="SCHEDULING_POLICY"):
        ServiceSettings.from_env({"PAGEDLLM_SCHEDULING_POLICY": "lifo"})


def test_the_stream_interval_setting():
    from bento_pagedllm.settings import ServiceSettings

    assert ServiceSettings.from_env({}).stream_interval == 1
    assert ServiceSettings.from_env({"PAGEDLLM_STREAM_INTERVAL": "4"}).stream_interval == 4
    with pytest.raises(ValueError, match="STREAM_INTERVAL"):
        ServiceSettings.from_env({"PAGEDLLM_STREAM_INTERVAL": "0"})


def test_the_generation_config_setting():
    from bento_pagedllm.settings import ServiceSettings

    assert ServiceSettings.from_env({}).generation_config == "auto"
    assert ServiceSettings.from_env({"PAGEDLLM_GENERATION_CONFIG": "none"}).generation_config == "none"
    with pytest.raises(ValueError, match="GENERATION_CONFIG"):
        ServiceSettings.from_env({"PAGEDLLM_GENERATION_CONFIG": "vllm"})
