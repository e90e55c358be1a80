"""vLLM's `POST /tokenize` and `POST /detokenize` (bento_pagedllm/openai/tokenization.py), in process on the tiny
random Llama: the ids are those the generation endpoints send the model (their usage counts agree), and ids
come back as their text. The real server serves them at its root too (tests/test_service.py)."""

from __future__ import annotations

import pytest
from api_helpers import HELLO, MAX_LEN, MODEL, error_of

from bento_pagedllm.tokenizer import apply_chat_template

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


async def test_a_prompt_counts_as_completions_count_it(engine, http):
    text = "The quick brown fox jumps over the lazy dog."
    r = await http.post("/v1/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200
    answer = r.json()
    assert answer == {"count": len(answer["tokens"]), "max_model_len": MAX_LEN,
                      "tokens": engine.tokenizer(text).input_ids, "token_strs": None}
    completion = await http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == answer["count"]
    # the model may be left out, as in vLLM's; special tokens left out on request; the tokens' own strings
    plain = (await http.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False,
                                                   "return_token_strs": True})).json()
    assert plain["tokens"] == engine.tokenizer(text, add_special_tokens=False).input_ids
    assert plain["token_strs"] == engine.tokenizer.convert_ids_to_tokens(plain["tokens"])


async def test_a_chat_counts_as_chat_completions_count_it(engine, http):
    for extra in ({}, {"tools": TOOLS}, {"add_generation_prompt": False},
                  {"messages": [*HELLO, {"role": "assistant", "content": "Well"}], "add_generation_prompt": False,
                   "continue_final_message": True}):
        request = {"model": MODEL, "messages": HELLO, **extra}
        r = await http.post("/v1/tokenize", json=request)
        assert r.status_code == 200, r.text
        chat = await http.post("/v1/chat/completions", json={**request, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"], extra
    rendered = apply_chat_template(engine.tokenizer, HELLO)
    assert (await http.post("/v1/tokenize", json={"messages": HELLO})).json()["tokens"] == rendered


async def test_detokenize_gives_the_ids_text(engine, http):
    text = "Hello, world! 123"
    ids = (await http.post("/v1/tokenize", json={"prompt": text, "add_special_tokens": False})).json()["tokens"]
    r = await http.post("/v1/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": engine.tokenizer.decode(ids)}
    assert r.json()["prompt"] == text
    assert (await http.post("/v1/detokenize", json={"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/tokenize", {"model": MODEL}, 400, "prompt"),
    ("/v1/tokenize", {"prompt": "x", "messages": HELLO}, 400, "messages"),
    ("/v1/tokenize", {"prompt": "x", "tools": TOOLS}, 400, "tools"),
    ("/v1/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ("/v1/tokenize", {"messages": HELLO, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/v1/tokenize", {"messages": HELLO, "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs"),
    ("/v1/tokenize", {"messages": HELLO, "continue_final_message": True}, 400, "continue_final_message"),
    ("/v1/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/v1/tokenize", {"model": "nope", "prompt": "x"}, 404, None),
    ("/v1/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/v1/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/v1/detokenize", {}, 400, "tokens"),
    ("/v1/detokenize", {"model": "nope", "tokens": [1]}, 404, None),
])
async def test_bad_requests(http, path, body, status, param):
    assert error_of(await http.post(path, json=body), status)["param"] == param


async def test_the_openapi_document_describes_them(http):
    paths = (await http.get("/v1/openapi.json")).json()["paths"]
    assert {"/tokenize", "/detokenize"} <= set(paths)
    assert (await http.get("/v1/tokenize")).status_code == 405
