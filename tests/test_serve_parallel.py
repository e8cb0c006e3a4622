"""``smcdecode serve --tensor-parallel 2`` on the CPU (two gloo ranks): a tiny random Llama with the
default model's tokenizer, its target sharded over the ranks and its first layer as the draft, served
through the openai client; the server's shutdown and death release the other rank; bad values."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_serve import ROOT, Server, _stream_text

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer Llama (8 heads, 4 key/value heads) over SmolLM2's tokenizer, saved as safetensors."""
    import torch
    from transformers import AutoTokenizer

    from smcdecode.models import SMOLLM2_GGUF, _smollm2_dir, chatml_eos

    out = tmp_path_factory.mktemp("tp_serve") / "tiny"
    tok = chatml_eos(AutoTokenizer.from_pretrained(_smollm2_dir(), gguf_file=SMOLLM2_GGUF))
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                                   rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return str(out)


def _start(model: str) -> Server:
    return Server("--model", model, "--draft", "truncated:1", "--tensor-parallel", "2", "--device", "cpu",
                  "--slots", "2", "--engine-particles", "2", "--engine-context", "256", "--particles", "2",
                  "--block-size", "2", "--max-block-size", "2")


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` that run Python (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"multiprocessing" in cmd and b"spawn_main" in cmd:
            out.append(int(stat.parent.name))
    return out


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]:
            return True
        time.sleep(0.2)
    return False


def test_two_ranks_serve_every_plain_strategy(tiny_model):
    s = _start(tiny_model)
    try:
        (rank1,) = _children(s.proc.pid)  # the follower rank
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        for strategy in ("smc", "ar", "sd"):
            r = s.client.chat.completions.create(model=s.model, messages=messages, max_tokens=5, temperature=0.7,
                                                 extra_body={"strategy": strategy})
            c = r.choices[0]
            assert isinstance(c.message.content, str) and c.finish_reason in ("stop", "length")
            assert r.model_extra["smc"]["strategy"] == strategy
            assert 1 <= r.usage.completion_tokens <= 5 and (c.finish_reason == "stop" or r.usage.completion_tokens == 5)
        stream = s.client.chat.completions.create(model=s.model, messages=messages, max_tokens=6, temperature=0.7,
                                                  stream=True, extra_body={"return_particles": True})
        text, _, reasons, extra = _stream_text(stream)
        particles = extra["smc"]["runs"][0]["particles"]
        assert len(particles) == 2 and text in [p["text"] for p in particles if p["weight"] > 0]
        assert reasons[0] in ("stop", "length")
        # a constrained request needs the whole model: refused with a message, and the server goes on
        status, body = s.post("/v1/chat/completions", {"model": s.model, "messages": messages, "max_tokens": 4,
                                                       "response_format": {"type": "json_object"}})
        assert status == 400 and "plain requests only" in body["error"]["message"]
        m = s.wait_idle()
        assert m["smcdecode_kv_pages_in_use"] == 0 and m["smcdecode_rounds_total"] > 0
    finally:
        s.stop()  # SIGTERM to the server: rank 0 shuts down and releases rank 1
    assert _gone(rank1, 30)


def test_the_other_rank_exits_when_the_server_is_killed(tiny_model):
    s = _start(tiny_model)
    (rank1,) = _children(s.proc.pid)
    s.proc.kill()
    s.proc.wait(timeout=30)
    s.log.close()
    assert _gone(rank1, 30)


def _serve_error(*args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "smcdecode", "serve", *args], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    return p.stderr


def test_bad_tensor_parallel_values_name_the_fix(tiny_model):
    import torch

    assert "--tensor-parallel must be >= 1, got 0" in _serve_error("--tensor-parallel", "0")
    err = _serve_error("--model", tiny_model, "--tensor-parallel", "3", "--device", "cpu")
    assert "tensor_parallel=3 does not divide the target's 8 attention heads: use one of [1, 2, 4]" in err
    err = _serve_error("--model", tiny_model, "--tensor-parallel", "2", "--device", "cpu")  # --draft default
    assert "--draft 'default' with --tensor-parallel" in err and "truncated:L" in err
    err = _serve_error("--model", tiny_model, "--tensor-parallel", "2", "--device", "cpu", "--backend", "reference")
    assert "--tensor-parallel runs the engine" in err
    if torch.cuda.device_count() < 4:
        err = _serve_error("--model", tiny_model, "--draft", "truncated:1", "--tensor-parallel", "4",
                           "--device", "cuda")
        assert f"--tensor-parallel 4 needs 4 GPUs; {torch.cuda.device_count()} are visible" in err
    help_text = subprocess.run([sys.executable, "-m", "smcdecode", "serve", "--help"], capture_output=True, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120).stdout
    assert "--tensor-parallel N" in help_text and "divide the target's attention heads" in " ".join(help_text.split())


def test_local_ids_reach_other_ranks_as_their_key():
    import pickle

    from smcdecode.backends.engine import parallel

    job = object()
    a = parallel.Local(7, (job, 1))
    b = pickle.loads(pickle.dumps(a))
    assert a[0] is job and len(b) == 0 and b.key == 7
    assert a == b and hash(a) == hash(b) and a != parallel.Local(8, (job, 1))
    assert parallel.digest([a]) == parallel.digest([b]) != parallel.digest([parallel.Local(8)])
