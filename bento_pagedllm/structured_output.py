"""Structured outputs: the generated text must match a JSON Schema, a regular expression, one of a list of
strings or a Lark grammar (OpenAI's `response_format`, vLLM's `structured_outputs`).

How: each constrained sequence owns a grammar matcher (llguidance, the library vLLM and llama.cpp use).
Before a step samples the sequence, the matcher computes which token ids may come next (a bitmask over
the vocabulary, ~0.1 ms a row on the host); the sampler sets the others' logits to -inf; after the step
the sampled token advances the matcher. When the grammar can take no more tokens the sequence stops
with finish reason "stop", without spending a step on the end-of-sequence token.

NOTE: a constrained row's next mask depends on the token just sampled, so a step holding one is read
before the next step is planned (`SamplingParams.reads_history`), as for penalties: no async scheduling
for those steps.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from llguidance import LLExecutor, LLMatcher, LLTokenizer
    from transformers import PreTrainedTokenizerBase

# NOTE: JSON without optional whitespace: a small model may otherwise emit spaces or newlines until
# max_tokens (a schema's "x-guidance" key may ask for whitespace back)
_JSON_OPTIONS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = '{"type": "object"}'


@dataclass(frozen=True)
class StructuredOutputs:
    """What the output must match: exactly one of the fields is set (vLLM's names).

    `json`: a JSON Schema, as JSON text; `json_object`: any JSON object (OpenAI's JSON mode); `regex`: a
    regular expression (Rust's `regex` syntax) over the whole output; `choice`: one of these strings;
    `grammar`: a Lark grammar (llguidance's dialect). Validated here, once: a bad schema, expression or
    grammar raises ValueError with the parser's message.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None, self.choice is not None,
                 self.grammar is not None]
        if sum(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice, grammar")
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("choice must be a non-empty list of non-empty strings")
        from llguidance import LLMatcher

        error = LLMatcher.validate_grammar(self.llguidance_grammar())
        if error:
            raise ValueError(f"invalid structured output: {error.strip()}")

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (what `LLMatcher` takes)."""
        from llguidance import LLMatcher

        if self.json is not None or self.json_object:
            schema = ANY_JSON_OBJECT if self.json_object else self.json
            try:
                parsed = json.loads(schema)
            except ValueError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
            if not isinstance(parsed, dict):
                raise ValueError("a JSON schema must be a JSON object")
            return LLMatcher.grammar_from_json_schema(parsed, defaults=_JSON_OPTIONS)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)

    @classmethod
    def from_json_schema(cls, schema: dict[str, Any]) -> "StructuredOutputs":
        return cls(json=json.dumps(schema))


class GrammarMatchers:
    """Makes the matchers of an engine's constrained sequences; holds llguidance's view of the tokenizer,
    built on first use (~1 s for a 50,000-token vocabulary), so engines that never see a constrained
    request never pay for it."""

    def __init__(self, tokenizer: "PreTrainedTokenizerBase | None", vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._ll_tokenizer: "LLTokenizer | None" = None

    def matcher(self, spec: StructuredOutputs) -> "LLMatcher":
        from llguidance import LLMatcher

        if self.tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer")
        if self._ll_tokenizer is None:
            import llguidance.hf

            # NOTE: the model's vocabulary may be wider than the tokenizer's: the extra ids are never allowed
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=list(self.eos_token_ids))
        matcher = LLMatcher(self._ll_tokenizer, spec.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output: {matcher.get_error().strip()}")
        return matcher


def advance(matcher: "LLMatcher", token_id: int) -> bool:
    """Feed the sampled token to the sequence's matcher; True when the grammar is complete and takes no
    more tokens (the sequence stops). NOTE: the token was drawn under the matcher's mask, so it is
    accepted; a refusal means a bug, and fails the request."""
    if not matcher.consume_token(token_id):
        raise RuntimeError(f"the grammar refused token {token_id}: {matcher.get_error()}")
    return matcher.is_stopped()


def fill_allowed_token_masks(masks: torch.Tensor, matchers: list[tuple["LLMatcher", int]]) -> None:
    """Each (matcher, row): row `row` of `masks` ([rows, ceil(vocab / 32)] int32) becomes the matcher's next
    tokens: bit j of word i set when token 32 i + j may come next (llguidance's layout). Several rows are
    filled in parallel, by llguidance's threads (a row takes ~0.05-0.2 ms; without the GIL)."""
    from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par

    if len(matchers) == 1:
        fill_next_token_bitmask(matchers[0][0], masks, matchers[0][1])
    elif matchers:
        fill_next_token_bitmask_par(_mask_threads(), matchers, masks)


def token_bitmask(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """[ceil(vocab / 32)] int32 with the bits of the given tokens set, in the masks' layout (above): a
    request's `allowed_token_ids`, made once when it is admitted."""
    bits = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.int64)
    bits[list(token_ids)] = 1
    words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)  # [words] in [0, 2^32)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


@functools.lru_cache(maxsize=1)
def _mask_threads() -> "LLExecutor":
    """llguidance's thread pool (80% of the CPUs, at most 32), made once a process, on first need."""
    from llguidance import LLExecutor

    return LLExecutor()


def mask_disallowed(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """logits [num_rows, vocab] with -inf at every token the bitmask of each of `rows` leaves out.

    rows: [k] int64 indices into logits; masks: [k, ceil(vocab / 32)] int32 on the logits' device."""
    vocab = logits.shape[1]
    bits = torch.arange(32, device=masks.device, dtype=torch.int32)
    allowed = ((masks[:, :, None] >> bits) & 1).reshape(masks.shape[0], -1)[:, :vocab].bool()  # [k, vocab]
    constrained = logits[rows].masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, constrained)
