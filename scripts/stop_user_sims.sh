#!/usr/bin/env bash
# Stop the user-simulator instances recorded by scripts/start_user_sims.sh, and nothing else.
#
#   scripts/stop_user_sims.sh [--run-dir DIR] [--ports P1,P2,...] [--grace SECONDS]
#
# Env: RUN_DIR (outputs/run), PORTS (default: every RUN_DIR/user_sim_*.pid), STOP_GRACE (20 s), PYTHON (as
# scripts/start_user_sims.sh).
# For each PID file ("PID START_TICKS" of port P) the process is signalled only when it is verifiably ours: alive
# with that start time (not a reused PID), owned by this user, and its command line is a simulator server with
# --port P. Then SIGTERM, a wait of up to the grace period, and SIGKILL for the instance and its own descendants
# (found through /proc, each checked by owner and start time; no process group is ever signalled). The PID file is
# removed (and RUN_DIR/user_sim_urls.txt once no PID file is left), as is the file of a process that is gone; a file
# naming a live process that cannot be verified is kept and the stop exits 1. Holds RUN_DIR/user_sims.lock like the start
# script. Never looks processes up by name. The work is done by llm_agent/user_sim/instances.py.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CALLER_DIR="$PWD"
SEAD_CALLER_DIR="$PWD"
source "$REPO_ROOT/scripts/python_env.sh"
sead_find_python  # PYTHON unset: `python` when it has the project, else the checkout's .venv
cd "$REPO_ROOT"
exec "$PYTHON" -m llm_agent.user_sim.instances stop --caller-dir "$CALLER_DIR" "$@"
