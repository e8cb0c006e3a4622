"""Triton kernels against their torch references, and the engine on the GPU (bf16, CUDA graphs).
Marked ``gpu``: skipped where CUDA or Triton is absent."""

import numpy as np
import pytest
import torch

from smcdecode.backends.engine import Engine, KVPool, Llama, LlamaConfig, PagedBatch, PageTable
from smcdecode.backends.engine.attention import reference_paged_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _scattered_pages(lengths: list[int], L: int, Hkv: int, D: int, PS: int = 16, P: int = 96, device="cuda"):
    """Random bf16 K/V pools and, for each row, P pages scattered over the pool (page 0 unused),
    the positions of its last L tokens and the PagedBatch over them."""
    B = len(lengths)
    num_pages = B * P + 1
    pool_k = torch.randn(num_pages, Hkv, PS, D, device=device, dtype=torch.bfloat16)
    pool_v = torch.randn(num_pages, Hkv, PS, D, device=device, dtype=torch.bfloat16)
    pt = (torch.randperm(num_pages - 1, device=device)[: B * P].view(B, P) + 1).to(torch.int32)
    seq = torch.tensor(lengths, device=device)
    positions = seq[:, None] - L + torch.arange(L, device=device)
    return pool_k, pool_v, positions, PagedBatch.build(positions, pt, PS)

def _rope_case(B: int, L: int, H: int, Hkv: int, D: int, pool_k, pool_v, positions, batch):
    """A fused projection qkv [B, L, (H + 2Hkv)·D], rope tables, and the reference of the RoPE-fused
    attention on it: (qkv, cos, sin, reference output, reference K and V pools after the write)."""
    from smcdecode.backends.engine.ops import rope_kv_write_reference

    freqs = torch.arange(2048, device="cuda", dtype=torch.float64)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D))
    cos, sin = freqs.cos().float(), freqs.sin().float()
    qkv = torch.randn(B, L, (H + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
    k_ref, v_ref = pool_k.clone(), pool_v.clone()
    q_ref = rope_kv_write_reference(qkv, positions, cos, sin, k_ref, v_ref, batch.slot_pages, batch.slot_offsets,
                                    H, Hkv)
    ref = reference_paged_attention(q_ref.double(), k_ref.double(), v_ref.double(), batch)
    return qkv, cos, sin, ref, k_ref, v_ref



@pytest.mark.parametrize("L,H,Hkv,D,lengths", [(1, 32, 8, 128, [1, 700, 33]), (2, 32, 8, 64, [2, 65, 300]),
                                               (9, 32, 8, 128, [9, 256, 1290]), (5, 8, 8, 64, [17, 40, 5]),
                                               (255, 32, 8, 128, [256, 300]), (1, 4, 2, 16, [3, 90, 7])])
@pytest.mark.parametrize("config", [None, (64, 4, 2, 4.0, 0), (64, 4, 2, 16.0, 0), (64, 4, 2, 0.01, 0)],
                         ids=["default", "4 per SM", "16 per SM", "one split"])
def test_triton_paged_attention_matches_reference(L, H, Hkv, D, lengths, config):
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels import triton_paged_attention
    from smcdecode.backends.engine.kernels.common import split_counters

    torch.manual_seed(L * 100 + D)
    pool_k, pool_v, positions, batch = _scattered_pages(lengths, L, Hkv, D)
    B = len(lengths)
    q = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16)
    ref = reference_paged_attention(q.double(), pool_k.double(), pool_v.double(), batch)
    for _ in range(3):  # repeated launches: the split counters are reset by each launch
        out = triton_paged_attention(q, pool_k, pool_v, batch, config=config)
        err = (out.double() - ref).norm() / ref.norm()
        assert torch.isfinite(out).all() and err < 1e-2, float(err)
    assert int(split_counters(q.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("L,H,Hkv,D,lengths", [(1, 32, 8, 64, [1, 700, 33]), (2, 32, 8, 64, [2, 65, 300]),
                                               (9, 32, 8, 128, [9, 256, 1290]), (16, 9, 3, 64, [17, 40, 16])])
@pytest.mark.parametrize("config", [None, (64, 4, 2, 4.0, 0), (64, 4, 2, 0.01, 0)],
                         ids=["default", "4 per SM", "one split"])
def test_triton_rope_paged_attention_matches_reference(L, H, Hkv, D, lengths, config):
    """RoPE + KV write + attention in one kernel against the reference RoPE/KV write followed by the
    reference attention: the same output, the same slots written with the same keys, nothing else."""
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels import triton_rope_paged_attention

    torch.manual_seed(L * 10 + D)
    pool_k, pool_v, positions, batch = _scattered_pages(lengths, L, Hkv, D)
    B = len(lengths)
    qkv, cos, sin, ref, k_ref, v_ref = _rope_case(B, L, H, Hkv, D, pool_k, pool_v, positions, batch)
    for _ in range(2):
        k_out, v_out = pool_k.clone(), pool_v.clone()
        out = triton_rope_paged_attention(qkv, cos, sin, k_out, v_out, batch, H, config=config)
        err = (out.double() - ref).norm() / ref.norm()
        assert torch.isfinite(out).all() and err < 1e-2, float(err)
        assert (k_out.float() - k_ref.float()).abs().max() < 2e-2  # the new keys (rounded like the reference)
        assert torch.equal(v_out, v_ref)
        changed = (k_out != pool_k).any(-1)  # [pages, Hkv, PS]: exactly the new slots
        assert int(changed.sum()) <= B * L * Hkv


@torch.inference_mode()
@pytest.mark.parametrize("split_k", ["default", "forced", "forced, fold <= 64 rows", "transposed"])
def test_bf16_engine_logprobs_match_hf_and_graph_round_runs(split_k, monkeypatch):
    """(split_k "forced": wo and w2 (256x256, 256x512) split K in 2 and 4 at up to 128 rows, which at
    these small shapes the engine would not do: the 30-row prefill's partials summed by the norms, the
    decode steps' norms folded into the products' epilogues (ops.Normed); "forced, fold <= 64
    rows": FOLD_MAX_ROWS 64, so the 30-row prefill whose keys the compared positions read folds too,
    in 32-row blocks; "transposed": no split and every wo and w2 run as W·xᵀ, the norms reading its
    transposed output.)"""
    transformers = pytest.importorskip("transformers")
    import triton

    from smcdecode.backends.engine import ops as M

    forced = {(256, 256): (32, 64, 4, 2, 2), (256, 512): (32, 64, 4, 2, 4)}

    def forced_split(x, w, tri, rows=None):
        m = x.numel() // w.shape[1] if rows is None else rows
        entry = forced.get(tuple(w.shape))
        if not tri or m > 128 or entry is None:
            return None
        bn, bk, warps, stages, split = entry
        return (max(16, triton.next_power_of_2(m)), bn, bk, warps, stages), split

    if split_k == "transposed":
        monkeypatch.setattr(M, "transposed_wins", lambda *shape: True)
        monkeypatch.setattr(M, "split_config", lambda x, w, tri, rows=None: None)
    elif split_k != "default":
        monkeypatch.setattr(M, "split_config", forced_split)
    if "64" in split_k:
        monkeypatch.setattr(M, "FOLD_MAX_ROWS", 64)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                   rope_theta=10000.0)
    hf = transformers.LlamaForCausalLM(cfg).eval().cuda()
    model = Llama.from_hf(hf, dtype=torch.bfloat16, device="cuda")
    PS = 16
    pool = KVPool.for_model(model.cfg, num_pages=64, page_size=PS, dtype=torch.bfloat16, device="cuda",
                            triton=True)
    table = PageTable(rows=1, max_pages=16, num_pages=64, page_size=PS)
    ids = torch.randint(0, 512, (1, 40), device="cuda")
    table.reserve(np.array([0]), np.array([40]))
    pt = torch.from_numpy(table.table).cuda()
    model(ids[:, :30], pool, PagedBatch.build(torch.arange(30, device="cuda")[None], pt, PS))
    out = model(ids[:, 30:], pool, PagedBatch.build(torch.arange(30, 40, device="cuda")[None], pt, PS))
    ref = torch.log_softmax(hf(ids).logits[:, 30:].float(), -1)
    lp = torch.log_softmax(out.float(), -1)
    tok = ids[:, 31:40]
    diff = (lp[:, :-1].gather(2, tok[..., None]) - ref[:, :-1].gather(2, tok[..., None])).abs().max()
    assert diff < 0.05, float(diff)

    draft = Llama.random(LlamaConfig(512, 128, 1, 4, 2, 256, rope_theta=10000.0), device="cuda")
    engine = Engine(model, draft, num_pages=512, page_size=PS, max_context=256)
    prompts = [ids[0, :33].tolist(), ids[0, :20].tolist()]
    res = engine.smc_sd(prompts, particles=4, block_size=3, max_new_tokens=50, use_graphs=True)
    assert res.tokens.shape == (2, 4, 50) and (res.lengths == 50).all()
    assert torch.isfinite(res.log_evidence).all()
    toks, _ = engine.autoregressive(prompts, max_new_tokens=20, use_graphs=True)
    assert toks.shape == (2, 20)


@pytest.mark.parametrize("B,L,H,Hkv,S", [(3, 9, 32, 8, 5), (2, 1, 8, 8, 1), (4, 2, 32, 8, 16), (2, 20, 32, 8, 3)])
def test_triton_merge_splits_matches_reference(B, L, H, Hkv, S):
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels.attention import _merge_splits_kernel, merge_splits_reference

    torch.manual_seed(B * 7 + S)
    G, D = H // Hkv, 128
    block_m = max(16, min(64, 1 << (L * G - 1).bit_length()))
    mt = -(-L * G // block_m)
    o_part = torch.randn(B * Hkv * mt, S, block_m, D, device="cuda")
    lse = torch.randn(B * Hkv * mt, S, block_m, device="cuda") * 3
    lse[:, S // 2 + 1 :] = float("-inf")  # splits past the row's length
    out = torch.full((B, L, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    _merge_splits_kernel[(B * Hkv * L * G,)](o_part, lse, out, L=L, G=G, H=H, HKV=Hkv, D=D, NSPLIT=S,
                                             NSPLIT_P2=max(2, 1 << (S - 1).bit_length()), BLOCK_M=block_m,
                                             num_warps=1)
    ref = merge_splits_reference(o_part.double(), lse.double(), B, L, H, Hkv, torch.float64)
    err = (out.double() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all() and err < 1e-2, float(err)


@pytest.mark.parametrize("M,dim,strided", [(7, 576, False), (72, 4096, True), (3, 2048, True), (256, 64, False),
                                           (192, 4096, "transposed"), (5, 576, "transposed"),
                                           (192, 4096, "transposed, 8 rows on 16 warps")])
def test_triton_add_rms_norm_and_silu_mul_match_reference(M, dim, strided):
    """(strided True: the last-position slice of a last_only forward; "transposed": a delta with unit
    stride between rows, as cuBLAS writes W·xᵀ for ops.linear_to_residual.)"""
    pytest.importorskip("triton")
    config = None
    if strided and "warps" in str(strided):
        config = (8, 16)
        strided = "transposed"
    from smcdecode.backends.engine.kernels import triton_add_rms_norm, triton_silu_mul
    from smcdecode.backends.engine.ops import add_rms_norm_reference, silu_mul

    torch.manual_seed(M + dim)
    x = torch.randn(M, 3, dim, device="cuda", dtype=torch.bfloat16)
    d = torch.randn(M, 3, dim, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
    if strided == "transposed":
        d = d.reshape(-1, dim).t().contiguous().t().reshape(M, 3, dim)
        assert d.reshape(-1, dim).stride() == (1, 3 * M)
    elif strided:  # the last-position slice, as in a last_only forward
        x, d = x[:, -1:], d[:, -1:]
    h, y = triton_add_rms_norm(x, d, w, 1e-5, config=config)
    h_ref, y_ref = add_rms_norm_reference(x, d, w, 1e-5)
    assert torch.equal(h, h_ref)
    assert (y.float() - y_ref.float()).abs().max() <= 2e-2 * y_ref.float().abs().max()
    h0, y0 = triton_add_rms_norm(x, None, w, 1e-5)
    assert h0 is x and (y0.float() - add_rms_norm_reference(x, None, w, 1e-5)[1].float()).abs().max() < 0.1
    gu = torch.randn(M, 2 * dim, device="cuda", dtype=torch.bfloat16)
    ref = silu_mul(gu)
    assert (triton_silu_mul(gu).float() - ref.float()).abs().max() <= 1e-2 * ref.float().abs().max()


@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 128), (9, 3, 64)])
def test_triton_rope_kv_write_matches_reference(H, Hkv, D):
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels import triton_rope_kv_write
    from smcdecode.backends.engine.ops import rope_kv_write_reference

    torch.manual_seed(H)
    B, L, PS, pages_n = 3, 9, 16, 40
    qkv = torch.randn(B, L, (H + 2 * Hkv) * D, device="cuda", dtype=torch.bfloat16)
    positions = torch.tensor([[5], [300], [1000]], device="cuda") + torch.arange(L, device="cuda")
    freqs = torch.arange(2048, device="cuda", dtype=torch.float64)[:, None] * (
        1.0 / 10000 ** (torch.arange(0, D, 2, device="cuda", dtype=torch.float64) / D))
    cos, sin = freqs.cos().float(), freqs.sin().float()
    page_ids = torch.randperm(pages_n - 1, device="cuda")[: B * 2].view(B, 2) + 1
    slot_pages = page_ids.gather(1, (positions - positions[:, :1]) // PS).reshape(-1)
    offsets = ((positions - positions[:, :1]) % PS).reshape(-1)
    pools = [torch.full((pages_n, Hkv, PS, D), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q = triton_rope_kv_write(qkv, positions.reshape(-1), cos, sin, pools[0], pools[1], slot_pages, offsets, H, Hkv)
    q_ref = rope_kv_write_reference(qkv, positions, cos, sin, pools[2], pools[3], slot_pages, offsets, H, Hkv)
    assert (q.float() - q_ref.float()).abs().max() < 2e-2
    for a, b in ((pools[0], pools[2]), (pools[1], pools[3])):
        assert torch.equal(torch.isnan(a), torch.isnan(b))  # the same slots written, nothing else
        ok = ~torch.isnan(b)
        assert (a[ok].float() - b[ok].float()).abs().max() < 2e-2


@pytest.mark.parametrize("V", [10, 50_000, 128_256])
def test_triton_sample_and_score_matches_reference(V):
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels import triton_sample_and_score

    torch.manual_seed(V)
    R, T = 4000, 0.8
    support = torch.tensor([0, V // 3, V // 2 + 1, V - 1], device="cuda")  # spread over the kernel's splits
    values = torch.tensor([0.0, 1.0, -0.5, 1.5], device="cuda")
    logits = torch.full((R, V), -1e4, device="cuda", dtype=torch.bfloat16)
    logits[:, support] = values.to(torch.bfloat16)
    logits += torch.randn(R, V, device="cuda", dtype=torch.bfloat16) * 0.01  # every row different
    gather = torch.randint(0, V, (R,), device="cuda")
    gather[::2] = support[torch.randint(0, 4, (R // 2,), device="cuda")]
    seed = torch.tensor(1234, device="cuda")
    tok, lp_tok, _, lp_gather = triton_sample_and_score(logits, T, seed, gather)
    logp = torch.log_softmax(logits.float() / T, -1)
    assert torch.allclose(lp_tok, logp.gather(1, tok[:, None])[:, 0], atol=1e-4)
    assert torch.allclose(lp_gather, logp.gather(1, gather[:, None])[:, 0], atol=1e-4)
    # the draws follow the softmax: chi-square over the 4 support tokens (others have p < 1e-4000)
    p = torch.softmax(values / T, 0).double()
    counts = torch.stack([(tok == s).sum() for s in support]).double()
    assert int(counts.sum()) == R
    chi2 = float(((counts - R * p) ** 2 / (R * p)).sum())
    assert chi2 < 21.0, chi2  # 3 degrees of freedom: P(chi2 > 21) ≈ 1e-4
    tok2 = triton_sample_and_score(logits, T, torch.tensor(99, device="cuda")).token
    assert not torch.equal(tok, tok2)  # a new seed gives new draws
    # verify's rows: only every 9th row draws (the same token as above), the others are only scored
    tok9, lp_tok9, _, lp_gather9 = triton_sample_and_score(logits, T, seed, gather, sample_every=9)
    drawn = torch.arange(R, device="cuda") % 9 == 8
    assert torch.equal(tok9[drawn], tok[drawn])
    torch.testing.assert_close(lp_tok9[drawn], lp_tok[drawn], rtol=0, atol=1e-5)
    assert (tok9[~drawn] == -1).all() and torch.isnan(lp_tok9[~drawn]).all()
    torch.testing.assert_close(lp_gather9, lp_gather, rtol=0, atol=1e-5)


def test_triton_copy_pages_matches_reference_in_a_graph():
    """The copy-on-write kernel on the GPU (bf16, a Llama-3.1-8B-shaped page: 8 kv heads × 16 × 128)
    equals the gather-and-scatter reference, also replayed in a CUDA graph with new indices."""
    from smcdecode.backends.engine.kernels import triton_copy_pages

    g = torch.Generator(device="cuda").manual_seed(0)
    kv = torch.randn(4, 2, 40, 8, 16, 128, device="cuda", generator=g).to(torch.bfloat16)

    def reference(kv, src, dst):
        out = kv.clone()
        for s_, d_ in zip(src.tolist(), dst.tolist()):
            if d_ != 0 and d_ != s_:
                out[:, :, d_] = kv[:, :, s_]
        return out

    src = torch.tensor([3, 0, 5, 7, 2, 9], device="cuda")
    dst = torch.tensor([8, 0, 0, 7, 4, 1], device="cuda")
    expect = reference(kv, src, dst)
    triton_copy_pages(kv, src, dst)
    assert torch.equal(kv, expect)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_copy_pages(kv, src, dst)
    src.copy_(torch.tensor([11, 12, 13, 0, 14, 15]))
    dst.copy_(torch.tensor([20, 21, 0, 0, 22, 23]))
    expect = reference(kv, src, dst)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kv, expect)



@pytest.mark.parametrize("M,N,K", [(8, 3072, 2048), (16, 2048, 8192), (1, 6144, 4096), (5, 100, 72), (64, 512, 256),
                                   (8, 2048, 2048), (1, 40000, 2048), (16, 8192, 2048), (64, 8192, 2048),
                                   (100, 8192, 2048), (128, 8192, 2048)])
def test_triton_skinny_linear_matches_torch(M, N, K):
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels import triton_skinny_linear
    from smcdecode.backends.engine.ops import silu_mul

    torch.manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    ref = (x.double() @ w.double().T)
    out = triton_skinny_linear(x, w)
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2
    w2 = torch.randn(2 * N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    ref2 = silu_mul(x @ w2.T).double()
    out2 = triton_skinny_linear(x[None], w2, silu=True)  # leading dims kept
    assert out2.shape == (1, M, N)
    assert ((out2[0].double() - ref2).norm() / ref2.norm()) < 2e-2
    if K >= 1024:  # split-K: float32 partials that sum to the product
        for split in (2, 4, 8):
            parts = triton_skinny_linear(x[None], w, split=split, config=(16, 32, 256, 4, 4))
            assert parts.shape == (split, 1, M, N) and parts.dtype == torch.float32
            assert ((parts.sum(0)[0].double() - ref).norm() / ref.norm()) < 1e-3


@pytest.mark.parametrize("M,N,K", [(72, 4096, 14336), (576, 4096, 4096)])
def test_cublaslt_products_match_and_restore_the_library(M, N, K):
    """The measured shapes go through cuBLASLt (ops.dense) with the same result as cuBLAS, within
    bf16 rounding, also in a CUDA graph; torch's preferred BLAS library is left as it was."""
    from smcdecode.backends.engine.ops import cublaslt_wins, dense

    torch.manual_seed(M)
    layer = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    before = torch.backends.cuda.preferred_blas_library()
    ref = x.double() @ layer.weight.double().T
    out = dense(x, layer)
    assert torch.backends.cuda.preferred_blas_library() == before
    assert ((out.double() - ref).norm() / ref.norm()) < 1e-2
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = dense(x, layer)
    g.replay()
    torch.cuda.synchronize()
    assert ((y.double() - ref).norm() / ref.norm()) < 1e-2
    assert cublaslt_wins(M, N, K, torch.cuda.get_device_capability()) == (torch.cuda.get_device_capability()[0] == 9)


def _residual_case(M: int, N: int, K: int):
    """A product feeding a residual add + RMSNorm (bf16): (kernels, x [M, K], w [N, K], residual
    [M, N], γ [N], the engine's split-K config for the shape (or a 2-way split), splits)."""
    pytest.importorskip("triton")
    from smcdecode.backends.engine import kernels

    torch.manual_seed(M + K)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    gamma = torch.randn(N, device="cuda", dtype=torch.bfloat16)
    cfg, split = kernels.splitk_config(M, N, K, x.device) or ((16, 32, 256, 4, 4), 2)
    return kernels, x, w, res, gamma, cfg, split


@pytest.mark.parametrize("M,N,K", [(8, 2048, 8192), (8, 2048, 2048), (64, 2048, 8192), (1, 4096, 14336), (9, 4096, 4096)])
def test_folded_norm_epilogue_matches_reference_in_a_graph(M, N, K):
    """The product added to the stream with the next RMSNorm folded in (the engine's split for the
    shape, the last split adding the partials), replayed 3 times in a CUDA graph (its counters reset
    each time): h, γ ⊙ h and Σ h² as the reference, and 1/rms · (γ ⊙ h) · W13ᵀ through the skinny
    SiLU·mul and the SiLU·mul kernel's row scale as rms_norm(h) · W13ᵀ (bf16 tolerance)."""
    from smcdecode.backends.engine.ops import Normed, add_rms_norm_reference, linear_add_norm_reference, silu_mul

    kernels, x, w, res, gamma, cfg, split = _residual_case(M, N, K)
    kernels.triton_skinny_linear_add_norm(x, w, res, gamma, cfg, split)  # compiles, allocates the counters
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        h, gh, ss = kernels.triton_skinny_linear_add_norm(x, w, res, gamma, cfg, split)
    ref = linear_add_norm_reference(x, w, res, gamma, 1e-5)
    for _ in range(3):
        h.zero_(), gh.zero_(), ss.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert (h.float() - ref.h.float()).abs().max() <= 2e-2 * ref.h.float().abs().max()
        assert (gh.float() - ref.gh.float()).abs().max() <= 3e-2 * ref.gh.float().abs().max()
        assert ((ss.sum(1) - ref.sumsq[:, 0]).abs() <= 2e-2 * ref.sumsq[:, 0]).all()
    assert int(kernels.common.split_counters(x.device, 1, kind="skinny").abs().sum()) == 0
    normed = Normed(h, gh, ss, 1e-5)
    w13 = torch.randn(2 * 512, N, device="cuda", dtype=torch.bfloat16) * N**-0.5
    want = silu_mul(add_rms_norm_reference(h, None, gamma, 1e-5)[1].float() @ w13.float().T)
    for got in (kernels.triton_skinny_linear(gh, w13, silu=True, rowscale=normed.rowscale()),
                kernels.triton_silu_mul(gh @ w13.T, rowscale=normed.rowscale())):
        assert (got.float() - want).abs().max() <= 3e-2 * want.abs().max()


@pytest.mark.parametrize("M,N,K", [(8, 2048, 8192), (1, 4096, 14336), (16, 2048, 2048)])
def test_split_k_partials_feed_the_norm_as_the_unsplit_product_would(M, N, K):
    """The add + RMSNorm that sums split-K partials equals the one that adds the product computed
    whole (bf16 tolerance: the float32 sums differ in order), with the engine's default split."""
    from smcdecode.backends.engine.ops import add_rms_norm_reference

    kernels, x, w, res, gamma, cfg, split = _residual_case(M, N, K)
    parts = kernels.triton_skinny_linear(x, w, config=cfg, split=split)
    h, y = kernels.triton_add_rms_norm(res, None, gamma, 1e-5, parts=parts)
    h_ref, y_ref = add_rms_norm_reference(res, x @ w.T, gamma, 1e-5)
    assert (h.float() - h_ref.float()).abs().max() <= 2e-2 * h_ref.float().abs().max()
    assert (y.float() - y_ref.float()).abs().max() <= 3e-2 * y_ref.float().abs().max()


@pytest.mark.parametrize("cfg,L,D,B", [  # every configuration kind at the benchmark's shapes (not all pairs: compiles)
    ((32, 4, 2, 1, 0), 1, 64, 8), ((128, 8, 2, 4, 0), 2, 64, 64), ((256, 4, 2, 2, 0), 9, 128, 8),
    ((16, 8, 3, 16, 0), 1, 128, 1), ((64, 4, 2, 0.01, 0), 9, 128, 64), ((64, 4, 2, 2, 1), 1, 64, 8),
    ((32, 8, 3, 0.5, 1), 9, 128, 8), ((128, 4, 2, 4, 1), 1, 128, 8), ((256, 8, 2, 1, 1), 2, 64, 8)])
def test_triton_attention_launch_configs_match_reference(cfg, L, D, B):
    """Launch configurations (BLOCK_N, warps, stages, programs per SM, page-id prefetch) at the
    benchmark's shapes: plain and RoPE-fused attention against the references; the particles of a
    request share the prompt's pages."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from smcdecode.backends.engine.kernels import triton_paged_attention, triton_rope_paged_attention
    from smcdecode.backends.engine.kernels.common import split_counters

    torch.manual_seed(L * 1000 + D + B)
    H, Hkv, PS, P = 32, 8, 16, 83
    lengths = torch.randint(300, 1290, (B,)).tolist()
    pool_k, pool_v, positions, batch = _scattered_pages(lengths, L, Hkv, D, PS, P)
    shared = (min(lengths) - L) // PS
    for r in range(B):  # rows in requests of 8 particles sharing their first pages
        batch.page_table[r, :shared] = batch.page_table[r - r % 8, :shared]
    q = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16)
    ref = reference_paged_attention(q.double(), pool_k.double(), pool_v.double(), batch)
    try:
        out = triton_paged_attention(q, pool_k, pool_v, batch, config=cfg)
    except OutOfResources as e:  # (a block too large for this GPU's shared memory: the sweep skips it too)
        pytest.skip(f"{cfg} at D={D}: {e}")
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
    qkv, cos, sin, ref, k_ref, v_ref = _rope_case(B, L, H, Hkv, D, pool_k, pool_v, positions, batch)
    for _ in range(2):  # repeated launches: the split counters are reset by each launch
        k_out, v_out = pool_k.clone(), pool_v.clone()
        try:
            out = triton_rope_paged_attention(qkv, cos, sin, k_out, v_out, batch, H, config=cfg)
        except OutOfResources as e:
            pytest.skip(f"{cfg} at D={D} with RoPE: {e}")
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-2
        assert (k_out.float() - k_ref.float()).abs().max() < 2e-2 and torch.equal(v_out, v_ref)
    assert int(split_counters(q.device, 1).abs().sum()) == 0


def _kernels_with_pdl():
    """The kernels module, or a skip where programmatic dependent launch cannot run (a GPU before
    sm_90, or a Triton without grid dependency control): there PDL is off whatever the setting."""
    pytest.importorskip("triton")
    from smcdecode.backends.engine import kernels

    if kernels.common.gdc_wait is None or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+ and Triton >= 3.3")
    return kernels


def test_pdl_chain_in_a_graph_equals_the_chain_without_pdl():
    """Programmatic dependent launch: a draft-layer chain (add + RMSNorm, skinny wqkv, wo, w13 +
    SiLU·mul, w2 on 12 layers) captured in a CUDA graph and replayed 30 times gives, bit for bit, the
    result of the same kernels launched without PDL (a kernel reading its input before the previous
    kernel finished would show as a difference)."""
    kernels = _kernels_with_pdl()
    torch.manual_seed(0)
    dim, inter, layers = 2048, 8192, 12
    ws = [(torch.randn(3072, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5,
           torch.randn(dim, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5,
           torch.randn(2 * inter, dim, device="cuda", dtype=torch.bfloat16) * dim**-0.5,
           torch.randn(dim, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5,
           torch.rand(dim, device="cuda", dtype=torch.bfloat16) + 0.5) for _ in range(layers)]
    x0 = torch.randn(8, dim, device="cuda", dtype=torch.bfloat16)

    def chain(x):
        delta = None
        for wqkv, wo, w13, w2, g in ws:
            x, n = kernels.triton_add_rms_norm(x, delta, g, 1e-5)
            q = kernels.triton_skinny_linear(n, wqkv)
            x, n = kernels.triton_add_rms_norm(x, kernels.triton_skinny_linear(q[:, :dim], wo), g, 1e-5)
            delta = kernels.triton_skinny_linear(kernels.triton_skinny_linear(n, w13, silu=True), w2)
        return x + delta

    with kernels.pdl_off():
        assert kernels.pdl_mode(x0.device) == 0
        ref = chain(x0.clone())
    assert kernels.pdl_mode(x0.device) == 1
    x = x0.clone()
    out = chain(x)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(x)
    for _ in range(30):
        x.copy_(x0)
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref)


def test_pdl_engine_outputs_equal_without_pdl():
    """SMC-SD on the engine (CUDA graphs) with every Triton kernel under PDL draws the same tokens as
    without PDL, for the same seed (exact SD and AR run without PDL either way)."""
    import contextlib

    kernels = _kernels_with_pdl()
    target = Llama.random(LlamaConfig(2048, 512, 4, 8, 2, 1024, rope_theta=10000.0), device="cuda", seed=1)
    draft = Llama.random(LlamaConfig(2048, 256, 2, 4, 2, 768, rope_theta=10000.0), device="cuda", seed=2)
    prompts = [list(range(5, 40)), list(range(100, 117))]
    outs = []
    for pdl in (False, True):
        with contextlib.nullcontext() if pdl else kernels.pdl_off():
            assert kernels.pdl_mode(torch.device("cuda")) == int(pdl)
            engine = Engine(target, draft, num_pages=512, page_size=16, max_context=256)
            smc = engine.smc_sd(prompts, particles=4, block_size=4, max_new_tokens=40, use_graphs=True, seed=3)
            sd = engine.speculative(prompts, block_size=4, max_new_tokens=30, use_graphs=True, seed=3)
            ar, _ = engine.autoregressive(prompts, max_new_tokens=20, use_graphs=True, seed=3)
        outs.append((smc.tokens.cpu(), smc.log_evidence.cpu(), sd.tokens.cpu(), ar.cpu()))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("R", [72, 576])
def test_triton_sampler_equals_the_torch_function_draw_for_draw(R):
    """The compiled kernel is ``samplers.steps.sample_and_score``: under the same noise bits, on the
    8B vocabulary in bf16 with -inf (masked) logits, the same tokens — but for float32 near-ties,
    whose two race keys must then agree to 1e-4 — and the same log-probs, normalisers and gathered
    log-probs; plain, per-row T, α with a mask (and a dead row), verify's every-9th-row draws, no draws.
    A mask given packed (``mask_bits``) draws and scores as the same mask given as bytes."""
    from smcdecode.backends.engine.kernels import triton_sample_and_score
    from smcdecode.potentials.constraint import pack_bits
    from smcdecode.samplers import steps

    V = 128_256
    g = torch.Generator(device="cuda").manual_seed(R)
    logits = (torch.randn(R, V, device="cuda", generator=g) * 3).to(torch.bfloat16)
    logits[0, ::2] = float("-inf")
    logits[1, 5:] = float("-inf")
    T = torch.rand(R, device="cuda", generator=g) + 0.5
    alpha = torch.rand(R, device="cuda", generator=g) * 2 + 0.3
    mask = torch.rand(R, V, device="cuda", generator=g) < 0.3
    mask[1, :3] = True
    mask[2] = False  # a dead row
    gather = torch.randint(0, V, (R,), device="cuda", generator=g)
    bits = torch.randint(-(2**31), 2**31 - 1, (R, V), device="cuda", generator=g, dtype=torch.int32)
    cases = [dict(temperature=0.8), dict(temperature=T), dict(temperature=T, alpha=alpha, mask=mask),
             dict(temperature=0.8, mask=mask), dict(temperature=0.8, sample_every=9),
             dict(temperature=T, draw=False)]
    for kw in cases:
        kw = dict(kw)
        temperature = kw.pop("temperature")
        fused = triton_sample_and_score(logits, temperature, torch.tensor(3, device="cuda"), gather, bits=bits, **kw)
        ref = steps.sample_and_score(logits, temperature, gather=gather, bits=bits, **kw)
        differ = (fused.token != ref.token).nonzero().flatten()
        assert len(differ) <= 2, (kw.keys(), differ)
        if len(differ):  # a near-tie in float32: both tokens' keys agree in float64
            x = logits[differ].double() / (temperature[differ, None] if isinstance(temperature, torch.Tensor)
                                           else temperature)
            a = alpha[differ, None].double() if "alpha" in kw else 1.0
            key = a * x - torch.log(-torch.log(steps.uniform_from_bits(bits[differ]).double()))
            k1 = key.gather(1, fused.token[differ, None])
            k2 = key.gather(1, ref.token[differ, None])
            assert ((k1 - k2).abs() < 1e-4).all(), (k1, k2)
        same = fused.token == ref.token
        for a_, b_ in zip(fused[1:], ref[1:]):
            assert (a_ is None) == (b_ is None)
            if a_ is not None:
                torch.testing.assert_close(a_[same], b_[same], rtol=1e-4, atol=1e-4, equal_nan=True)
        if "mask" in kw:  # the mask packed (a bit a token, as the host uploads it): the same, bit for bit
            kw["mask_bits"] = pack_bits(kw.pop("mask"))
            unmasked = torch.full((R, 2), 7.0, device="cuda")  # (written into a strided column)
            packed = triton_sample_and_score(logits, temperature, torch.tensor(3, device="cuda"), gather, bits=bits,
                                             unmasked_out=unmasked[:, 0], **kw)
            for a_, b_ in zip(packed, fused):
                assert torch.equal(a_.nan_to_num(), b_.nan_to_num())
            expect = torch.where(torch.isfinite(fused.log_norm), fused.log_prob + fused.log_norm, 0.0)
            torch.testing.assert_close(unmasked[:, 0], expect, rtol=0, atol=1e-6)
            assert (unmasked[:, 1] == 7.0).all() and unmasked[2, 0] == 0  # (row 2 is dead)


def test_wait_for_host_holds_the_stream_until_the_host_counts_and_gives_up_on_time():
    """The device waits for the host's count (pinned memory) before the kernels after it, in a graph
    replayed twice; a wait nobody answers gives up after its limit and says so in posted[1]."""
    import time

    from smcdecode.backends.engine.kernels.host import wait_for_host

    posted = torch.zeros(2, dtype=torch.long, pin_memory=True)
    seen = torch.zeros(1, dtype=torch.long, device="cuda")
    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    posted[0] = 2**62  # (the capture's warm-up passes)
    wait_for_host(posted, seen)
    torch.cuda.synchronize()
    seen.zero_()
    posted[0] = 0
    with torch.cuda.graph(graph):
        for _ in range(2):
            wait_for_host(posted, seen)
            x.add_(1)
    for replay in range(2):
        graph.replay()
        for point in range(2):
            time.sleep(0.05)
            assert not torch.cuda.current_stream().query(), (replay, point)  # (still waiting)
            posted[0] = 2 * replay + point + 1
        torch.cuda.synchronize()
        assert int(seen[0]) == 2 * replay + 2 and float(x[0]) == 2 * replay + 2
    assert int(posted[1]) == 0
    t0 = time.perf_counter()
    wait_for_host(posted, seen, give_up_s=0.2)  # (nobody posts a 5th point)
    torch.cuda.synchronize()
    assert 0.15 < time.perf_counter() - t0 < 10 and int(posted[1]) == 1 and int(seen[0]) == 5
    with pytest.raises(ValueError, match="pinned"):
        wait_for_host(torch.zeros(2, dtype=torch.long), seen)


def test_wait_for_host_waits_for_every_party_and_hand_over_flags_the_column():
    """With several parties (the engine's process and the mask workers) the device waits until every
    count, a line apart, exceeds its own; ``hand_over`` writes a column into host memory and then the
    device's count into the flag word, so a host process that sees the flag reads the column."""
    import time

    from smcdecode.backends.engine.kernels.host import hand_over, wait_for_host
    from smcdecode.backends.engine.mask_workers import shared_buffer

    class Owner:  # (the buffers stay pinned while it lives: to the test's end)
        pass

    # (host memory as the engine's sync lines and columns are: shared mappings registered with CUDA)
    owner = Owner()
    mem = shared_buffer(8 * 3 * 8, True, owner)
    posted = torch.frombuffer(mem, dtype=torch.long)
    cmem = shared_buffer(8 * 40, True, owner)
    column = torch.frombuffer(cmem, dtype=torch.long)
    seen = torch.zeros(1, dtype=torch.long, device="cuda")
    flag = posted[2 * 8:]
    assert posted.is_pinned() and column.is_pinned() and int(posted.abs().sum()) == 0
    tokens = torch.arange(37, device="cuda") * 3 + 1
    # (each kernel launched once first, every wait passing: a kernel's first launch loads its module,
    # which waits for the device, so it must not come while the device waits for this host)
    posted[0] = posted[8] = 2**62
    wait_for_host(posted, seen, parties=2)
    hand_over(tokens, column, flag, seen)
    torch.cuda.synchronize()
    assert int(flag[0]) == 1 and torch.equal(column[:37], tokens.cpu())
    seen.zero_()
    posted.zero_()
    column.zero_()
    wait_for_host(posted, seen, parties=2)
    hand_over(tokens, column, flag, seen)
    for p in (0, 8):  # (one party's count alone does not let it through)
        time.sleep(0.05)
        assert not torch.cuda.current_stream().query() and int(flag[0]) == 0, p
        posted[p] = 1
    torch.cuda.synchronize()
    assert int(seen[0]) == 1 and int(flag[0]) == 1 and int(posted[1]) == 0
    assert torch.equal(column[:37], tokens.cpu()) and int(column[37:].abs().sum()) == 0
    with pytest.raises(ValueError, match="parties"):
        wait_for_host(posted, seen, parties=4)
