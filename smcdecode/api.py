"""Strategies: SMC-SD, exact speculative decoding and autoregressive sampling, side by side.

    target = LM(model, temperature=0.7) * Regex(r"[0-9]+")
    smc = SMC(target, Draft(draft_model, temperature=0.7), particles=8, block_size=4)
    result = smc.run("Pick a number: ", max_new_tokens=16, seed=0)
"""

from __future__ import annotations

import contextlib
import math
import time

import torch

from .devices import check_device, check_dtype
from .errors import SMCDecodeError, check_nonneg_int, check_positive_int, check_unit_interval
from .potentials.base import as_target
from .result import NO_SAMPLE, Result
from .samplers.adaptive import AdaptiveBlocks, FixedBlocks, as_schedule
from .samplers.autoregressive import autoregressive
from .samplers.loop import Finished, Request, smc_sd, speculative
from .samplers.proposals import as_proposal
from .samplers.resampling import RESAMPLERS, normalise
from .samplers.smc_sd import SMCOutput

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 64 bits
MAX_PARTICLES = 2**20  # particles (times groups, or samples) in one run: a bound far above any useful run


def _check_flag(name: str, value) -> bool:
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise SMCDecodeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")


def _check_engine_options(options: dict) -> dict:
    """Types and values of the engine options (which names each backend takes is checked there)."""
    options = dict(options)
    if options.get("dtype") is not None:
        options["dtype"] = check_dtype(options["dtype"])
    if options.get("device") is not None:
        options["device"] = check_device(options["device"], "engine_options['device']")
    for key in ("page_size", "num_pages"):
        if options.get(key) is not None:
            check_positive_int(f"engine_options[{key!r}]", options[key])
    if options.get("use_graphs") is not None:
        _check_flag("engine_options['use_graphs']", options["use_graphs"])
    return options


def _generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    if seed is None:
        g.seed()
    else:
        g.manual_seed(check_nonneg_int("seed", seed, maximum=MAX_SEED))
    return g


@contextlib.contextmanager
def _progress(enabled: bool, total: int, desc: str, prompt_tokens: int = 0):
    if not enabled:
        yield None
        return
    from tqdm.auto import tqdm

    class Bar(tqdm):
        """Says "prefill" until the first tokens come (a long prompt's prefill can take a while)."""

        def update(self, n=1):
            if self.postfix:
                self.set_postfix_str("", refresh=False)
            return super().update(n)

    bar = Bar(total=total, desc=desc, unit="tok", leave=False,
              postfix=f"prefill of the {prompt_tokens}-token prompt" if prompt_tokens else None)
    try:
        yield bar
        if 0 < bar.n < bar.total:  # every sequence ended before the token budget: the bar ends where they did
            bar.total = bar.n
        elif bar.n == 0:  # a backend that reports no steps (the engine's own rounds): done is done
            bar.update(bar.total)
        bar.refresh()  # draw the final count (tqdm redraws at most every 0.1 s)
    finally:
        bar.close()


class _Strategy:
    name = "strategy"
    backend = "reference"
    engine_options: dict = {}

    def __init__(self, target):
        self.target = as_target(target)
        self.model = self.target.lm.model

    def _set_backend(self, backend: str, engine_options: dict | None) -> None:
        """``"reference"`` (eager, any model) or ``"engine"`` (the GPU engine: its request loop and
        rounds; Llama-family HF models)."""
        from .backends import BACKENDS

        if not isinstance(backend, str) or backend not in BACKENDS:
            raise SMCDecodeError(f"unknown backend {backend!r}: choose one of {sorted(BACKENDS)}")
        if engine_options is not None and not isinstance(engine_options, dict):
            raise SMCDecodeError(
                f"engine_options must be a dict such as {{'device': 'cuda'}}, got {type(engine_options).__name__}"
            )
        self.backend = backend
        if backend == "engine":
            from .backends.engine.bridge import check_options

            self.engine_options = _check_engine_options(check_options(engine_options))
        elif engine_options:
            raise SMCDecodeError("engine_options apply to backend='engine' only: drop them or pass backend='engine'")

    def _prepare(self, prompt, max_new_tokens: int) -> list[int]:
        check_positive_int("max_new_tokens", max_new_tokens)
        ids = self.model.prompt_ids(prompt)
        self.model.check_length(len(ids), max_new_tokens)
        proposal = getattr(self, "proposal", None)
        if proposal is not None and hasattr(proposal.model, "check_length"):
            proposal.model.check_length(len(ids), max_new_tokens)
        for r in self.target.rewards:
            if hasattr(r, "scorer"):  # an LMReward scores the generated tokens after its own prompt
                r.scorer.check_length(len(r.prompt_ids), max_new_tokens + 1)
        for c in self.target.constraints:
            if hasattr(c, "satisfiable") and not c.satisfiable():
                self._unsatisfiable = f"no token sequence satisfies the constraint {c!r} with this vocabulary"
                break
        else:
            self._unsatisfiable = ""
        return ids

    def run(self, prompt, max_new_tokens: int = 64, seed: int | None = None, progress: bool = True) -> Result:
        """Generate from ``prompt`` (text, token ids, or chat messages) and return a :class:`Result`."""
        progress = _check_flag("progress", progress)
        ids = self._prepare(prompt, max_new_tokens)
        g = _generator(seed)
        start = time.perf_counter()
        with _progress(progress, max_new_tokens * self._bar_scale(), self.name, len(ids)) as bar:
            out = self._run(ids, 1, max_new_tokens, g, bar)
        seconds = time.perf_counter() - start
        result = self._result(out, ids, seconds, g)
        result.max_new_tokens = max_new_tokens
        return result

    def run_groups(self, prompt, groups: int, max_new_tokens: int = 64, seed: int | None = None) -> SMCOutput:
        """``groups`` independent runs at once (vectorised), as raw tensors with a leading group
        dimension: used for replicate studies such as checking that E[Ẑ] = Z."""
        check_positive_int("groups", groups)
        per_group = getattr(self, "particles", None) or getattr(self, "samples", 1)
        if groups * per_group > MAX_PARTICLES:
            raise SMCDecodeError(
                f"groups × particles = {groups} × {per_group} exceeds {MAX_PARTICLES} sequences in one run: "
                "run the replicates in several calls"
            )
        ids = self._prepare(prompt, max_new_tokens)
        return self._run(ids, groups, max_new_tokens, _generator(seed), None)

    def _bar_scale(self) -> int:
        return 1

    def _result(self, out: SMCOutput, ids, seconds, g) -> Result:
        model = self.model
        toks, texts = [], []
        for row, n in zip(out.tokens[0], out.lengths[0]):
            t = row[: int(n)].tolist()
            toks.append(t)
            texts.append(model.decode(t[:-1] if t and t[-1] == model.eos_token_id else t))
        lw = out.log_weights[0]
        W, _ = normalise(lw[None])
        W = W[0]
        sample = None
        target_log_evidence = None
        L = getattr(out, "target_log_weights", None)
        if L is not None and float(W.sum()) > 0:
            inv = torch.logsumexp(torch.log(W) - L[0], 0)  # log Σ_i W_i e^{−L_i}
            target_log_evidence = float(-inv) if bool(torch.isfinite(inv)) else None
        message = self._unsatisfiable
        if float(W.sum()) > 0:
            sample = int(torch.multinomial(W, 1, generator=g)[0])
        elif not message:
            message = NO_SAMPLE
        return Result(
            strategy=self.name,
            texts=texts,
            tokens=toks,
            log_weights=lw,
            weights=W,
            finished=out.finished[0],
            log_evidence=float(out.log_evidence[0]),
            ess=[float(e[0]) for e in out.ess],
            resampled=[bool(r[0]) for r in out.resampled],
            weight_history=[w[0] for w in out.weights],
            sample_index=sample,
            seconds=seconds,
            prompt_tokens=len(ids),
            particles=out.tokens.shape[1],
            block_size=getattr(self, "block_size", 0),
            draft_tokens=out.draft_tokens,
            accepted_tokens=getattr(out, "accepted_tokens", None),
            message=message,
            n_rounds=None if out.ess else out.rounds,
            eos_token_id=model.eos_token_id,
            block_sizes=[int(k[0]) for k in getattr(out, "block_sizes", [])],
            survivors=[int(s[0]) for s in getattr(out, "survivors", [])],
            target_log_evidence=target_log_evidence,
        )


class SMC(_Strategy):
    """Sequential Monte Carlo speculative decoding (SMC-SD).

    ``proposal``: a :class:`Draft` (its samples are reweighted, never rejected), or ``"target"``
    for a plain particle filter proposing one token per round from the locally normalised target.
    ``block_size`` K: draft tokens per round (a round adds K+1 tokens: the drafts and a bonus;
    default 4 with a draft; with ``proposal="target"`` leave it out: a round adds one token);
    ``"adaptive"`` (or ``AdaptiveBlocks(max_block_size=...)``) picks K ∈ {0..8} per round from the
    draft's record so far (docs/strategies.md); a list gives K per round (the last repeats; 0 allowed).
    ``ess_threshold`` τ: resample when ESS < τ·N; 0 never (sequential importance sampling), 1 every round.
    ``backend="engine"`` runs the same program on the GPU engine (paged KV cache, CUDA graphs, Triton;
    its torch reference path on the CPU); ``engine_options``: dtype, device, page_size, num_pages,
    use_graphs; every proposal but a feature draft (``"target"``: rounds of one bonus token).
    """

    name = "smc"

    def __init__(
        self,
        target,
        proposal="target",
        *,
        particles: int = 8,
        block_size: int | str | list | AdaptiveBlocks | FixedBlocks | None = None,
        resampler: str = "systematic",
        ess_threshold: float = 0.5,
        backend: str = "reference",
        engine_options: dict | None = None,
    ):
        super().__init__(target)
        self._set_backend(backend, engine_options)
        self.particles = check_positive_int("particles", particles, "use at least 1 particle", MAX_PARTICLES)
        self.proposal = as_proposal(proposal, self.model)
        if self.proposal is None:
            if block_size is not None:
                raise SMCDecodeError(
                    f"block_size={block_size!r} needs a draft: with proposal='target' every round proposes one "
                    "token from the target itself. Pass a draft as proposal (sd.Draft(model), or "
                    "load_default_draft(model) for the default model), or leave block_size out")
            self.block_size, self.schedule = 0, None
        else:
            block_size = 4 if block_size is None else block_size
            self.schedule = as_schedule(block_size)
            if self.schedule is not None:
                self.block_size = self.schedule.max_block_size
            else:
                self.block_size = check_positive_int(
                    "block_size", block_size,
                    "draft at least 1 token per round, or pass block_size='adaptive' (K from 0 up, chosen per round)")
        if not isinstance(resampler, str) or resampler not in RESAMPLERS:
            raise SMCDecodeError(f"unknown resampler {resampler!r}: choose one of {sorted(RESAMPLERS)}")
        self.resampler = resampler
        self.ess_threshold = check_unit_interval("ess_threshold", ess_threshold, "0 never resamples, 1 always")
        if self.proposal is not None and self.proposal.reads_target and backend != "reference":
            raise SMCDecodeError(
                f"feature draft {self.proposal.model.name!r} runs on backend='reference' only (the engine's "
                "rounds do not pass it the target's hidden states yet): use backend='reference', or a layer "
                "draft (load_default_draft(model) or load_draft(model, DIR)) on the engine"
            )

    def as_request(self, prompt, max_new_tokens: int = 64, seed: int | None = None, id=None) -> Request:
        """``run(prompt, max_new_tokens, seed)`` as one request of the reference backend's request loop
        (:class:`~smcdecode.samplers.loop.Loop`), to run interleaved with others; :meth:`result_of`
        turns its :class:`~smcdecode.samplers.loop.Finished` record into the Result ``run`` returns."""
        if self.backend != "reference":
            raise SMCDecodeError(f"as_request makes requests of the reference backend's loop; this SMC runs on "
                                 f"backend={self.backend!r}: use run, or the engine's Scheduler")
        ids = self._prepare(prompt, max_new_tokens)
        return Request(ids, self.target, self.proposal, self.particles, self.block_size, max_new_tokens,
                       resampler=self.resampler, ess_threshold=self.ess_threshold, schedule=self.schedule,
                       generator=_generator(seed), id=id)

    def result_of(self, finished: Finished, seconds: float = 0.0) -> Result:
        """The :class:`Result` of a request from :meth:`as_request` that left the loop (its error re-raised)."""
        if finished.error is not None:
            raise finished.error
        r = finished.request
        result = self._result(finished.output, r.prompt, seconds, r.generator)
        result.max_new_tokens = r.max_new_tokens
        return result

    def _run(self, ids, groups, max_new_tokens, g, bar):
        if self.backend == "engine":
            from .backends.engine.bridge import run_smc

            return run_smc(self, ids, groups, max_new_tokens, g, self.engine_options)
        return smc_sd(
            self.target, self.proposal, ids, groups=groups, particles=self.particles,
            block_size=self.block_size, max_new_tokens=max_new_tokens, resampler=self.resampler,
            ess_threshold=self.ess_threshold, generator=g, progress=bar, schedule=self.schedule,
        )


class SpeculativeDecoding(_Strategy):
    """Exact speculative decoding (the baseline): samples exactly p_T, ``samples`` independent
    sequences. Only a plain LM target (α = 1, no constraints or rewards) is allowed."""

    name = "speculative"

    def __init__(self, target, proposal, *, block_size: int = 4, samples: int = 1, backend: str = "reference",
                 engine_options: dict | None = None):
        super().__init__(target)
        self._set_backend(backend, engine_options)
        if self.target.lm.alpha != 1 or self.target.constraints or self.target.rewards:
            raise SMCDecodeError(
                f"exact speculative decoding samples the LM alone; target {self.target!r} has a power, "
                "constraint or reward: use SMC for it"
            )
        self.proposal = as_proposal(proposal, self.model)
        if self.proposal is None:
            raise SMCDecodeError("speculative decoding needs a draft proposal: pass Draft(model, temperature)")
        if self.proposal.reads_target:
            raise SMCDecodeError(
                f"exact speculative decoding does not run feature drafts ({self.proposal.model.name!r} reads the "
                "target's hidden states): use SMC with it, or a layer draft (load_default_draft(model) or load_draft(model, DIR))"
            )
        self.block_size = check_positive_int("block_size", block_size, "draft at least 1 token per round")
        self.samples = check_positive_int("samples", samples, maximum=MAX_PARTICLES)

    def _bar_scale(self) -> int:
        return self.samples

    def _run(self, ids, groups, max_new_tokens, g, bar):
        if self.backend == "engine":
            from .backends.engine.bridge import run_speculative

            return run_speculative(self, ids, groups, max_new_tokens, g, self.engine_options)
        out = speculative(
            self.target, self.proposal, ids, batch=groups * self.samples, block_size=self.block_size,
            max_new_tokens=max_new_tokens, generator=g, progress=bar,
        )
        return _regroup(out, groups)


class Autoregressive(_Strategy):
    """Plain autoregressive sampling of ``samples`` sequences from the locally normalised target
    p_T^α·1[valid] (exactly p_T when α = 1 and there is no constraint; rewards are not allowed).
    ``backend="engine"``: the engine's AR step (p_T^α = p at temperature T/α); with constraints, the
    engine's request loop with the target as proposal and no resampling (each row independent)."""

    name = "autoregressive"

    def __init__(self, target, *, samples: int = 1, backend: str = "reference", engine_options: dict | None = None):
        super().__init__(target)
        self._set_backend(backend, engine_options)
        if self.target.rewards:
            raise SMCDecodeError("autoregressive sampling cannot apply a reward tilt: use SMC for it")
        self.samples = check_positive_int("samples", samples, maximum=MAX_PARTICLES)
        self.block_size = 0

    def _run(self, ids, groups, max_new_tokens, g, bar):
        if self.backend == "engine":
            from .backends.engine.bridge import run_autoregressive

            return run_autoregressive(self, ids, groups, max_new_tokens, g, self.engine_options)
        out = autoregressive(
            self.target, ids, batch=groups * self.samples, max_new_tokens=max_new_tokens, generator=g, progress=bar
        )
        return _regroup(out, groups)


def _regroup(out: SMCOutput, groups: int) -> SMCOutput:
    B = out.tokens.shape[1]
    n = B // groups
    out.tokens = out.tokens.view(groups, n, -1)
    out.lengths = out.lengths.view(groups, n)
    out.finished = out.finished.view(groups, n)
    out.log_weights = out.log_weights.view(groups, n)
    out.log_evidence = torch.full((groups,), math.nan, dtype=torch.float64)
    return out
