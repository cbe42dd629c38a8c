"""Check that running user simulators answer before a run depends on them.

    python -m utils.check_simulators http://127.0.0.1:5000,http://127.0.0.1:5001 [--timeout 5]
    USER_SIM_URLS=... python -m utils.check_simulators --syntax-only     # the URLs from the environment, no request

Each comma-separated base URL (what `USER_SIM_URLS` and `rollout_loop.config.user_sim.urls` hold; without the
argument, $USER_SIM_URLS) must answer `GET <url>/health` with 200 within the timeout; exit status 0 when all do,
2 naming every one that does not (by host:port). The URLs are checked first exactly as the simulator client checks
them (`llm_agent.user_sim.client.wire.parse_urls`: http(s), a host, a port in 1-65535, no whitespace, control
characters or quotes); one carrying credentials (a user name or password, a query string such as ?token=) is
refused (exit 2) without repeating them: the token belongs in $SEAD_USER_SIM_API_KEY. `--syntax-only` stops after
that check (scripts/main.sh runs it before anything else, on the environment's value, so that a URL holding a
credential never reaches a command line).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from llm_agent.user_sim.client.wire import instance_name, parse_urls
from llm_agent.user_sim.processes import health_ok

URLS_ENV = "USER_SIM_URLS"


def dead_simulators(urls: list[str], timeout_s: float) -> list[str]:
    """The URLs of `urls` whose /health does not answer 200 within `timeout_s` (probed concurrently)."""
    with ThreadPoolExecutor(max_workers=min(len(urls), 16) or 1) as pool:
        alive = list(pool.map(lambda url: health_ok(url, timeout_s), urls))
    return [url for url, ok in zip(urls, alive) if not ok]


def _urls(text: str) -> list[str]:
    """The comma-separated base URLs, checked and normalised (argparse type)."""
    try:
        return parse_urls(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _timeout(text: str) -> float:
    """A finite number of seconds above 0 (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds above 0, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: 0 when every simulator answers, else 2 and the dead URLs on stderr."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("urls", type=_urls, nargs="?", default=None,
                        help=f"comma-separated simulator base URLs (default: ${URLS_ENV})")
    parser.add_argument("--timeout", type=_timeout, default=5.0, help="seconds each /health may take")
    parser.add_argument("--syntax-only", action="store_true", help="check the URLs without sending any request")
    args = parser.parse_args(argv)
    if args.urls is None:
        try:
            args.urls = _urls(os.environ.get(URLS_ENV, ""))
        except argparse.ArgumentTypeError as exc:
            parser.error(f"${URLS_ENV}: {exc}")
    if args.syntax_only:
        print(",".join(args.urls))
        return 0
    dead = dead_simulators(args.urls, args.timeout)
    if dead:
        print(f"user simulator(s) of USER_SIM_URLS not answering GET /health within {args.timeout:g} s: "
              f"{', '.join(map(instance_name, dead))}; start them (scripts/start_user_sims.sh) or unset USER_SIM_URLS "
              f"to let this script start scripted ones", file=sys.stderr)
        return 2
    print(f"user simulators answering: {', '.join(map(instance_name, args.urls))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
