"""The API's OpenAPI 3.1 document, served at `GET /v1/openapi.json`.

The request bodies' schemas are generated from the pydantic models in protocol.py, so the document cannot drift
from what the server accepts; the tests fuzz the server against it (schemathesis). Every error status is
documented with OpenAI's error object.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest, TokenizeRequest

_REF = "#/components/schemas/{model}"

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

# NOTE: for text/event-stream the schema describes one event (as OpenAPI 3.2's itemSchema does): its `data` is
# a JSON chunk, an error object or [DONE]; the Responses API's events also name their type in `event`
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"event": {"type": "string"}, "data": {"type": "string"}}}

# status -> when it is answered
_ERRORS = {
    "400": "Invalid request (bad JSON, a parameter out of range, a prompt too long for the context)",
    "401": "Missing or wrong API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "500": "The engine failed while serving the request",
    "503": "Overloaded (too many requests waiting) or shutting down; see Retry-After",
    "504": "The request ran past the server's time limit",
}


def _error_responses() -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    return {status: {"description": why, "content": content} for status, why in _ERRORS.items()}


def _generation(summary: str, body_model: str, result: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": _REF.format(model=body_model)}}}},
            "responses": {
                "200": {"description": f"The {result} (JSON), or its chunks as Server-Sent Events when stream is true",
                        "content": {"application/json": {"schema": {"type": "object"}},
                                    "text/event-stream": {"schema": _SSE_EVENT}}},
                **_error_responses(),
            },
        }
    }


def _json_post(summary: str, body_model: str, result: dict[str, Any]) -> dict[str, Any]:
    """A POST whose answer is one JSON object of the `result` schema."""
    content = {"application/json": {"schema": {"$ref": _REF.format(model=body_model)}}}
    return {"post": {"summary": summary, "requestBody": {"required": True, "content": content},
                     "responses": {"200": {"description": summary,
                                           "content": {"application/json": {"schema": result}}},
                                   **_error_responses()}}}


# vLLM's answers (tokenization.py)
_TOKENIZE_RESPONSE = {
    "type": "object", "required": ["count", "max_model_len", "tokens", "token_strs"],
    "properties": {"count": {"type": "integer"}, "max_model_len": {"type": "integer"},
                   "tokens": {"type": "array", "items": {"type": "integer"}},
                   "token_strs": {"type": ["array", "null"], "items": {"type": "string"}}},
}
_DETOKENIZE_RESPONSE = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}


def _model_card_path(summary: str, schema: dict[str, Any], parameters: list | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {
        "summary": summary,
        "responses": {"200": {"description": summary, "content": {"application/json": {"schema": schema}}},
                      **_error_responses()},
    }
    if parameters:
        operation["parameters"] = parameters
    return {"get": operation}


def openapi_document(model_name: str, *, secured: bool) -> dict[str, Any]:
    """The document for a server of `model_name`; `secured` when every operation needs the bearer key."""
    _, defs = models_json_schema([(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
                                  (ResponsesRequest, "validation"), (TokenizeRequest, "validation"),
                                  (DetokenizeRequest, "validation")], ref_template=_REF)
    schemas = {**defs["$defs"], "ErrorResponse": _ERROR_SCHEMA}
    # NOTE: the only model name that resolves is the served one (never a path): the document says so
    served = {"type": "string", "enum": [model_name]}
    for body in ("CompletionRequest", "ChatCompletionRequest", "ResponsesRequest"):
        schemas[body]["properties"]["model"] = served
    for body in ("TokenizeRequest", "DetokenizeRequest"):  # NOTE: optional there, as in vLLM's
        schemas[body]["properties"]["model"] = {"anyOf": [served, {"type": "null"}]}
    model_param = [{"name": "model", "in": "path", "required": True, "schema": served}]
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "bento-pagedllm OpenAI-compatible API", "version": "1",
                 "description": f"Serves the model `{model_name}`."},
        "servers": [{"url": "/v1"}],
        "paths": {
            "/completions": _generation("Create a completion", "CompletionRequest", "completion"),
            "/chat/completions": _generation("Create a chat completion", "ChatCompletionRequest", "chat completion"),
            "/responses": _generation("Create a response", "ResponsesRequest", "response"),
            "/tokenize": _json_post("Tokenize a prompt or a chat (vLLM's; also at the server's root)",
                                    "TokenizeRequest", _TOKENIZE_RESPONSE),
            "/detokenize": _json_post("Detokenize token ids (vLLM's; also at the server's root)",
                                      "DetokenizeRequest", _DETOKENIZE_RESPONSE),
            "/models": _model_card_path("List the models", {"type": "object"}),
            "/models/{model}": _model_card_path("Retrieve a model", {"type": "object"}, model_param),
        },
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
    if secured:
        document["security"] = [{"bearer": []}]
    return document
