"""Grammar (Lark / GBNF via llguidance): errors, the tensor path, a differential test against the
`lark` parser, and exact enumeration of grammar-constrained targets (with rewards and drafts)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import PROMPT, statistical_settings, toy_model, toy_table
from hypothesis import given
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.potentials.grammar import Grammar
from smcdecode.testing import (
    check_batch_consistency,
    check_distribution,
    check_logw_next_consistency,
    check_tensor_path,
    enumerate_prefixes,
    exact_autoregressive,
    exact_target,
    total_variation,
)

ARITH = r"""
start: expr
expr: term ("+" term)*
term: NUM | "(" expr ")"
NUM: /[12]/
"""
ARITH_GBNF = r"""
root ::= expr
expr ::= term ("+" term)*
term ::= [12] | "(" expr ")"
"""
# '1+' and '(1' cross the grammar's token boundaries
VOCAB = ["<bos>", "1", "2", "+", "(", ")", "1+", "(1", "x", "<eos>"]
ALPHABET = ["1", "2", "+", "(", ")"]


def toy(seed: int, scale: float = 1.0, vocab=VOCAB) -> sd.FunctionModel:
    return toy_model(toy_table(seed, len(vocab), scale), vocab)


def noisy_draft(seed: int, vocab=VOCAB, noise: float = 0.3) -> sd.FunctionModel:
    """The target toy's table plus noise: a draft close enough that importance weights stay
    light-tailed (a z-test on a few hundred replicates needs that)."""
    table = toy_table(seed, len(vocab), 1.0) + noise * toy_table(seed + 1, len(vocab), 1.0)
    return toy_model(table, vocab, name="toy-draft")


def lark_parser():
    lark = pytest.importorskip("lark")
    return lark.Lark(ARITH, start="start")


def in_language(parser, text: str) -> bool:
    import lark

    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


# -- errors ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grammar, syntax, needle",
    [
        ("start: expr\nexpr: NUMBER | undefined_rule\n", "lark", 'unknown name: "NUMBER"'),
        ("start: foo\n", "lark", "foo"),
        ("start: (", "lark", "Expected token"),
        ('start: "a" /[/\n', "lark", "invalid lark grammar"),
        ("root ::= [0-9", "gbnf", "invalid GBNF grammar"),
        ("", "lark", "non-empty string"),
        ("start: 'a'", "ebnf", "syntax must be one of"),
    ],
)
def test_invalid_grammar_raises_naming_the_problem(grammar, syntax, needle):
    with pytest.raises(sd.SMCDecodeError) as e:
        Grammar(grammar, syntax=syntax)
    assert needle in str(e.value)


@pytest.mark.parametrize("force_canonical", [False, True])  # (False: we prepend an llguidance options line)
def test_grammar_errors_quote_the_users_lines(force_canonical):
    with pytest.raises(sd.SMCDecodeError) as e:
        Grammar("start: expr\nexpr: NUMBER", force_canonical=force_canonical)
    message = str(e.value)
    assert "at 2(7): unknown name" in message and "%llguidance" not in message, message
    assert "   1 | start: expr\n   2 | expr: NUMBER" in message, message
    with pytest.raises(sd.SMCDecodeError, match=r"2\(8\): Expected token"):
        Grammar('start: "a"\nfoo: ((', force_canonical=force_canonical)


def test_grammar_needs_a_model_before_use():
    with pytest.raises(sd.SMCDecodeError, match="not bound to a vocabulary"):
        Grammar(ARITH).start(1)


# -- the tensor path and the language ----------------------------------------------------------------


def test_tensor_path_agrees_with_scalar_path():
    model = toy(0)
    g = Grammar(ARITH).bind(model)
    seqs = enumerate_prefixes(model, 3)
    check_tensor_path(g, seqs)
    check_logw_next_consistency(g, PROMPT, seqs[:200])
    check_batch_consistency(g, PROMPT, seqs[:60])


def test_language_equals_the_lark_parser_on_every_short_string():
    parser = lark_parser()
    g = Grammar(ARITH).bind(toy(0))
    for n in range(1, 6):
        for chars in itertools.product(ALPHABET, repeat=n):
            text = "".join(chars)
            assert g.matches(text) == in_language(parser, text), text


def test_every_tokenisation_is_allowed_by_default_and_canonical_forcing_is_optional():
    model = toy(0)
    by_char = [VOCAB.index(c) for c in "(1)"]
    merged = [VOCAB.index("(1"), VOCAB.index(")")]
    g = Grammar(ARITH).bind(model)
    assert g.complete(by_char) == 0.0 and g.complete(merged) == 0.0
    Grammar(ARITH, force_canonical=True).bind(model)  # compiles; the allowed set may then shrink


def test_gbnf_and_lark_define_the_same_constraint():
    model = toy(0)
    lark_g = Grammar(ARITH).bind(model)
    gbnf_g = Grammar(ARITH_GBNF, syntax="gbnf").bind(model)
    seqs = [s for s in enumerate_prefixes(model, 3) if lark_g.prefix(s) == 0.0 or gbnf_g.prefix(s) == 0.0]
    assert len(seqs) > 50
    a = lark_g.batch_logw_next(seqs)
    b = gbnf_g.batch_logw_next(seqs)
    assert torch.equal(a, b)


@st.composite
def expressions(draw, depth=3):
    terms = draw(st.integers(1, 3))
    parts = []
    for _ in range(terms):
        if depth > 0 and draw(st.booleans()):
            parts.append("(" + draw(expressions(depth=depth - 1)) + ")")
        else:
            parts.append(draw(st.sampled_from(["1", "2"])))
    return "+".join(parts)


@statistical_settings(60)
@given(text=expressions(), cut=st.integers(1, 30))
def test_generated_expressions_are_accepted_and_their_prefixes_are_viable(text, cut):
    g = Grammar(ARITH).bind(toy(0))
    assert g.matches(text)
    model = g.model
    ids = model.encode(text)
    assert g.prefix(ids[: min(cut, len(ids))]) == 0.0
    assert g.complete(ids[: len(ids) - 1]) == float("-inf") or g.matches(model.decode(ids[:-1]))


# -- exact enumeration ---------------------------------------------------------------------------------


@statistical_settings(4)
@given(seed=st.integers(0, 10_000), particles=st.sampled_from([4, 6]))
def test_smc_matches_the_exact_global_conditional(seed, particles):
    model = toy(seed)
    target = sd.LM(model) * Grammar(ARITH)
    exact = exact_target(target, PROMPT, 5)
    out = sd.SMC(target, particles=particles).run_groups(PROMPT, groups=1000, max_new_tokens=5, seed=seed)
    check_distribution(out, exact)


@statistical_settings(3)
@given(seed=st.integers(0, 10_000), block=st.sampled_from([1, 2, 4]), mode=st.sampled_from(["prefix", "complete"]))
def test_smc_sd_with_masked_draft_and_a_reward(seed, block, mode):
    model, draft = toy(seed), noisy_draft(seed)
    # a mild tilt: a strong one makes the draft a poor proposal for the tilted target, and the
    # weights too heavy-tailed for a z-test on this many replicates
    reward = sd.Reward(lambda text: 0.6 * text.count("+") - 0.3 * text.count("("), beta=0.5, mode=mode)
    target = sd.LM(model) * Grammar(ARITH) * reward
    exact = exact_target(target, PROMPT, 5)
    out = sd.SMC(target, sd.Draft(draft), particles=4, block_size=block).run_groups(
        PROMPT, groups=1500, max_new_tokens=5, seed=seed
    )
    check_distribution(out, exact)


def test_locally_masked_decoding_is_far_from_the_global_conditional_and_smc_is_not():
    parser = lark_parser()
    model = toy(11, 1.5)
    target = sd.LM(model) * Grammar(ARITH)
    exact = exact_target(target, PROMPT, 5)
    local = exact_autoregressive(target, PROMPT, 5)
    assert total_variation(exact.probs, local.probs) > 0.15
    out = sd.SMC(target, particles=4).run_groups(PROMPT, groups=600, max_new_tokens=5, seed=0)
    check_distribution(out, exact)
    W = torch.softmax(out.log_weights.double(), -1)
    for g in range(out.tokens.shape[0]):
        for i in range(out.tokens.shape[1]):
            if W[g, i] > 0:
                ids = out.tokens[g, i, : int(out.lengths[g, i])].tolist()
                assert in_language(parser, model.decode(ids))


@pytest.mark.slow
def test_smollm2_arithmetic_expression_parses():
    parser = lark_parser()
    model = sd.load_model()
    target = sd.LM(model, temperature=0.7) * Grammar(ARITH)
    result = sd.SMC(target, particles=8).run(
        [{"role": "user", "content": "What is one plus two? Write it as a sum like 1+2."}],
        max_new_tokens=16,
        seed=0,
        progress=False,
    )
    for text, w in zip(result.texts, result.weights.tolist()):
        if w > 0:
            assert in_language(parser, text), text
    assert result.text is not None
