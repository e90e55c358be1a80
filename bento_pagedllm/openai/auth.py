"""API-key authentication as an ASGI middleware, so that it guards every path of the app it wraps (unknown
routes too), before any handler runs.

NOTE: the key is compared in constant time (digests of equal length, `hmac.compare_digest`), is never put in
a log line or an error message, and never appears in a repr (ServiceSettings hides it).
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import OpenAIError

_MISSING = "You didn't provide an API key: pass it as 'Authorization: Bearer <key>'."
_WRONG = "Incorrect API key provided."


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


class APIKeyMiddleware:
    """Answer 401 with OpenAI's error object unless the request carries `Authorization: Bearer <key>`.

    `open_paths` (exact paths) and `open_prefixes` pass without a key; so do CORS preflights (an OPTIONS
    with `Access-Control-Request-Method`): browsers send them without credentials, and they return no data.
    """

    def __init__(self, app: ASGIApp, *, api_key: str, open_paths: frozenset[str] = frozenset(),
                 open_prefixes: tuple[str, ...] = ()) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        self.app = app
        self._key_digest = _digest(api_key.encode())
        self.open_paths = open_paths
        self.open_prefixes = open_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope):
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _is_open(self, scope: Scope) -> bool:
        path = scope["path"]
        if path in self.open_paths or path.startswith(self.open_prefixes):
            return True
        return scope["method"] == "OPTIONS" and _header(scope, b"access-control-request-method") is not None

    def _check(self, scope: Scope) -> OpenAIError | None:
        scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return OpenAIError(_MISSING, status=401, code="invalid_api_key")
        # NOTE: digests, not the raw strings: compare_digest's time then depends on neither key's length
        if not hmac.compare_digest(_digest(token), self._key_digest):
            return OpenAIError(_WRONG, status=401, code="invalid_api_key")
        return None


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value
    return None
