"""Packed token masks (int32 bitmasks, llguidance's layout): packing, llguidance's parallel fill
against its single-matcher mask, the unique-key rule on bits, and the engine's HostMasks (bitmask
rows of several requests, uploaded and unpacked) against the boolean masks of each request."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import smcdecode as sd
from smcdecode.backends.engine.host_masks import HostMasks, RequestMasks
from smcdecode.potentials.constraint import no_bit_set, pack_bits, unpack_bits
from smcdecode.potentials.json_keys import DEAD
from smcdecode.potentials.json_schema import JSONSchema
from smcdecode.potentials.matchers import MatcherBatch, fill_bits_together

EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
if not EVAL.exists():
    EVAL = Path("/work/shared/data/eval")


def _schemas(name: str, count: int) -> list[dict]:
    with open(EVAL / name) as f:
        return [json.loads(line)["schema"] for line in f][:count]


@pytest.mark.parametrize("V", [1, 31, 32, 33, 100, 49152])
def test_pack_unpack_round_trip(V):
    g = torch.Generator().manual_seed(V)
    mask = torch.rand(5, V, generator=g) < 0.5
    mask[0] = True
    mask[1] = False
    bits = pack_bits(mask)
    assert bits.dtype == torch.int32 and bits.shape == (5, (V + 31) // 32)
    assert torch.equal(unpack_bits(bits, V), mask)
    # the layout llguidance writes: token v is bit v % 32 of word v // 32 (little-endian bytes)
    flat = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")
    assert np.array_equal(flat[:, :V], mask.numpy()) and not flat[:, V:].any()
    # the rows that allow no token, read from the words, also where bits past V are set (an
    # unconstrained row's words are all ones)
    mask[2] = False
    mask[3] = False
    mask[3, V - 1] = True
    bits = pack_bits(mask)
    if V % 32:
        bits[2, -1] = -1 << (V % 32)  # (every bit past V)
    assert torch.equal(no_bit_set(bits, V), ~mask.any(-1)), V


@pytest.mark.parametrize("eos", [0, 31, 37, 69])
def test_bonus_masks_tell_whether_a_row_goes_on(eos):
    """After a round's bonus masks the next round is launched without waiting for the round's end
    only where some row goes on: its masks allow a token but not EOS (a row allowed EOS may end; a row
    allowed nothing dies)."""
    V = 70
    host = HostMasks(2, V, "cpu")
    host.eos = eos
    masks = torch.zeros(4, V, dtype=torch.bool)
    masks[0, eos] = True  # EOS alone
    masks[1] = True  # every token
    # (row 2: no token; row 3: every token, EOS too)
    masks[3] = True
    assert not host._goes_on(pack_bits(masks).numpy())
    masks[2, (eos + 1) % V] = True  # a token, not EOS: that row goes on
    assert host._goes_on(pack_bits(masks).numpy())
    masks[2, eos] = True
    assert not host._goes_on(pack_bits(masks).numpy())
    host.eos = -1  # (no EOS: every row goes on until its budget)
    assert host._goes_on(pack_bits(masks).numpy())


def test_engine_sampler_reads_packed_masks_on_the_cpu():
    """The engine's sampler given the host's masks packed (``mask_bits``) draws as with the unpacked
    mask (the torch function unpacks them; the fused kernel reads them: test_engine_kernels)."""
    from smcdecode.backends.engine.sampling import sample_and_score

    V = 70
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, V, generator=g)
    mask = torch.rand(6, V, generator=g) < 0.3
    mask[1] = False
    outs = []
    for kw in ({"mask": mask}, {"mask_bits": pack_bits(mask)}):
        torch.manual_seed(4)
        outs.append(sample_and_score(logits, 0.9, None, alpha=torch.full((6,), 0.7), **kw))
    for a, b in zip(*outs):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    assert mask[torch.arange(6) != 1, outs[0].token[torch.arange(6) != 1]].all()
    with pytest.raises(ValueError, match="not both"):
        sample_and_score(logits, 0.9, None, mask=mask, mask_bits=pack_bits(mask))


def _reference_mask(c, state, matchers=None) -> torch.Tensor:
    """bool [B, V] from llguidance's single-matcher bitmask, dead rows emptied, repeated keys removed
    by the boolean key rule (the path before packed masks). ``matchers``: llguidance's matchers fed
    the rows' tokens, where ``state``'s may stand in for them past a complete document
    (``matchers.Stopped``)."""
    V = c.model.vocab_size
    matchers = state.matchers if matchers is None else matchers
    rows = []
    for m in matchers:
        raw = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        rows.append(torch.from_numpy(np.unpackbits(raw, bitorder="little")[:V].astype(bool)))
    mask = torch.stack(rows)
    for i in range(len(state)):
        if matchers[i].is_error():
            mask[i] = False
    if state.keys is not None:
        mask = c._keys.restrict(mask, state.keys)
    return mask


@pytest.mark.parametrize("threads", [0, -2, 1.5, True, "4"])
def test_threads_must_be_a_count(threads):
    for path in ("llguidance", "automaton"):
        with pytest.raises(sd.SMCDecodeError, match=r"threads must be None or 1 .* got"):
            JSONSchema({"type": "string", "maxLength": 3}, path=path, threads=threads)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["jsonschemabench_Glaiveai2K.jsonl", "jsonschemabench_Github_easy.jsonl"])
def test_bitmask_fill_equals_single_matcher_masks_on_real_schemas(model, source):
    """N = 8 particles walk random valid token paths (uniform over the allowed tokens) through real
    schemas on SmolLM2's vocabulary; at every step the packed parallel fill, unpacked, equals the
    reference masks, and row 7 is a dead particle (an empty mask)."""
    V, eos = model.vocab_size, model.eos_token_id
    g = torch.Generator().manual_seed(0)
    checked = 0
    assert JSONSchema({"type": "object"}, threads=1).bind(model)._executor is None
    for schema in _schemas(source, 3):
        c = JSONSchema(schema, path="llguidance").bind(model)
        state = c.start(8)
        theirs = [c._template.deep_copy() for _ in range(8)]  # (llguidance's own, fed the same tokens)
        for step in range(24):
            ref = _reference_mask(c, state, theirs)
            bits = c.allowed_bits(state)
            assert torch.equal(unpack_bits(bits, V), ref), (schema, step)
            assert torch.equal(c.allowed(state), ref)
            out = torch.full_like(bits, 7)
            c.fill_bits(state, out)
            assert torch.equal(out, bits)
            # without an executor (threads=1, a mask worker's constraints): row by row in this thread, the same
            executor, c._executor = c._executor, None
            try:
                out = torch.full_like(bits, 7)
                fill_bits_together([(c, MatcherBatch(state.matchers, state.keys), 0)], out, 8)
            finally:
                c._executor = executor
            assert torch.equal(out, bits)
            choice = ref.clone()
            choice[:, eos] = False
            alive = choice.any(1)
            weights = torch.where(alive[:, None], choice.double(), 1.0)
            tokens = torch.multinomial(weights, 1, generator=g)[:, 0]
            if step == 0:  # a token the schema does not allow: row 7 dies
                bad = (~ref[7]).nonzero()[0, 0]
                tokens[7] = bad
            state = c.advance(state, tokens)
            for m, t in zip(theirs, tokens.tolist()):
                m.consume_token(t)
            checked += int(alive.sum())
        assert state.matchers[7].is_error() and not c.allowed(state)[7].any()
    assert checked > 3 * 24 * 2  # particles stay alive for much of the walk (a finished document allows EOS only)


@pytest.mark.slow
def test_repeated_keys_are_cleared_on_bits(model):
    """The unique-key rule on packed masks equals the boolean rule, for an object that holds keys."""
    c = JSONSchema({"type": "object", "additionalProperties": {"type": "integer"}}, path="llguidance").bind(model)
    assert c._keys is not None
    texts = ['{"a": 1, "a', '{"ab": 1, "a": 2, "ab', '{"x": {"y": 1, "y', "{"]  # inside a repeated key
    keys = [c._keys.replay(model.encode(t)) for t in texts] + [DEAD]
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(len(keys), model.vocab_size, generator=g) < 0.9
    blocked = [len(c._keys.blocked(k)) for k in keys[:-1]]
    assert blocked[0] > 0 and blocked[1] > 0 and blocked[2] > 0  # the test exercises the rule
    bits = c._keys.restrict_bits(pack_bits(mask), keys)
    assert torch.equal(unpack_bits(bits, model.vocab_size), c._keys.restrict(mask.clone(), keys))


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("handed, workers", [(True, 0), (False, 0), (True, 2)])
def test_host_masks_pack_every_request_into_one_bitmask(model, device, handed, workers):
    """Two requests (N = 3 and N = 2 of N_max = 4, different schemas, K = 2; the second also under a
    regex, whose token automaton ANDs its packed mask in): HostMasks' mask of each step (llguidance's
    rows of both requests filled in one call) equals each request's own boolean masks on its rows and
    every token elsewhere. ``handed``: the round hands each drafted column over (``drafted``: on a GPU a
pinned copy and an event); else the host reads it from the drafts buffer. ``workers``: the first
    request's llguidance states held by two mask worker processes, the second's (a regex too) here.
    In the last round the first request has left: its rows, written with its masks before, allow
    every token again."""
    V = model.vocab_size
    schemas = _schemas("jsonschemabench_Glaiveai2K.jsonl", 2)
    cs = [JSONSchema(s, path="llguidance").bind(model) for s in schemas]
    regex = sd.Regex(r'[{}\[\]":, a-z0-9_.-]*').bind(model)
    refs = [c.start(n) for c, n in zip(cs, (3, 2))]
    ref_regex = regex.start(2)
    host = HostMasks(4, V, device, rows=8, k_max=2, workers=workers)
    host.add(0, RequestMasks([cs[0]], 3, block_size=2, budget=100))
    host.add(1, RequestMasks([cs[1], regex], 2, block_size=2, budget=100))
    assert [m.remote for m in host.requests.values()] == [bool(workers), False]
    g = torch.Generator().manual_seed(2)
    rows = 8
    live = [True, True]
    for _round in range(4):
        if _round == 3:
            host.remove(0)
            live[0] = False
        drafts = torch.zeros(rows, 2, dtype=torch.long, device=device)
        host.begin(rows, 2, drafts)
        for i in range(3):  # draft steps 0, 1 and the bonus
            out = torch.zeros(rows, host.W, dtype=torch.int32, device=device)
            host.mask(i, out)
            m = unpack_bits(out, V).cpu()
            expect = torch.ones(rows, V, dtype=torch.bool)
            for slot, (c, s) in enumerate(zip(cs, refs)):
                if live[slot]:
                    expect[slot * 4: slot * 4 + len(s)] = c.allowed(s)
            expect[4:6] &= regex.allowed(ref_regex)
            assert torch.equal(m, expect), (_round, i)
            choice = expect.clone()
            choice[:, model.eos_token_id] = False
            d = torch.multinomial(choice.double() + 1e-30 * (~choice.any(1, keepdim=True)), 1, generator=g)[:, 0]
            refs = [c.advance(s, d[slot * 4: slot * 4 + len(s)]) if live[slot] else s
                    for slot, (c, s) in enumerate(zip(cs, refs))]
            ref_regex = regex.advance(ref_regex, d[4:6])
            d_dev = d.to(device)
            if i < 2:
                drafts[:, i] = d_dev
                if handed:
                    host.drafted(i, d_dev)
            else:
                host.end(d_dev)
    host.close()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_host_masks_of_rows_sharing_matchers_equal_their_replayed_histories(model, workers):
    """Resampled rows share their ancestor's matcher (copy on write) and, drawing from one logit vector,
    often take the same token: every step's HostMasks mask (one mask per distinct matcher, the
    unique-key rule applied) equals, row by row, the reference mask of that row's own token history
    replayed into a fresh matcher; where the states are held by mask workers (``workers``), the
    rows that end a round accepting are those of the histories too."""
    V, eos = model.vocab_size, model.eos_token_id
    c = JSONSchema({"type": "object", "additionalProperties": {"type": "integer"}}, path="llguidance").bind(model)
    closing = torch.tensor([b is not None and b"}" in b for b in c._keys.token_bytes])  # (documents stay open)
    N, K = 4, 2
    host = HostMasks(N, V, "cpu", rows=N, k_max=K, workers=workers)
    host.add(0, RequestMasks([c], N, K, budget=1000))
    assert host.requests[0].remote == bool(workers)
    hist = [[] for _ in range(N)]
    g = torch.Generator().manual_seed(3)
    out = torch.empty(N, host.W, dtype=torch.int32)
    shared_steps = 0
    for rnd in range(8):
        drafts = torch.zeros(N, K, dtype=torch.long)
        host.begin(N, K, drafts)
        for i in range(K + 1):
            host.mask(i, out)
            ref = _reference_mask(c, c._replay(hist))
            assert torch.equal(unpack_bits(out, V), ref), (rnd, i)
            if not workers:
                matchers = host.requests[0].states[0].matchers
                shared_steps += len({id(m) for m in matchers}) < N
            choice = ref & ~closing
            choice[:, eos] = False
            logits = torch.rand(V, generator=g).expand(N, V).clone()
            logits[3] = torch.rand(V, generator=g)  # row 3 draws on its own
            d = torch.where(choice, logits, -1.0).argmax(1)
            for r in range(N):
                hist[r].append(int(d[r]))
            if i < K:
                drafts[:, i] = d
                host.drafted(i, d)
            else:
                host.end(d)
        accepting = [bool(c.accepting(c._replay([h]))[0]) for h in hist]
        assert (~host.rejects(N)).tolist() == accepting
        index = torch.tensor([0, 0, 1, 0] if rnd % 2 == 0 else [2, 2, 3, 3])
        host.fork(index)
        hist = [list(hist[a]) for a in index]
    assert workers or shared_steps > 8  # the rows did share matchers for much of the walk
    host.close()


@pytest.mark.slow
def test_next_round_first_masks_filled_before_the_resampling_follow_the_ancestors(model):
    """With mask workers, a round's end fills the next round's step-0 masks from the states before the
    resampling, and step 0 gives each row its ancestor's row. Rows draw their tokens on their own (so
    their masks differ), the resampling moves rows between ancestors, and requests come and go between
    a round's end and the next round's step 0: every step's rows equal the masks of each row's own
    replayed history, and the rows of a request that left (or of a smaller one in its slot) allow
    every token. The walk is checked to be one where the ancestors' masks differ from the rows' own."""
    V, eos, K = model.vocab_size, model.eos_token_id, 2
    schemas = _schemas("jsonschemabench_Glaiveai2K.jsonl", 2)
    cs = [JSONSchema(s, path="llguidance").bind(model) for s in schemas]
    host = HostMasks(4, V, "cpu", rows=8, k_max=K, workers=2)
    held = {0: (cs[0], 4), 1: (cs[1], 2)}  # slot -> (constraint, rows)
    for slot, (c, n) in held.items():
        host.add(slot, RequestMasks([c], n, K, budget=1000))
    hist = {0: [[] for _ in range(4)], 1: [[] for _ in range(2)]}
    g = torch.Generator().manual_seed(5)
    out = torch.empty(8, host.W, dtype=torch.int32)
    moved = 0  # rows whose ancestor's step-0 mask differs from their own history's
    for rnd in range(5):
        if rnd == 2:  # a smaller request takes slot 1 between the end and step 0: its row 5 is free
            host.remove(1)
            held[1], hist[1] = (cs[1], 1), [[]]
            host.add(1, RequestMasks([cs[1]], 1, K, budget=1000))
        if rnd == 3:  # slot 1 left: its row allows every token
            host.remove(1)
            del held[1], hist[1]
        drafts = torch.zeros(8, K, dtype=torch.long)
        host.begin(8, K, drafts)
        for i in range(K + 1):
            host.mask(i, out)
            expect = torch.ones(8, V, dtype=torch.bool)
            for slot, (c, n) in held.items():
                expect[slot * 4: slot * 4 + n] = _reference_mask(c, c._replay(hist[slot]))
            assert torch.equal(unpack_bits(out, V), expect), (rnd, i)
            choice = expect.clone()
            choice[:, eos] = False
            d = torch.multinomial(choice.double() + 1e-30 * (~choice.any(1, keepdim=True)), 1, generator=g)[:, 0]
            for slot, (_, n) in held.items():
                for r in range(n):
                    hist[slot][r].append(int(d[slot * 4 + r]))
            if i < K:
                drafts[:, i] = d
                host.drafted(i, d)
            else:
                host.end(d)
        index = np.arange(8)
        for slot, (c, n) in held.items():
            local = torch.randint(0, n, (n,), generator=g).numpy()
            before = _reference_mask(c, c._replay(hist[slot]))
            moved += int((before[local] != before).any(1).sum())
            index[slot * 4: slot * 4 + n] = slot * 4 + local
            hist[slot] = [list(hist[slot][a]) for a in local]
        host.fork(index)
    assert moved > 0  # (some step 0 did take rows from other ancestors whose masks differ)
    host.close()


@pytest.mark.slow
def test_requests_of_one_constraint_take_lanes_whose_masks_agree(model):
    """Three requests under one constraint take lanes 0, 1, 2 (each a compile of its own, so
    llguidance fills them in parallel); fed the same tokens, every request's HostMasks rows equal
    the reference masks of one replayed history, whatever its lane. A lane is taken modulo the
    pool's threads, and a lane that is not a whole number >= 0 is refused."""
    V = model.vocab_size
    c = JSONSchema(_schemas("jsonschemabench_Glaiveai2K.jsonl", 1)[0], path="llguidance", threads=3).bind(model)
    N, K = 2, 2
    host = HostMasks(N, V, "cpu")
    for slot in range(3):
        host.add(slot, RequestMasks([c], N, K, budget=100, lane=slot))
    assert len(c._lanes) == 3 and len({id(m) for m in c._lanes}) == 3
    assert c._lane(4) is c._lanes[1]
    one = JSONSchema(_schemas("jsonschemabench_Glaiveai2K.jsonl", 1)[0], path="llguidance").bind(model)
    one.start(2, lane=5)  # (no pool by default: every row from lane 0)
    assert one._executor is None and len(one._lanes) == 1
    for bad in (-1, 1.5, True):
        with pytest.raises(sd.SMCDecodeError, match="lane"):
            c.start(2, lane=bad)
    rows, hist = 3 * N, []
    g = torch.Generator().manual_seed(4)
    out = torch.empty(rows, host.W, dtype=torch.int32)
    for _round in range(3):
        drafts = torch.zeros(rows, K, dtype=torch.long)
        host.begin(rows, K, drafts)
        for i in range(K + 1):
            host.mask(i, out)
            ref = _reference_mask(c, c._replay([hist]))[0]
            assert torch.equal(unpack_bits(out, V), ref.expand(rows, V)), (_round, i)
            choice = ref.clone()
            choice[model.eos_token_id] = False
            t = int(torch.multinomial(choice.double(), 1, generator=g))
            hist.append(t)
            d = torch.full((rows,), t)
            if i < K:
                drafts[:, i] = d
                host.drafted(i, d)
            else:
                host.end(d)


@pytest.mark.slow
def test_complete_documents_and_dead_particles_on_the_host_masks(model):
    """A matcher whose document is complete (llguidance has stopped it) gets EOS alone, as
    llguidance's own mask of it; a dead one no token (where llguidance's mask would allow EOS)."""
    V, eos = model.vocab_size, model.eos_token_id
    c = JSONSchema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                    "additionalProperties": False}, path="llguidance").bind(model)
    texts = ['{"a": 12}', '{"a": 1', '{"a"']
    state = c._replay([model.encode(t) for t in texts])
    assert state.matchers[0].is_stopped() and not state.matchers[1].is_stopped()
    state = c.advance(state, torch.tensor([eos, model.encode("}")[0], model.encode("x")[0]]))
    assert state.matchers[2].is_error()
    bits = c.allowed_bits(state)
    ref = _reference_mask(c, state)
    assert torch.equal(unpack_bits(bits, V), ref)
    assert ref[0].nonzero().flatten().tolist() == [eos] and ref[1].nonzero().flatten().tolist() == [eos]
    assert not ref[2].any()
