"""What the engine hands back each step: the state of a request's choices, cumulative and as deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import TokenLogprob


@dataclass
class CompletionOutput:
    """One choice. `text`/`token_ids`/`logprobs` are cumulative; the `delta_*` fields hold what this step
    added (concatenating every delta_text of a stream gives `text`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (not computed again)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the engine failed this request (its choices end with reason "error")
    # `SamplingParams.prompt_logprobs`: one entry a prompt token, the first None (vLLM's form); complete in
    # every output that carries a token. NOTE: the engine's own list: read it, do not change it
    prompt_logprobs: list[TokenLogprob | None] | None = None
