"""The engine's front: what accepting a request needs (the model's limits, the tokenizer, the chat template),
without the model. The engine owns one; when the engine runs in its own process (engine_process.py), the
serving process builds its own from the same arguments, so it tokenizes and refuses bad requests itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .config import EngineArgs, EngineConfigs, SchedulingPolicy
from .loader import ModelSource, resolve_model, sampling_defaults
from .sampling_params import SamplingParams
from .tokenizer import apply_chat_template, bad_words_token_ids, encode_prompt, load_tokenizer, read_chat_template

# a text, token ids, or vLLM's prompt dicts: {"prompt": text} (TextPrompt), {"prompt_token_ids": ids} (TokensPrompt)
PromptType = str | list[int] | Mapping[str, Any]


class RequestError(ValueError):
    """A request the engine cannot serve (too long, bad token ids...): rejected before scheduling."""


def plain_prompt(prompt: PromptType) -> str | list[int]:
    """The text or the token ids of a prompt given as vLLM's prompt dicts take it (as they are otherwise)."""
    if not isinstance(prompt, Mapping):
        return prompt
    keys = set(prompt)
    if keys == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if keys == {"prompt_token_ids"}:
        return list(prompt["prompt_token_ids"])
    raise RequestError(f"a prompt dict holds 'prompt' (a text) or 'prompt_token_ids' alone; got keys {sorted(keys)}")


class PromptProcessor:
    def __init__(self, args: EngineArgs) -> None:
        self.source: ModelSource = resolve_model(args.model)
        self.configs: EngineConfigs = args.create_configs(self.source.config, self.source.path)
        self.model_config = self.configs.model
        self.tokenizer = load_tokenizer(self.source.tokenizer_dir) if self.source.tokenizer_dir else None
        if args.chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("chat_template is set, but this model has no tokenizer to render it")
            self.tokenizer.chat_template = read_chat_template(args.chat_template)
        # the model's recommended sampling parameters (generation_config.json): the API's defaults for the
        # fields a request leaves out, unless the server is told to ignore them
        self.sampling_defaults = sampling_defaults(self.source)
        # the tokens that end a sequence (unless `ignore_eos`): the model config's and the tokenizer's
        eos = set(self.model_config.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    def tokenize(self, prompt: PromptType, add_special_tokens: bool = True) -> list[int]:
        prompt = plain_prompt(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: give prompts as token ids")
            return encode_prompt(self.tokenizer, prompt, add_special_tokens)
        return list(prompt)

    def chat_prompt_ids(self, messages: list[dict], tools: list[dict] | None = None, *,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The chat rendered by the model's template; `tools` (OpenAI's form) go to the template too
        (tokenizer.apply_chat_template says what the rest do)."""
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer, so no chat template")
        if not self.tokenizer.chat_template:
            raise RequestError("this model has no chat template: the server can take one (EngineArgs.chat_template, "
                               "PAGEDLLM_CHAT_TEMPLATE: vLLM's --chat-template), or send a completions prompt")
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, tools, continue_final_message,
                                   template_kwargs)

    def validate_priority(self, priority: int) -> None:
        """NOTE: vLLM's rule: a priority that the scheduler would ignore is an error, not a silent no-op."""
        if priority and self.configs.scheduler.policy is not SchedulingPolicy.PRIORITY:
            raise RequestError("a nonzero priority needs the priority scheduling policy (scheduling_policy: "
                               "priority)")

    def validate_prompt(self, ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise `RequestError` for a request the engine could not serve."""
        self.validate_priority(priority)
        max_len = self.configs.scheduler.max_model_len
        if not ids:
            raise RequestError("the prompt is empty")
        if len(ids) > max_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens, more than the maximum context length {max_len} "
                f"(by {len(ids) - max_len})"
            )
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})")
        if params.allowed_token_ids and params.allowed_token_ids[-1] >= vocab:
            raise RequestError(f"allowed_token_ids must be in [0, {vocab})")
        max_num_seqs = self.configs.scheduler.max_num_seqs
        if params.n > max_num_seqs:
            # NOTE: the scheduler seats the n choices together: a larger n would wait forever, and block the
            # queue behind it
            raise RequestError(f"n must be at most {max_num_seqs}, the sequences this engine runs at once")
        if params.stop_strings and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer")
        if params.structured_outputs is not None and self.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer")
        if params.bad_words and self.tokenizer is None:
            raise RequestError("bad_words need a tokenizer")

    def bad_words_token_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """The token sequences the request's `bad_words` ban (checked by `validate_prompt`: a tokenizer)."""
        return bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
