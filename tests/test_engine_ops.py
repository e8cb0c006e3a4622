"""The torch references of the engine's fused kernels (CPU): add + RMSNorm, RoPE + KV-page write,
sample-and-score. The Triton kernels are tested against these in test_engine_kernels.py (GPU)."""

import math

import torch

from smcdecode.backends.engine.engine import sample_and_score_reference
from smcdecode.backends.engine.model import (
    LlamaConfig,
    add_rms_norm_reference,
    rope_inv_freq,
    rope_kv_write_reference,
)


def test_add_rms_norm_reference_is_the_norm_of_the_sum():
    g = torch.Generator().manual_seed(0)
    x, d, w = torch.randn(5, 3, 24, generator=g), torch.randn(5, 3, 24, generator=g), torch.randn(24, generator=g)
    h, y = add_rms_norm_reference(x, d, w, 1e-6)
    s = (x + d).double()
    want = w.double() * s / torch.sqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(h, x + d)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-6)
    h0, y0 = add_rms_norm_reference(x, None, w, 1e-6)
    assert h0 is x and y0.shape == x.shape


def test_rope_kv_write_reference_rotates_and_writes_slots():
    cfg = LlamaConfig(vocab_size=10, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8, rope_theta=100.0)
    H, Hkv, D, PS = 4, 2, 8, 4
    g = torch.Generator().manual_seed(1)
    B, L = 2, 3
    qkv = torch.randn(B, L, (H + 2 * Hkv) * D, generator=g, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2], [5, 6, 7]])
    freqs = torch.arange(16, dtype=torch.float64)[:, None] * rope_inv_freq(cfg).double()
    cos, sin = freqs.cos(), freqs.sin()
    k_pool = torch.full((6, Hkv, PS, D), float("nan"), dtype=torch.float64)
    v_pool = k_pool.clone()
    pages = torch.tensor([1, 1, 1, 3, 4, 4])
    offsets = torch.tensor([0, 1, 2, 1, 0, 3])
    q = rope_kv_write_reference(qkv, positions, cos, sin, k_pool, v_pool, pages, offsets, H, Hkv)

    def rotate(x, pos):  # complex-number form of rotate-half RoPE: (x1 + i x2) · e^{i θ pos}
        z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * torch.exp(1j * freqs[pos].to(torch.complex128))
        return torch.cat([z.real, z.imag], -1)

    qh = qkv[..., : H * D].reshape(B, L, H, D)
    kh = qkv[..., H * D : (H + Hkv) * D].reshape(B, L, Hkv, D)
    vh = qkv[..., (H + Hkv) * D :].reshape(B, L, Hkv, D)
    for b in range(B):
        for t in range(L):
            pos = int(positions[b, t])
            torch.testing.assert_close(q[b, t], rotate(qh[b, t], pos))
            slot = b * L + t
            torch.testing.assert_close(k_pool[pages[slot], :, offsets[slot]], rotate(kh[b, t], pos))
            torch.testing.assert_close(v_pool[pages[slot], :, offsets[slot]], vh[b, t])
    assert int(torch.isnan(k_pool).any(-1).sum()) == (6 * PS - 6) * Hkv  # nothing else written


def test_sample_and_score_reference_scores_exactly_and_samples_the_softmax():
    g = torch.Generator().manual_seed(2)
    V, R, T = 6, 40000, 0.7
    base = torch.randn(V, generator=g) * 2
    logits = base.repeat(R, 1)
    gather = torch.randint(0, V, (R,), generator=g)
    tok, lp_tok, lp_gather = sample_and_score_reference(logits, T, gather, generator=g)
    logp = torch.log_softmax(base / T, -1)
    torch.testing.assert_close(lp_tok, logp[tok])
    torch.testing.assert_close(lp_gather, logp[gather])
    counts = torch.bincount(tok, minlength=V).double()
    expected = R * logp.double().exp()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, chi2  # 5 degrees of freedom: P(chi2 > 25) ≈ 1e-4
    assert math.isclose(float(counts.sum()), R)
