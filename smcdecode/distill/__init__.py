"""Distil a small draft from a target LM, for SMC-SD and speculative decoding.

The draft (see :mod:`smcdecode.drafts`) is ``L`` decoder layers of the target's width, initialised
from target layers, on top of the target's frozen token embeddings and LM head. It is trained to
minimise the per-token

    KL(p_T || q_T) = Σ_v p_T(v | h) [log p_T(v | h) − log q_T(v | h)],

p_T and q_T the target's and draft's next-token distributions at temperature T (the temperature
SMC-SD will run at; several may be given and their losses are averaged), over the response
positions of text *the target itself generates* from chat prompts. The held-out figures are

    acceptance α(h) = Σ_v min(p_T, q_T)      (exact speculative decoding accepts a draft token
                                               with this probability)
    χ²(h)          = Σ_v p_T² / q_T − 1      (the variance of the per-token importance weight
                                               p/q under q; SMC-SD's weights degrade with it)

averaged over positions of held-out target samples.

    python -m smcdecode.distill --target smollm2 --prompts sharegpt_500.json alpaca_eval_instructions.json \\
        --out my-draft --layers 4 --steps 2000 --device cuda

writes ``my-draft/draft.json`` + ``draft.safetensors`` (load with ``smcdecode.drafts.load_draft``),
``corpus.pt`` (the generated text), ``checkpoint.pt`` (training resumes from it when the command
is run again) and ``eval.json``.

Modules: :mod:`.config` (the recipe, :class:`DistillConfig`), :mod:`.corpus` (prompts and the
target's own text), :mod:`.training` (the KL objective's optimisation), :mod:`.evaluation` (the
loss and the held-out figures), :mod:`.recipe` (:func:`distill`: the whole recipe), :mod:`.cli`
(``smcdecode distill``).
"""

from .cli import main
from .config import DistillConfig
from .corpus import (
    SCHEMA_PROMPT,
    chat_prompts,
    generate_corpus,
    load_prompts,
    self_prompts,
    split_prompts,
    user_turn_prefix,
)
from .evaluation import evaluate_draft, kl_loss
from .recipe import distill
from .training import train_draft

__all__ = [
    "SCHEMA_PROMPT",
    "DistillConfig",
    "chat_prompts",
    "distill",
    "evaluate_draft",
    "generate_corpus",
    "kl_loss",
    "load_prompts",
    "main",
    "self_prompts",
    "split_prompts",
    "train_draft",
    "user_turn_prefix",
]
