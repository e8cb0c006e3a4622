"""Programs beyond the engine's drafted SMC-SD on ``backend="engine"``: the particle filter with the
target as proposal (K = 0 rounds, no draft model), locally masked autoregressive sampling (the
request loop with K = 0 and no resampling), ``Autoregressive(..., backend="engine")`` with a power;
against exact enumeration. Tiny random Llamas, float32; on the CPU (torch reference path) and,
marked ``gpu``, on CUDA (Triton kernels)."""

from __future__ import annotations

import pytest
import torch
from conftest import CUDA_PARAM, ENGINE_VOCAB, tiny_llama_pair

import smcdecode as sd
from smcdecode.testing import (
    check_distribution,
    check_evidence_unbiased,
    chi_square_pvalue,
    exact_autoregressive,
    exact_target,
)

transformers = pytest.importorskip("transformers")

DEVICES = ["cpu", CUDA_PARAM]
VOCAB = ENGINE_VOCAB
V = len(VOCAB)
PROMPT = [0, 1, 2]
_MODELS: dict = {}


def _models(device: str):
    """(target, draft) HFModels: a tiny random Llama whose attention outputs dominate the residual
    stream (so a token's distribution depends on the whole history, not mostly the last token) and
    whose head turns that into logits of a few nats, and a copy with a perturbed head. With a head
    of std 0.15 (as in test_engine_api.py) a runner that forgot to reorder its rows passed the
    exact-target test (max |z| 3.8); with 0.3 it fails it (z = 15)."""
    if device not in _MODELS:
        _MODELS[device] = tiny_llama_pair(device, head_std=0.3, value_scale=20.0)
    return _MODELS[device]


@pytest.mark.parametrize("device", DEVICES)
def test_particle_filter_and_power_target_on_the_engine(device):
    """proposal='target' (one bonus token a round, no draft model) on p^2."""
    target_model, _ = _models(device)
    exact = exact_target(sd.LM(_models("cpu")[0]) ** 2, PROMPT, 3)
    smc = sd.SMC(sd.LM(target_model) ** 2, "target", particles=4, ess_threshold=1.0, backend="engine")
    out = smc.run_groups(PROMPT, 1000, 3, seed=2)
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["reference", "engine"])
def test_particle_filter_on_cuda_against_the_exact_target(backend):
    """The setting of the open CUDA log-Z difference (docs/engine.md): the particle filter on p²
    with a fork every round, 4 tokens (8 are too many to enumerate), both backends on CUDA against
    exact enumeration on the CPU.
    Whichever backend fails here is the one that is off on CUDA."""
    target_model, _ = _models("cuda")
    exact = exact_target(sd.LM(_models("cpu")[0]) ** 2, PROMPT, 4)
    smc = sd.SMC(sd.LM(target_model) ** 2, "target", particles=4, ess_threshold=1.0, resampler="multinomial",
                 backend=backend)
    out = smc.run_groups(PROMPT, 1000, 4, seed=4)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)
    check_distribution(out, exact, z_max=5.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_masked_autoregressive_on_the_engine(device, alpha):
    """Locally masked sampling v ∝ p^α·1[valid] on the engine (the request loop, K = 0, τ = 0): the
    exact locally-masked distribution; a particle cut where the regex does not accept has weight 0."""
    target_model, _ = _models(device)
    cpu = _models("cpu")[0]
    pattern = r"(ab|b)*a"
    masked = sd.LM(target_model) ** alpha * sd.Regex(pattern)
    exact_masked = exact_autoregressive(sd.LM(cpu) ** alpha * sd.Regex(pattern), PROMPT, 3)
    ar_out = sd.Autoregressive(masked, samples=4, backend="engine").run_groups(PROMPT, 500, 3, seed=1)
    assert ar_out.tokens.shape[:2] == (500, 4) and bool(ar_out.finished.all())
    assert chi_square_pvalue(ar_out, exact_masked) > 1e-4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_autoregressive_on_the_engine_samples_the_local_target(device, alpha):
    """``Autoregressive(..., backend="engine")``: the engine's AR at temperature T/α, cut after the
    first EOS; p_T^α sampled token by token (α = 2 fails if α is ignored)."""
    target_model, _ = _models(device)
    target = sd.LM(target_model, temperature=0.8) ** alpha
    exact = exact_autoregressive(sd.LM(_models("cpu")[0], temperature=0.8) ** alpha, PROMPT, 3)
    strategy = sd.Autoregressive(target, samples=4, backend="engine")
    out = strategy.run_groups(PROMPT, 800, 3, seed=0)
    assert out.tokens.shape == (800, 4, 3) and bool(out.finished.all())
    assert chi_square_pvalue(out, exact) > 1e-4
    result = strategy.run(PROMPT, max_new_tokens=5, seed=3, progress=False)
    eos = target_model.eos_token_id
    assert all(eos not in t[:-1] and 1 <= len(t) <= 5 for t in result.tokens)
    assert result.text is not None


def test_engine_backends_refuse_what_they_cannot_run():
    target_model, draft_model = _models("cpu")
    with pytest.raises(sd.SMCDecodeError, match="unknown backend 'engine-runner'"):
        sd.SMC(sd.LM(target_model), sd.Draft(draft_model), backend="engine-runner")
    with pytest.raises(sd.SMCDecodeError, match="page_size must be a positive integer .* got 0"):
        sd.SpeculativeDecoding(sd.LM(target_model), sd.Draft(draft_model), backend="engine",
                               engine_options={"page_size": 0})
    toy = sd.FunctionModel(lambda ctx: torch.zeros(ctx.shape[0], V), vocab=VOCAB, eos="<eos>")
    with pytest.raises(sd.SMCDecodeError, match="FunctionModel: use backend='reference'"):
        sd.Autoregressive(sd.LM(toy), backend="engine").run([0, 1], 2, progress=False)
    from smcdecode.backends.engine import Request, Scheduler
    from smcdecode.backends.engine.bridge import engine_for

    engine = engine_for(target_model, draft_model, rows=8, context=16, options={})
    sched = Scheduler(engine, slots=2, max_particles=2, max_block_size=2, max_context=16, exact_only=True)
    with pytest.raises(sd.SMCDecodeError, match="exact speculative decoding only"):
        sched.submit(Request(PROMPT, particles=2, block_size=2, max_new_tokens=3))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exact_only", [False, True])
def test_exact_speculative_decoding_on_the_request_loop_samples_the_target(device, exact_only):
    """Exact speculative decoding as a program of the request loop (``Request(exact=True)``): in a
    ``Scheduler(speculative=True)``, in the same rounds as SMC-SD requests of another K, and alone in
    an exact-only scheduler (the round of exact.py) whose requests draft K = 1 or 2 of its 3: its
    samples follow p_T exactly (chi-square against exact enumeration, ≤ 3 tokens), and the SMC-SD
    requests beside it still give unbiased evidence estimates."""
    from types import SimpleNamespace

    from smcdecode.backends.engine import Request, Scheduler
    from smcdecode.backends.engine.bridge import engine_for

    target, draft = _models(device)
    eos = V - 1
    engine = engine_for(target, draft, rows=200, context=16, options={})
    sched = Scheduler(engine, slots=64, max_particles=3, max_block_size=3, eos_token_id=eos,
                      speculative=not exact_only, exact_only=exact_only, max_context=16, seed=5)
    M, n = 3000, 3
    for i in range(M):
        k = 1 + i % 2 if exact_only else 2
        sched.submit(Request(PROMPT, particles=1, block_size=k, max_new_tokens=n, exact=True, id=("sd", i)))
        if i % 10 == 0 and not exact_only:
            sched.submit(Request(PROMPT, particles=3, block_size=3, max_new_tokens=n, id=("smc", i)))
    done = sched.run()
    sd_runs = [f for f in done if f.request.id[0] == "sd"]
    assert len(sd_runs) == M and all(f.accepted is not None and 0 <= int(f.accepted[0]) <= int(f.drafted[0])
                                     for f in sd_runs)
    out = SimpleNamespace(tokens=torch.stack([f.tokens for f in sd_runs]), lengths=torch.stack([f.lengths for f in sd_runs]),
                          log_weights=torch.zeros(M, 1, dtype=torch.float64))
    exact = exact_target(sd.LM(_models("cpu")[0], temperature=1.0), PROMPT, n)
    assert chi_square_pvalue(out, exact) > 1e-4
    assert sum(int(f.accepted[0]) for f in sd_runs) > 0  # drafts were accepted, not only rejections drawn
    smc_runs = [f for f in done if f.request.id[0] == "smc"]
    if exact_only:
        return
    evidence = torch.tensor([f.log_evidence for f in smc_runs], dtype=torch.float64)
    assert torch.isfinite(evidence).all()
    ratio = torch.exp(evidence - exact.log_Z)
    assert abs(float(ratio.mean()) - 1) < 4 * float(ratio.std()) / len(ratio) ** 0.5 + 0.05


@pytest.mark.parametrize("device", DEVICES)
def test_autoregressive_rows_of_the_request_loop_sample_the_target(device):
    """Exact-only rows of K = 0 without a draft (``Engine.autoregressive``'s program and the server's
    AR lane): requests of a one-token prompt at temperature 1 and of a longer one at 0.7, in the same
    rounds, joining as slots free up; each follows p_T at its temperature exactly (chi-square against
    exact enumeration, 3 tokens); a request of K > 0 is refused."""
    from types import SimpleNamespace

    from smcdecode.backends.engine import Request, Scheduler
    from smcdecode.backends.engine.bridge import engine_for

    target, _ = _models(device)
    engine = engine_for(target, None, rows=200, context=16, options={})
    sched = Scheduler(engine, slots=4, max_particles=50, max_block_size=0, eos_token_id=V - 1, max_context=16,
                      seed=3, exact_only=True)
    prompts, temperatures, n = {"one": PROMPT[:1], "long": PROMPT}, {"one": 1.0, "long": 0.7}, 3
    for i in range(60):
        name = "one" if i % 2 else "long"
        sched.submit(Request(prompts[name], particles=50, block_size=0, max_new_tokens=n,
                             target_temperature=temperatures[name], id=(name, i), exact=True))
    done = sched.run()
    for name in prompts:
        runs = [f for f in done if f.request.id[0] == name]
        out = SimpleNamespace(tokens=torch.cat([f.tokens for f in runs])[:, None],
                              lengths=torch.cat([f.lengths for f in runs])[:, None],
                              log_weights=torch.zeros(1500, 1, dtype=torch.float64))
        exact = exact_target(sd.LM(_models("cpu")[0], temperature=temperatures[name]), prompts[name], n)
        assert chi_square_pvalue(out, exact) > 1e-4, name
    with pytest.raises(sd.SMCDecodeError, match="block_size .* exceeds"):
        sched.submit(Request(PROMPT, particles=1, block_size=1, max_new_tokens=n, exact=True))
