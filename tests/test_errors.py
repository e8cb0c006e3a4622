"""Bad input gets a clear SMCDecodeError naming the argument and the value; nothing returns NaN."""

import math

import pytest
import torch

import smcdecode as sd

VOCAB = ["<bos>", "a", "b", "<eos>"]


def _toy(seed=0, vocab=VOCAB):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(len(vocab), len(vocab), generator=g)
    return sd.FunctionModel(lambda ctx: table[ctx[:, -1]], vocab=vocab, eos="<eos>")


def test_draft_with_different_vocabulary_is_rejected():
    target = sd.LM(_toy())
    other = _toy(1, vocab=["<bos>", "a", "b", "c", "<eos>"])
    with pytest.raises(sd.SMCDecodeError, match=r"draft vocabulary \(5\) differs from target vocabulary \(4\)"):
        sd.SMC(target, sd.Draft(other))


@pytest.mark.parametrize("pattern", ["a(", "[a-", "a(?=b)", r"(a)\1"])
def test_invalid_regex(pattern):
    with pytest.raises(sd.SMCDecodeError, match="regex"):
        sd.Regex(pattern)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"particles": 0}, "particles must be a positive integer, got 0"),
        ({"block_size": 0}, "block_size must be a positive integer, got 0"),
        ({"ess_threshold": 1.5}, r"ess_threshold must lie in \[0, 1\], got 1.5"),
        ({"ess_threshold": -0.1}, r"ess_threshold must lie in \[0, 1\]"),
        ({"resampler": "bogus"}, "unknown resampler 'bogus'"),
    ],
)
def test_bad_smc_arguments(kwargs, match):
    m = _toy()
    with pytest.raises(sd.SMCDecodeError, match=match):
        sd.SMC(sd.LM(m), sd.Draft(_toy(1)), **kwargs)


@pytest.mark.parametrize("t", [0, -1.0, float("nan"), float("inf")])
def test_bad_temperatures(t):
    with pytest.raises(sd.SMCDecodeError, match="temperature"):
        sd.LM(_toy(), temperature=t)
    with pytest.raises(sd.SMCDecodeError, match="draft temperature"):
        sd.Draft(_toy(), temperature=t)


def test_bad_max_new_tokens_and_prompts():
    smc = sd.SMC(sd.LM(_toy()), "target", particles=2)
    with pytest.raises(sd.SMCDecodeError, match="max_new_tokens must be a positive integer, got 0"):
        smc.run([0], max_new_tokens=0, progress=False)
    with pytest.raises(sd.SMCDecodeError, match="prompt is empty"):
        smc.run("", max_new_tokens=3, progress=False)
    with pytest.raises(sd.SMCDecodeError, match="prompt is empty"):
        smc.run([], max_new_tokens=3, progress=False)
    with pytest.raises(sd.SMCDecodeError, match="outside the vocabulary"):
        smc.run([7], max_new_tokens=3, progress=False)


def test_prompt_longer_than_context():
    m = _toy()
    m.max_context = 8
    smc = sd.SMC(sd.LM(m), "target", particles=2)
    with pytest.raises(sd.SMCDecodeError, match=r"exceeds the context of model .* \(8 tokens\)"):
        smc.run([0] * 6, max_new_tokens=4, progress=False)


def test_unsatisfiable_constraint_is_reported_not_nan():
    m = _toy()
    # no token sequence over {a, b} can spell "c"
    res = sd.SMC(sd.LM(m) * sd.Regex("c+"), sd.Draft(_toy(1)), particles=4, block_size=2).run(
        [0], max_new_tokens=4, seed=0, progress=False
    )
    assert res.text is None and res.sample_index is None
    assert "no token sequence satisfies" in res.message
    assert not torch.isnan(res.weights).any() and float(res.weights.sum()) == 0.0
    assert res.log_evidence == -math.inf


def test_constraint_unreachable_within_budget_is_reported():
    m = _toy()
    res = sd.SMC(sd.LM(m) * sd.Regex("a{6}"), sd.Draft(_toy(1)), particles=4, block_size=2).run(
        [0], max_new_tokens=3, seed=0, progress=False
    )
    assert res.text is None
    assert "no particle satisfied the constraints within max_new_tokens" in res.message
    assert res.log_evidence == -math.inf and not torch.isnan(res.log_weights).any()


@pytest.mark.parametrize(
    "fn, match",
    [
        (lambda text: 1 / 0, "reward 'bad' raised ZeroDivisionError"),
        (lambda text: float("nan"), "reward 'bad' returned nan"),
        (lambda text: float("inf"), "reward 'bad' returned inf"),
        (lambda text: "x", "not a number"),
    ],
)
@pytest.mark.parametrize("mode", ["prefix", "complete"])
def test_bad_reward(fn, match, mode):
    target = sd.LM(_toy()) * sd.Reward(fn, beta=1.0, mode=mode, name="bad")
    with pytest.raises(sd.RewardError, match=match):
        sd.SMC(target, "target", particles=2).run([0], max_new_tokens=3, seed=0, progress=False)


def test_bad_reward_mode_and_target_types():
    with pytest.raises(sd.SMCDecodeError, match="reward mode"):
        sd.Reward(len, mode="sometimes")
    with pytest.raises(sd.SMCDecodeError, match="exactly one language-model potential"):
        sd.SMC(sd.Regex("a") * sd.Reward(len), "target")
    with pytest.raises(sd.SMCDecodeError, match="target must be a potential"):
        sd.SMC("not a target", "target")


def test_exact_sd_refuses_targets_it_cannot_sample():
    m, d = _toy(), sd.Draft(_toy(1))
    with pytest.raises(sd.SMCDecodeError, match="use SMC"):
        sd.SpeculativeDecoding(sd.LM(m) ** 2, d)
    with pytest.raises(sd.SMCDecodeError, match="use SMC"):
        sd.SpeculativeDecoding(sd.LM(m) * sd.Regex("a+"), d)


def test_function_model_bad_output_shape():
    bad = sd.FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], 3), vocab=VOCAB)
    with pytest.raises(ValueError, match=r"must return next-token log-probabilities of shape"):
        sd.Autoregressive(sd.LM(bad)).run([0], max_new_tokens=2, progress=False)


def test_custom_potential_without_tensor_path_is_refused():
    class ForbidB(sd.Potential):
        def prefix(self, tokens, prompt=()):
            return float("-inf") if 2 in tokens else 0.0

        def complete(self, tokens, prompt=()):
            return self.prefix(tokens, prompt)

    with pytest.raises(sd.SMCDecodeError, match="the samplers cannot use potential .*ForbidB"):
        sd.SMC(sd.LM(_toy()) * ForbidB(), "target")
