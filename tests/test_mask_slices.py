"""llguidance's slices (token_bytes.mask_slices: finer runs of string characters, and the character
classes a schema's patterns repeat or its formats are made of) change what a mask costs, never the mask: along random walks
through real schemas' documents, with the default model's vocabulary, every mask equals the mask of
llguidance's plain trie walk (slicing off)."""

from __future__ import annotations

import random

import pytest
import torch

from smcdecode.potentials.json_schema import JSONSchema, repeated_classes
from smcdecode.potentials.token_bytes import _llguidance, llguidance_tokenizer, mask_slices

SCHEMAS = {
    "maxLength 8": {"type": "string", "maxLength": 8},
    "maxLength 24": {"type": "string", "maxLength": 24},
    "bounded pattern": {"type": "string", "pattern": "^[a-z ]{1,24}$"},
    "pattern": {"type": "string", "pattern": "^[a-z ]+$"},
    "negated class and digits": {"type": "string", "pattern": "^[^@]+@\\d{2,4}$"},
    "format": {"type": "string", "format": "email"},
}


def _object(value: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "n"],
            "properties": {"name": value, "n": {"type": "integer"}}}


def test_repeated_classes():
    assert repeated_classes(_object(SCHEMAS["pattern"])) == ("[a-z ]",)
    assert repeated_classes(_object(SCHEMAS["negated class and digits"])) == ('[^"\\\\\\x00-\\x1F\\x7F@]', "[0-9]")
    assert repeated_classes({"patternProperties": {"^x[0-9]$": {}, "^[a-f]{2,}$": {}}}) == ("[a-f]",)
    assert repeated_classes({"properties": {"pattern": {"type": "string"}}}) == ()  # (a property named so)
    assert repeated_classes({"const": {"pattern": "[a]+"}, "enum": [{"format": "email"}]}) == ()  # (values)
    assert repeated_classes(_object(SCHEMAS["format"])) == ("[A-Za-z0-9]",)
    assert len(repeated_classes({"anyOf": [{"pattern": f"^[{c}]+$"} for c in "abcde"]})) == 3
    assert mask_slices(("[a-z ]",))[1:3] == ["[a-z ]{1,1}", "[a-z ]{1,2}"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_slices_leave_the_masks_as_they_are(model, name):
    llg = _llguidance()
    c = JSONSchema(_object(SCHEMAS[name]), path="llguidance").bind(model)
    assert c._tok is not llguidance_tokenizer(model)  # (the constraint's own slices)
    plain = llguidance_tokenizer(model).with_slices([])  # (llguidance's trie walk, no slice taken whole)
    words = c._words
    short = torch.tensor([len(model.decode([t])) <= 2 for t in range(model.vocab_size)])
    shifts = torch.arange(32, dtype=torch.int32)
    rng = random.Random(0)
    steps = 0
    for _walk in range(4):
        state, ref, text = c.start(1), llg.LLMatcher(plain, c._grammar, log_level=0), []
        for _ in range(40):
            ours = c.allowed_bits(state)[0]
            theirs = torch.zeros(words, dtype=torch.int32)
            ref.unsafe_compute_mask_ptr(theirs.data_ptr(), words * 4)
            assert torch.equal(ours, theirs), (name, model.decode(text))
            allowed = ((ours[:, None] >> shifts) & 1).bool().reshape(-1)[: model.vocab_size]
            assert allowed.any()
            # (short tokens mostly: the walk stays inside the string a while)
            pick = allowed & short if (allowed & short).any() else allowed
            t = rng.choice(pick.nonzero()[:, 0].tolist())
            if t == model.eos_token_id:
                break
            state = c.advance(state, torch.tensor([t]))
            assert ref.consume_token(t)
            text.append(t)
            steps += 1
    assert steps > 40


@pytest.mark.parametrize("patterns", [["^[a-zA-Z]+$", "^[A-Za-z]+$"], ["^/[^\u0000]+$"]])
def test_classes_whose_slices_repeat_fall_back_to_the_string_slices(model, patterns):
    """llguidance refuses two slices that take the same tokens ("repeating slices?"): the constraint
    then keeps the JSON string slices alone, and its masks are llguidance's."""
    schema = {"type": "object", "additionalProperties": False,
              "properties": {f"p{i}": {"type": "string", "pattern": p} for i, p in enumerate(patterns)}}
    c = JSONSchema(schema, path="llguidance")
    assert c._classes  # (the classes the patterns repeat: their slices repeat)
    bound = c.bind(model)
    assert bound._classes == () and bound.path == "llguidance"
    prefix = model.tokenizer.encode('{"p0": "', add_special_tokens=False)
    state = bound.start(1)
    for t in prefix:
        state = bound.advance(state, torch.tensor([t]))
    plain = _llguidance().LLMatcher(llguidance_tokenizer(model).with_slices([]), bound._grammar, log_level=0)
    assert all(plain.consume_token(t) for t in prefix)
    theirs = torch.zeros(bound._words, dtype=torch.int32)
    plain.unsafe_compute_mask_ptr(theirs.data_ptr(), bound._words * 4)
    assert torch.equal(bound.allowed_bits(state)[0], theirs)
