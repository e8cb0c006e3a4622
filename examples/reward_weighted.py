"""Reward-weighted decoding with the default model, on the CPU.

1. A keyword and length reward: π(x) ∝ p(x) · exp(β·R(x)) with R rewarding sea words and
   penalising length, computed on a batch of texts per round (batched=True) and applied as a
   twist (mode="prefix") so SMC resamples towards it early.
2. A reward from a second prompt (prompt intersection): π(x) ∝ p(x | prompt A) · p(x | prompt B)^β,
   text that both prompts find likely, with LMReward.

    python examples/reward_weighted.py        # two to three minutes
"""

from __future__ import annotations

import torch

import smcdecode as sd
from smcdecode.potentials import LMReward

SEA_WORDS = ("sea", "ocean", "beach", "wave", "island", "coast")


def keyword_length_reward(texts: list[str]) -> list[float]:
    """+1 per sea word present, −0.01 per character: one call per round for all particles."""
    return [sum(w in t.lower() for w in SEA_WORDS) - 0.01 * len(t) for t in texts]


def main() -> None:
    torch.set_num_threads(1)  # predictable on a shared machine; raise it on your own
    model = sd.load_model()
    question = [{"role": "user", "content": "Write one sentence about your favourite place."}]

    print("=== 1. keyword + length reward (β = 2, a prefix twist)")
    plain = sd.SMC(sd.LM(model, temperature=0.8), particles=8).run(question, max_new_tokens=32, seed=0, progress=False)
    print(f"no reward: {plain.text!r}")
    reward = sd.Reward(keyword_length_reward, beta=2.0, mode="prefix", batched=True, name="sea-words-short")
    tilted = sd.SMC(sd.LM(model, temperature=0.8) * reward, particles=8).run(
        question, max_new_tokens=32, seed=0, progress=False
    )
    print(f"rewarded:  {tilted.text!r}")
    print(tilted.summary())

    print("\n=== 2. a reward from a second prompt (prompt intersection)")
    second = model.prompt_ids([{"role": "user", "content": "Write one sentence about the sea and sailing."}])
    both = sd.LM(model, temperature=0.8) * LMReward(model, second, beta=1.0, mode="prefix")
    smc = sd.SMC(both, particles=8).run(question, max_new_tokens=32, seed=0, progress=False)
    print(f"p(x | favourite place) · p(x | the sea): {smc.text!r}")
    print(smc.summary())


if __name__ == "__main__":
    main()
