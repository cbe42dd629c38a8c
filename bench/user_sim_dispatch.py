"""Benchmark: dispatch of one turn batch over N user-simulator instances, ours vs the original SEAD client.

    python -m bench.user_sim_dispatch [--requests 480] [--median-ms 50] [--sigma 0.6] [--slow-factor 5]
                                      [--capacity 8] [--repeats 3] [--out bench/results/user_sim_dispatch.json]

Starts scripted simulator servers (`python -m llm_agent.user_sim.server`) with injected lognormal latency and
sends `--requests` dialogue turns (one chat completion each) in four set-ups: one instance; two equal
instances; two instances of which one is `--slow-factor` times slower; two instances of which one is dead
(nothing listens on its port). Each set-up is timed for

- ours: `UserSimClient` (least-in-flight routing over all instances), and
- original: SEAD's multi-URL dispatch re-implemented here: the batch is cut into `ceil(B / n)` contiguous
  chunks, one thread per chunk, each chunk sent to its own instance, the turn ending when the last chunk ends.

A server's capacity is modelled as `--capacity` requests in flight per instance (vLLM's max_num_seqs): the
original sends each chunk with at most `capacity` concurrent requests, ours caps the whole client at
`capacity * n` (at `capacity` in the dead set-up, where one instance is left). Ours uses a fresh client per run
(so detecting a dead instance is inside the timed run). Runs of ours and the original alternate, `--repeats`
times; the median wall time and the number of turns answered are reported.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import statistics
import threading
import time
from pathlib import Path

import httpx

from bench.results import write_result
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.user_sim.client import TurnReply, TurnRequest, UserSimClient
from llm_agent.user_sim.processes import SimulatorGroup, free_port

logger = logging.getLogger("bench.user_sim_dispatch")

REPO = Path(__file__).resolve().parents[1]
SCENARIO = DEFAULT_SCENARIO_PATH


def latency_flags(median_ms: float, sigma: float, seed: int) -> tuple[str, ...]:
    """Server flags of a scripted simulator with injected lognormal latency and its own seed."""
    return ("--seed", str(seed), "--inject-latency-ms", str(median_ms), "--inject-latency-sigma", str(sigma))


def make_requests(n: int) -> list[TurnRequest]:
    """`n` first dialogue turns with the scenario's personas (what the rollout loop sends)."""
    scenario = load_scenario(SCENARIO)
    states = scenario.state_space()
    return [
        TurnRequest(dialogue_id=f"d{i}",
                    messages=[{"role": "system",
                               "content": scenario.render_user_prompt(scenario.profile(states[i % len(states)]))},
                              {"role": "user", "content": f"Hello, this is Anna from the delivery app, call {i}."}],
                    seed=i, max_tokens=128)
        for i in range(n)
    ]


async def _send_chunk(url: str, model: str, chunk: list[TurnRequest], capacity: int, timeout_s: float,
                      out: list, offset: int) -> None:
    """Send one contiguous chunk to one instance, at most `capacity` at a time; failures stay None."""
    slots = asyncio.Semaphore(capacity)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=capacity), timeout=timeout_s) as http:
        async def one(i: int, req: TurnRequest) -> None:
            body = {"model": model, "messages": req.messages, "n": 1, "temperature": req.temperature,
                    "top_p": req.top_p, "max_tokens": req.max_tokens, "seed": req.seed}
            async with slots:
                try:
                    response = await http.post(f"{url}/v1/chat/completions", json=body)
                    if response.status_code == 200:
                        out[offset + i] = response.json()["choices"][0]["message"]["content"]
                except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                    logger.debug("original dispatch: %s failed: %r", url, exc)

        await asyncio.gather(*(one(i, req) for i, req in enumerate(chunk)))


def original_dispatch(urls: list[str], model: str, requests: list[TurnRequest], capacity: int,
                      timeout_s: float = 60.0) -> list[str | None]:
    """SEAD's multi-URL client: ceil(B/n) contiguous chunks, one thread per chunk and instance, merged in order."""
    size = math.ceil(len(requests) / len(urls))
    out: list[str | None] = [None] * len(requests)
    threads = [
        threading.Thread(target=asyncio.run, args=(_send_chunk(url, model, requests[k * size:(k + 1) * size],
                                                               capacity, timeout_s, out, k * size),))
        for k, url in enumerate(urls)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def time_ours(urls: list[str], model: str, requests: list[TurnRequest], max_in_flight: int) -> tuple[float, dict]:
    """Wall time of one batch through a fresh UserSimClient, and how many replies each instance served."""
    start = time.perf_counter()
    with UserSimClient(urls, model=model, max_in_flight=max_in_flight, timeout_s=60, backoff_s=0.05) as client:
        results = client.complete(requests)
    wall = time.perf_counter() - start
    split: dict[str, int] = {}
    for r in results:
        if isinstance(r, TurnReply):
            split[r.instance] = split.get(r.instance, 0) + 1
    return wall, split


def time_original(urls: list[str], model: str, requests: list[TurnRequest], capacity: int) -> tuple[float, int]:
    """Wall time of one batch through the original chunked dispatch, and how many turns it answered."""
    start = time.perf_counter()
    results = original_dispatch(urls, model, requests, capacity)
    wall = time.perf_counter() - start
    return wall, sum(r is not None for r in results)


def run_setup(label: str, urls: list[str], requests: list[TurnRequest], capacity: int, repeats: int,
              baseline: bool, max_in_flight: int | None = None) -> dict:
    """Alternate ours and (optionally) the original `repeats` times on one set of instances.

    Ours gets a fresh client per run (so a dead instance is discovered inside the timed run) capped at
    `max_in_flight`, by default `capacity` per instance.
    """
    model = httpx.get(f"{urls[0]}/v1/models").json()["data"][0]["id"]
    max_in_flight = max_in_flight or capacity * len(urls)
    time_ours(urls, model, requests[:max_in_flight], max_in_flight)  # warm-up (imports, server caches)
    ours, original, splits, answered = [], [], [], []
    for _ in range(repeats):
        wall, split = time_ours(urls, model, requests, max_in_flight)
        ours.append(wall)
        splits.append(split)
        if baseline:
            wall, count = time_original(urls, model, requests, capacity)
            original.append(wall)
            answered.append(count)
    row = {"setup": label, "instances": len(urls), "ours_max_in_flight": max_in_flight, "ours_s": ours,
           "ours_median_s": statistics.median(ours), "ours_min_s": min(ours), "ours_split": splits[-1],
           "ours_answered": min(sum(split.values()) for split in splits)}
    if baseline:
        row.update(original_s=original, original_median_s=statistics.median(original), original_min_s=min(original),
                   original_answered=min(answered))
        row["ours_over_original"] = row["ours_median_s"] / row["original_median_s"]
    logger.info("%s: %s", label, row)
    return row


def main(argv: list[str] | None = None) -> dict:
    """Start the servers, time every set-up, print a table and write the JSON results."""
    load_at_start = os.getloadavg()[0]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=480)
    p.add_argument("--median-ms", type=float, default=50.0)
    p.add_argument("--sigma", type=float, default=0.6, help="log-space sigma of the latency (heavy right tail)")
    p.add_argument("--slow-factor", type=float, default=5.0)
    p.add_argument("--capacity", type=int, default=8, help="requests in flight per instance")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/user_sim_dispatch.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log_dir = args.out.parent / "user_sim_dispatch_logs"
    log_dir.mkdir(exist_ok=True)

    with SimulatorGroup(log_dir) as sims:
        url = {"fast1": sims.start(*latency_flags(args.median_ms, args.sigma, 1)),
               "fast2": sims.start(*latency_flags(args.median_ms, args.sigma, 2)),
               "slow": sims.start(*latency_flags(args.median_ms * args.slow_factor, args.sigma, 3))}
        sims.wait_ready(*url.values(), timeout_s=90)
        requests = make_requests(args.requests)
        rows = [
            run_setup("1 instance", [url["fast1"]], requests, args.capacity, args.repeats, baseline=False),
            run_setup("2 equal instances", [url["fast1"], url["fast2"]], requests, args.capacity, args.repeats,
                      baseline=True),
            run_setup(f"2 instances, one {args.slow_factor:g}x slower", [url["fast1"], url["slow"]], requests,
                      args.capacity, args.repeats, baseline=True),
            run_setup("2 instances, one dead", [url["fast1"], f"http://127.0.0.1:{free_port()}"], requests,
                      args.capacity, args.repeats, baseline=True, max_in_flight=args.capacity),
        ]

    one = rows[0]["ours_median_s"]
    summary = {
        "two_over_one_instance_ours": rows[1]["ours_median_s"] / one,
        "two_over_one_instance_original": rows[1]["original_median_s"] / one,
        "slow_pair_ours_over_original": rows[2]["ours_over_original"],
        "equal_pair_ours_over_original": rows[1]["ours_over_original"],
        "dead_pair_answered_ours": rows[3]["ours_answered"] / args.requests,
        "dead_pair_answered_original": rows[3]["original_answered"] / args.requests,
    }
    result = write_result(args, load_at_start, rows=rows, summary=summary)

    n = args.requests
    lines = [f"{'set-up':<30} {'ours (s)':>9} {'original (s)':>13} {'ours/orig':>10} {'answered':>13}  ours split"]
    for row in rows:
        orig = f"{row['original_median_s']:13.3f}" if "original_median_s" in row else f"{'-':>13}"
        ratio = f"{row['ours_over_original']:10.2f}" if "ours_over_original" in row else f"{'-':>10}"
        answered = f"{row['ours_answered']}/{row.get('original_answered', '-')}"
        split = ", ".join(f"port {k.rsplit(':', 1)[-1]}={v}" for k, v in row["ours_split"].items())
        lines.append(f"{row['setup']:<30} {row['ours_median_s']:9.3f} {orig} {ratio} {answered:>13}  {split}")
    lines.append(f"answered = turns answered (of {n}) by ours/original, worst run")
    lines += [f"{k}: {v:.2f}" for k, v in summary.items()] + [f"written to {args.out}"]
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
