"""Distillation and draft files, on tiny random Llama models (CPU, a few seconds in all)."""

from __future__ import annotations

import json

import pytest
import torch

from smcdecode import LM, SMC, Draft, HFModel, SMCDecodeError
from smcdecode.distill import (
    DistillConfig,
    distill,
    evaluate_draft,
    generate_corpus,
    kl_loss,
    load_prompts,
    main,
    split_prompts,
    train_draft,
)
from smcdecode.drafts import (
    _decoder,
    build_draft,
    draft_info,
    grow_draft,
    grown_layout,
    load_default_draft,
    load_draft,
    own_state,
    read_draft_config,
    save_draft,
)

transformers = pytest.importorskip("transformers")


def word_tokenizer(vocab: int):
    """A whitespace tokenizer over the words <s>, </s>, w0 .. w{vocab-3} (no chat template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>"] + [f"w{i}" for i in range(vocab - 2)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="w0")


def word_prompts(count: int, stride: int, spread: int) -> list[str]:
    """``count`` distinct prompts of 2 to spread + 1 words of the tiny tokenizer's vocabulary."""
    return [" ".join(f"w{(stride * i + j) % 46}" for j in range(2 + i % spread)) for i in range(count)]


def tiny_target(vocab: int = 48, seed: int = 0, layers: int = 3, tokenizer: bool = False) -> HFModel:
    """A random Llama with peaked next-token distributions (large init), so KL is far from 0."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=1, pad_token_id=1, initializer_range=0.25,
    )
    tok = word_tokenizer(vocab) if tokenizer else None
    return HFModel(transformers.LlamaForCausalLM(cfg).eval(), tok, name=f"tiny-{vocab}-{seed}")


@pytest.fixture(scope="module")
def target() -> HFModel:
    return tiny_target()


@pytest.fixture(scope="module")
def corpus(target):
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 48, (int(n),), generator=g).tolist() for n in torch.randint(3, 8, (16,), generator=g)]
    return generate_corpus(target, prompts, samples=2, max_new_tokens=12, batch_size=32, seed=0, progress=False)


def test_corpus_is_cut_after_eos(target, corpus):
    assert len(corpus) == 32
    for _prompt, response in corpus:
        assert 1 <= len(response) <= 12
        assert target.eos_token_id not in response[:-1]


def test_kl_loss_is_zero_on_equal_logits_and_positive_otherwise():
    z = torch.randn(5, 7)
    assert float(kl_loss(z, z, [0.7, 1.0])) == pytest.approx(0.0, abs=1e-6)
    assert float(kl_loss(z, z + torch.randn(5, 7), [0.7])) > 0


def test_distillation_reduces_kl(target, corpus):
    held, train = corpus[:8], corpus[8:]
    draft = build_draft(target, 1)
    before = evaluate_draft(target, draft, held)
    config = DistillConfig(layers=1, steps=40, batch_size=8, lr=1e-2, warmup_steps=1, checkpoint_every=1000)
    report = train_draft(target, draft, train, config, progress=False)
    after = evaluate_draft(target, draft, held)
    assert report["steps"] == 40
    assert after["kl"] < 0.7 * before["kl"]
    assert after["acceptance"] > before["acceptance"]
    # the target is frozen and shared, not trained
    assert all(not p.requires_grad for p in target.hf.parameters())
    assert draft.hf.get_input_embeddings() is target.hf.get_input_embeddings()


def test_training_resumes_from_checkpoint_exactly(target, corpus, tmp_path):
    config = dict(layers=1, batch_size=8, lr=3e-3, warmup_steps=1, min_lr_ratio=1.0, checkpoint_every=1000)
    straight = build_draft(target, 1)
    train_draft(target, straight, corpus, DistillConfig(steps=10, **config), progress=False)

    ckpt = tmp_path / "checkpoint.pt"
    resumed = build_draft(target, 1)
    train_draft(target, resumed, corpus, DistillConfig(steps=5, **config), checkpoint=ckpt, progress=False)
    fresh = build_draft(target, 1)  # a new process: same recipe, more steps
    logs = []
    out = train_draft(target, fresh, corpus, DistillConfig(steps=10, **config), checkpoint=ckpt, progress=False,
                      log=logs.append)
    assert out["steps"] == 10 and "resuming" in logs[0]
    for (k, a), b in zip(own_state(straight).items(), own_state(fresh).values()):
        torch.testing.assert_close(a, b, msg=k)

    with pytest.raises(SMCDecodeError, match="another recipe"):
        train_draft(target, build_draft(target, 1), corpus, DistillConfig(steps=10, **{**config, "lr": 1e-3}),
                    checkpoint=ckpt, progress=False)


def test_distill_end_to_end_then_resume(tmp_path):
    target = tiny_target(tokenizer=True)
    prompts = word_prompts(20, stride=7, spread=4)
    config = DistillConfig(layers=1, samples_per_prompt=2, max_new_tokens=8, holdout=4, steps=6, batch_size=4,
                           lr=1e-2, warmup_steps=1, checkpoint_every=3, weights="bfloat16")
    logs: list[str] = []
    report = distill(target, prompts, tmp_path, config, progress=False, log=logs.append)
    for name in ("draft.json", "draft.safetensors", "corpus.pt", "checkpoint.pt", "eval.json"):
        assert (tmp_path / name).is_file(), name
    assert report["training"]["steps"] == 6 and report["training"]["train_sequences"] == 32
    (figures,) = report["eval"]
    assert figures["temperature"] == 0.7 and 0 < figures["acceptance"] <= 1 and figures["sequences"] == 4
    assert read_draft_config(tmp_path)["eval"] == report["eval"]

    # the same command with more steps: the corpus is reused and training resumes
    config.steps = 9
    report = distill(target, prompts, tmp_path, config, progress=False, log=logs.append)
    assert any(line.startswith("reusing") for line in logs) and any(line.startswith("resuming") for line in logs)
    assert report["training"]["steps"] == 9
    result = SMC(LM(target, 0.7), Draft(load_draft(target, tmp_path), 0.7), particles=2, block_size=2).run(
        "w3 w4", max_new_tokens=5, seed=0, progress=False)
    assert isinstance(result.text, str)

    # a warm start from the saved draft, into another directory
    config.steps = 2
    warm = distill(target, prompts, tmp_path / "warm", config, init_draft=tmp_path, progress=False, log=logs.append)
    assert warm["training"]["warm_start"]["training"]["steps"] == 9 and warm["training"]["steps"] == 2
    config.layers = 2
    with pytest.raises(SMCDecodeError, match="cannot grow a 1-layer draft"):
        distill(target, prompts, tmp_path / "bad", config, init_draft=tmp_path, progress=False, log=logs.append)
    config.layers, config.init_layers = 1, [0]
    with pytest.raises(SMCDecodeError, match="pass --layers 1"):
        distill(target, prompts, tmp_path / "bad", config, init_draft=tmp_path, progress=False, log=logs.append)


def test_a_grown_draft_starts_as_its_source_and_trains_its_new_layers(tmp_path):
    target = tiny_target(layers=6, tokenizer=True)
    prompts = word_prompts(24, stride=5, spread=4)
    config = DistillConfig(layers=3, samples_per_prompt=2, max_new_tokens=8, holdout=4, steps=30, batch_size=8,
                           lr=1e-2, warmup_steps=1, checkpoint_every=1000, weights="float32")
    distill(target, prompts, tmp_path / "d3", config, progress=False, log=lambda _: None)
    source = load_draft(target, tmp_path / "d3")
    assert draft_info(source)["init_layers"] == [0, 2, 5]

    grown = grow_draft(target, source, 5)  # one new layer in each gap, from the target layer midway
    assert draft_info(grown)["init_layers"] == [0, 1, 2, 3, 5]
    ids = torch.randint(2, 48, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(grown.hf(input_ids=ids).logits, source.hf(input_ids=ids).logits,
                                   atol=1e-5, rtol=1e-5)

    # distill --init-draft d3 --layers 5: grows, trains the new layers, saves 5 layers
    logs: list[str] = []
    config.layers, config.steps = 5, 10
    report = distill(target, prompts, tmp_path / "d5", config, init_draft=tmp_path / "d3", progress=False,
                     log=logs.append)
    assert any(line.startswith("grown from 3 to 5 layers") for line in logs)
    assert report["training"]["warm_start"]["num_layers"] == 3
    saved = load_draft(target, tmp_path / "d5")
    assert read_draft_config(tmp_path / "d5")["init_layers"] == [0, 1, 2, 3, 5]
    new_layer = _decoder(saved.hf).layers[1]
    assert float(new_layer.self_attn.o_proj.weight.abs().max()) > 0
    assert float(new_layer.mlp.down_proj.weight.abs().max()) > 0

    assert grown_layout([0, 10, 20, 29], 6) == ([0, 5, 10, 20, 24, 29], [False, True, False, False, True, False])
    with pytest.raises(SMCDecodeError, match=r"num_layers must be in \[4, 5\] to grow a 3-layer draft"):
        grow_draft(target, source, 6)


def test_extra_prompts_only_train_and_generation_budget_keeps_a_random_subset(tmp_path):
    target = tiny_target(tokenizer=True)
    prompts = word_prompts(20, stride=7, spread=4)
    extra = [f"w{i} w{i} w{i + 1}" for i in range(10)] + [prompts[0]]
    config = DistillConfig(layers=1, samples_per_prompt=2, max_new_tokens=6, holdout=4, steps=1, batch_size=4,
                           weights="bfloat16")
    base = distill(target, prompts, tmp_path / "a", config, progress=False, log=lambda s: None)
    logs: list[str] = []
    more = distill(target, prompts, tmp_path / "b", config, extra_prompts=extra, progress=False, log=logs.append)
    held_a = torch.load(tmp_path / "a" / "corpus.pt", weights_only=True)
    held_b = torch.load(tmp_path / "b" / "corpus.pt", weights_only=True)
    assert held_a["heldout_prompts"] == held_b["heldout_prompts"]  # extra prompts never change the held-out set
    assert held_a["heldout"] == held_b["heldout"]
    # 16 training prompts + 10 new extra ones (the repeated prompts[0] is dropped), 2 samples each
    assert base["training"]["train_sequences"] == 32 and more["training"]["train_sequences"] == 52
    assert any("10 of 11 extra prompts" in line for line in logs)

    # a time budget stops generation after the first batch: a random subset, not the shortest prompts
    jobs = [[2] * n for n in range(1, 41)]
    few = generate_corpus(target, jobs, samples=1, max_new_tokens=2, batch_size=8, seed=3, progress=False,
                          time_budget_s=1e-9, log=logs.append)
    assert len(few) == 8 and sorted(len(p) for p, _ in few) != list(range(1, 9))
    assert any("generation time budget" in line for line in logs)


def _chi2_pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit of ``counts`` to ``p`` (cells expected < 5 times pooled)."""
    from scipy.stats import chisquare

    n = float(counts.sum())
    keep = p * n >= 5
    obs, exp = counts[keep], p[keep] * n
    if (~keep).any():
        obs, exp = torch.cat([obs, counts[~keep].sum()[None]]), torch.cat([exp, p[~keep].sum()[None] * n])
    return float(chisquare(obs.numpy(), exp.numpy() * float(obs.sum()) / float(exp.sum())).pvalue)


def test_engine_generator_samples_the_target(target):
    """The engine-generated corpus follows p_T, with many samples of each prompt sharing its KV
    pages and two prompts of different lengths in one batch: first-token counts against
    softmax(logits / T), and second-token counts among the answers with the same first token t
    against p_T(· | prompt, t) (an answer that read another row's token from a shared page would
    fail it); chi-square, false-alarm rate 1e-6 each. Every response is cut after its first EOS."""
    prompts, T, n = [[5, 9, 13], [7, 3, 11, 2, 8, 4]], 0.7, 1500
    corpus = generate_corpus(target, prompts, samples=n, max_new_tokens=3, temperature=T, batch_size=2 * n,
                             seed=4, progress=False, generator="engine")
    assert len(corpus) == 2 * n
    for _prompt, response in corpus:
        assert 1 <= len(response) <= 3 and target.eos_token_id not in response[:-1]

    def p_T(ids):
        with torch.no_grad():
            return torch.softmax(target.hf(input_ids=torch.tensor([ids])).logits[0, -1].double() / T, -1)

    V, tested = 48, 0
    for g, prompt in enumerate(prompts):
        answers = [r for p, r in corpus[g * n : (g + 1) * n]]
        assert all(p == prompt for p, _ in corpus[g * n : (g + 1) * n])  # answers of prompt g, in order
        first = torch.tensor([r[0] for r in answers])
        assert _chi2_pvalue(torch.bincount(first, minlength=V).double(), p_T(prompt)) > 1e-6
        for t in torch.unique(first).tolist():
            seconds = [r[1] for r in answers if r[0] == t and len(r) > 1]
            if t == target.eos_token_id or len(seconds) < 150:
                continue
            counts = torch.bincount(torch.tensor(seconds), minlength=V).double()
            assert _chi2_pvalue(counts, p_T(prompt + [t])) > 1e-6, (prompt, t)
            tested += 1
    assert tested >= 2
    with pytest.raises(SMCDecodeError, match="generator must be"):
        generate_corpus(target, [prompts[0]], generator="vllm", progress=False)
    with pytest.raises(SMCDecodeError, match="samples must be"):
        generate_corpus(target, [prompts[0]], samples=0, generator="engine", progress=False)


def test_engine_generator_time_budget_keeps_whole_prompts(target):
    """With the engine a batch holds whole prompts with all their samples (a prompt with more
    samples than a batch holds is split); a time budget keeps a seeded random subset of them."""
    logs: list[str] = []
    jobs = [[2 + i % 40] * (1 + i) for i in range(40)]
    few = generate_corpus(target, jobs, samples=4, max_new_tokens=2, batch_size=8, seed=3, progress=False,
                          time_budget_s=1e-9, generator="engine", log=logs.append)
    kept = {tuple(p) for p, _ in few}
    assert len(few) == 8 and len(kept) == 2 and all(sum(tuple(p) == k for p, _ in few) == 4 for k in kept)
    assert sorted(map(len, kept)) != [1, 2]  # not the shortest prompts
    assert any("generation time budget" in line for line in logs)
    split = generate_corpus(target, jobs[:2], samples=5, max_new_tokens=2, batch_size=4, seed=0, progress=False,
                            generator="engine")
    assert [p for p, _ in split] == [jobs[0]] * 5 + [jobs[1]] * 5


@pytest.mark.parametrize("weights, tol", [("float32", 0.0), ("bfloat16", 5e-2), ("int8", 5e-2)])
def test_saved_draft_round_trips(target, tmp_path, weights, tol):
    draft = build_draft(target, 2, [0, 2])
    with torch.no_grad():
        for p in draft.hf.model.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))  # differ from the target layers they started from
    path = save_draft(draft, tmp_path / "d", weights=weights, metadata={"training": {"note": "test"}})
    config = read_draft_config(path)
    assert config["num_layers"] == 2 and config["init_layers"] == [0, 2] and config["weights"] == weights
    assert config["training"] == {"note": "test"}
    assert config["target"]["vocab_size"] == 48
    loaded = load_draft(target, path)
    ids = torch.randint(2, 48, (2, 9))
    with torch.no_grad():
        a, b = draft.hf(ids).logits, loaded.hf(ids).logits
    assert float((a - b).norm() / a.norm()) <= tol + 1e-6
    assert loaded.hf.get_output_embeddings() is target.hf.get_output_embeddings()  # shared, not saved
    saved = sum(f.stat().st_size for f in path.iterdir())
    assert saved < 4 * sum(p.numel() for p in draft.hf.model.layers.parameters()) + 20_000

    # the loaded draft drives SMC-SD
    out = SMC(LM(target, 0.7), Draft(loaded, 0.7), particles=3, block_size=2).run_groups([5, 6, 7], 1, 6, seed=0)
    assert out.tokens.shape == (1, 3, 6) and out.rounds >= 1


def test_vocab_mismatch_is_a_clear_error(target, tmp_path):
    path = save_draft(build_draft(target, 1), tmp_path / "d")
    other = tiny_target(vocab=64, seed=0)
    with pytest.raises(SMCDecodeError, match=r"draft .* vocabulary \(48\) differs from target vocabulary \(64\)"):
        load_draft(other, path)
    same_vocab = tiny_target(vocab=48, seed=7)  # same sizes, different weights
    with pytest.raises(SMCDecodeError, match="distilled from a different target"):
        load_draft(same_vocab, path)
    with pytest.raises(SMCDecodeError, match="no shipped draft fits"):
        load_default_draft(other)
    with pytest.raises(SMCDecodeError, match="no draft at"):
        load_draft(target, tmp_path / "missing")


def test_draft_config_errors(target, tmp_path):
    with pytest.raises(SMCDecodeError, match="num_layers must be"):
        build_draft(target, 3)
    with pytest.raises(SMCDecodeError, match="init_layers must list"):
        build_draft(target, 2, [0, 5])
    (tmp_path / "draft.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(SMCDecodeError, match="not a smcdecode draft"):
        load_draft(target, tmp_path)


def test_load_prompts_reads_the_eval_formats(tmp_path):
    (tmp_path / "share.json").write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "Hello?"}, {"from": "gpt", "value": "Hi"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
    ]))
    (tmp_path / "alpaca.json").write_text(json.dumps([{"instruction": "Sum 2 and 3.", "input": ""}, "plain", "Hello?"]))
    (tmp_path / "spec.jsonl").write_text(json.dumps({"turns": ["First turn", "second"]}) + "\n")
    prompts = load_prompts([tmp_path / "share.json", tmp_path / "alpaca.json", tmp_path / "spec.jsonl"])
    assert prompts == ["Hello?", "Sum 2 and 3.", "plain", "First turn"]
    import gzip

    from smcdecode.distill import SCHEMA_PROMPT

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    (tmp_path / "schemas.jsonl").write_text(json.dumps({"id": "s", "schema": schema}) + "\n")
    (tmp_path / "code.jsonl.gz").write_bytes(gzip.compress(
        (json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n    "}) + "\n").encode()))
    prompts = load_prompts([tmp_path / "schemas.jsonl", tmp_path / "code.jsonl.gz"])
    assert prompts == [SCHEMA_PROMPT + json.dumps(schema), "def f(x):"]  # (prompts are stripped)
    assert json.loads(prompts[0].removeprefix(SCHEMA_PROMPT)) == schema
    train, held = split_prompts(list(range(10)), 3, seed=0)
    assert len(held) == 3 and sorted(train + held) == list(range(10))
    assert split_prompts(list(range(10)), 3, seed=0) == (train, held)


def test_command_reports_bad_input(tmp_path, capsys):
    assert main(["--prompts", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["--prompts", "x.json", "--out", str(tmp_path / "o"), "--layers", "0"]) == 2
    assert "layers must be a positive integer" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_distill_on_cuda(tmp_path):
    target = tiny_target(tokenizer=True)
    target.hf.to("cuda")
    prompts = word_prompts(24, stride=5, spread=3)
    config = DistillConfig(layers=1, samples_per_prompt=2, max_new_tokens=10, holdout=4, steps=60, batch_size=8,
                           lr=1e-2, warmup_steps=1)
    report = distill(target, prompts, tmp_path, config, progress=False, log=lambda s: None)
    history = report["history"]
    assert history[-1]["kl"] < history[0]["kl"]
    draft = load_draft(target, tmp_path)
    assert draft.device.type == "cuda"
    result = SMC(LM(target, 0.7), Draft(draft, 0.7), particles=4, block_size=3).run("w1 w2", 9, seed=0, progress=False)
    assert isinstance(result.text, str)


def test_validation_keeps_the_draft_with_the_lowest_validation_kl(tmp_path):
    target = tiny_target(tokenizer=True)
    prompts = word_prompts(30, stride=3, spread=4)
    config = DistillConfig(layers=1, samples_per_prompt=1, max_new_tokens=8, holdout=4, steps=30, batch_size=4,
                           lr=5e-2, warmup_steps=1, eval_every=5, validation_prompts=5, weights="float32")
    logs: list[str] = []
    report = distill(target, prompts, tmp_path, config, progress=False, log=logs.append)
    checks = [h for h in report["history"] if "validation_kl" in h]
    assert [h["step"] for h in checks] == [5, 10, 15, 20, 25, 30]
    kept = report["training"]["kept"]
    best = min(checks, key=lambda h: h["validation_kl"])
    assert kept == {"step": best["step"], "validation_kl": best["validation_kl"]}
    corpus = torch.load(tmp_path / "corpus.pt", weights_only=True)
    assert len(corpus["validation"]) == 5 and len(corpus["train"]) == 30 - 4 - 5
    again = evaluate_draft(target, load_draft(target, tmp_path), corpus["validation"])
    assert again["kl"] == pytest.approx(best["validation_kl"], rel=1e-4)


def test_corpus_throughput_benchmark_runs_on_cpu(tmp_path):
    """benchmarks/corpus_throughput.py --tiny: both generators on the same prompts, a JSON report."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "corpus_throughput.py"
    spec = importlib.util.spec_from_file_location("corpus_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "ct.json"
    assert bench.main(["--tiny", "--num-prompts", "6", "--samples", "3", "--max-new-tokens", "5", "--batch-size", "8",
                       "--repeats", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["generators"]) == {"engine", "hf"} and report["device"] == "cpu"
    for g in report["generators"].values():
        assert g["first_call"]["sequences"] == 18 and g["median"]["sequences_per_s"] > 0


def test_on_policy_corpus_takes_a_share_of_the_answers_from_the_draft(tmp_path):
    """on_policy = 0.5 with 4 samples a prompt: 2 answers per training prompt from the target and 2
    from the draft being trained — exactly the draft's own samples (the same call on the built draft
    reproduces them), the held-out answers still the target's; a corpus made with another share is
    not silently reused; a share outside [0, 1] is refused."""
    target = tiny_target(tokenizer=True)
    prompts = word_prompts(14, stride=5, spread=3)
    config = DistillConfig(layers=1, samples_per_prompt=4, max_new_tokens=6, holdout=4, steps=2, batch_size=4,
                           lr=1e-2, warmup_steps=1, on_policy=0.5, weights="float32")
    logs: list[str] = []
    report = distill(target, prompts, tmp_path, config, progress=False, log=logs.append)
    corpus = torch.load(tmp_path / "corpus.pt", weights_only=True)
    assert report["training"]["draft_sequences"] == corpus["draft_sequences"] == 10 * 2  # 10 training prompts
    assert len(corpus["train"]) == 10 * 4 and corpus["on_policy"] == 0.5
    assert any("sampled by the draft" in line for line in logs)

    from smcdecode.distill import chat_prompts, generate_corpus, split_prompts

    train_p, held_p = split_prompts(chat_prompts(target, prompts, config.max_prompt_tokens), 4, config.seed)
    draft0 = build_draft(target, 1)  # the draft before training (build_draft is deterministic)
    ids = [i for _, i in train_p]
    mine = generate_corpus(draft0, ids, samples=2, max_new_tokens=6, temperature=0.7, seed=config.seed + 3,
                           progress=False, log=lambda s: None)
    theirs = generate_corpus(target, ids, samples=2, max_new_tokens=6, temperature=0.7, seed=config.seed,
                             progress=False, log=lambda s: None)
    assert corpus["train"] == theirs + mine and mine != theirs
    held = generate_corpus(target, [i for _, i in held_p], samples=1, max_new_tokens=6, temperature=0.7,
                           seed=config.seed + 1, progress=False, log=lambda s: None)
    assert corpus["heldout"] == held

    config.on_policy = 0.0
    with pytest.raises(SMCDecodeError, match="was made with on_policy=0.5"):
        distill(target, prompts, tmp_path, config, progress=False, log=logs.append)
    config.on_policy = 1.5
    with pytest.raises(SMCDecodeError, match=r"on_policy must be a fraction in \[0, 1\]"):
        config.check()


def test_evaluate_draft_at_another_proposal_temperature(target, corpus):
    """q at T' against p at T: the target as its own draft accepts 1 at T' = T and exactly
    mean Σ min(p_T, p_T') at T' ≠ T (computed here from the logits), and T' must be > 0."""
    from smcdecode.distill.evaluation import response_batch, response_logits

    seqs = corpus[:6]
    same = evaluate_draft(target, target, seqs, temperature=0.7, draft_temperature=0.7)
    assert same["acceptance"] == pytest.approx(1.0, abs=1e-6) and "draft_temperature" not in same
    ids, pos = response_batch(seqs, target.device)
    with torch.no_grad():
        z = response_logits(target.hf, ids, pos).float()
    expect = torch.minimum(torch.softmax(z / 0.7, -1), torch.softmax(z / 0.5, -1)).sum(-1).mean()
    other = evaluate_draft(target, target, seqs, temperature=0.7, draft_temperature=0.5)
    assert other["draft_temperature"] == 0.5 and other["acceptance"] == pytest.approx(float(expect), abs=1e-5)
    assert other["acceptance"] < 0.99 and other["kl"] > 1e-4
    with pytest.raises(SMCDecodeError, match="draft_temperature must be a finite number > 0"):
        evaluate_draft(target, target, seqs, temperature=0.7, draft_temperature=0.0)


def test_proposal_temperature_defaults_to_the_targets_for_a_draft_without_a_scale(target, tmp_path):
    from smcdecode.drafts import proposal_temperature

    draft = build_draft(target, 1)
    assert proposal_temperature(draft, 0.8) == 0.8
    save_draft(draft, tmp_path, weights="float32")
    cfg = json.loads((tmp_path / "draft.json").read_text())
    cfg["proposal_temperature_scale"] = 0.5
    (tmp_path / "draft.json").write_text(json.dumps(cfg))
    assert proposal_temperature(load_draft(target, tmp_path), 0.8) == pytest.approx(0.4)
    import argparse

    from smcdecode.cli import _draft

    proposal = _draft(str(tmp_path), target, argparse.Namespace(draft_temperature=None, temperature=0.8, device="cpu"))
    assert proposal.temperature == pytest.approx(0.4) and proposal.model.name.endswith("distilled1")  # a draft dir
    cfg["proposal_temperature_scale"] = -1
    (tmp_path / "draft.json").write_text(json.dumps(cfg))
    with pytest.raises(SMCDecodeError, match="proposal_temperature_scale"):
        proposal_temperature(load_draft(target, tmp_path), 0.8)


def test_self_prompts_are_the_targets_own_user_turns_and_only_train(tmp_path):
    """self_prompts = n: the target samples n user turns of its chat template (from the template's
    text before the user's message); the complete, distinct ones join the training prompts (each
    with its answers), never the held-out or validation sets; a model without a chat template is a
    clear error."""
    from smcdecode.distill import self_prompts, user_turn_prefix

    target = tiny_target(tokenizer=True)
    target.tokenizer.chat_template = ("{% for m in messages %}<s> w5 {{ m['content'] }} </s> {% endfor %}"
                                      "{% if add_generation_prompt %}<s> w6 {% endif %}")
    assert user_turn_prefix(target) == target.encode("<s> w5") == [0, 7]
    logs: list[str] = []
    written = self_prompts(target, 40, max_new_tokens=8, seed=4, progress=False, log=logs.append)
    gens = generate_corpus(target, [[0, 7]], samples=40, max_new_tokens=8, temperature=1.0, seed=4, progress=False)
    complete = [target.decode(r[:-1]).strip() for _, r in gens if r[-1] == target.eos_token_id]
    assert written == list(dict.fromkeys(t for t in complete if t)) and 0 < len(written) < 40
    assert any("distinct user messages" in line for line in logs)

    prompts = word_prompts(14, stride=5, spread=3)
    config = DistillConfig(layers=1, samples_per_prompt=2, max_new_tokens=6, holdout=4, steps=2, batch_size=4,
                           lr=1e-2, warmup_steps=1, self_prompts=40, weights="float32", max_prompt_tokens=40)
    report = distill(target, prompts, tmp_path, config, progress=False, log=lambda s: None)
    corpus = torch.load(tmp_path / "corpus.pt", weights_only=True)
    mine = self_prompts(target, 40, seed=config.seed + 4, progress=False, log=lambda s: None)
    assert corpus["self_prompts"] == mine and report["training"]["self_prompts"] == len(mine)
    held_ids = {tuple(p) for p, _ in corpus["heldout"]}
    self_ids = {tuple(ids) for t in mine if len(ids := target.chat([{"role": "user", "content": t}])) <= 40}
    train_ids = {tuple(p) for p, _ in corpus["train"]}
    fresh = self_ids - {tuple(target.chat([{"role": "user", "content": t}])) for t in prompts}
    assert fresh and fresh <= train_ids and not fresh & held_ids
    assert len(corpus["train"]) == 2 * (10 + len(fresh))  # 10 training prompts + the new written ones

    with pytest.raises(SMCDecodeError, match="has no chat template"):
        user_turn_prefix(tiny_target(tokenizer=True))
    with pytest.raises(SMCDecodeError, match="self_prompts must be a count"):
        DistillConfig(self_prompts=-1).check()


def test_toward_target_proposal_of_the_fidelity_study():
    """benchmarks/draft_fidelity.py --toward-target λ: q_λ ∝ p_T^λ q_T'^(1-λ). λ = 0 is the draft
    itself (the same run, token for token); λ = 1 is the target (every weight equal, ESS = N, the
    per-token acceptance 1 and KL 0); in between, the acceptance lies between the two."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "draft_fidelity.py"
    spec = importlib.util.spec_from_file_location("draft_fidelity", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    target = tiny_target(tokenizer=True)
    draft = build_draft(target, 1)
    lm = LM(target, 0.7)

    def run(proposal):
        return SMC(lm, Draft(proposal, 0.5), particles=4, block_size=3).run("w3 w4 w5", 9, seed=2, progress=False)

    plain = run(draft)
    stats = {}
    for lam in (0.0, 0.5, 1.0):
        model = bench.TowardTarget(draft, target, lam, 0.7, 0.5)
        res = run(model)
        s = model.take_stats()
        stats[lam] = (res, s["own_acceptance_sum"] / s["own_positions"], s["own_kl_sum"] / s["own_positions"])
    res0 = stats[0.0][0]
    assert res0.sample_tokens == plain.sample_tokens
    assert res0.ess == pytest.approx(plain.ess, rel=1e-5)
    res1, acc1, kl1 = stats[1.0]
    assert res1.ess == pytest.approx([4.0] * len(res1.ess), rel=1e-9) and res1.resample_rate == 0
    assert acc1 == pytest.approx(1.0, abs=1e-9) and kl1 == pytest.approx(0.0, abs=1e-9)
    assert stats[0.0][1] < stats[0.5][1] < 1.0 and stats[0.0][2] > stats[0.5][2] > 0
