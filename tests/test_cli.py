"""The command line: --help explains the knobs; bad input exits 2 with one line on stderr."""

import pytest

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
