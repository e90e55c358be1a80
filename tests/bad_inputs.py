"""Hand-written bad requests for the /v1 API, each with the 4xx it must get (always with OpenAI's error object).

Shared by the in-process suite (test_bad_input.py) and the soak against a real server (test_soak.py), which
sends them between well-behaved requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BadInput:
    name: str
    path: str  # under /v1
    body: bytes
    status: int
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=lambda: {"content-type": "application/json"})


def _json(value) -> bytes:
    return json.dumps(value).encode()


def bad_inputs(model: str, *, max_body_bytes: int, vocab_size: int, model_path: str) -> list[BadInput]:
    """Every case for a server of `model` (whose files lie at `model_path`, a name that must not resolve)."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    completion = {"model": model, "prompt": "Hi"}

    def chat_with(**fields) -> bytes:
        return _json({**chat, **fields})

    def completion_with(**fields) -> bytes:
        return _json({**completion, **fields})

    def response_with(**fields) -> bytes:
        return _json({"model": model, "input": "Hi", **fields})

    cases = [
        # malformed JSON and bodies that are not an object
        BadInput("truncated JSON", "/chat/completions", b'{"model": "' + model.encode(), 400),
        BadInput("not JSON", "/chat/completions", b"{not json", 400),
        BadInput("empty body", "/completions", b"", 400),
        BadInput("trailing comma", "/completions", b'{"model": "m", "prompt": "x",}', 400),
        BadInput("array body", "/completions", b"[1, 2]", 400),
        BadInput("null body", "/chat/completions", b"null", 400),
        BadInput("deeply nested", "/completions", b'{"model": "m", "prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
                 400),
        # bodies over the size limit
        BadInput("oversize body", "/completions", completion_with(prompt="x" * (max_body_bytes + 1)), 413),
        # invalid UTF-8 and unpaired surrogates
        BadInput("invalid UTF-8 in model", "/completions", b'{"model": "\xff\xfe", "prompt": "x"}', 400),
        BadInput("invalid UTF-8 in prompt", "/completions",
                 b'{"model": "' + model.encode() + b'", "prompt": "\xc3\x28"}', 400),
        BadInput("lone surrogate", "/chat/completions",
                 b'{"model": "' + model.encode() + b'", "messages": [{"role": "user", "content": "\\ud800"}]}', 400),
        # wrong types
        BadInput("prompt is a number", "/completions", completion_with(prompt=5), 400),
        BadInput("prompt is an object", "/completions", completion_with(prompt={"text": "x"}), 400),
        BadInput("messages is a string", "/chat/completions", chat_with(messages="Hi"), 400),
        BadInput("message is a number", "/chat/completions", chat_with(messages=[1]), 400),
        BadInput("message without role", "/chat/completions", chat_with(messages=[{"content": "Hi"}]), 400),
        BadInput("temperature is a string", "/chat/completions", chat_with(temperature="hot"), 400),
        BadInput("max_tokens is a string", "/completions", completion_with(max_tokens="10"), 400),
        BadInput("n is fractional", "/completions", completion_with(n=1.5), 400),
        BadInput("stream is a string", "/chat/completions", chat_with(stream="yes"), 400),
        BadInput("stop is a number", "/completions", completion_with(stop=5), 400),
        BadInput("model is a number", "/completions", completion_with(model=5), 400),
        BadInput("logprobs is a string", "/chat/completions", chat_with(logprobs="yes"), 400),
        # NaN, infinities and negative numbers
        BadInput("temperature NaN", "/completions",
                 b'{"model": "' + model.encode() + b'", "prompt": "x", "temperature": NaN}', 400),
        BadInput("top_p Infinity", "/completions",
                 b'{"model": "' + model.encode() + b'", "prompt": "x", "top_p": Infinity}', 400),
        BadInput("temperature negative", "/chat/completions", chat_with(temperature=-1), 400),
        BadInput("top_p negative", "/chat/completions", chat_with(top_p=-0.5), 400),
        BadInput("max_tokens negative", "/completions", completion_with(max_tokens=-1), 400),
        BadInput("n negative", "/completions", completion_with(n=-1), 400),
        BadInput("presence_penalty too low", "/chat/completions", chat_with(presence_penalty=-5), 400),
        BadInput("seed too large", "/completions", completion_with(seed=2**70), 400),
        BadInput("top_k below -1", "/completions", completion_with(top_k=-5), 400),
        BadInput("repetition_penalty zero", "/completions", completion_with(repetition_penalty=0), 400),
        # huge n and max_tokens
        BadInput("n huge", "/completions", completion_with(n=10**6), 400),
        BadInput("n above the limit", "/chat/completions", chat_with(n=129), 400),
        BadInput("max_tokens huge", "/completions", completion_with(max_tokens=10**9), 400),
        BadInput("max_tokens 2^63", "/chat/completions", chat_with(max_tokens=2**63), 400),
        BadInput("max_completion_tokens huge", "/chat/completions", chat_with(max_completion_tokens=10**12), 400),
        BadInput("max_tokens 1e300", "/completions",
                 b'{"model": "' + model.encode() + b'", "prompt": "x", "max_tokens": 1e300}', 400),
        # empty or malformed messages, unknown roles
        BadInput("no messages", "/chat/completions", chat_with(messages=[]), 400),
        BadInput("messages missing", "/chat/completions", _json({"model": model}), 400),
        BadInput("unknown role", "/chat/completions", chat_with(messages=[{"role": "robot", "content": "Hi"}]), 400),
        BadInput("empty role", "/chat/completions", chat_with(messages=[{"role": "", "content": "Hi"}]), 400),
        BadInput("role in capitals", "/chat/completions", chat_with(messages=[{"role": "USER", "content": "Hi"}]),
                 400),
        BadInput("image content part", "/chat/completions", chat_with(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}]}]), 400),
        # very long stop lists
        BadInput("1000 stop strings", "/completions", completion_with(stop=["x"] * 1000), 400),
        BadInput("1000 stop token ids", "/completions", completion_with(stop_token_ids=[1] * 1000), 400),
        BadInput("stop token id out of vocabulary", "/completions", completion_with(stop_token_ids=[vocab_size]),
                 400),
        # token-id prompts outside the vocabulary
        BadInput("token id = vocabulary size", "/completions", completion_with(prompt=[vocab_size]), 400),
        BadInput("token id huge", "/completions", completion_with(prompt=[10**12]), 400),
        BadInput("token id negative", "/completions", completion_with(prompt=[1, -1]), 400),
        BadInput("batch with an out-of-vocabulary prompt", "/completions",
                 completion_with(prompt=[[1, 2], [vocab_size + 7]]), 400),
        BadInput("empty prompt list", "/completions", completion_with(prompt=[]), 400),
        BadInput("empty prompt", "/completions", completion_with(prompt=""), 400),
        # unknown models; a model name never resolves to a path
        BadInput("unknown model", "/completions", completion_with(model="gpt-4o"), 404),
        BadInput("model is a relative path", "/chat/completions", chat_with(model="../../../../etc/passwd"), 404),
        BadInput("model is an absolute path", "/completions", completion_with(model="/etc/passwd"), 404),
        BadInput("model is the served model's directory", "/completions", completion_with(model=model_path), 404),
        BadInput("model card of a path", f"/models/{model_path.lstrip('/')}", b"", 404, method="GET"),
        # logit_bias outside its bounds
        BadInput("logit_bias key not a token id", "/chat/completions", chat_with(logit_bias={"x": 1.0}), 400),
        BadInput("logit_bias token out of vocabulary", "/chat/completions",
                 chat_with(logit_bias={str(vocab_size): 1.0}), 400),
        BadInput("logit_bias value beyond 100", "/chat/completions", chat_with(logit_bias={"5": 1e9}), 400),
        # structured outputs that do not parse, or ask for two things at once
        BadInput("response_format schema not a schema", "/chat/completions", chat_with(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}), 400),
        BadInput("response_format json_schema without schema", "/chat/completions",
                 chat_with(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400),
        BadInput("structured_outputs regex that does not parse", "/completions",
                 completion_with(structured_outputs={"regex": "a(b"}), 400),
        BadInput("structured_outputs grammar that does not parse", "/completions",
                 completion_with(structured_outputs={"grammar": "start: ((("}), 400),
        BadInput("structured_outputs with two constraints", "/completions",
                 completion_with(structured_outputs={"regex": "a", "choice": ["a"]}), 400),
        BadInput("response_format and structured_outputs", "/chat/completions",
                 chat_with(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), 400),
        # tool calls that cannot be made
        BadInput("tool_choice required without tools", "/chat/completions", chat_with(tool_choice="required"), 400),
        BadInput("tool_choice names a tool not given", "/chat/completions", chat_with(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}}), 400),
        BadInput("tool parameters not a schema", "/chat/completions", chat_with(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            tool_choice="required"), 400),
        BadInput("earlier tool call arguments not JSON", "/chat/completions", chat_with(messages=[
            {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}]}]),
                 400),
        # the Responses API: what it cannot be
        BadInput("response input missing", "/responses", _json({"model": model}), 400),
        BadInput("response input is a number", "/responses", response_with(input=5), 400),
        BadInput("response input item of no known type", "/responses", response_with(input=[{"type": "nope"}]), 400),
        BadInput("previous_response_id (nothing stored)", "/responses", response_with(previous_response_id="r"), 400),
        BadInput("response output cut to nothing", "/responses", response_with(max_output_tokens=0), 400),
        BadInput("response too long for the context", "/responses", response_with(input="Hi " * 20_000), 400),
        # unsupported parameters
        BadInput("suffix", "/completions", completion_with(suffix="y"), 400),
        # prompt scoring: what it cannot be
        BadInput("prompt_logprobs with stream", "/completions", completion_with(prompt_logprobs=1, stream=True), 400),
        BadInput("prompt_logprobs beyond 20", "/chat/completions", chat_with(prompt_logprobs=21), 400),
        BadInput("max_tokens 0 without echo", "/completions", completion_with(max_tokens=0), 400),
        # unknown routes and methods
        BadInput("unknown route", "/embeddings", _json({"model": model, "input": "x"}), 404),
        BadInput("wrong method", "/completions", b"", 405, method="GET"),
    ]
    assert len({case.name for case in cases}) == len(cases)
    return cases
