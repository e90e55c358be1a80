"""OpenAI's error object, `{"error": {"message", "type", "param", "code"}}`, and the exceptions that map to it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse


class OpenAIError(Exception):
    """An error answered to the client as OpenAI answers it (status code plus error object)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: Mapping[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status, headers={**self.headers, **(headers or {})})


def server_error(message: str = "The server had an error while processing your request.") -> OpenAIError:
    return OpenAIError(message, status=500, type="server_error")


def overloaded(retry_after_s: int) -> OpenAIError:
    """Backpressure: too many requests wait already. 503 with Retry-After, which OpenAI's clients honour."""
    return OpenAIError("The server is currently overloaded with other requests. Please retry after "
                       f"{retry_after_s} s.", status=503, type="server_error", code="engine_overloaded",
                       headers={"Retry-After": str(retry_after_s)})


def shutting_down(retry_after_s: int) -> OpenAIError:
    return OpenAIError("The server is shutting down. Please retry on another instance or later.", status=503,
                       type="server_error", code="server_shutting_down",
                       headers={"Retry-After": str(retry_after_s)})


def timed_out(error: Exception) -> OpenAIError:
    return OpenAIError(f"The request was aborted: {error}.", status=504, type="server_error",
                       code="request_timeout")


def invalid_json() -> OpenAIError:
    return OpenAIError(
        "We could not parse the JSON body of your request: the API expects a JSON object as the body.",
    )


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        f"The model `{model}` does not exist or you do not have access to it.", status=404, code="model_not_found"
    )


def param_from_loc(loc: tuple[int | str, ...], field_names: frozenset[str]) -> str | None:
    """`("messages", 0, "content", "str")` -> `"messages[0].content"`.

    pydantic adds the member it tried to a location inside a union (`"str"`, `"list[int]"`, a class name):
    parts that are neither an index nor one of our field names are left out.
    """
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in field_names:
            param += f".{part}" if param else part
    return param or None


def from_validation_error(error: ValidationError, field_names: frozenset[str]) -> OpenAIError:
    """A request that failed validation: 400 naming the first offending parameter."""
    errors = error.errors(include_url=False)
    first = errors[0]
    if first["loc"]:
        # NOTE: a union reports one error per member; the most specific of the first field's errors (a value
        # out of range rather than "not a string", the deepest location) says best what is wrong.
        same_field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
        first = max(same_field, key=lambda e: (not _is_type_error(e["type"]), len(e["loc"])))
    kind = first["type"]
    if kind == "json_invalid":
        return invalid_json()
    param = param_from_loc(tuple(first["loc"]), field_names)
    if param is None:
        return OpenAIError("The request body must be a JSON object.", code="invalid_type")
    if kind == "missing":
        return OpenAIError(f"Missing required parameter: '{param}'.", param=param,
                           code="missing_required_parameter")
    code = "invalid_type" if _is_type_error(kind) else "invalid_value"
    return OpenAIError(f"Invalid value for '{param}': {first['msg']}.", param=param, code=code)


def _is_type_error(kind: str) -> bool:
    return kind.endswith(("_type", "_parsing"))
