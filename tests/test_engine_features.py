"""The engine's SMC-SD beyond the plain case, against exact enumeration on a tiny random Llama
(vocab 8, float32): constrained targets (regex automata on the device, and host masks — the
llguidance path), power targets p^α, reward tilts, and per-request N, K, temperatures and budgets in
one call. E[Ẑ · Σ_i W_i 1{x_i = s}] = π(s)·Z and E[Ẑ] = Z are checked cell by cell with
``smcdecode.testing`` (z-scores, threshold 5); the exact π comes from the library's enumerator over
a FunctionModel that runs the same transformers model in float64. On the CPU (torch reference
path) and, marked ``gpu``, on CUDA (Triton kernels, CUDA graphs)."""

from __future__ import annotations

import copy
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import smcdecode as sd
from smcdecode.backends.engine import Engine, EngineConfig, Llama
from smcdecode.backends.engine.scheduler import Scheduler
from smcdecode.backends.engine.targets import DeviceAutomaton, EngineTarget
from smcdecode.samplers.resampling import ancestors
from smcdecode.testing import check_distribution, check_evidence_unbiased, exact_target, sequences

transformers = pytest.importorskip("transformers")

VOCAB = ["<bos>", "a", "b", "ab", "ba", "c", "bb", "<eos>"]
V, EOS = len(VOCAB), len(VOCAB) - 1
PROMPT = [0, 1, 2]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def _tiny_hf(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rope_theta=10000.0, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.normal_(0.0, 0.15)  # logits of about a nat
    return hf


_CACHE: dict = {}


def _setup(device: str):
    """(Engine over target + nearby draft, FunctionModel running the target in float64)."""
    if device not in _CACHE:
        target_hf = _tiny_hf(0)
        draft_hf = copy.deepcopy(target_hf)
        with torch.no_grad():
            g = torch.Generator().manual_seed(1)
            draft_hf.lm_head.weight.add_(torch.randn(draft_hf.lm_head.weight.shape, generator=g) * 0.03)
        exact_hf = copy.deepcopy(target_hf).double()

        def fn(ctx):
            with torch.no_grad():
                return exact_hf(ctx).logits[:, -1]

        model = sd.FunctionModel(fn, vocab=VOCAB, eos="<eos>", name="tiny-llama")
        engine = Engine(Llama.from_hf(target_hf, dtype=torch.float32, device=device),
                        Llama.from_hf(draft_hf, dtype=torch.float32, device=device),
                        num_pages=30000, page_size=4, max_context=32)
        _CACHE[device] = (engine, model)
    return _CACHE[device]


def _output(out, groups=slice(None), particles: int | None = None, n: int | None = None):
    """The engine output (or some of its requests) as the samplers' [G, N, ...] tensors on the CPU."""
    N = particles or out.log_weights.shape[1]
    tokens = out.tokens[groups, :N].cpu()
    return SimpleNamespace(tokens=tokens[..., :n] if n else tokens, lengths=out.lengths[groups, :N].cpu(),
                           log_weights=out.log_weights[groups, :N].cpu(), log_evidence=out.log_evidence[groups].cpu())


# NOTE: drafts a little wider than the target (T_d = 1.2·T/min(α, 1)) keep the importance weights
# bounded, so every cell of π is visited often enough for the z-tests (a draft narrower than the
# target on some token leaves rare cells unvisited and the z-test's normal approximation fails).
def _run(engine, target, *, G=1500, N=4, K=2, n=3, T=1.0, Td=1.2, tau=0.5, resampler="systematic", seed=0,
         host_masks=False):
    prog = EngineTarget.of(target, host_masks=host_masks)
    kw = dict(particles=N, block_size=K, max_new_tokens=n, draft_temperature=Td, target_temperature=T,
              eos_token_id=EOS, ess_threshold=tau, resampler=resampler, target=prog)
    # a first, shorter call captures the round graph(s); the measured call (same shape) replays them
    engine.smc_sd([PROMPT] * G, **{**kw, "max_new_tokens": 1}, seed=seed + 1000)
    n_graphs = len(engine.graphs)
    out = engine.smc_sd([PROMPT] * G, **kw, seed=seed)
    assert len(engine.graphs) == n_graphs  # nothing captured anew
    return out


def _check_constraint(out, pattern: str, model) -> None:
    alive = torch.isfinite(out.log_weights)
    for g in range(0, out.tokens.shape[0], 5):
        for x, ok in zip(sequences(out, g), alive[g].tolist()):
            if ok:
                text = model.decode(list(x))
                assert re.fullmatch(pattern, text), f"particle {list(x)} ({text!r}) has weight > 0 but fails {pattern!r}"


PATTERNS = [r"[ab]{2,4}", r"(ab|b)*a"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_regex_constrained_smc_sd_is_the_global_conditional(device, pattern):
    engine, model = _setup(device)
    target = sd.LM(model) * sd.Regex(pattern)
    exact = exact_target(target, PROMPT, 3)
    out = _output(_run(engine, target, G=2500, K=2, resampler="stratified", seed=7))
    _check_constraint(out, pattern, model)
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)


@pytest.mark.parametrize("device", DEVICES)
def test_host_masks_match_the_device_automaton_path(device):
    """The host-mask path (what llguidance constraints use) on the same regex: same exact target."""
    engine, model = _setup(device)
    pattern = PATTERNS[0]
    target = sd.LM(model) * sd.Regex(pattern)
    exact = exact_target(target, PROMPT, 3)
    out = _output(_run(engine, target, G=1000, K=1, tau=1.0, seed=3, host_masks=True))
    _check_constraint(out, pattern, model)
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["llguidance", "automaton"])
def test_grammar_constraint_on_host_masks_and_device_automaton(device, path):
    """A grammar on llguidance (masks computed on the host every draft step) and, being regular, on
    the device automaton (stepped inside the round): the same exact target."""
    pytest.importorskip("llguidance")
    engine, model = _setup(device)
    grammar = sd.Grammar('start: ("a" | "b")+ "a"', path=path)  # = (a|b)+a
    assert (DeviceAutomaton.of(grammar.bind(model), "cpu") is None) == (path == "llguidance")
    target = sd.LM(model) * grammar
    exact = exact_target(target, PROMPT, 3)
    out = _output(_run(engine, target, G=1000, K=2, seed=5))
    _check_constraint(out, r"[ab]+a", model)
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", ["regex", "llguidance"])
def test_host_mask_round_as_one_waiting_graph_draws_what_the_eager_round_draws(path):
    """With host masks the proposal is one CUDA graph, launched whole, that waits on the device at
    each host point for the host's masks: for the same seed it draws the tokens and weights of the
    eager round (where the host uploads each step's masks as the proposal reaches it)."""
    pytest.importorskip("llguidance")
    engine, model = _setup("cuda")
    c = sd.Regex(PATTERNS[0]) if path == "regex" else sd.Grammar('start: ("a" | "b")+ "a"', path="llguidance")
    prog = EngineTarget.of(sd.LM(model) * c, host_masks=path == "regex")
    kw = dict(particles=4, block_size=2, max_new_tokens=4, eos_token_id=EOS, target=prog, draft_temperature=1.2)
    graphs = engine.smc_sd([PROMPT] * 64, **kw, seed=9, use_graphs=True)
    eager = engine.smc_sd([PROMPT] * 64, **kw, seed=9, use_graphs=False)
    assert torch.equal(graphs.tokens.cpu(), eager.tokens.cpu())
    torch.testing.assert_close(graphs.log_weights.cpu(), eager.log_weights.cpu(), rtol=0, atol=1e-9)
    _check_constraint(graphs, PATTERNS[0] if path == "regex" else r"[ab]+a", model)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path, workers", [("regex", 0), ("llguidance", 0), ("llguidance", 2)])
def test_host_mask_rounds_pipelined_draw_what_rounds_read_in_turn_draw(device, path, workers, monkeypatch):
    """With host masks a round is launched before the host reads the one before it (pipelined): the
    host ends that round (its last drafts and bonus), reads it and forks its states between the
    launch and the new round's first host point, while the device waits there. For the same seed it
    draws what rounds read before each launch draw: tokens, weights, evidence, rounds, ESS, also
    where requests end rounds apart (a round launched after every request ended does nothing) and
    with the llguidance states in mask worker processes; a round launched without pages set aside
    finds none left from the calls before. On CUDA with CUDA graphs (the waiting graph)."""
    if path == "llguidance":
        pytest.importorskip("llguidance")
    base, model = _setup(device)
    engine = Engine(base.target, base.draft, config=EngineConfig(num_pages=30000, page_size=4, max_context=32,
                                                                 host_workers=workers))
    pattern = r"[ab]{5,9}" if path == "regex" else r"[ab]+a"
    c = sd.Regex(pattern) if path == "regex" else sd.Grammar('start: ("a" | "b")+ "a"', path="llguidance")
    prog = EngineTarget.of(sd.LM(model) * c, host_masks=path == "regex")
    kw = dict(particles=4, block_size=2, max_new_tokens=20, eos_token_id=EOS, target=prog, draft_temperature=1.2,
              record_weights=True)
    launches, launch = [], Scheduler._launch

    def counting(sched, rnd, bucket, k, occupied, K_now, held, meanwhile=None):
        launches.append(held is not None and rnd.hosted)
        if held is None:  # (no pages set aside: none from an earlier round, this call's or one before it)
            assert not sched.full.buffers["fresh"][: bucket * sched.Nmax].any()
        return launch(sched, rnd, bucket, k, occupied, K_now, held, meanwhile)

    monkeypatch.setattr(Scheduler, "_launch", counting)
    piped = engine.smc_sd([PROMPT] * 24, **kw, seed=4, pipeline=True)
    assert sum(launches) >= 2  # (rounds launched before the one before them was read)
    launches.clear()
    plain = engine.smc_sd([PROMPT] * 24, **kw, seed=4, pipeline=False)
    assert not any(launches)
    for name in ("tokens", "lengths", "log_weights", "log_evidence", "finished"):
        assert torch.equal(getattr(piped, name).cpu(), getattr(plain, name).cpu()), name
    assert piped.rounds == plain.rounds == len(piped.ess) == len(plain.ess) == len(piped.weights)
    for a, b in zip(piped.ess + piped.resampled, plain.ess + plain.resampled):
        np.testing.assert_array_equal(a, b)  # (NaN equal to NaN: the ESS of a request whose particles all died)
    assert all(torch.equal(x, y) for x, y in zip(piped.weights, plain.weights))
    assert len(set(plain.lengths.max(1).values.tolist())) > 1  # (requests ended rounds apart)
    _check_constraint(piped, pattern, model)
    for key in list(engine.graphs.keys()):  # (its mask workers stopped now, not when collected)
        if getattr(engine.graphs[key], "host", None) is not None:
            engine.graphs[key].host.close()


@pytest.mark.parametrize("seed", range(4, 8))  # (seeds where the plain request ends at EOS, after the cancel)
def test_no_round_is_launched_after_every_request_ended_once_host_masks_leave(seed):
    """A pipelined round with host masks is launched without waiting for the round before only where
    that round's bonus masks left a row going on; a round without host-masked requests (the masked
    one cancelled) says nothing of that: the scheduler then waits, as for plain rounds, and launches
    no round after every request ended."""
    from smcdecode.backends.engine.scheduler import Request

    engine, model = _setup("cpu")
    masked = EngineTarget.of(sd.LM(model) * sd.Regex(r"[ab]{5,19}"), host_masks=True)
    plain = EngineTarget.of(sd.LM(model))
    sched = Scheduler(engine, slots=2, max_particles=4, max_block_size=2, eos_token_id=EOS, target=[masked, plain],
                      pipeline=True, seed=seed)
    sched.submit(Request(PROMPT, particles=4, block_size=2, max_new_tokens=25, id="masked", target=masked))
    sched.submit(Request(PROMPT, particles=1, block_size=2, max_new_tokens=25, id="plain", target=plain))
    sched.step()
    assert sched.cancel("masked")
    sched.run()
    assert sched.launched == sched.round  # (every round launched did some request's work)


def test_an_error_while_a_pipelined_host_mask_round_starts_returns_its_pages(monkeypatch):
    """An error raised between a pipelined round's launch and its first host point (here the host's
    fork of the round before) comes out of ``step`` with the pages set aside for that round back on
    the free list: every page is then either in use or free."""
    from smcdecode.backends.engine import host_masks
    from smcdecode.backends.engine.scheduler import Request

    engine, model = _setup("cpu")
    masked = EngineTarget.of(sd.LM(model) * sd.Regex(r"[ab]{5,19}"), host_masks=True)
    sched = Scheduler(engine, slots=2, max_particles=4, max_block_size=2, eos_token_id=EOS, target=masked,
                      pipeline=True, seed=1, ess_threshold=1.0)  # (resampled every round: a fork each round)
    for i in range(2):
        sched.submit(Request(PROMPT, particles=4, block_size=2, max_new_tokens=25, id=i))
    sched.step()
    sched.step()
    assert sched._flights and sched._flights[-1].held is not None  # (the round in flight was pipelined)

    def failing(self, index):
        raise RuntimeError("a fork failed")

    monkeypatch.setattr(host_masks.HostMasks, "fork", failing)
    with pytest.raises(RuntimeError, match="a fork failed"):
        sched.step()
    table = sched.table
    assert len(table.free) + table.used == table.ref.shape[0] - 1  # (page 0, the null page, is neither)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_an_error_between_host_points_releases_the_waiting_graph(monkeypatch):
    """An error while the host computes a point's masks (the graph launched whole, waiting on the
    device) comes out of the call without leaving the device waiting, and the next call draws what
    a call on a fresh start draws."""
    pytest.importorskip("llguidance")
    from smcdecode.backends.engine import host_masks

    engine, model = _setup("cuda")
    prog = EngineTarget.of(sd.LM(model) * sd.Grammar('start: ("a" | "b")+ "a"', path="llguidance"))
    kw = dict(particles=4, block_size=2, max_new_tokens=4, eos_token_id=EOS, target=prog, seed=9, use_graphs=True)
    before = engine.smc_sd([PROMPT] * 8, **kw)
    fill, calls = host_masks.HostMasks._fill, [0]

    def failing(self, i, turn):
        calls[0] += 1
        if calls[0] == 4:
            raise RuntimeError("a host point failed")
        return fill(self, i, turn)

    monkeypatch.setattr(host_masks.HostMasks, "_fill", failing)
    with pytest.raises(RuntimeError, match="a host point failed"):
        engine.smc_sd([PROMPT] * 8, **kw)
    monkeypatch.setattr(host_masks.HostMasks, "_fill", fill)
    after = engine.smc_sd([PROMPT] * 8, **kw)
    assert torch.equal(before.tokens.cpu(), after.tokens.cpu())
    torch.testing.assert_close(before.log_weights.cpu(), after.log_weights.cpu(), rtol=0, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_power_target(device, alpha):
    """π ∝ p^α (global), with the bonus normaliser log Σ_v p^α; Z = Σ_x p(x)^α."""
    engine, model = _setup(device)
    target = sd.LM(model) ** alpha
    exact = exact_target(target, PROMPT, 3)
    out = _output(_run(engine, target, K=2, Td=1.2 / min(alpha, 1.0), resampler="residual", seed=11))
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)


def _reward(text: str) -> float:
    return text.count("a") - 0.5 * text.count("b") + 0.3 * math.sin(len(text))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["prefix", "complete"])
def test_reward_target(device, mode):
    """π ∝ p·exp(β·R(x)): prefix twists (Z relative to R("")) and terminal rewards; a batched reward,
    a power and a constraint at once for the prefix mode."""
    engine, model = _setup(device)
    if mode == "prefix":
        reward = sd.Reward(lambda texts: [_reward(t) for t in texts], beta=0.8, mode=mode, batched=True)
        target = sd.LM(model) ** 2.0 * sd.Regex(r"[abc]*") * reward
    else:
        target = sd.LM(model) * sd.Reward(_reward, beta=-1.0, mode=mode)
    exact = exact_target(target, PROMPT, 3)
    out = _output(_run(engine, target, G=1000, K=1, Td=1.2, tau=1.0, resampler="multinomial", seed=13))
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("host_masks", [False, True])
def test_per_request_settings_in_one_call(device, host_masks):
    """Requests with different N, K, temperatures and budgets in one call: each request follows its
    own exact target (rows are padded to N_max; padding rows never count). ``host_masks``: the
    constraint's masks come from the host (the llguidance path), each request in its own lockstep."""
    engine, model = _setup(device)
    pattern = r"[ab]+"  # (no dead ends: the z-tests stay well-conditioned at this many replicates)
    a = dict(N=4, K=1, n=3, T=1.0, Td=1.25)
    b = dict(N=3, K=3, n=2, T=0.8, Td=1.0)
    G = 1200
    reqs = [a if g % 2 == 0 else b for g in range(G)]
    prog = EngineTarget.of(sd.LM(model) * sd.Regex(pattern), host_masks=host_masks)
    out = engine.smc_sd([PROMPT] * G, particles=[r["N"] for r in reqs], block_size=[r["K"] for r in reqs],
                        max_new_tokens=[r["n"] for r in reqs], target_temperature=[r["T"] for r in reqs],
                        draft_temperature=[r["Td"] for r in reqs], eos_token_id=EOS, ess_threshold=0.5,
                        target=prog, seed=17)
    assert out.particles == [r["N"] for r in reqs]
    assert bool(torch.isneginf(out.log_weights[1::2, 3]).all()) and int(out.lengths[1::2, 3].max()) == 0
    for sl, r in ((slice(0, G, 2), a), (slice(1, G, 2), b)):
        target = sd.LM(model, temperature=r["T"]) * sd.Regex(pattern)
        exact = exact_target(target, PROMPT, r["n"])
        o = _output(out, sl, particles=r["N"], n=r["n"])
        assert int(o.lengths.max()) <= r["n"]
        _check_constraint(o, pattern, model)
        check_distribution(o, exact, z_max=5.0)
        check_evidence_unbiased(o, exact.log_Z, z_max=5.0)


@pytest.mark.parametrize("scheme", ["systematic", "stratified", "multinomial", "residual"])
def test_segmented_resampler_offspring(scheme):
    """E[#children of i] = n_g·W_i over each group's first n_g rows; padding rows keep themselves."""
    torch.manual_seed(0)
    n = torch.tensor([5, 3, 1, 2])
    M = 5
    lw = torch.randn(4, M, dtype=torch.float64)
    lw[torch.arange(M)[None] >= n[:, None]] = -math.inf
    lw[1, 0] = -math.inf  # a zero-weight particle is never chosen
    W = torch.softmax(lw, -1)
    reps = 4000
    counts = torch.zeros(4, M, dtype=torch.float64)
    for _ in range(reps):
        A = ancestors(W, scheme, n=n)
        for g in range(4):
            assert torch.equal(A[g, n[g]:], torch.arange(n[g], M))
            counts[g] += torch.bincount(A[g, : n[g]], minlength=M).double()
    assert counts[1, 0] == 0
    expected = n[:, None] * W * reps
    sd_ = torch.sqrt(n[:, None] * W * (1 - W) * reps).clamp(min=1.0)
    assert ((counts - expected).abs() / sd_).max() < 5, (counts / reps, expected / reps)


def test_engine_refuses_what_it_cannot_run():
    engine, model = _setup("cpu")
    with pytest.raises(sd.SMCDecodeError, match="eos_token_id"):
        engine.smc_sd([PROMPT], particles=2, block_size=1, max_new_tokens=3, target=EngineTarget.of(
            sd.LM(model) * sd.Regex("a+")))
    with pytest.raises(sd.SMCDecodeError, match="particles lists 3 values for 2 prompts"):
        engine.smc_sd([PROMPT] * 2, particles=[1, 2, 3], block_size=1, max_new_tokens=3)
    with pytest.raises(sd.SMCDecodeError, match="block_size must be an integer >= 0"):
        engine.smc_sd([PROMPT], particles=2, block_size=-1, max_new_tokens=3)


@pytest.mark.parametrize("device", DEVICES)
def test_plain_fused_round_with_eos(device):
    """The plain uniform case with EOS: a drafted or bonus EOS ends
    the particle (absorbing), and the output follows p exactly (Z = 1)."""
    engine, model = _setup(device)
    target = sd.LM(model)
    exact = exact_target(target, PROMPT, 3)
    kw = dict(particles=4, block_size=1, max_new_tokens=3, eos_token_id=EOS, ess_threshold=0.5, draft_temperature=1.2)
    engine.smc_sd([PROMPT] * 4, **{**kw, "max_new_tokens": 1}, seed=1)
    out = _output(engine.smc_sd([PROMPT] * 1500, **kw, seed=2))
    for g in range(0, 1500, 7):
        for x in sequences(out, g):
            assert EOS not in x[:-1], x  # nothing after an EOS
    check_distribution(out, exact, z_max=5.0)
    check_evidence_unbiased(out, exact.log_Z, z_max=5.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", ["regex", "reward", "programs"])
def test_requests_join_and_leave_between_rounds(device, variant):
    """Continuous batching: more requests than slots, with different N, K, temperatures and budgets;
    each joins when a slot frees up and leaves when finished. Every request still follows its own
    exact target (EOS ends particles at different rounds, so requests leave at different rounds).
    ``reward``: a prefix twist (rows of a joining request restart from R("")); ``programs``: the two
    kinds of request run different programs (a regex; a power with two regexes and a reward)."""
    from smcdecode.backends.engine.scheduler import Request, Scheduler

    engine, model = _setup(device)
    regex = sd.Regex(r"[ab]+")
    twist = sd.Reward(lambda texts: [_reward(t) for t in texts], beta=0.7, mode="prefix", batched=True)
    program_a = program_b = sd.LM(model) * regex * (twist if variant == "reward" else sd.Regex(r".*"))
    if variant == "programs":
        program_b = sd.LM(model) ** 2.0 * sd.Regex(r"[abc]*") * sd.Regex(r".{0,3}") * twist
    prog = {id(p): EngineTarget.of(p) for p in (program_a, program_b)}
    a = dict(particles=4, block_size=1, max_new_tokens=3, target_temperature=1.0, draft_temperature=1.25)
    b = dict(particles=3, block_size=2, max_new_tokens=2, target_temperature=0.8)
    reqs = [Request(PROMPT, **(a if i % 2 == 0 else b), id=i, target=prog[id(program_a if i % 2 == 0 else program_b)])
            for i in range(1200)]
    sched = Scheduler(engine, slots=96, max_particles=4, max_block_size=2, eos_token_id=EOS,
                      target=list(prog.values()), ess_threshold=1.0, seed=23)
    for r in reqs[:600]:
        sched.submit(r)
    done = []
    while sched.busy:
        if sched.round == 3:  # later arrivals
            for r in reqs[600:]:
                sched.submit(r)
        done.extend(sched.step())
    assert len(done) == len(reqs) and len({f.request.id for f in done}) == len(reqs)
    assert len({f.joined_round for f in done}) > 5  # requests joined at many different rounds
    by_id = {f.request.id: f for f in done}
    for parity, s, program in ((0, a, program_a), (1, b, program_b)):
        fs = [by_id[i] for i in range(parity, len(reqs), 2)]
        out = SimpleNamespace(tokens=torch.stack([f.tokens for f in fs]), lengths=torch.stack([f.lengths for f in fs]),
                              log_weights=torch.stack([f.log_weights for f in fs]),
                              log_evidence=torch.tensor([f.log_evidence for f in fs], dtype=torch.float64))
        assert out.tokens.shape == (len(fs), s["particles"], s["max_new_tokens"])
        lm = program.lm
        exact = exact_target(sd.Product([sd.LM(model, temperature=s["target_temperature"]) ** lm.alpha,
                                         *program.factors[1:]]), PROMPT, s["max_new_tokens"])
        _check_constraint(out, r"[ab]+" if program is program_a else r"[abc]{0,3}", model)
        check_distribution(out, exact, z_max=5.0)
        check_evidence_unbiased(out, exact.log_Z, z_max=5.0)
    # the engine's batch call on the same requests (all at once) returns them in request order
    served = engine.serve([Request(PROMPT, **a, id=i) for i in range(8)], slots=3, eos_token_id=EOS,
                          target=EngineTarget.of(sd.LM(model) * regex))
    assert [f.request.id for f in served] == list(range(8))


@pytest.mark.parametrize("device", DEVICES)
def test_per_request_targets_in_one_call(device):
    """Each prompt with its own program in one call (one captured round): a regex, a power target
    without constraints, two intersected regexes, a reward tilt. Every request follows its own
    exact target; the automata share one device table."""
    engine, model = _setup(device)
    lm = sd.LM(model)
    programs = [
        lm * sd.Regex(r"[ab]+"),
        lm**2.0,
        lm * sd.Regex(r"[ab]{2,4}") * sd.Regex(r"a.*"),
        lm * sd.Reward(_reward, beta=-0.7, mode="complete"),
    ]
    G = 2400
    targets = [EngineTarget.of(programs[g % 4]) for g in range(4)]
    out = engine.smc_sd([PROMPT] * G, particles=4, block_size=2, max_new_tokens=3, draft_temperature=1.2,
                        eos_token_id=EOS, ess_threshold=0.5, target=[targets[g % 4] for g in range(G)], seed=29)
    for i, program in enumerate(programs):
        o = _output(out, slice(i, G, 4))
        exact = exact_target(program, PROMPT, 3)
        if i in (0, 2):
            _check_constraint(o, r"[ab]+" if i == 0 else r"a[ab]{1,3}", model)
        check_distribution(o, exact, z_max=5.0)
        check_evidence_unbiased(o, exact.log_Z, z_max=5.0)


@pytest.mark.parametrize("device", DEVICES)
def test_round_shape_follows_the_largest_block_size_present(device):
    """Mixed K: while a K = 3 request is in, every row runs the 3-draft round; once it has left, the
    K = 1 requests run the 1-draft round (they stop paying for the largest K). Each shape is
    captured once (CUDA graphs on the GPU)."""
    from smcdecode.backends.engine.scheduler import Request, Scheduler

    engine, model = _setup(device)
    engine.clear_graphs()
    sched = Scheduler(engine, slots=4, max_particles=2, max_block_size=3, eos_token_id=None, seed=0)
    sched.submit(Request(PROMPT, particles=2, block_size=3, max_new_tokens=8))
    for _ in range(3):
        sched.submit(Request(PROMPT, particles=2, block_size=1, max_new_tokens=12))
    left = [len(sched.step()) for _ in range(2)]
    assert left == [0, 1]  # the K = 3 request: 2 rounds of 4 tokens
    assert set(sched._rounds.by_bucket) == {(4, 3, False)}
    done = sched.run()
    assert len(done) == 3 and all(int(f.lengths.max()) == 12 for f in done)
    assert sched.round == 2 + (12 - 2 * 2) // 2  # the K = 1 requests: 2 tokens a round
    assert set(sched._rounds.by_bucket) == {(4, 3, False), (4, 1, False)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_draft", [False, True])
def test_k0_rounds_with_a_free_slot_in_the_bucket(device, with_draft):
    """Rounds of bonus tokens only (every request K = 0: the target as proposal, as the server's AR
    scheduler runs them) over a bucket with a free slot: the free slot's rows must index the target's
    logits at K = 0 too. A late request joins mid-run; each request gets one token a round."""
    from smcdecode.backends.engine.scheduler import Request, Scheduler

    engine, _ = _setup(device)
    if not with_draft:
        engine = Engine(engine.target, None, num_pages=400, page_size=4, max_context=32)
    sched = Scheduler(engine, slots=4, max_particles=2, max_block_size=2 if with_draft else 0, eos_token_id=None,
                      ess_threshold=0.0, seed=0)
    for particles in (2, 1):
        sched.submit(Request(PROMPT, particles=particles, block_size=0, max_new_tokens=12))
    assert [sched.step() for _ in range(2)] == [[], []]
    sched.submit(Request(PROMPT, particles=1, block_size=0, max_new_tokens=4, id="late"))  # slot 2: bucket 4
    done = {f.request.id: f for f in sched.run()}
    late = done.pop("late")
    assert (late.joined_round, late.rounds, int(late.lengths[0])) == (2, 4, 4)
    assert all(f.rounds == 12 and bool((f.lengths == 12).all()) for f in done.values())
    assert not any(any(f.resampled) for f in done.values())  # τ = 0: never resampled
