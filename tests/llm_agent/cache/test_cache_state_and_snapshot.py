"""The cache's user-state levels (a reply is only reused for a user at the level it was given at) and its
checkpoint snapshot (a resumed run starts from exactly the checkpoint's replies, whatever the live file gained)."""
from __future__ import annotations

import json

import pytest

from llm_agent.cache import CacheConfig, UserResponseCache
from llm_agent.cache.entries import state_level_fn
from llm_agent.scenario import Dimension, StateRange, StateSchema

SCENARIO = "test_scenario"
RANGES = StateSchema(tuple(Dimension(d, StateRange(lo, hi), d[0]) for d, (lo, hi) in
                           {"cooperation": (0, 4), "emotion": (0, 3), "trust": (0, 5)}.items()))
HOSTILE = {"cooperation": 0, "emotion": 0, "trust": 0}
WARM = {"cooperation": 4, "emotion": 3, "trust": 5}
MIDDLE = {"cooperation": 2, "emotion": 2, "trust": 2}


def _cache(tmp_path, ranges=RANGES, **overrides) -> UserResponseCache:
    cfg = {"path": str(tmp_path / "cache.jsonl"), "stage_hit_rates": {0: 1.0, 1: 1.0}, "min_bucket_size": 1,
           **overrides}
    return UserResponseCache(CacheConfig(**cfg), SCENARIO, ranges)


@pytest.mark.parametrize("state, level", [
    (HOSTILE, 0), (WARM, 2), (MIDDLE, 1),                       # (0.5 + 0.667 + 0.4) / 3 = 0.52 -> bin 1
    ({"cooperation": 1, "emotion": 1, "trust": 1}, 0),          # (0.25 + 0.333 + 0.2) / 3 = 0.26 -> bin 0
    ({"cooperation": 3, "emotion": 2, "trust": 4}, 2),          # (0.75 + 0.667 + 0.8) / 3 = 0.74 -> bin 2
    ({"cooperation": 4, "emotion": None, "trust": None}, 2),    # only the dimensions present count
    ({}, 1), (None, 1),                                         # nothing known: the middle level
])
def test_state_level_by_hand(state, level):
    assert state_level_fn(3, RANGES)(state) == level


def test_one_level_or_no_ranges_is_stage_only():
    assert {state_level_fn(1, RANGES)(s) for s in (HOSTILE, WARM)} == {0}
    assert {state_level_fn(3, None)(s) for s in (HOSTILE, WARM)} == {0}


def test_a_hostile_user_never_gets_a_cooperative_users_reply(tmp_path):
    cache = _cache(tmp_path)
    assert cache.add(0, "Sure, happy to hear more!", WARM, 0)
    assert all(cache.lookup(f"d{k}", 0, HOSTILE) is None for k in range(50))
    assert cache.add(0, "Who is this? Stop calling.", HOSTILE, 0)
    hits = {cache.lookup(f"e{k}", 0, HOSTILE).reply for k in range(50)}
    assert hits == {"Who is this? Stop calling."}
    assert {cache.lookup(f"f{k}", 0, WARM).reply for k in range(50)} == {"Sure, happy to hear more!"}


def test_stage_limit_counts_every_level_of_the_stage(tmp_path):
    cache = _cache(tmp_path, max_per_stage=4)
    for i, state in enumerate([HOSTILE, WARM, MIDDLE, HOSTILE, WARM, MIDDLE]):
        assert cache.add(0, f"reply {i}", state, 0)
    held = sorted(e.reply.reply for b in cache._buckets.values() for e in b)
    assert held == ["reply 2", "reply 3", "reply 4", "reply 5"]  # the two oldest of stage 0 went


def test_restore_snapshot_drops_replies_added_after_it_and_draws_as_uninterrupted(tmp_path):
    """The checkpoint scenario: snapshot + RNG state saved; the run goes on adding replies (appended to the live
    file) and crashes; the resumed cache must equal the checkpoint's, so its draws equal an uninterrupted run's."""
    def draws(cache, n=40):
        return [(h.reply if (h := cache.lookup(f"x{k}", k % 2, MIDDLE)) else None) for k in range(n)]

    first = _cache(tmp_path)
    for i in range(12):
        first.add(i % 2, f"reply {i}", MIDDLE, 0)
    snapshot = tmp_path / "ckpt" / "user_response_cache.jsonl"
    assert first.save_snapshot(snapshot) == 12
    rng_state = json.loads(json.dumps(first.state_dict()))
    expected = draws(first)  # what the uninterrupted run draws next
    for i in range(12, 30):  # after the checkpoint: more replies reach the live file, then a crash
        first.add(i % 2, f"late reply {i}", MIDDLE, 0)
    first.sync()
    live_lines = (tmp_path / "cache.jsonl").read_text().splitlines()
    assert len(live_lines) == 30
    resumed = _cache(tmp_path)
    assert len(resumed) == 30  # the live file alone would resume with the late replies
    resumed.load_state_dict(rng_state)
    assert resumed.restore_snapshot(snapshot) == 12
    assert draws(resumed) == expected
    assert len((tmp_path / "cache.jsonl").read_text().splitlines()) == 12  # the live file matches again
    assert len(_cache(tmp_path)) == 12


def test_restore_keeps_other_scenarios_lines_and_rejects_a_corrupt_snapshot(tmp_path):
    foreign = json.dumps({"scenario": "other", "stage": 0, "reply": "hi", "state": {}, "status": 0, "ts": 1.0})
    (tmp_path / "cache.jsonl").write_text(foreign + "\n")
    cache = _cache(tmp_path)
    cache.add(0, "mine", MIDDLE, 0)
    snap = tmp_path / "snap.jsonl"
    cache.save_snapshot(snap)
    cache.add(0, "later", MIDDLE, 0)
    cache.restore_snapshot(snap)
    lines = (tmp_path / "cache.jsonl").read_text().splitlines()
    assert lines[0] == foreign and [json.loads(x)["reply"] for x in lines[1:]] == ["mine"]
    snap.write_text(snap.read_text() + "{not json\n")
    with pytest.raises(ValueError, match="corrupt"):
        cache.restore_snapshot(snap)
    assert len(cache) == 1  # nothing lost on a refused restore
