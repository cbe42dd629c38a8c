"""Tests of llm_agent.cache: hit rates, the no-two-in-a-row rule, terminal replies, persistence and limits."""
from __future__ import annotations

import json
import logging
import math
import os
import random
import threading
from pathlib import Path

import pytest

import llm_agent.cache.response_cache as cache_mod
from llm_agent.cache import CacheConfig, CachedReply, UserResponseCache

SCENARIO = "test_scenario"
STATE = {"cooperation": 2, "emotion": 1, "trust": 3}


def _cache(tmp_path: Path | None, **overrides) -> UserResponseCache:
    """A cache on tmp_path/cache.jsonl (memory-only when tmp_path is None) with config overrides."""
    path = None if tmp_path is None else str(tmp_path / "cache.jsonl")
    return UserResponseCache(CacheConfig(path=path, **overrides), SCENARIO)


def _fill(cache: UserResponseCache, stage: int, n: int, prefix: str = "r") -> None:
    """Add n distinct non-terminal replies to `stage`."""
    for i in range(n):
        assert cache.add(stage, f"{prefix}{stage}-{i}", {**STATE, "trust": i % 5}, 0)


def _file_lines(path: Path) -> list[dict]:
    """The parsed non-blank lines of a cache file."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _line(stage: int, reply: str, scenario: str = SCENARIO, **overrides) -> str:
    """One well-formed cache line; `overrides` replace fields (e.g. a mistyped stage)."""
    obj = {"scenario": scenario, "stage": stage, "reply": reply, "state": dict(STATE), "status": 0, "ts": 1.5}
    obj.update(overrides)
    return json.dumps(obj)


# ---------------------------------------------------------------- config


def test_config_defaults_and_string_stage_keys():
    cfg = CacheConfig()
    assert cfg.stage_hit_rates == {0: 0.9, 1: 0.5, 2: 0.2, 3: 0.0}
    assert (cfg.min_bucket_size, cfg.max_per_stage, cfg.max_total, cfg.default_hit_rate) == (10, 500, 10000, 0.0)
    cfg = CacheConfig.from_dict({"stage_hit_rates": {"0": 1, "2": 0.25}, "seed": 3}, where="rollout_loop.cache")
    assert cfg.stage_hit_rates == {0: 1.0, 2: 0.25} and cfg.seed == 3
    assert CacheConfig.from_dict(None) == CacheConfig()


@pytest.mark.parametrize("d, needle", [
    ({"hit_rate": 0.5}, "hit_rate is not a config key"),
    ({"stage_hit_rates": {0: 1.5}}, "stage_hit_rates[0]"),
    ({"stage_hit_rates": {"x": 0.5}}, "stage_hit_rates key 'x'"),
    ({"default_hit_rate": True}, "default_hit_rate"),
    ({"max_total": 0}, "max_total"),
    ({"min_bucket_size": 20, "max_per_stage": 5}, "min_bucket_size (20) exceeds rollout_loop.config.cache.max_per_stage (5)"),
    ({"enabled": "yes"}, "enabled"),
    ({"path": ""}, "path"),
])
def test_config_errors_name_where_and_what(d, needle):
    with pytest.raises(ValueError) as info:
        CacheConfig.from_dict(d, where="rollout_loop.config.cache")
    assert str(info.value).startswith("rollout_loop.config.cache.")
    assert needle in str(info.value)


# ---------------------------------------------------------------- serving rules


def test_measured_hit_rates_match_configured_rates_per_stage():
    rates = {0: 0.9, 1: 0.5, 2: 0.2, 3: 0.0}
    cache = _cache(None, stage_hit_rates=rates, default_hit_rate=0.0, seed=7)
    for stage in (*rates, 7):
        _fill(cache, stage, 12)
    n = 4000
    counted = {}
    for stage in (*rates, 7):
        hits = 0
        for k in range(n):
            dialogue = f"s{stage}-d{k}"
            hits += cache.lookup(dialogue, stage) is not None
            cache.end_dialogue(dialogue)
        counted[stage] = hits
    metrics = cache.metrics()
    for stage, hits in counted.items():
        p = rates.get(stage, 0.0)
        sigma = math.sqrt(n * p * (1.0 - p))
        assert abs(hits - n * p) <= 4.0 * sigma, (stage, hits)
        assert metrics[f"cache/lookups/stage{stage}"] == n
        assert metrics[f"cache/hits/stage{stage}"] == hits
        assert metrics[f"cache/eligible/stage{stage}"] == n
        assert metrics[f"cache/hit_rate/stage{stage}"] == pytest.approx(hits / n, abs=1e-12)
        assert metrics[f"cache/target_hit_rate/stage{stage}"] == p  # the configured rate, beside the observed one
    assert metrics["cache/blocked_consecutive"] == 0 and metrics["cache/size"] == 5 * 12
    after = cache.metrics()
    # nothing was eligible since the reset: the hit rate is undefined, not 0
    assert after["cache/lookups/stage0"] == 0 and "cache/hit_rate/stage0" not in after
    assert after["cache/size"] == 5 * 12


def test_small_bucket_and_missing_stage_never_serve():
    cache = _cache(None, stage_hit_rates={0: 1.0}, min_bucket_size=5)
    _fill(cache, 0, 4)
    assert all(cache.lookup(f"d{k}", 0) is None for k in range(50))
    assert cache.lookup("x", None) is None
    m = cache.metrics()
    assert m["cache/lookups/stage0"] == 50 and m["cache/eligible/stage0"] == 0 and "cache/hit_rate/stage0" not in m
    assert m["cache/target_hit_rate/stage0"] == 1.0
    _fill(cache, 0, 1, prefix="extra")
    assert cache.lookup("d0", 0) is not None


def test_never_two_hits_in_a_row_per_dialogue_interleaved():
    cache = _cache(None, stage_hit_rates={0: 1.0, 1: 0.6}, min_bucket_size=3, seed=1)
    _fill(cache, 0, 5)
    _fill(cache, 1, 5)
    rng = random.Random(0)
    dialogues = [f"uid{g}#{k}" for g in range(3) for k in range(4)]
    previous_hit = {d: False for d in dialogues}
    blocked = 0
    for _ in range(3000):
        d = rng.choice(dialogues)
        hit = cache.lookup(d, rng.choice([0, 1])) is not None
        assert not (hit and previous_hit[d]), d
        blocked += previous_hit[d]
        previous_hit[d] = hit
    assert cache.metrics()["cache/blocked_consecutive"] == blocked > 0


def test_flag_cleared_on_stageless_turn_and_by_end_dialogue():
    cache = _cache(None, stage_hit_rates={0: 1.0}, min_bucket_size=1)
    _fill(cache, 0, 2)
    assert cache.lookup("a", 0) is not None
    assert cache.lookup("a", None) is None          # blocked, and the flag is cleared here
    assert cache.lookup("a", 0) is not None
    assert cache.lookup("b", 0) is not None         # another dialogue is independent
    cache.end_dialogue("b")
    assert cache.lookup("b", 0) is not None


def test_terminal_and_empty_replies_are_never_stored(tmp_path):
    cache = _cache(tmp_path, stage_hit_rates={0: 1.0}, min_bucket_size=1)
    assert not cache.add(0, "done, thanks", STATE, 1)
    assert not cache.add(0, "bye", STATE, -1)
    assert not cache.add(0, "no status tag", STATE, None)
    assert not cache.add(0, "   ", STATE, 0)
    assert not cache.add(None, "no stage", STATE, 0)
    assert len(cache) == 0 and cache.lookup("d", 0) is None
    assert cache.add(0, "go on", STATE, 0) and not cache.add(0, "go on", STATE, 0)
    cache.sync()  # the file is written off the caller's thread: sync waits for it
    assert len(cache) == 1 and [l["status"] for l in _file_lines(tmp_path / "cache.jsonl")] == [0]
    with pytest.raises(ValueError, match="stage must be an int"):
        cache.add("1", "x", STATE, 0)
    with pytest.raises(ValueError, match="state\\['trust'\\] must be an int or null"):
        cache.add(0, "x", {"trust": "high"}, 0)


def test_state_tags_round_trip_memory_and_disk(tmp_path):
    state = {"cooperation": 0, "emotion": None, "trust": 4}
    cache = _cache(tmp_path, stage_hit_rates={2: 1.0}, min_bucket_size=1)
    assert cache.add(2, "Which card?", state, 0)
    got = cache.lookup("d", 2)
    assert got == CachedReply(2, "Which card?", state, 0)
    got.state["trust"] = 0                          # the caller's copy; the cache is unaffected
    reloaded = _cache(tmp_path, stage_hit_rates={2: 1.0}, min_bucket_size=1)
    assert reloaded.lookup("d", 2) == CachedReply(2, "Which card?", state, 0)


def test_same_seed_same_sequence():
    def run() -> list:
        cache = _cache(None, stage_hit_rates={0: 0.5}, min_bucket_size=2, seed=11)
        _fill(cache, 0, 10)
        return [(r.reply if r else None) for r in (cache.lookup(f"d{k % 7}", 0) for k in range(300))]
    assert run() == run()


# ---------------------------------------------------------------- persistence


def test_restart_reloads_same_entries_in_order(tmp_path):
    first = _cache(tmp_path, max_per_stage=30)
    for stage in (0, 1, 2):
        _fill(cache=first, stage=stage, n=25)
    second = _cache(tmp_path, max_per_stage=30)
    assert len(second) == len(first) == 75
    assert second._buckets.keys() == first._buckets.keys()
    for stage, bucket in first._buckets.items():
        assert [e.reply for e in second._buckets[stage]] == [e.reply for e in bucket]


def test_restart_with_restored_state_draws_exactly_as_an_uninterrupted_cache(tmp_path):
    def draws(cache, prefix, n=60):  # one lookup per fresh dialogue: no consecutive-hit flag involved
        return [(hit.reply if (hit := cache.lookup(f"{prefix}{k}", k % 3)) else None) for k in range(n)]

    first = _cache(tmp_path, max_per_stage=30)
    for stage in (0, 1, 2):
        _fill(cache=first, stage=stage, n=25)
    draws(first, "before")  # some history before the "checkpoint"
    state = json.loads(json.dumps(first.state_dict()))
    expected = draws(first, "after")
    restarted = _cache(tmp_path, max_per_stage=30)
    restarted.load_state_dict(state)
    assert draws(restarted, "after") == expected
    fresh = _cache(tmp_path, max_per_stage=30)
    assert draws(fresh, "after") != expected  # without the state the draws restart from the seed
    with pytest.raises(ValueError, match="cache state must be"):
        fresh.load_state_dict({"rng": "nope"})


def test_corrupt_lines_skipped_counted_and_logged_once(tmp_path, caplog):
    path = tmp_path / "cache.jsonl"
    good = [_line(0, f"good {i}") for i in range(3)]
    foreign = _line(0, "other scenario", scenario="other")
    lines = [
        good[0],
        "this is not json",
        json.dumps([1, 2, 3]),
        _line(0, "wrong stage type").replace('"stage": 0', '"stage": "0"'),
        _line(0, "terminal", status=1),
        json.dumps({"scenario": SCENARIO, "stage": 0, "reply": "no state"}),
        _line(0, "bad state", state={"trust": "high"}),
        _line(0, "bad ts", ts="yesterday"),
        good[1],
        foreign,
        "",
        good[2],
    ]
    raw = ("\n".join(lines) + "\n").encode() + b"\xff\xfe bad utf8\n" + _line(0, "truncated")[:25].encode()
    path.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="llm_agent.cache"):
        cache = _cache(tmp_path)
    assert len(cache) == 3
    assert [e.reply.reply for e in cache._buckets[(0, 0)]] == ["good 0", "good 1", "good 2"]
    assert cache.metrics()["cache/corrupt_lines"] == 9
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0]
    for number in (2, 3, 4, 5, 6, 7, 8, 13, 14):
        assert f"line {number}:" in warnings[0]
    after = path.read_text(encoding="utf-8").splitlines()    # compacted: foreign kept, bad lines gone
    assert after[0] == foreign and [json.loads(l)["reply"] for l in after[1:]] == ["good 0", "good 1", "good 2"]
    assert cache.add(0, "appended after load", STATE, 0)
    assert len(_cache(tmp_path)) == 4


def test_size_limits_hold_in_memory_and_on_disk(tmp_path):
    path = tmp_path / "cache.jsonl"
    max_per_stage, max_total = 20, 50
    slack = max(16, max_total // 10)
    cache = _cache(tmp_path, max_per_stage=max_per_stage, max_total=max_total, min_bucket_size=1)
    rng = random.Random(3)
    added = []
    for i in range(600):
        stage = rng.choice([0, 1, 2, 3])
        assert cache.add(stage, f"reply {i}", STATE, 0)
        added.append((stage, f"reply {i}"))
        sizes = {s: len(b) for s, b in cache._buckets.items()}
        assert max(sizes.values()) <= max_per_stage and len(cache) == sum(sizes.values()) <= max_total
        cache.sync()
        assert len(cache) <= len(_file_lines(path)) <= len(cache) + slack
    assert len(cache) == max_total
    cache.flush()
    on_disk = _file_lines(path)
    assert len(on_disk) == len(cache)
    per_stage = {}
    for obj in on_disk:
        per_stage[obj["stage"]] = per_stage.get(obj["stage"], 0) + 1
    assert max(per_stage.values()) <= max_per_stage
    expected = _expected_survivors(added, max_per_stage, max_total)
    assert [(o["stage"], o["reply"]) for o in on_disk] == expected


def _expected_survivors(added: list, max_per_stage: int, max_total: int) -> list:
    """Independent model of oldest-first eviction: per stage first, then globally."""
    kept: list = []
    for item in added:
        kept.append(item)
        same = [k for k in kept if k[0] == item[0]]
        if len(same) > max_per_stage:
            kept.remove(same[0])
        while len(kept) > max_total:
            kept.pop(0)
    return kept


def test_load_applies_limits_to_an_oversized_file(tmp_path):
    path = tmp_path / "cache.jsonl"
    path.write_text("".join(_line(i % 2, f"old {i}") + "\n" for i in range(100)), encoding="utf-8")
    cache = _cache(tmp_path, max_per_stage=10, max_total=15)
    cache.sync()
    assert len(cache) == 15 and len(_file_lines(path)) == 15
    assert [e.reply.reply for e in cache._buckets[(1, 0)]][-1] == "old 99"


@pytest.mark.parametrize("target", ["replace", "fsync"])
def test_compaction_is_atomic(tmp_path, monkeypatch, target):
    path = tmp_path / "cache.jsonl"
    cache = _cache(tmp_path, max_per_stage=5, max_total=100, min_bucket_size=1)
    _fill(cache, 0, 12)                              # 7 evicted: surplus below the slack, no compaction yet
    cache.sync()
    before = path.read_bytes()
    assert len(_file_lines(path)) == 12 and len(cache) == 5

    def fail(*args, **kwargs):
        raise OSError(f"injected {target} failure")
    monkeypatch.setattr(cache_mod.os, target, fail)
    with pytest.raises(OSError, match="injected"):
        cache.flush()
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["cache.jsonl", "cache.jsonl.lock"]  # no temp file left
    cache.flush()
    assert [o["reply"] for o in _file_lines(path)] == [f"r0-{i}" for i in range(7, 12)]


def test_disabled_cache_writes_nothing(tmp_path):
    for overrides in ({"enabled": False}, {"stage_hit_rates": {0: 0.0, 1: 0.0}, "default_hit_rate": 0.0}):
        cache = _cache(tmp_path, min_bucket_size=1, **overrides)
        assert not cache.enabled
        assert not cache.add(0, "hello", STATE, 0) and len(cache) == 0
        assert cache.lookup("d", 0) is None
        cache.flush()
        assert not (tmp_path / "cache.jsonl").exists()


def test_concurrent_add_and_lookup_keep_invariants(tmp_path):
    path = tmp_path / "cache.jsonl"
    cache = _cache(tmp_path, stage_hit_rates={0: 0.9, 1: 0.7}, min_bucket_size=5, max_per_stage=40,
                   max_total=60, seed=5)
    errors: list[str] = []

    def worker(t: int) -> None:
        rng = random.Random(t)
        last_hit: dict[str, bool] = {}
        for i in range(400):
            stage = rng.choice([0, 1])
            cache.add(stage, f"t{t}-{i}", STATE, rng.choice([0, 0, 1]))
            d = f"t{t}-d{rng.randrange(3)}"
            got = cache.lookup(d, stage)
            if got is not None and (last_hit.get(d) or got.status != 0 or got.stage != stage):
                errors.append(f"{d}: bad hit {got}")
            last_hit[d] = got is not None
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert len(cache) == 60 and all(len(b) <= 40 for b in cache._buckets.values())
    cache.flush()
    cache.sync()
    lines = _file_lines(path)
    assert len(lines) == 60 and all(o["status"] == 0 for o in lines)
    reloaded = _cache(tmp_path, max_per_stage=40, max_total=60)
    assert sorted(o["reply"] for o in lines) == sorted(e.reply.reply for b in reloaded._buckets.values() for e in b)
