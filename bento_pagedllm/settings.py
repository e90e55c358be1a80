"""The service's settings, read once from the environment (so a container needs no code change).

| variable | default | meaning |
|---|---|---|
| PAGEDLLM_MODEL | smollm2-135m-instruct:latest | BentoML model tag to serve |
| PAGEDLLM_SERVED_MODEL_NAME | the tag's name | the `model` name clients send |
| PAGEDLLM_API_KEY | unset | when set, every /v1 request needs `Authorization: Bearer <key>` |
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
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field

from .config import EngineArgs
from .loader.store import DEFAULT_MODEL_NAME

PREFIX = "PAGEDLLM_"


def _parse_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError("expected true or false")

# EngineArgs fields settable from the environment, with their parsers
_ENGINE_FIELDS = {
    "dtype": str, "device": str, "block_size": int, "gpu_memory_utilization": float,
    "cpu_kv_cache_bytes": int, "num_kv_blocks": int, "max_model_len": int, "max_num_seqs": int,
    "max_num_batched_tokens": int, "seed": int, "enable_prefix_caching": _parse_bool,
    "load_format": str, "max_graph_batch": int, "async_scheduling": _parse_bool,
}


@dataclass(frozen=True)
class ServiceSettings:
    model: str = f"{DEFAULT_MODEL_NAME}:latest"
    served_model_name: str | None = None
    api_key: str | None = field(default=None, repr=False)  # NOTE: never printed
    engine: dict = field(default_factory=dict)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "ServiceSettings":
        engine = {}
        for name, parse in _ENGINE_FIELDS.items():
            raw = env.get(PREFIX + name.upper())
            if raw not in (None, ""):
                try:
                    engine[name] = parse(raw)
                except ValueError as error:
                    raise ValueError(f"{PREFIX}{name.upper()}={raw!r}: {error}") from None
        return cls(
            model=env.get(PREFIX + "MODEL") or cls.model,
            served_model_name=env.get(PREFIX + "SERVED_MODEL_NAME") or None,
            api_key=env.get(PREFIX + "API_KEY") or None,
            engine=engine,
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.split(":", 1)[0]

    def engine_args(self, model_path: str) -> EngineArgs:
        return EngineArgs(model=model_path, **self.engine)

    @property
    def resources(self) -> dict:
        """One GPU when the machine has one (the service owns the engine, as a runner once did)."""
        return {"gpu": 1} if shutil.which("nvidia-smi") else {"cpu": str(os.cpu_count() or 1)}
