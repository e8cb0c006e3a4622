"""SMC-SD target programs the engine benchmarks compare with the plain round (``engine_ab.py``,
``profile_programs.py``): ``program(name) -> (smc_sd keyword arguments, label)``."""

from __future__ import annotations

VOCAB = 128256
EOS = 128001


def synthetic_vocab(size: int = VOCAB) -> list[str]:
    """Token texts for random-weight models: the letter strings a, b, …, z, ba, bb, … (base 26), with
    ``<eos>`` at EOS, so a regex over letters allows a known share of the vocabulary."""
    def word(i: int) -> str:
        w = ""
        while True:
            w, i = w + chr(97 + i % 26), i // 26
            if i == 0:
                return w

    vocab = [word(i) for i in range(size)]
    vocab[EOS] = "<eos>"
    return vocab


def program(name: str) -> tuple[dict, str]:
    """plain (the round with everything off), alpha2 (power α = 2), regex (``[a-m]*`` on the device
    automaton over the synthetic vocabulary: about 7 % of it allowed)."""
    import smcdecode
    from smcdecode.backends.engine.targets import EngineTarget

    if name == "plain":
        return {}, "plain"
    if name == "alpha2":
        return {"target": EngineTarget(alpha=2.0)}, "alpha=2"
    if name == "regex":
        model = smcdecode.FunctionModel(lambda ctx: None, vocab=synthetic_vocab(), eos="<eos>", name="synthetic")
        return {"target": EngineTarget.of(smcdecode.LM(model) * smcdecode.Regex(r"[a-m]*")), "eos_token_id": EOS}, "regex"
    raise ValueError(f"unknown program {name!r}: use plain, alpha2 or regex")
