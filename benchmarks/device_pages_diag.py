"""Device pages vs host pages on CUDA: graphs on/off, Triton on/off; and host vs host (determinism).

    PYTHONPATH=$PWD python benchmarks/device_pages_diag.py      # one CUDA GPU, ~20 s

Prints, per case of tests/test_engine_device_pages.py, whether tokens and log Z agree (session 3 on
an H200: equal without graphs, different with graphs; docs/engine.md)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_engine_device_pages as T  # noqa: E402  (its models and cases)


def cmp(a, b) -> str:
    same_tok = torch.equal(a.tokens.cpu(), b.tokens.cpu())
    dz = float((a.log_evidence.cpu() - b.log_evidence.cpu()).abs().max())
    first = None
    if not same_tok:
        d = (a.tokens.cpu() != b.tokens.cpu()).nonzero()
        first = int(d[:, -1].min())
    return f"tokens_equal={same_tok} first_diff_pos={first} max|dlogZ|={dz:.2e}"


for name, case in T.CASES.items():
    prompts, N, K, n, eos, tau, PS = case
    for graphs in (True, False):
        for triton in ("1", "0"):
            os.environ["SMCDECODE_TRITON"] = triton
            try:
                h1, _ = T._run("cuda", prompts, N, K, n, eos, tau, PS, device_pages=False, use_graphs=graphs)
                h2, _ = T._run("cuda", prompts, N, K, n, eos, tau, PS, device_pages=False, use_graphs=graphs)
                d1, _ = T._run("cuda", prompts, N, K, n, eos, tau, PS, device_pages=True, use_graphs=graphs)
                print(f"{name[:28]:28s} graphs={graphs} triton={triton} | host/host {cmp(h1, h2)} | host/dev {cmp(h1, d1)}", flush=True)
            except Exception as e:
                print(name, graphs, triton, "ERROR", repr(e)[:300], flush=True)
