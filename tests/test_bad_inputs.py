"""Every bad input gets a clear SMCDecodeError (the CLI: exit 2, one line); dead particles stop.

Each test here is a case that once escaped as a raw traceback, a silent NaN/inf, or junk output.
"""

import math
import time

import pytest
import torch
from conftest import tiny_llama_pair

import smcdecode as sd
from smcdecode.cli import main
from smcdecode.testing import check_tensor_path, enumerate_prefixes, exact_target

VOCAB = ["<bos>", "a", "b", "<eos>"]


def _toy(seed=0, vocab=VOCAB, forbid=()):
    """A bigram toy over ``vocab``; tokens in ``forbid`` get logit -inf (the model never emits them)."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(len(vocab), len(vocab), generator=g)
    table[:, list(forbid)] = -math.inf
    return sd.FunctionModel(lambda ctx: table[ctx[:, -1]], vocab=vocab, eos="<eos>", name=f"toy{seed}")


def _recording(model):
    """``model`` with every context its function is called with recorded in ``model.calls``."""
    fn = model.fn
    model.calls = []

    def recorded(ctx):
        model.calls.append(ctx.clone())
        return fn(ctx)

    model.fn = recorded
    return model


def _tiny_chat_model():
    model, _ = tiny_llama_pair("cpu", head_std=1.0)
    model.tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}{{ m['content'] }}{% endfor %}"
    return model


def _cli(argv, capsys):
    """(exit status, stderr lines) of the CLI run in-process."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


# -- chat messages ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "user"}], r"chat message 0 has no 'content' key"),
        ([{"content": "a"}], r"chat message 0 has no 'role' key"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], r"chat message 1: 'content' must be a string, got int"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}]}], r"'content' must be a string, got list"),
        ([{"role": "user", "content": "a"}, "b"], r"chat message 1 must be a dict"),
        ([{"role": "", "content": "a"}], r"chat message 0: 'role' is empty"),
        ([{"role": "user", "content": "\ud800"}], r"content is not valid Unicode"),
    ],
)
def test_malformed_chat_messages_name_the_message_and_key(messages, match):
    model = _tiny_chat_model()
    assert model.prompt_ids([{"role": "user", "content": "ab"}])  # the template itself works
    with pytest.raises(sd.SMCDecodeError, match=match):
        model.prompt_ids(messages)
    with pytest.raises(sd.SMCDecodeError, match=match):  # checked before "no chat template" too
        _toy().prompt_ids(messages)


def test_a_template_that_raises_is_a_clear_error():
    model = _tiny_chat_model()
    model.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(sd.SMCDecodeError, match="chat template of model 'tiny' rejected the messages.*alternate"):
        model.prompt_ids([{"role": "user", "content": "a"}])


@pytest.mark.parametrize(
    "prompt, match",
    [
        (b"ab", "prompt is bytes"),
        (torch.tensor([1.0, 2.0]), "must hold integer token ids"),
        (torch.zeros(2, 2, dtype=torch.long), r"1-D token ids .* got shape \(2, 2\)"),
        ([1, 2.5], "prompt must be text, a list of token ids"),
        ("a\ud800", "prompt is not valid Unicode"),
    ],
)
def test_malformed_prompts(prompt, match):
    with pytest.raises(sd.SMCDecodeError, match=match):
        _toy().prompt_ids(prompt)


def test_integer_arrays_are_token_ids():
    np = pytest.importorskip("numpy")
    assert _toy().prompt_ids(np.array([0, 1])) == [0, 1]
    assert _toy().prompt_ids([np.int64(0), 1]) == [0, 1]
    assert _toy().prompt_ids(torch.tensor([[0, 2]])) == [0, 2]


# -- rewards whose beta·R does not fit a float64 log-weight ----------------------------------------


@pytest.mark.parametrize("mode", ["complete", "prefix"])
def test_reward_times_beta_overflowing_is_a_reward_error(mode):
    huge = sd.Reward(lambda text: 1e308 if text else -1e308, beta=10.0, mode=mode, name="huge")
    with pytest.raises(sd.RewardError, match=r"reward 'huge': beta × R = 10 × .* not a finite log-weight"):
        sd.SMC(sd.LM(_toy()) * huge, "target", particles=4).run([0], max_new_tokens=3, seed=0, progress=False)
    with pytest.raises(sd.RewardError, match="not a finite log-weight"):
        exact_target(sd.LM(_toy()) * huge, [0], 2)


def test_a_constant_huge_prefix_reward_telescopes_exactly():
    """β·(R(new) − R(old)) = 0 for a constant R, however large: no overflow, the LM's own target."""
    const = sd.Reward(lambda text: 1e308, beta=10.0, mode="prefix")
    res = sd.SMC(sd.LM(_toy()) * const, "target", particles=4).run([0], max_new_tokens=3, seed=0, progress=False)
    plain = sd.SMC(sd.LM(_toy()), "target", particles=4).run([0], max_new_tokens=3, seed=0, progress=False)
    assert torch.equal(res.log_weights, plain.log_weights) and res.log_evidence == plain.log_evidence


def test_rewards_that_overflow_only_together_are_a_reward_error():
    big = [sd.Reward(lambda text: 1e308, beta=1.0, name=f"r{i}") for i in range(2)]
    with pytest.raises(sd.RewardError, match=r"add up to inf"):
        sd.SMC(sd.LM(_toy()) * big[0] * big[1], "target", particles=2).run([0], max_new_tokens=2, seed=0, progress=False)


def _lm_reward_with_a_zero():
    """An LMReward whose second model gives token 'b' probability 0 (log p' = -inf)."""
    return _toy(5, forbid=[2])


def test_lm_reward_of_minus_inf_is_exact():
    scorer = _lm_reward_with_a_zero()
    for beta in (1.0, 0.0):
        target = sd.LM(_toy()) * sd.LMReward(scorer, [0], beta=beta)
        res = sd.SMC(target, "target", particles=8).run([0], max_new_tokens=3, seed=1, progress=False)
        assert not torch.isnan(res.log_weights).any() and not torch.isposinf(res.log_weights).any()
        assert math.isfinite(res.log_evidence)
        has_b = torch.tensor([2 in t for t in res.tokens])
        exact = exact_target(target, [0], 3)
        assert math.isfinite(exact.log_Z)
        if beta > 0:  # p·p'^β = 0 where p' = 0: weight 0, exactly
            assert has_b.any() and torch.isneginf(res.log_weights[has_b]).all()
            assert not any(2 in x for x in exact.probs)
        else:  # p'^0 = 1 even where p' = 0
            assert torch.isfinite(res.log_weights).all() and any(2 in x for x in exact.probs)
    with pytest.raises(sd.RewardError, match=r"use beta > 0 with a reward that can be -inf"):
        target = sd.LM(_toy()) * sd.LMReward(scorer, [0], beta=-1.0)
        for seed in range(5):
            sd.SMC(target, "target", particles=8).run([0], max_new_tokens=3, seed=seed, progress=False)


@pytest.mark.parametrize(
    "fn, batched, match",
    [
        (lambda text: "1.5", False, r"returned str '1.5' \(not a number\)"),
        (lambda text: 10**400, False, "not a number"),
        (lambda texts: 1.0, True, r"batched reward .* returned float"),
        (lambda texts: "ab", True, r"batched reward .* returned str"),
        (lambda texts: (1 / 0 for _ in texts), True, "raised ZeroDivisionError"),
    ],
)
def test_misbehaving_rewards(fn, batched, match):
    target = sd.LM(_toy()) * sd.Reward(fn, batched=batched, name="bad")
    with pytest.raises(sd.RewardError, match=match):
        sd.SMC(target, "target", particles=2).run([0], max_new_tokens=2, seed=0, progress=False)


def test_rewards_may_return_numpy_and_torch_numbers():
    np = pytest.importorskip("numpy")
    for fn, batched in [(lambda t: np.float32(len(t)), False), (lambda ts: torch.ones(len(ts)), True)]:
        res = sd.SMC(sd.LM(_toy()) * sd.Reward(fn, batched=batched), "target", particles=2).run(
            [0], max_new_tokens=2, seed=0, progress=False)
        assert torch.isfinite(res.log_weights).all()


# -- devices, GGUF files, model names -----------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu(capsys, tmp_path):
    for device in ("cuda", "cuda:0", torch.device("cuda", 1)):
        with pytest.raises(sd.SMCDecodeError, match=r"device 'cuda(:\d)?' is not available: .*use 'cpu'"):
            sd.load_model("smollm2", device=device)
    code, err = _cli(["generate", "--device", "cuda", "--no-progress"], capsys)
    assert code == 2 and len(err) == 1 and "--device 'cuda' is not available" in err[0]
    model, draft = tiny_llama_pair("cpu", head_std=1.0)
    with pytest.raises(sd.SMCDecodeError, match=r"engine_options\['device'\] 'cuda' is not available"):
        sd.SMC(sd.LM(model), sd.Draft(draft), backend="engine", engine_options={"device": "cuda"})


@pytest.mark.parametrize(
    "device, match",
    [
        ("bogus", "device 'bogus' is not a torch device"),
        ("", "device '' is not a torch device"),
        (3, "device must be a string such as 'cpu'"),
        ("meta", "holds no weights"),
    ],
)
def test_malformed_devices(device, match, capsys):
    with pytest.raises(sd.SMCDecodeError, match=match):
        sd.load_model("smollm2", device=device)
    if isinstance(device, str):
        code, err = _cli(["generate", "--device", device], capsys)
        assert code == 2 and len(err) == 1 and "--device" in err[0]


@pytest.mark.parametrize("content, match", [(b"not a gguf", "is not a GGUF file"), (b"", "is not a GGUF file"),
                                            (b"GGUF\x03\x00\x00\x00", "could not load GGUF file")])
def test_a_file_named_gguf_that_is_not_one(tmp_path, content, match):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    with pytest.raises(sd.SMCDecodeError, match=match):
        sd.load_model(str(path))


def test_a_hub_name_that_is_not_cached_fails_fast():
    start = time.perf_counter()
    with pytest.raises(sd.SMCDecodeError, match=r"could not load model 'some-org/not-a-model'.*nothing is downloaded"):
        sd.load_model("some-org/not-a-model")
    assert time.perf_counter() - start < 10  # no retries against the Hub (it used to take ~47 s offline)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"name_or_path": 5}, "model must be a name or path"),
        ({"name_or_path": " "}, "model name is empty"),
        ({"name_or_path": "./no/such/dir"}, "does not exist"),
        ({"dtype": "int8"}, "dtype must be a floating-point torch dtype"),
        ({"dtype": torch.long}, "dtype must be a floating-point torch dtype"),
        ({"dtype": "no such"}, "dtype must be a floating-point torch dtype"),
    ],
)
def test_bad_load_model_arguments(kwargs, match):
    with pytest.raises(sd.SMCDecodeError, match=match):
        sd.load_model(**{"name_or_path": "smollm2", **kwargs})


# -- a user's own TokenConstraint, written as docs/dsl.md says -----------------------------------


class NoRepeat(sd.TokenConstraint):
    """No token twice in a row; the state is the last token (-1 at the start)."""

    def start(self, batch):
        return torch.full((batch,), -1, dtype=torch.long)

    def allowed(self, state):
        V = self.model.vocab_size
        mask = torch.ones(len(state), V, dtype=torch.bool)
        rows = torch.nonzero(state >= 0).flatten()
        mask[rows, state[rows]] = False
        mask[:, self.model.eos_token_id] = True
        return mask

    def advance(self, state, tokens):
        return tokens.clone()

    def accepting(self, state):
        return torch.ones(len(state), dtype=torch.bool)


def test_a_user_constraint_is_bound_by_product_and_by_bind():
    model = _toy()
    c = NoRepeat()
    target = sd.LM(model) * c
    assert target.constraints[0].model is model
    bound = c.bind(model)
    assert bound.model is model and c.model is None  # bind returns the bound copy
    check_tensor_path(bound, enumerate_prefixes(model, 3))
    exact = exact_target(target, [0], 3)
    assert exact.probs and all(all(x[i] != x[i + 1] for i in range(len(x) - 1)) for x in exact.probs)
    res = sd.SMC(target, sd.Draft(_toy(1)), particles=8, block_size=2).run([0], max_new_tokens=4, seed=0, progress=False)
    for toks, w in zip(res.tokens, res.weights):
        if w > 0:
            assert all(toks[i] != toks[i + 1] for i in range(len(toks) - 1))
    with pytest.raises(sd.SMCDecodeError, match=r"c = c\.bind\(model\)"):
        check_tensor_path(c, [[1]])
    with pytest.raises(sd.SMCDecodeError, match="bind needs a smcdecode Model"):
        c.bind("smollm2")


# -- dead particles stop ------------------------------------------------------------------------

# the token 'b' is a dead end: after it, no token (not even EOS) keeps the text viable. llguidance
# allows it (the text "b" is a viable prefix of "bc", though no token spells "c"); a Regex's token
# automaton would not (it drops states from which no token sequence reaches an accepting state), so
# the grammar runs on llguidance here (path="llguidance": "auto" would take the automaton)
DEAD_END = 'start: "a" | "bc"'


@pytest.mark.parametrize("proposal", ["draft", "target"])
def test_a_dead_particle_stops_and_is_never_fed_an_arbitrary_token(proposal):
    target_model = _recording(_toy(0, forbid=[0]))  # neither model ever proposes <bos> (id 0)
    draft_model = _recording(_toy(1, forbid=[0]))
    prop = sd.Draft(draft_model) if proposal == "draft" else "target"
    smc = sd.SMC(sd.LM(target_model) * sd.Grammar(DEAD_END, path="llguidance"), prop, particles=16,
                 block_size=3 if proposal == "draft" else None)
    res = smc.run([0], max_new_tokens=6, seed=0, progress=False)
    dead = [i for i, t in enumerate(res.tokens) if t and t[0] == 2]
    assert dead, "the seed should send some particle into the dead end"
    for i in dead:
        assert res.tokens[i] == [2] and res.texts[i] == "b"  # it stopped at the dead end: no junk after it
        assert res.weights[i] == 0 and bool(res.finished[i])
    for i, t in enumerate(res.tokens):
        if i not in dead:
            assert t == [1, 3] and res.texts[i] == "a"
    for calls in (target_model.calls, draft_model.calls):
        for ctx in calls:
            assert not (ctx[:, 1:] == 0).any(), "a model was fed a token its proposal cannot produce"


def test_autoregressive_dead_end_stops():
    model = _recording(_toy(0, forbid=[0]))
    res = sd.Autoregressive(sd.LM(model) * sd.Grammar(DEAD_END, path="llguidance"), samples=16).run([0], max_new_tokens=5, seed=0,
                                                                               progress=False)
    assert {tuple(t) for t in res.tokens} == {(2,), (1, 3)}
    for t, lw in zip(res.tokens, res.log_weights):
        assert (t == [2]) == bool(torch.isneginf(lw))
    assert not any((ctx[:, 1:] == 0).any() for ctx in model.calls)


# -- more of the same kinds ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda m: sd.SMC(sd.LM(m), resampler=["systematic"]), "unknown resampler"),
        (lambda m: sd.SMC(sd.LM(m), backend=["engine"]), "unknown backend"),
        (lambda m: sd.SMC(sd.LM(m), engine_options=[1]), "engine_options must be a dict"),
        (lambda m: sd.SMC(sd.LM(m), ess_threshold="0.5"), "ess_threshold must be a finite number, got str"),
        (lambda m: sd.SMC(sd.LM(m), particles=10**12), "particles must be at most"),
        (lambda m: sd.SMC(sd.LM(m)).run([0], seed=2**70, progress=False), "seed must be at most"),
        (lambda m: sd.SMC(sd.LM(m)).run([0], progress="no"), "progress must be True or False"),
        (lambda m: sd.SMC(sd.LM(m)).run_groups([0], groups=10**7), "groups × particles"),
        (lambda m: sd.LM(m, temperature=1e-300), "temperature must be a finite number >= 0.0001"),
        (lambda m: sd.LM(m, temperature="0.7"), "temperature must be a number > 0, got str"),
        (lambda m: sd.LM(m) ** 1e300, r"power alpha must be a number in \(0, 1000\]"),
        (lambda m: sd.LM(m) ** "2", "power alpha must be a finite number, got str"),
        (lambda m: sd.LM(m) * 3, "cannot multiply LM"),
        (lambda m: 3 * sd.LM(m), "cannot multiply LM"),
        (lambda m: sd.Regex("a") ** "x", "constraint power must be a finite number"),
        (lambda m: sd.Regex("a{100000}"), "repetition counts multiply to 100000"),
        (lambda m: sd.Regex("(a{50}){50}"), "repetition counts multiply to 2500"),
        (lambda m: sd.Reward(len, beta=1e300) ** 1e300, r"beta × alpha must be a finite number"),
        (lambda m: sd.LMReward(m, [0], chunk=0), "chunk must be a positive integer"),
        (lambda m: sd.LMReward(m, [0], chunk="8"), "chunk must be a positive integer"),
        (lambda m: sd.FunctionModel(lambda c: c, vocab="abc"), "vocab must be a list of token strings"),
        (lambda m: sd.FunctionModel(lambda c: c, vocab=[1, 2]), "vocab must be a list of token strings"),
        (lambda m: sd.FunctionModel(lambda c: c, vocab=["a", "b"], eos=1.5), "eos must be a token string"),
    ],
)
def test_more_bad_arguments(make, match):
    with pytest.raises(sd.SMCDecodeError, match=match):
        make(_toy())


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda c: None, "the model function returned NoneType"),
        (lambda c: torch.full((c.shape[0], 4), math.nan), r"returned \[nan"),
        (lambda c: torch.full((c.shape[0], 4), -math.inf), "at least one finite entry"),
        (lambda c: torch.full((c.shape[0], 4), math.inf), r"returned \[inf"),
    ],
)
def test_function_models_that_return_no_distribution(fn, match):
    model = sd.FunctionModel(fn, vocab=VOCAB)
    with pytest.raises(sd.SMCDecodeError, match=match):
        sd.SMC(sd.LM(model), "target", particles=2).run([0], max_new_tokens=2, seed=0, progress=False)


def test_huge_max_new_tokens_allocates_only_what_is_generated():
    """A model without a context limit and max_new_tokens = 10**12: the runs end at EOS."""
    m = _toy()
    for strategy in (sd.SMC(sd.LM(m), sd.Draft(_toy(1)), particles=4, block_size=10**6),
                     sd.Autoregressive(sd.LM(m), samples=4), sd.SpeculativeDecoding(sd.LM(m), sd.Draft(_toy(1)))):
        res = strategy.run([0], max_new_tokens=10**12, seed=0, progress=False)
        assert all(t and t[-1] == m.eos_token_id for t in res.tokens)


def test_truncated_draft_and_exact_target_arguments():
    model, _ = tiny_llama_pair("cpu", head_std=1.0)
    for layers in ("1", 1.0, True, 0, 2):
        with pytest.raises(sd.SMCDecodeError, match=r"num_layers must be in \[1, 1\]"):
            sd.truncated_draft(model, layers)
    with pytest.raises(sd.SMCDecodeError, match="truncated_draft needs an HFModel"):
        sd.truncated_draft(_toy(), 1)
    for budget in (-1, 2.5, "3"):
        with pytest.raises(sd.SMCDecodeError, match="max_new_tokens must be a non-negative integer"):
            exact_target(sd.LM(_toy()), [0], budget)


def test_prompt_plus_budget_past_the_drafts_context():
    m, d = _toy(), _toy(1)
    d.max_context = 4
    with pytest.raises(sd.SMCDecodeError, match=r"exceeds the context of model 'toy1' \(4 tokens\)"):
        sd.SMC(sd.LM(m), sd.Draft(d)).run([0, 1], max_new_tokens=3, progress=False)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--particles", "abc"], "argument -n/--particles: invalid int value: 'abc'"),
        (["--resampler", "bogus"], "invalid choice: 'bogus'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--seed", str(2**70)], "--seed must lie in [0, 2**64)"),
        (["--json-schema", "/nonexistent/schema.json"], "no such file, and not inline JSON"),
        (["--plot", "/nonexistent/dir/plot.png"], "--plot '/nonexistent/dir/plot.png': its directory does not exist"),
        (["--grammar", __file__], "invalid lark grammar"),  # a multi-line message, printed as one line
    ],
)
def test_cli_errors_are_one_line(argv, match, capsys):
    code, err = _cli(["generate", "--no-progress", *argv], capsys)
    assert code == 2 and len(err) == 1 and match in err[0], err


def test_a_fix_is_offered_only_where_it_fits_the_value():
    from smcdecode.errors import SMCDecodeError, check_positive_int
    from smcdecode.serve.protocol import Defaults, Limits, RequestError, parse

    with pytest.raises(SMCDecodeError) as e:
        check_positive_int("particles", "8", "use at least 1 particle")
    assert str(e.value) == "particles must be a positive integer, got str '8'"
    with pytest.raises(SMCDecodeError, match="got 0: use at least 1 particle"):
        check_positive_int("particles", 0, "use at least 1 particle")
    limits = Limits(max_particles=16)
    for value, hint in ((-1, False), ("eight", False), (64, True)):
        with pytest.raises(RequestError) as e:
            parse({"prompt": "hi", "particles": value}, "completions", limits, Defaults())
        assert e.value.param == "particles" and ("--max-particles" in e.value.message) == hint, e.value.message


def test_a_block_size_without_a_draft_is_refused_and_the_default_proposes_one_token():
    """block_size counts a draft's tokens: with the target as proposal it cannot apply, so it is
    refused (naming the value and the fix) instead of ignored; left out, a round adds one token."""
    target = sd.LM(_toy(1))
    for k in (4, "adaptive", [2, 1]):
        with pytest.raises(sd.SMCDecodeError, match=r"block_size=.* needs a draft.*leave block_size out"):
            sd.SMC(target, "target", particles=4, block_size=k)
    smc = sd.SMC(target, particles=4)
    res = smc.run([0], max_new_tokens=3, seed=0, progress=False)
    assert smc.block_size == 0 and res.rounds == 3  # (one token a round)
    assert sd.SMC(target, sd.Draft(_toy(2)), particles=4).block_size == 4  # (the default with a draft)


def test_a_function_model_declares_its_context_and_longer_runs_are_refused():
    model = sd.FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], 3), vocab=["a", "b", "<eos>"], max_context=8)
    with pytest.raises(sd.SMCDecodeError, match=r"exceeds the context of model .* \(8 tokens\)"):
        sd.SMC(sd.LM(model), particles=2).run([0, 1], max_new_tokens=7, seed=0, progress=False)
    assert len(sd.SMC(sd.LM(model), particles=2).run([0, 1], max_new_tokens=6, seed=0, progress=False).tokens) <= 6
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(sd.SMCDecodeError, match="max_context must be a positive number of tokens"):
            sd.FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], 3), vocab=["a", "b", "<eos>"], max_context=bad)
