"""The torch references of the engine's fused kernels (CPU): add + RMSNorm, RoPE + KV-page write,
sample-and-score. The Triton kernels are tested against these in test_engine_kernels.py (GPU)."""

import math

import pytest
import torch

from smcdecode.backends.engine.model import LlamaConfig, rope_inv_freq
from smcdecode.backends.engine.ops import add_rms_norm_reference, rope_kv_write_reference
from smcdecode.samplers.steps import sample_and_score


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


def test_torch_sample_and_score_scores_exactly_and_samples_the_softmax():
    g = torch.Generator().manual_seed(2)
    V, R, T = 6, 40000, 0.7
    base = torch.randn(V, generator=g) * 2
    logits = base.repeat(R, 1)
    gather = torch.randint(0, V, (R,), generator=g)
    tok, lp_tok, _, lp_gather = sample_and_score(logits, T, gather=gather, generator=g)
    logp = torch.log_softmax(base / T, -1)
    torch.testing.assert_close(lp_tok, logp[tok])
    torch.testing.assert_close(lp_gather, logp[gather])
    counts = torch.bincount(tok, minlength=V).double()
    expected = R * logp.double().exp()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, chi2  # 5 degrees of freedom: P(chi2 > 25) ≈ 1e-4
    assert math.isclose(float(counts.sum()), R)


# ------------------------------------------------------------------------------------------------
# The Triton kernels themselves on the CPU, in Triton's interpreter (TRITON_INTERPRET=1; skipped where
# triton is not installed). The same kernels run compiled in test_engine_kernels.py (GPU).

def _interpreted_kernels():
    import os

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the compiled kernels are tested in test_engine_kernels.py")
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported and the kernels decorated
    pytest.importorskip("triton")
    from smcdecode.backends.engine import kernels

    return kernels


def _rope_tables(H: int, Hkv: int, D: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos/sin tables [64, D/2] of a small config (theta 100: fast rotations)."""
    cfg = LlamaConfig(vocab_size=10, dim=H * D, n_layers=1, n_heads=H, n_kv_heads=Hkv, intermediate_size=8,
                      rope_theta=100.0)
    freqs = torch.arange(64, dtype=torch.float64)[:, None] * rope_inv_freq(cfg).double()
    return freqs.cos().float(), freqs.sin().float()


def _paged_case(seed, B, L, H, Hkv, D, PS, P, lengths, dtype=torch.float32):
    from smcdecode.backends.engine.attention import PagedBatch

    g = torch.Generator().manual_seed(seed)
    num_pages = B * P + 1
    pools = [torch.randn(num_pages, Hkv, PS, D, generator=g, dtype=dtype) for _ in range(2)]
    pt = (torch.randperm(num_pages - 1, generator=g)[: B * P].view(B, P) + 1).to(torch.int32)
    seq = torch.tensor(lengths)
    positions = seq[:, None] - L + torch.arange(L)
    return pools, pt, PagedBatch.build(positions, pt, PS), g


def test_interpreted_paged_attention_and_merges_match_reference():
    """The default launch and launches with more KV splits (their partials merged by the last split
    to finish), one and two query tiles."""
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine.attention import reference_paged_attention

    for L, H, Hkv, D, lengths, per_sm in [(1, 4, 2, 32, [1, 37, 20], 4.0), (3, 8, 2, 16, [3, 30, 11], 1.0),
                                          (20, 4, 2, 32, [20, 29], 1.0)]:  # (20·2 rows: two query tiles)
        (kp, vp), pt, batch, g = _paged_case(L, len(lengths), L, H, Hkv, D, 4, 10, lengths)
        q = torch.randn(len(lengths), L, H, D, generator=g)
        ref = reference_paged_attention(q.double(), kp.double(), vp.double(), batch)
        for config in (None, (64, 4, 2, per_sm, 0)):
            out = kernels.triton_paged_attention(q, kp, vp, batch, config=config)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err < 1e-5, (L, config, err)
        assert int(kernels.common.split_counters(q.device, 1).abs().sum()) == 0  # every counter reset


def test_interpreted_rope_paged_attention_matches_rope_write_then_attention():
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine.attention import reference_paged_attention

    H, Hkv, D, PS = 8, 2, 32, 4
    cos, sin = _rope_tables(H, Hkv, D)
    for L, lengths, per_sm in [(1, [1, 9, 40], 4.0), (2, [2, 18, 33], 2.0), (9, [9, 26, 40], 1.0)]:
        (kp, vp), pt, batch, g = _paged_case(10 + L, len(lengths), L, H, Hkv, D, PS, 10, lengths)
        qkv = torch.randn(len(lengths), L, (H + 2 * Hkv) * D, generator=g)
        kp_ref, vp_ref = kp.clone(), vp.clone()
        q_ref = rope_kv_write_reference(qkv, batch.positions, cos, sin, kp_ref, vp_ref, batch.slot_pages,
                                        batch.slot_offsets, H, Hkv)
        ref = reference_paged_attention(q_ref.double(), kp_ref.double(), vp_ref.double(), batch)
        # the default launch, more splits, and one split of 16-key blocks with the page ids loaded a block ahead
        for config in (None, (64, 4, 2, per_sm, 0), (16, 4, 2, 0.01, 1)):
            k_out, v_out = kp.clone(), vp.clone()
            out = kernels.triton_rope_paged_attention(qkv, cos, sin, k_out, v_out, batch, H, config=config)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err < 1e-5, (L, config, err)
            torch.testing.assert_close(k_out, kp_ref)  # the same slots written with the same keys, nothing else
            torch.testing.assert_close(v_out, vp_ref)


def test_interpreted_merge_kernel_matches_reference():
    kernels = _interpreted_kernels()
    for B, L, H, Hkv, S in [(2, 9, 8, 2, 3), (2, 1, 4, 4, 2), (1, 20, 4, 2, 2)]:
        g = torch.Generator().manual_seed(B * 7 + S)
        G, D = H // Hkv, 16
        block_m = max(16, min(64, 1 << (L * G - 1).bit_length()))
        mt = -(-L * G // block_m)
        o_part = torch.randn(B * Hkv * mt, S, block_m, D, generator=g)
        lse = torch.randn(B * Hkv * mt, S, block_m, generator=g) * 3
        lse[:, S // 2 + 1 :] = float("-inf")  # splits with no keys for the row
        out = torch.full((B, L, H, D), float("nan"))
        kernels.attention._merge_splits_kernel[(B * Hkv * L * G,)](o_part, lse, out, L=L, G=G, H=H, HKV=Hkv, D=D, NSPLIT=S,
                                                         NSPLIT_P2=max(2, 1 << (S - 1).bit_length()),
                                                         BLOCK_M=block_m)
        ref = kernels.merge_splits_reference(o_part.double(), lse.double(), B, L, H, Hkv, torch.float64)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_interpreted_skinny_linear_matches_torch():
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine.ops import silu_mul

    g = torch.Generator().manual_seed(5)
    for M, N, K, cfg in [(3, 40, 48, (16, 16, 16, 4, 2)), (17, 16, 64, (16, 16, 32, 4, 2)), (8, 24, 40, None),
                         (70, 80, 96, (64, 64, 64, 4, 2)), (100, 72, 64, (128, 64, 64, 8, 2))]:  # 2 tiles; 1 of 128
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)
        torch.testing.assert_close(kernels.triton_skinny_linear(x, w, config=cfg), x @ w.T, rtol=1e-4, atol=1e-4)
        w2 = torch.randn(2 * N, K, generator=g)
        torch.testing.assert_close(kernels.triton_skinny_linear(x, w2, silu=True, config=cfg), silu_mul(x @ w2.T),
                                   rtol=1e-4, atol=1e-4)


def _copy_case(shape, seed):
    """A pool [layers, 2, pages, Hkv, PS, D] of random values and copy lists with skipped entries
    (dst 0, and dst == src) among real copies (distinct destinations, none of them a source)."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(*shape, generator=g)
    src = torch.tensor([3, 0, 5, 7, 2, 9], dtype=torch.long)
    dst = torch.tensor([8, 0, 0, 7, 4, 1], dtype=torch.long)  # entries 1-3 copy nothing
    expect = kv.clone()
    for s_, d_ in [(3, 8), (2, 4), (9, 1)]:
        expect[:, :, d_] = kv[:, :, s_]
    return kv, src, dst, expect


def test_interpreted_copy_pages_matches_the_reference():
    """The copy-on-write kernel copies whole pages of every layer's keys and values, skips entries
    whose destination is the null page or their own source, and agrees with the torch reference
    (KVPool.copy_pages off CUDA), for a page smaller and one larger than the kernel's block."""
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine import KVPool

    for shape, seed in [((3, 2, 10, 2, 4, 8), 0), ((2, 2, 10, 4, 16, 128), 1)]:
        kv, src, dst, expect = _copy_case(shape, seed)
        pool = KVPool(shape[0], shape[3], shape[5], shape[2], shape[4], torch.float32, "cpu")
        pool.kv.copy_(kv)
        pool.copy_pages(src, dst)  # the reference
        assert torch.equal(pool.kv, expect)
        kernels.triton_copy_pages(kv, src, dst)
        assert torch.equal(kv, expect)
    with pytest.raises(ValueError, match="src .* and dst .*: give two 1-D tensors of one length"):
        kernels.triton_copy_pages(kv, src, dst[:2])


def test_interpreted_split_k_partials_sum_to_the_product_and_feed_the_norm():
    """Split-K: the float32 partials [S, M, N] sum to x·wᵀ (K not a multiple of a split: the last one
    masked), and the add + RMSNorm that reads them equals the reference on their total."""
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine.ops import SplitSum, add_rms_norm_reference

    g = torch.Generator().manual_seed(6)
    for M, N, K, cfg, split, S in [(3, 40, 96, (16, 16, 32, 4, 2), 2, 2), (8, 24, 200, (16, 16, 16, 4, 1), 4, 4),
                                   (5, 32, 100, (16, 32, 64, 4, 2), 4, 2), (40, 48, 96, (64, 16, 32, 4, 2), 2, 2),
                                   (72, 32, 64, (128, 16, 32, 4, 2), 2, 2)]:  # (a verify pass's 72 rows)
        x = torch.randn(M, K, generator=g)
        w = torch.randn(N, K, generator=g)
        parts = kernels.triton_skinny_linear(x, w, config=cfg, split=split)
        assert parts.shape == (S, M, N) and parts.dtype == torch.float32  # S: whole K blocks a split
        torch.testing.assert_close(parts.sum(0), x @ w.T, rtol=1e-4, atol=1e-4)
        res, gamma = torch.randn(M, N, generator=g), torch.randn(N, generator=g)
        h, y = kernels.triton_add_rms_norm(res, None, gamma, 1e-5, parts=parts)
        h_ref, y_ref = add_rms_norm_reference(res, SplitSum(parts).total(res.dtype), gamma, 1e-5)
        torch.testing.assert_close(h, h_ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="split"):
        kernels.triton_skinny_linear(x, torch.randn(2 * N, K), silu=True, config=cfg, split=2)


def test_interpreted_add_rms_norm_reads_a_transposed_delta():
    """A delta stored transposed (the view (W·xᵀ)ᵀ of a product cuBLAS ran on the transposed
    problem, ops.linear_to_residual) gives the reference's h and norm: read in 4-row tiles (rows
    not a multiple of 4, a width that is not a power of two), and a slice of it whose rows are not
    adjacent in memory (the last position of each sequence) through a copy."""
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine.ops import add_rms_norm_reference

    g = torch.Generator().manual_seed(11)
    for B, L, dim in [(2, 9, 48), (1, 7, 40), (3, 1, 64)]:
        x = torch.randn(B, L, dim, generator=g)
        W, a = torch.randn(dim, 24, generator=g), torch.randn(B * L, 24, generator=g)
        d = torch.mm(W, a.t()).t().reshape(B, L, dim)  # [B, L, dim], unit stride between rows
        assert d.stride(-1) == B * L and d.reshape(-1, dim).stride(0) == 1
        gamma = torch.randn(dim, generator=g)
        for xs, ds in ((x, d), (x[:, -1:], d[:, -1:])):
            h, y = kernels.triton_add_rms_norm(xs, ds, gamma, 1e-5)
            if xs is x:  # other tiles: 8 and 2 rows a program
                for config in ((8, 4), (2, 4)):
                    h8, y8 = kernels.triton_add_rms_norm(xs, ds, gamma, 1e-5, config=config)
                    torch.testing.assert_close(h8, h, rtol=0, atol=0)
                    torch.testing.assert_close(y8, y, rtol=1e-6, atol=1e-6)
            h_ref, y_ref = add_rms_norm_reference(xs, ds, gamma, 1e-5)
            assert h.shape == y.shape == xs.shape
            torch.testing.assert_close(h, h_ref, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)


def test_transposed_products_are_the_measured_shapes():
    """W·xᵀ for the measured shapes on sm_90 only; the transposed-delta norm's tile is 4 rows on 8
    warps unless a config is given, and a bad config is refused."""
    from smcdecode.backends.engine.ops import TRANSPOSED_SHAPES, transposed_wins

    shape = next(iter(TRANSPOSED_SHAPES))
    assert transposed_wins(*shape, (9, 0)) and not transposed_wins(*shape, (8, 0))
    assert not transposed_wins(8, 4096, 14336, (9, 0))
    kernels = _interpreted_kernels()
    assert kernels.norms.TNORM_CONFIG == (4, 8)
    x = torch.randn(3, 16)
    d = torch.randn(16, 3).t()  # unit stride between rows: the transposed kernel's input
    for bad in ((3, 8), (8,), (8, 3), (8, 4, 512)):
        with pytest.raises(ValueError, match="transposed-norm config"):
            kernels.triton_add_rms_norm(x, d, torch.ones(16), 1e-5, config=bad)


def test_interpreted_folded_norm_kernels_match_references():
    """The folded RMSNorm (ops.Normed): the skinny product's RESID epilogue gives h = resid + x·wᵀ,
    γ ⊙ h and per-column-block Σ h² (unsplit, and split-K added up in order by the last split of each
    column block, whose counters are all reset); its consumers — the skinny SiLU·mul and the
    SiLU·mul kernel — scale the rows by 1/rms as the references do."""
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine.ops import Normed, linear_add_norm_reference, silu_mul

    g = torch.Generator().manual_seed(7)
    for M, N, K, cfg, split in [(3, 40, 96, (16, 16, 32, 4, 2), 1), (8, 24, 200, (16, 16, 16, 4, 1), 4),
                                (5, 32, 100, (16, 32, 64, 4, 2), 3), (40, 48, 96, (32, 16, 32, 4, 2), 2)]:
        x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
        res, gamma = torch.randn(M, N, generator=g), torch.randn(N, generator=g)
        h, gh, ss = kernels.triton_skinny_linear_add_norm(x, w, res, gamma, cfg, split)
        ref = linear_add_norm_reference(x, w, res, gamma, 1e-5)
        assert ss.shape == (M, -(-N // cfg[1])) and ss.dtype == torch.float32
        torch.testing.assert_close(h, ref.h, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(gh, ref.gh, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(ss.sum(1), ref.sumsq[:, 0], rtol=1e-5, atol=1e-3)
        normed = Normed(h, gh, ss, 1e-5)
        torch.testing.assert_close(normed.rstd(), torch.rsqrt(h.pow(2).mean(-1) + 1e-5))
        w13 = torch.randn(2 * 16, N, generator=g)
        want = silu_mul(normed.scale(gh @ w13.T))
        torch.testing.assert_close(kernels.triton_skinny_linear(gh, w13, silu=True, config=(16, 16, 16, 4, 1),
                                                                rowscale=normed.rowscale()), want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kernels.triton_silu_mul((gh @ w13.T).contiguous(), rowscale=normed.rowscale()),
                                   want, rtol=1e-4, atol=1e-4)
    assert int(kernels.common.split_counters(x.device, 1, kind="skinny").abs().sum()) == 0  # every counter reset
    with pytest.raises(ValueError, match="rowscale"):
        kernels.triton_skinny_linear(gh, w13[:16], config=cfg, split=2, rowscale=normed.rowscale())
    with pytest.raises(ValueError, match="sumsq"):
        kernels.triton_silu_mul(gh @ w13.T, rowscale=(ss.double(), 1e-5, N))


def test_interpreted_embed_rms_norm_matches_lookup_then_norm():
    """The embedding lookup with the first RMSNorm in one launch equals the lookup, then the norm."""
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine.ops import add_rms_norm_reference

    g = torch.Generator().manual_seed(8)
    table, w = torch.randn(50, 48, generator=g), torch.randn(48, generator=g)
    tokens = torch.randint(0, 50, (3, 5), generator=g)
    x, y = kernels.triton_embed_rms_norm(tokens, table, w, 1e-5)
    assert x.shape == y.shape == (3, 5, 48)
    torch.testing.assert_close(x, table[tokens], rtol=0, atol=0)
    torch.testing.assert_close(y, add_rms_norm_reference(table[tokens], None, w, 1e-5)[1], rtol=1e-5, atol=1e-5)


def test_norms_fold_where_both_products_split(monkeypatch):
    """The norms after wo and w2 fold where both products run split-K, at most FOLD_MAX_ROWS rows
    (16), only with Triton (off the GPU the torch references run: nothing folds)."""
    from smcdecode.backends.engine import Llama
    from smcdecode.backends.engine import ops as M

    blk = Llama.random(LlamaConfig(64, 128, 1, 4, 2, 96), dtype=torch.float32, device="cpu").layers[0]
    x = torch.zeros(8, 128)
    assert not M.fold_norms(x, blk, triton=False)
    monkeypatch.setattr(M, "split_config", lambda x, w, triton, rows=None: ((16, 16, 32, 4, 1), 2))
    assert M.fold_norms(x, blk, triton=True) and not M.fold_norms(x, blk, triton=False)
    x16 = torch.zeros(16, 128)
    assert M.FOLD_MAX_ROWS == 16 and M.fold_norms(x16, blk, triton=True)
    assert not M.fold_norms(torch.zeros(17, 128), blk, triton=True)
    monkeypatch.setattr(M, "split_config", lambda x, w, triton, rows=None: None)
    assert not M.fold_norms(x, blk, triton=True)  # no split: the norms run on their own


def test_split_k_configs_are_the_measured_shapes():
    """wo and w2 split K at <= 16 rows (the measured shapes as measured, others with K >= 4096 where
    the column blocks alone do not cover the SMs) and at 17-64 rows (the measured shapes only)."""
    kernels = _interpreted_kernels()
    cpu = torch.device("cpu")
    cfg, split = kernels.splitk_config(8, 2048, 8192, cpu)  # the 1B's w2 at the draft's 8 rows
    assert split > 1 and cfg[0] == 16
    assert kernels.splitk_config(8, 2048, 8192, cpu) == ((16, 32, 128, 4, 4), 4)
    assert kernels.splitk_config(64, 2048, 8192, cpu) == ((64, 64, 128, 4, 4), 4)  # the draft of 8 requests
    assert kernels.splitk_config(17, 2048, 8192, cpu) == ((32, 64, 128, 4, 4), 4)
    assert kernels.splitk_config(65, 2048, 8192, cpu) is None  # more rows: cuBLAS
    assert kernels.splitk_config(72, 4096, 4096, cpu) is None  # the 8B's verify pass: measured slower split
    assert kernels.splitk_config(64, 4096, 14336, cpu) is None  # above 16 rows only the measured shapes
    assert kernels.splitk_config(8, 28672, 4096, cpu) is None  # enough column blocks already
    assert kernels.splitk_config(1, 576, 1536, cpu) is None  # small, unmeasured: as before
    assert kernels.splitk_config(1, 5120, 13824, cpu)[1] == 2  # unmeasured, large: the rule


@torch.no_grad()
def test_interpreted_model_forward_matches_reference_path(monkeypatch):
    """The Llama forward with every Triton path forced (a pool with triton=True: fused RoPE + KV write
    + attention for short extensions, tiled attention for the prefill, skinny products with SiLU·mul,
    split-K wo and w2) equals the torch reference path: prefill, a 2-token and a 1-token step, and a
    7-token verify-like step. The 40-row prefill's wo and w2 partials are summed by the norms; the
    steps' norms after wo and w2 are folded into those products (add, γ and Σh² in the product's
    epilogue, 1/rms applied by the attention kernel and SiLU·mul)."""
    _interpreted_kernels()
    import numpy as np

    import smcdecode.backends.engine.ops as M
    from smcdecode.backends.engine import KVPool, Llama, PagedBatch, PageTable

    cfg = LlamaConfig(64, 128, 2, 4, 2, 96, rope_theta=10000.0)  # head_dim 32
    model = Llama.random(cfg, dtype=torch.float32, device="cpu")

    folds = []
    real_fold = M.linear_add_norm

    def counted(*a):
        folds.append(1)
        return real_fold(*a)

    monkeypatch.setattr(M, "linear_add_norm", counted)

    def run(force: bool):
        monkeypatch.setattr(M, "use_skinny", lambda x, w, triton, silu=False: triton)
        # wo and w2 split-K into partials that the next add + RMSNorm sums (split 2: 64 + 64 of 128
        # columns for wo, 64 + 32 of 96 for w2), or that the last split adds up (folded norms)
        monkeypatch.setattr(M, "split_config", lambda x, w, triton, rows=None: ((16, 16, 32, 4, 1), 2) if triton
                            else None)
        torch.manual_seed(1)
        PS = 4
        pool = KVPool.for_model(cfg, 40, PS, torch.float32, "cpu", triton=force)
        table = PageTable(rows=2, max_pages=12, num_pages=40, page_size=PS)
        table.reserve(np.array([0, 1]), np.array([30, 30]))
        pt = torch.from_numpy(table.table)
        ids = torch.randint(0, 64, (2, 30))
        outs = []
        for a, b in ((0, 20), (20, 22), (22, 23), (23, 30)):
            outs.append(model(ids[:, a:b], pool, PagedBatch.build(torch.arange(a, b)[None].repeat(2, 1), pt, PS)))
        return outs

    ref = run(False)
    assert not folds
    for x, y in zip(run(True), ref):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    # per forward of at most 16 rows (not the 40-row prefill): wo of both layers and w2 of the first
    # (the last layer's w2 feeds the final norm)
    assert len(folds) == 3 * 3


def test_torch_sample_and_score_sample_every_draws_only_the_last_row_of_each_group():
    g = torch.Generator().manual_seed(3)
    R, V, S = 12, 50, 4
    logits = torch.randn(R, V, generator=g) * 3
    gather = torch.randint(0, V, (R,), generator=g)
    tok, lp_tok, _, lp_gather = sample_and_score(logits, 0.9, gather=gather, generator=g, sample_every=S)
    logp = torch.log_softmax(logits / 0.9, -1)
    torch.testing.assert_close(lp_gather, logp.gather(1, gather[:, None])[:, 0])
    drawn = torch.arange(R) % S == S - 1
    assert (tok[~drawn] == -1).all() and torch.isnan(lp_tok[~drawn]).all()
    assert ((tok[drawn] >= 0) & (tok[drawn] < V)).all()
    torch.testing.assert_close(lp_tok[drawn], logp[drawn].gather(1, tok[drawn][:, None])[:, 0])
    # the rows that draw follow the softmax (one repeated row, many groups)
    base = torch.randn(8, generator=g)
    n = 20000
    tok = sample_and_score(base.repeat(n * S, 1), 1.0, generator=g, sample_every=S).token
    assert (tok[S - 1 :: S] >= 0).all()
    counts = torch.bincount(tok[S - 1 :: S], minlength=8).double()
    expected = n * torch.softmax(base.double(), -1)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, chi2  # 7 degrees of freedom: P(chi2 > 30) ≈ 1e-4


@pytest.mark.parametrize("support", [[5, 261, 700, 1030, 2100, 3004], [5, 261, 517, 773, 1029, 2821]],
                         ids=["lanes", "one-lane"])
def test_interpreted_sample_and_score_draws_the_softmax(support):
    """The Triton sampler's draws (noise: one Philox call per four elements, over several blocks and
    quarters of a block) follow softmax(x / T): chi-square over six support tokens placed in every
    block and quarter; the scores are exact."""
    kernels = _interpreted_kernels()
    R, V, T = 600, 3100, 0.7  # one split of four 1024-blocks a row (the last one masked in part)
    # "lanes": blocks 0, 0, 0, 1, 2, 2 and quarters 0, 1, 2, 0, 0, 3 of 256 lanes; 5 and 261 share a
    # lane (and a logit): noise shared across quarters would tie their keys and 261 would never win.
    # "one-lane": all six in lane 5 (quarters 0-3 of block 0, block 1, block 2's last quarter), so the
    # race within a lane (its comparisons and the rescaling as the lane's max grows) decides every draw
    support = torch.tensor(support)
    values = torch.tensor([0.4, 0.4, -0.3, 0.8, 0.2, -0.6])
    logits = torch.full((R, V), -1e4)
    logits[:, support] = values
    tok, lp_tok, _, _ = kernels.triton_sample_and_score(logits, T, torch.tensor(2024))
    p = torch.softmax(values.double() / T, 0)
    counts = torch.stack([(tok == s).sum() for s in support]).double()
    assert int(counts.sum()) == R
    chi2 = float(((counts - R * p) ** 2 / (R * p)).sum())
    assert chi2 < 25.7, chi2  # 5 degrees of freedom: P(chi2 > 25.7) ≈ 1e-4
    torch.testing.assert_close(lp_tok, torch.log_softmax(logits / T, -1).gather(1, tok[:, None])[:, 0])


def test_interpreted_sample_and_score_races_long_lanes_and_masked_tails():
    """Eight blocks a split program (chunk 8192): long races within a lane, with the lane's running
    max growing; logits of several scales and a masked tail (V not a multiple of the block), two
    splits a row, rows whose support is one block's first lanes (the draw stays in it) and rows whose
    support is one lane (32 elements raced within the lane): exact scores of the drawn token and of
    the gathered ones; a chunk that is not a multiple of the block is refused."""
    kernels = _interpreted_kernels()
    g = torch.Generator().manual_seed(10)
    R, V = 96, 9000
    logits = torch.randn(R, V, generator=g) * torch.tensor([0.5, 3.0, 20.0]).repeat(R // 3)[:, None]
    logits[::4, 100:] = float("-inf")  # rows whose support is one block's first lanes
    lane = torch.ones(V, dtype=torch.bool)
    lane[7::256] = False
    logits[1::2, lane] = float("-inf")  # rows whose support is one lane: its race decides the draw
    gather = torch.randint(0, 100, (R,), generator=g)
    seed = torch.tensor(31)
    tok, lp_tok, _, lp_g = kernels.triton_sample_and_score(logits, 0.9, seed, gather, chunk=8192)
    assert (tok[::4] < 100).all() and (tok[1::2] % 256 == 7).all()
    logp = torch.log_softmax(logits / 0.9, -1)
    torch.testing.assert_close(lp_tok, logp.gather(1, tok[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp_g, logp.gather(1, gather[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="chunk=1000: give a multiple of 1024"):
        kernels.triton_sample_and_score(logits, 1.0, seed, chunk=1000)


def test_interpreted_sample_and_score_skips_rows_but_draws_the_same_tokens():
    """sample_every = K + 1 (verify): the same log-sum-exp and gathered log-probs on every row, and the
    rows that draw get exactly the token (and log-prob) of the full kernel (the noise is keyed by the
    element); the other rows return -1 / nan. A vocabulary over several splits."""
    kernels = _interpreted_kernels()
    g = torch.Generator().manual_seed(4)
    R, V, S, T = 12, 9000, 3, 0.8  # 9000 > 8192: two splits a row
    logits = torch.randn(R, V, generator=g) * 4
    gather = torch.randint(0, V, (R,), generator=g)
    seed = torch.tensor(77)
    tok, lp_tok, _, lp_gather = kernels.triton_sample_and_score(logits, T, seed, gather)
    tok_s, lp_tok_s, _, lp_gather_s = kernels.triton_sample_and_score(logits, T, seed, gather, sample_every=S)
    logp = torch.log_softmax(logits / T, -1)
    torch.testing.assert_close(lp_gather_s, logp.gather(1, gather[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp_gather_s, lp_gather)
    drawn = torch.arange(R) % S == S - 1
    assert torch.equal(tok_s[drawn], tok[drawn])
    torch.testing.assert_close(lp_tok_s[drawn], lp_tok[drawn])
    assert (tok_s[~drawn] == -1).all() and torch.isnan(lp_tok_s[~drawn]).all()
    tok_other = kernels.triton_sample_and_score(logits, T, torch.tensor(78), gather, sample_every=S).token
    assert not torch.equal(tok_other[drawn], tok_s[drawn])  # the seed still matters


def test_interpreted_packed_masks_find_dead_rows_and_write_the_unmasked_log_q():
    """A packed mask without ``dead``: each program finds the rows that allow nothing from the bits
    (bits set past V in the last word do not count), and the draws, log π, normalisers are those of
    the same mask as bytes with ``dead`` given; ``unmasked_out`` (a strided column, as the round's
    log_q_all[:, i]) gets log q(token) of the unmasked softmax, 0 on a dead row."""
    from smcdecode.potentials.constraint import pack_bits

    kernels = _interpreted_kernels()
    g = torch.Generator().manual_seed(6)
    R, V = 8, 3100  # (V % 32 = 28: the last word has 4 bits past V)
    logits = torch.randn(R, V, generator=g) * 2
    mask = torch.rand(R, V, generator=g) < 0.2
    mask[3] = False  # dead
    mask[5] = False  # dead, but for a bit past V (set below)
    mask[6] = False
    mask[6, -1] = True  # only the last token
    bits = pack_bits(mask)
    bits[5, -1] |= 1 << 30
    noise = torch.randint(-(2**31), 2**31 - 1, (R, V), generator=g, dtype=torch.int32)
    seed = torch.tensor(5)
    out = torch.full((R, 3), 7.0)
    got = kernels.triton_sample_and_score(logits, 0.9, seed, bits=noise, mask_bits=bits, unmasked_out=out[:, 1])
    ref = kernels.triton_sample_and_score(logits, 0.9, seed, bits=noise, mask=mask, dead=~mask.any(-1))
    assert torch.equal(got.token, ref.token)
    for a, b in zip(got[1:3], ref[1:3]):
        torch.testing.assert_close(a, b)
    assert torch.isinf(got.log_norm[[3, 5]]).all() and torch.isfinite(got.log_norm[[0, 1, 2, 4, 6, 7]]).all()
    assert got.token[6] == V - 1
    live = torch.tensor([r not in (3, 5) for r in range(R)])
    logq = torch.log_softmax(logits / 0.9, -1).gather(1, got.token[:, None])[:, 0]
    torch.testing.assert_close(out[live, 1], logq[live], rtol=1e-5, atol=1e-5)
    assert (out[~live, 1] == 0).all() and (out[:, [0, 2]] == 7.0).all()
    with pytest.raises(ValueError, match="unmasked_out must be float32 of shape"):
        kernels.triton_sample_and_score(logits, 0.9, seed, mask_bits=bits, unmasked_out=out[:4, 1])
    with pytest.raises(ValueError, match="unmasked_out needs a mask"):
        kernels.triton_sample_and_score(logits, 0.9, seed, unmasked_out=out[:, 1])


class _LaunchSpy:
    """Stands in for a Triton kernel object: records the keyword arguments of each launch."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((grid, kw))
            return self.kernel[grid](*args, **kw)

        return launch


def test_interpreted_paged_attention_follows_the_launch_config(monkeypatch):
    """The launches take ATTN_CONFIGS' entry for their shape class (and head dim): that BLOCK_N,
    warps, stages, split count and prefetch, and the output still matches the reference, at blocks
    smaller and larger than the default 64 (page size 4); an explicit config wins; a bad one is
    refused."""
    kernels = _interpreted_kernels()
    from smcdecode.backends.engine.attention import reference_paged_attention

    spy = _LaunchSpy(kernels.attention._paged_attn_kernel)
    monkeypatch.setattr(kernels.attention, "_paged_attn_kernel", spy)
    H, Hkv, D, PS, P = 4, 2, 32, 4, 40
    table = {"decode": (16, 2, 3, 0.1, 1), "verify": (128, 8, 1, 0.05, 0), "verify:32": (32, 4, 2, 0.05, 1),
             "prefill": (16, 4, 2, 0.1, 0)}  # (with and without prefetch; several blocks a split)
    monkeypatch.setattr(kernels.attention, "ATTN_CONFIGS", table)
    explicit = (64, 4, 2, 0.3, 1)
    for L, lengths, key in [(1, [1, 150, 97], "decode"), (5, [5, 160, 70], "verify:32"), (20, [20, 90], "prefill")]:
        (kp, vp), pt, batch, g = _paged_case(30 + L, len(lengths), L, H, Hkv, D, PS, P, lengths)
        q = torch.randn(len(lengths), L, H, D, generator=g)
        ref = reference_paged_attention(q.double(), kp.double(), vp.double(), batch)
        for config in (None, explicit):
            out = kernels.triton_paged_attention(q, kp, vp, batch, config=config)
            err = float((out.double() - ref).norm() / ref.norm())
            assert err < 1e-5, (L, config, err)
            grid, kw = spy.launches[-1]
            block_n, warps, stages, per_sm, prefetch = table[key] if config is None else config
            mt = -(-L * (H // Hkv) // kw["BLOCK_M"])
            nsplit = max(1, min(32, -(-P * PS // block_n), int(per_sm * 132) // (len(lengths) * Hkv * mt)))
            assert (kw["BLOCK_N"], kw["num_warps"], kw["num_stages"], kw["NSPLIT"], kw["PREFETCH"]) == (
                block_n, warps, stages, nsplit, prefetch == 1), (key, kw)
            assert grid == (len(lengths) * Hkv, nsplit, mt)
    assert {kw["NSPLIT"] for _, kw in spy.launches} >= {1, 2, 3}  # split and unsplit launches ran
    for bad in ((48, 4, 2, 2.0, 0), (64, 3, 2, 2.0, 0), (64, 4, 2, 0, 0), (64, 4, 2, 2.0, 2), (64, 4, 2, 2.0)):
        with pytest.raises(ValueError, match="attention config"):
            kernels.triton_paged_attention(q[:, :1], kp, vp, batch, config=bad)


_COMPILE_FOR_SM90 = r'''
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import inspect

from smcdecode.backends.engine.kernels import attention, linear, norms, pages, sampling


def defaults(fn, sig):
    # parameters with a default that the signature does not name (e.g. a row scale's, off): constants
    return {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
            if p.default is not inspect.Parameter.empty and n not in sig}


rowscale = {"SS": "*fp32", "stride_ss": "i32", "rs_eps": "fp32"}


def build(fn, sig, consts, warps, stages):
    # each kernel without and with programmatic dependent launch (PDL 1: wait for the previous
    # kernel, then release the next one)
    for pdl in (0, 1):
        c = {**defaults(fn, sig), **consts, "PDL": pdl}
        k = triton.compile(ASTSource(fn=fn, signature={**sig, **{k: "constexpr" for k in c}}, constexprs=c),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": stages, "launch_pdl": bool(pdl)})
        assert k.asm["cubin"]
        assert k.asm["ptx"].count("griddepcontrol.wait") == pdl, (fn, pdl)


for every in (1, 9):
    build(sampling._sample_split_kernel, {"LOGITS": "*bf16", "SEED": "*i64", "stride_r": "i32", "inv_temp": "fp32",
                                   "PART": "*fp32"},
          {"V": 128256, "CHUNK": 8192, "BLOCK": 1024, "NSPLIT": 16, "SAMPLE_EVERY": every}, 4, 2)
    build(sampling._sample_merge_kernel, {"PART": "*fp32", "LOGITS": "*bf16", "stride_r": "i32", "inv_temp": "fp32",
                                   "GATHER": "*i64", "TOK": "*i64", "LOGP_TOK": "*fp32", "LOGP_GATHER": "*fp32"},
          {"NSPLIT": 16, "NSPLIT_P2": 16, "HAS_GATHER": True, "SAMPLE_EVERY": every}, 1, 2)
# the general path with the host's packed masks, dead rows read from the bits, the unmasked log q written
build(sampling._general_split_kernel, {"LOGITS": "*bf16", "SEED": "*i64", "BITS": "*i64", "MASK": "*i32",
                                       "DEAD": "*i64", "ALPHA": "*fp32", "stride_r": "i32", "stride_m": "i32",
                                       "inv_temp": "fp32", "INV_TEMP": "*fp32", "PART": "*fp32"},
      {"V": 49155, "CHUNK": 8192, "BLOCK": 1024, "NSPLIT": 7, "SAMPLE_EVERY": 1, "DRAW": True, "TEMP_PER_ROW": True,
       "NOISE_BITS": False, "HAS_MASK": True, "HAS_ALPHA": False, "PACKED": True, "DEAD_FROM_BITS": True}, 4, 2)
build(sampling._general_merge_kernel, {"PART": "*fp32", "LOGITS": "*bf16", "stride_r": "i32", "inv_temp": "fp32",
                                       "INV_TEMP": "*fp32", "GATHER": "*i64", "DEAD": "*i64", "MASK": "*i32",
                                       "stride_m": "i32", "ALPHA": "*fp32", "TOK": "*i64", "LOGP_TOK": "*fp32",
                                       "LOG_NORM": "*fp32", "LOGP_GATHER": "*fp32", "UNMASKED": "*fp32",
                                       "stride_u": "i32"},
      {"V": 49155, "NSPLIT": 7, "NSPLIT_P2": 8, "HAS_GATHER": False, "SAMPLE_EVERY": 1, "DRAW": True,
       "TEMP_PER_ROW": True, "HAS_MASK": True, "HAS_ALPHA": False, "DEAD_FROM_BITS": True, "HAS_UNMASKED": True},
      1, 2)
attn = {"Q": "*bf16", "KP": "*bf16", "VP": "*bf16", "PT": "*i32", "POS": "*i64", "O": "*bf16", "OP": "*fp32",
        "LSE": "*fp32", "CNT": "*i32", "COS": "*fp32", "SIN": "*fp32", "sm_scale": "fp32", "stride_qt": "i32",
        "stride_pt": "i32"}
for L, D, nsplit, block_n, warps, stages, prefetch in [(1, 64, 4, 32, 4, 2, True), (9, 128, 8, 128, 8, 3, True),
                                                      (1, 128, 1, 64, 4, 2, False)]:
    build(attention._paged_attn_kernel, attn,
          dict(L=L, G=4, H=32, HKV=8, D=D, PS=16, NSPLIT=nsplit, MT=1, BLOCK_M=max(16, min(64, triton.next_power_of_2(4 * L))),
               BLOCK_N=block_n, BLOCK_L=16, ROPE=True, MERGE=2 if nsplit > 1 else 0, DYN_LOOP=True, MAX_IT=1,
               PREFETCH=prefetch),
          warps, stages)
# with a folded norm's row scale (the draft's decode step)
build(attention._paged_attn_kernel, {**attn, **rowscale},
      dict(L=1, G=4, H=32, HKV=8, D=64, PS=16, NSPLIT=4, MT=1, BLOCK_M=16, BLOCK_N=64, BLOCK_L=16, ROPE=True, MERGE=2,
           DYN_LOOP=True, MAX_IT=1, PREFETCH=True, RS_T=32, RS_TP2=32, RS_DIM=2048), 4, 3)
build(norms._silu_mul_kernel, {"GU": "*bf16", "OUT": "*bf16", **rowscale},
      dict(INTER=8192, BLOCK=1024, RS_T=64, RS_TP2=64, RS_DIM=2048), 4, 1)
build(pages._copy_pages_kernel, {"KV": "*bf16", "SRC": "*i64", "DST": "*i64", "n_pages": "i32"},
      dict(PAGE=16384, BLOCK=4096), 4, 1)
# the skinny product at the shapes it runs (the draft's wo and w13 + SiLU·mul at 8 and 64 rows, a
# vocabulary head), with the 16-byte alignment the JIT assumes of pointers and strides (without it
# nothing is pipelined): every load of the K loop must be an async copy of the software pipeline
skinny = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "M": "i32", "stride_xm": "i32"}
aligned = {(linear._skinny_linear_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("X", "W", "Y", "stride_xm")}
# With PDL (the wait before the loop) the K loop must stay pipelined too.
# Split-K (float32 partials, K_PER < K) likewise; and a folded norm's epilogues (RESID: the add, γ and
# Σh², by the last split with split-K; the SiLU·mul's row scale).
resid = {"R": "*bf16", "H_OUT": "*bf16", "GAMMA": "*bf16", "GH_OUT": "*bf16", "SS": "*fp32", "CNT": "*i32"}
for m, n, k, bn, bk, silu, pdl, split, fold in [
        (16, 2048, 2048, 16, 256, False, 0, 1, 0), (16, 8192, 2048, 32, 128, True, 0, 1, 0),
        (64, 8192, 2048, 32, 128, True, 0, 1, 0), (16, 128256, 2048, 64, 128, False, 0, 1, 0),
        (16, 2048, 8192, 16, 256, False, 1, 1, 0), (16, 8192, 2048, 32, 128, True, 1, 1, 0),
        (16, 2048, 8192, 32, 256, False, 0, 4, 0), (16, 4096, 14336, 32, 256, False, 1, 2, 0),
        (16, 2048, 2048, 64, 128, False, 0, 4, 1), (64, 2048, 8192, 64, 128, False, 1, 4, 1),
        (16, 2048, 2048, 16, 256, False, 0, 1, 1), (16, 8192, 2048, 32, 128, True, 0, 1, 2)]:
    consts = dict(N=n, K=k, BLOCK_M=m, BLOCK_N=bn, BLOCK_K=bk, SILU=silu, PDL=pdl, SPLIT=split,
                  K_PER=-(-k // split // bk) * bk)
    sig = {**skinny, "Y": "*fp32" if split > 1 else "*bf16"}
    if fold == 1:
        sig, consts = {**sig, **resid}, {**consts, "RESID": 1}
    elif fold == 2:
        sig = {**sig, "SS_IN": "*fp32", "stride_ss": "i32", "rs_eps": "fp32"}
        consts = {**consts, "RS_T": 64, "RS_TP2": 64, "RS_DIM": 2048}
    consts = {**defaults(linear._skinny_linear_kernel, sig), **consts}
    kern = triton.compile(ASTSource(fn=linear._skinny_linear_kernel, signature={**sig, **dict.fromkeys(consts, "constexpr")},
                                    constexprs=consts, attrs=aligned),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4, "launch_pdl": bool(pdl)})
    ttgir, ptx = kern.asm["ttgir"], kern.asm["ptx"]
    loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
    assert "tt.load" not in loop and "tt.store" not in loop, (consts, loop)
    assert ttgir.count("async_copy_global_to_local") == 4 * (2 + silu), consts  # 4 stages of each load
    assert ptx.count("griddepcontrol.wait") == pdl, consts
print("compiled")
'''


def test_kernels_compile_for_a_gpu_target():
    """The kernels this CPU suite runs in the interpreter also compile for an H100/H200 (sm_90, with
    the ptxas that ships with triton; no GPU needed): the row-skipping sampler, the attention with
    the page-id prefetch and non-default blocks, warps and stages, the page copy, the general path on
    packed masks, and the skinny product with every
    load of its K loop software-pipelined (async copies, 4 stages)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                         env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    r = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0 and ("ptxas" in r.stderr and "not found" in r.stderr.lower()):
        pytest.skip("no ptxas for the CUDA backend")
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


def test_skinny_products_are_the_measured_shapes():
    """w13 + SiLU·mul goes to the skinny kernel at up to 16 rows and at 33 to SKINNY_SILU_MAX_ROWS
    rows (128; 17-32 rows were not measured), each row range with its block shape; other products at
    most 16 rows, square or vocabulary heads only (wqkv and w2 stay on cuBLAS)."""
    kernels = _interpreted_kernels()
    assert kernels.linear.SKINNY_SILU_MAX_ROWS == 128
    assert kernels.skinny_wins(16, 8192, 2048, 64e6, silu=True)
    assert not kernels.skinny_wins(17, 8192, 2048, 64e6, silu=True)
    assert not kernels.skinny_wins(32, 8192, 2048, 64e6, silu=True)
    assert kernels.skinny_wins(33, 8192, 2048, 64e6, silu=True) and kernels.skinny_wins(128, 8192, 2048, 64e6, True)
    assert not kernels.skinny_wins(129, 8192, 2048, 64e6, silu=True)
    assert not kernels.skinny_wins(16, 8192, 2048, 235e6, silu=True)
    cpu = torch.device("cpu")
    assert kernels.skinny_config(8, 8192, 2048, cpu, silu=True) == (16, 32, 128, 4, 4)
    assert kernels.skinny_config(64, 8192, 2048, cpu, silu=True) == (64, 64, 128, 4, 4)
    assert kernels.skinny_config(128, 8192, 2048, cpu, silu=True) == (128, 64, 64, 8, 5)
    assert not kernels.skinny_wins(64, 2048, 2048, 8e6, silu=False) and kernels.skinny_wins(16, 2048, 2048, 8e6, False)
    assert not kernels.skinny_wins(8, 3072, 2048, 12e6, silu=False)  # wqkv: cuBLAS
    assert not kernels.skinny_wins(16, 2048, 8192, 33e6, silu=False)  # w2: cuBLAS (or split-K)
    assert kernels.skinny_wins(8, 128256, 2048, 500e6, silu=False)  # a vocabulary head


def test_cublaslt_choice_is_per_measured_shape():
    """Only the measured shapes go to cuBLASLt, and only on sm_90. On the CPU ``dense`` is the layer
    itself."""
    from smcdecode.backends.engine import ops

    assert ops.cublaslt_wins(72, 4096, 14336, (9, 0)) and ops.cublaslt_wins(576, 128256, 4096, (9, 0))
    assert not ops.cublaslt_wins(72, 4096, 14336, (8, 0))  # measured on Hopper only
    assert not ops.cublaslt_wins(72, 6144, 4096, (9, 0)) and not ops.cublaslt_wins(73, 4096, 14336, (9, 0))
    layer = torch.nn.Linear(8, 4, bias=False)
    x = torch.randn(3, 8)
    torch.testing.assert_close(ops.dense(x, layer), layer(x))


def test_pdl_is_off_on_the_cpu_and_inside_pdl_off():
    """PDL is off on the CPU (and in the interpreter); it is wanted except inside ``pdl_off()``
    (autoregressive decoding), also when the block raises; the interpreter runs the kernels with
    PDL's default (0): the skinny product still matches torch."""
    kernels = _interpreted_kernels()
    assert kernels.pdl_mode(torch.device("cpu")) == 0 and kernels.common.pdl_args(torch.device("cpu")) == {}
    assert kernels.pdl_enabled()
    with kernels.pdl_off():
        assert not kernels.pdl_enabled()
        with kernels.pdl_off():
            assert not kernels.pdl_enabled()
        assert not kernels.pdl_enabled()
    assert kernels.pdl_enabled()
    with pytest.raises(RuntimeError), kernels.pdl_off():
        raise RuntimeError
    assert kernels.pdl_enabled()
    x, w = torch.randn(3, 64), torch.randn(48, 64)
    torch.testing.assert_close(kernels.triton_skinny_linear(x, w, config=(16, 16, 32, 4, 1)), x @ w.T,
                               rtol=1e-4, atol=1e-4)
