"""Property-based fuzzing of the state files a run resumes from (issue 29, items 2, 7 and 8): an evaluation's
dialogue log, the response cache's file and a checkpoint's trainer state, each written with hostile lines or
values (deep nesting, lone surrogates, NaN, torn lines, poisoned numbers). Properties: reading fails only with a
ValueError naming the file, nothing read is lost (a torn tail is kept, unreadable cache lines moved aside), what
is accepted satisfies the resume invariants, and a second read finds the same state."""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from llm_agent.cache import CacheConfig, UserResponseCache
from llm_agent.evaluation.dialogue_log import TORN_SUFFIX, drop_torn_tail, read_dialogue_log
from verl.trainer.ppo.trainer_checkpoint import check_trainer_state
from verl.utils.checkpoint import STATE_FILE, get_rng_state, load_trainer_state

from tests.helpers.hostile_json import NESTED_PROBES, dumps, hostile_text, json_values, nested_json

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SCENARIO = "fuzz_scenario"
NESTED_LINES = nested_json()
RAW_LINES = st.binary(max_size=48).map(lambda b: b.replace(b"\n", b" "))


def _file(lines: list[bytes], newline_at_end: bool) -> bytes:
    return b"\n".join(lines) + (b"\n" if newline_at_end and lines else b"")


def _utf8_json(data: bytes) -> list:
    """Every line of `data` decoded as strict UTF-8 JSON (raises otherwise)."""
    return [json.loads(line.decode("utf-8")) for line in data.splitlines() if line.strip()]


# ---- the evaluation's dialogue log -------------------------------------------------------------------------

DIALOGUE_LINES = st.one_of(
    st.fixed_dictionaries({"dialogue_id": hostile_text(6), "outcome": st.sampled_from(["completed", "error"])},
                          optional={"settings": json_values(4), "x": json_values(6)}).map(dumps),
    json_values().map(dumps), RAW_LINES, NESTED_LINES)


@FUZZ
@given(lines=st.lists(DIALOGUE_LINES, max_size=6), newline_at_end=st.booleans())
@example(lines=[b'{"dialogue_id": "a#0"}', NESTED_PROBES[1][:-10]], newline_at_end=False).via("item 8: nested torn")
@example(lines=[b'{"dialogue_id": "\\ud800#0"}'], newline_at_end=True).via("item 2: a lone surrogate")
def test_a_dialogue_log_reads_or_names_its_file_and_a_torn_tail_is_kept(lines, newline_at_end):
    data = _file(lines, newline_at_end)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agent_dialogues.jsonl"
        path.write_bytes(data)
        try:
            log = read_dialogue_log(path)
        except ValueError as err:
            assert str(err).startswith(f"{path}:"), err
            event("refused")
            return
        assert all(isinstance(r, dict) for r in log.records) and json.dumps(log.records).isascii()
        event("torn tail" if log.torn_tail else "read whole")
        drop_torn_tail(log)
        kept = Path(str(path) + TORN_SUFFIX)
        after = path.read_bytes()
        if log.torn_tail:
            assert after == data[:log.valid_bytes] and after + kept.read_bytes() == data
        else:
            assert not kept.exists() and after.rstrip(b"\n") == data.rstrip(b"\n")
        again = read_dialogue_log(path)
        assert again.records == log.records and not again.torn_tail


# ---- the response cache's file -----------------------------------------------------------------------------

CACHE_LINES = st.one_of(
    st.fixed_dictionaries({"scenario": st.sampled_from([SCENARIO, "other"]), "stage": st.one_of(st.integers(0, 3),
                           st.integers(0, 3), json_values(2)), "reply": hostile_text(), "state": st.one_of(st.just({"trust": 2}),
                           json_values(3)), "status": st.just(0), "ts": st.floats()}).map(dumps),
    RAW_LINES, NESTED_LINES)


@FUZZ
@given(lines=st.lists(CACHE_LINES, max_size=6), newline_at_end=st.booleans())
@example(lines=[(b'{"scenario": "fuzz_scenario", "stage": 0, "reply": "hi \\ud800", "state": {}, "status": 0, '
                 b'"ts": 1.0}'), b'{"scenario": "fuzz'], newline_at_end=False).via("item 2: surrogate, torn line")
def test_a_cache_file_loads_moves_bad_lines_aside_and_reloads_the_same(lines, newline_at_end):
    data = _file(lines, newline_at_end)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "cache.jsonl"
        path.write_bytes(data)
        config = CacheConfig(path=str(path), min_bucket_size=1, default_hit_rate=0.5)
        cache = UserResponseCache(config, SCENARIO)
        held = len(cache)
        cache.close()
        event(f"held {min(held, 2)}")
        rewritten = path.read_bytes()
        decoded = _utf8_json(rewritten)  # what the cache leaves in its file is strict UTF-8 JSON
        assert sum(isinstance(v, dict) and v.get("scenario") == SCENARIO for v in decoded) == held
        rejected = Path(str(path) + ".rejected")
        moved = rejected.read_bytes() if rejected.exists() else b""
        for line in (raw for raw in data.split(b"\n") if raw.strip()):  # every line is kept or moved aside ...
            foreign = line in rewritten
            assert foreign or line in moved or _is_own(line), line[:80]  # ... or held (own lines are re-encoded)
        again = UserResponseCache(config, SCENARIO)
        assert len(again) == held and (rejected.read_bytes() if rejected.exists() else b"") == moved
        again.close()


def _is_own(line: bytes) -> bool:
    try:
        value = json.loads(line)
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("scenario") == SCENARIO


# ---- a checkpoint's trainer state --------------------------------------------------------------------------

STEP = 3
POISON = st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -1e9, -5, 1e30, 0, 2, None, True, "3", [], {}]),
                   json_values(3))


def _state_with(changes: dict, removed: list[str]) -> dict:
    state = {"global_step": STEP, "dataloader": {"epoch": 1, "batch_index": 0}, "kl_ctrl_value": 0.001,
             "rng": get_rng_state()}
    for key, value in changes.items():
        if key.startswith("dataloader."):
            if isinstance(state["dataloader"], dict):
                state["dataloader"][key.removeprefix("dataloader.")] = value
        else:
            state[key] = value
    for key in removed:
        state.pop(key, None)
    return state


@FUZZ
@given(changes=st.one_of(st.just({}), st.dictionaries(st.sampled_from(
           ["global_step", "kl_ctrl_value", "dataloader", "rng", "dataloader.epoch", "dataloader.batch_index"]),
           st.one_of(POISON, st.integers(0, 5), st.floats(0, 10)), max_size=2)),
       removed=st.lists(st.sampled_from(["global_step", "dataloader", "kl_ctrl_value", "rng"]), max_size=1),
       raw=st.one_of(st.none(), st.none(), st.none(), RAW_LINES, NESTED_LINES))
@example(changes={"kl_ctrl_value": math.nan}, removed=[], raw=None).via("item 7: NaN KL coefficient")
@example(changes={"global_step": 1e30}, removed=[], raw=None).via("item 7: a huge step")
@example(changes={"dataloader.epoch": -1}, removed=[], raw=None).via("item 7: a negative epoch")
@example(changes={"dataloader": {}}, removed=[], raw=None).via("item 7: an empty dataloader state")
def test_a_trainer_state_is_resumable_or_refused_naming_its_file(changes, removed, raw):
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / f"global_step_{STEP}"
        directory.mkdir()
        file = directory / STATE_FILE
        file.write_bytes(raw if raw is not None else json.dumps(_state_with(changes, removed)).encode())
        try:
            state = load_trainer_state(directory)
            check_trainer_state(directory, state)
        except ValueError as err:
            assert str(file) in str(err), err
            event("refused")
            return
        event("accepted")
        assert state["global_step"] == STEP and not isinstance(state["global_step"], bool)
        assert math.isfinite(state["kl_ctrl_value"]) and state["kl_ctrl_value"] >= 0
        position = [state["dataloader"][k] for k in ("epoch", "batch_index")]
        assert all(type(v) is int and v >= 0 for v in position), position
