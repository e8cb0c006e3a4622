"""Property-based test of the public API and the CLI: any argument gets a valid result or an
``SMCDecodeError`` (the CLI: exit status 2 and exactly one line on stderr) -- never another
exception, and never NaN or ±inf weights or evidence without a message in the result.

Most examples run a tiny toy model (a 16-token vocabulary whose text covers regexes, JSON and
grammars); a few marked ``slow`` run the real default model, whose tokenizer (special tokens,
byte pieces, a chat template) toy models cannot imitate. Deterministic: hypothesis is
derandomised, every run seeded. Wall time on a 2-core machine: ~10 s, ~25 s more for ``slow``.
"""

from __future__ import annotations

import contextlib
import io
import math
import re

import pytest
import torch
from conftest import tiny_llama_pair, toy_model, toy_table
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.cli import main
from smcdecode.samplers.resampling import RESAMPLERS

VOCAB = ["<bos>", "a", "b", "ab", "0", "1", "{", "}", "[", "]", '"', ":", ",", " ", "x", "<eos>"]
V = len(VOCAB)
EOS = V - 1


def fuzz_settings(max_examples: int) -> settings:
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def _toy(seed: int, forbid=()) -> sd.FunctionModel:
    """A toy LM over VOCAB whose EOS is likely (runs end after a few tokens); tokens in ``forbid``
    get probability 0. Its hashed contexts hold up to 64 tokens, which it declares: a constraint
    can rule EOS out for good (two regexes whose every common prefix extends, none completes), so an
    unbounded budget is refused up front rather than run into the table's limit."""
    table = toy_table(seed, V, 1.0)
    table[:, EOS] += 1.5
    table[:, list(forbid)] = -math.inf
    return toy_model(table, VOCAB, name=f"toy{seed}", max_context=64)


TARGET_MODEL, DRAFT_MODEL, SCORER = _toy(0), _toy(1), _toy(2, forbid=[2])

# -- values of every kind -------------------------------------------------------------------------

WEIRD = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.binary(max_size=3), st.lists(st.integers(-2, 2), max_size=2),
    st.sampled_from([object(), torch.tensor([1.0, 2.0]), {"a": 1}, (), 1j]),
)


class Args:
    """Draws an example's arguments: first which of them (none, one or two) are bad, then each
    argument from its good or its bad values. Hypothesis favours the ends of every range it
    draws from, so "bad now and then" per argument would make almost every example bad; this
    way about half the examples are valid programs that run, and the others are refused for one
    or two reasons."""

    def __init__(self, data, names):
        self.data = data
        self.bad = data.draw(st.one_of(st.just(frozenset()), st.sets(st.sampled_from(sorted(names)), min_size=1,
                                                                     max_size=2)), "bad arguments")

    def __call__(self, name: str, good, bad=WEIRD):
        return self.data.draw(bad if name in self.bad else good, name)


NUMBERS = st.sampled_from([0, -1, 1e-300, 1e-5, 1e4, 1e300, math.inf, math.nan, "0.7", True, None])
TEXT = st.text(alphabet=st.sampled_from(list('ab01{}[]":, x')), max_size=6)
MESSAGES = st.lists(
    st.dictionaries(st.sampled_from(["role", "content", "name"]),
                    st.one_of(st.sampled_from(["user", "system", "assistant", ""]), TEXT, WEIRD), max_size=3),
    max_size=3)
PROMPTS = st.one_of(TEXT.filter(bool), st.lists(st.integers(0, V - 2), min_size=1, max_size=4))
BAD_PROMPTS = st.one_of(
    st.text(max_size=4), st.lists(st.integers(-2, V + 1), max_size=4), MESSAGES, WEIRD,
    st.sampled_from(["", [], "\ud800", b"ab", torch.tensor([0, 1]), torch.tensor([[0.5]]), [[0]], [True], (0, 1)]))
REGEXES = st.sampled_from([r"a+", r"(ab|b)*a", r"[01]{1,3}", "", r"x|ab", r"a|bc", r"\d+", r'"[ab]*"', r"(a|b)b?",
                           r"\w{2}", r"[^a]+", r"a*x?"])
BAD_REGEXES = st.one_of(st.sampled_from(["a(", r"(?=a)", r"a{100000}", r"^a$", r"(a)\1", r"[", r"(?i)A", r"\bx", "q+"]),
                        st.text(alphabet=st.sampled_from(list("ab01x()|*+?[]^$\\.")), max_size=8), WEIRD)
SCHEMAS = st.sampled_from([
    {"type": "integer"}, {"type": "string", "maxLength": 2}, {"enum": ["a", "b"]}, {"type": "boolean"},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 2}, '{"type": "integer", "minimum": 10}',
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, True,
])
BAD_SCHEMAS = st.one_of(st.sampled_from([
    False, "{", "3", {"type": "nope"}, {"not": {}}, {"$ref": "#/nowhere"}, [], {"minLength": -1},
    {"oneOf": [{"type": "integer"}, {"minimum": 0}]}, {"type": "string", "format": "no-such-format"},
    {"type": "string", "pattern": "("}, {"type": "integer", "minimum": 5, "maximum": 1},
]), st.text(max_size=6), WEIRD)
GRAMMARS = st.sampled_from(['start: "a"+', 'start: ("a" | "b") "x"', "start: NUMBER\n%import common.NUMBER",
                            "start: /[ab]+/", 'start: "[" "0"? "]"'])
BAD_GRAMMARS = st.one_of(st.sampled_from(["start: (", "", "root ::= (", 'start: "q"', "start: start", "start: /(/",
                                          'start: "a"\nstart: "b"']), st.text(max_size=8), WEIRD)
# rewards that misbehave: raise, return NaN, ±inf, a non-number, a value that overflows with beta
REWARD_FNS = st.sampled_from([len, lambda t: t.count("a") - 0.5, lambda t: torch.tensor(1.0), lambda t: True])
BAD_REWARD_FNS = st.sampled_from([
    lambda t: 1 / 0, lambda t: math.nan, lambda t: math.inf, lambda t: "1", lambda t: None, lambda t: 1e308,
    lambda t: -1e308, lambda t: 10**400, lambda t: [1.0], "not callable",
])
BATCHED_FNS = st.sampled_from([lambda ts: [len(t) for t in ts], lambda ts: torch.ones(len(ts))])
BAD_BATCHED_FNS = st.sampled_from([
    lambda ts: 1.0, lambda ts: "ab", lambda ts: [1.0], lambda ts: (1 / 0 for _ in ts), lambda ts: [math.nan] * len(ts),
    lambda ts: {t: 1 for t in ts},
])


def answer(call):
    """The value of ``call()``, or None when it raises SMCDecodeError; anything else propagates."""
    try:
        return call()
    except sd.SMCDecodeError as e:
        assert str(e).strip(), "an SMCDecodeError must say what was wrong"
        return None


# -- building programs from drawn pieces -----------------------------------------------------------

TARGET_ARGS = {"T", "alpha", "regex", "schema", "whitespace", "grammar", "syntax", "reward fn", "beta", "mode",
               "scorer", "prompt2", "lm beta", "chunk"}


def draw_target(data, args: Args, allow_constraints=True, allow_rewards=True):
    """A target built from drawn pieces (None when building it was refused with SMCDecodeError),
    and the regex patterns among its factors (to check the outputs against)."""
    patterns = []

    def build():
        target = sd.LM(TARGET_MODEL, temperature=args("T", st.sampled_from([0.7, 1.0, 1.5]), NUMBERS))
        if data.draw(st.booleans(), "power"):
            target = target ** args("alpha", st.sampled_from([0.5, 2.0]), NUMBERS)
        factors = data.draw(st.lists(st.sampled_from(
            (["regex", "schema", "grammar"] if allow_constraints else []) +
            (["reward", "lm_reward"] if allow_rewards else []) + ["none"]), max_size=2), "factors")
        for kind in factors:
            if kind == "regex":
                pattern = args("regex", REGEXES, BAD_REGEXES)
                target = target * sd.Regex(pattern)
                patterns.append(pattern)
            elif kind == "schema":
                target = target * sd.JSONSchema(args("schema", SCHEMAS, BAD_SCHEMAS),
                                                whitespace=args("whitespace", st.sampled_from(["compact", "flexible"])))
            elif kind == "grammar":
                target = target * sd.Grammar(args("grammar", GRAMMARS, BAD_GRAMMARS),
                                             syntax=args("syntax", st.just("lark"), st.sampled_from(["gbnf", "ebnf"])))
            elif kind == "reward":
                batched = data.draw(st.booleans(), "batched")
                target = target * sd.Reward(
                    args("reward fn", BATCHED_FNS, BAD_BATCHED_FNS) if batched else
                    args("reward fn", REWARD_FNS, BAD_REWARD_FNS),
                    beta=args("beta", st.sampled_from([0.0, 1.0, -1.0, 2.0]), st.sampled_from([10.0, 1e308]) | WEIRD),
                    mode=args("mode", st.sampled_from(["prefix", "complete"])), batched=batched)
            elif kind == "lm_reward":
                target = target * sd.LMReward(
                    args("scorer", st.sampled_from([SCORER, DRAFT_MODEL]), st.sampled_from(["toy", _toy(3, forbid=[]),
                                                                                            TARGET_MODEL.fn])),
                    args("prompt2", PROMPTS, BAD_PROMPTS),
                    beta=args("lm beta", st.sampled_from([0.0, 0.5, 1.0, -1.0]), st.sampled_from([1e308]) | WEIRD),
                    mode=data.draw(st.sampled_from(["prefix", "complete"]), "lm mode"),
                    chunk=args("chunk", st.integers(1, 4)))
        return target

    return answer(build), patterns


def check_result(res, strategy: str, patterns=(), vocab_size: int = V, eos: int = EOS) -> None:
    """A Result that is valid: shapes agree, tokens in the vocabulary with EOS only last, no NaN
    or +inf weight, normalised weights or an explained zero, SMC evidence finite or explained,
    and every positive-weight text matching the target's regexes."""
    assert isinstance(res, sd.Result)
    N = len(res.texts)
    assert N == len(res.tokens) == res.weights.shape[0] == res.log_weights.shape[0] == res.finished.shape[0] >= 1
    assert all(isinstance(t, str) for t in res.texts)
    for toks in res.tokens:
        assert all(isinstance(t, int) and 0 <= t < vocab_size for t in toks)
        assert eos not in toks[:-1], f"EOS inside a sequence: {toks}"
    lw, W = res.log_weights, res.weights
    assert not torch.isnan(lw).any() and not torch.isposinf(lw).any(), lw
    assert torch.isfinite(W).all() and (W >= 0).all(), W
    total = float(W.sum())
    if total == 0:
        assert res.message and res.sample_index is None and res.text is None
    else:
        assert abs(total - 1) < 1e-6 and res.sample_index is not None and W[res.sample_index] > 0
    if strategy == "smc":
        assert not math.isnan(res.log_evidence)
        if math.isinf(res.log_evidence):
            assert res.log_evidence < 0 and res.message, (res.log_evidence, res.message)
    else:
        assert math.isnan(res.log_evidence)  # documented: the baselines do not estimate it
    for text, w in zip(res.texts, W.tolist()):
        if w > 0:
            for pattern in patterns:
                assert re.fullmatch(pattern, text), (pattern, text)


# -- the API ---------------------------------------------------------------------------------------


STRATEGY_ARGS = TARGET_ARGS | {"proposal", "draft T", "backend", "options", "particles", "K", "resampler", "tau",
                               "samples", "prompt", "max_new_tokens", "seed", "progress"}


@fuzz_settings(500)
@given(data=st.data())
def test_strategies_answer_anything(data):
    args = Args(data, STRATEGY_ARGS)
    kind = data.draw(st.sampled_from(["smc", "smc", "sd", "ar"]), "strategy")
    target, patterns = draw_target(data, args, allow_constraints=kind != "sd", allow_rewards=kind == "smc")
    if target is None:
        event("target refused")
        return
    which = args("proposal", st.sampled_from(["draft", "target", "model"]), st.just("weird"))
    proposal = {"draft": lambda: sd.Draft(DRAFT_MODEL, args("draft T", st.sampled_from([0.7, 1.0]), NUMBERS)),
                "target": lambda: "target", "model": lambda: DRAFT_MODEL,
                "weird": lambda: data.draw(WEIRD, "weird proposal")}[which]
    backend = args("backend", st.just("reference"), st.sampled_from(["engine", "engine-runner", "gpu", None, 1]))
    options = args("options", st.none(), st.one_of(st.fixed_dictionaries(
        {}, optional={"device": st.sampled_from(["cpu", "cuda", "bogus", 0]), "dtype": st.sampled_from(["float32", "int8"]),
                      "page_size": st.sampled_from([1, 0, "x"]), "bogus": st.just(1)}), WEIRD))

    def make():
        if kind == "smc":
            return sd.SMC(
                target, proposal(), particles=args("particles", st.integers(1, 6)),
                block_size=args("K", st.sampled_from([1, 2, 3, 10**6])),
                resampler=args("resampler", st.sampled_from(sorted(RESAMPLERS))),
                ess_threshold=args("tau", st.floats(0, 1)), backend=backend, engine_options=options)
        if kind == "sd":
            return sd.SpeculativeDecoding(
                target, proposal(), block_size=args("K", st.sampled_from([1, 3, 10**6])),
                samples=args("samples", st.integers(1, 3)), backend=backend, engine_options=options)
        return sd.Autoregressive(target, samples=args("samples", st.integers(1, 4)), backend=backend,
                                 engine_options=options)

    strategy = answer(make)
    if strategy is None:
        event("strategy refused")
        return
    prompt = args("prompt", PROMPTS, BAD_PROMPTS)
    budget = args("max_new_tokens", st.sampled_from([1, 2, 3, 5, 8, 40, 10**12]))
    seed = args("seed", st.integers(0, 2**64 - 1))
    progress = args("progress", st.just(False), st.sampled_from([True, "no", None]))
    res = answer(lambda: strategy.run(prompt, max_new_tokens=budget, seed=seed, progress=progress))
    event("run refused" if res is None else f"{kind} result")
    if res is not None:
        check_result(res, kind, patterns)


JSON_ARGS = {"schema", "particles", "strategy", "proposal", "T", "max_new_tokens", "whitespace", "seed", "model", "prompt",
             "tau"}


@fuzz_settings(120)
@given(data=st.data())
def test_generate_json_answers_anything(data):
    args = Args(data, JSON_ARGS)
    schema = args("schema", SCHEMAS, BAD_SCHEMAS)
    kwargs = {
        "particles": args("particles", st.integers(1, 4)),
        "strategy": args("strategy", st.sampled_from(["smc", "masked"])),
        "proposal": args("proposal", st.sampled_from(["target", sd.Draft(DRAFT_MODEL)])),
        "temperature": args("T", st.sampled_from([0.7, 1.0]), NUMBERS),
        "max_new_tokens": args("max_new_tokens", st.sampled_from([1, 4, 12])),
        "ess_threshold": args("tau", st.sampled_from([0.0, 0.5, 1.0])),
        "whitespace": args("whitespace", st.sampled_from(["compact", "flexible"])),
        "schema_in_prompt": data.draw(st.booleans(), "in prompt"),
        "seed": args("seed", st.integers(0, 10)),
    }
    model = args("model", st.just(TARGET_MODEL), st.sampled_from(["smollm2", None, TARGET_MODEL.fn]))
    prompt = args("prompt", PROMPTS | MESSAGES, BAD_PROMPTS)
    out = answer(lambda: sd.generate_json(model, prompt, schema, **kwargs))
    event("refused" if out is None else "result")
    if out is None:
        return
    check_result(out.result, "smc" if kwargs["strategy"] == "smc" else "ar")
    if out.ok:
        assert out.constraint.is_valid(out.text), out.text
    assert len(out.values) == len(out.result.texts)


@fuzz_settings(60)
@given(
    name=st.one_of(st.sampled_from(["", " ", "some-org/not-a-model", "/nonexistent/model.gguf", "./nope", "~nobody/x",
                                    "x" * 5000, "a\x00b", "model.safetensors", ".", "tests"]),
                   st.text(max_size=12).filter(lambda s: s.strip() not in ("smollm2", "default", "SmolLM2-135M-Instruct")),
                   WEIRD),
    dtype=st.one_of(st.sampled_from(["float32", "bfloat16", "int8", "float", torch.float16, torch.long]), WEIRD),
    device=st.one_of(st.sampled_from(["cpu", "cuda", "cuda:3", "mps", "meta", "bogus", "", "cpu:0"]), WEIRD),
    gguf_file=st.one_of(st.none(), st.sampled_from(["x.gguf", "../x.gguf"]), WEIRD),
)
def test_load_model_refuses_clearly_and_fast(name, dtype, device, gguf_file):
    """Names that are not a loadable model: an SMCDecodeError every time (no network retries)."""
    with pytest.raises(sd.SMCDecodeError):
        sd.load_model(name, dtype=dtype, device=device, gguf_file=gguf_file)


# -- the CLI ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama saved as a Hugging Face directory, with a chat template."""
    model, _ = tiny_llama_pair("cpu", head_std=1.0)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{{ m['content'] }}{% endfor %}"
    model.hf.save_pretrained(path)
    model.tokenizer.save_pretrained(path)
    return str(path)


def run_cli(argv: list[str]) -> tuple[int, str, list[str]]:
    """(exit status, stdout, non-empty stderr lines) of ``main(argv)`` run in-process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue(), [line for line in err.getvalue().split("\n") if line.strip()]


def check_cli(argv: list[str]) -> int:
    """Run the CLI: exit 2 with exactly one error line on stderr, or exit 0 with output."""
    code, out, err = run_cli(argv)
    if code == 2:
        assert len(err) == 1 and ": error: " in err[0], (argv, err)
    else:
        assert code == 0, (argv, code, err)
        assert out.strip()
    return code


CLI_VALUES = {
    "--prompt": st.sampled_from(["ab", "a", "", "abc", "\u00e9", "x" * 300]),
    "--chat": st.sampled_from(["ab", "", "a b"]),
    "--draft": st.sampled_from(["target", "truncated:1", "truncated:0", "truncated:x", "/nonexistent", "default"]),
    "--strategy": st.sampled_from(["smc", "sd", "ar", "all", "bogus"]),
    "-n": st.sampled_from(["1", "3", "0", "-2", "x", "1e9", "99999999999999"]),
    "-k": st.sampled_from(["1", "2", "0", "1000000", "x"]),
    "--temperature": st.sampled_from(["0.7", "1", "0", "-1", "nan", "inf", "1e-300", "x"]),
    "--draft-temperature": st.sampled_from(["0.7", "0", "nan"]),
    "--alpha": st.sampled_from(["1", "2", "0", "inf", "1e300"]),
    "--resampler": st.sampled_from(sorted(RESAMPLERS) + ["bogus"]),
    "--ess-threshold": st.sampled_from(["0", "0.5", "1", "2", "nan", "-1"]),
    "--regex": st.one_of(st.sampled_from([r"[ab]+", "a(", "", r"a{100000}", r"(?=a)"]), st.text(max_size=5)),
    "--json-schema": st.sampled_from(['{"type": "string", "maxLength": 2}', "{", "3", "/nonexistent.json",
                                      '{"type": "nope"}', "true", "x" * 400]),
    "--grammar": st.sampled_from(["/nonexistent.lark", __file__, "/"]),
    "--reward-prompt": st.sampled_from(["ab", ""]),
    "--reward-beta": st.sampled_from(["1", "nan", "1e308", "-1"]),
    "--max-new-tokens": st.sampled_from(["1", "3", "0", "200", "x"]),
    "--seed": st.sampled_from(["0", "-1", str(2**64), "x"]),
    "--device": st.sampled_from(["cpu", "cuda", "bogus", "", "meta"]),
    "--backend": st.sampled_from(["reference", "engine-runner", "engine", "gpu"]),
    "--plot": st.sampled_from(["/nonexistent/dir/x.png"]),
    "--model": st.sampled_from(["/nonexistent/m.gguf", "some-org/not-a-model", ""]),
}


@fuzz_settings(80)
@given(data=st.data())
def test_cli_answers_anything(data, tiny_dir):
    options = {"--model": tiny_dir, "--draft": "target", "-n": "2", "--max-new-tokens": "3", "--prompt": "ab"}
    for flag in data.draw(st.lists(st.sampled_from(sorted(CLI_VALUES)), max_size=4, unique=True), "flags"):
        if flag == "--chat":  # --prompt and --chat exclude each other
            options.pop("--prompt", None)
        options[flag] = data.draw(CLI_VALUES[flag], flag)
    argv = ["generate", "--no-progress", *(x for item in options.items() for x in item)]
    if data.draw(st.booleans(), "json"):
        argv.append("--json")
    event(f"exit {check_cli(argv)}")


@fuzz_settings(10)
@given(argv=st.lists(st.one_of(st.sampled_from(["generate", "--bogus", "-n", "--prompt", "--", "distill"]),
                               st.text(max_size=4)), max_size=4))
def test_cli_survives_arbitrary_argv(argv):
    if argv[:1] == ["distill"]:
        return  # the distill command has its own tests
    if argv[:1] == ["generate"]:
        argv = [*argv, "--model", "/nonexistent/m.gguf"]  # never start a real run of the default model here
    code, out, err = run_cli(argv)
    if code == 0:  # only --help (or an abbreviation of it) succeeds here
        assert "usage:" in out and not err, (argv, out, err)
    else:
        assert code == 2 and len(err) == 1, (argv, code, err)


# -- the real default model (its tokenizer and chat template) ---------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    return sd.load_model("smollm2")


UNICODE = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6) | st.sampled_from(
    ["<|im_start|>", "<|im_end|>", "\u200b", "\U0001f600", "\x00", "\ud800", " \n\t", "{\"a\": 1}"])


@pytest.mark.slow
@fuzz_settings(30)
@given(data=st.data())
def test_default_model_answers_anything(data, smollm2):
    prompt = data.draw(st.one_of(
        UNICODE, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                                 "content": UNICODE}), min_size=1, max_size=3),
        MESSAGES, st.lists(st.integers(-1, smollm2.vocab_size), max_size=3)), "prompt")
    ids = answer(lambda: smollm2.prompt_ids(prompt))
    if ids is not None:
        assert ids and all(0 <= i < smollm2.vocab_size for i in ids)
    constraint = data.draw(st.sampled_from([None, "regex", "schema", "grammar"]), "constraint")

    def build():
        target = sd.LM(smollm2, temperature=0.7)
        if constraint == "regex":
            target = target * sd.Regex(data.draw(st.sampled_from([r"[0-9]+", r"(yes|no)", r"\w+", "a(", r"\d{2000}"]),
                                                 "regex"))
        elif constraint == "schema":
            target = target * sd.JSONSchema(data.draw(SCHEMAS, "schema"))
        elif constraint == "grammar":
            target = target * sd.Grammar(data.draw(GRAMMARS, "grammar"))
        return sd.SMC(target, "target", particles=2)

    smc = answer(build)
    if smc is None:
        return
    res = answer(lambda: smc.run(prompt, max_new_tokens=3, seed=0, progress=False))
    if res is not None:
        assert len(res.texts) == 2 and all(all(0 <= t < smollm2.vocab_size for t in toks) for toks in res.tokens)
        assert not torch.isnan(res.log_weights).any() and not torch.isposinf(res.log_weights).any()
        assert not math.isnan(res.log_evidence) and (math.isfinite(res.log_evidence) or res.message)


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["--chat", "<|im_end|>\U0001f600", "--regex", "[0-9]+"],
    ["--prompt", "\u00e9t\u00e9", "--json-schema", '{"type": "integer"}'],
    ["--chat", "", "--strategy", "all", "-n", "1"],
    ["--reward-prompt", "Name a city.", "--reward-beta", "1e308"],
])
def test_cli_on_the_default_model(argv):
    check_cli(["generate", "--no-progress", "--max-new-tokens", "2", "-n", "2", "--draft", "target", *argv])
