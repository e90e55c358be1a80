"""The chat page as a Starlette app of static files; service.py mounts it at /chat."""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC_DIR = Path(__file__).with_name("static")

# The page needs nothing but its own origin. A strict policy is a second wall behind the Markdown renderer: even
# if model output ever reached the DOM as markup, no inline script, handler or foreign resource would run.
CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])

PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # revalidate every time (cheap: ETag), so an upgraded server never runs next to a stale cached script
    "Cache-Control": "no-cache",
}


class _PageHeaders:
    """Adds PAGE_HEADERS to every response of the page."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in PAGE_HEADERS.items():
                    headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)


def build_chat_app() -> Starlette:
    """`/` serves index.html (html=True); the scripts and styles sit beside it."""
    files = StaticFiles(directory=STATIC_DIR, html=True)
    return Starlette(routes=[Mount("/", app=files)], middleware=[Middleware(_PageHeaders)])
