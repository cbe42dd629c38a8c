"""Stage-keyed cache of the user simulator's non-terminal replies, persisted as JSONL.

During training the rollout loop asks the cache before each user turn; with the agent's declared stage's hit
rate the cache answers with a stored simulator reply instead of calling the simulator. Unlike the original:
- only non-terminal replies (status 0) are stored, so a cached reply never ends a dialogue;
- replies are bucketed by stage AND a coarse level of the user state they were given in (`state_buckets`), so a
  hostile user is never answered with a cooperative user's words; a cached reply supplies only its words: the
  rollout loop keeps the dialogue's own user state (the stored state tags only choose the bucket);
- "no two cached turns in a row" is tracked per dialogue id (not per batch row), and the flag is cleared on
  every lookup, also when the turn has no stage;
- the file obeys the same size limits as memory: appends go to the file, and when it holds too many stale lines
  it is rewritten atomically (temp file in the same directory, fsync, ``os.replace``);
- no disk write runs in the caller's thread (in async mode, the event loop every dialogue runs on): appends and
  rewrites go, in order, to the cache's writer thread (`cache_file.CacheWriter`); `sync`, `flush`,
  `save_snapshot`, `restore_snapshot` and `close` return once the file holds everything asked before them (the
  rollout loop syncs at the end of every rollout call, so what a call stored is in the file when it returns, as
  when the appends were made in line), and a write that failed is raised by the next `add` or sync as an OSError
  naming the file.

File format, one object per line: ``{"scenario", "stage", "reply", "state", "status", "ts"}``. Lines of other
scenarios are kept verbatim; lines that cannot be read (corrupt, torn, too deeply nested, too long, another schema
version or encoding) are counted, logged once with their line numbers, and moved byte for byte to
``<path>.rejected`` before any rewrite, so nothing is lost. Every line is decoded by the project's policy for
outside input (`verl.utils.untrusted.load_json`), and every reply stored is cleaned (`clean_text`: lone surrogates
become U+FFFD), so what the cache holds can always be written back. A reply longer than `max_reply_bytes` is
neither stored nor read (a file line that long is never held in memory). One process writes a given file: it holds an exclusive lock on
``<path>.lock`` (a second process gets CacheLockedError at construction; `close()` releases it); every public
method takes the same thread lock, so the loop may call from threads.
`save_snapshot` / `restore_snapshot` copy the replies held into and out of a checkpoint, so a resumed run starts
from exactly the checkpoint's cache even when the live file gained replies after it.
"""
from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from llm_agent.cache.cache_file import (CacheFileLock, CacheLockedError, CacheWriter, Line, atomic_write, keep_rejected,
                                        read_lines)
from llm_agent.cache.config import CacheConfig, is_int
from llm_agent.cache.entries import CachedReply, Entry, check_state, parse_line, state_level_fn
from llm_agent.scenario import StateSchema
from verl.utils.untrusted import UntrustedInputError, clean_text, load_json

logger = logging.getLogger(__name__)

__all__ = ["CacheConfig", "CacheLockedError", "CachedReply", "UserResponseCache"]


def max_line_bytes(max_reply_bytes: int) -> int:
    """The longest cache-file line read: a reply of `max_reply_bytes` escaped in JSON (at most 6 bytes per byte,
    e.g. \\u0001) plus the other fields."""
    return 6 * max_reply_bytes + 4096


class UserResponseCache:
    """Per-(stage, user-state level) buckets of non-terminal simulator replies, served with the stage's hit rate.

    `schema` (the scenario's user-state schema) turns on the state levels (`config.state_buckets`); without it
    replies are bucketed by stage only. See the module docstring.
    """

    def __init__(self, config: CacheConfig, scenario_name: str, schema: StateSchema | None = None) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"UserResponseCache needs a CacheConfig, got {type(config).__name__}")
        if not isinstance(scenario_name, str) or not scenario_name:
            raise ValueError(f"UserResponseCache: scenario_name must be a non-empty string, got {scenario_name!r}")
        self.config = config
        self.scenario_name = scenario_name
        self._lock = threading.Lock()
        self._rng = random.Random(config.seed)
        self._level = state_level_fn(config.state_buckets, schema)
        self._buckets: dict[tuple[int, int], list[Entry]] = {}
        self._keys: dict[int, set[tuple]] = {}
        self._size = 0
        self._seq = 0
        self._last_hit: set[str] = set()
        self._foreign: list[str] = []
        self._disk_lines = 0
        self._slack = max(16, config.max_total // 10)
        self._corrupt = 0
        self._file_stale = False  # a background write failed: the next compaction rewrites the file from memory
        self._reset_counters()
        self._enabled = config.enabled and (config.default_hit_rate > 0 or any(config.stage_hit_rates.values()))
        self._file_lock: CacheFileLock | None = None
        self._writer: CacheWriter | None = None
        if self._enabled and config.path is not None:
            self._file_lock = CacheFileLock(config.path)
            self._writer = CacheWriter.acquire(config.path)
            self._release = weakref.finalize(self, _release, self._writer, self._file_lock)
            try:
                self._writes_done()  # another cache of this process on the file may have writes queued
                if os.path.exists(config.path):
                    self._load(config.path)
                self._writes_done()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Finish the file's queued writes and release its lock (the object keeps serving from memory; it must not
        write after this); raises a write that failed."""
        if self._file_lock is not None:
            self._release()

    @property
    def enabled(self) -> bool:
        """False when the config disables the cache or every hit rate is 0 (then it neither serves nor stores)."""
        return self._enabled

    def __len__(self) -> int:
        """Number of replies held (all stages)."""
        with self._lock:
            return self._size

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state that is not in the file: the RNG of the hit draws and reply choices."""
        with self._lock:
            version, internal, gauss = self._rng.getstate()
            return {"rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict()` (the replies themselves come from the file); ValueError on a malformed state."""
        try:
            version, internal, gauss = state["rng"]
            rng_state = (int(version), tuple(int(x) for x in internal), gauss)
            rng = random.Random()
            rng.setstate(rng_state)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"cache state must be {{'rng': [version, [ints], gauss]}}: {exc}") from None
        with self._lock:
            self._rng = rng

    def _rate(self, stage: int) -> float:
        """The configured hit rate of `stage`."""
        return self.config.stage_hit_rates.get(stage, self.config.default_hit_rate)

    def _reset_counters(self) -> None:
        """Zero the per-stage lookup/hit/eligible counters and the blocked count."""
        self._lookups: dict[int, int] = {}
        self._eligible: dict[int, int] = {}
        self._hits: dict[int, int] = {}
        self._blocked = 0

    def lookup(self, dialogue_id: str, stage: int | None, state: Mapping[str, Any] | None = None
               ) -> CachedReply | None:
        """A cached reply for this user turn of a user now in `state`, or None (then ask the simulator).

        None when the dialogue's previous lookup was a hit (the flag is cleared, whatever the stage), when the
        stage is None, negative or has rate 0, or when the (stage, level of `state`) bucket holds fewer than
        min_bucket_size replies; otherwise a uniformly chosen reply of that bucket with the stage's probability.
        Only the reply's words are meant to be reused: its `state` is the one it was given in, not the caller's.
        """
        if not self._enabled:
            return None
        with self._lock:
            if dialogue_id in self._last_hit:
                self._last_hit.discard(dialogue_id)
                self._blocked += 1
                if is_int(stage):
                    self._lookups[stage] = self._lookups.get(stage, 0) + 1
                return None
            if not is_int(stage) or stage < 0:
                return None
            self._lookups[stage] = self._lookups.get(stage, 0) + 1
            bucket = self._buckets.get((stage, self._level(state)), [])
            if len(bucket) < self.config.min_bucket_size:
                return None
            self._eligible[stage] = self._eligible.get(stage, 0) + 1
            if self._rng.random() >= self._rate(stage):
                return None
            self._hits[stage] = self._hits.get(stage, 0) + 1
            self._last_hit.add(dialogue_id)
            chosen = bucket[self._rng.randrange(len(bucket))].reply
            return CachedReply(chosen.stage, chosen.reply, dict(chosen.state), 0)

    def end_dialogue(self, dialogue_id: str) -> None:
        """Forget the dialogue's consecutive-hit flag: call when a dialogue ends, and after a user turn the cache
        was not asked for (a format-error note), which breaks the run of consecutive cached turns."""
        with self._lock:
            self._last_hit.discard(dialogue_id)

    def add(self, stage: int | None, reply: str, state: Mapping[str, int | None], status: int | None) -> bool:
        """Store a simulator reply; True when stored.

        Only a non-terminal (status 0) reply with a non-empty text of at most `max_reply_bytes` and an agent stage
        is stored (its text and state keys cleaned), once (same text and state tags in the same stage are a
        duplicate). The oldest replies of the stage, then the globally oldest, are evicted past max_per_stage /
        max_total. ValueError on mistyped arguments.
        """
        if stage is not None and (not is_int(stage) or stage < 0):
            raise ValueError(f"UserResponseCache.add: stage must be an int >= 0 or None, got {stage!r}")
        if not isinstance(reply, str):
            raise ValueError(f"UserResponseCache.add: reply must be a string, got {type(reply).__name__}")
        reason = check_state(state)
        if reason is not None:
            raise ValueError(f"UserResponseCache.add: {reason}")
        if status is not None and not is_int(status):
            raise ValueError(f"UserResponseCache.add: status must be an int or None, got {status!r}")
        if not self._enabled or stage is None or status != 0 or not reply.strip():
            return False
        if len(reply) > self.config.max_reply_bytes or len(reply.encode("utf-8", "surrogatepass")) > \
                self.config.max_reply_bytes:
            logger.warning("cache: a reply of %d characters is over max_reply_bytes=%d; not stored", len(reply),
                           self.config.max_reply_bytes)
            return False
        state = {clean_text(dim): value for dim, value in state.items()}
        entry = Entry(0, time.time(), CachedReply(stage, clean_text(reply), state, 0))
        with self._lock:
            if self._writer is not None:
                self._writes_done(wait=False)
            if entry.key() in self._keys.get(stage, ()):
                return False
            if self._writer is not None:
                self._append(entry)
            self._insert(entry)
            if self._writer is not None and self._surplus() > self._slack:
                self._compact()
            return True

    def _insert(self, entry: Entry) -> bool:
        """Put `entry` into memory with the next seq and apply the size limits; False for a duplicate."""
        stage = entry.reply.stage
        keys = self._keys.setdefault(stage, set())
        if entry.key() in keys:
            return False
        entry.seq, self._seq = self._seq, self._seq + 1
        self._buckets.setdefault((stage, self._level(entry.reply.state)), []).append(entry)
        keys.add(entry.key())
        self._size += 1
        if sum(len(b) for (s, _), b in self._buckets.items() if s == stage) > self.config.max_per_stage:
            self._evict(lambda key: key[0] == stage)
        while self._size > self.config.max_total:
            self._evict(lambda key: True)
        return True

    def _evict(self, among: Callable[[tuple[int, int]], bool]) -> None:
        """Drop the oldest entry of the buckets whose (stage, level) key satisfies `among`."""
        key = min((b[0].seq, k) for k, b in self._buckets.items() if b and among(k))[1]
        old = self._buckets[key].pop(0)
        self._keys[key[0]].discard(old.key())
        self._size -= 1

    def _line(self, entry: Entry) -> str:
        """The JSONL line of `entry` (without newline)."""
        r = entry.reply
        return json.dumps({"scenario": self.scenario_name, "stage": r.stage, "reply": r.reply, "state": r.state,
                           "status": 0, "ts": entry.ts}, ensure_ascii=False)

    def _surplus(self) -> int:
        """Lines in the file that memory no longer holds (evicted, duplicate, corrupt or blank lines); after a
        failed write, more than any slack, so the next chance to compact rewrites the file."""
        if self._file_stale:
            return self._slack + 1
        return self._disk_lines - len(self._foreign) - self._size

    def _writes_done(self, wait: bool = True) -> None:
        """Raise a background write that failed (waiting for the queued ones first when `wait`); the file is then
        marked stale, to be rewritten from memory at the next compaction."""
        try:
            self._writer.wait() if wait else self._writer.check()
        except OSError:
            self._file_stale = True
            raise

    def _append(self, entry: Entry) -> None:
        """Queue one line's append to the file (the writer thread creates its directory)."""
        self._writer.append([self._line(entry)])
        self._disk_lines += 1

    def _compact(self) -> None:
        """Queue rewriting the file as the other scenarios' lines plus the entries in memory now, oldest first,
        atomically (on an error the temp file is removed and the old file left as it was)."""
        entries = sorted((e for b in self._buckets.values() for e in b), key=lambda e: e.seq)
        self._writer.rewrite([*self._foreign, *(self._line(e) for e in entries)])
        self._disk_lines, self._file_stale = len(self._foreign) + len(entries), False
        logger.debug("compacting %s to %d lines", self.config.path, self._disk_lines)

    def save_snapshot(self, path: str | os.PathLike) -> int:
        """Write the replies held now (this scenario's, oldest first) to `path` atomically, once the live file holds
        every write before; returns their count."""
        with self._lock:
            if self._writer is not None:
                self._writes_done()
            entries = sorted((e for b in self._buckets.values() for e in b), key=lambda e: e.seq)
            atomic_write(os.fspath(path), [self._line(e) for e in entries])
            return len(entries)

    def restore_snapshot(self, path: str | os.PathLike) -> int:
        """Replace the replies held by those of a `save_snapshot` file and rewrite the live file to match (other
        scenarios' lines kept), so replies added after the snapshot are gone; returns the count restored."""
        with self._lock:
            own, _, bad, _ = self._parse(os.fspath(path))
            if bad:
                raise ValueError(f"cache snapshot {path}: {len(bad)} corrupt line(s), first: line {bad[0][0].number}: "
                                 f"{bad[0][1]}")
            self._buckets, self._keys, self._size, self._seq = {}, {}, 0, 0
            for entry in own:
                self._insert(entry)
            if self._writer is not None:
                self._compact()
                self._writes_done()
            logger.info("cache restored from %s: %d replies", path, self._size)
            return self._size

    def _parse(self, path: str) -> tuple[list[Entry], list[str], list[tuple[Line, str]], Line | None]:
        """Split a cache file into this scenario's entries, other scenarios' lines, the unreadable lines (each with
        the reason) and its last line (None for an empty file)."""
        own: list[Entry] = []
        foreign: list[str] = []
        bad: list[tuple[Line, str]] = []
        limit = max_line_bytes(self.config.max_reply_bytes)
        last = None
        for line in read_lines(path, limit):
            last = line
            if line.raw is None:
                bad.append((line, f"{line.length} bytes, over the limit of {limit} (max_reply_bytes)"))
                continue
            if not line.raw.strip():
                continue
            try:
                obj = load_json(line.raw, what="line", max_bytes=limit)
            except UntrustedInputError as exc:
                bad.append((line, str(exc).removeprefix("line: ")))
                continue
            reason = parse_line(obj)
            if reason is None and len(obj["reply"].encode("utf-8")) > self.config.max_reply_bytes:
                reason = f"reply over max_reply_bytes={self.config.max_reply_bytes}"
            if reason is not None:
                bad.append((line, reason))
            elif obj["scenario"] != self.scenario_name:
                foreign.append(line.raw.decode("utf-8").strip())
            else:
                reply = CachedReply(obj["stage"], obj["reply"], dict(obj["state"]), 0)
                own.append(Entry(0, float(obj["ts"]), reply))
        return own, foreign, bad, last

    def _load(self, path: str) -> None:
        """Read the file: own valid lines into memory (limits applied), other scenarios' lines kept verbatim,
        unreadable lines moved to ``<path>.rejected`` and logged once; compacts when the file needs cleaning."""
        own, self._foreign, bad, last = self._parse(path)
        for entry in own:
            self._insert(entry)
        self._disk_lines = 0 if last is None else last.number
        self._corrupt = len(bad)
        if bad:
            kept = keep_rejected(path, [line for line, _ in bad])
            shown = "; ".join(f"line {line.number}: {why}" for line, why in bad[:20])
            more = f" (and {len(bad) - 20} more)" if len(bad) > 20 else ""
            logger.warning("cache file %s: %d unreadable line(s) moved to %s: %s%s", path, len(bad), kept, shown,
                           more)
        logger.info("cache file %s: loaded %d replies for scenario %r (%d lines, %d of other scenarios)",
                    path, self._size, self.scenario_name, self._disk_lines, len(self._foreign))
        if bad or self._surplus() > self._slack or (last is not None and not last.complete):
            self._compact()

    def sync(self) -> None:
        """Return once the file holds every write asked for so far (appends reach the OS; rewrites are fsynced);
        raises a write that failed. Blocks: call it off the event loop."""
        if self._writer is not None:
            self._writes_done()

    def flush(self) -> None:
        """Compact the file whenever it holds more lines than memory (stale, duplicate or corrupt lines), and
        return once the file holds every write."""
        with self._lock:
            if self._writer is not None:
                if self._surplus() > 0:
                    self._compact()
                self._writes_done()

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Lookups, eligible lookups, hits, hit rate (hits / eligible; left out when nothing was eligible: it is
        undefined, not 0) and the configured target rate per stage since the last reset, plus
        cache/blocked_consecutive, cache/size and cache/corrupt_lines (found when loading); resets the counters
        when `reset`. Configured stages always appear."""
        with self._lock:
            stages = sorted(set(self.config.stage_hit_rates) | set(self._lookups))
            out: dict[str, float] = {}
            for s in stages:
                hits, eligible = self._hits.get(s, 0), self._eligible.get(s, 0)
                out[f"cache/lookups/stage{s}"] = float(self._lookups.get(s, 0))
                out[f"cache/hits/stage{s}"] = float(hits)
                out[f"cache/eligible/stage{s}"] = float(eligible)
                if eligible:
                    out[f"cache/hit_rate/stage{s}"] = hits / eligible
                out[f"cache/target_hit_rate/stage{s}"] = self.config.stage_hit_rates.get(s, self.config.default_hit_rate)
            out["cache/blocked_consecutive"] = float(self._blocked)
            out["cache/size"] = float(self._size)
            out["cache/corrupt_lines"] = float(self._corrupt)
            if reset:
                self._reset_counters()
            return out


def _release(writer: CacheWriter, lock: CacheFileLock) -> None:
    """Finish the file's queued writes, then release its lock (a cache's `close`, or its finaliser)."""
    try:
        writer.release()
    finally:
        lock.release()
