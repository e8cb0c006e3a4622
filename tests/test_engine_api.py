"""The public API on the engine: ``SMC(..., backend="engine")`` and ``SpeculativeDecoding(...,
backend="engine")`` run the same programs as the reference backend and return the same types; the
output matches exact enumeration; models convert (HFModel, truncated draft, the shipped draft of
SmolLM2 loaded from its GGUF); what the engine cannot run is refused with an SMCDecodeError."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import CUDA_PARAM, ENGINE_VOCAB, tiny_llama_pair

import smcdecode as sd
from smcdecode.testing import check_distribution, check_evidence_unbiased, chi_square_pvalue, exact_target

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

VOCAB = ENGINE_VOCAB
V = len(VOCAB)
PROMPT = [0, 1, 2]
DEVICES = ["cpu", CUDA_PARAM]


_MODELS: dict = {}


def _models(device: str):
    """(target, draft) HFModels: a tiny random Llama and a copy with a perturbed head."""
    if device not in _MODELS:
        _MODELS[device] = tiny_llama_pair(device, head_std=0.15)
    return _MODELS[device]


@pytest.mark.parametrize("device", DEVICES)
def test_smc_on_the_engine_matches_the_exact_target(device):
    target_model, draft_model = _models(device)
    pattern = r"[ab]{2,4}"
    target = sd.LM(target_model, temperature=0.9) * sd.Regex(pattern)
    # the exact target from the CPU copy (the same weights): the potentials' scalar scoring path
    # mixes the LM's device with the regex's CPU tensors
    exact = exact_target(sd.LM(_models("cpu")[0], temperature=0.9) * sd.Regex(pattern), PROMPT, 3)
    smc = sd.SMC(target, sd.Draft(draft_model, 1.1), particles=4, block_size=2, backend="engine")
    out = smc.run_groups(PROMPT, 1200, 3, seed=0)
    assert out.tokens.shape == (1200, 4, 3) and out.log_evidence.shape == (1200,)
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)

    result = smc.run(PROMPT, max_new_tokens=3, seed=1, progress=False)
    assert isinstance(result, sd.Result) and re.fullmatch(pattern, result.text)
    assert len(result.ess) == len(result.weight_history) == len(result.resampled) >= 1
    assert 0 < result.draft_tokens <= 4 * 3  # N particles × at most the budget
    again = smc.run(PROMPT, max_new_tokens=3, seed=1, progress=False)
    assert again.tokens == result.tokens and again.log_evidence == result.log_evidence  # seeded


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_decoding_on_the_engine_samples_the_target(device):
    target_model, draft_model = _models(device)
    lm = sd.LM(target_model, temperature=1.0)
    exact = exact_target(sd.LM(_models("cpu")[0], temperature=1.0), PROMPT, 2)
    strategy = sd.SpeculativeDecoding(lm, sd.Draft(draft_model, 1.0), block_size=2, samples=4, backend="engine")
    out = strategy.run_groups(PROMPT, 1000, 2, seed=0)
    assert chi_square_pvalue(out, exact) > 1e-4
    result = strategy.run(PROMPT, max_new_tokens=4, seed=0, progress=False)
    assert 0 <= result.acceptance_rate <= 1


def test_truncated_draft_converts_and_shares_the_targets_modules():
    from smcdecode.backends.engine.bridge import engine_for

    target_model, _ = _models("cpu")
    draft = sd.truncated_draft(target_model, 1)
    engine = engine_for(target_model, draft, rows=4, context=16, options={})
    assert engine.draft.cfg.n_layers == 1 and engine.target.cfg.n_layers == 2
    assert engine.draft.tok_embeddings is engine.target.tok_embeddings
    assert engine.draft.output is engine.target.output
    out = sd.SMC(sd.LM(target_model), sd.Draft(draft), particles=3, block_size=2, backend="engine").run(
        PROMPT, max_new_tokens=5, seed=0, progress=False)
    assert len(out.tokens) == 3 and all(1 <= len(t) <= 5 for t in out.tokens)
    assert len(out.weight_history) == len(out.ess) >= 1  # the fused plain round records them too
    assert 0 < out.draft_tokens <= 3 * 5


def test_what_the_engine_cannot_run_is_refused():
    target_model, draft_model = _models("cpu")
    toy = sd.FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], V), vocab=VOCAB, eos="<eos>")
    with pytest.raises(sd.SMCDecodeError, match="FunctionModel: use backend='reference'"):
        sd.SMC(sd.LM(toy), sd.Draft(toy), backend="engine").run([0, 1], 2, progress=False)
    with pytest.raises(sd.SMCDecodeError, match="unknown backend 'gpu'"):
        sd.SMC(sd.LM(target_model), sd.Draft(draft_model), backend="gpu")
    with pytest.raises(sd.SMCDecodeError, match=r"unknown engine option\(s\) \['pages'\]"):
        sd.SMC(sd.LM(target_model), sd.Draft(draft_model), backend="engine", engine_options={"pages": 3})
    with pytest.raises(sd.SMCDecodeError, match="engine_options apply to backend='engine' only"):
        sd.SMC(sd.LM(target_model), sd.Draft(draft_model), engine_options={"page_size": 8})
    with pytest.raises(sd.SMCDecodeError, match="at least 2 tokens"):
        sd.SMC(sd.LM(target_model), sd.Draft(draft_model), backend="engine").run([1], 2, progress=False)
    with pytest.raises(sd.SMCDecodeError, match=rf"outside the vocabulary \[0, {V}\): \[{V + 3}\]"):
        sd.SMC(sd.LM(target_model), sd.Draft(draft_model), backend="engine").run([1, V + 3, 2], 2, progress=False)
    # the Engine itself (its Triton embedding lookup would read outside the table)
    from smcdecode.backends.engine import Engine, Llama, LlamaConfig

    tiny = LlamaConfig(V, 32, 1, 2, 1, 64, rope_theta=10000.0)
    engine = Engine(Llama.random(tiny, dtype=torch.float32, device="cpu"),
                    Llama.random(tiny, dtype=torch.float32, device="cpu", seed=1), num_pages=64, page_size=4,
                    max_context=64)
    for bad in (V + 3, -1):
        with pytest.raises(sd.SMCDecodeError, match=rf"prompt token id {bad} is outside the model's vocabulary"):
            engine.smc_sd([[1, bad, 2]], particles=2, block_size=2, max_new_tokens=2)


@pytest.mark.slow
def test_smollm2_from_gguf_with_its_distilled_draft_on_the_engine():
    """The default model (a GGUF, through load_model) and its shipped distilled draft convert to the
    engine's Llama; a constrained SMC run on the engine's CPU path returns text in the language."""
    model = sd.load_model("smollm2")
    draft = sd.load_default_draft(model)
    pattern = r"[0-9]{2,4}"
    target = sd.LM(model, temperature=0.7) * sd.Regex(pattern)
    smc = sd.SMC(target, sd.Draft(draft, 0.7), particles=4, block_size=3, backend="engine")
    result = smc.run([{"role": "user", "content": "Pick a number."}], max_new_tokens=6, seed=0, progress=False)
    assert result.text is not None and re.fullmatch(pattern, result.text), result.text
    assert all(re.fullmatch(pattern, t) for t, w in zip(result.texts, result.weights.tolist()) if w > 0)
