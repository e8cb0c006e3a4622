"""Chat-level structured output: a JSON Schema (a dict or a pydantic model) in, parsed objects out.

    from pydantic import BaseModel
    class City(BaseModel):
        name: str
        country: str
        population: int

    out = generate_json(model, "Describe Paris as JSON.", City, particles=8, seed=0)
    out.value          # City(name='Paris', country='France', population=...)
    out.values         # every particle's parsed object, with out.weights

SMC targets the global conditional p(x | x valid under the schema); ``strategy="masked"`` gives the
locally-masked baseline (each token drawn from the renormalised allowed set, as greedy constrained
decoders do) for comparison.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from .api import SMC, Autoregressive
from .errors import SMCDecodeError, check_temperature
from .models import Model
from .potentials.json_schema import JSONSchema
from .potentials.lm import LM
from .result import Result

STRATEGIES = ("smc", "masked")

SCHEMA_INSTRUCTION = (
    "Reply with one JSON value and nothing else. It must be an instance of the JSON Schema below, "
    "with real values in it, not a copy of the schema.\nJSON Schema: {schema}"
)
# keywords that say nothing about the document, left out of the prompt (a small model copies them)
_PROMPT_DROP = ("$schema", "$id", "id", "$comment")


@dataclass
class StructuredResult:
    """Parsed outputs of a structured run.

    ``value``: the sampled particle's parsed object (a pydantic instance when the schema was a
    pydantic model), or None when no particle produced a valid document. ``values[i]`` is particle
    i's parsed object (None where its weight is 0), ``weights[i]`` its normalised weight.
    """

    value: Any
    values: list[Any]
    weights: torch.Tensor
    text: str | None
    result: Result
    constraint: JSONSchema
    prompt_ids: list[int]  # the prompt as run (with the schema message when one was added)

    @property
    def ok(self) -> bool:
        return self.value is not None

    @property
    def path(self) -> str:
        """How the constraint's masks were computed: "automaton" (a token automaton, on the device on
        the engine) or "llguidance"; ``constraint.path_reason`` says why."""
        return self.constraint.path

    def __str__(self) -> str:
        return f"{self.value!r}\n{self.result.summary()}\nconstraint path: {self.path} ({self.constraint.path_reason})"


def schema_prompt(model: Model, prompt, schema: dict, instruction: str = SCHEMA_INSTRUCTION):
    """``prompt`` (text or chat messages) with the schema stated in a system message, for models
    with a chat template; other prompts (token ids, models without a template) are returned as is."""
    shown = {k: v for k, v in schema.items() if k not in _PROMPT_DROP or not isinstance(v, str)}
    text = instruction.format(schema=json.dumps(shown))
    if isinstance(prompt, str):
        if getattr(getattr(model, "tokenizer", None), "chat_template", None) is None:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = [dict(m) for m in prompt]
        if messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
        return messages
    return prompt


def generate_json(
    model: Model,
    prompt,
    schema,
    *,
    particles: int = 8,
    strategy: str = "smc",
    proposal="target",
    block_size: int | str | None = None,
    temperature: float = 0.7,
    max_new_tokens: int = 256,
    ess_threshold: float = 0.5,
    whitespace: str = "compact",
    extra_properties: bool = False,
    schema_in_prompt: bool = True,
    seed: int | None = None,
    progress: bool = False,
) -> StructuredResult:
    """Generate a JSON document valid under ``schema`` and parse it.

    ``prompt``: text (sent as a user message when the model has a chat template), chat messages,
    or token ids. ``schema``: a dict, a JSON string or a pydantic model class; it is compiled
    first, so an invalid or unsupported schema raises :class:`SMCDecodeError` before any
    generation. ``extra_properties=False`` (default): objects that declare ``properties`` and say
    nothing of other keys hold only the declared ones (every output is still valid under
    ``schema``; a small model otherwise tends to add keys, or to copy the schema's own keywords, and
    to run on); True allows whatever the schema allows. ``schema_in_prompt``: also state the schema in a system message (small models
    need it to fill the fields sensibly; the constraint guarantees validity either way).
    ``strategy``: "smc" (``particles`` particles, ``proposal`` = "target" or a Draft, ``block_size``
    its draft tokens per round as in :class:`SMC`) or "masked" (locally-masked decoding of one
    sample, the usual constrained decoder).
    """
    if not isinstance(model, Model):
        raise SMCDecodeError(
            f"model must be a smcdecode Model (load_model(...) or FunctionModel(...)), got {type(model).__name__}"
        )
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise SMCDecodeError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    check_temperature("temperature", temperature)
    constraint = JSONSchema(schema, whitespace=whitespace, extra_properties=extra_properties).bind(model)
    if schema_in_prompt:
        model.prompt_ids(prompt)  # a malformed prompt or message is reported as it was given
        prompt = schema_prompt(model, prompt, constraint.schema)
    target = LM(model, temperature=temperature) * constraint
    if strategy == "smc":
        runner = SMC(target, proposal, particles=particles, block_size=block_size, ess_threshold=ess_threshold)
    else:
        runner = Autoregressive(target, samples=1)
    ids = model.prompt_ids(prompt)
    result = runner.run(ids, max_new_tokens=max_new_tokens, seed=seed, progress=progress)
    values: list[Any] = []
    for text, w in zip(result.texts, result.weights.tolist()):
        values.append(_parse_or_none(constraint, text) if w > 0 else None)
    if result.sample_index is not None and values[result.sample_index] is None:
        # NOTE: every positive-weight particle satisfies the constraint, so this would be a bug
        raise SMCDecodeError(
            f"internal error: the sampled output does not validate against its schema: {result.text[:120]!r}"
        )
    value = None if result.sample_index is None else values[result.sample_index]
    return StructuredResult(value, values, result.weights, result.text, result, constraint, ids)


def _parse_or_none(constraint: JSONSchema, text: str):
    try:
        return constraint.parse(text)
    except Exception:  # noqa: BLE001 - SMCDecodeError or a pydantic ValidationError
        return None
