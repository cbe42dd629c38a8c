"""API keys come from an owner-only file or the environment, and no refusal ever repeats the key."""
from __future__ import annotations

import os

import pytest

from llm_agent.api_keys import MAX_KEY_CHARS, ApiKeyError, api_key, command_line_refusal, read_key_file

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
