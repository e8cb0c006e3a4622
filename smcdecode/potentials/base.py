"""The potential contract and products of potentials.

A potential Φ scores token sequences x (generated tokens, given a prompt) in log space:

    prefix(x)    log Φ of x as an unfinished prefix
    complete(x)  log Φ of x as a finished sequence (ended by EOS or cut at max_new_tokens)
    logw_next(x) [V] log-weights of one more token: prefix(x·v) - prefix(x) for v != EOS,
                 complete(x) - prefix(x) for v = EOS

A target is a product of potentials, ``LM(model) ** alpha * Regex(...) * Reward(...)``:
exactly one language model, any number of prefix-checkable constraints, any number of rewards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..errors import SMCDecodeError

if TYPE_CHECKING:
    from ..models import Model


class Potential:
    """Base class: log-space scores of token sequences. Combine with ``*``."""

    #: the model whose vocabulary this potential is defined over (set for LMs; bound for others)
    model: Model | None = None
    #: what the samplers do with this factor of a target: "lm" (LM), "constraint" (TokenConstraint),
    #: "reward" (Reward); None for a potential the samplers cannot use
    role: str | None = None

    def prefix(self, tokens: Sequence[int], prompt: Sequence[int] = ()) -> float:
        raise NotImplementedError  # abstract

    def complete(self, tokens: Sequence[int], prompt: Sequence[int] = ()) -> float:
        raise NotImplementedError  # abstract

    def logw_next(self, tokens: Sequence[int], prompt: Sequence[int] = ()) -> Tensor:
        """[V] float64 next-token log-weights; the default derives them from ``prefix``/``complete``."""
        model = self._require_model()
        base = self.prefix(tokens, prompt)
        out = torch.full((model.vocab_size,), float("-inf"), dtype=torch.float64)
        if base == float("-inf"):
            return out
        for v in range(model.vocab_size):
            if v == model.eos_token_id:
                out[v] = self.complete(tokens, prompt) - base
            else:
                out[v] = self.prefix(list(tokens) + [v], prompt) - base
        return out

    def batch_logw_next(self, seqs: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> Tensor:
        """[B, V] next-token log-weights for a batch of sequences (same result as one at a time)."""
        return torch.stack([self.logw_next(s, prompt) for s in seqs])

    def bind(self, model: Model) -> Potential:
        """This potential over ``model``'s vocabulary (LMs are already bound). Returns the bound
        potential and leaves ``self`` as it was: write ``c = c.bind(model)``."""
        return self

    def _require_model(self) -> Model:
        if self.model is None:
            raise SMCDecodeError(
                f"{self!r} is not bound to a vocabulary: use the bound copy that bind returns, "
                "`c = c.bind(model)` (binding never changes c itself), or pass the whole target "
                "`LM(model) * c`, whose factors are bound"
            )
        return self.model

    def __mul__(self, other: Potential) -> Product:
        if not isinstance(other, Potential):
            raise SMCDecodeError(
                f"cannot multiply {self!r} by {type(other).__name__} {str(other)[:40]!r}: a target is a product of "
                "potentials (LM, Regex, JSONSchema, Grammar, Reward, LMReward, your TokenConstraint)"
            )
        return Product([self, other])

    def __rmul__(self, other) -> Product:
        return self.__mul__(other)  # `3 * potential`: the same error as `potential * 3`

    def __pow__(self, alpha: float) -> Potential:
        raise SMCDecodeError(f"{type(self).__name__} does not support a power")


class Product(Potential):
    """Φ(x) = Π_i Φ_i(x): log-scores add. Constraints and rewards are bound to the LM's vocabulary."""

    def __init__(self, factors: Sequence[Potential]):
        flat: list[Potential] = []
        for f in factors:
            flat.extend(f.factors if isinstance(f, Product) else [f])
        models = [f.model for f in flat if f.model is not None]
        model = models[0] if models else None
        for m in models[1:]:
            if m.vocab_size != model.vocab_size or m.eos_token_id != model.eos_token_id:
                raise SMCDecodeError(
                    f"potentials are over different vocabularies: {model.name!r} has {model.vocab_size} "
                    f"tokens (EOS {model.eos_token_id}) but {m.name!r} has {m.vocab_size} (EOS {m.eos_token_id}): "
                    "use models that share one tokenizer"
                )
        self.factors = [f.bind(model) if model is not None else f for f in flat]
        self.model = model

    def __repr__(self) -> str:
        return " * ".join(repr(f) for f in self.factors)

    @property
    def lm(self) -> Potential:
        lms = [f for f in self.factors if f.role == "lm"]
        if len(lms) != 1:
            raise SMCDecodeError(
                f"a target needs exactly one language-model potential, this one has {len(lms)}: {self!r}"
            )
        return lms[0]

    @property
    def constraints(self) -> list:
        return [f for f in self.factors if f.role == "constraint"]

    @property
    def rewards(self) -> list:
        return [f for f in self.factors if f.role == "reward"]

    def bind(self, model: Model) -> Product:
        return Product([f.bind(model) for f in self.factors])

    def prefix(self, tokens, prompt=()):
        total = 0.0
        for f in self.factors:
            total += f.prefix(tokens, prompt)
            if total == float("-inf"):
                break
        return total

    def complete(self, tokens, prompt=()):
        total = 0.0
        for f in self.factors:
            total += f.complete(tokens, prompt)
            if total == float("-inf"):
                break
        return total

    def logw_next(self, tokens, prompt=()):
        return sum(f.logw_next(tokens, prompt) for f in self.factors)

    def batch_logw_next(self, seqs, prompt=()):
        return sum(f.batch_logw_next(seqs, prompt) for f in self.factors)

    def __pow__(self, alpha: float) -> Product:
        return Product([f**alpha for f in self.factors])


def as_target(target: Potential) -> Product:
    """Normalise a user target (one potential or a product) into a :class:`Product`."""
    if isinstance(target, Product):
        prod = target
    elif isinstance(target, Potential):
        prod = Product([target])
    else:
        raise SMCDecodeError(
            f"target must be a potential such as LM(model) or LM(model) * Regex(...), got {type(target).__name__}"
        )
    prod.lm  # noqa: B018 - validates that there is exactly one LM
    for f in prod.factors:
        if f.role not in ("lm", "constraint", "reward"):
            raise SMCDecodeError(
                f"the samplers cannot use potential {f!r} ({type(f).__name__}): it is not an LM, a "
                "TokenConstraint (implement start/allowed/advance/accepting) or a Reward; wrap a "
                "sequence-level score as Reward(fn, mode='complete') or a constraint as a TokenConstraint"
            )
    return prod
