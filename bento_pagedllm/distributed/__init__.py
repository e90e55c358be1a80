"""Tensor parallelism: the rank handle and its collectives (`parallel_state`), the sharded layers
(`layers`) and the worker processes that run ranks 1.. (`workers`)."""

from .parallel_state import ParallelConfig

__all__ = ["ParallelConfig"]
