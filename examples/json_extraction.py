"""JSON extraction to a schema with the default model (SmolLM2-135M-Instruct), on the CPU.

A pydantic model is the schema; generate_json returns parsed objects. SMC targets the model's
global conditional p(x | x valid); locally-masked decoding (what constrained decoders usually do)
renormalises over the allowed tokens at every step instead. Both are shown with the
log-probability per token the model gives to each output.

    python examples/json_extraction.py        # about a minute
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel

import smcdecode as sd
from smcdecode.potentials import LMReward
from smcdecode.structured import generate_json


class Person(BaseModel):
    name: str
    city: str
    age: int
    job: Literal["engineer", "doctor", "teacher", "artist"]


TEXTS = [
    "Maria Lopez, 34, works as a doctor in Madrid.",
    "Tom is a teacher from Leeds. He turned 51 last spring.",
]


def log_p_per_token(model, out, temperature: float) -> float:
    """log p_T(output | prompt) / tokens: how likely the model finds what was returned."""
    tokens = out.result.sample_tokens
    if not tokens:
        return float("nan")
    return float(LMReward(model, out.prompt_ids, temperature=temperature).score_tokens([tokens])[0]) / len(tokens)


def main() -> None:
    torch.set_num_threads(1)  # predictable on a shared machine; raise it on your own
    model = sd.load_model()
    for text in TEXTS:
        messages = [{"role": "user", "content": f"Extract the person described in this text: {text}"}]
        print(f"\n=== {text}")
        for strategy, particles in [("masked", 1), ("smc", 8)]:
            out = generate_json(
                model,
                messages,
                Person,
                strategy=strategy,
                particles=particles,
                max_new_tokens=48,
                temperature=0.7,
                seed=0,
            )
            lp = log_p_per_token(model, out, 0.7)
            print(f"{strategy:>6} N={particles}: {out.value!r}  (log p/token {lp:.2f}, {out.result.seconds:.1f} s)")
        print("  SMC particles (weight, value):")
        for v, w in sorted(zip(out.values, out.weights.tolist()), key=lambda p: -p[1]):
            if w > 0:
                print(f"    {w:.3f}  {v!r}")


if __name__ == "__main__":
    main()
