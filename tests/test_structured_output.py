"""Structured outputs: the constraint's parts against references, and the engine's outputs matching their
schema, expression, choice or grammar.

The strongest oracle is a model with random weights: left alone it writes no JSON, so every output that
parses and fits its schema shows the masks were applied to every token.
"""

import json
import pickle
import re

import pytest
import torch

from bento_pagedllm import RequestError, SamplingParams
from bento_pagedllm.structured_output import StructuredOutputs, mask_disallowed

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{4}"
CHOICES = ("positive", "negative", "neutral")
LIST_GRAMMAR = """
start: "(" item ("," item)* ")"
item: "a" | "bb"
"""


def check_person(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"name", "age", "color", "tags"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 120
    assert value["color"] in ("red", "green", "blue")
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(t in (True, False) for t in value["tags"])


def all_free(llm) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.requests


# ---- the constraint ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ("a",)}, "exactly one"),
    ({"json": '{"type": "objectx"}'}, "objectx"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "JSON object"),
    ({"regex": "(unclosed"}, "unclosed"),
    ({"choice": ()}, "non-empty"),
    ({"choice": ("a", "")}, "non-empty"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
])
def test_bad_constraints_are_refused_with_the_parsers_message(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputs(**fields)


def test_a_constraint_travels_to_an_engine_process():
    spec = StructuredOutputs.from_json_schema(PERSON)
    params = SamplingParams(structured_outputs=spec)
    assert pickle.loads(pickle.dumps(params)).structured_outputs == spec
    assert params.reads_history and not SamplingParams().reads_history
    with pytest.raises(ValueError, match="StructuredOutputs"):
        SamplingParams(structured_outputs={"json": "{}"})


@pytest.mark.parametrize("vocab", [64, 70, 1000])
def test_mask_disallowed_matches_a_token_by_token_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    rows = torch.tensor([3, 0])
    masks = torch.randint(-(2**31), 2**31 - 1, (2, (vocab + 31) // 32), dtype=torch.int32, generator=gen)
    out = mask_disallowed(logits, rows, masks)
    expected = logits.clone()
    for k, row in enumerate(rows.tolist()):
        for token in range(vocab):
            if not (int(masks[k, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    assert torch.equal(out, expected)
    assert torch.equal(out[[1, 2, 4]], logits[[1, 2, 4]])  # rows without a grammar untouched


# ---- the engine ----------------------------------------------------------------------------------


def test_random_weights_still_write_what_each_constraint_allows(llm):
    """Sampled at temperature 1 from a random model, every choice of every request matches its
    constraint and ends by itself (finish reason "stop"), with several kinds of constraint in one batch."""
    specs = [StructuredOutputs.from_json_schema(PERSON), StructuredOutputs(regex=PHONE),
             StructuredOutputs(choice=CHOICES), StructuredOutputs(grammar=LIST_GRAMMAR)]
    params = [SamplingParams(n=3, temperature=1.0, seed=seed, max_tokens=200, structured_outputs=spec)
              for seed, spec in enumerate(specs)]
    outs = llm.generate(["Describe a person.", "Call me at", "The mood is", "A number:"], params)
    for out in outs:
        assert [c.finish_reason for c in out.outputs] == ["stop"] * 3, out.outputs
    for choice in outs[0].outputs:
        check_person(choice.text)
    assert all(re.fullmatch(PHONE, c.text) for c in outs[1].outputs)
    assert all(c.text in CHOICES for c in outs[2].outputs)
    assert all(re.fullmatch(r"\((a|bb)(,(a|bb))*\)", c.text) for c in outs[3].outputs), outs[3].outputs
    assert all_free(llm)


def test_an_unconstrained_request_beside_constrained_ones_is_unchanged(llm):
    prompt, plain = "Once upon a time", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(prompt, plain)[0].outputs[0].token_ids
    spec = SamplingParams(temperature=0.0, max_tokens=50, structured_outputs=StructuredOutputs(json_object=True))
    together = llm.generate([prompt, "JSON:", prompt], [plain, spec, plain])
    assert together[0].outputs[0].token_ids == alone == together[2].outputs[0].token_ids
    constrained_alone = llm.generate("JSON:", spec)[0].outputs[0]
    assert together[1].outputs[0].token_ids == constrained_alone.token_ids


def test_the_grammar_decides_the_end_over_min_tokens_and_ignore_eos(llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=40, min_tokens=20, ignore_eos=True,
                            structured_outputs=StructuredOutputs(choice=("yes", "no")))
    out = llm.generate("Answer:", params)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"


def test_max_tokens_cuts_a_constrained_output(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3,
                            structured_outputs=StructuredOutputs.from_json_schema(PERSON))
    out = llm.generate("Describe a person.", params)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith('{"')


def test_a_constraint_on_a_model_without_tokenizer_is_refused(llm):
    processor = llm.engine.prompts
    tokenizer, processor.tokenizer = processor.tokenizer, None
    try:
        with pytest.raises(RequestError, match="tokenizer"):
            params = SamplingParams(structured_outputs=StructuredOutputs(regex="a"))
            llm.engine.add_request(None, [5, 6, 7], params)
    finally:
        processor.tokenizer = tokenizer


def test_smollm2_answers_in_the_schema_greedily(smol):
    """The real model, greedy, float32: JSON that fits the schema, and the same with the chat template and
    log-probabilities asked for (the sampler's full path)."""
    conv = [{"role": "user", "content": "Describe a person called Ann as JSON: name, age, favourite color, tags."}]
    spec = StructuredOutputs.from_json_schema(PERSON)
    out = smol.chat(conv, SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=spec))[0].outputs[0]
    assert out.finish_reason == "stop"
    check_person(out.text)
    with_logprobs = smol.chat(conv, SamplingParams(temperature=0.0, max_tokens=80, logprobs=2,
                                                   structured_outputs=spec))[0].outputs[0]
    assert with_logprobs.token_ids == out.token_ids
    assert all(lp.logprob <= 0.0 for lp in with_logprobs.logprobs)
    assert all_free(smol)
