"""API keys come from an owner-only file or the environment, and no refusal ever repeats the key."""
from __future__ import annotations

import os

import pytest

from llm_agent.api_keys import MAX_KEY_CHARS, ApiKeyError, api_key, command_line_refusal, read_key_file
from tests.helpers.for_evaluation_cli import load_script

SECRET = "sk-test-0123456789"


def _key_file(tmp_path, mode=0o600, text=f"  {SECRET}\n"):
    path = tmp_path / "key.txt"
    path.write_text(text, encoding="utf-8")
    path.chmod(mode)
    return path


def test_an_owner_only_file_gives_its_key_stripped_and_wins_over_the_environment(tmp_path):
    path = _key_file(tmp_path)
    assert read_key_file(path) == SECRET
    assert api_key("SEAD_TEST_KEY", path, environ={"SEAD_TEST_KEY": "from-env"}) == SECRET
    assert api_key("SEAD_TEST_KEY", None, environ={"SEAD_TEST_KEY": " from-env "}) == "from-env"
    assert api_key("SEAD_TEST_KEY", None, environ={"SEAD_TEST_KEY": "  "}) is None
    assert api_key("SEAD_TEST_KEY", None, environ={}) is None


def _unusable(tmp_path, case):
    """A key path of the kind `case` names."""
    if case == "group-readable":
        return _key_file(tmp_path, 0o640)
    if case == "world-readable":
        return _key_file(tmp_path, 0o604)
    if case == "empty":
        return _key_file(tmp_path, text="\n")
    if case == "huge":
        return _key_file(tmp_path, text="k" * (MAX_KEY_CHARS + 1))
    if case == "binary":
        path = tmp_path / "bin.key"
        path.write_bytes(b"\xff\xfe" + SECRET.encode())
        path.chmod(0o600)
        return path
    if case == "symlink":
        os.symlink(_key_file(tmp_path), tmp_path / "link.txt")
        return tmp_path / "link.txt"
    if case == "fifo":  # opening it must not wait for a writer
        os.mkfifo(tmp_path / "pipe", 0o600)
        return tmp_path / "pipe"
    if case == "directory":
        return tmp_path
    return tmp_path / "absent.txt"


@pytest.mark.parametrize("case, match", [
    ("group-readable", "mode 0640; other users may read it: chmod 600"),
    ("world-readable", "mode 0604"),
    ("empty", "is empty"),
    ("huge", f"more than {MAX_KEY_CHARS} characters"),
    ("binary", "not UTF-8"),
    ("symlink", "Too many levels of symbolic links"),
    ("fifo", "not a regular file"),
    ("directory", "not a regular file"),
    ("missing", "No such file"),
])
def test_an_unusable_key_file_is_refused_by_name_without_its_content(tmp_path, case, match):
    with pytest.raises(ApiKeyError, match=match) as err:
        read_key_file(_unusable(tmp_path, case), "--agent-api-key-file")
    assert str(err.value).startswith("--agent-api-key-file") and SECRET not in str(err.value)


def test_the_command_line_refusal_names_the_safe_ways_only():
    message = command_line_refusal("--sim-api-key", "SEAD_USER_SIM_API_KEY")
    assert "--sim-api-key-file PATH" in message and "SEAD_USER_SIM_API_KEY" in message and "/proc" in message


@pytest.mark.parametrize("text", [f"{SECRET}\nsecond-key", f"A={SECRET}\0B=other\0", f"{SECRET}\rx", f"a\tb"])
def test_a_key_file_of_several_lines_or_control_characters_is_refused(tmp_path, text):
    with pytest.raises(ApiKeyError, match="several lines or control characters") as err:
        read_key_file(_key_file(tmp_path, text=text), "--sim-api-key-file")
    assert SECRET not in str(err.value)


def test_a_key_given_where_its_files_path_belongs_is_never_repeated(tmp_path):
    with pytest.raises(ApiKeyError, match="cannot open the file given to --sim-api-key-file") as err:
        read_key_file(SECRET, "--sim-api-key-file")
    assert SECRET not in str(err.value)
    with pytest.raises(ApiKeyError) as err:
        read_key_file(tmp_path / SECRET, "--sim-api-key-file")
    assert SECRET not in str(err.value)


@pytest.mark.parametrize("argv", [["--sim-api-key-f", SECRET], [f"--sim-api-key-f={SECRET}"], ["--sim-api-k", SECRET],
                                  ["--agent-api-key-fi", SECRET], ["--sim-api", SECRET], ["--bogus", SECRET]])
def test_evaluate_refuses_abbreviated_key_flags_without_repeating_their_value(argv, capsys):
    evaluate = load_script("evaluate")
    with pytest.raises(SystemExit) as exc:
        evaluate.parse_args(["--agent", "scripted:good", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized option(s) " + argv[0].split("=")[0] in err and SECRET not in err


def test_evaluate_never_prints_a_key_given_as_its_files_path(tmp_path, capsys):
    evaluate = load_script("evaluate")
    with pytest.raises(SystemExit) as exc:
        evaluate.main(["--agent", "scripted:good", "--sim-api-key-file", SECRET, "--out", str(tmp_path)])
    assert "--sim-api-key-file" in str(exc.value.code) and SECRET not in str(exc.value.code)
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err


@pytest.mark.parametrize("module", ["llm_agent.user_sim.server.app", "llm_agent.user_sim.instances"])
def test_the_simulator_commands_refuse_abbreviations_without_repeating_values(module, capsys):
    import importlib

    from llm_agent.user_sim.instances import UsageError, parse_start

    if module.endswith("instances"):
        with pytest.raises(UsageError) as err:
            parse_start(["--api-key-f", SECRET], {})
        assert "unknown option(s) --api-key-f" in str(err.value) and SECRET not in str(err.value)
        return
    with pytest.raises(SystemExit):  # before: --api-key-f read the file named SECRET and printed its name
        importlib.import_module(module).parse_args(["--api-key-f", SECRET])
    err = capsys.readouterr().err
    assert "unrecognized option(s) --api-key-f" in err and SECRET not in err
