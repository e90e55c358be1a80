"""Typed engine configuration: plain dataclasses, validated once in ``__post_init__``.

`EngineArgs` is what a user fills in; `EngineArgs.create_configs()` resolves it (reading the model's own
config) into the frozen configs that each room of the engine reads: `ModelConfig`, `CacheConfig`,
`SchedulerConfig` and `DeviceConfig`.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype; reject anything else early."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (`rope_type: llama3` in transformers' config)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


# transformers architectures whose every layer this engine computes: Llama's (and Mistral's, which is Llama's
# layers plus a sliding window, when the window does not bind)
SUPPORTED_HF_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


def _check_supported(cfg: dict[str, Any]) -> str:
    """The config's architecture, or a ValueError for what the engine would load and then compute wrong
    (another architecture, biased projections, a binding sliding window)."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in SUPPORTED_HF_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_HF_ARCHITECTURES)}")
    for flag in ("attention_bias", "mlp_bias"):
        if cfg.get(flag):
            raise ValueError(f"{flag} is set: projections with biases are not supported (Llama's have none)")
    window, longest = cfg.get("sliding_window"), cfg.get("max_position_embeddings", 2048)
    if window is not None and window < longest:
        raise ValueError(f"sliding_window {window} is shorter than max_position_embeddings {longest}: sliding-window "
                         "attention is not supported")
    return arch


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family model, as transformers' `LlamaConfig` defines it."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: tuple[int, ...] = (2,)
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even for rotary embeddings")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        per_layer = h * (self.q_size + 2 * self.kv_size) + self.q_size * h + 3 * h * i + 2 * h
        embed = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * per_layer + embed + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a transformers `config.json` dict (Llama, Mistral-without-sliding-window, SmolLM2...)."""
        arch = _check_supported(cfg)
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        rope_theta = cfg.get("rope_theta")
        scaling = None
        if isinstance(rope, dict):
            rope_theta = rope_theta or rope.get("rope_theta")
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type == "llama3":
                scaling = RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                )
            elif rope_type not in ("default", None):
                raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
        eos = cfg.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            head_dim=cfg.get("head_dim"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_ids,
            architecture=arch,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The transformers `config.json` for this architecture (used when saving converted models)."""
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return cfg


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size and how much memory the pool may take.

    NOTE: `num_blocks`, when set, overrides the memory budget (tests use it to force preemption).
    """

    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError("num_blocks must be positive")


class SchedulingPolicy(enum.Enum):
    """vLLM's `scheduling_policy`: which requests run first, and which give way when memory is short."""

    FCFS = "fcfs"  # arrival order; every request's priority is 0
    PRIORITY = "priority"  # a request's `priority` first (lower runs first), then arrival


def parse_scheduling_policy(name: str) -> SchedulingPolicy:
    """A user's `scheduling_policy` name; reject anything else early."""
    try:
        return SchedulingPolicy(name)
    except ValueError:
        raise ValueError(f"unknown scheduling_policy {name!r}; choose one of "
                         f"{[p.value for p in SchedulingPolicy]}") from None


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits: tokens computed per step, sequences running at once, context length."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    policy: SchedulingPolicy = SchedulingPolicy.FCFS

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0 or self.max_model_len <= 0:
            raise ValueError("scheduler limits must be positive")


@dataclass(frozen=True)
class DeviceConfig:
    device: torch.device
    dtype: torch.dtype
    seed: int = 0


# NOTE: a mixed graph's attention launches a program per KV head for every sequence slot it was captured
# with, used or not (the spare ones exit at once): a bound on that waste.
MAX_MIXED_GRAPH_SEQS = 256
# Steps of up to this many tokens project through kernels/gemv.py by default: up to 16 rows its tiles beat
# cuBLAS plus the separate norm and activation kernels on every Llama-2-7B and Llama-3-8B projection
# (H200, BENCHMARKS.md "Small decode batches through the tensor-core tiles"); at 17-32 rows whole decode
# steps ran ~3% faster through them (Llama-3-8B: 5.22-5.23 against 5.39-5.40 ms with TILE_32_SHAPES, 5.04
# against 5.41 with every configuration, 2026-12-02), at 33-64 10% slower. NOTE: 32 costs a cold start the
# 32-row tiles' compiles and timings (with every configuration: 29.5-34.1 s against 23.5-26.9 s, Llama-2-7B,
# H200); kernels/gemv.py's TILE_32_SHAPES halves them (26.4-28.4 s against 22.4-27.4 s).
FUSED_GEMV_ROWS = 32
# Steps of at least this many tokens take the MLP's gate/up product and its SwiGLU as one GEMM on CUDA
# (kernels/swiglu_gemm.py, compute capability 9+, 16-bit weights): prefill-sized steps, where the separate
# activation kernel cost 0.35-0.55 ms a Llama-3-8B layer at 16,384 tokens; smaller steps keep cuBLAS.
SWIGLU_GEMM_ROWS = 4096


@dataclass(frozen=True)
class EngineConfigs:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: DeviceConfig
    model_path: str
    load_format: str
    cuda_graph_max_batch: int = 0  # decode graphs for batches up to this size; 0: none (CPU, eager)
    cuda_graph_max_mixed_tokens: int = 0  # mixed-step graphs for steps up to this many tokens; 0: none
    cuda_graph_max_mixed_seqs: int = 0  # ... and up to this many sequences
    async_scheduling: bool = False  # plan and launch step N+1 before reading step N's tokens
    tensor_parallel_size: int = 1  # processes (one device each) the heads and vocabulary are split over
    native_cpu_ops: bool = True  # CPU, float32: fused native operators (kernels/cpu_ops.cpp), not torch's
    peer_all_reduce: bool = False  # CUDA tensor parallelism: all-reduces up to 8 MB through NVLink peer memory
    fused_gemv_rows: int = FUSED_GEMV_ROWS  # CUDA, 16-bit: steps of up to this many tokens project with kernels/gemv.py
    dependent_launch: bool = True  # CUDA 9.0+: decode kernels launch as programmatic dependents (kernels/gemv.py)
    measured_tiles: bool = True  # CUDA: one-row projections take this GPU's measured tiles (kernels/tiles/), if any
    quiet_gc: bool = False  # freeze the startup heap, collect young objects less often (engine.py)


@dataclass
class EngineArgs:
    """Everything a user can set, with defaults that suit the device.

    `model` is a transformers-format directory, a `.gguf` file, or a BentoML model tag. With
    `load_format="dummy"` only the config is read and the weights are random (benchmarks).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    seed: int = 0
    # vLLM's: "fcfs" (arrival order) or "priority" (each request's `priority` first, lower first; the
    # lowest-priority running sequence is the one preempted when memory runs short)
    scheduling_policy: str = "fcfs"
    enforce_eager: bool = False  # on CUDA: no decode graphs (debugging, or to save capture time)
    max_graph_batch: int = 256
    # On CUDA: mixed steps (prefill chunks with decodes) of up to this many tokens, and up to
    # `max_graph_batch` (at most 256) sequences, replayed from CUDA graphs too; bigger ones run eagerly,
    # where the device's work hides the launches (bench/mixed_step.py). 0: none.
    max_mixed_graph_tokens: int = 512
    # Plan and launch each step before the previous step's tokens reach the host, so the device never
    # waits for the host's bookkeeping. None: on where it pays (CUDA), off on the CPU (whose kernels run
    # in the calling thread, so there is nothing to overlap).
    async_scheduling: bool | None = None
    # Split the attention heads, KV heads, MLP and vocabulary over this many processes (one GPU each on
    # CUDA; gloo processes on the CPU). Rank 0 (this process) schedules and samples.
    tensor_parallel_size: int = 1
    # On the CPU in float32: the norms, rotary embedding, SiLU and decode attention as fused native
    # operators, compiled on first use (kernels/cpu_ops.cpp). False keeps the pure-torch reference ones.
    native_cpu_ops: bool = True
    # Tensor parallelism on CUDA: all-reduce the small messages of decode steps through peer memory
    # (distributed/parallel_state.py::PeerAllReduce) instead of NCCL. Off: measured slower than NCCL alone
    # on 2 H200s (BENCHMARKS.md, tensor parallelism); kept for the latency-bound case it was built for.
    peer_all_reduce: bool = False
    # On CUDA in 16 bits: the projections of steps of up to this many tokens (decode of a few sequences) as
    # Triton kernels with the RMSNorm before them and the SwiGLU activation or the residual add after them
    # fused in (kernels/gemv.py, at most its MAX_ROWS). Bigger steps, and 0: cuBLAS and separate kernels.
    fused_gemv_rows: int = FUSED_GEMV_ROWS
    # On GPUs of compute capability 9.0+ (Hopper): the projections, the rotary kernel and decode attention
    # launch as programmatic dependents of the kernel before them, so each starts (and asks L2 for its
    # first weights) while the one before finishes (kernels/gemv.py). Off: plain stream order.
    dependent_launch: bool = True
    # On CUDA: the one-row projections (single-stream decode) launch with the tiles found fastest for this
    # GPU by the whole decode step's time (bench/tile_search.py), where the package has a table for the GPU
    # (kernels/tiles/<GPU name>.json); other projections, and GPUs without a table, are autotuned. Why: the
    # autotuner judges each kernel alone, and its choices (different in every process) left Llama-2-7B's
    # single stream 2-3% slower on an H100 (BENCHMARKS.md, "The single stream's speed is the autotuner's
    # tile choice"). False: autotune them all.
    measured_tiles: bool = True
    # Tune the process's garbage collector once the engine is built: the startup heap frozen, young
    # objects collected every 20,000 allocations instead of 700 (engine.py::quiet_garbage_collector;
    # `shutdown` unfreezes). For a process that runs one engine for its life: the engine process sets it
    # (engine_process.py), and the benchmarks. NOTE: off by default because frozen objects are never
    # collected: an engine dropped without `shutdown` (its cycles) would keep its KV cache.
    quiet_gc: bool = False
    hf_config_overrides: dict[str, Any] = field(default_factory=dict)
    # A Jinja chat template, or a file holding one, in place of the model's (vLLM's --chat-template): for a
    # model that has none (a base model) or whose template is wrong. None: the model's own.
    chat_template: str | None = None

    def resolve_device(self) -> torch.device:
        """"auto": CUDA where torch sees it, else the CPU; "cpu", "cuda" or "cuda:N" as asked (whether it exists
        is `create_configs`' check)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            device = torch.device(self.device)
        except (RuntimeError, TypeError):
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'")
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return parse_dtype(self.dtype)

    def _check_flags_and_counts(self) -> None:
        """The on/off settings are booleans (a string such as "no" would read as on) and the optional counts,
        when given, positive (None, not 0, asks for the default)."""
        for setting in dataclasses.fields(self):
            value = getattr(self, setting.name)
            if setting.type in ("bool", "bool | None") and not (
                    isinstance(value, bool) or (value is None and setting.type == "bool | None")):
                raise ValueError(f"{setting.name} must be True or False, got {value!r}")
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer (None: the default), got {value!r}")

    def create_configs(self, model_config: ModelConfig, model_path: str) -> EngineConfigs:
        if self.load_format not in ("auto", "dummy", "hf", "gguf"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        self._check_flags_and_counts()
        device = self.resolve_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r}: this torch sees no CUDA device")
        max_model_len = self.max_model_len if self.max_model_len is not None else model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's {model_config.max_position_embeddings}"
            )
        batched = (self.max_num_batched_tokens if self.max_num_batched_tokens is not None
                   else max(2048, min(max_model_len, 8192)))
        self.validate_tensor_parallel(model_config, device)
        graphs = device.type == "cuda" and not self.enforce_eager
        return EngineConfigs(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                cpu_kv_cache_bytes=self.cpu_kv_cache_bytes,
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=batched,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
                policy=parse_scheduling_policy(self.scheduling_policy),
            ),
            device=DeviceConfig(device=device, dtype=self.resolve_dtype(device), seed=self.seed),
            model_path=model_path,
            load_format=self.load_format,
            cuda_graph_max_batch=min(self.max_num_seqs, self.max_graph_batch) if graphs else 0,
            cuda_graph_max_mixed_tokens=min(batched, self.max_mixed_graph_tokens) if graphs else 0,
            cuda_graph_max_mixed_seqs=min(self.max_num_seqs, self.max_graph_batch, MAX_MIXED_GRAPH_SEQS),
            async_scheduling=device.type == "cuda" if self.async_scheduling is None else self.async_scheduling,
            tensor_parallel_size=self.tensor_parallel_size,
            native_cpu_ops=self.native_cpu_ops,
            peer_all_reduce=self.peer_all_reduce,
            fused_gemv_rows=self.fused_gemv_rows,
            dependent_launch=self.dependent_launch,
            measured_tiles=self.measured_tiles,
            quiet_gc=self.quiet_gc,
        )

    def validate_tensor_parallel(self, model_config: ModelConfig, device: torch.device) -> None:
        """Every split must be even (no KV head replication), and CUDA needs one device per rank.

        NOTE: the vocabulary need not divide: the last ranks' ranges are padded (distributed/layers.py).
        """
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(model_config, name)
            if value % tp:
                raise ValueError(f"the model's {name} ({value}) is not divisible by tensor_parallel_size {tp}")
        if tp > 1 and device.type == "cuda":
            if device.index not in (None, 0):
                raise ValueError("tensor parallelism uses devices 0..tensor_parallel_size-1: set the device "
                                 "to 'cuda' and choose the GPUs with CUDA_VISIBLE_DEVICES")
            if tp > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
