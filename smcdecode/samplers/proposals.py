"""Proposals: a draft LM at its own temperature, or the target itself."""

from __future__ import annotations

from ..errors import SMCDecodeError, check_temperature
from ..models import Model


class Draft:
    """Propose tokens from ``model`` at ``temperature``; SMC masks it by the target's constraints."""

    def __init__(self, model: Model, temperature: float = 1.0):
        if not isinstance(model, Model):
            raise SMCDecodeError(
                f"draft model must be a smcdecode Model (load_model(...), truncated_draft(...) or "
                f"FunctionModel(...)), got {type(model).__name__}"
            )
        self.model = model
        self.temperature = check_temperature("draft temperature", temperature)

    def __repr__(self) -> str:
        return f"Draft({self.model.name}, T={self.temperature:g})"

    @property
    def reads_target(self) -> bool:
        """A feature draft: it reads the target's hidden states (SMC on the reference backend only)."""
        return bool(getattr(self.model, "uses_target_features", False))

    def check_compatible(self, target_model: Model) -> None:
        m = self.model
        if self.reads_target and m.target is not target_model:
            raise SMCDecodeError(
                f"feature draft {m.name!r} reads the hidden states of the model it was loaded for "
                f"({m.target.name!r}), not of this target ({target_model.name!r}): load it with "
                "load_draft(target_model, ...) for the same model object the target LM uses"
            )
        if m.vocab_size != target_model.vocab_size:
            raise SMCDecodeError(
                f"draft vocabulary ({m.vocab_size}) differs from target vocabulary "
                f"({target_model.vocab_size}): use a draft with the target's tokenizer"
            )
        if m.eos_token_id != target_model.eos_token_id:
            raise SMCDecodeError(
                f"draft EOS token ({m.eos_token_id}) differs from the target's ({target_model.eos_token_id}): "
                "use a draft with the target's tokenizer"
            )


TARGET = "target"


def as_proposal(proposal, target_model: Model) -> Draft | None:
    """None means 'the target is the proposal'."""
    if proposal is None or proposal == TARGET:
        return None
    if isinstance(proposal, Model):
        proposal = Draft(proposal)
    if not isinstance(proposal, Draft):
        raise SMCDecodeError(
            f"proposal must be Draft(model, temperature), a Model, or 'target', got {type(proposal).__name__}"
        )
    proposal.check_compatible(target_model)
    return proposal
