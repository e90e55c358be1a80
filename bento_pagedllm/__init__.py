"""bento-pagedllm: a paged-attention engine for Llama-family models, served through BentoML."""

from .async_engine import AsyncLLMEngine
from .config import EngineArgs
from .engine import LLM, LLMEngine, RequestError
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .structured_output import StructuredOutputs

__all__ = [
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineArgs",
    "LLM",
    "LLMEngine",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputs",
]
