"""Benchmark: how long a person waits for the agent's turn on the talk-to-the-agent page (`for_evaluation.chat`).

    python -m bench.chat_turns --agent rl=outputs/checkpoints/cpu_demo_outbound_ad_trial [--calls 8] \\
        [--out bench/results/chat_turns.json]

Starts the page's real server on loopback for `--agent` (any `for_evaluation.chat` spec) and plays `--calls`
calls through its HTTP API, the person's part played by the scripted persona's preview shown beside each agent
turn (its words, state and status: agreed / hung up ends the call). Times each agent turn as the person sees
it: from the request (starting the call, or sending a turn) to the answer carrying the agent's next turn. Prints
p50 / p95 / max per kind of turn and writes them with the machine to `--out`.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.results import write_result
from llm_agent.evaluation.human_calls import END_CHOICES

END_BY_STATUS = {role: end for end, role in END_CHOICES.items() if end}  # a status role -> the page's end


def _post(url: str, token: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(f"{url}{path}?token={token}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def _end_choice(status: int, statuses: Any) -> str | None:
    for role, end in END_BY_STATUS.items():
        if status == getattr(statuses, role):
            return end
    return None


def play_call(url: str, token: str, statuses: Any) -> dict[str, Any]:
    """One call played by the scripted persona's previews: the opening and reply latencies, the outcome."""
    start = time.perf_counter()
    call = _post(url, token, "/api/call", {"profile": "sample"})
    opening, replies = time.perf_counter() - start, []
    while call["phase"] == "user":
        scripted = call["pending"]["scripted"]
        body = {"reply": scripted["reply"], "state": scripted["state"],
                "end": _end_choice(scripted["status"], statuses)}
        start = time.perf_counter()
        call = _post(url, token, "/api/turn", body)
        if call["phase"] in ("user", "done") and body["end"] is None:
            replies.append(time.perf_counter() - start)
    return {"opening_s": opening, "reply_s": replies, "phase": call["phase"],
            "outcome": (call.get("result") or {}).get("outcome"), "error": call.get("error")}


def _summary(values: list[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    if not ordered:
        return {"n": 0}
    return {"n": len(ordered), "p50": statistics.median(ordered),
            "p95": ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))], "max": ordered[-1]}


def main(argv: list[str] | None = None) -> None:
    from for_evaluation.chat import build_server, parse_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agent", required=True)
    p.add_argument("--tokenizer", default=None, help="for an endpoint or scripted agent (as for_evaluation.chat)")
    p.add_argument("--calls", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("bench/results/chat_turns.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-chat-") as work:
        chat_args = parse_args(["--agent", args.agent, "--out", str(Path(work) / "calls"), "--no-stream",
                                "--log-level", "WARNING", *(["--tokenizer", args.tokenizer] if args.tokenizer else [])])
        server, owned = build_server(chat_args, Path(work))
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            url, token = server.url.split("/?token=")
            calls = [play_call(url, token, server.scenario.statuses) for _ in range(args.calls)]
        finally:
            server.shutdown()
            for thing in owned:
                thing.close()
    openings = _summary([c["opening_s"] for c in calls])
    replies = _summary([s for c in calls for s in c["reply_s"]])
    outcomes = {o: sum(c["outcome"] == o for c in calls) for o in {c["outcome"] for c in calls}}
    print(f"{'agent turn':<14} {'n':>4} {'p50 s':>7} {'p95 s':>7} {'max s':>7}")
    for name, row in (("opening", openings), ("after a reply", replies)):
        if row["n"]:
            print(f"{name:<14} {row['n']:>4} {row['p50']:>7.2f} {row['p95']:>7.2f} {row['max']:>7.2f}")
    print(f"calls: {len(calls)}, outcomes {outcomes}, errors {sum(bool(c['error']) for c in calls)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_result(args, load_at_start, opening=openings, after_reply=replies, outcomes=outcomes, calls=calls)


if __name__ == "__main__":
    main()
