"""Scratch (shared by ctx3.py and ctx4.py): structured_engine's ``Engine`` and ``smollm2_models`` wrapped so
that the script keeps the run's last engine (``ENG[0]``) and SmolLM2's models (``SM[0]``) after the run."""

ENG, SM = [None], [None]


def install(se, forget_random_engine: bool) -> object:
    """Wrap ``se``'s engine constructor and SmolLM2 loader; returns the unwrapped constructor.
    ``forget_random_engine``: drop the reference to the random models' engine as SmolLM2 loads (ctx3.py);
    without it (ctx4.py) that engine stays referenced until SmolLM2's engine is made."""
    make = se.Engine
    load = se.smollm2_models

    def rec(*a, **k):
        e = make(*a, **k)
        ENG[0] = e
        return e

    def patched(args, device, dtype):
        if forget_random_engine:
            ENG[0] = None
        SM[0] = load(args, device, dtype)
        return SM[0]

    se.Engine = rec
    se.smollm2_models = patched
    return make


def run(se, argv: list) -> float:
    """structured_engine's main with ``argv`` (a failed row's exit printed, not raised); its seconds."""
    import sys
    import time

    sys.argv = ["structured_engine.py", *argv]
    t0 = time.time()
    try:
        se.main()
    except SystemExit as e:
        print("se exit:", e, flush=True)
    return time.time() - t0
