"""Benchmark: the simulator client's own CPU per request, UserSimClient (aiohttp) beside a plain httpx client.

    python -m bench.user_sim_client_cpu [--requests 2000] [--concurrency 64] [--repeats 3]
                                        [--out bench/results/user_sim_client_cpu.json]

One scripted simulator server on loopback (no injected latency) answers `--requests` first dialogue turns, at
most `--concurrency` in flight, sent by

- ours: `UserSimClient.complete` (routing, retries, health, stats; aiohttp underneath), and
- httpx: bare `httpx.AsyncClient`s in pools of 8 connections, each request on the least busy pool (the layout of
  the client when it was built on httpx: httpcore's per-request work grows with its pool), sending the same
  bodies and parsing the replies, with no routing, retries or stats: a floor for what that client cost.

Runs alternate, `--repeats` times each. The CPU is this process's (user + system; the server is another
process), so it is the driver's cost of a simulator request in the rollout loop. Printed and written: per client
the median CPU ms per request and wall time; `ours_over_httpx_cpu` is the ratio of the medians.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.results import write_result
from bench.user_sim_dispatch import latency_flags, make_requests
from llm_agent.user_sim.client import TurnReply, TurnRequest, UserSimClient
from llm_agent.user_sim.processes import SimulatorGroup

REPO = Path(__file__).resolve().parents[1]
POOL_CONNECTIONS = 8  # connections per httpx pool in the reference client


def cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_ours(url: str, requests: list[TurnRequest], concurrency: int) -> tuple[float, float, int]:
    """(CPU s, wall s, replies) of one batch through a UserSimClient (built and closed outside the timing)."""
    with UserSimClient(url, max_in_flight=concurrency, timeout_s=60) as client:
        client.complete(requests[:concurrency])  # connections open before the timing, as in a long run
        cpu0, wall0 = cpu_s(), time.perf_counter()
        results = client.complete(requests)
        cpu, wall = cpu_s() - cpu0, time.perf_counter() - wall0
    return cpu, wall, sum(isinstance(r, TurnReply) for r in results)


async def _httpx_batch(url: str, model: str, requests: list[TurnRequest], concurrency: int
                       ) -> tuple[float, float, int]:
    slots = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=POOL_CONNECTIONS, max_keepalive_connections=POOL_CONNECTIONS)
    pools = [httpx.AsyncClient(limits=limits, timeout=60) for _ in range(-(-concurrency // POOL_CONNECTIONS))]
    busy = [0] * len(pools)

    async def one(req: TurnRequest) -> bool:
        body = {"model": model, "messages": req.messages, "n": 1, "temperature": req.temperature,
                "top_p": req.top_p, "max_tokens": req.max_tokens, "seed": req.seed}
        async with slots:
            index = min(range(len(pools)), key=busy.__getitem__)
            busy[index] += 1
            try:
                response = await pools[index].post(f"{url}/v1/chat/completions", json=body)
            finally:
                busy[index] -= 1
            return response.status_code == 200 and isinstance(response.json()["choices"][0]["message"]["content"],
                                                              str)

    try:
        await asyncio.gather(*(one(r) for r in requests[:concurrency]))
        cpu0, wall0 = cpu_s(), time.perf_counter()
        answered = await asyncio.gather(*(one(r) for r in requests))
        return cpu_s() - cpu0, time.perf_counter() - wall0, sum(answered)
    finally:
        await asyncio.gather(*(pool.aclose() for pool in pools))


def run_httpx(url: str, model: str, requests: list[TurnRequest], concurrency: int) -> tuple[float, float, int]:
    """(CPU s, wall s, replies) of one batch through pools of bare httpx.AsyncClients."""
    return asyncio.run(_httpx_batch(url, model, requests, concurrency))


def main(argv: list[str] | None = None) -> dict:
    """Start the server, alternate the two clients, print the table and write the JSON results."""
    load_at_start = os.getloadavg()[0]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "bench/results/user_sim_client_cpu.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    requests = make_requests(args.requests)
    runs: dict[str, list[dict]] = {"ours": [], "httpx": []}
    with tempfile.TemporaryDirectory() as tmp:
        with SimulatorGroup(Path(tmp)) as sims:
            url = sims.start(*latency_flags(0.0, 0.0, 1))
            sims.wait_ready(url, timeout_s=90)
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            for _ in range(args.repeats):
                for name, run in (("ours", lambda: run_ours(url, requests, args.concurrency)),
                                  ("httpx", lambda: run_httpx(url, model, requests, args.concurrency))):
                    cpu, wall, answered = run()
                    runs[name].append({"cpu_ms_per_request": 1e3 * cpu / len(requests), "wall_s": wall,
                                       "answered": answered})
    medians = {name: {key: statistics.median(r[key] for r in rows) for key in ("cpu_ms_per_request", "wall_s")}
               for name, rows in runs.items()}
    complete = all(r["answered"] == len(requests) for rows in runs.values() for r in rows)
    summary = {"ours_over_httpx_cpu": medians["ours"]["cpu_ms_per_request"] / medians["httpx"]["cpu_ms_per_request"],
               "every_request_answered": complete}
    result = write_result(args, load_at_start, runs=runs, median=medians, summary=summary)
    lines = [f"{'client':>6} {'CPU ms/request':>15} {'wall s':>7}   median of {args.repeats}; {args.requests} "
             f"requests, {args.concurrency} in flight"]
    for name, row in medians.items():
        lines.append(f"{name:>6} {row['cpu_ms_per_request']:15.3f} {row['wall_s']:7.2f}")
    lines.append(f"ours_over_httpx_cpu: {summary['ours_over_httpx_cpu']:.3f}; every request answered: {complete}")
    lines.append(f"written to {args.out}")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
