"""The response cache writes its file off the caller's thread: a slow disk never stalls the event loop that runs
every dialogue of an async rollout (nor its other dialogues' turns), the file still gets every line in the order
the replies were stored, and a write that failed surfaces on the next call and is repaired from memory."""
from __future__ import annotations

import asyncio
import builtins
import json
import threading
import time

import pytest

import llm_agent.cache.cache_file as cache_file
from llm_agent.cache import CacheConfig, UserResponseCache

STATE = {"cooperation": 2, "emotion": 2, "trust": 2}
SLOW_S = 0.25  # each append of the injected slow disk


def _cache(tmp_path, **overrides) -> UserResponseCache:
    return UserResponseCache(CacheConfig(path=str(tmp_path / "cache.jsonl"), default_hit_rate=1.0,
                                         min_bucket_size=1, **overrides), "s")


def _lines(tmp_path) -> list[str]:
    return [json.loads(line)["reply"] for line in (tmp_path / "cache.jsonl").read_text().splitlines()]


def test_a_slow_disk_does_not_stall_the_event_loop_and_keeps_the_order(tmp_path, monkeypatch):
    """Five dialogues store a reply each through a disk whose appends take 0.25 s: a heartbeat on the same event
    loop keeps ticking, every dialogue finishes its turns at loop speed, and after `sync` the file holds the five
    lines in the order they were stored. (In line, the appends held the loop 1.25 s.)"""
    real_open, target = builtins.open, str(tmp_path / "cache.jsonl")
    writer_threads = set()

    def slow_open(file, mode="r", *args, **kwargs):  # the disk: opening the cache file to append takes 0.25 s
        if str(file) == target and "a" in mode:
            writer_threads.add(threading.current_thread().name)
            time.sleep(SLOW_S)
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", slow_open)
    cache = _cache(tmp_path)

    async def main() -> tuple[float, list[float]]:
        gaps, done = [], []
        stop = asyncio.Event()

        async def heartbeat() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        async def dialogue(k: int) -> None:
            start = time.monotonic()
            for turn in range(3):
                if turn == 1:
                    cache.add(0, f"reply {k}", STATE, 0)  # the simulator's answer, stored on the loop
                await asyncio.sleep(0.005)  # the rest of the turn
            done.append(time.monotonic() - start)

        beat = asyncio.create_task(heartbeat())
        await asyncio.gather(*(dialogue(k) for k in range(5)))
        stop.set()
        await beat
        return max(gaps), done

    largest_gap, durations = asyncio.run(main())
    assert largest_gap < SLOW_S / 2, largest_gap
    assert max(durations) < SLOW_S / 2, durations
    assert writer_threads == {"cache-writer"}
    cache.sync()
    assert _lines(tmp_path) == [f"reply {k}" for k in range(5)]
    cache.close()


def test_compactions_and_appends_reach_the_file_in_order(tmp_path):
    """Appends queued before and after a compaction keep their order around it (one writer, first in first out)."""
    cache = _cache(tmp_path, max_per_stage=4, max_total=100)
    for i in range(40):  # evictions push the surplus past the slack: compactions between the appends
        cache.add(i % 2, f"r{i}", STATE, 0)
    cache.sync()
    on_disk = _lines(tmp_path)  # the last compaction's lines, then the appends after it, in order
    assert on_disk[-2:] == ["r38", "r39"] and on_disk == sorted(on_disk, key=lambda r: int(r[1:]))
    cache.flush()
    assert _lines(tmp_path) == [f"r{i}" for i in range(32, 40)] and len(cache) == 8
    cache.close()


def test_a_failed_write_is_raised_by_the_next_call_and_repaired_from_memory(tmp_path, monkeypatch):
    cache = _cache(tmp_path)
    cache.add(0, "kept", STATE, 0)
    cache.sync()

    def failing(path, lines):
        raise OSError("disk full")

    monkeypatch.setattr(cache_file, "append_lines", failing)
    assert cache.add(0, "lost on disk", STATE, 0)  # stored in memory; its append fails in the background
    with pytest.raises(OSError, match=r"cache file .*cache.jsonl: a background write failed: disk full"):
        cache.sync()
    monkeypatch.undo()
    cache.flush()  # the file was marked stale: rewritten from memory
    assert _lines(tmp_path) == ["kept", "lost on disk"]
    cache.close()
    assert len(_cache(tmp_path)) == 2
