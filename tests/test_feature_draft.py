"""Feature drafts (EAGLE-style: they read the target's last hidden state), on tiny random Llamas (CPU).

The runner SMC-SD uses must compute exactly what training unrolls; training must reduce the KL at
every drafted position of a round; a saved draft round-trips; SMC-SD with a feature draft keeps
E[Ẑ] = Z and targets π exactly (enumeration); misuse is a clear error."""

from __future__ import annotations

import json

import pytest
import torch
from test_distill import corpus, target, tiny_target, word_prompts  # noqa: F401 (fixtures)

import smcdecode as sd
from smcdecode import SMCDecodeError
from smcdecode.distill import DistillConfig, distill, evaluate_draft, train_draft
from smcdecode.drafts import build_draft, load_draft, own_state, read_draft_config, save_draft
from smcdecode.drafts.feature import FeatureDraftModel, build_feature_draft, target_hidden, unrolled_mask
from smcdecode.testing import check_distribution, check_evidence_unbiased, exact_target


def _perturbed(draft: FeatureDraftModel, scale: float, seed: int = 0) -> FeatureDraftModel:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.net.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return draft


def test_unrolled_mask_is_a_rounds_attention():
    # step 1 (0-based) at position j: true-feature keys at <= j-1, and its own key at j
    m = unrolled_mask(4, 1, "cpu").int()
    assert m[:, :4].tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert m[:, 4:].tolist() == torch.eye(4, dtype=torch.int).tolist()
    # step 2 at position 3: true keys <= 1, step-1 key at 2, step-2 key at 3
    m = unrolled_mask(4, 2, "cpu")
    assert m.shape == (4, 12)
    assert m[3].int().tolist() == [1, 1, 0, 0] + [0, 0, 1, 0] + [0, 0, 0, 1]


@pytest.mark.parametrize("layers", [1, 2])
def test_runner_computes_what_training_unrolls(layers):
    """Prefix from the target's features, then a round: the first drafted position reads the
    target's feature, the next ones the runner's own outputs — step s of ``unrolled`` there."""
    t = tiny_target(layers=3)
    draft = _perturbed(build_feature_draft(t, layers), 0.05)
    ids = torch.randint(2, 48, (2, 12), generator=torch.Generator().manual_seed(3))
    hidden, _ = target_hidden(t.hf, ids, use_cache=False)
    steps = draft.net.unrolled(ids, hidden, 4)
    for P in (1, 6):
        for b in range(2):
            runner = draft.start(ids[b, :P].tolist(), 1)
            logits, h = runner.extend(ids[b : b + 1, P : P + 1], runner.tail_feature[:, None])
            for s in range(4):
                if s:
                    logits, h = runner.extend(ids[b : b + 1, P + s : P + s + 1], h[:, -1:])
                torch.testing.assert_close(h[0, -1], steps[s][b, P + s], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(logits[0, -1], draft.net.logits(steps[s])[b, P + s], atol=1e-4, rtol=1e-4)
    # re-feeding a round with the target's features gives the step-0 (true-feature) states again
    runner = draft.start(ids[0, :5].tolist(), 1)
    _, h = runner.extend(ids[:1, 5:9], hidden[:1, 4:8])
    torch.testing.assert_close(h[0], steps[0][0, 5:9], atol=1e-4, rtol=1e-4)


def test_feature_distillation_reduces_kl_at_every_drafted_position(target, corpus):  # noqa: F811
    held, train = corpus[:8], corpus[8:]
    draft = build_feature_draft(target, 1)
    before = evaluate_draft(target, draft, held, unroll=3)
    config = DistillConfig(layers=1, kind="feature", unroll=3, steps=40, batch_size=8, lr=1e-2, warmup_steps=1,
                           checkpoint_every=1000)
    report = train_draft(target, draft, train, config, progress=False)
    after = evaluate_draft(target, draft, held, unroll=3)
    assert report["steps"] == 40
    assert len(after["by_draft_step"]) == 3 and after["positions"] == before["positions"]
    for b, a in zip(before["by_draft_step"], after["by_draft_step"]):
        assert a["kl"] < 0.7 * b["kl"] and a["acceptance"] > b["acceptance"]
    assert all(not p.requires_grad for p in target.hf.parameters())


def test_feature_draft_from_a_layer_draft_starts_as_that_draft(target):  # noqa: F811
    layer_draft = build_draft(target, 2)
    with torch.no_grad():
        for p in layer_draft.hf.model.layers.parameters():
            p.add_(0.1 * torch.randn_like(p))
    draft = build_feature_draft(target, 2, from_draft=layer_draft)
    ids = torch.randint(2, 48, (2, 10), generator=torch.Generator().manual_seed(0))
    hidden, _ = target_hidden(target.hf, ids, use_cache=False)
    expected = layer_draft.hf(input_ids=ids).logits.float()
    for h in draft.net.unrolled(ids, hidden, 3):  # the feature input starts at zero: features ignored
        torch.testing.assert_close(draft.net.logits(h), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(SMCDecodeError, match="must equal the layers"):
        build_feature_draft(target, 1, from_draft=layer_draft)


@pytest.mark.parametrize("weights,tol", [("float32", 0.0), ("int8", 0.05)])
def test_saved_feature_draft_round_trips(target, tmp_path, weights, tol):  # noqa: F811
    draft = _perturbed(build_feature_draft(target, 2), 0.05)
    save_draft(draft, tmp_path, weights=weights)
    config = read_draft_config(tmp_path)
    assert config["kind"] == "feature" and config["version"] == 2 and config["num_layers"] == 2
    loaded = load_draft(target, tmp_path)
    assert isinstance(loaded, FeatureDraftModel)
    for (k, a), b in zip(own_state(draft).items(), own_state(loaded).values()):
        assert (a - b).abs().max() <= tol * a.abs().max() + 1e-7, k
    assert not any(p.requires_grad for p in loaded.net.parameters())
    # a layer draft is still written as version 1 (older readers load it)
    save_draft(build_draft(target, 1), tmp_path / "layers")
    assert read_draft_config(tmp_path / "layers")["version"] == 1
    with pytest.raises(SMCDecodeError, match="different target"):
        load_draft(tiny_target(seed=1), tmp_path)


def test_smc_with_a_feature_draft_is_unbiased_and_targets_pi():
    """p_T^2 over a 5-token vocabulary, 3 new tokens, enumerated exactly: E[Ẑ] = Z and the
    weighted particles target π, with a feature draft proposing K = 2 tokens a round."""
    model = tiny_target(vocab=5, layers=2)
    draft = _perturbed(build_feature_draft(model, 1), 0.02, seed=1)
    lm = sd.LM(model, 0.9) ** 2
    prompt = [0, 2, 3]
    exact = exact_target(lm, prompt, 3)
    smc = sd.SMC(lm, sd.Draft(draft, 1.0), particles=4, block_size=2, ess_threshold=0.5)
    out = smc.run_groups(prompt, 3000, 3, seed=11)
    check_evidence_unbiased(out, exact.log_Z)
    check_distribution(out, exact, z_max=5.5)


def test_feature_draft_misuse_is_a_clear_error(target, tmp_path):  # noqa: F811
    draft = build_feature_draft(target, 1)
    lm = sd.LM(target, 0.7)
    with pytest.raises(SMCDecodeError, match="backend='reference' only"):
        sd.SMC(lm, sd.Draft(draft, 0.7), backend="engine")
    with pytest.raises(SMCDecodeError, match="does not run feature drafts"):
        sd.SpeculativeDecoding(lm, sd.Draft(draft, 0.7))
    other = tiny_target(seed=2)
    with pytest.raises(SMCDecodeError, match="reads the hidden states of the model it was loaded for"):
        sd.SMC(sd.LM(other, 0.7), sd.Draft(draft, 0.7))
    with pytest.raises(SMCDecodeError, match="on_policy"):
        DistillConfig(kind="feature", on_policy=0.5).check()
    with pytest.raises(SMCDecodeError, match="kind must be"):
        DistillConfig(kind="eagle").check()
    with pytest.raises(SMCDecodeError, match="pass kind='feature'"):
        DistillConfig(feature_from="default").check()
    save_draft(draft, tmp_path)
    config = json.loads((tmp_path / "draft.json").read_text())
    (tmp_path / "draft.json").write_text(json.dumps({**config, "kind": "medusa"}))
    with pytest.raises(SMCDecodeError, match="kind 'medusa'"):
        load_draft(target, tmp_path)


def test_distill_a_feature_draft_end_to_end_then_resume(tmp_path):
    tiny = tiny_target(tokenizer=True)
    prompts = word_prompts(20, stride=7, spread=4)
    config = DistillConfig(layers=1, kind="feature", unroll=2, samples_per_prompt=2, max_new_tokens=8, holdout=4,
                           steps=6, batch_size=4, lr=1e-2, warmup_steps=1, checkpoint_every=3)
    logs: list[str] = []
    report = distill(tiny, prompts, tmp_path, config, progress=False, log=logs.append)
    (figures,) = report["eval"]
    assert len(figures["by_draft_step"]) == 2 and figures["sequences"] == 4
    config.steps = 8
    report = distill(tiny, prompts, tmp_path, config, progress=False, log=logs.append)
    assert any(line.startswith("resuming") for line in logs) and report["training"]["steps"] == 8
    draft = load_draft(tiny, tmp_path)
    result = sd.SMC(sd.LM(tiny, 0.7), sd.Draft(draft, 0.7), particles=3, block_size=3).run(
        "w3 w4", max_new_tokens=7, seed=0, progress=False)
    assert isinstance(result.text, str) and len(result.ess) >= 2
    # a warm start must be of the same kind
    with pytest.raises(SMCDecodeError, match="--kind feature"):
        distill(tiny, prompts, tmp_path / "bad", DistillConfig(layers=1, steps=1), init_draft=tmp_path,
                progress=False, log=logs.append)


def test_smc_weights_use_the_features_a_round_sees():
    """One particle, no resampling: its log weight is Σ log p_T(d) − log q(d) over the drafted
    tokens, with q(d) recomputed offline from the whole sequence by ``unrolled`` (the s-th drafted
    token of a round read the target's features up to the round's start and the draft's own
    outputs since). Pins the re-feeding of each round's tokens with the target's features."""
    model = tiny_target(vocab=48, layers=2)
    draft = _perturbed(build_feature_draft(model, 1), 0.05, seed=2)
    prompt, K, T, Tq = [0, 5, 7, 9], 2, 0.8, 1.1
    smc = sd.SMC(sd.LM(model, T), sd.Draft(draft, Tq), particles=1, block_size=K, ess_threshold=0.0)
    checked = 0
    for seed in range(6):
        out = smc.run_groups(prompt, 1, 3 * (K + 1), seed=seed)
        gen = out.tokens[0, 0].tolist()
        if model.eos_token_id in gen:
            continue
        ids = torch.tensor([prompt + gen])
        with torch.no_grad():
            hidden, z_t = target_hidden(model.hf, ids, use_cache=False)
            log_p = torch.log_softmax(z_t[0].double() / T, -1)
            steps = [torch.log_softmax(draft.net.logits(h)[0].double() / Tq, -1)
                     for h in draft.net.unrolled(ids, hidden, K)]
        expected = 0.0
        for r in range(3):
            start = len(prompt) - 1 + r * (K + 1)  # position of the round's `last` token
            for s in range(K):
                token = ids[0, start + s + 1]
                expected += float(log_p[start + s, token] - steps[s][start + s, token])
        assert float(out.log_weights[0, 0]) == pytest.approx(expected, abs=1e-3)
        checked += 1
    assert checked >= 3
