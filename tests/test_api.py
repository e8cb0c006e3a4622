"""Seeded runs are reproducible; the result object carries what the docs promise."""

import math

import pytest
import torch

import smcdecode as sd

VOCAB = ["<bos>", "a", "b", "c", "<eos>"]


def _toy(seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(len(VOCAB), len(VOCAB), generator=g)
    return sd.FunctionModel(lambda ctx: table[ctx[:, -1]], vocab=VOCAB, eos="<eos>")


@pytest.fixture
def strategies():
    target, draft = sd.LM(_toy(0), temperature=0.8), sd.Draft(_toy(1), temperature=1.2)
    return [
        sd.SMC(target, draft, particles=6, block_size=3, resampler="stratified"),
        sd.SMC(target * sd.Regex("(a|b)+c"), draft, particles=6, block_size=2, ess_threshold=1.0),
        sd.SpeculativeDecoding(target, draft, block_size=3, samples=4),
        sd.Autoregressive(target, samples=4),
    ]


def test_seeded_runs_are_reproducible_and_seeds_matter(strategies):
    for s in strategies:
        a = s.run([0], max_new_tokens=6, seed=3, progress=False)
        b = s.run([0], max_new_tokens=6, seed=3, progress=False)
        c = s.run([0], max_new_tokens=6, seed=4, progress=False)
        assert a.tokens == b.tokens and a.sample_index == b.sample_index
        assert torch.equal(a.log_weights, b.log_weights)
        others = [s.run([0], max_new_tokens=6, seed=k, progress=False).tokens for k in range(5, 9)]
        assert any(o != a.tokens for o in others + [c.tokens])


def test_result_fields(strategies, tmp_path):
    res = strategies[0].run([0], max_new_tokens=6, seed=0, progress=False)
    assert res.weights.shape == (6,) and abs(float(res.weights.sum()) - 1) < 1e-9
    assert len(res.texts) == len(res.tokens) == 6 and res.finished.all()
    assert len(res.ess) == len(res.resampled) == len(res.weight_history) == res.rounds > 0
    assert all(1 - 1e-9 <= e <= 6 + 1e-9 for e in res.ess)
    assert math.isfinite(res.log_evidence) and res.seconds > 0 and res.tokens_per_second >= 0
    assert res.text == res.texts[res.sample_index]
    assert "weight" in res.summary()
    res.plot(str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 1000
    fig = res.plot()  # rounds on whole-number ticks, one round too
    for ax in fig.axes[:2]:
        assert ax.get_xlim() == (0.5, res.rounds + 0.5)
        assert all(float(t).is_integer() for t in ax.get_xticks())
    assert all(float(t).is_integer() for t in fig.axes[1].get_yticks())  # particles
    sdres = strategies[2].run([0], max_new_tokens=6, seed=0, progress=False)
    assert math.isnan(sdres.log_evidence) and 0 <= sdres.acceptance_rate <= 1
    with pytest.raises(sd.SMCDecodeError, match="a speculative result has none"):
        sdres.plot()


def test_progress_bar_is_shown(strategies, capsys):
    strategies[0].run([0, 1, 2], max_new_tokens=6, seed=0, progress=True)
    err = capsys.readouterr().err
    assert "tok" in err and "prefill of the 3-token prompt" in err, err  # (until the first tokens come)


def test_plot_to_a_missing_directory_is_a_clear_error(strategies, tmp_path):
    result = strategies[0].run([0], max_new_tokens=6, seed=0, progress=False)
    with pytest.raises(sd.SMCDecodeError, match="directory does not exist"):
        result.plot(str(tmp_path / "no" / "such" / "dir" / "run.png"))
    with pytest.raises(sd.SMCDecodeError, match="must be a file name"):
        result.plot(3)
    result.plot(str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 0


def test_cli_json_says_how_each_particle_ended():
    """--json reports each particle's end (eos / cut / stopped) as the text summary does, not a
    'finished' flag that was true for particles cut at the budget."""
    import json

    from smcdecode import cli

    target = sd.LM(_toy(0), temperature=0.8)
    result = sd.Autoregressive(target, samples=8).run([0], max_new_tokens=2, seed=0, progress=False)
    rows = json.loads(json.dumps(cli._as_json(result)))["particles"]
    assert [r["end"] for r in rows] == result.endings
    assert "cut" in result.endings  # 8 samples of at most 2 tokens: some reach the budget
    for r, toks in zip(rows, result.tokens):
        assert r["end"] == ("eos" if toks[-1] == result.eos_token_id else "cut")
