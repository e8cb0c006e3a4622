"""What a call asks of the engine: the target program on the device (α, token automata as device
tables, host-mask constraints, rewards) and the per-request settings of an SMC-SD call."""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ...errors import SMCDecodeError

_AUTOMATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # constraint -> {device: DeviceAutomaton}


@dataclass
class DeviceAutomaton:
    """A token automaton on the device, over token classes: ``table [S+1, C]`` int32 next state
    (row and value S = dead), ``classes [V]`` int64 token -> class, ``accepting [S+1]`` bool, the
    initial state. Masks and advances are gathers (graph-capturable)."""

    table: Tensor
    classes: Tensor
    accepting: Tensor
    initial: int
    dead: int
    live: Tensor | None = None  # [S+1] bool: the state allows some token (its mask is not all False)

    def __post_init__(self):
        # (every class holds a token, so a state allows a token iff one of its classes is not dead)
        self.live = (self.table != self.dead).any(1)

    @classmethod
    def of(cls, constraint, device) -> DeviceAutomaton | None:
        """The automaton of a constraint on the automaton path (a ``Regex``, or a ``JSONSchema`` whose
        ``path`` is "automaton"), or of the superset of a ``JSONSchema`` on the superset path (its
        documents are then checked on the host); None for constraints whose masks come from
        llguidance. Cached per constraint and device (captured graphs are keyed by the table they read)."""
        path = getattr(constraint, "path", None)
        if path not in ("automaton", "superset"):
            return None
        cache = _AUTOMATA.setdefault(constraint, {})
        key = str(torch.device(device))
        if key not in cache:
            a = constraint.token_automaton if path == "automaton" else constraint.superset_automaton
            cache[key] = cls(a.table.to(device=device, dtype=torch.int32).contiguous(),
                             a.classes.to(device=device, dtype=torch.long).contiguous(), a.accepting.to(device),
                             int(a.initial), int(a.dead))
        return cache[key]

    @property
    def nbytes(self) -> int:
        """Device memory of the table, class map, accepting and live flags."""
        return sum(t.numel() * t.element_size() for t in (self.table, self.classes, self.accepting, self.live))

    def allowed(self, state: Tensor) -> Tensor:
        return (self.table[state] != self.dead)[:, self.classes]  # [B, C] -> [B, V]

    def advance(self, state: Tensor, tokens: Tensor) -> Tensor:
        return self.table[state, self.classes[tokens]].long()


class CombinedAutomaton(DeviceAutomaton):
    """Several requests' automata in one device table, so one captured round serves per-request
    constraints: state 0 is the free automaton (every token, always accepting: a request with fewer
    constraints than the others), then each automaton's live states at an offset; every dead state
    is the one shared dead state (the last row). A combined class is a tuple of the parts' classes
    (the distinct columns of their stacked class maps)."""

    offsets: dict

    @classmethod
    def of(cls, automata: list, device) -> CombinedAutomaton:
        distinct = list({id(a): a for a in automata}.values())
        key = (tuple(id(a) for a in distinct), str(torch.device(device)))
        hit = _COMBINED.get(key)
        if hit is not None:
            return hit
        parts, classes = torch.unique(torch.stack([a.classes.to(device) for a in distinct]), dim=1,
                                      return_inverse=True)  # parts [n, C]: each automaton's class of class c
        total = 1 + sum(a.dead for a in distinct)  # live states (each automaton's dead state is its last row)
        table = torch.zeros(total + 1, parts.shape[1], dtype=torch.int32, device=device)
        accepting = torch.zeros(total + 1, dtype=torch.bool, device=device)
        accepting[0] = True
        table[total] = total
        offsets, at = {}, 1
        for i, a in enumerate(distinct):
            S = a.dead
            live = a.table[:S].long()[:, parts[i]]
            table[at : at + S] = torch.where(live == a.dead, total, live + at).to(torch.int32)
            accepting[at : at + S] = a.accepting[:S]
            offsets[id(a)] = at
            at += S
        out = cls(table, classes.long().contiguous(), accepting, 0, total)
        out.offsets = offsets
        out.parts = distinct  # (keeps the ids in `key` alive)
        if len(_COMBINED) >= 16:
            _COMBINED.pop(next(iter(_COMBINED)))
        _COMBINED[key] = out
        return out

    def initial_of(self, automaton: DeviceAutomaton) -> int:
        return self.offsets[id(automaton)] + automaton.initial if automaton.initial != automaton.dead else self.dead


_COMBINED: dict = {}  # (automata ids, device) -> CombinedAutomaton (a few, most recent)


@dataclass
class EngineTarget:
    """What the engine needs of a target ``LM(model, T) ** α * constraints * rewards``:
    α, the constraints (token automata go to the device, other constraints' masks come from the
    host), the rewards and the model that decodes token ids into the texts rewards score."""

    alpha: float = 1.0
    constraints: Sequence = ()
    rewards: Sequence = ()
    decoder: object = None  # a smcdecode Model (decode, eos_token_id)
    host_masks: bool = False  # run token automata through the host path too (tests compare both)

    @classmethod
    def of(cls, target, host_masks: bool = False) -> EngineTarget:
        """From a smcdecode target (a potential or a Product)."""
        from ...potentials.base import as_target

        prod = as_target(target)
        return cls(alpha=prod.lm.alpha, constraints=list(prod.constraints), rewards=list(prod.rewards),
                   decoder=prod.lm.model, host_masks=host_masks)

    def check(self) -> None:
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise SMCDecodeError(f"alpha must be a finite number > 0, got {self.alpha!r}")
        for c in self.constraints:
            if getattr(c, "model", None) is None:
                raise SMCDecodeError(f"constraint {c!r} is not bound to a vocabulary: call .bind(model) first")
        if self.rewards and self.decoder is None:
            raise SMCDecodeError("rewards score texts: pass EngineTarget(decoder=model) (a smcdecode Model)")


def _per_request(name: str, value, G: int, kind: type, minimum: int = 1) -> list:
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * G
    if len(values) != G:
        raise SMCDecodeError(f"{name} lists {len(values)} values for {G} prompts: give one value or one per prompt")
    out = []
    for v in values:
        if kind is int:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise SMCDecodeError(f"{name} must be an integer >= {minimum} (or one per prompt), got {v!r}")
            out.append(int(v))
        else:
            try:
                f = float(v)
            except (TypeError, ValueError):
                raise SMCDecodeError(f"{name} must be a number > 0 (or one per prompt), got {v!r}") from None
            if not (f > 0 and math.isfinite(f)):
                raise SMCDecodeError(f"{name} must be a finite number > 0 (or one per prompt), got {v!r}")
            out.append(f)
    return out


@dataclass
class Settings:
    """Per-request settings of one ``smc_sd`` call, validated."""

    particles: list[int]
    block_size: list[int]
    max_new_tokens: list[int]
    draft_temperature: list[float]
    target_temperature: list[float]

    @classmethod
    def of(cls, G: int, particles, block_size, max_new_tokens, draft_temperature, target_temperature) -> Settings:
        return cls(_per_request("particles", particles, G, int), _per_request("block_size", block_size, G, int, minimum=0),
                   _per_request("max_new_tokens", max_new_tokens, G, int),
                   _per_request("draft_temperature", draft_temperature, G, float),
                   _per_request("target_temperature", target_temperature, G, float))

    @property
    def uniform(self) -> bool:
        return all(len(set(v)) == 1 for v in (self.particles, self.block_size, self.max_new_tokens,
                                                self.draft_temperature, self.target_temperature))
