"""What differs between the completions and chat endpoints: how a choice, a streamed delta and the
log-probabilities look. The routes (routes.py) and the answers (responses.py) do everything else the same
way for both.
"""

from __future__ import annotations

import codecs
import weakref
from dataclasses import dataclass
from typing import Any

from ..outputs import CompletionOutput, RequestOutput
from ..sequence import TokenLogprob

MIN_LOGPROB = -9999.0  # JSON has no -inf


def finish_reason(choice: CompletionOutput) -> str | None:
    return choice.finish_reason  # the engine already uses OpenAI's names: "stop", "length"


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None  # as given, for echo; None for token-id prompts


# ---- what differs between completions and chat -------------------------------------------------------


class Format:
    object: str
    chunk_object: str

    def __init__(self, texts: "_TokenTexts") -> None:
        self.texts = texts
        self._scores: dict[int, list[TokenLogprob | None]] = {}  # per choice: its prompt's scores

    def take_prompt_scores(self, index: int, scores: list[TokenLogprob | None] | None) -> None:
        """The choice's prompt scores (`RequestOutput.prompt_logprobs`), given with each output before its
        delta or choice is asked for."""
        if scores is not None:
            self._scores[index] = scores

    def response_fields(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """Fields of a non-streamed answer beside its choices."""
        return {}

    def choice_token_ids(self, prompt: Prompt, choice: CompletionOutput) -> dict[str, Any]:
        """vLLM's `return_token_ids` fields of a choice."""
        return {"token_ids": choice.token_ids}

    def response_token_ids(self, prompts: list[Prompt]) -> dict[str, Any]:
        """vLLM's `return_token_ids` fields beside the choices."""
        return {}

    def opening(self, index: int, prompt: Prompt) -> dict[str, Any] | None:
        """The choice's first streamed chunk, if it has one."""
        return None

    def delta(self, index: int, choice: CompletionOutput) -> dict[str, Any] | None:
        """What one engine step added to the choice, or None if nothing worth a chunk."""
        raise NotImplementedError

    def finish(self, index: int, reason: str | None) -> list[dict[str, Any]]:
        """The choice's last streamed chunks: what it held back, if anything, then the one with its reason.
        NOTE: the reason comes in a chunk of its own, as OpenAI sends it (the `openai` SDK's stream helpers
        close a tool call's arguments only when the reason follows them)."""
        raise NotImplementedError

    def choice(self, index: int, prompt: Prompt, choice: CompletionOutput) -> dict[str, Any]:
        """The whole choice, in a non-streamed answer."""
        raise NotImplementedError


class ChatFormat(Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, texts: "_TokenTexts", logprobs: bool, prompt_logprobs: int | None = None) -> None:
        super().__init__(texts)
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs

    def response_fields(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        """vLLM's `prompt_logprobs` of a chat answer: beside the choices (one prompt)."""
        if self.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": vllm_prompt_logprobs(self.texts, outputs[0].prompt_logprobs, self.prompt_logprobs)}

    def response_token_ids(self, prompts: list[Prompt]) -> dict[str, Any]:
        """A chat's one prompt: beside the choices, as its `prompt_logprobs`."""
        return {"prompt_token_ids": prompts[0].token_ids}

    def opening(self, index: int, prompt: Prompt) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, choice: CompletionOutput) -> dict[str, Any] | None:
        logprobs = choice.delta_logprobs if self.logprobs else None
        if not choice.delta_text and not logprobs:
            return None
        return {"index": index, "delta": {"content": choice.delta_text}, "logprobs": self._logprobs(logprobs),
                "finish_reason": None}

    def finish(self, index: int, reason: str | None) -> list[dict[str, Any]]:
        return [{"index": index, "delta": {}, "logprobs": None, "finish_reason": reason}]

    def choice(self, index: int, prompt: Prompt, choice: CompletionOutput) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": choice.text, "refusal": None},
            "logprobs": self._logprobs(choice.logprobs if self.logprobs else None),
            "finish_reason": finish_reason(choice),
        }

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if logprobs is None:
            return None
        return {"content": token_logprobs(self.texts, logprobs), "refusal": None}


def token_logprobs(texts: "_TokenTexts", logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's (and the Responses API's) form of each token's log-probability and its top alternatives."""

    def token(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = texts.get(token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(raw)}

    return [{**token(lp.token_id, lp.logprob), "top_logprobs": [token(i, logprob) for i, logprob in lp.top]}
            for lp in logprobs]


class CompletionFormat(Format):
    """With `echo` and `logprobs` the log-probabilities start with the prompt's tokens (the first has none),
    as OpenAI's legacy answers and vLLM's do; streamed, the prompt's text and scores come with the first
    tokens. `prompt_logprobs`: vLLM's field of that name on each choice."""

    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, texts: "_TokenTexts", logprobs: int | None, echo: bool,
                 prompt_logprobs: int | None = None) -> None:
        super().__init__(texts)
        self.logprobs = logprobs
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs
        self._offsets: dict[int, int] = {}  # per choice: text_offset of its next token
        # per choice: its tokens' bytes decoded as they come, so a character split over tokens (byte fallback)
        # counts once, when complete, as it does in the text
        self._decoders: dict[int, codecs.IncrementalDecoder] = {}
        self._held: dict[int, Prompt] = {}  # per choice: a prompt to echo with its scores in the first delta

    @property
    def _echoes_scores(self) -> bool:
        return self.echo and self.logprobs is not None

    def _echo(self, index: int, prompt: Prompt) -> str:
        text = ""
        if self.echo:
            text = prompt.text if prompt.text is not None else self.texts.decode(prompt.token_ids)
        # NOTE: echoed scores count offsets from the prompt's first token (vLLM's), else from the output's
        self._offsets[index] = 0 if self._echoes_scores else len(text)
        return text

    def _prompt_entries(self, index: int, prompt: Prompt) -> list[tuple[int, TokenLogprob | None]]:
        """The prompt's tokens with their scores, to lead the echoed log-probabilities."""
        if not self._echoes_scores or not prompt.token_ids:
            return []
        scores = self._scores.get(index) or [None] * len(prompt.token_ids)
        return list(zip(prompt.token_ids, scores))

    def opening(self, index: int, prompt: Prompt) -> dict[str, Any] | None:
        if self._echoes_scores:  # NOTE: the prompt's scores come with the first tokens: so does its text
            self._held[index] = prompt
            return None
        text = self._echo(index, prompt)
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None} if text else None

    def delta(self, index: int, choice: CompletionOutput) -> dict[str, Any] | None:
        held = self._held.pop(index, None)
        echo, entries = "", []
        if held is not None:
            echo, entries = self._echo(index, held), self._prompt_entries(index, held)
        logprobs = choice.delta_logprobs if self.logprobs is not None else None
        # NOTE: a chunk for every step that produced tokens, even when their text is still held back (or
        # the model has no tokenizer), as vLLM does: streaming clients time tokens by chunks
        if held is None and not choice.delta_text and not logprobs and not choice.delta_token_ids:
            return None
        if logprobs is not None:
            entries += [(lp.token_id, lp) for lp in logprobs]
        return {"index": index, "text": echo + choice.delta_text,
                "logprobs": self._logprobs(index, entries) if logprobs is not None else None, "finish_reason": None}

    def finish(self, index: int, reason: str | None) -> list[dict[str, Any]]:
        return [{"index": index, "text": "", "logprobs": None, "finish_reason": reason}]

    def choice_token_ids(self, prompt: Prompt, choice: CompletionOutput) -> dict[str, Any]:
        """Completions may hold several prompts: each choice names its own, as its `prompt_logprobs`."""
        return {"prompt_token_ids": prompt.token_ids, **super().choice_token_ids(prompt, choice)}

    def choice(self, index: int, prompt: Prompt, choice: CompletionOutput) -> dict[str, Any]:
        echo = self._echo(index, prompt)
        logprobs = None
        if self.logprobs is not None:
            logprobs = self._logprobs(index, self._prompt_entries(index, prompt)
                                      + [(lp.token_id, lp) for lp in choice.logprobs or []])
        answer = {"index": index, "text": echo + choice.text, "logprobs": logprobs,
                  "finish_reason": finish_reason(choice)}
        if self.prompt_logprobs is not None:
            answer["prompt_logprobs"] = vllm_prompt_logprobs(self.texts, self._scores.get(index), self.prompt_logprobs)
        return answer

    def _logprobs(self, index: int, entries: list[tuple[int, TokenLogprob | None]]) -> dict[str, Any]:
        """OpenAI's legacy form of (token id, its score or None) entries."""
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        offset = self._offsets.get(index, 0)
        decoder = self._decoders.setdefault(index, codecs.getincrementaldecoder("utf-8")(errors="replace"))
        for token_id, lp in entries:
            text, raw = self.texts.get(token_id)
            if lp is None:  # the prompt's first token: nothing before it to score it
                chosen, top = None, None
            else:
                chosen = max(lp.logprob, MIN_LOGPROB)
                top = {self.texts.get(i)[0]: max(logprob, MIN_LOGPROB) for i, logprob in lp.top[: self.logprobs]}
                top.setdefault(text, chosen)  # the chosen token is always listed, as in OpenAI's answers
            tokens.append(text)
            token_logprobs.append(chosen)
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(decoder.decode(raw))  # NOTE: characters of the text, not of a `bytes:` label
        self._offsets[index] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": text_offset}


def vllm_prompt_logprobs(texts: "_TokenTexts", scores: list[TokenLogprob | None] | None,
                         num_top: int) -> list[dict[str, Any] | None] | None:
    """vLLM's form of prompt scores: per prompt token None (the first) or {token id: {"logprob", "rank",
    "decoded_token"}}, the prompt's token first, then the `num_top` most likely."""
    if scores is None:
        return None

    def entry(logprob: float, rank: int | None, token_id: int) -> dict[str, Any]:
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": texts.get(token_id)[0]}

    answer: list[dict[str, Any] | None] = []
    for score in scores:
        if score is None:
            answer.append(None)
            continue
        tokens = {str(score.token_id): entry(score.logprob, score.rank, score.token_id)}
        for rank, (token_id, logprob) in enumerate(score.top[:num_top], start=1):
            tokens.setdefault(str(token_id), entry(logprob, rank, token_id))
        answer.append(tokens)
    return answer


# ---- how logprobs name tokens ------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character byte-level BPE vocabularies use."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class _TokenTexts:
    """A token's raw bytes and its text (OpenAI writes a token that is not valid UTF-8 alone as
    `bytes:\\xe2\\x80`), cached per token id."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = backend is not None and "ByteLevel" in str(backend.decoder)
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})

    def decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def get(self, token_id: int) -> tuple[str, bytes]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._raw(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            cached = self._cache[token_id] = (text, raw)
        return cached

    def _raw(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return f"token_id:{token_id}".encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._added:
            return piece.encode()
        if self._byte_level:
            try:
                return bytes(_BYTE_DECODER[c] for c in piece)
            except KeyError:
                pass
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        if "\u2581" in piece:  # SentencePiece's word boundary
            return piece.replace("\u2581", " ").encode()
        return self.tokenizer.decode([token_id]).encode()


_TEXTS: weakref.WeakKeyDictionary[Any, _TokenTexts] = weakref.WeakKeyDictionary()


class _TokenIdTexts(_TokenTexts):
    """vLLM's `return_tokens_as_token_ids`: log-probabilities name each token `token_id:N` (its bytes, those
    of that name), so a client recovers the exact ids even where several decode to the same text."""

    def _raw(self, token_id: int) -> bytes:
        return f"token_id:{token_id}".encode()


def token_texts(tokenizer: Any, as_token_ids: bool = False) -> _TokenTexts:
    """How log-probabilities name tokens (their text, or with `as_token_ids` their ids), cached per tokenizer."""
    if as_token_ids:
        return _TokenIdTexts(tokenizer)
    if tokenizer is None:
        return _TokenTexts(None)
    try:
        texts = _TEXTS.get(tokenizer)
        if texts is None:
            texts = _TEXTS[tokenizer] = _TokenTexts(tokenizer)
        return texts
    except TypeError:  # not weak-referenceable or not hashable: no cache across requests
        return _TokenTexts(tokenizer)
