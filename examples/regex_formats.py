"""Regex formats with the default model: an ISO date and a phone number, on the CPU.

The Regex potential compiles a pattern to a token-level DFA (integer states: forking a particle
is a gather, the masks of all particles are one table lookup). SMC samples the model's global
conditional given the format; the weights and ESS per round are printed.

    python examples/regex_formats.py          # about a minute
"""

from __future__ import annotations

import torch

import smcdecode as sd

TASKS = [
    (
        "When did the first person walk on the Moon? Answer with the date only, as YYYY-MM-DD.",
        r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    ),
    (
        "Make up a phone number for a pizza shop in New York, in the format (212) 555-0123.",
        r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}",
    ),
]


def main() -> None:
    torch.set_num_threads(1)  # predictable on a shared machine; raise it on your own
    model = sd.load_model()
    for question, pattern in TASKS:
        target = sd.LM(model, temperature=0.7) * sd.Regex(pattern)
        messages = [{"role": "user", "content": question}]
        print(f"\n=== {question}\n    pattern {pattern}")
        masked = sd.Autoregressive(target).run(messages, max_new_tokens=16, seed=0, progress=False)
        print(f"masked decoding: {masked.text!r}")
        smc = sd.SMC(target, particles=8).run(messages, max_new_tokens=16, seed=0, progress=False)
        print(f"SMC (N=8):       {smc.text!r}")
        print(smc.summary())


if __name__ == "__main__":
    main()
