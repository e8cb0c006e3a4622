"""Command line: ``smcdecode generate`` runs SMC-SD (and the baselines) on a prompt.

Bad input exits with status 2 and a one-line message on stderr; a run that returns no sample (no
particle satisfied the constraints) exits with status 1 and says so in one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .cli_common import HelpFormatter as _HelpFormatter
from .cli_common import Parser as _Parser
from .cli_common import one_line as _one_line

DEFAULT_CHAT = "What is the capital of France?"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="smcdecode",
        description="Sequential Monte Carlo over language models: SMC speculative decoding, "
        "constrained and reward-weighted generation.",
    )
    from . import __version__

    p.add_argument("--version", action="version", version=f"smcdecode {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("distill", add_help=False,
                   help="distil a small draft from a target model (smcdecode distill --help)")
    sub.add_parser("serve", add_help=False,
                   help="serve a model over an OpenAI-compatible HTTP API (smcdecode serve --help)")
    g = sub.add_parser(
        "generate",
        help="generate text with SMC-SD, exact speculative decoding or autoregressive sampling",
        description="Generate from a prompt. The target is the model at --temperature, raised to --alpha, "
        "times the constraints given (--regex, --json-schema, --grammar: the output must match them) and a "
        "reward tilt (--reward-prompt, --reward-beta); the proposal is the --draft model at --draft-temperature "
        "(or the target itself: --draft target). For each --strategy it prints the sampled text, a summary in "
        "that strategy's terms (SMC: particles, rounds, resamplings, log Z, ESS; exact speculative decoding: "
        "rounds and draft acceptance; autoregressive: samples and tokens) and one row per particle or sample.",
        formatter_class=_HelpFormatter,
    )
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt text (no chat template)")
    src.add_argument("--chat", help=f"a user chat message, wrapped in the model's chat template (default: {DEFAULT_CHAT!r})")
    g.add_argument("--model", default="smollm2",
                   help="target model: 'smollm2' (built-in SmolLM2-135M-Instruct), a local Hugging Face directory, or a .gguf file")
    g.add_argument("--draft", default="auto",
                   help="proposal: 'auto' (the target itself on a CPU, where a draft does not pay; the built-in draft "
                   "elsewhere), 'default' (the built-in draft for the default model), 'truncated:L' (the target's first L layers), "
                   "'target' (particle filter with the target as proposal), a distilled draft directory (smcdecode distill --out), "
                   "or a model directory/.gguf sharing the target's tokenizer")
    g.add_argument("--strategy", default="smc", choices=["smc", "sd", "ar", "all"],
                   help="smc = SMC speculative decoding; sd = exact speculative decoding; ar = autoregressive; all = the three side by side")
    g.add_argument("-n", "--particles", type=int, default=8, help="number of particles N (SMC) or samples (sd/ar)")
    g.add_argument("-k", "--block-size", default="auto",
                   help="draft tokens per round K (a round adds K+1 tokens), 'adaptive' (K from 0 to 8 chosen each round "
                   "from the draft's record so far) or 'auto' (adaptive for SMC, 4 for exact speculative decoding)")
    g.add_argument("--temperature", type=float, default=0.7, help="target temperature T (> 0)")
    g.add_argument("--draft-temperature", type=float, default=None,
                   help="draft temperature (> 0); default: the draft's proposal temperature for --temperature "
                   "(the built-in draft: 5/7 of it, 0.5 at the default 0.7; any other draft: --temperature)")
    g.add_argument("--alpha", type=float, default=1.0, help="power α of the target: π ∝ p_T^α")
    g.add_argument("--resampler", default="systematic", choices=["multinomial", "stratified", "systematic", "residual"],
                   help="resampling scheme")
    g.add_argument("--ess-threshold", type=float, default=0.5,
                   help="resample when ESS < τ·N; 0 never resamples, 1 resamples every round")
    g.add_argument("--regex", help="constrain the generated text to fully match this regular expression")
    g.add_argument("--json-schema", help="constrain the output to a JSON Schema: a .json file or inline JSON")
    g.add_argument("--grammar", help="constrain the output to a context-free grammar file (Lark or GBNF syntax)")
    g.add_argument("--grammar-syntax", default="lark", choices=["lark", "gbnf"], help="syntax of --grammar")
    g.add_argument("--reward-prompt",
                   help="also weight by exp(beta * log p(output | this chat message)): prompt intersection")
    g.add_argument("--reward-beta", type=float, default=1.0, help="beta of --reward-prompt")
    g.add_argument("--max-new-tokens", type=int, default=64, help="maximum generated tokens per sequence")
    g.add_argument("--seed", type=int, default=0, help="random seed (runs are reproducible)")
    g.add_argument("--device", default="cpu", help="torch device for the models, e.g. cpu or cuda")
    g.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: OMP_NUM_THREADS if set, else half the usable CPUs, at least 1: "
                   "measured fastest on 2 cores, see docs/cli.md)")
    g.add_argument("--backend", default="reference", choices=["reference", "engine"],
                   help="what runs the models: the reference backend (any model, eager) or smcdecode's engine "
                   "(Llama-family models; paged KV cache, CUDA graphs on a GPU, its torch path on a CPU)")
    g.add_argument("--plot", metavar="PNG", help="save a plot of ESS and weights over rounds to this file")
    g.add_argument("--json", action="store_true", help="print the result as JSON instead of text")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


class UsageError(Exception):
    """A bad command-line argument, reported in one line with exit status 2."""


DRAFT_CHOICES = "auto, default, target, truncated:L, a distilled draft directory or a model"


def check_draft_spec(spec: str) -> None:
    """Refuse a --draft that is a near miss of one of its words (``defualt``) before any model loads;
    anything else may name a model."""
    import difflib

    words = ("auto", "default", "target")
    if spec in words or spec.startswith("truncated:") or "/" in spec or _is_dir(Path(spec)) or _is_file(Path(spec)):
        return
    close = difflib.get_close_matches(spec.lower(), words + ("truncated",), n=1, cutoff=0.7)
    if close:
        hint = "truncated:L" if close[0] == "truncated" else close[0]
        raise UsageError(f"--draft {spec!r}: did you mean {hint!r}? (--draft takes {DRAFT_CHOICES})")


def _draft(spec: str, target_model, args):
    import smcdecode as sd

    if spec == "target":
        return "target"
    if spec == "default":
        from .drafts import proposal_temperature

        draft = _default_draft(target_model, args)
        t = args.draft_temperature if args.draft_temperature is not None else \
            proposal_temperature(draft, args.temperature)
        return sd.Draft(draft, t)
    if spec.startswith("truncated:"):
        try:
            layers = int(spec.split(":", 1)[1])
        except ValueError:
            raise UsageError(f"--draft {spec!r}: write truncated:L with an integer L, e.g. truncated:8") from None
        return sd.Draft(sd.truncated_draft(target_model, layers), args.draft_temperature or args.temperature)
    if _is_file(Path(spec, "draft.json")):  # a distilled draft directory
        from .drafts import load_draft, proposal_temperature

        draft = load_draft(target_model, spec)
        return sd.Draft(draft, args.draft_temperature or proposal_temperature(draft, args.temperature))
    try:
        model = sd.load_model(spec, device=args.device)
    except sd.SMCDecodeError as e:
        raise UsageError(f"--draft {spec!r}: {e} (--draft takes {DRAFT_CHOICES})") from None
    return sd.Draft(model, args.draft_temperature or args.temperature)


def choose_proposal(draft: str, block_size, device: str, backend: str) -> tuple[str, int | str, str]:
    """(--draft, --block-size, what was chosen and why) for SMC: explicit choices are kept; 'auto'
    picks the target as proposal on a CPU (measured: the shipped draft makes the default model no
    faster there and its answers worse, docs/strategies.md) and the shipped draft with adaptive K
    on a GPU or with --backend engine (whose rounds need a draft), and the shipped draft wherever
    --block-size is given; --block-size auto is adaptive whenever a draft proposes."""
    notes = []
    if draft == "auto" and block_size != "auto":
        draft = "default"
        notes.append(f"the built-in draft (--draft auto with --block-size {block_size}: a K asks for a draft)")
    elif draft == "auto":
        if str(device).startswith("cpu") and backend != "engine":  # (the engine's own rounds need a draft)
            draft = "target"
            notes.append("the target as proposal (--draft auto on a CPU: the built-in draft does not pay there, "
                         "docs/strategies.md; --draft default uses it)")
        else:
            draft = "default"
            notes.append(f"the built-in draft (--draft auto on {device})")
    if block_size == "auto":
        block_size = "adaptive"
        if draft != "target":
            notes.append("adaptive K from 0 to 8 (--block-size auto; give -k K for a fixed K)")
    return draft, block_size, ("chosen for you: " + "; ".join(notes)) if notes else ""


def _default_draft(target_model, args):
    """The built-in draft for the default model (see docs/drafts.md)."""
    import smcdecode as sd

    try:
        from .drafts import load_default_draft
    except ImportError:
        load_default_draft = None
    if load_default_draft is not None:
        try:
            return load_default_draft(target_model)
        except Exception as e:  # noqa: BLE001 - no shipped draft fits: fall back to truncation
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
    else:
        reason = "no shipped drafts"
    layers = target_model.hf.config.num_hidden_layers
    keep = max(1, layers // 3)
    # NOTE: printed once the run succeeds, so that an error stays the only line on stderr
    notes = vars(args).setdefault("notes", [])
    note = f"smcdecode: note: using the target's first {keep} layers as the draft ({reason})"
    if note not in notes:
        notes.append(note)
    return sd.truncated_draft(target_model, keep)


def _is_file(path: Path) -> bool:
    try:
        return path.expanduser().is_file()
    except (OSError, ValueError, RuntimeError):  # inline text too long to be a file name, a NUL byte, ~nobody
        return False


def _is_dir(path: Path) -> bool:
    try:
        return path.expanduser().is_dir()
    except (OSError, ValueError, RuntimeError):
        return False


def _read(flag: str, path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{flag} {str(path)!r}: cannot read it as UTF-8 text ({type(e).__name__})") from None


def _generate(args) -> int:
    import smcdecode as sd

    # check cheap arguments before loading any model
    if args.block_size not in ("auto", "adaptive"):
        try:
            args.block_size = int(args.block_size)
        except ValueError:
            raise UsageError(f"--block-size must be an integer >= 1, 'adaptive' or 'auto', got {args.block_size!r}") \
                from None
    if isinstance(args.block_size, int) and args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1, got {args.block_size} (for rounds of K = 0, where the target "
                         "proposes, give --block-size adaptive, which lets the draft in only where it pays, or "
                         "--draft target)")
    for flag, value in (("--particles", args.particles), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    check_draft_spec(args.draft)
    if args.draft == "target":
        if args.strategy in ("sd", "all"):
            raise UsageError(f"--strategy {args.strategy} runs exact speculative decoding, which needs a draft "
                             "model: drop --draft target (or give --strategy smc)")
        if args.block_size != "auto":
            raise UsageError(f"--block-size {args.block_size} needs a draft: with --draft target the target proposes "
                             "one token a round; drop --block-size, or give a draft (--draft default)")
    for flag, value in (("--temperature", args.temperature), ("--draft-temperature", args.draft_temperature),
                        ("--alpha", args.alpha)):
        if value is not None and (not value > 0 or value == float("inf")):
            raise UsageError(f"{flag} must be a finite number > 0, got {value}")
    if not 0.0 <= args.ess_threshold <= 1.0:
        raise UsageError(f"--ess-threshold must lie in [0, 1], got {args.ess_threshold}")
    if not 0 <= args.seed < 2**64:
        raise UsageError(f"--seed must lie in [0, 2**64), got {args.seed}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {args.threads}")
    from .devices import check_device

    check_device(args.device, "--device")
    if args.plot and not _is_dir(Path(args.plot).parent):
        raise UsageError(f"--plot {args.plot!r}: its directory does not exist")
    if args.plot and args.strategy in ("sd", "ar"):
        raise UsageError(f"--plot draws SMC's effective sample size and weights over rounds: use it with --strategy "
                         f"smc or all, not {args.strategy}")
    if args.prompt is not None and not args.prompt:
        raise UsageError("--prompt is empty: give some text")
    regex = sd.Regex(args.regex) if args.regex is not None else None
    schema = grammar = None
    if args.json_schema is not None:
        path = Path(args.json_schema)
        if not _is_file(path) and args.json_schema.strip()[:1] not in ("{", "[", '"') and \
                args.json_schema.strip() not in ("true", "false"):
            raise UsageError(f"--json-schema {args.json_schema!r}: no such file, and not inline JSON (give a .json file or a schema such as '{{\"type\": \"integer\"}}')")
        schema = sd.JSONSchema(_read("--json-schema", path) if _is_file(path) else args.json_schema)
    if args.grammar is not None:
        path = Path(args.grammar)
        if not _is_file(path):
            raise UsageError(f"--grammar {args.grammar!r}: no such file (give a Lark or GBNF grammar file)")
        grammar = sd.Grammar(_read("--grammar", path), syntax=args.grammar_syntax)
    model = sd.load_model(args.model, device=args.device, threads=args.threads)
    target = sd.LM(model, temperature=args.temperature) ** args.alpha
    for constraint in (regex, schema, grammar):
        if constraint is not None:
            target = target * constraint
    if args.reward_prompt is not None:
        ids = model.prompt_ids([{"role": "user", "content": args.reward_prompt}])
        target = target * sd.LMReward(model, ids, beta=args.reward_beta)
    if args.prompt is not None:
        prompt = args.prompt
    else:
        prompt = [{"role": "user", "content": args.chat if args.chat is not None else DEFAULT_CHAT}]
        if schema is not None:  # as generate_json does: the model reads the schema in a system message
            from .structured import schema_prompt

            prompt = schema_prompt(model, prompt, schema.schema)
    model.check_length(len(model.prompt_ids(prompt)), args.max_new_tokens)  # before any draft is built
    strategies = ["smc", "sd", "ar"] if args.strategy == "all" else [args.strategy]
    results = []
    for name in strategies:
        chosen = ""
        if name == "smc":
            spec, block, chosen = choose_proposal(args.draft, args.block_size, args.device, args.backend)
            proposal = _draft(spec, model, args)
            runner = sd.SMC(target, proposal, particles=args.particles,
                            block_size=None if proposal == "target" else block,
                            resampler=args.resampler, ess_threshold=args.ess_threshold, backend=args.backend)
        elif name == "sd":
            block = 4 if isinstance(args.block_size, str) else args.block_size
            if args.block_size == "adaptive":
                raise UsageError("--block-size adaptive is for SMC: exact speculative decoding takes a fixed K")
            runner = sd.SpeculativeDecoding(target, _draft("default" if args.draft == "auto" else args.draft, model,
                                                           args), block_size=block, samples=args.particles,
                                            backend=args.backend)
        else:
            runner = sd.Autoregressive(target, samples=args.particles, backend=args.backend)
        results.append(runner.run(prompt, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                  progress=not args.no_progress))
        results[-1].chosen = chosen
    if args.json:
        print(json.dumps([_as_json(r) for r in results], indent=2))
    else:
        for r in results:
            print(f"=== {r.strategy} ===")
            print(r.text if r.text is not None else "(no sample: every particle has weight 0)")
            print()
            print(r.summary())
            print()
    if args.plot:
        smc = next((r for r in results if r.strategy == "smc"), results[0])
        smc.plot(args.plot)
        print(f"plot saved to {args.plot}", file=sys.stderr)
    for note in getattr(args, "notes", []):
        print(note, file=sys.stderr)
    failed = [r.strategy for r in results if r.text is None]
    if failed:  # ran, but returned nothing: exit status 1 (2 is bad usage)
        print(f"smcdecode: no valid sample ({', '.join(failed)}): every particle has weight 0 (none satisfied the "
              f"constraints within --max-new-tokens {args.max_new_tokens}); raise --max-new-tokens or loosen the "
              "constraints", file=sys.stderr)
        return 1
    return 0


def _as_json(r) -> dict:
    return {
        "strategy": r.strategy,
        "text": r.text,
        "log_evidence": None if r.log_evidence != r.log_evidence else r.log_evidence,
        "particles": [
            {"text": t, "tokens": len(tok), "weight": float(w), "log_weight": float(lw), "end": end}
            for t, tok, w, lw, end in zip(r.texts, r.tokens, r.weights, r.log_weights, r.endings)
        ],
        "ess": r.ess,
        "block_sizes": r.block_sizes,
        "diagnosis": r.diagnosis,
        "chosen": r.chosen,
        "resampled": r.resampled,
        "seconds": r.seconds,
        "tokens_per_second": r.tokens_per_second,
        "acceptance_rate": r.acceptance_rate,
        "message": r.message,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["distill"]:
        from .distill import main as distill_main

        return distill_main(argv[1:])
    if argv[:1] == ["serve"]:
        from .serve.cli import main as serve_main

        return serve_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        print("smcdecode: error: no command given: use `smcdecode generate ...`, `smcdecode serve ...` or "
              "`smcdecode distill ...`",
              file=sys.stderr)
        return 2
    from .errors import SMCDecodeError

    try:
        return _generate(args)
    except (UsageError, SMCDecodeError) as e:
        print(f"smcdecode: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
