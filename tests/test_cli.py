"""The command line: --help explains the knobs; bad input exits 2 with one line on stderr; each
strategy's summary speaks its own terms; CPU threads, the converted-model cache and the KV-cache
keyword behave as docs/cli.md says."""

import re
import warnings

import pytest
import torch

import smcdecode as sd
from smcdecode import SMCDecodeError
from smcdecode.cli import main


def test_help_lists_every_knob(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ["--prompt", "--chat", "--particles", "--block-size", "--temperature", "--draft-temperature",
                 "--resampler", "--ess-threshold", "--regex", "--max-new-tokens", "--seed", "--model", "--draft",
                 "--strategy", "--alpha", "--plot", "--backend"]:
        assert flag in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--particles", "0"], "--particles must be >= 1, got 0"),
        (["--block-size", "0"], "--block-size must be >= 1, got 0"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
        (["--temperature", "0"], "--temperature must be a finite number > 0, got 0.0"),
        (["--draft-temperature", "-1"], "--draft-temperature must be a finite number > 0"),
        (["--ess-threshold", "2"], "--ess-threshold must lie in [0, 1], got 2.0"),
        (["--regex", "a("], "invalid or unsupported regex 'a('"),
        (["--prompt", ""], "--prompt is empty"),
        (["--model", "/nonexistent/model.gguf"], "GGUF file '/nonexistent/model.gguf' does not exist"),
        (["--block-size", "0"], "--block-size adaptive"),
        (["--draft", "defualt"], "--draft 'defualt': did you mean 'default'?"),
        (["--draft", "truncate:4"], "did you mean 'truncated:L'?"),
        (["--draft", "target", "--block-size", "4"], "--block-size 4 needs a draft"),
        (["--draft", "target", "--strategy", "all"], "--strategy all runs exact speculative decoding"),
        (["--strategy", "ar", "--plot", "run.png"], "use it with --strategy smc or all, not ar"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, message, capsys):
    code = main(["generate", "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith("smcdecode: error:") and message in err


def test_unknown_choice_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--resampler", "bogus"])
    assert e.value.code == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--json-schema", "{not json"], "JSON"),
        (["--grammar", "/nonexistent.lark"], "--grammar '/nonexistent.lark': no such file"),
    ],
)
def test_bad_constraints_exit_2(argv, message, capsys):
    code = main(["generate", "--no-progress", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def _generate_help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare with single spaces


def test_help_shows_one_default_per_option(capsys):
    out = _generate_help(capsys)
    assert "(default: None)" not in out
    options = out[out.index("options:") :]
    chat = options[options.index("--chat CHAT") : options.index("--model MODEL")]
    assert chat.count("(default:") == 1 and "What is the capital of France?" in chat


def test_help_description_names_every_constraint_and_the_reward(capsys):
    out = _generate_help(capsys)
    description = out[out.index("Generate from a prompt") : out.index("options:")]
    for flag in ["--regex", "--json-schema", "--grammar", "--reward-prompt", "--draft", "--strategy", "--alpha"]:
        assert flag in description, flag


def test_threads_below_one_exits_2(capsys):
    assert main(["generate", "--no-progress", "--threads", "0"]) == 2
    assert "--threads must be >= 1, got 0" in capsys.readouterr().err


# -- CPU threads: an explicit choice is kept, otherwise half the usable CPUs ------------------------


@pytest.fixture
def threads_restored(monkeypatch):
    import smcdecode.devices as devices

    before = torch.get_num_threads()
    monkeypatch.setattr(devices, "_threads_set", None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(devices, "usable_cpus", lambda: 4)  # as on a 4-CPU machine
    yield devices
    torch.set_num_threads(before)


def test_default_threads_are_half_the_cpus_when_nobody_chose(threads_restored):
    devices = threads_restored
    torch.set_num_threads(4)  # torch's default on a 4-CPU machine
    assert devices.set_cpu_threads() == 2 == torch.get_num_threads()
    assert devices.set_cpu_threads() == 2  # a second model load keeps it


def test_explicit_thread_counts_are_kept(threads_restored, monkeypatch):
    devices = threads_restored
    torch.set_num_threads(3)  # the user called torch.set_num_threads
    assert devices.set_cpu_threads() == 3
    torch.set_num_threads(4)
    assert devices.set_cpu_threads(4) == 4  # threads=4 (--threads 4) wins, even at torch's default count
    assert devices.set_cpu_threads() == 4  # and a later load without threads keeps it
    monkeypatch.setattr(devices, "_threads_set", None)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert devices.set_cpu_threads() == 4  # OMP_NUM_THREADS is a choice too


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_threads_raise(bad, threads_restored):
    with pytest.raises(SMCDecodeError, match="threads must be a positive integer"):
        threads_restored.set_cpu_threads(bad)


# -- the converted-model cache is announced once ---------------------------------------------------


def test_cache_announcement_says_where_how_big_and_how_to_clear(tmp_path, capsys):
    from smcdecode.models import _announce_cache

    converted = tmp_path / "model-123"
    converted.mkdir()
    (converted / "model.safetensors").write_bytes(b"\0" * 3_000_000)
    (converted / "config.json").write_text("{}")
    _announce_cache(tmp_path / "model.gguf", converted)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "model.gguf" in err and str(converted) in err and "3 MB" in err
    assert "delete that folder" in err and "SMCDECODE_CACHE" in err


@pytest.mark.slow
def test_first_load_converts_once_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SMCDECODE_CACHE", str(tmp_path))
    sd.load_model("smollm2")
    first = capsys.readouterr().err
    assert first.count("smcdecode: converted SmolLM2-135M-Instruct.Q4_1.gguf") == 1 and str(tmp_path) in first
    sd.load_model("smollm2")  # from the converted copy: nothing to say
    assert "converted" not in capsys.readouterr().err


# -- the KV cache is passed the way the installed transformers names it ----------------------------


def test_cache_keyword_follows_the_forward_signature():
    from smcdecode.backends.reference import cache_keyword

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kwargs):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return input_ids

    assert cache_keyword(New()) == "cache" and cache_keyword(Old()) == "past_key_values"


def test_reference_runner_raises_no_deprecation_warning():
    from conftest import tiny_llama_pair

    target, draft = tiny_llama_pair("cpu", head_std=0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a FutureWarning or DeprecationWarning fails the test
        smc = sd.SMC(sd.LM(target), sd.Draft(draft, 1.0), particles=3, block_size=2)
        result = smc.run([0, 1], max_new_tokens=6, seed=0, progress=False)
    assert len(result.texts) == 3


# -- summaries in each strategy's own terms ---------------------------------------------------------


def _toys(no_eos: bool = False):
    from conftest import toy_model, toy_table

    vocab = ["<bos>", "a", "b", "c", "<eos>"]
    table = toy_table(7, 5, 1.0)
    if no_eos:
        table[:, -1] = -1e4  # EOS never sampled: every sequence is cut at the token budget
    return toy_model(table, vocab), toy_model(toy_table(8, 5, 1.0), vocab, name="toy-draft")


def test_autoregressive_summary_counts_samples_and_tokens():
    model, _ = _toys()
    r = sd.Autoregressive(sd.LM(model), samples=3).run([0], max_new_tokens=5, seed=0, progress=False)
    head = r.summary().splitlines()[0]
    total = sum(len(t) for t in r.tokens)
    assert head.startswith(f"strategy autoregressive: 3 samples, {total} tokens in all;")
    assert "block size" not in r.summary() and "round" not in r.summary()


def test_speculative_summary_counts_rounds_and_acceptance():
    model, draft = _toys()
    r = sd.SpeculativeDecoding(sd.LM(model), sd.Draft(draft, 1.0), block_size=2, samples=2).run(
        [0], max_new_tokens=6, seed=0, progress=False)
    lines = r.summary().splitlines()
    assert r.rounds > 0 and r.draft_tokens > 0
    assert lines[0].startswith(f"strategy speculative: 2 samples, K = 2 draft tokens a round, {r.rounds} "
                               "draft-and-verify rounds")
    assert lines[1] == (f"draft acceptance {r.accepted_tokens / r.draft_tokens:.3f} ({r.accepted_tokens} of "
                        f"{r.draft_tokens} drafted tokens accepted)")
    # each round adds 1..K+1 tokens to one sequence
    assert sum(len(t) for t in r.tokens) / (2 + 1) <= r.rounds <= sum(len(t) for t in r.tokens)


def test_smc_summary_marks_particles_cut_at_the_budget():
    model, _ = _toys(no_eos=True)
    r = sd.SMC(sd.LM(model), "target", particles=4).run([0], max_new_tokens=5, seed=0, progress=False)
    text = r.summary()
    assert text.splitlines()[0].startswith(
        f"strategy smc: 4 particles, the target as proposal (one token a round), {r.rounds} rounds "
        f"({sum(r.resampled)} resampled);")
    assert r.rounds == 5 and r.endings == ["cut"] * 4
    rows = text.splitlines()[-4:]
    assert all(" cut " in row for row in rows) and not any("yes" in row for row in rows)


def test_endings_tell_eos_from_cut_and_stopped():
    model, draft = _toys()
    r = sd.SMC(sd.LM(model), sd.Draft(draft, 1.0), particles=8, block_size=2).run(
        [0], max_new_tokens=4, seed=1, progress=False)
    for toks, end in zip(r.tokens, r.endings):
        assert end == ("eos" if toks[-1] == model.eos_token_id else "cut" if len(toks) == 4 else "stopped")
    assert set(r.endings) <= {"eos", "cut"}  # no constraint: nothing stops early


@pytest.mark.parametrize("strategy", ["smc", "speculative", "autoregressive"])
def test_progress_bar_reaches_its_end(strategy, capsys):
    model, draft = _toys()
    target = sd.LM(model)
    runner = {"smc": lambda: sd.SMC(target, sd.Draft(draft, 1.0), particles=4, block_size=2),
              "speculative": lambda: sd.SpeculativeDecoding(target, sd.Draft(draft, 1.0), block_size=2, samples=3),
              "autoregressive": lambda: sd.Autoregressive(target, samples=3)}[strategy]()
    r = runner.run([0], max_new_tokens=40, seed=0, progress=True)
    assert max(len(t) for t in r.tokens) < 40  # every sequence ended early: the case that left bars short
    shown = re.findall(r"(\d+)/(\d+) \[", capsys.readouterr().err)
    assert shown, "no progress bar drawn"
    done, total = map(int, shown[-1])
    assert done == total > 0


def test_auto_proposal_keeps_explicit_choices():
    from smcdecode.cli import choose_proposal

    assert choose_proposal("auto", "auto", "cpu", "auto")[:2] == ("target", "adaptive")
    assert choose_proposal("auto", "auto", "cuda", "auto")[:2] == ("default", "adaptive")
    draft, block, chosen = choose_proposal("auto", 4, "cpu", "auto")  # a K asks for a draft, also on a CPU
    assert (draft, block) == ("default", 4) and "--block-size 4: a K asks for a draft" in chosen
    assert choose_proposal("default", 4, "cpu", "auto") == ("default", 4, "")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"smcdecode {sd.__version__}"
