"""Which simulator instance gets the next request: a peak-EWMA load score weighted by the share of useful replies.

Each instance keeps `LoadScore`: a latency estimate that jumps to any slower reply at once and decays towards faster
ones with time constant `decay_s` (the "peak EWMA" of Finagle's and linkerd's balancers), and decayed counts of its
replies and of the useful ones among them (a reply the caller refused as breaking the protocol, or a failed
attempt, is not useful). An instance's score is

    latency estimate x (requests in flight + 1) / share of useful replies

and the request goes to the lowest score, so a 5x slower instance gets a request only when the fast one has about
five times as many in flight, and an instance whose replies are useless (share near 0) gets traffic only when every
other instance is swamped. The useful share starts from one useful reply of prior and both counts decay, so an
instance that stopped failing earns its share back within a few `decay_s`. An instance without a latency sample
yet is scored with the fastest estimate known (or, before any, by its requests in flight alone), so new and
restarted instances are tried at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DECAY_S", "MIN_USEFUL_SHARE", "LoadScore"]

DECAY_S = 5.0  # seconds for an estimate to move 63% of the way to the recent replies
MIN_USEFUL_SHARE = 0.02  # a 100%-failing instance costs 50 times a healthy one of the same speed


@dataclass
class LoadScore:
    """One instance's latency estimate and useful-reply share (see the module docstring)."""

    decay_s: float = DECAY_S
    latency_s: float | None = None
    replies: float = 0.0
    useful: float = 0.0
    stamp: float = 0.0

    def _decay(self, now: float) -> float:
        """The weight left to the past since the last update, and move the clock to `now`."""
        weight = math.exp(-max(0.0, now - self.stamp) / self.decay_s) if self.stamp else 0.0
        self.stamp = now
        return weight

    def reply(self, latency_s: float, now: float) -> None:
        """A reply came back after `latency_s` (useful unless `refused` later)."""
        weight = self._decay(now)
        if self.latency_s is None or latency_s > self.latency_s:
            self.latency_s = latency_s
        else:
            self.latency_s = self.latency_s * weight + latency_s * (1.0 - weight)
        self.replies = self.replies * weight + 1.0
        self.useful = self.useful * weight + 1.0

    def failed(self, now: float) -> None:
        """An attempt failed (timeout, connection, HTTP error, garbage): one reply that was not useful."""
        weight = self._decay(now)
        self.replies = self.replies * weight + 1.0
        self.useful *= weight

    def refused(self, now: float) -> None:
        """The caller refused a reply this instance gave: a reply that was not useful. (`reply` counted it useful;
        when that count has decayed away, the refusal counts as a reply of its own.)"""
        weight = self._decay(now)
        useful = self.useful * weight - 1.0
        self.replies = self.replies * weight + max(0.0, -useful)
        self.useful = max(0.0, useful)

    def useful_share(self) -> float:
        """The share of useful replies, with one useful reply of prior, never below `MIN_USEFUL_SHARE`."""
        return max(MIN_USEFUL_SHARE, (self.useful + 1.0) / (self.replies + 1.0))

    def score(self, in_flight: int, fallback_latency_s: float | None) -> float:
        """The load score with `in_flight` requests outstanding; lower is better. `fallback_latency_s` stands in
        for an instance without a latency sample (None: 1 s for every such instance, so in-flight counts decide)."""
        latency = self.latency_s if self.latency_s is not None else fallback_latency_s
        return (1.0 if latency is None else latency) * (in_flight + 1) / self.useful_share()
