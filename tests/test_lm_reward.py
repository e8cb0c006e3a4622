"""LMReward: a second prompt's log-probability as a reward (prompt intersection / product of
experts): scores against the LM potential, the potential contract, and exact enumeration."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPT, statistical_settings, toy_model, toy_table
from hypothesis import given
from hypothesis import strategies as st

import smcdecode as sd
from smcdecode.potentials.lm_reward import LMReward
from smcdecode.testing import (
    check_batch_consistency,
    check_distribution,
    check_logw_next_consistency,
    enumerate_prefixes,
    exact_target,
)

VOCAB = ["<bos>", "<alt>", "a", "b", "c", "<eos>"]
PROMPT2 = [1]  # the second expert conditions on another prompt


def toy(seed: int, scale: float = 1.0) -> sd.FunctionModel:
    return toy_model(toy_table(seed, len(VOCAB), scale), VOCAB)


def test_scores_are_the_second_prompts_log_probabilities():
    model = toy(0)
    r = LMReward(model, PROMPT2).bind(model)
    lm = sd.LM(model)
    seqs = [[], [2], [2, 3], [4, 4, 2], [2, 3, model.eos_token_id]]
    got = r.score_tokens(seqs)
    for s, g in zip(seqs, got.tolist()):
        eos = model.eos_token_id
        want = lm.complete(s[:-1], PROMPT2) if s and s[-1] == eos else lm.prefix(s, PROMPT2)
        assert g == pytest.approx(want, abs=1e-5)
    # tokens after an EOS are ignored; rows are independent of the batch they come in
    assert r.score_tokens([[2, 3, model.eos_token_id, 3, 3]])[0] == pytest.approx(float(got[4]), abs=1e-6)
    assert r.score_tokens([[4, 4, 2]])[0] == pytest.approx(float(got[3]), abs=1e-6)


def test_temperature_of_the_scorer():
    model = toy(0)
    r = LMReward(model, PROMPT2, temperature=0.5).bind(model)
    assert float(r.score_tokens([[2, 3]])[0]) == pytest.approx(
        sd.LM(model, temperature=0.5).prefix([2, 3], PROMPT2), abs=1e-5
    )


@pytest.mark.parametrize("mode", ["prefix", "complete"])
def test_potential_contract(mode):
    model = toy(1)
    r = LMReward(model, PROMPT2, beta=0.7, mode=mode).bind(model)
    seqs = enumerate_prefixes(model, 2)
    check_logw_next_consistency(r, PROMPT, seqs)
    check_batch_consistency(r, PROMPT, seqs[:12])


def test_power_scales_beta_and_keeps_the_class():
    model = toy(0)
    r = LMReward(model, PROMPT2, beta=0.5) ** 2
    assert isinstance(r, LMReward) and r.beta == 1.0


def test_errors():
    model = toy(0)
    other = sd.FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], 4), ["a", "b", "c", "<eos>"])
    with pytest.raises(sd.SMCDecodeError, match="does not share the target's vocabulary"):
        sd.LM(model) * LMReward(other, [0])
    with pytest.raises(sd.SMCDecodeError, match="mode"):
        LMReward(model, PROMPT2, mode="sometimes")
    with pytest.raises(sd.SMCDecodeError, match="Model"):
        LMReward("gpt", PROMPT2)
    with pytest.raises(sd.SMCDecodeError, match="prompt"):
        LMReward(model, [])


@statistical_settings(4)
@given(
    seed=st.integers(0, 10_000),
    # a terminal-only reward at β = 1 gives heavy-tailed weights (no twist guides the particles),
    # too heavy for a z-test on this many replicates: it is tested at β = 0.5
    beta_mode=st.sampled_from([(0.5, "prefix"), (1.0, "prefix"), (0.5, "complete")]),
    draft=st.booleans(),
)
def test_smc_samples_the_product_of_experts(seed, beta_mode, draft):
    beta, mode = beta_mode
    model = toy(seed)
    target = sd.LM(model) * LMReward(model, PROMPT2, beta=beta, mode=mode)
    exact = exact_target(target, PROMPT, 4)
    proposal = sd.Draft(toy_model(toy_table(seed, len(VOCAB), 1.0) + 0.3 * toy_table(seed + 1, len(VOCAB), 1.0), VOCAB))
    smc = sd.SMC(target, proposal if draft else "target", particles=4, block_size=2 if draft else None)
    out = smc.run_groups(PROMPT, groups=1200, max_new_tokens=4, seed=seed)
    check_distribution(out, exact)


def test_product_of_experts_is_proportional_to_both_lms():
    """π(x) ∝ p(x | prompt) · p(x | prompt'): checked on the enumeration itself (β = 1)."""
    model = toy(3)
    exact = exact_target(sd.LM(model) * LMReward(model, PROMPT2), PROMPT, 3)
    lm = sd.LM(model)
    eos = model.eos_token_id
    ratios = []
    for x, p in exact.probs.items():
        body = list(x[:-1]) if x[-1] == eos else list(x)
        a = lm.complete(body, PROMPT) if x[-1] == eos else lm.prefix(body, PROMPT)
        b = lm.complete(body, PROMPT2)  # a cut sequence is scored as complete by the reward
        ratios.append(torch.log(torch.tensor(p)) - (a + b))
    ratios = torch.stack(ratios)
    assert float(ratios.max() - ratios.min()) < 1e-4


def test_combined_with_a_constraint():
    model = toy(4)
    target = sd.LM(model) * sd.Regex(r"(ab|c)+") * LMReward(model, PROMPT2, beta=1.0)
    exact = exact_target(target, PROMPT, 4)
    out = sd.SMC(target, particles=4).run_groups(PROMPT, groups=1000, max_new_tokens=4, seed=0)
    check_distribution(out, exact)


def _tiny_llama(vocab: int = 6, seed: int = 0) -> sd.HFModel:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=vocab - 1, pad_token_id=vocab - 1)
    return sd.HFModel(transformers.LlamaForCausalLM(cfg).eval(), None, name=f"tiny-llama-{seed}")


@pytest.mark.parametrize("make", [lambda: toy(2), _tiny_llama], ids=["function-model", "hf-kv-cache"])
def test_prefix_session_equals_full_rescoring_through_forks(make):
    """The incremental prefix scores (one cache over all particles, fed only each round's new
    tokens, reordered on resampling) equal rescoring every whole prefix, through random forks,
    rows that end (EOS) and rows that stop being extended; a stale row is refused (None)."""
    model = make()
    r = LMReward(model, PROMPT2 + [2, 3]).bind(model)
    eos, B = model.eos_token_id, 6
    g = torch.Generator().manual_seed(5)
    session = r.prefix_session(B)
    seqs: list[list[int]] = [[] for _ in range(B)]
    ended = [False] * B
    for _round in range(5):
        rows = [i for i in range(B) if not ended[i]]
        if not rows:
            break
        for i in rows:
            block = torch.randint(1, eos + 1, (3,), generator=g).tolist()
            seqs[i] += block[: block.index(eos) + 1] if eos in block else block
            ended[i] = eos in seqs[i]
        got = session.scores([seqs[i] for i in rows], rows)
        want = r.score_tokens([seqs[i] for i in rows])
        assert torch.allclose(got, want, atol=1e-4), (got, want)
        index = torch.randint(0, B, (B,), generator=g)
        session.fork(index)
        seqs = [list(seqs[int(j)]) for j in index]
        ended = [ended[int(j)] for j in index]
    # a row left out of a call holds padding: extending it later is refused (the caller rescores)
    fresh = r.prefix_session(2)
    assert fresh.scores([[2, 3]], [0]) is not None and bool(fresh.stale[1])
    assert fresh.scores([[4]], [1]) is None


def test_smc_with_an_incremental_prefix_reward_matches_full_rescoring():
    """The same seeded SMC run with the incremental LMReward path (the default) and with
    whole-prefix rescoring (incremental=False) gives the same particles and the same weights."""
    model, draft = toy(3), toy(4, 0.5)
    runs = []
    for incremental in (True, False):
        target = sd.LM(model) * LMReward(model, PROMPT2, beta=0.8, incremental=incremental)
        runs.append(sd.SMC(target, sd.Draft(draft), particles=6, block_size=2).run_groups(PROMPT, 4, 6, seed=11))
    fast, slow = runs
    from smcdecode.samplers.common import RewardTracker

    for incremental in (True, False):  # the two runs did take different paths
        t = sd.LM(model) * LMReward(model, PROMPT2, incremental=incremental)
        assert bool(RewardTracker(t.rewards, model, 3, incremental=True).sessions) == incremental
    assert torch.equal(fast.tokens, slow.tokens)
    assert torch.allclose(fast.log_weights, slow.log_weights, atol=1e-6)
    assert torch.allclose(fast.log_evidence, slow.log_evidence, atol=1e-6)
