"""Request and Sequence: the engine's bookkeeping for one prompt and each of its `n` choices.

A `Sequence` owns its token ids (prompt + generated), its status, how many of its tokens already sit in
the KV cache (`num_computed_tokens`) and its block table. It holds no tensors. The scheduler's only question
about a sequence is "how many tokens are not yet computed?": the same question covers a fresh prompt,
a chunked prefill, a decode step and a recompute after preemption.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from .sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher


PENDING_TOKEN = -1  # a step input whose id is still on the device (see Sequence.num_pending)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class TokenLogprob(NamedTuple):
    """The chosen token's log-probability and the top alternatives at that position (a NamedTuple: one
    is made per sampled token). For a prompt token (`SamplingParams.prompt_logprobs`) the token is the
    prompt's, and `rank` its place in the distribution (1: the most likely)."""

    token_id: int
    logprob: float | None  # None when the request asked for no log-probabilities
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


_seq_counter = itertools.count()


class Sequence:
    """One generated choice. `token_ids` is prompt followed by output; only the engine appends to it."""

    def __init__(self, request: "Request", index: int, token_ids: list[int], rng_seed: int) -> None:
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self._token_ids = token_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = 0
        # NOTE: tokens sampled by a launched step whose ids the host has not read yet (async scheduling):
        # the scheduler counts them, `token_ids` does not hold them. At most two (the step in flight and
        # the one launched after it).
        self.num_pending = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix-cache names of its full blocks, memoised
        self.num_named_blocks = 0  # leading blocks of the table already offered to the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.rng_seed = rng_seed
        self.cumulative_logprob: float | None = 0.0 if request.params.logprobs is not None else None
        self.logprobs: list[TokenLogprob] = []
        self.num_preemptions = 0
        # structured outputs: the grammar's matcher (structured_output.py), advanced by each token the
        # engine appends; None for unconstrained sequences. NOTE: the engine sets it for choice 0; forks copy it
        self.grammar: "LLMatcher | None" = None

    # NOTE: the read-only views below are the only way other rooms see the tokens. `token_ids` and
    # `output_token_ids` hold the known tokens; the counts include the pending ones (the scheduler's view).
    @property
    def token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def num_known_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_known_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """The order sequences run in: the request's priority (lower first; always 0 under FCFS), then
        arrival (earlier first), then choice index."""
        return (self.request.priority, self.request.arrival_index, self.index)

    def append_token(self, token: TokenLogprob) -> None:
        """A sampled token is known: it takes the place of the oldest pending one, if any."""
        if self.num_pending:
            self.num_pending -= 1
        self._token_ids.append(token.token_id)
        if self.cumulative_logprob is not None:
            self.cumulative_logprob += token.logprob
        if self.request.params.logprobs is not None:
            self.logprobs.append(token)

    def fork(self, index: int, rng_seed: int) -> "Sequence":
        """A new choice sharing this sequence's tokens so far (the caller shares the KV blocks)."""
        child = Sequence(self.request, index, list(self._token_ids), rng_seed)
        child.num_computed_tokens = self.num_computed_tokens
        child.block_hashes = list(self.block_hashes)
        child.num_named_blocks = self.num_named_blocks
        child.status = self.status
        child.grammar = self.grammar.deep_copy() if self.grammar is not None else None
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request.request_id}, idx={self.index}, "
            f"tokens={self.num_tokens}, pending={self.num_pending}, computed={self.num_computed_tokens}, "
            f"blocks={self.block_table})"
        )


_arrival_counter = itertools.count()


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    # prompt tokens found in the prefix cache when the request was first scheduled (its usage reports them)
    cached_prompt_tokens: int = 0


class Request:
    """A prompt with its sampling parameters and its `n` sequences (one until the prompt is computed).

    NOTE: with n > 1 the prompt is computed once by the first sequence; when its last prompt token is
    scheduled the scheduler forks the other choices, which share the prompt's KV blocks.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        rng_seed: int,
        *,
        bad_words: tuple[tuple[int, ...], ...] = (),
        allowed_mask: torch.Tensor | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """`bad_words`: `params.bad_words` as token sequences, `allowed_mask`: `params.allowed_token_ids` as
        the sampler's bitmask ([ceil(vocab / 32)] int32), both made by the engine, which knows the tokenizer
        and the vocabulary; `cache_salt`: names the empty prefix of the request's prefix-cache blocks;
        `priority`: vLLM's, lower runs first (under the priority scheduling policy; 0 otherwise)."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_index = next(_arrival_counter)
        self.times = RequestTimes()
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.rng_seed = rng_seed
        self.seqs: list[Sequence] = [Sequence(self, 0, list(self.prompt_token_ids), rng_seed)]
        # `params.prompt_logprobs`: entry i scores prompt token i given the ones before it (entry 0: None);
        # filled as the steps computing the prompt are read
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None else None)
        # positions whose logits score the next prompt token that a planned step computes: 0 .. this - 1
        # NOTE: only grows (a prompt recomputed after preemption is not scored twice)
        self.prompt_positions_scored = 0
        self.bad_words = bad_words
        self.allowed_mask = allowed_mask
        self.cache_salt = cache_salt
        self.priority = priority

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens are still to be scored: every prompt position must be computed, none taken from
        the prefix cache."""
        return self.prompt_logprobs is not None and self.prompt_positions_scored < self.num_prompt_tokens - 1

    @property
    def is_forked(self) -> bool:
        return len(self.seqs) == self.params.n

    @property
    def is_finished(self) -> bool:
        if not self.is_forked:
            return False  # NOTE: its other choices do not exist yet
        for seq in self.seqs:  # a loop, not all(): read for every request of every step
            if seq.status is not SequenceStatus.FINISHED:
                return False
        return True
