"""A context-free grammar with the default model: a small SQL subset and arithmetic, on the CPU.

Grammars are written in Lark syntax (GBNF works too: Grammar(text, syntax="gbnf")) and run by
llguidance; each particle holds a parser state, forked copy-on-write when particles are resampled,
and the token masks of all particles are computed in one call per step.

    python examples/grammar_sql.py            # one to two minutes
"""

from __future__ import annotations

import torch

import smcdecode as sd
from smcdecode.potentials import Grammar

SQL = r"""
start: query
query: "SELECT " columns " FROM " NAME where? order? ";"
columns: "*" | NAME (", " NAME)*
where: " WHERE " condition (" AND " condition)*
condition: NAME " " OP " " value
order: " ORDER BY " NAME (" ASC" | " DESC")?
value: NUMBER | "'" /[A-Za-z ]{1,20}/ "'"
OP: "=" | "<" | ">" | "<=" | ">=" | "!="
NAME: /[a-z_]{1,20}/
NUMBER: /[0-9]{1,6}/
"""

ARITHMETIC = r"""
start: expr
expr: term ((" + " | " - ") term)*
term: factor ((" * " | " / ") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,4}/
"""

TASKS = [
    (SQL, "Table employees(name, age, city). Write an SQL query listing the names of employees older than 30."),
    (ARITHMETIC, "Write an arithmetic expression whose value is 12, using + and *."),
]


def main() -> None:
    torch.set_num_threads(1)  # predictable on a shared machine; raise it on your own
    model = sd.load_model()
    for grammar, question in TASKS:
        target = sd.LM(model, temperature=0.7) * Grammar(grammar)
        messages = [{"role": "user", "content": question}]
        print(f"\n=== {question}")
        masked = sd.Autoregressive(target).run(messages, max_new_tokens=40, seed=0, progress=False)
        print(f"masked decoding: {masked.text!r}")
        smc = sd.SMC(target, particles=8).run(messages, max_new_tokens=40, seed=0, progress=False)
        print(f"SMC (N=8):       {smc.text!r}   ({smc.seconds:.1f} s, mean ESS {smc.mean_ess:.1f})")
        for text, w in sorted(zip(smc.texts, smc.weights.tolist()), key=lambda p: -p[1])[:4]:
            print(f"    {w:.3f}  {text!r}")


if __name__ == "__main__":
    main()
