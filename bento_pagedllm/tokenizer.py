"""Tokenizer helpers: loading, prompt encoding, chat templates and incremental (streaming) detokenization.

Text is always produced by the fast (Rust) tokenizer that transformers wraps, so that streamed text and
`tokenizer.decode` agree character for character.
"""

from __future__ import annotations

import functools
import inspect
import re
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(tokenizer_dir: str) -> PreTrainedTokenizerBase:
    """Load the tokenizer saved in a local folder; never touch the network (the engine serves offline)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)


def read_chat_template(value: str) -> str:
    """`EngineArgs.chat_template`: the template itself when it reads as Jinja (vLLM's rule: it holds `{`, `}` or a
    line break), else the file it names."""
    if any(c in value for c in "{}\n"):
        return value
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as error:
        raise ValueError(f"chat_template {value!r} is neither a Jinja template nor a readable file: {error}") from None


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of a raw prompt, with the tokenizer's own special-token handling (e.g. a BOS it adds) unless
    `add_special_tokens` is false."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


def bad_words_token_ids(tokenizer: PreTrainedTokenizerBase, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """The token sequences `SamplingParams.bad_words` ban: each word as the tokenizer writes it alone and after a
    space (at a text's start, and inside it), without special tokens; each sequence once."""
    sequences = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            sequences.append(tuple(encode_prompt(tokenizer, text, add_special_tokens=False)))
    return tuple(dict.fromkeys(s for s in sequences if s))


@functools.lru_cache(maxsize=1)
def chat_template_call_arguments() -> frozenset[str]:
    """The names transformers' `apply_chat_template` takes itself (and `messages`, the template's variable):
    extra template variables may not use them (a `return_tensors` would change what comes back)."""
    from transformers import PreTrainedTokenizerBase

    names = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    return frozenset(names | {"messages"})


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
    tools: list[dict] | None = None, continue_final_message: bool = False,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of a chat rendered with the model's chat template. `continue_final_message`: the last
    (assistant) message is left open, for the answer to go on from it; `template_kwargs`: more variables for
    the template (e.g. a model's `enable_thinking`).

    NOTE: transformers 5 returns a `BatchEncoding` by default; we ask for a plain list and still unwrap a
    mapping, so callers always get `list[int]`.
    """
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False,
        continue_final_message=continue_final_message, **(template_kwargs or {}),
    )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_TOKEN_CLASSES: weakref.WeakKeyDictionary[Tokenizer, tuple[frozenset[int], frozenset[int]]] = (
    weakref.WeakKeyDictionary()
)


def _token_classes(backend: Tokenizer) -> tuple[frozenset[int], frozenset[int]]:
    """(byte-fallback token ids, special token ids) of a tokenizer; the first is empty without a ByteFallback
    decoder. Computed once per tokenizer (a vocabulary scan), not once per sequence.
    """
    cached = _TOKEN_CLASSES.get(backend)
    if cached is None:
        byte_ids: frozenset[int] = frozenset()
        if "ByteFallback" in str(backend.decoder):
            byte_ids = frozenset(i for t, i in backend.get_vocab().items() if _BYTE_TOKEN.fullmatch(t))
        special = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        cached = _TOKEN_CLASSES[backend] = (byte_ids, special)
    return cached


class IncrementalDetokenizer:
    """Turns a sequence's output token ids into text as they are generated, and applies stop strings.

    Decoding uses `tokenizers.decoders.DecodeStream`, which re-decodes only a short window of tokens per
    step (vLLM's prefix/read offset scheme, in Rust) and withholds text while it ends in an incomplete
    UTF-8 character. Only the output tokens are decoded, so the text is the completion alone, exactly as
    `tokenizer.decode(output_ids, skip_special_tokens=...)` would render it.

    SentencePiece-style `ByteFallback` decoders render a run of `<0xXX>` tokens as one UTF-8 string, or as
    one U+FFFD per token if the run as a whole is invalid, so a later byte token can change text an earlier
    one produced. DecodeStream cannot take text back (it raises), so such a run is fed to it only once a
    token that ends the run has arrived.

    NOTE: the invariant is "".join(every delta, the last with finished=True) == output_text, and, when no
    stop string matched, output_text == tokenizer.decode(output_ids, skip_special_tokens=...).
    NOTE: transformers' `clean_up_tokenization_spaces` is not applied (transformers 5 ignores it for BPE
    anyway); it would make text depend on characters not yet generated.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise TypeError("IncrementalDetokenizer needs a fast (tokenizers-backed) tokenizer")
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = tuple(s for s in ([stop] if isinstance(stop, str) else stop) if s)
        self._include_stop = include_stop_str_in_output
        max_stop_len = max((len(s) for s in self._stop), default=0)
        # The last `_lookback` characters are all a stop string could have started in before new text came.
        self._lookback = max(max_stop_len - 1, 0)
        # Text that may still be cut by a stop string must not be streamed yet. When the stop string is kept
        # in the output only text *after* it is cut, and that text always arrives in the same step.
        self._holdback = 0 if include_stop_str_in_output else self._lookback
        self._ids: list[int] = []
        byte_ids, special_ids = _token_classes(backend)
        # Ids that render to nothing: skipped special tokens vanish before the decoder runs.
        self._silent_ids = special_ids if skip_special_tokens else frozenset()
        # Ids that may continue a byte-fallback run.
        self._run_ids = byte_ids | self._silent_ids if byte_ids else byte_ids
        self._held: list[int] = []  # ids not yet fed to DecodeStream: an unfinished byte-fallback run
        self._pending: list[int] = []  # ids fed since DecodeStream last produced text
        self._parts: list[str] = []  # output text, in pieces (joined lazily: no O(n) copy per token)
        self._tail = ""  # the last `_lookback` characters of the output text
        self._unsent: list[str] = []  # output text not yet returned by get_delta
        self._unsent_len = 0
        self._decoded_len = 0  # characters produced by the stream, before any stop truncation
        self.stop_reason: str | None = None  # the stop string that matched, if any

    @property
    def output_text(self) -> str:
        """The completion so far; text the decoder withholds joins it at get_delta(finished=True)."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append newly generated token ids; return the stop string that matched (first match in the text),
        else None.

        After a match, output_text is truncated right before the stop string (or right after it when
        include_stop_str_in_output), and the sequence is finished: later calls are ignored.
        """
        if self.stop_reason is not None or not token_ids:
            return None
        feed = list(token_ids)
        self._ids.extend(feed)
        if self._run_ids:
            held = self._held
            held.extend(feed)
            end = len(held)
            while end and held[end - 1] in self._run_ids:
                end -= 1
            if not end:
                return None
            feed, self._held = held[:end], held[end:]
        new = self._stream.step(self._backend, feed)
        if new is None:
            self._pending.extend(feed)
            return None
        self._pending.clear()
        self._decoded_len += len(new)
        return self._append(new)

    def get_delta(self, finished: bool) -> str:
        """New visible text since the previous call.

        While not finished, hold back the last (max stop len - 1) characters that could still be the start of
        a stop string, so the concatenation of all deltas always equals the final output_text. With
        include_stop_str_in_output nothing needs holding back: only text after a stop string is ever cut.
        finished=True also releases text the decoder still withholds (e.g. a cut-off UTF-8 character).
        """
        if finished:
            self._flush()
        keep = 0 if finished or self.stop_reason is not None else self._holdback
        if self._unsent_len <= keep:
            return ""
        unsent = "".join(self._unsent)
        cut = len(unsent) - keep
        self._unsent = [unsent[cut:]] if keep else []
        self._unsent_len = keep
        return unsent[:cut]

    def _append(self, new: str) -> str | None:
        """Add decoded text; search stop strings only where they could end in it (O(len(new) + lookback))."""
        self._parts.append(new)
        self._unsent.append(new)
        self._unsent_len += len(new)
        if not self._stop:
            return None
        window = self._tail + new
        best, best_at = None, len(window)
        for s in self._stop:
            # Start late enough that a match ends inside `new` (older text was searched already) and end
            # early enough that it starts before the best match so far.
            at = window.find(s, max(len(self._tail) - len(s) + 1, 0), best_at + len(s) - 1)
            if at != -1 and at < best_at:
                best, best_at = s, at
        if best is None:
            self._tail = window[-self._lookback:] if self._lookback else ""
            return None
        # NOTE: everything cut here is still unsent: it lies in `new` or in the held-back tail.
        drop = len(window) - best_at - (len(best) if self._include_stop else 0)
        if drop:
            self._parts = [self.output_text[:-drop]]
            self._unsent = ["".join(self._unsent)[:-drop]]
            self._unsent_len -= drop
        self.stop_reason = best
        return best

    def _flush(self) -> None:
        """At the end, release what is still withheld (e.g. a cut-off UTF-8 character, rendered as U+FFFD)."""
        leftover = self._pending + self._held
        self._pending, self._held = [], []
        if self.stop_reason is not None or not leftover:
            return
        # NOTE: only a leftover with text (not, say, a skipped EOS) costs a full decode, once a sequence.
        if all(i in self._silent_ids for i in leftover):
            return
        full = self._backend.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
        rest = full[self._decoded_len:]
        if rest:
            self._decoded_len += len(rest)
            self._append(rest)
