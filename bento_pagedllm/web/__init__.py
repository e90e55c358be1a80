"""The chat page at /chat: plain HTML, CSS and ES modules in `static/`, served as they are (no build step, nothing
fetched from elsewhere at run time). The page talks to the OpenAI API at /v1 like any other client."""

from .app import STATIC_DIR, build_chat_app

__all__ = ["STATIC_DIR", "build_chat_app"]
