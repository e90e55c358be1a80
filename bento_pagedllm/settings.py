"""The service's settings, read once from the environment (so a container needs no code change).

| variable | default | meaning |
|---|---|---|
| PAGEDLLM_MODEL | smollm2-135m-instruct:latest | BentoML model tag to serve |
| PAGEDLLM_SERVED_MODEL_NAME | the tag's name | the `model` name clients send |
| PAGEDLLM_API_KEY | unset (else VLLM_API_KEY) | when set, every request needs `Authorization: Bearer <key>` (see below) |
| PAGEDLLM_OPEN_HEALTH_AND_METRICS | false | with an API key: leave /livez, /healthz, /readyz, /health, /metrics open |
| PAGEDLLM_CORS_ALLOW_ORIGINS | unset | comma-separated origins allowed by CORS (none: no CORS headers) |
| PAGEDLLM_MAX_WAITING_REQUESTS | 1024 | requests waiting for their first token; past it, 503 + Retry-After |
| PAGEDLLM_RETRY_AFTER_SECONDS | 1 | the Retry-After of a 503 |
| PAGEDLLM_REQUEST_TIMEOUT_SECONDS | unset | wall-clock limit per request (then aborted: 504 or an error event) |
| PAGEDLLM_SHUTDOWN_GRACE_SECONDS | 30 | on SIGTERM, how long running requests may still finish |
| PAGEDLLM_MAX_BODY_BYTES | 4194304 | largest request body (413 past it) |
| PAGEDLLM_STREAM_INTERVAL | 1 | a streamed answer is written once at least this many new tokens wait (or it ends) |
| PAGEDLLM_TRACE_REQUESTS | false | let BentoML's OpenTelemetry middleware trace the /v1 requests (a span per streamed chunk) |
| PAGEDLLM_ENGINE_PROCESS | auto | run the engine in a child process, off the HTTP worker's GIL (auto: on with CUDA) |
| PAGEDLLM_GENERATION_CONFIG | auto | auto: sampling fields a request leaves out take the model's generation_config.json values (vLLM's default); none: OpenAI's defaults |
| PAGEDLLM_FAULT_INJECTION_SEED | unset | test hook: requests with this `seed` fail inside the engine |
| PAGEDLLM_FAULT_INJECTION_AFTER_TOKENS | 1 | ... at this generated token |
| PAGEDLLM_DTYPE | auto | float32 / float16 / bfloat16 (auto: bf16 on CUDA, fp32 on CPU) |
| PAGEDLLM_DEVICE | auto | cuda / cpu |
| PAGEDLLM_BLOCK_SIZE | 16 | tokens per KV block |
| PAGEDLLM_GPU_MEMORY_UTILIZATION | 0.9 | share of GPU memory for weights + KV cache |
| PAGEDLLM_CPU_KV_CACHE_BYTES | 1073741824 | KV cache budget on the CPU |
| PAGEDLLM_NUM_KV_BLOCKS | unset | exact KV block count (overrides the budgets) |
| PAGEDLLM_MAX_MODEL_LEN | the model's | longest context |
| PAGEDLLM_MAX_NUM_SEQS | 256 | sequences running at once |
| PAGEDLLM_MAX_NUM_BATCHED_TOKENS | 2048+ | tokens computed per step |
| PAGEDLLM_SEED | 0 | engine seed for unseeded requests |
| PAGEDLLM_ENABLE_PREFIX_CACHING | true | reuse the KV blocks of shared prompt prefixes |
| PAGEDLLM_LOAD_FORMAT | auto | `dummy`: random weights from the stored config.json (benchmarks) |
| PAGEDLLM_MAX_GRAPH_BATCH | 256 | largest decode batch captured in a CUDA graph |
| PAGEDLLM_ASYNC_SCHEDULING | auto | plan step N+1 before reading step N (auto: on for CUDA) |
| PAGEDLLM_TENSOR_PARALLEL_SIZE | 1 | GPUs (processes) the model is split over; the service asks BentoML for as many |
| PAGEDLLM_CHAT_TEMPLATE | the model's | a Jinja chat template, or a file holding one (vLLM's --chat-template) |
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .async_engine import RequestLimits
from .config import EngineArgs, parse_scheduling_policy
from .faults import FaultInjection
from .loader.store import DEFAULT_MODEL_NAME

PREFIX = "PAGEDLLM_"


def _parse_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")


def _generation_config(raw: str) -> str:
    if raw not in ("auto", "none"):
        raise ValueError("expected auto or none")
    return raw


def _origins(raw: str) -> tuple[str, ...]:
    return tuple(origin.strip() for origin in raw.split(",") if origin.strip())


# EngineArgs fields settable from the environment, with their parsers
_ENGINE_FIELDS = {
    "dtype": str, "device": str, "block_size": int, "gpu_memory_utilization": float,
    "cpu_kv_cache_bytes": int, "num_kv_blocks": int, "max_model_len": int, "max_num_seqs": int,
    "max_num_batched_tokens": int, "seed": int, "enable_prefix_caching": _parse_bool,
    "load_format": str, "max_graph_batch": int, "async_scheduling": _parse_bool,
    "tensor_parallel_size": int, "quiet_gc": _parse_bool,
    "scheduling_policy": lambda raw: parse_scheduling_policy(raw).value,
    "chat_template": str,
}


# ServiceSettings fields settable from the environment (besides the model's), with their parsers
_SERVICE_FIELDS = {
    "open_health_and_metrics": _parse_bool, "cors_allow_origins": _origins, "max_waiting_requests": int,
    "retry_after_seconds": int, "request_timeout_seconds": float, "shutdown_grace_seconds": float,
    "max_body_bytes": int, "stream_interval": int, "engine_process": _parse_bool,
    "generation_config": _generation_config, "trace_requests": _parse_bool,
}

# the /v1 routes, as OpenTelemetry's URL exclusions see them (regular expressions searched in the full URL)
OPENAI_ROUTES_PATTERN = "/v1/"


def _parse_fields(env: Mapping[str, str], parsers: Mapping[str, Callable[[str], object]]) -> dict:
    values = {}
    for name, parse in parsers.items():
        raw = env.get(PREFIX + name.upper())
        if raw not in (None, ""):
            try:
                values[name] = parse(raw)
            except ValueError as error:
                raise ValueError(f"{PREFIX}{name.upper()}={raw!r}: {error}") from None
    return values


@dataclass(frozen=True)
class ServiceSettings:
    model: str = f"{DEFAULT_MODEL_NAME}:latest"
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)  # NOTE: never printed
    open_health_and_metrics: bool = False
    cors_allow_origins: tuple[str, ...] = ()
    max_waiting_requests: int = 1024
    retry_after_seconds: int = 1
    request_timeout_seconds: float | None = None
    shutdown_grace_seconds: float = 30.0
    max_body_bytes: int = 4 << 20
    # NOTE: each SSE write costs the event loop a trip through the ASGI stack (BentoML's middlewares,
    # tracing, uvicorn), and with the engine on the worker's thread the loop shares the GIL with it: with
    # hundreds of streams that cost bounds throughput (BENCHMARKS.md). Like vLLM's --stream-interval; 1
    # writes every step's tokens.
    stream_interval: int = 1
    # NOTE: BentoML's OpenTelemetry middleware opens a span around every ASGI `send`, so a stream pays for one
    # per chunk even when nothing samples it (BentoML's default sample rate is 0): ~45% of the serving
    # worker's CPU when streaming (BENCHMARKS.md). Off: /v1 is excluded from tracing; on: traced like the rest.
    trace_requests: bool = False
    # NOTE: None (auto) runs the engine in its own process on CUDA, where the HTTP work of hundreds of
    # streams would otherwise share one GIL with the engine (BENCHMARKS.md); on the CPU the engine's
    # threads need the cores more than the HTTP work does.
    engine_process: bool | None = None
    # "auto": the model's recommended sampling parameters (generation_config.json) are the API's defaults,
    # as in vLLM since 0.6.5 (`--generation-config auto`); "none": OpenAI's
    generation_config: str = "auto"
    # what the service asks BentoML for (`resources`): "gpu" or "cpu"; None: the device setting's, else the
    # machine's (nvidia-smi). NOTE: a bento argument (bentofile.yaml `args`), not an environment variable:
    # `bentoml build` records the resources on the machine that builds, where the image's environment is not
    # set, so a bento built on a CPU runner must still ask for GPUs
    accelerator: str | None = None
    fault_injection: FaultInjection | None = None
    engine: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_body_bytes", "stream_interval"):
            if getattr(self, name) < 1:
                raise ValueError(f"{PREFIX}{name.upper()} must be at least 1")
        if self.retry_after_seconds < 0 or self.shutdown_grace_seconds < 0:
            raise ValueError("retry and grace times must not be negative")
        RequestLimits(self.max_waiting_requests, self.request_timeout_seconds)  # raises now, not at start-up
        if self.accelerator not in (None, "gpu", "cpu"):
            raise ValueError(f"the bento argument accelerator={self.accelerator!r}: expected gpu or cpu")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, accelerator: str | None = None) -> "ServiceSettings":
        faults = _parse_fields(env, {"fault_injection_seed": int, "fault_injection_after_tokens": int})
        return cls(
            model=env.get(PREFIX + "MODEL") or cls.model,
            served_model_name=env.get(PREFIX + "SERVED_MODEL_NAME") or None,
            # NOTE: vLLM's variable too: an operator who moves over with only VLLM_API_KEY set must not get an
            # open server
            api_key=env.get(PREFIX + "API_KEY") or env.get("VLLM_API_KEY") or None,
            accelerator=accelerator,
            fault_injection=FaultInjection(faults["fault_injection_seed"], faults.get("fault_injection_after_tokens", 1))
            if "fault_injection_seed" in faults else None,
            engine=_parse_fields(env, _ENGINE_FIELDS),
            **_parse_fields(env, _SERVICE_FIELDS),
        )

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(self.max_waiting_requests, self.request_timeout_seconds)

    @property
    def http_config(self) -> dict:
        """BentoML's `http` service config: CORS only for the configured origins, never by default."""
        if not self.cors_allow_origins:
            return {}
        return {"cors": {
            "enabled": True,
            "access_control_allow_origins": list(self.cors_allow_origins),
            "access_control_allow_methods": ["GET", "POST", "OPTIONS"],
            "access_control_allow_headers": ["Authorization", "Content-Type"],
        }}

    @property
    def tracing_config(self) -> dict:
        """BentoML's `tracing` service config: the /v1 routes excluded unless `trace_requests`."""
        return {} if self.trace_requests else {"excluded_urls": [OPENAI_ROUTES_PATTERN]}

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.split(":", 1)[0]

    def engine_args(self, model_path: str) -> EngineArgs:
        return EngineArgs(model=model_path, **self.engine)

    def use_engine_process(self, args: EngineArgs) -> bool:
        if self.engine_process is not None:
            return self.engine_process
        return args.resolve_device().type == "cuda"

    @property
    def tensor_parallel_size(self) -> int:
        return int(self.engine.get("tensor_parallel_size", 1))

    @property
    def resources(self) -> dict:
        """One GPU per tensor-parallel rank on GPUs (the service owns the engine, as a runner once did, and the
        engine spawns ranks 1.. itself). On GPUs: where PAGEDLLM_DEVICE names CUDA, else where the bento
        argument `accelerator` says gpu, else where the machine has GPUs."""
        device = self.engine.get("device", "auto")
        if device == "auto":
            on_gpus = self.accelerator == "gpu" if self.accelerator else shutil.which("nvidia-smi") is not None
        else:
            on_gpus = device.startswith("cuda")
        if on_gpus:
            return {"gpu": self.tensor_parallel_size}
        return {"cpu": str(os.cpu_count() or 1)}
