"""The real thing: `bentoml serve service:svc` in a subprocess (conftest's `server`), driven by the official
openai client."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pydantic
import pytest
from server_helpers import API_KEY, MAX_MODEL_LEN, MODEL

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=300)


CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_and_model_store_labels(client, smollm2_model):
    assert [m.id for m in client.models.list().data] == [MODEL]
    labels = smollm2_model.info.labels
    assert labels["arch"] == "LlamaForCausalLM" and labels["dtype"] == "float32"
    assert labels["params"] == "135M" and labels["context_length"] == "8192"


def test_chat_streaming_equals_non_streaming_and_arrives_over_time(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=40)
    assert "Paris" in full.choices[0].message.content and full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens > 3 and full.object == "chat.completion"
    chunks, times = [], []
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=40,
                                                stream=True, stream_options={"include_usage": True}):
        chunks.append(chunk)
        times.append(time.perf_counter())
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 5  # token by token
    text = "".join(c.choices[0].delta.content for c in content)
    assert text == full.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and chunks[-1].choices == []
    assert times[-1] - times[0] > 0.05  # not buffered to the end: CPU decode takes tens of ms a token


def test_completions_stream_equals_non_stream(client):
    prompt = "The three primary colors are"
    full = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=20)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=20, stream=True))
    assert streamed == full.choices[0].text and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20


def test_n_stop_seed_logprobs(client):
    two = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, temperature=1.0, max_tokens=12, seed=3)
    assert [c.index for c in two.choices] == [0, 1]
    again = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, temperature=1.0, max_tokens=12, seed=3)
    assert [c.message.content for c in again.choices] == [c.message.content for c in two.choices]
    stopped = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=40, stop=["Paris"])
    assert "Paris" not in stopped.choices[0].message.content and stopped.choices[0].finish_reason == "stop"
    lp = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=5, logprobs=True,
                                        top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)


class City(pydantic.BaseModel):
    """What `client.chat.completions.parse` asks for: OpenAI's strict JSON schema of a pydantic model."""

    city: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    population_millions: float


def test_structured_outputs_through_the_openai_sdk(client):
    """The SDK's structured-output helper sends the pydantic model as response_format's json_schema and
    parses the answer back into it; vLLM's `structured_outputs` extension picks from a list (SmolLM2 knows
    this one)."""
    asked = [{"role": "user", "content": "Which city is the capital of France? Answer as JSON."}]
    parsed = client.chat.completions.parse(model=MODEL, messages=asked, temperature=0, max_tokens=80,
                                           response_format=City)
    answer = parsed.choices[0].message.parsed
    assert isinstance(answer, City) and parsed.choices[0].finish_reason == "stop"
    # NOTE: whole sentences: a bare "London" would win on its first token "L", the model's second choice
    # after "The" (constrained greedy decoding picks the best allowed token, not the best whole answer)
    sentences = [f"The capital of France is {city}." for city in ("London", "Paris", "Berlin")]
    choice = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20,
                                            extra_body={"structured_outputs": {"choice": sentences}})
    assert choice.choices[0].message.content == sentences[1] and choice.choices[0].finish_reason == "stop"


def test_the_responses_api_through_the_openai_sdk(client):
    """OpenAI's Responses API against the real server: SmolLM2 answers as in chat, streamed events and all."""
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=40)
    response = client.responses.create(model=MODEL, input=CHAT[0]["content"], temperature=0, max_output_tokens=40)
    assert response.status == "completed" and "Paris" in response.output_text
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    with client.responses.stream(model=MODEL, input=CHAT[0]["content"], temperature=0,
                                 max_output_tokens=40) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) >= 5 and "".join(deltas) == final.output_text == response.output_text
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt, thrice: cached blocks


def test_32_concurrent_streams_are_independent(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=600)
        prompts = [f"Write the number {i} in words." for i in range(32)]

        async def stream(p):
            out = await client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=12, stream=True)
            return "".join([c.choices[0].text async for c in out])

        async def whole(p):
            return (await client.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=12)).choices[0].text

        streamed = await asyncio.gather(*(stream(p) for p in prompts))
        alone = [await whole(p) for p in prompts[:4]]
        await client.close()
        return streamed, alone

    streamed, alone = asyncio.run(run())
    assert streamed[:4] == alone
    assert len(set(streamed)) > 16  # different prompts, different answers
    server.wait_idle()


def test_disconnect_mid_stream_frees_everything(server):
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 1500, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        lines = 0
        for line in response.iter_lines():
            lines += bool(line)
            if lines >= 3:
                break
    assert server.metric("pagedllm_kv_blocks_total") == 512
    server.wait_idle()
    assert server.metric("pagedllm_requests_aborted_total") >= 1


def test_errors_through_the_server(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    no_key = httpx.post(f"{server.base}/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    unknown = httpx.post(f"{server.base}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=headers)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    too_long = httpx.post(f"{server.base}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 5000},
                          headers=headers)
    assert too_long.status_code == 400 and "2048" in too_long.json()["error"]["message"]
    # unknown /v1 paths reach the API: OpenAI's 404, behind the key like every /v1 path
    assert httpx.get(f"{server.base}/v1/embeddings").status_code == 401
    nope = httpx.get(f"{server.base}/v1/embeddings", headers=headers)
    assert nope.status_code == 404 and nope.json()["error"]["type"] == "invalid_request_error"
    # a known path with the wrong method: the API's 405 (BentoML mounts the app's routes and, after them, the API
    # for every other /v1 path: service.OpenAIAPI)
    wrong_method = httpx.get(f"{server.base}/v1/chat/completions", headers=headers)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"


def test_vllms_tokenizer_endpoints_at_the_root_and_under_v1(client, server):
    """vLLM's clients strip /v1 and call /tokenize at the server's root; the counts are the chat path's."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    usage = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage
    for base in (server.base, f"{server.base}/v1"):
        r = httpx.post(f"{base}/tokenize", json={"model": MODEL, "messages": CHAT}, headers=headers)
        assert r.status_code == 200 and r.json()["count"] == usage.prompt_tokens, (base, r.text)
        assert r.json()["max_model_len"] == MAX_MODEL_LEN
        text = "Paris is the capital of France."
        ids = httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False},
                         headers=headers).json()["tokens"]
        back = httpx.post(f"{base}/detokenize", json={"tokens": ids}, headers=headers)
        assert back.status_code == 200 and back.json() == {"prompt": text}
        no_key = httpx.post(f"{base}/tokenize", json={"prompt": text})
        assert no_key.status_code == 401 and no_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base}/tokenize", headers=headers).status_code == 405


def test_the_worker_froze_its_startup_heap(server):
    """The serving worker freezes what it built at start-up (torch, transformers, bentoml, the tokenizer), so the
    collector's full passes, which stop the event loop writing every stream, never traverse it (service.py)."""
    import re

    frozen = [int(n) for n in re.findall(r"froze the startup heap \((\d+) objects\)", server.log_path.read_text())]
    assert len(frozen) == 1 and frozen[0] > 50_000  # one worker; its heap holds at least the imported modules


def test_the_worker_serves_on_uvloop(server):
    """uvicorn takes uvloop (and httptools) when installed, as pyproject asks: each streamed token is a write
    through the worker's event loop, which uvloop runs with less CPU a write (BENCHMARKS.md)."""
    assert "serving on uvloop's event loop" in server.log_path.read_text()


def test_the_openai_routes_make_no_tracing_spans_by_default(server, client):
    """BentoML's OpenTelemetry middleware would open a span around every streamed chunk: with
    PAGEDLLM_TRACE_REQUESTS unset, /v1 is excluded, so its access log lines carry no trace ids (BentoML writes
    them for every request it traced), while BentoML's own routes keep theirs."""
    list(client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, stream=True))
    assert httpx.get(f"{server.base}/docs.json", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    deadline = time.monotonic() + 10  # NOTE: the server writes a request's line after its response ends
    while True:
        lines = server.log_path.read_text().splitlines()
        v1 = [line for line in lines if "path=/v1/completions" in line and "status=200" in line]
        docs = [line for line in lines if "path=/docs.json" in line and "status=200" in line]
        if (v1 and docs) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert v1 and docs, "the access log records both requests"
    assert not any("trace=" in line for line in v1) and all("trace=" in line for line in docs)


def test_vllms_version_endpoint_names_the_installed_package(server):
    from importlib.metadata import version

    r = httpx.get(f"{server.base}/version", headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json() == {"version": version("bento-pagedllm")}
    assert httpx.get(f"{server.base}/version").status_code == 401


def test_health_and_metrics_open_as_configured_the_rest_behind_the_key(server):
    for path in ("/readyz", "/livez", "/healthz", "/health", "/metrics"):  # PAGEDLLM_OPEN_HEALTH_AND_METRICS=true
        assert httpx.get(f"{server.base}{path}").status_code == 200, path
    for path in ("/", "/docs.json", "/schema.json"):
        r = httpx.get(f"{server.base}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path


def test_no_cors_unless_configured(server):
    preflight = httpx.options(f"{server.base}/v1/chat/completions", headers={
        "Origin": "https://example.com", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    r = httpx.get(f"{server.base}/v1/models", headers={"Origin": "https://example.com",
                                                       "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


def test_shared_system_prompt_hits_the_prefix_cache(client, server):
    system = {"role": "system", "content": "You answer in one short sentence. " * 30}
    before = server.metric("pagedllm_prefix_cache_hits_total")
    for question in ("What is the capital of Italy?", "What is the capital of Spain?"):
        client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": question}],
                                       temperature=0, max_tokens=8)
    # the second request reuses the ~200-token system prompt's full blocks
    assert server.metric("pagedllm_prefix_cache_hits_total") - before >= 160
    assert server.metric("pagedllm_prefix_cache_queries_total") > 0


def test_metrics_report_engine_state(server):
    for name in ("pagedllm_requests_running", "pagedllm_requests_waiting", "pagedllm_kv_blocks_used",
                 "pagedllm_prompt_tokens_total", "pagedllm_generation_tokens_total", "pagedllm_preemptions_total",
                 "pagedllm_time_to_first_token_seconds_count", "pagedllm_time_per_output_token_seconds_count"):
        server.metric(name)
    assert server.metric("pagedllm_generation_tokens_total") > 0
    assert server.metric("pagedllm_time_to_first_token_seconds_count") > 0
    # the same measurements under vLLM's names, for dashboards and autoscalers built for vLLM (one scrape, idle)
    twins = {"pagedllm_generation_tokens_total": "vllm:generation_tokens_total",
             "pagedllm_prompt_tokens_total": "vllm:prompt_tokens_total",
             "pagedllm_requests_waiting": "vllm:num_requests_waiting",
             "pagedllm_requests_running": "vllm:num_requests_running",
             "pagedllm_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
             "pagedllm_time_to_first_token_seconds_count": "vllm:time_to_first_token_seconds_count",
             "pagedllm_time_per_output_token_seconds_count": "vllm:request_time_per_output_token_seconds_count",
             "pagedllm_e2e_request_latency_seconds_count": "vllm:e2e_request_latency_seconds_count"}
    server.wait_idle()
    scraped = server.metrics([*twins, *twins.values(), "vllm:kv_cache_usage_perc"])
    assert all(scraped[vllms] == scraped[ours] for ours, vllms in twins.items()), scraped
    assert scraped["vllm:kv_cache_usage_perc"] == 0.0 and scraped["vllm:generation_tokens_total"] > 0
    # every finished request's end-to-end time: as many as its first-token times
    e2e, ttft = (scraped[f"pagedllm_{name}_seconds_count"] for name in ("e2e_request_latency", "time_to_first_token"))
    assert e2e >= ttft > 0


def test_generated_tokens_are_counted_exactly(client, server):
    """With async scheduling a stopped sequence has one more token sampled, which is dropped: the counter
    must count the tokens delivered."""
    before = server.metric("pagedllm_generation_tokens_total")
    stopped = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=12, temperature=0,
                                        stop=[","])
    full = client.completions.create(model=MODEL, prompt="Count: one, two,", max_tokens=9, temperature=0,
                                     extra_body={"ignore_eos": True})
    delivered = stopped.usage.completion_tokens + full.usage.completion_tokens
    assert stopped.choices[0].finish_reason == "stop" and full.usage.completion_tokens == 9
    assert server.metric("pagedllm_generation_tokens_total") - before == delivered
