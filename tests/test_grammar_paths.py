"""Grammar on the device automaton and on llguidance: which grammars have a regular-expression form
(grammar_regex.py), the choice of path, equal masks on every short token sequence, and the same
distribution on both paths (exact enumeration, reference backend)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

import smcdecode as sd
from smcdecode.potentials.grammar_regex import NotRegular, grammar_regex
from smcdecode.testing import check_distribution, exact_target

pytest.importorskip("llguidance")
pytest.importorskip("lark")

VOCAB = ["<bos>", "a", "b", "ab", "ba", ",", ", ", " ", ";", "c", "bc", "<eos>"]
EOS = len(VOCAB) - 1
PROMPT = [0, 1, 2]
REGULAR = {
    "list": 'start: ITEM (", " ITEM)* ";"\nITEM: /[ab]+/',  # lark's left recursion for *
    "right": 'start: x\nx: "a" x | "b" ";"?',  # right recursion
    "shared prefix": 'start: "a" | "ab" "c" | "b"+',
    "rules": 'start: pair (";" pair)?\npair: WORD "," WORD\nWORD: "a" | "b" | "ab"',
}
NOT_REGULAR = {
    'start: x\nx: "a" x "b" | "c"': "refers to itself",
    'start: e\ne: "a" | "(" f\nf: e ")"': "recursion through rules (e -> f -> e)",
    'start: A B\nA: /a+/\nB: "a"': "lexes greedily",
    'start: "a" "b"\n%ignore " "': "%ignore",
    "start: NUMBER\n%import common.NUMBER": "%import",
    r"start: /\d+/": r"\d",
}


def _toy(seed: int = 0) -> sd.FunctionModel:
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(251, len(VOCAB), generator=g, dtype=torch.float64)
    return sd.FunctionModel(lambda ctx: table[(ctx.sum(-1) * 7 + ctx.shape[-1]) % 251], vocab=VOCAB, eos="<eos>")


@pytest.mark.parametrize("name", sorted(REGULAR))
def test_regular_grammars_take_the_automaton(name):
    g = sd.Grammar(REGULAR[name])
    assert g.path == "automaton" and g.path_reason == "the grammar's language is regular"
    assert sd.Grammar(REGULAR[name], path="llguidance").path == "llguidance"
    assert sd.Grammar(REGULAR[name], force_canonical=True).path == "llguidance"


@pytest.mark.parametrize("text", sorted(NOT_REGULAR))
def test_other_grammars_keep_llguidance_and_say_why(text):
    why = NOT_REGULAR[text]
    with pytest.raises(NotRegular, match=re.escape(why)):
        grammar_regex(text)
    g = sd.Grammar(text)
    assert g.path == "llguidance" and why in g.path_reason, g.path_reason
    with pytest.raises(sd.SMCDecodeError, match="no token automaton.*" + re.escape(why)):
        sd.Grammar(text, path="automaton")


def test_bad_path_and_bad_grammar_are_errors_on_both_paths():
    with pytest.raises(sd.SMCDecodeError, match="path must be one of"):
        sd.Grammar('start: "a"', path="gpu")
    for path in ("auto", "automaton", "llguidance"):
        with pytest.raises(sd.SMCDecodeError, match="invalid lark grammar"):
            sd.Grammar("start: expr\nexpr: NUMBER", path=path)


def test_greedy_lexing_is_why_the_check_exists():
    """llguidance's language of A B (A: /a+/, B: "a") is empty, though the rules concatenate to a+a."""
    from test_json_schema import char_model

    model = char_model("a")
    g = sd.Grammar(next(t for t, w in NOT_REGULAR.items() if w == "lexes greedily")).bind(model)
    assert g.path == "llguidance" and not any(g.matches("a" * n) for n in range(1, 5))


@pytest.mark.parametrize("name", sorted(REGULAR))
def test_masks_equal_llguidance_on_every_short_sequence(name):
    model = _toy()
    auto = sd.Grammar(REGULAR[name]).bind(model)
    llg = sd.Grammar(REGULAR[name], path="llguidance").bind(model)
    assert auto.token_automaton is not None and llg.token_automaton is None
    text = [t for t in range(len(VOCAB)) if t not in (0, EOS)]
    live = 0
    for n in range(5):
        for seq in itertools.product(text, repeat=n):
            a, b = auto.logw_next(list(seq)), llg.logw_next(list(seq))
            assert torch.equal(torch.isinf(a), torch.isinf(b)), (name, [VOCAB[t] for t in seq])
            assert auto.complete(list(seq)) == llg.complete(list(seq)), (name, [VOCAB[t] for t in seq])
            live += bool(torch.isfinite(a).any())
    assert live > 5


@pytest.mark.parametrize("name", ["list", "shared prefix"])
def test_both_paths_sample_the_exact_target(name):
    model = _toy(1)
    for path in ("automaton", "llguidance"):
        target = sd.LM(model) * sd.Grammar(REGULAR[name], path=path)
        exact = exact_target(target, PROMPT, 4)
        out = sd.SMC(target, particles=4).run_groups(PROMPT, groups=800, max_new_tokens=4, seed=3)
        check_distribution(out, exact, z_max=5.0)
