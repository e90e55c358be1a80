"""SamplingParams: what a request asks of the sampler and of the stop logic. Validated once, here."""

from __future__ import annotations

from dataclasses import dataclass, field

from .structured_output import StructuredOutputs


@dataclass
class SamplingParams:
    """Per-request sampling settings, named as vLLM and OpenAI name them.

    `temperature == 0` means greedy. `top_k <= 0` (or -1) and `top_p == 1` and `min_p == 0` disable those
    filters. `repetition_penalty` (1 = off) applies to prompt and output tokens as in transformers;
    `presence_penalty` and `frequency_penalty` (0 = off) apply to output tokens as in OpenAI's API.
    `logprobs=k` returns the chosen token's log-probability plus the top k alternatives (k may be 0);
    `prompt_logprobs=k` the same for every prompt token after the first (vLLM's parameter: each prompt
    token's log-probability given the ones before it, its rank, and the top k at that position).
    `max_tokens=0` generates nothing: only the prompt is computed (for its `prompt_logprobs`).
    `min_tokens`: end-of-sequence and `stop_token_ids` cannot be drawn before that many tokens (vLLM's
    meaning; stop strings still apply).
    `logit_bias`: token id -> a value in [-100, 100] added to that token's logit before sampling (OpenAI's
    parameter), after the penalties; log-probabilities stay the model's own (vLLM's default). The token ids
    are checked against the vocabulary where it is known (`PromptProcessor.validate_prompt`).
    `structured_outputs`: the output must match a JSON Schema, a regular expression, a choice or a grammar
    (structured_output.py); min_tokens does not ban the end of such an output: the grammar decides it.
    `allowed_token_ids` (vLLM's): only these tokens may be drawn (under a grammar, those of them it allows).
    `bad_words` (vLLM's): the output never ends on a word's tokens (as the tokenizer writes the word alone and
    after a space): the last token of a word is banned wherever the output ends on the tokens before it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputs | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == 0:
            self.top_k = -1
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0.0, "temperature must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (disabled) or at least 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be positive"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.max_tokens is None or self.max_tokens >= 0, "max_tokens must be non-negative"),
            (self.min_tokens >= 0, "min_tokens must be non-negative"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must be at most max_tokens"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids"),
            (
                self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
                f"logprobs must be in [0, {self.MAX_LOGPROBS}]",
            ),
            (
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS,
                f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}]",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        for value in (self.temperature, self.top_p, self.min_p, self.repetition_penalty,
                      self.presence_penalty, self.frequency_penalty):
            if value != value:  # NaN
                raise ValueError("sampling parameters must not be NaN")
        for name in ("temperature", "repetition_penalty"):  # NOTE: the bounded ones are checked above
            if getattr(self, name) == float("inf"):
                raise ValueError(f"{name} must be finite")
        self.logit_bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()} or None
        for token, bias in (self.logit_bias or {}).items():
            if token < 0:
                raise ValueError("logit_bias token ids must be non-negative")
            if not -self.MAX_LOGIT_BIAS <= bias <= self.MAX_LOGIT_BIAS:  # NOTE: False for NaN too
                raise ValueError(f"logit_bias values must be in [-{self.MAX_LOGIT_BIAS:g}, {self.MAX_LOGIT_BIAS:g}]")
        # NOTE: read for every sequence of every step (the scheduler's sampling rows): worked out once, as
        # the checks above are (parameters do not change after construction)
        self.uses_penalties = (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = sorted({int(t) for t in self.allowed_token_ids})
            if not self.allowed_token_ids or self.allowed_token_ids[0] < 0:
                raise ValueError("allowed_token_ids must be non-empty token ids (non-negative)")
        self.bad_words = [w for w in (self.bad_words or []) if w.strip()]
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError("structured_outputs must be a StructuredOutputs")
        # the next token's sampling depends on the tokens sampled so far, read on the host (penalties count
        # them, a grammar's mask follows them, a bad word's ban follows its first tokens): a step sampling
        # such a row is read before the next is planned
        self.reads_history = self.uses_penalties or self.structured_outputs is not None or bool(self.bad_words)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stop_strings(self) -> list[str]:
        assert isinstance(self.stop, list)
        return self.stop
