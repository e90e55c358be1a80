"""Beam search (vLLM's `use_beam_search`, `LLM.beam_search`): the `width` most likely continuations by
length-penalised log-probability, not samples.

Why above the engine, as vLLM V1 does it: a beam step is one-token requests, one per live beam, that ask
for the next token's top 2 x width log-probabilities (the model's own distribution, `SamplingParams.logprobs`);
the scheduler batches them like any others and the prefix cache holds each beam's context (a beam's request
computes its last partial block, not its whole context). So the scheduler, the sampler and the graphs need
nothing of their own, and a beam costs a request a token. `BeamSearch` is the search itself (pure Python,
driven by the offline `LLM.beam_search` and by the API's `beam_search_output` alike).

The score, vLLM's: cumulative log-probability / length ** length_penalty, the length counting the prompt and
the generated tokens without a final end-of-sequence token. A beam ends at an end-of-sequence token (unless
`ignore_eos`) or after `max_tokens`; after the last step the finished and the live beams compete together.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from .async_engine import AsyncLLMEngine


@dataclass(frozen=True)
class BeamSearchParams:
    width: int  # beams kept a step, and choices returned
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    skip_special_tokens: bool = True  # for the choices' text

    # NOTE: a step asks for the top 2 x width tokens of each beam, as many alternatives as logprobs allows
    MAX_WIDTH = SamplingParams.MAX_LOGPROBS // 2

    def __post_init__(self) -> None:
        if not 1 <= self.width <= self.MAX_WIDTH:
            raise ValueError(f"the beam width must be in [1, {self.MAX_WIDTH}]")
        if self.max_tokens < 1:
            raise ValueError("beam search needs max_tokens >= 1")

    def step_params(self) -> SamplingParams:
        """A beam's request for one step: one token, the top 2 x width alternatives of the next position."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.width, ignore_eos=True)


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    cumulative_logprob: float = 0.0
    finished: bool = False  # ended with an end-of-sequence token


@dataclass
class BeamSearch:
    """One prompt's search: `contexts()` are the token ids to ask the next position's alternatives of, one per
    live beam; `advance` takes each one's (token, log-probability) alternatives, in the same order."""

    prompt_token_ids: list[int]
    params: BeamSearchParams
    eos_token_ids: Collection[int]
    live: list[Beam] = field(default_factory=lambda: [Beam([])])
    finished: list[Beam] = field(default_factory=list)
    steps: int = 0

    @property
    def done(self) -> bool:
        return not self.live or self.steps >= self.params.max_tokens

    def contexts(self) -> list[list[int]]:
        return [self.prompt_token_ids + beam.token_ids for beam in self.live]

    def score(self, beam: Beam) -> float:
        length = len(self.prompt_token_ids) + len(beam.token_ids) - beam.finished
        return beam.cumulative_logprob / length**self.params.length_penalty

    def advance(self, alternatives: list[tuple[tuple[int, float], ...]]) -> None:
        """Every live beam extended by each of its alternatives; those ending in end-of-sequence finish,
        the best `width` of the others stay live."""
        candidates = []
        for beam, top in zip(self.live, alternatives, strict=True):
            for token, logprob in top:
                ends = token in self.eos_token_ids and not self.params.ignore_eos
                extended = Beam(beam.token_ids + [token], beam.cumulative_logprob + logprob, ends)
                (self.finished if ends else candidates).append(extended)
        self.live = sorted(candidates, key=self.score, reverse=True)[: self.params.width]
        self.steps += 1

    def best(self) -> list[Beam]:
        """The `width` best of the finished and the live beams, best first."""
        return sorted(self.finished + self.live, key=self.score, reverse=True)[: self.params.width]

    def output(self, request_id: str, prompt: str | None, tokenizer, metrics=None) -> RequestOutput:
        """The search's answer in the engine's form: a finished request whose choices are the best beams."""
        choices = []
        for index, beam in enumerate(self.best()):
            text = "" if tokenizer is None else tokenizer.decode(
                beam.token_ids, skip_special_tokens=self.params.skip_special_tokens)
            choices.append(CompletionOutput(index, text, beam.token_ids, beam.cumulative_logprob, None,
                                            finish_reason="stop" if beam.finished else "length",
                                            delta_text=text, delta_token_ids=list(beam.token_ids)))
        return RequestOutput(request_id, prompt, self.prompt_token_ids, choices, finished=True, metrics=metrics)


async def beam_search_output(engine: AsyncLLMEngine, prompt_token_ids: list[int], params: BeamSearchParams,
                             request_id: str, *, prompt: str | None = None, cache_salt: str | None = None,
                             priority: int = 0) -> RequestOutput:
    """Run a search through the async engine, each step's beams as concurrent requests.

    NOTE: cancelled (a client gone), the step's requests are aborted as their streams close. The answer's
    metrics are the first step's (its prompt tokens found in the prefix cache)."""
    search = BeamSearch(prompt_token_ids, params, engine.prompts.eos_token_ids)
    step_params = params.step_params()
    metrics = None

    async def next_position(context: list[int], name: str):
        async with aclosing(engine.submit(context, step_params, request_id=name, cache_salt=cache_salt,
                                          priority=priority)) as stream:
            async for out in stream:
                last = out
        return last

    while not search.done:
        outs = await asyncio.gather(*(next_position(context, f"{request_id}-{search.steps}-{i}")
                                      for i, context in enumerate(search.contexts())))
        metrics = metrics or outs[0].metrics
        search.advance([out.outputs[0].logprobs[0].top for out in outs])
    return search.output(request_id, prompt, engine.tokenizer, metrics)
