"""The OpenAI request bodies, as pydantic models: used at the HTTP boundary only.

Field names and ranges follow OpenAI's API reference; `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
`stop_token_ids`, `min_tokens`, `include_stop_str_in_output`, `skip_special_tokens`, `truncate_prompt_tokens`,
`return_tokens_as_token_ids`, `prompt_logprobs`, `allowed_token_ids`, `bad_words`, `cache_salt`, `priority`,
`add_special_tokens`, `use_beam_search` and `length_penalty` are vLLM's extensions. Unknown fields are
ignored. Types are strict (`"temperature": "1"` is an error, as in OpenAI's API), except that an integer is
a valid float and, as JSON Schema has it, a float without a fractional part (`2.0`) a valid integer. The API's OpenAPI document is generated
from these models (schema.py), and the tests fuzz the server against it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

MAX_LOGPROBS = 20  # SamplingParams.MAX_LOGPROBS; OpenAI's limit for top_logprobs too
MAX_N = 128
# NOTE: each stop string and stop token id is checked after every generated token, on the engine thread that
# serves everyone: long lists would slow all requests down. (OpenAI takes at most 4 stop strings.)
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
# NOTE: each bad word is matched against a sequence's last tokens every step it samples, on the engine thread
MAX_BAD_WORDS = 64
MAX_LOGIT_BIAS = 300  # entries a request: OpenAI's limit (each costs host work every step it is sampled)
MAX_TOOLS = 128  # OpenAI's limit


def _integral_float_to_int(value: object) -> object:
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(_integral_float_to_int)]  # NOTE: use it, not int, for every integer field
Float = Annotated[float, Field(allow_inf_nan=False)]
Bias = Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]  # SamplingParams.MAX_LOGIT_BIAS
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
PositiveInt = Annotated[Int, Field(ge=1)]
TokenId = Annotated[Int, Field(ge=0)]


def _seed_in_range(value: int) -> int:
    """NOTE: a check of its own, as pydantic's `lt=2**64` message writes the bound as a float (...552000)."""
    if not -(1 << 63) <= value < 1 << 64:
        raise PydanticCustomError("seed_range", "Input should be at least -2**63 and below 2**64")
    return value


# what a 64-bit seed holds, signed or not (the bounds stated in the OpenAPI document too)
Seed = Annotated[Int, AfterValidator(_seed_in_range),
                 Field(json_schema_extra={"minimum": -(1 << 63), "exclusiveMaximum": 1 << 64})]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: with include_usage, every chunk reports usage so far


class JsonSchemaFormat(_Body):
    """response_format.json_schema (OpenAI's structured outputs)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # NOTE: `schema` is BaseModel's
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Body):
    """vLLM's `structured_outputs` extension: exactly one of these (structured_output.py)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON Schema
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1)] | None = None
    grammar: str | None = None  # Lark
    json_object: bool | None = None


# vLLM's fields before `structured_outputs` (still sent by clients written for vLLM 0.10 and earlier): ignored,
# they would leave the answer unconstrained without a word
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


class _SamplingRequest(_Body):
    """What completions and chat completions share."""

    @model_validator(mode="before")
    @classmethod
    def _guided_as_structured_outputs(cls, data: Any) -> Any:
        """vLLM's older `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar`: the same constraints
        as `structured_outputs` (which wins where both are given)."""
        if not isinstance(data, dict) or not any(data.get(name) is not None for name in _GUIDED_FIELDS):
            return data
        guided = {kind: data[name] for name, kind in _GUIDED_FIELDS.items() if data.get(name) is not None}
        rest = {key: value for key, value in data.items() if key not in _GUIDED_FIELDS}
        return rest if rest.get("structured_outputs") is not None else {**rest, "structured_outputs": guided}

    model: str | None = None  # NOTE: left out or null: the served model (vLLM's); the route fills it in
    n: Annotated[Int, Field(ge=1, le=MAX_N)] | None = 1
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    seed: Seed | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # token id (a string, as OpenAI's; the route checks it against the vocabulary) -> bias
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: str | None = None  # ignored
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: Annotated[Int, Field(ge=-1)] | None = None  # -1 or 0: disabled
    min_p: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: Annotated[Int, Field(ge=0)] | None = 0
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool | None = False  # the matched stop string stays at the text's end
    skip_special_tokens: bool | None = True  # false: special tokens' text (e.g. "</s>") stays in the output
    # keep only the prompt's last k tokens; -1: the model's context length (vLLM's); 0 is refused where it is read
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    # vLLM's: the answer's id is built from it (as from an X-Request-Id header, which wins)
    request_id: str | None = None
    # vLLM's: the prompt's token ids and each choice's beside the text (non-streamed answers; a stream: a 400)
    return_token_ids: bool | None = False
    return_tokens_as_token_ids: bool | None = False  # log-probabilities name tokens "token_id:N"
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None  # only these may be drawn
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None  # never ended on
    use_beam_search: bool | None = False  # vLLM's: the n best beams instead of n samples (not streamed)
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] = 1.0  # vLLM's: beam scores / length ** this
    # vLLM's: the prompt shares prefix-cache blocks only with requests of the same salt (one per tenant)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    priority: Int = 0  # vLLM's: lower runs first; nonzero needs the server's priority scheduling policy
    # each prompt token's log-probability and the top k at its position (not streamed)
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # OpenAI's; the completions endpoint takes it too, as vLLM's does
    response_format: ResponseFormat | None = None


class CompletionRequest(_SamplingRequest):
    """POST /completions. `prompt`: a string, a list of strings (a batch), token ids or a list of token-id lists."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Annotated[Int, Field(ge=0)] | None = None  # 0: with echo, only the prompt (and its scores)
    echo: bool | None = False
    add_special_tokens: bool | None = True  # vLLM's: false leaves out the tokenizer's own (a BOS) from text prompts
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None  # accepted only when null: not supported
    best_of: PositiveInt | None = None  # accepted only when equal to n


class TextContentPart(_Body):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Body):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Body):
    """A tool call the assistant made earlier in the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's
    tool_call_id: str | None = None  # a tool's answer: to which call


class FunctionDefinition(_Body):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # the arguments always match the schema when the server constrains them


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    """POST /chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template options: end the prompt with the assistant's turn opened (the default), or leave
    # the last (assistant) message open for the answer to continue it; more variables for the template
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's per-request template: refused (a 400), as vLLM refuses it unless told to trust requests' templates
    chat_template: str | None = None


# ---- vLLM's POST /tokenize and POST /detokenize (tokenization.py) ------------------------------------------


class TokenizeRequest(_Body):
    """POST /tokenize, vLLM's two forms in one body: a `prompt` (a completion's text) or `messages` (a chat,
    with the chat request's tools and template options, rendered as /chat/completions renders it)."""

    model: str | None = None  # the served model's name, if given
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused, as on /chat/completions
    # the tokenizer's special tokens (e.g. a BOS): added to a prompt by default; a chat's come from its template
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


# ---- POST /responses (OpenAI's Responses API; responses_api.py answers it through the chat path) --------


class InputText(_Body):
    """A text part of a message: `input_text` (what the user or system said) or `output_text` (an earlier
    answer of the assistant's, sent back as conversation state)."""

    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Body):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(_Body):
    """A function call the model made earlier (sent back with its output as conversation state)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class TextFormat(_Body):
    """text.format: OpenAI's structured outputs in the Responses API (json_schema's fields inline)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class TextConfig(_Body):
    format: TextFormat | None = None


class FunctionTool(_Body):
    """A function tool as the Responses API gives it: FunctionDefinition's fields, not nested."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Body):
    type: Literal["function"]
    name: str


class Reasoning(_Body):
    effort: str | None = None  # accepted only when null or "none": the served models do not reason
    summary: str | None = None


class ResponsesRequest(_Body):
    """POST /responses: one answer to `input` (a string, or messages and earlier function calls and their
    outputs), after `instructions` (a system message). Stateless: `previous_response_id` and `background`
    are refused and nothing is stored (the answer says `store: false`)."""

    model: str | None = None  # as in the other requests: the served model when left out
    input: str | Annotated[list[InputMessage | FunctionCallItem | FunctionCallOutputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stream: bool | None = False
    text: TextConfig | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    metadata: Annotated[dict[str, str], Field(max_length=16)] | None = None  # returned as given
    user: str | None = None  # ignored
    store: bool | None = None  # nothing is stored, whatever it says
    truncation: Literal["disabled"] | None = None  # "auto" (dropping early input to fit) is not supported
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None  # refused: no stored responses
    background: bool | None = None  # refused when true
    include: list[str] | None = None  # OpenAI's includables: "message.output_text.logprobs" adds something
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # vLLM's, as on chat
    priority: Int = 0  # vLLM's, as on chat
    logit_bias: Annotated[dict[str, Bias], Field(max_length=MAX_LOGIT_BIAS)] | None = None  # vLLM's, as on chat


FIELD_NAMES: frozenset[str] = frozenset(
    field.alias or name
    for model in (StreamOptions, CompletionRequest, TextContentPart, ChatMessage, ChatCompletionRequest,
                  ResponseFormat, JsonSchemaFormat, StructuredOutputsParams, ToolCall, ToolCallFunction,
                  FunctionDefinition, Tool, NamedFunction, NamedToolChoice, InputText, InputMessage, FunctionCallItem,
                  FunctionCallOutputItem, TextFormat, TextConfig, FunctionTool, FunctionToolChoice, Reasoning,
                  ResponsesRequest, TokenizeRequest, DetokenizeRequest)
    for name, field in model.model_fields.items()
)
