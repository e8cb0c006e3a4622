"""Toy language models and hypothesis strategies for the statistical tests.

A toy LM is a random logits table whose row is picked by a hash of the *whole* context (every
token and the length), so its next-token distribution depends on all of the history: a sampler
that forgets to reorder a runner's history after resampling, or feeds a token twice, changes the
distribution it samples and fails the exact tests. Everything is seeded; hypothesis runs
derandomised, so the suite is deterministic.
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import smcdecode as sd

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels can only run in Triton's interpreter (test_engine_ops.py), and
    # triton.jit reads this when it decorates them: set it before any test module imports them, so the
    # order of the test modules does not matter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the CI machines have 2 cores shared by several jobs; the tensors here are tiny
torch.set_num_threads(1)

@pytest.fixture(scope="session")
def model():
    """The default model (SmolLM2-135M-Instruct), loaded once for the tests that take it (a test
    module may define its own ``model``)."""
    return sd.load_model()


PROMPT = [0]  # the "<bos>" token
LETTERS = ["a", "b", "c", "d"]
REGEX_VOCAB = ["<bos>", "a", "b", "ab", "<eos>"]  # "ab" and "a"·"b" spell the same text
PATTERNS = [r"a+b?", r"(ab|b)*a", r"[ab]{2,3}", r"b*", r"(a|b)b(a|b)*"]
TABLE_ROWS = 251  # a prime: hash buckets of the context


def statistical_settings(max_examples: int) -> settings:
    """Few, fixed examples: every test is deterministic and its false-alarm rate is designed to be
    far below 1/1000 per example."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )


class HashedTableLM:
    """``fn(contexts [B, T]) -> logits [B, V]``: row ``hash(context) mod 251`` of a random table;
    with ``markov=True`` the row is the last token (a bigram model that ignores the rest)."""

    def __init__(self, table: torch.Tensor, markov: bool = False):
        self.table = table  # [TABLE_ROWS, V] float32
        self.markov = markov
        gen = torch.Generator().manual_seed(12345)
        self.coef = torch.randint(1, 2**31 - 1, (64,), generator=gen)

    def __call__(self, contexts: torch.Tensor) -> torch.Tensor:
        # contexts: [B, T]
        T = contexts.shape[1]
        if self.markov:
            return self.table[contexts[:, -1] % self.table.shape[0]]
        h = ((contexts * self.coef[:T]).sum(1) + 7919 * T) % self.table.shape[0]
        return self.table[h]


def toy_table(seed: int, vocab_size: int, scale: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return scale * torch.randn(TABLE_ROWS, vocab_size, generator=gen)


def toy_model(table: torch.Tensor, vocab: list[str], markov: bool = False, name: str = "toy",
              max_context: int | None = None) -> sd.FunctionModel:
    return sd.FunctionModel(HashedTableLM(table, markov), vocab=vocab, eos="<eos>", name=name, max_context=max_context)


@dataclass
class Toy:
    """A target LM and a draft LM over one small vocabulary, with sampling settings."""

    model: sd.FunctionModel
    draft: sd.FunctionModel
    vocab: list[str]
    max_new_tokens: int
    temperature: float
    alpha: float
    draft_factor: float
    prompt: list[int]
    description: str = ""  # how the tables were drawn, for failure reports

    def __repr__(self) -> str:
        return (
            f"Toy(vocab={self.vocab}, prompt={self.prompt}, max_new_tokens={self.max_new_tokens}, T={self.temperature}, "
            f"alpha={self.alpha}, draft T factor={self.draft_factor}, {self.description})"
        )

    def lm(self) -> sd.LM:
        """The target's LM potential p_T^α."""
        return sd.LM(self.model, temperature=self.temperature) ** self.alpha

    def proposal(self) -> sd.Draft:
        """The draft at temperature factor·T/min(α, 1): never sharper than the local target
        p_T^α ∝ p_{T/α} (a proposal with lighter tails than the target gives heavy-tailed weights)."""
        return sd.Draft(self.draft, self.draft_factor * self.temperature / min(self.alpha, 1.0))


@st.composite
def toys(draw, vocab=None, max_new_tokens=(3, 4), alphas=(1.0,), drafts=("noisy", "bigram"), noise=(0.3, 0.7)) -> Toy:
    """A random target/draft pair. The draft is the target's table plus Gaussian noise of scale
    ``noise`` (a close draft), or a bigram table that ignores all but the last token (a poor draft).
    Poor drafts have heavy-tailed importance weights: fine for tests of E[Ẑ] (a mean over every
    sequence), too noisy for per-sequence tests, which use drafts with noise ≤ 0.4: some sequence
    of probability 0.01 proposed 50 times less often than π would want is visited too rarely for
    a z-test over a few thousand replicates.

    The logits' scale is kept below 2·T/α so the target is never nearly deterministic: a sequence
    of probability 1e-5 that no replicate visits would carry more of E[Ẑ] than rounding allows."""
    if vocab is None:
        n_letters = draw(st.integers(1, 3))
        vocab = ["<bos>", *LETTERS[:n_letters], "<eos>"]
    V = len(vocab)
    alpha = draw(st.sampled_from(list(alphas)))
    temperature = draw(st.sampled_from([0.8, 1.0, 1.25]))
    scale = draw(st.sampled_from([s for s in (0.5, 1.0, 1.5) if s <= 2 * temperature / alpha]))
    seed = draw(st.integers(0, 2**31 - 1))
    table = toy_table(seed, V, scale)
    kind = draw(st.sampled_from(list(drafts)))
    if kind == "noisy":
        sigma = draw(st.sampled_from(list(noise)))
        draft = toy_model(table + sigma * toy_table(seed + 1, V, 1.0), vocab, name="toy-draft")
        description = f"table seed {seed} scale {scale}, draft = table + {sigma}·noise"
    else:
        draft = toy_model(toy_table(seed + 2, V, 0.5), vocab, markov=True, name="toy-bigram-draft")
        description = f"table seed {seed} scale {scale}, bigram draft"
    return Toy(
        model=toy_model(table, vocab),
        draft=draft,
        vocab=vocab,
        max_new_tokens=draw(st.sampled_from(list(max_new_tokens))),
        temperature=temperature,
        alpha=alpha,
        draft_factor=draw(st.sampled_from([1.0, 1.25])),
        prompt=draw(st.sampled_from([PROMPT, [0, 1], [0, 1, 0, 1]])),  # the runners prefill prompt[:-1]
        description=description,
    )


# -- rewards: deterministic text functions (no Python hash(): it is salted per process) ----------


def reward_count(text: str) -> float:
    return text.count("a") - 0.5 * text.count("b")


def reward_crc(text: str) -> float:
    """An arbitrary, non-monotone score in [-1, 1) with R("") ≠ 0."""
    return (zlib.crc32(text.encode()) % 1000) / 500.0 - 1.0 + 0.3


def reward_length(text: str) -> float:
    return math.sin(1.7 * len(text)) + 0.5


REWARDS = [reward_count, reward_crc, reward_length]


@pytest.fixture
def toy_lm_model() -> sd.FunctionModel:
    """One fixed 5-token toy model (for tests that need no hypothesis)."""
    return toy_model(toy_table(7, 5, 1.0), ["<bos>", "a", "b", "c", "<eos>"])


# ------------------------------------------------------------------------------------------------
# A tiny random Llama pair (target, draft) with a word-level tokenizer, for the engine tests

ENGINE_VOCAB = ["<bos>", "a", "b", "ab", "ba", "c", "bb", "<eos>"]
CUDA_PARAM = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


def engine_tokenizer(vocab: list[str] = ENGINE_VOCAB):
    """A word-level tokenizer over ``vocab`` whose decoded token texts join without spaces."""
    import tokenizers
    import transformers

    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=vocab[0]))
    tk.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=vocab[0], eos_token=vocab[-1])


def tiny_llama_pair(device: str, head_std: float, value_scale: float = 1.0, vocab: list[str] = ENGINE_VOCAB):
    """(target, draft) HFModels on ``device``: a 2-layer random Llama (seed 0) with an LM head of
    std ``head_std`` and attention value/output projections scaled by ``value_scale``, and a copy
    whose head is perturbed by N(0, 0.03²) noise (seed 1). The same weights on every device."""
    import copy

    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.normal_(0.0, head_std)
        if value_scale != 1.0:
            for layer in hf.model.layers:
                layer.self_attn.v_proj.weight.mul_(value_scale)
                layer.self_attn.o_proj.weight.mul_(value_scale)
    draft_hf = copy.deepcopy(hf)
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        draft_hf.lm_head.weight.add_(torch.randn(draft_hf.lm_head.weight.shape, generator=g) * 0.03)
    tok = engine_tokenizer(vocab)
    return sd.HFModel(hf.to(device), tok, name="tiny"), sd.HFModel(draft_hf.to(device), tok, name="tiny-draft")


def llama3_scaled_hf():
    """A random 2-layer HF Llama (seed 0, vocabulary 97, GQA 4/2 heads) with Llama-3 rope scaling
    whose original context (16) is short enough that the tests' positions cross it."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16},
        rope_theta=10000.0,
    )
    return transformers.LlamaForCausalLM(cfg).eval()
