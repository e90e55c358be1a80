"""Fault injection: a test hook that makes chosen requests fail inside the engine, as a sampling error would.

It proves that a failure stays with its request: the request's stream ends with an error, every other request
goes on, and /metrics counts the failure. It is off unless the operator sets `PAGEDLLM_FAULT_INJECTION_SEED`;
then a request whose `seed` equals that value fails while its `after_tokens`-th token is processed. A client
alone can never turn it on.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import Sequence, TokenLogprob


class InjectedFault(RuntimeError):
    """The failure the hook raises: looks to the engine like any error in a request's token processing."""


@dataclass(frozen=True)
class FaultInjection:
    """`LLMEngine.token_hook`: fail requests seeded with `seed` at their `after_tokens`-th generated token."""

    seed: int
    after_tokens: int = 1

    def __post_init__(self) -> None:
        if self.after_tokens < 1:
            raise ValueError("after_tokens must be at least 1")

    def __call__(self, seq: Sequence, token: TokenLogprob) -> None:
        position = seq.num_known_output_tokens + 1  # NOTE: known tokens (the counts include pending ones)
        if seq.request.params.seed == self.seed and position >= self.after_tokens:
            raise InjectedFault(f"injected sampling fault at output token {position}")
