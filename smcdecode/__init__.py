"""smcdecode: sequence-level sequential Monte Carlo over language models.

A target is a product of potentials (an LM, constraints, reward tilts, powers); a proposal is a
draft LM or the target itself; SMC-SD reweights and resamples particles. See docs/concepts.md.
"""

from .api import SMC, Autoregressive, SpeculativeDecoding
from .drafts import load_default_draft, load_draft
from .errors import RewardError, SMCDecodeError
from .models import FunctionModel, HFModel, Model, load_model, truncated_draft
from .potentials import LM, Grammar, JSONSchema, LMReward, Potential, Product, Regex, Reward, TokenConstraint
from .result import Result
from .samplers.proposals import Draft
from .structured import StructuredResult, generate_json

__version__ = "0.1.0"

__all__ = [
    "LM",
    "SMC",
    "Autoregressive",
    "Draft",
    "FunctionModel",
    "Grammar",
    "HFModel",
    "JSONSchema",
    "LMReward",
    "Model",
    "Potential",
    "Product",
    "Regex",
    "Result",
    "Reward",
    "RewardError",
    "SMCDecodeError",
    "SpeculativeDecoding",
    "StructuredResult",
    "TokenConstraint",
    "generate_json",
    "load_default_draft",
    "load_draft",
    "load_model",
    "truncated_draft",
]
