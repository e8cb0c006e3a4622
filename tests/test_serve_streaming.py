"""Exact streaming, without a server: what a watch reports as final is a prefix of what the
strategies return, on toy models small enough to run many seeds; text deltas with stop sequences
and incomplete UTF-8 characters."""

from __future__ import annotations

import threading

import pytest
import torch

import smcdecode as sd
from smcdecode.serve.stream import TextStream, cut_at_stop
from smcdecode.serve.watch import Cancelled, Watch, WatchedRunner

VOCAB = ["a", "b", "c", "d", "<eos>"]
EOS = 4


def _table(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(VOCAB), len(VOCAB), generator=g) * 1.5


class WatchedToy(sd.FunctionModel):
    """A toy LM whose runners are watched while ``watch`` is set (as the server's model's are)."""

    watch = None

    def start(self, prefix_ids, batch):
        runner = super().start(prefix_ids, batch)
        return runner if self.watch is None else WatchedRunner(runner, self.watch, len(prefix_ids), batch)


def _toy(seed: int, cls=sd.FunctionModel):
    table = _table(seed)

    def fn(ctx):  # next-token logits from the last token, and a growing pull towards EOS
        logits = table[ctx[:, -1]].clone()
        logits[:, EOS] += 0.3 * ctx.shape[1] - 2
        return logits

    return cls(fn, VOCAB, eos="<eos>")


def _run(strategy: str, seed: int, regex: str | None = None):
    target_model = _toy(1, WatchedToy)
    draft = sd.Draft(_toy(2), temperature=1.0)
    target = sd.LM(target_model, temperature=1.0)
    if regex is not None:
        target = target * sd.Regex(regex)
    if strategy == "smc":
        runner = sd.SMC(target, draft, particles=4, block_size=2, ess_threshold=0.9)
    elif strategy == "sd":
        runner = sd.SpeculativeDecoding(target, draft, block_size=2)
    else:
        runner = sd.Autoregressive(target)
    commits: list[list[int]] = []

    def on_commit(ids) -> bool:
        commits.append(list(ids))
        return False  # never stop early

    target_model.watch = Watch(strategy, EOS, on_commit, threading.Event())
    result = runner.run([0, 1], max_new_tokens=12, seed=seed, progress=False)
    return result, commits


@pytest.mark.parametrize("strategy", ["smc", "sd", "ar"])
def test_what_a_watch_reports_is_a_prefix_of_every_particle_that_can_be_returned(strategy):
    grew = 0
    for seed in range(40):
        for regex in (None, "[ab]*c[a-d]*") if strategy != "sd" else (None,):
            result, commits = _run(strategy, seed, regex)
            assert all(len(a) < len(b) for a, b in zip(commits, commits[1:]))  # reported only when it grows
            keep = [t[: t.index(EOS)] if EOS in t else t for t, w in zip(result.tokens, result.weights) if w > 0]
            for ids in commits:
                for toks in keep:
                    assert toks[: len(ids)] == ids, (seed, regex, ids, toks)
            if commits and result.sample_tokens is not None:
                grew += len(commits[-1]) > 0
    assert grew >= 5  # the watch does report text before the end


def test_a_cancelled_run_stops_at_its_next_step():
    model = _toy(1, WatchedToy)
    cancelled = threading.Event()
    steps = []

    def on_commit(ids):
        steps.append(len(ids))
        if len(ids) >= 3:
            cancelled.set()
        return False

    model.watch = Watch("ar", EOS, on_commit, cancelled)
    with pytest.raises(Cancelled):
        sd.Autoregressive(sd.LM(model) * sd.Regex("[a-d]{10}")).run([0, 1], max_new_tokens=50, seed=0,
                                                                     progress=False)
    assert steps[-1] == 3


def _bytes_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_holds_back_partial_characters_and_stop_sequences():
    text = "héllo wörld STOP more"
    ids = list(text.encode())
    s = TextStream(_bytes_decode, ["STOP"])
    sent = ""
    for k in range(1, len(ids) + 1):
        delta = s.update(ids[:k])
        sent += delta
        assert "\ufffd" not in sent and "STOP" not in sent and text.startswith(sent)
        assert not sent.endswith(("S", "ST", "STO")) or s.stopped
    assert sent == "héllo wörld " and s.stopped
    rest, whole, stopped = s.finish(text)
    assert (rest, whole, stopped) == ("", "héllo wörld ", True)
    s = TextStream(_bytes_decode, [])
    assert s.update(list(b"ab")) == "ab"
    rest, whole, stopped = s.finish("abc")
    assert (rest, whole, stopped) == ("c", "abc", False)
    s = TextStream(_bytes_decode, [])
    s.update(list(b"ab"))
    with pytest.raises(sd.SMCDecodeError, match="internal error"):  # a final text the stream contradicts
        s.finish("xy")


def test_cut_at_stop_takes_the_first_occurrence_of_any():
    assert cut_at_stop("one two three", ["three", " t"]) == ("one", True)
    assert cut_at_stop("abc", ["x"]) == ("abc", False)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_decode_equals_the_whole_decode_on_the_default_tokenizer(seed):
    """TextStream decodes only a window before its kept text each update: on the default model's
    tokenizer (multi-byte characters split across tokens, random tokens, growth by 1–5 tokens) its
    text equals decoding every id again, at every length, also after the kept text moved."""
    import random

    model = sd.load_model()
    rng = random.Random(seed)
    ids = model.encode("Héllo wörld — ünïcödé ✓ 日本語のテキスト 🙂 " * 3) + \
        [rng.randrange(model.vocab_size) for _ in range(60)] + model.encode(" ok. \n\n done")
    if seed % 2:
        rng.shuffle(ids)
    stream, n, moved = TextStream(model.decode, []), 0, False
    while n < len(ids):
        n = min(len(ids), n + rng.randint(1, 5))
        assert stream._text(ids[:n]) == model.decode(ids[:n]), n
        moved |= stream._base > 0
    assert moved  # the kept text moved on (the window path ran)
