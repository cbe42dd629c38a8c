"""The response cache against hostile text (issue 29, items 2 and 10): lone surrogates in a reply or a file line,
a torn line beside them, deep nesting, and replies over the size limit, in memory and on disk."""
from __future__ import annotations

import json
import logging

import pytest

from llm_agent.cache import CacheConfig, UserResponseCache

SCENARIO = "test_scenario"
STATE = {"cooperation": 2, "emotion": 1, "trust": 3}


def _cache(tmp_path, **overrides) -> UserResponseCache:
    return UserResponseCache(CacheConfig(path=str(tmp_path / "cache.jsonl"), **overrides), SCENARIO)


def _line(reply: str, stage: int = 0) -> str:
    return json.dumps({"scenario": SCENARIO, "stage": stage, "reply": reply, "state": STATE, "status": 0, "ts": 1.0})


def test_a_reply_with_lone_surrogates_is_stored_clean(tmp_path):
    cache = _cache(tmp_path, min_bucket_size=1)
    assert cache.add(0, "hi \ud800 there", STATE, 0)
    assert cache.add(0, "bye \udfff", {"cooperation\udc80": 1}, 0)
    cache.save_snapshot(tmp_path / "snap.jsonl")
    cache.close()
    lines = (tmp_path / "cache.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["reply"] for line in lines] == ["hi \ufffd there", "bye \ufffd"]


def test_a_file_with_surrogate_lines_and_a_torn_line_loads_and_names_what_it_dropped(tmp_path, caplog):
    path = tmp_path / "cache.jsonl"
    good, nested = _line("good reply"), '{"a": ' * 5000 + "1" + "}" * 5000
    path.write_text("\n".join([_line("hi \ud800 there"), good, nested, _line("torn")[:30]]), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="llm_agent.cache.response_cache"):
        cache = _cache(tmp_path, min_bucket_size=1)
    assert len(cache) == 2
    assert cache.save_snapshot(tmp_path / "snap.jsonl") == 2  # the snapshot writes what it holds
    cache.close()
    replies = [json.loads(line)["reply"] for line in path.read_text(encoding="utf-8").splitlines()]
    assert replies == ["hi \ufffd there", "good reply"]
    rejected = (tmp_path / "cache.jsonl.rejected").read_bytes()
    assert rejected == (nested + "\n" + _line("torn")[:30] + "\n").encode()
    assert "line 3: " in caplog.text and "nested" in caplog.text and "line 4: " in caplog.text


def test_a_reply_over_the_size_limit_is_neither_held_nor_written(tmp_path):
    cache = _cache(tmp_path, min_bucket_size=1, max_reply_bytes=1024)
    assert not cache.add(0, "x" * 1025, STATE, 0)
    assert not cache.add(0, "\u00e9" * 513, STATE, 0)  # 1026 bytes in UTF-8
    assert cache.add(0, "y" * 1024, STATE, 0)
    cache.close()
    assert len(cache) == 1 and len((tmp_path / "cache.jsonl").read_bytes()) < 2048


def test_a_huge_line_in_the_file_is_moved_aside_without_being_held(tmp_path):
    path = tmp_path / "cache.jsonl"
    huge = _line("z" * (1 << 20))
    path.write_text(_line("small") + "\n" + huge + "\n", encoding="utf-8")
    cache = _cache(tmp_path, min_bucket_size=1, max_reply_bytes=4096)
    cache.close()
    assert len(cache) == 1
    assert (tmp_path / "cache.jsonl.rejected").read_text(encoding="utf-8") == huge + "\n"


def test_the_default_limit_refuses_a_100_mb_reply(tmp_path):
    cache = _cache(tmp_path, min_bucket_size=1)
    assert not cache.add(0, "x" * (100 << 20), STATE, 0)
    cache.close()
    assert len(cache) == 0 and not (tmp_path / "cache.jsonl").exists()


@pytest.mark.parametrize("bad", [0, -1, 1.5, float("nan")])
def test_the_size_limit_must_be_a_positive_integer(bad):
    from verl.trainer.config_schema import ConfigError

    with pytest.raises(ConfigError, match="max_reply_bytes"):
        CacheConfig(max_reply_bytes=bad)
