"""The warm start's key (utils.content_key): paths stand for their content, so moving or copying the checkout keeps
it, while a change to what the warm start reads (its base model, its scenario) changes it. Before, the key held the
scenario's absolute path, so a moved or copied checkout warm-started again."""
from __future__ import annotations

import shutil

from utils.content_key import content_key, main


def _checkout(root):
    (root / "models" / "tiny").mkdir(parents=True)
    (root / "models" / "tiny" / "model.safetensors").write_bytes(b"weights")
    (root / "models" / "tiny" / "config.json").write_text("{}")
    (root / "scenario.yaml").write_text("name: x\n")
    return root


def _args(root):
    return ["--model", str(root / "models" / "tiny"), "--out", str(root / "models" / "warm"), "--scenario",
            str(root / "scenario.yaml"), "--lr", "3e-3", "--system-prompt", "x" * 5000]


def test_a_moved_or_copied_checkout_keeps_the_key(tmp_path):
    first = _checkout(tmp_path / "a")
    key = content_key(_args(first), ["--out"])
    shutil.copytree(first, tmp_path / "b")
    first.rename(tmp_path / "c")
    assert content_key(_args(tmp_path / "b"), ["--out"]) == key == content_key(_args(tmp_path / "c"), ["--out"])
    assert key[3] == "<output>" and key[6:8] == ["--lr", "3e-3"] and key[-1] == "x" * 5000
    assert not any(str(tmp_path) in line for line in key)


def test_what_the_command_reads_changes_the_key(tmp_path, capsys):
    root = _checkout(tmp_path / "a")
    key = content_key(_args(root), ["--out"])
    (root / "scenario.yaml").write_text("name: y\n")
    edited = content_key(_args(root), ["--out"])
    (root / "models" / "tiny" / "model.safetensors").write_bytes(b"rebuilt")
    rebuilt = content_key(_args(root), ["--out"])
    assert len({tuple(key), tuple(edited), tuple(rebuilt)}) == 3
    assert main(["--output-flag=--out", "--", *_args(root)]) == 0
    assert capsys.readouterr().out.splitlines() == rebuilt
