"""Potentials: the factors of a target π(x) ∝ Π_i Φ_i(x)."""

from .base import Potential, Product, as_target
from .constraint import TokenConstraint
from .grammar import Grammar
from .json_schema import JSONSchema
from .lm import LM
from .lm_reward import LMReward
from .regex import Regex
from .reward import Reward

__all__ = [
    "LM",
    "Grammar",
    "JSONSchema",
    "LMReward",
    "Potential",
    "Product",
    "Regex",
    "Reward",
    "TokenConstraint",
    "as_target",
]
