"""bento-pagedllm: a paged-attention engine for Llama-family models, served through BentoML."""

from .async_engine import AsyncLLMEngine
from .beam_search import BeamSearchParams
from .config import EngineArgs
from .engine import LLM, LLMEngine, RequestError
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .structured_output import StructuredOutputs

__version__ = "0.1.0"  # NOTE: the package's version too (pyproject.toml reads it)

__all__ = [
    "AsyncLLMEngine",
    "BeamSearchParams",
    "CompletionOutput",
    "EngineArgs",
    "LLM",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
]
