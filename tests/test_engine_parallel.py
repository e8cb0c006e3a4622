"""Tensor parallelism (backends/engine/parallel.py, shards.py) on the CPU with gloo, 2 and 4 processes:
the sharded forward equals the unsharded one through prefill, extend and fork (every loader: a model
in memory, transformers, safetensors, GGUF in float32 and Q8_0); the ranks' logits are the same
bytes; the exact-enumeration tests of test_engine_statistics.py pass through a TP = 2 engine whose
ranks return identical outputs, and ``agree`` catches ranks that diverge; ``launch`` /
``Lockstep`` run calls on every rank. Marked ``gpu``: the same on 2 GPUs with NCCL, Triton kernels and CUDA
graphs (collectives captured in the round's graph)."""

from __future__ import annotations

import os
import pickle
import socket
import traceback

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from smcdecode.backends.engine import Engine, KVPool, Llama, PagedBatch, PageTable, parallel
from smcdecode.errors import SMCDecodeError

transformers = pytest.importorskip("transformers")


# ------------------------------------------------------------------------------------------------
# running a function on `world` gloo ranks


def _rank_entry(rank, world, address, fn, args, queue, backend):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        tp = parallel.init(backend, rank=rank, world=world, init_method=address)
        queue.put((rank, "ok", pickle.dumps(fn(tp, *args))))  # by value (no shared-memory handles)
    except BaseException:  # noqa: BLE001 - reported to the test process
        queue.put((rank, "error", traceback.format_exc()))
    os._exit(0)  # the result is in the pipe: skip the interpreter's (and gloo's) slow teardown


def run_ranks(world: int, fn, *args, backend: str = "gloo", timeout: float = 240.0) -> list:
    """fn(tp, *args) on ranks 0..world-1 (spawned processes); their results by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank_entry, args=(r, world, address, fn, args, queue, backend)) for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    for _ in range(world):
        rank, status, value = queue.get()
        if status == "ok":
            results[rank] = pickle.loads(value)
        else:
            errors.append(f"rank {rank}:\n{value}")
    for p in procs:
        p.join(timeout)
    assert not errors, "\n".join(errors)
    return [results[r] for r in range(world)]


# ------------------------------------------------------------------------------------------------
# tiny models


def _hf(case: str):
    torch.manual_seed(3)
    common = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=16384,
                  rms_norm_eps=1e-5, rope_theta=10000.0)
    if case == "gqa":  # vocabulary divisible by 2 and 4: vocab-parallel head
        cfg = transformers.LlamaConfig(vocab_size=96, num_attention_heads=8, num_key_value_heads=4,
                                       tie_word_embeddings=False, **common)
    else:  # tied embeddings, q/k/v biases, Llama-3 rope scaling, vocabulary 97: replicated head
        cfg = transformers.LlamaConfig(
            vocab_size=97, num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
            attention_bias=True, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            **common)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):  # (Qwen2-style: q/k/v biases; the engine has no o_proj bias)
                p.normal_(0.0, 0.3) if "o_proj" not in name else p.zero_()
    return hf


@torch.inference_mode()
def _logits(model: Llama, seed: int = 1) -> list[torch.Tensor]:
    """Logits of a 7-token prompt, then two rows extending a shared prefix by 3 tokens (copy-on-write),
    then both rows continuing row 1 after a fork (resampling) by 2 tokens."""
    PS = 4
    pool = KVPool.for_model(model.cfg, num_pages=32, page_size=PS, dtype=torch.float32, device="cpu")
    table = PageTable(rows=2, max_pages=8, num_pages=32, page_size=PS)
    g = torch.Generator().manual_seed(seed)
    V = model.cfg.vocab_size
    out = []
    prompt = torch.randint(0, V, (1, 7), generator=g)
    table.reserve(np.array([0]), np.array([7]))
    out.append(model(prompt, pool, PagedBatch.build(torch.arange(7)[None], torch.from_numpy(table.table)[:1], PS)))
    table.advance(np.array([0]), np.array([7]))
    table.share_prefix([0, 1], 0)
    src, dst = table.reserve(np.arange(2), np.full(2, 10))
    pool.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
    table.advance(np.arange(2), np.full(2, 10))
    block = torch.randint(0, V, (2, 3), generator=g)
    out.append(model(block, pool, PagedBatch.build(7 + torch.arange(3)[None].repeat(2, 1),
                                                   torch.from_numpy(table.table), PS)))
    table.fork(np.array([1, 1]))
    src, dst = table.reserve(np.arange(2), np.full(2, 12))
    pool.copy_pages(torch.tensor(src, dtype=torch.long), torch.tensor(dst, dtype=torch.long))
    more = torch.randint(0, V, (2, 2), generator=g)
    out.append(model(more, pool, PagedBatch.build(10 + torch.arange(2)[None].repeat(2, 1),
                                                  torch.from_numpy(table.table), PS), last_only=True))
    return out


def write_gguf(hf, path: str, qtype) -> None:
    """The HF model as a llama.cpp GGUF: q/k rows permuted to llama.cpp's RoPE order, 2-D weights in
    ``qtype`` (F32 or Q8_0), norms F32, Llama-3 scaling as rope_freqs."""
    import gguf

    from smcdecode.backends.engine import LlamaConfig
    from smcdecode.backends.engine.model import rope_inv_freq
    from smcdecode.backends.engine.shards import gguf_name

    c = hf.config
    cfg = LlamaConfig.from_hf(c)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    D = cfg.head_dim
    for name, t in hf.state_dict().items():
        if (name == "lm_head.weight" and c.tie_word_embeddings) or name.endswith("o_proj.bias"):
            continue
        a = t.detach().float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
            a = a.reshape(-1, 2, D // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(a, dtype=np.float32))
    if cfg.rope_scaling is not None:
        base = rope_inv_freq(LlamaConfig(1, 1, 1, 1, 1, 1, head_dim=D, rope_theta=cfg.rope_theta))
        w.add_tensor("rope_freqs.weight", (base / rope_inv_freq(cfg)).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ------------------------------------------------------------------------------------------------
# the sharded forward equals the unsharded one


@torch.no_grad()
def _forward_rank(tp, files: dict, cases: tuple[str, ...]):
    """Per case, this rank's shard from each loader against the whole model (max |Δ logit|), and the
    shard's logits (to compare across ranks). No transformers model here: spawned ranks start fast."""
    from safetensors.torch import load_file

    from smcdecode.backends.engine.shards import GGUFReader, StateDictReader

    report = {}
    for case in cases:
        full = Llama.from_safetensors(files[case + "/st"], dtype=torch.float32)
        ref = _logits(full)
        state_dict = load_file(os.path.join(files[case + "/st"], "model.safetensors"))
        models = {"shard": parallel.shard(full, tp),
                  "state_dict": parallel.build(StateDictReader(full.cfg, state_dict), tp, torch.float32),
                  "safetensors": parallel.load(files[case + "/st"], tp, torch.float32),
                  "gguf_f32": parallel.load(files[case + "/f32"], tp, torch.float32)}
        for name, m in models.items():
            assert m.cfg.n_heads * tp.world == full.cfg.n_heads
            got = _logits(m)
            report[f"{case}/{name}"] = max(float((a - b).abs().max()) for a, b in zip(got, ref))
            report[f"{case}/{name}/logits"] = [t.clone() for t in got]
        report[f"{case}/kv_heads"] = KVPool.for_model(models["shard"].cfg, 4, 4, torch.float32, "cpu").kv.shape[3]
        # Q8_0: the sharded GGUF equals the unsharded GGUF (the same dequantised values, however sliced)
        one = parallel.TensorParallel(0, 1, torch.device("cpu"))
        q8 = _logits(parallel.build(GGUFReader(files[case + "/q8"]), one, torch.float32))
        got = _logits(parallel.load(files[case + "/q8"], tp, torch.float32))
        report[f"{case}/gguf_q8"] = max(float((a - b).abs().max()) for a, b in zip(got, q8))
        report[f"{case}/gguf_q8_vs_f32"] = max(float((a - b).abs().max()) for a, b in zip(q8, ref))
    return report


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    gguf = pytest.importorskip("gguf")  # (the GPU machines lack it: the tests that need files skip there)
    d = tmp_path_factory.mktemp("tp_models")
    files = {}
    for case in ("gqa", "tied_bias"):
        hf = _hf(case)
        hf.save_pretrained(d / case, safe_serialization=True)
        files[case + "/st"] = str(d / case)
        for tag, q in (("f32", gguf.GGMLQuantizationType.F32), ("q8", gguf.GGMLQuantizationType.Q8_0)):
            files[f"{case}/{tag}"] = str(d / f"{case}-{tag}.gguf")
            write_gguf(hf, files[f"{case}/{tag}"], q)
    return files


# 4 ranks: the GQA case only (4 processes on CI's 2 cores are slow); its Q8_0 column slices (16 of
# o_proj's 64, 24 of down_proj's 96) are not 32-aligned, so they take the blocks at both ends whole
@pytest.mark.parametrize("world, cases", [(2, ("gqa", "tied_bias")), (4, ("gqa",))])
def test_sharded_forward_equals_unsharded(world, cases, model_files):
    reports = run_ranks(world, _forward_rank, model_files, cases)
    r0 = reports[0]
    for case in cases:
        for name in ("shard", "state_dict", "safetensors", "gguf_f32"):
            assert r0[f"{case}/{name}"] < 1e-5, (case, name, r0[f"{case}/{name}"])
            for r in reports[1:]:  # every rank has the same full logits, bit for bit
                for a, b in zip(r0[f"{case}/{name}/logits"], r[f"{case}/{name}/logits"]):
                    assert torch.equal(a, b), (case, name)
        assert r0[f"{case}/kv_heads"] == 4 // world  # the KV pool holds this rank's heads
        assert r0[f"{case}/gguf_q8"] < 1e-5
        assert 1e-5 < r0[f"{case}/gguf_q8_vs_f32"] < 0.05  # quantised: near the model, not equal to it


class _Counting:
    """A shards reader that counts the elements each read returns, by weight."""

    def __init__(self, reader):
        self.reader, self.config, self.read_elements = reader, reader.config, {}

    def has(self, name):
        return self.reader.has(name)

    def read(self, name, *slices):
        w = self.reader.read(name, *slices)
        self.read_elements[name] = self.read_elements.get(name, 0) + w.numel()
        return w


@torch.no_grad()
def _reads_rank(tp, files: dict):
    """Elements each loader read for this rank's shard (by weight), and elements the GGUF reader
    dequantised (every call of gguf's dequantize counted)."""
    import gguf

    from smcdecode.backends.engine.shards import GGUFReader, SafetensorsReader

    out = {}
    for name, reader in (("safetensors", SafetensorsReader(files["gqa/st"])), ("gguf_q8", GGUFReader(files["gqa/q8"]))):
        counting = _Counting(reader)
        dequantised = [0]
        deq = gguf.quants.dequantize

        def counted(data, qtype, deq=deq, dequantised=dequantised):
            w = deq(data, qtype)
            dequantised[0] += w.size
            return w

        gguf.quants.dequantize = counted
        try:
            parallel.build(counting, tp, torch.float32)
        finally:
            gguf.quants.dequantize = deq
        out[name] = (counting.read_elements, dequantised[0])
    return out


def test_each_rank_reads_only_its_slices(model_files):
    """Safetensors and GGUF: a rank reads the replicated weights (embedding, norms) whole and exactly
    1/world of every other weight; GGUF dequantises exactly that plus the rest of the quantisation
    blocks at the ends of its column slices."""
    from safetensors.torch import load_file

    whole = {k: v.numel() for k, v in load_file(os.path.join(model_files["gqa/st"], "model.safetensors")).items()}
    replicated = {k for k in whole if k == "model.embed_tokens.weight" or k.endswith("norm.weight")}
    for world in (2, 4):
        for rank, report in enumerate(run_ranks(world, _reads_rank, model_files)):
            for loader, (read, dequantised) in report.items():
                assert set(read) == set(whole), (loader, set(whole) ^ set(read))
                for k, n in read.items():
                    assert n == (whole[k] if k in replicated else whole[k] // world), (loader, rank, k, n, whole[k])
                if loader == "gguf_q8":  # Q8_0 blocks of 32 columns; o_proj and down_proj are sliced by column
                    extra = 0
                    for k, n in whole.items():
                        if k.endswith(("o_proj.weight", "down_proj.weight")):
                            cols = n // 64  # 64 rows (the model width)
                            c0, c1 = rank * cols // world, (rank + 1) * cols // world
                            extra += 64 * ((-(-c1 // 32) - c0 // 32) * 32 - (c1 - c0))
                    assert dequantised == sum(read.values()) + extra, (rank, dequantised, extra)


@torch.no_grad()
def _triton_rank(tp):
    """This rank's shard on the Triton paths (in Triton's interpreter): fused RoPE + KV write +
    attention over its heads, skinny products, split-K wo/w2 partials summed before the all-reduce,
    the embedding + norm kernel's first ``Normed``; against the whole model's torch reference."""
    from smcdecode.backends.engine import LlamaConfig
    from smcdecode.backends.engine import ops as M
    from smcdecode.backends.engine.shards import RandomReader

    M.use_skinny = lambda x, w, triton, silu=False: triton
    M.split_config = lambda x, w, triton, rows=None: ((16, 16, 32, 4, 1), 2) if triton else None
    cfg = LlamaConfig(64, 128, 2, 4, 2, 96, rope_theta=10000.0)  # head_dim 32
    one = parallel.TensorParallel(0, 1, torch.device("cpu"))
    models = {"whole": parallel.build(RandomReader(cfg, 5), one, torch.float32),
              "shard": parallel.build(RandomReader(cfg, 5), tp, torch.float32)}
    seen = []
    for blk in models["shard"].layers:  # which partials reach the all-reduce
        blk.reduce = (lambda f: lambda partial: (seen.append(type(partial).__name__), f(partial))[1])(blk.reduce)
    outs = {"partials": seen}
    for name, model in models.items():
        PS = 4
        pool = KVPool.for_model(model.cfg, 16, PS, torch.float32, "cpu", triton=name == "shard")
        table = PageTable(rows=2, max_pages=6, num_pages=16, page_size=PS)
        table.reserve(np.array([0, 1]), np.array([15, 15]))
        pt = torch.from_numpy(table.table)
        ids = torch.randint(0, 64, (2, 15), generator=torch.Generator().manual_seed(2))
        outs[name] = [model(ids[:, a:b], pool, PagedBatch.build(torch.arange(a, b)[None].repeat(2, 1), pt, PS))
                      for a, b in ((0, 12), (12, 14), (14, 15))]
    return outs


def test_tp2_triton_kernels_interpreted_match_the_whole_reference():
    pytest.importorskip("triton")
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter runs only without a GPU (TRITON_INTERPRET=1, set by conftest)")
    r0, r1 = run_ranks(2, _triton_rank)
    assert "SplitSum" in r0["partials"] and len(r0["partials"]) == 3 * 2 * 2  # 3 forwards × 2 layers × wo, w2
    for a, b, c in zip(r0["shard"], r0["whole"], r1["shard"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert torch.equal(a, c)


@torch.no_grad()
@pytest.mark.parametrize("case", ["gqa", "tied_bias"])
def test_one_rank_is_the_plain_model_and_matches_transformers(case):
    hf = _hf(case)
    one = parallel.TensorParallel(0, 1, torch.device("cpu"))
    model = parallel.from_hf(hf, one, torch.float32)
    assert all(b.reduce is None for b in model.layers) and not model._forward_hooks  # no collectives at all
    whole = Llama.from_hf(hf, dtype=torch.float32)
    for a, b in zip(model.state_dict().values(), whole.state_dict().values()):
        assert torch.equal(a, b)
    tokens = torch.randint(0, hf.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    logits = model(tokens, KVPool.for_model(model.cfg, 8, 4, torch.float32, "cpu"),
                   PagedBatch.build(torch.arange(9)[None], torch.arange(1, 4, dtype=torch.int32)[None], 4))
    torch.testing.assert_close(logits, hf(tokens).logits, rtol=1e-4, atol=1e-4)


def test_bad_tensor_parallel_sizes_name_the_fix():
    cfg = Llama.from_hf(_hf("gqa"), dtype=torch.float32).cfg
    with pytest.raises(SMCDecodeError, match=r"tensor_parallel=3 does not divide the target's 8 attention heads: "
                                             r"use one of \[1, 2, 4\]"):
        parallel.local_config(cfg, 3)
    with pytest.raises(SMCDecodeError, match="positive integer"):
        parallel.local_config(cfg, 0)
    with pytest.raises(SMCDecodeError, match="neither a .gguf file nor a directory"):
        parallel.load("/nonexistent/model", parallel.TensorParallel(0, 1, torch.device("cpu")))


# ------------------------------------------------------------------------------------------------
# exact enumeration through a TP = 2 engine


def _stats_rank(tp):
    import test_engine_statistics as S

    target_hf, draft_hf = S._tiny_hf(0, 2), S._tiny_hf(0, 2)
    with torch.no_grad():
        draft_hf.lm_head.weight.add_(torch.randn(draft_hf.lm_head.weight.shape,
                                                 generator=torch.Generator().manual_seed(1)) * 0.2)
    target = parallel.from_hf(target_hf, tp, torch.float32)
    draft = Llama.from_hf(draft_hf, dtype=torch.float32)  # replicated
    engine = Engine(target, draft, num_pages=16000, page_size=4, max_context=32)
    assert engine.kv_t.kv.shape[3] == 2 // tp.world and engine.kv_d.kv.shape[3] == 2
    sd = engine.speculative([[3, 1, 4, 1, 5]] * 20, samples=250, block_size=2, max_new_tokens=3, seed=5)
    smc = engine.smc_sd([[2, 7, 1, 6]] * 1500, particles=4, block_size=1, max_new_tokens=3, ess_threshold=1.0,
                        seed=3)
    parallel.agree(tp, smc)  # the ranks agree (raises otherwise) ...
    try:  # ... and a result that differs on one rank is caught on every rank
        parallel.agree(tp, smc.log_weights + (1e-9 if tp.rank else 0.0))
        caught = None
    except SMCDecodeError as e:
        caught = str(e)
    return sd, smc, caught


def test_tp2_engine_passes_the_exact_enumeration_tests():
    import test_engine_statistics as S

    (sd, smc, caught), (sd1, smc1, caught1) = run_ranks(2, _stats_rank)
    assert caught is not None and "ranks disagree" in caught and caught1 == caught
    assert parallel.digest(sd) == parallel.digest(sd1) and parallel.digest(smc) == parallel.digest(smc1)
    assert torch.equal(smc.tokens, smc1.tokens) and torch.equal(smc.log_weights, smc1.log_weights)
    hf = S._tiny_hf(0, 2)
    # exact speculative decoding samples the target exactly
    prompt, n, reps, per = [3, 1, 4, 1, 5], 3, 20, 250
    exact = S._exact(hf, prompt, n)
    assert (sd.lengths == n).all() and 0 < int(sd.accepted.sum()) < reps * per * n
    seqs = [tuple(t) for t in sd.tokens.numpy().reshape(-1, n).tolist()]
    for m in S.MARGINALS:
        z = S._z_scores(np.full((reps, per), 1.0 / per), seqs, exact, m)
        assert len(z) and np.abs(z).max() < 4.5, z.round(2)
    # SMC-SD's Ẑ-weighted particles are unbiased for the target; E[Ẑ] = Z = 1
    exact = S._exact(hf, [2, 7, 1, 6], n)
    assert (smc.lengths == n).all() and smc.rounds == 2
    seqs = [tuple(t) for t in smc.tokens.numpy().reshape(-1, n).tolist()]
    contrib = torch.exp(smc.log_evidence[:, None] - torch.logsumexp(smc.log_weights, 1, keepdim=True)
                        + smc.log_weights).numpy()
    values = contrib.reshape(30, -1) / (1500 // 30)
    for m in S.MARGINALS:
        z = S._z_scores(values, seqs, exact, m)
        assert len(z) and np.abs(z).max() < 4.5, z.round(2)
    zhat = smc.log_evidence.exp().numpy()
    assert abs(zhat.mean() - 1.0) < 4.5 * zhat.std(ddof=1) / np.sqrt(len(zhat))


# ------------------------------------------------------------------------------------------------
# launch / Lockstep / follow, and the agreement check


def build_tiny_engine(tp, files):
    target = parallel.load(files["gqa/st"], tp, torch.float32)
    draft = Llama.from_safetensors(files["gqa/st"], dtype=torch.float32)  # replicated
    return Engine(target, draft, num_pages=256, page_size=4, max_context=64)


def _count_rows(engine, state, n):
    state["calls"] = state.get("calls", 0) + 1
    return torch.tensor([state["calls"], n, engine.kv_t.kv.shape[3]])


def test_launch_runs_every_call_on_every_rank(model_files):
    lock = parallel.launch(2, build_tiny_engine, model_files, backend="gloo")
    try:
        tokens, _ = lock.autoregressive([[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=5, samples=2, seed=7)
        again, _ = lock.autoregressive([[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=5, samples=2, seed=7)
        assert tokens.shape == (4, 5) and torch.equal(tokens, again)  # seeds reproduce
        assert lock.run(_count_rows, 3).tolist() == [1, 3, 2]  # state kept per rank, heads split
        assert lock.run(_count_rows, 4).tolist() == [2, 4, 2]
        with pytest.raises(SMCDecodeError, match="max_new_tokens|prompt"):
            lock.autoregressive([[1]], max_new_tokens=0)  # a bad call fails on every rank; the next still runs
        assert lock.run(_count_rows, 5).tolist() == [3, 5, 2]
    finally:
        lock.close()
    with pytest.raises(SMCDecodeError, match="closed"):
        lock.run(_count_rows, 1)


@pytest.mark.slow
def test_bench_tp_smoke_run_on_two_cpu_ranks(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           os.path.join(root, "benchmarks", "bench_tp.py"), "--tiny", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "tp_tiny_tp2.json").read_text())
    assert not res["errors"] and res["gpus"] == 2 and res["repeats"] == 2
    (check,) = res["forward_check"]
    assert check["max_abs_err_over_max_logit"] < 1e-5 and check["argmax_agreement"] == 1.0
    systems = [r["system"] for r in res["runs"]]
    assert systems == ["engine TP=2 AR"] * 2 + ["engine TP=2 SMC-SD N=8 K=8"] * 2 + ["engine TP=2 exact SD K=4"] * 2
    assert all(len(r["seconds"]) == 2 and r["first_call_s"] > 0 for r in res["runs"])
    smc = [r for r in res["runs"] if r.get("N")]
    assert all(r["speedup_over_tp_ar"] > 0 and r["rounds"] == 2 for r in smc)
    assert "engine TP=2 SMC-SD N=8 K=8 | 1 |" in proc.stdout


def _bench_errors_rank(tp):
    import bench_tp

    def fails_on_rank_1():
        if tp.rank == 1:
            raise RuntimeError("rank 1 broke")
        return "fine"

    return bench_tp.on_every_rank(tp, "a stage", fails_on_rank_1, timeout=60)


def test_bench_tp_reports_an_error_of_any_rank_on_every_rank(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             "benchmarks"))
    (v0, e0), (v1, e1) = run_ranks(2, _bench_errors_rank)
    assert v0 == "fine" and v1 is None
    assert e0 == e1 and len(e0) == 1 and e0[0].startswith("rank 1: a stage:") and "rank 1 broke" in e0[0]


def test_bench_tp_deadline_ends_a_stuck_rank_with_a_message():
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import time, bench_tp\nwith bench_tp.deadline(1.0, 'waiting for rank 1', 0):\n    time.sleep(30)\n"
            "print('not reached')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.path.join(root, 'benchmarks')}"})
    assert proc.returncode == 1 and "not reached" not in proc.stdout
    assert "'waiting for rank 1' still running after 1 s" in proc.stderr
    assert 'File "<string>", line 3' in proc.stderr  # the stuck thread's stack


# ------------------------------------------------------------------------------------------------
# the real default model: its GGUF (Q4_1, 9 heads, 3 KV heads) sharded over 3 ranks


@torch.no_grad()
def _smollm2_rank(tp, source, tokens):
    """Logits of ``tokens`` from this rank's shard of the GGUF at ``source`` (its rows and columns
    only), or from ``source`` itself (an unsharded Llama)."""
    model = parallel.load(source, tp, torch.float32) if isinstance(source, str) else source
    assert model.cfg.n_heads * tp.world == 9 and model.cfg.n_kv_heads * tp.world == 3
    n = tokens.shape[1]
    pool = KVPool.for_model(model.cfg, 8, 16, torch.float32, "cpu")
    pt = torch.arange(1, 1 + -(-n // 16), dtype=torch.int32)[None]
    return model(tokens, pool, PagedBatch.build(torch.arange(n)[None], pt, 16))


@pytest.mark.slow
def test_smollm2_gguf_sharded_over_three_ranks_equals_the_transformers_load():
    import smcdecode as sd
    from smcdecode.models import SMOLLM2_GGUF, _smollm2_dir

    path = str(_smollm2_dir() / SMOLLM2_GGUF)
    hf = sd.load_model(path)  # transformers' GGUF loader, dequantised whole
    tokens = torch.tensor([hf.prompt_ids([{"role": "user", "content": "What is the capital of France?"}])])
    with torch.no_grad():
        ref = _smollm2_rank(parallel.TensorParallel(0, 1, torch.device("cpu")), Llama.from_hf(hf, dtype=torch.float32),
                            tokens)
        ref_hf = hf.hf(tokens).logits
    assert (ref - ref_hf).abs().max() < 1e-3
    logits = run_ranks(3, _smollm2_rank, path, tokens)
    assert all(torch.equal(logits[0], x) for x in logits[1:])
    assert (logits[0] - ref).abs().max() < 1e-3, (logits[0] - ref).abs().max()
    assert int(logits[0][0, -1].argmax()) == int(ref[0, -1].argmax())


# ------------------------------------------------------------------------------------------------
# GPU: NCCL, Triton kernels, CUDA graphs (run by hand on a machine with >= 2 GPUs)

def _gpu_rank(tp):
    from smcdecode.backends.engine import LlamaConfig
    from smcdecode.backends.engine.shards import RandomReader

    cfg = LlamaConfig(1024, 256, 2, 8, 4, 512, rope_theta=10000.0)
    one = parallel.TensorParallel(0, 1, tp.device)
    full = parallel.build(RandomReader(cfg, 3, tp.device), one, torch.bfloat16)
    sharded = parallel.random(cfg, tp, torch.bfloat16, seed=3)
    draft = parallel.build(RandomReader(LlamaConfig(1024, 128, 1, 4, 2, 256, rope_theta=10000.0),
                                                        4, tp.device), one, torch.bfloat16)
    prompts = [list(range(5, 40)), list(range(50, 70))]
    outs = {}
    for name, target in (("tp", sharded), ("full", full)):
        engine = Engine(target, draft, num_pages=2048, page_size=16, max_context=256)
        for graphs in (True, False):  # captured rounds (collectives in the graph) vs eager: the same draws
            outs[name, graphs] = (engine.smc_sd(prompts, particles=4, block_size=4, max_new_tokens=40, seed=1,
                                                use_graphs=graphs),
                                  engine.speculative(prompts, block_size=3, max_new_tokens=20, seed=2,
                                                     use_graphs=graphs),
                                  engine.autoregressive(prompts, max_new_tokens=20, seed=3, use_graphs=graphs)[0])
            torch.cuda.synchronize()
    return ({k: parallel.digest(v) for k, v in outs.items()},
            [t.float().cpu() for t in _gpu_logits(sharded)], [t.float().cpu() for t in _gpu_logits(full)])


@torch.inference_mode()
def _gpu_logits(model):
    PS = 16
    pool = KVPool.for_model(model.cfg, 8, PS, torch.bfloat16, model.inv_freq.device)
    tokens = torch.arange(3, 40, device=model.inv_freq.device)[None]
    pt = torch.arange(1, 4, dtype=torch.int32, device=tokens.device)[None]
    return [model(tokens, pool, PagedBatch.build(torch.arange(37, device=tokens.device)[None], pt, PS))]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_on_gpus_graphs_equal_eager_and_ranks_agree():
    (d0, tp0, full0), (d1, tp1, _) = run_ranks(2, _gpu_rank, backend="nccl")
    assert d0 == d1  # both ranks drew the same particles, tokens and weights
    assert d0["tp", True] == d0["tp", False]  # the captured round (NCCL in the graph) == eager
    assert d0["full", True] == d0["full", False]
    assert torch.equal(tp0[0], tp1[0])
    err = (tp0[0] - full0[0]).abs().max() / full0[0].abs().max()
    assert err < 0.05, err  # bf16: sharded sums round differently
