"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt's or a chat's token ids, exactly those the generation
endpoints would send the model, and the context window they must fit) and `POST /detokenize` (ids back to
text). Clients count tokens or build training data with them (vLLM serves them at its root; routes.py serves
them under /v1 too). The serving process's own tokenizer and chat template answer: no engine request.
"""

from __future__ import annotations

from typing import Any

from ..async_engine import AsyncLLMEngine
from ..engine import RequestError
from .errors import OpenAIError
from .jobs import chat_prompt_ids, tokenize_text
from .protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from .tools import plan_tools

# the fields that shape a chat's rendering: a `prompt` has none of them
_CHAT_FIELDS = ("tools", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "chat_template")


async def tokenize(body: TokenizeRequest, engine: AsyncLLMEngine, model_name: str) -> dict[str, Any]:
    """vLLM's TokenizeResponse: `count`, `max_model_len`, `tokens` and (with `return_token_strs`) `token_strs`."""
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError("Give either prompt or messages.", param="prompt" if body.prompt is None else "messages")
    if body.prompt is not None:
        if given := [name for name in _CHAT_FIELDS if name in body.model_fields_set]:
            raise OpenAIError(f"{given[0]} applies to messages, not to a prompt.", param=given[0])
        ids = await tokenize_text(engine, body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        if body.add_special_tokens:
            # NOTE: the chat template writes the model's special tokens itself (as /chat/completions sends it)
            raise OpenAIError("add_special_tokens applies to a prompt: a chat's special tokens come from its "
                              "template.", param="add_special_tokens")
        chat = ChatCompletionRequest(model=model_name, **{
            name: getattr(body, name) for name in ("messages", *_CHAT_FIELDS)})
        ids = await chat_prompt_ids(chat, engine, plan_tools(chat), "messages")
    tokenizer = engine.prompts.tokenizer
    return {
        "count": len(ids),
        "max_model_len": engine.prompts.configs.scheduler.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }


def detokenize(body: DetokenizeRequest, engine: AsyncLLMEngine) -> dict[str, Any]:
    """vLLM's DetokenizeResponse: the ids' text (special tokens included, as vLLM decodes them)."""
    tokenizer = engine.prompts.tokenizer
    if tokenizer is None:
        raise RequestError("this model has no tokenizer")
    vocab = engine.prompts.model_config.vocab_size
    if any(token >= vocab for token in body.tokens):
        raise OpenAIError(f"tokens must be in [0, {vocab}).", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}
