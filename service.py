"""The BentoML service: it owns the engine (in its own process, no extra hop per token) and mounts the
OpenAI-compatible API at /v1 and the chat page at /chat (bento_pagedllm/web/). Settings come from the
environment: see bento_pagedllm/settings.py.

NOTE: this module is also imported by BentoML's supervisor; the engine is built in `__init__`, which runs
only in the serving worker.
"""

from __future__ import annotations

import bentoml

from bento_pagedllm.openai.routes import build_openai_app
from bento_pagedllm.settings import ServiceSettings
from bento_pagedllm.web import build_chat_app

SETTINGS = ServiceSettings.from_env()

openai_app = build_openai_app(
    lambda: bentoml.get_current_service().engine,
    model_name=SETTINGS.model_name,
    api_key=SETTINGS.api_key,
)

# NOTE: the page itself needs no key (it holds no data); it asks for one when /v1 answers 401.
chat_app = build_chat_app()


@bentoml.asgi_app(openai_app, path="/v1")
@bentoml.asgi_app(chat_app, path="/chat")
@bentoml.service(
    name="pagedllm",
    resources=SETTINGS.resources,
    # NOTE: traffic.timeout bounds the time to the first byte only; streams may run longer.
    traffic={"timeout": 600},
)
class PagedLLM:
    model = bentoml.models.BentoModel(SETTINGS.model)

    def __init__(self) -> None:
        from bento_pagedllm import AsyncLLMEngine
        from bento_pagedllm.metrics import EngineMetrics

        self.engine = AsyncLLMEngine(
            SETTINGS.engine_args(self.model.path), observer=EngineMetrics(SETTINGS.model_name)
        )
        self.engine.start()

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        self.engine.shutdown()


svc = PagedLLM
