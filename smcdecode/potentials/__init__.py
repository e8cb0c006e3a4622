"""Potentials: the factors of a target π(x) ∝ Π_i Φ_i(x)."""

from .base import Potential, Product, as_target
from .constraint import TokenConstraint
from .lm import LM
from .regex import Regex
from .reward import Reward

__all__ = ["LM", "Potential", "Product", "Regex", "Reward", "TokenConstraint", "as_target"]
