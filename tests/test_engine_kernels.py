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


@pytest.mark.parametrize("L,H,Hkv,D,lengths", [(1, 32, 8, 128, [1, 700, 33]), (2, 32, 8, 64, [2, 65, 300]),
                                               (9, 32, 8, 128, [9, 256, 1290]), (5, 8, 8, 64, [17, 40, 5])])
def test_triton_paged_attention_matches_reference(L, H, Hkv, D, lengths):
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels import triton_paged_attention

    torch.manual_seed(L * 100 + D)
    PS, P = 16, 96
    B = len(lengths)
    num_pages = B * P + 1
    pool_k = torch.randn(num_pages, Hkv, PS, D, device="cuda", dtype=torch.bfloat16)
    pool_v = torch.randn(num_pages, Hkv, PS, D, device="cuda", dtype=torch.bfloat16)
    pages = torch.randperm(num_pages - 1, device="cuda")[: B * P].view(B, P) + 1  # scattered pages
    pt = pages.to(torch.int32)
    seq = torch.tensor(lengths, device="cuda")
    positions = seq[:, None] - L + torch.arange(L, device="cuda")
    batch = PagedBatch.build(positions, pt, PS)
    q = torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16)
    out = triton_paged_attention(q, pool_k, pool_v, batch)
    ref = reference_paged_attention(q.double(), pool_k.double(), pool_v.double(), batch)
    err = (out.double() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all() and err < 1e-2, float(err)


@torch.inference_mode()
def test_bf16_engine_logprobs_match_hf_and_graph_round_runs():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                                   rope_theta=10000.0)
    hf = transformers.LlamaForCausalLM(cfg).eval().cuda()
    model = Llama.from_hf(hf, dtype=torch.bfloat16, device="cuda")
    PS = 16
    pool = KVPool.for_model(model.cfg, num_pages=64, page_size=PS, dtype=torch.bfloat16, device="cuda",
                            attention_backend="triton")
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


@pytest.mark.parametrize("B,L,H,Hkv,S", [(3, 9, 32, 8, 5), (2, 1, 8, 8, 1), (4, 2, 32, 8, 16)])
def test_triton_merge_splits_matches_reference(B, L, H, Hkv, S):
    pytest.importorskip("triton")
    from smcdecode.backends.engine.kernels import _merge_splits_kernel, merge_splits_reference

    torch.manual_seed(B * 7 + S)
    G, D = H // Hkv, 128
    block_m = max(16, 1 << (L * G - 1).bit_length())
    o_part = torch.randn(B * Hkv, S, block_m, D, device="cuda")
    lse = torch.randn(B * Hkv, S, block_m, device="cuda") * 3
    lse[:, S // 2 + 1 :] = float("-inf")  # splits past the row's length
    out = torch.full((B, L, H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    _merge_splits_kernel[(B * Hkv * L * G,)](o_part, lse, out, L=L, G=G, H=H, HKV=Hkv, D=D, NSPLIT=S,
                                             NSPLIT_P2=1 << (S - 1).bit_length(), BLOCK_M=block_m, num_warps=1)
    ref = merge_splits_reference(o_part.double(), lse.double(), B, L, H, torch.float64)
    err = (out.double() - ref).norm() / ref.norm()
    assert torch.isfinite(out).all() and err < 1e-2, float(err)
