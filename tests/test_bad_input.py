"""Bad input, in process on the tiny random Llama: the hand-written cases of bad_inputs.py, then property-based
fuzzing of every /v1 operation against the API's own OpenAPI document (schemathesis, valid and invalid data).

Every bad request gets a 4xx with OpenAI's error object, never a 5xx; after each one the engine holds nothing
and still answers a normal request.
"""

from __future__ import annotations

import collections
import os

import httpx
import pytest
import schemathesis
from api_helpers import MODEL, error_of, http_client, mount, tiny_engine, wait_idle, wait_idle_blocking
from bento_pagedllm.openai import build_openai_app
from bad_inputs import bad_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import positive_data_acceptance

MAX_BODY_BYTES = 64 << 10
MAX_MODEL_LEN = 64  # NOTE: short, so that the fuzzer's valid requests generate little
FUZZ_EXAMPLES = int(os.environ.get("PAGEDLLM_FUZZ_EXAMPLES", "200"))
CASE_NAMES = [case.name for case in bad_inputs(MODEL, max_body_bytes=MAX_BODY_BYTES, vocab_size=1,
                                               model_path="/model")]


@pytest.fixture(scope="module")
def engine(tiny_llama3_dir):
    engine = tiny_engine(tiny_llama3_dir, max_model_len=MAX_MODEL_LEN)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def app(engine):
    return mount(lambda: engine, max_body_bytes=MAX_BODY_BYTES)


@pytest.fixture(scope="module")
def cases(engine, tiny_llama3_dir):
    vocab = engine.engine.model_config.vocab_size
    return {case.name: case for case in bad_inputs(MODEL, max_body_bytes=MAX_BODY_BYTES, vocab_size=vocab,
                                                   model_path=tiny_llama3_dir)}


async def assert_healthy(client: httpx.AsyncClient, engine) -> None:
    assert await wait_idle(engine)
    assert (await client.get("/v1/models")).status_code == 200
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("name", CASE_NAMES)
async def test_bad_input_gets_a_4xx_and_the_server_stays_healthy(app, engine, cases, name):
    case = cases[name]
    async with http_client(app) as client:
        r = await client.request(case.method, "/v1" + case.path, content=case.body, headers=case.headers)
        error = error_of(r, case.status)
        assert error["message"] and error["type"] == "invalid_request_error"
        await assert_healthy(client, engine)


async def test_n_above_the_engines_sequences_is_refused(app, engine):
    """The scheduler seats a request's n choices together: n above max_num_seqs (64 here) would wait forever, and
    block every request behind it."""
    async with http_client(app) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "n": 65, "max_tokens": 1})
        assert "n must be at most 64" in error_of(r, 400)["message"]
        await assert_healthy(client, engine)


def test_fuzz_against_the_openapi_document(engine):
    """Requests drawn from the API's own schema, valid and deliberately invalid: none gets a 5xx; invalid ones a
    4xx; every answer conforms to the documented statuses, content types and schemas; nothing stays behind.

    NOTE: the API app itself, not mounted: a mount (Starlette's, BentoML's) routes no path with a newline, which
    the fuzzer does send; the app answers those too."""
    api = build_openai_app(lambda: engine, model_name=MODEL, max_body_bytes=MAX_BODY_BYTES)
    # NOTE: a schema-violating body may also be too large (a long list of tools): the API's 413 refuses it too
    rejections = {"checks": {"negative_data_rejection": {"expected-statuses": [
        "400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]}}}
    schema = schemathesis.openapi.from_asgi("/openapi.json", api, config=SchemathesisConfig.from_dict(rejections))
    assert {op.ok().label for op in schema.get_all_operations()} == {
        "GET /models", "GET /models/{model}", "POST /completions", "POST /chat/completions", "POST /responses",
        "POST /tokenize", "POST /detokenize"}
    seen: collections.Counter = collections.Counter()

    # NOTE: schema-valid requests may still be refused (a prompt too long for the context, n above the engine's
    # sequences, an unsupported parameter): 400 is allowed for them, and only that check is left out.
    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE)))
    def run(case) -> None:
        response = case.call(base_url="http://testserver")
        seen[(case.meta.generation.mode.value, response.status_code // 100)] += 1
        assert response.status_code < 500, response.text
        case.validate_response(response, excluded_checks=[positive_data_acceptance])
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        assert wait_idle_blocking(engine)

    run()
    # the fuzzer reached the engine (valid requests answered) as well as the validation (invalid ones refused)
    assert seen[("positive", 2)] > 0 and seen[("negative", 4)] > 0, seen
