"""The OpenAI-compatible HTTP API (a Starlette app that BentoML mounts at /v1)."""

from .errors import OpenAIError
from .routes import build_openai_app

__all__ = ["OpenAIError", "build_openai_app"]
