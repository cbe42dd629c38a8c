"""The cache file loses nothing (issue 12, items 9-11): unreadable lines are kept aside, deep nesting is a
named bad line, and a second writer is refused instead of silently dropping the first one's lines."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from llm_agent.cache import CacheConfig, UserResponseCache

SCENARIO = "outbound_ad_trial"
STATE = {"cooperation": 2, "emotion": 2, "trust": 2}


def _line(stage: int, reply: str, **over) -> str:
    obj = {"scenario": SCENARIO, "stage": stage, "reply": reply, "state": STATE, "status": 0, "ts": 1.0, **over}
    return json.dumps(obj)


def _cache(path: Path) -> UserResponseCache:
    return UserResponseCache(CacheConfig(path=str(path), default_hit_rate=0.5), SCENARIO)


def test_unreadable_lines_are_moved_aside_byte_for_byte(tmp_path, caplog):
    """A UTF-16 re-saved file lost all of its lines at load (compaction dropped them with no backup)."""
    path = tmp_path / "cache.jsonl"
    original = "".join(_line(0, f"reply {i}") + "\n" for i in range(6)).encode("utf-16")
    path.write_bytes(original)
    with caplog.at_level(logging.WARNING, logger="llm_agent.cache"):
        cache = _cache(path)
    assert len(cache) == 0
    rejected = Path(str(path) + ".rejected")
    assert rejected.read_bytes() in (original, original + b"\n")  # every byte still there (+ a final newline)
    assert any(str(rejected) in r.getMessage() for r in caplog.records)
    cache.close()


def test_other_schema_versions_and_corrupt_lines_survive_a_compaction(tmp_path):
    path = tmp_path / "cache.jsonl"
    future = json.dumps({"scenario": SCENARIO, "stage": 0, "reply": "v2", "state": STATE, "status": 0, "ts": 1.0,
                         "schema": 2})
    lines = [_line(0, "good"), future, "{not json", _line(1, "also good")]
    path.write_text("\n".join(lines) + "\n")
    cache = _cache(path)
    assert len(cache) == 2
    assert [json.loads(l)["reply"] for l in path.read_text().splitlines()] == ["good", "also good"]
    assert Path(str(path) + ".rejected").read_text().splitlines() == [future, "{not json"]
    cache.close()


def test_deeply_nested_line_is_a_named_bad_line_not_a_crash(tmp_path, caplog):
    path = tmp_path / "cache.jsonl"
    deep = "[" * 100_000 + "]" * 100_000
    path.write_text(_line(0, "kept") + "\n" + deep + "\n")
    with caplog.at_level(logging.WARNING, logger="llm_agent.cache"):
        cache = _cache(path)
    assert len(cache) == 1 and cache.metrics()["cache/corrupt_lines"] == 1
    message = " ".join(r.getMessage() for r in caplog.records)
    assert str(path) in message and "line 2: JSON nested" in message
    cache.close()


_WRITER = """
import sys, time
from llm_agent.cache import CacheConfig, UserResponseCache
cache = UserResponseCache(CacheConfig(path=sys.argv[1], default_hit_rate=0.5), "outbound_ad_trial")
for i in range(10):
    cache.add(0, f"from the other writer {i}", {"cooperation": 2, "emotion": 2, "trust": 2}, 0)
cache.sync()
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.processes
def test_a_second_writer_is_refused_with_a_clear_error(tmp_path):
    """Two processes on one file: the second one's compaction dropped all 10 of the first one's lines."""
    from llm_agent.cache.response_cache import CacheLockedError

    path = tmp_path / "cache.jsonl"
    other = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[3])
    try:
        assert other.stdout.readline().strip() == "ready"
        with pytest.raises(CacheLockedError, match=rf"cache file {path} is in use by another process \(PID "
                                                   rf"{other.pid}"):
            _cache(path)
    finally:
        other.kill()
        other.wait()
    cache = _cache(path)  # the lock died with its holder
    assert len(cache) == 10
    twin = _cache(path)   # caches of one process share the lock
    cache.close()
    twin.close()
