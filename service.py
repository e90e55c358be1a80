"""The BentoML service: it owns the engine (on a thread of its worker, or in a child process of it:
PAGEDLLM_ENGINE_PROCESS) and mounts the
OpenAI-compatible API at /v1 (with vLLM's /tokenize, /detokenize, /health and /version at the root too) and the chat page at /chat
(bento_pagedllm/web/). Settings come from the
environment: see bento_pagedllm/settings.py.

NOTE: this module is also imported by BentoML's supervisor; the engine is built in `__init__`, which runs
only in the serving worker.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading

import bentoml
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from bento_pagedllm import __version__
from bento_pagedllm.openai.auth import APIKeyMiddleware
from bento_pagedllm.openai.routes import build_openai_app
from bento_pagedllm.settings import ServiceSettings
from bento_pagedllm.web import build_chat_app

logger = logging.getLogger("bento_pagedllm.service")
# NOTE: the bento argument `accelerator` (bentofile.yaml's `args`, `bentoml build --arg accelerator=cpu`) says
# what a bento asks BentoML for wherever it is built; `bentoml serve service:svc` has none (the machine's)
SETTINGS = ServiceSettings.from_env(accelerator=getattr(bentoml.use_arguments(), "accelerator", None))
PROBE_PATHS = frozenset({"/livez", "/healthz", "/readyz", "/health", "/metrics"})

openai_app = build_openai_app(
    lambda: bentoml.get_current_service().engine,
    model_name=SETTINGS.model_name,
    api_key=SETTINGS.api_key,
    max_body_bytes=SETTINGS.max_body_bytes,
    retry_after_s=SETTINGS.retry_after_seconds,
    stream_interval=SETTINGS.stream_interval,
    model_sampling_defaults=SETTINGS.generation_config == "auto",
)

# NOTE: the page itself needs no key (it holds no data); it asks for one when /v1 answers 401.
chat_app = build_chat_app()


class OpenAIAPI:
    """The API behind an ASGI callable that is not a Starlette app.

    NOTE: BentoML mounts a Starlette app "passively" (only the paths its routes match) and lists its routes in
    the bento's schema (`apis/schema.json`, and the `openai_endpoint` label BentoCloud reads). Mounted after the
    app itself at /v1, this callable takes every other /v1 path, so an unknown path gets OpenAI's 404 and a
    wrong method the API's 405, not BentoML's. As a route's endpoint it keeps BentoML from listing the
    API's routes under that route's path.
    """

    async def __call__(self, scope, receive, send) -> None:
        await openai_app(scope, receive, send)


openai_asgi = OpenAIAPI()


async def vllm_health(request: Request) -> Response:
    """vLLM's `GET /health` (what load balancers set up for vLLM probe): 200 while the service takes requests
    (BentoML's /readyz), else 503."""
    return Response(status_code=200 if bentoml.get_current_service().__is_ready__() else 503)


async def vllm_version(request: Request) -> Response:
    """vLLM's `GET /version`: the server's version, as clients and dashboards read it there."""
    return JSONResponse({"version": __version__})


# vLLM serves its tokenizer endpoints, its health check and its version at the root, and clients call them there. NOTE: a
# Starlette app, so BentoML mounts it passively (it takes these paths and nothing else); the tokenizer routes'
# endpoint is the API (an ASGI callable, not a function: Starlette passes it the request's scope as is)
vllm_root_app = Starlette(routes=[
    *(Route(path, openai_asgi, methods=["POST"]) for path in ("/tokenize", "/detokenize")),
    Route("/health", vllm_health, methods=["GET"]),
    Route("/version", vllm_version, methods=["GET"]),
])


@bentoml.asgi_app(openai_asgi, path="/v1")  # NOTE: after the app itself (decorators apply bottom-up): see OpenAIAPI
@bentoml.asgi_app(openai_app, path="/v1")
@bentoml.asgi_app(vllm_root_app, path="/")
@bentoml.asgi_app(chat_app, path="/chat")
@bentoml.service(
    name="pagedllm",
    resources=SETTINGS.resources,
    # NOTE: traffic.timeout bounds the time to the first byte only; streams may run longer
    # (PAGEDLLM_REQUEST_TIMEOUT_SECONDS bounds a whole request).
    traffic={"timeout": 600},
    **({"http": SETTINGS.http_config} if SETTINGS.http_config else {}),
    **({"tracing": SETTINGS.tracing_config} if SETTINGS.tracing_config else {}),
)
class PagedLLM:
    model = bentoml.models.BentoModel(SETTINGS.model)

    def __init__(self) -> None:
        from bento_pagedllm import AsyncLLMEngine
        from bento_pagedllm.engine import freeze_startup_heap
        from bento_pagedllm.metrics import EngineMetrics

        # NOTE: BentoML's server logging keeps the root logger at WARNING and its own at INFO (DEBUG with
        # --debug, ERROR with --quiet): the package's records follow BentoML's level, through its handler
        logging.getLogger("bento_pagedllm").setLevel(logging.getLogger("bentoml").getEffectiveLevel())
        args = SETTINGS.engine_args(self.model.path)
        self.engine = AsyncLLMEngine(
            args, observer=EngineMetrics(SETTINGS.model_name), limits=SETTINGS.request_limits,
            engine_process=SETTINGS.use_engine_process(args),
            token_hook=SETTINGS.fault_injection,  # None unless the operator turned it on
        )
        self.engine.start()
        # NOTE: once the engine runs: the heap built so far (modules, tokenizer, the app) lives as long as the worker
        frozen = freeze_startup_heap()
        logger.info("froze the startup heap (%d objects): the collector's full passes skip them", frozen)
        # NOTE: uvicorn takes uvloop and httptools when they are installed (pyproject): every streamed token
        # goes through this loop, so say which one it is
        logger.info("serving on %s's event loop", _event_loop_library())
        if SETTINGS.generation_config == "auto" and self.engine.prompts.sampling_defaults:
            logger.info("the model's generation_config.json recommends %s: requests that leave these out get them "
                        "(PAGEDLLM_GENERATION_CONFIG=none: OpenAI's defaults)", self.engine.prompts.sampling_defaults)
        self._drain_on_sigterm()

    def _drain_on_sigterm(self) -> None:
        """On SIGTERM, drain the engine (refuse new requests, end those still running after the grace period),
        then hand the signal to the server's own handler.

        NOTE: under BentoML the handler found here is uvicorn's: it stops accepting connections, waits for the
        open ones to finish (the drain bounds that wait), then runs the shutdown hooks; the process exits 0.
        Without a server's handler (SIGTERM's default), nothing is chained.
        """
        previous = signal.getsignal(signal.SIGTERM)
        if not callable(previous) or threading.current_thread() is not threading.main_thread():
            return

        def on_sigterm(signum, frame) -> None:
            self.engine.drain(SETTINGS.shutdown_grace_seconds)
            previous(signum, frame)

        signal.signal(signal.SIGTERM, on_sigterm)

    def __is_ready__(self) -> bool:
        """Ready while the engine runs and takes requests: a draining server leaves the load balancer's pool."""
        return self.engine.is_running and not self.engine.is_draining

    def __is_alive__(self) -> bool:
        return self.engine.dead_error is None

    async def __metrics__(self, content: str) -> str:
        """/metrics, plus what the event loop holds now (runs on the event loop, as `live_gauges` needs)."""
        from bento_pagedllm.metrics import live_gauges

        return content + live_gauges(self.engine, SETTINGS.model_name)

    @bentoml.on_shutdown
    def shutdown(self) -> None:
        self.engine.shutdown()
        gc.unfreeze()  # NOTE: what __init__ froze is collectable again, as after the engine's own shutdown


def _event_loop_library() -> str:
    """'uvloop' or 'asyncio': whose event loop runs this thread (none: 'no')."""
    try:
        return type(asyncio.get_running_loop()).__module__.split(".")[0]
    except RuntimeError:
        return "no"


if SETTINGS.api_key:
    # NOTE: the /v1 app checks the key itself; this covers BentoML's own routes (docs, health, metrics).
    # NOTE: the chat page stays open (it holds no data and asks for the key itself when /v1 answers 401)
    PagedLLM.add_asgi_middleware(APIKeyMiddleware, api_key=SETTINGS.api_key,
                                 open_paths=PROBE_PATHS if SETTINGS.open_health_and_metrics else frozenset(),
                                 open_prefixes=("/chat",))

svc = PagedLLM
