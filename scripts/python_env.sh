# The python the scripts run the project with (sourced by main.sh, engine_demo.sh and the simulator scripts).
#
# `sead_find_python [vllm]` sets and exports PYTHON and says on stderr which one it is. A PYTHON from the
# environment wins (a relative path with a slash is taken from SEAD_CALLER_DIR, the caller's directory, when the
# script changed directory). Otherwise `python` on PATH when it has the project's dependencies (an activated
# .venv, or PATH=$PWD/.venv-vllm/bin:$PATH), else the checkout's own environment: .venv/bin/python (`make
# install`), then .venv-vllm/bin/python (`make vllm-env`); `vllm` as $1 tries .venv-vllm first (the rehearsal
# needs vLLM). With none of them it exits 2 saying how to make one.

SEAD_REPO_ROOT=${SEAD_REPO_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}

# True when python $1 can import what every script needs (the project runs from the repository root).
_sead_has_project() {
    "$1" -c 'import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ("omegaconf", "hydra", "torch", "ray", "transformers")))' \
        2> /dev/null
}

sead_find_python() {
    if [[ -n "${PYTHON:-}" ]]; then
        if [[ "$PYTHON" == */* && "$PYTHON" != /* && -n "${SEAD_CALLER_DIR:-}" ]]; then
            PYTHON="$SEAD_CALLER_DIR/$PYTHON"
        fi
        export PYTHON
        return 0
    fi
    local -a envs=(.venv .venv-vllm)
    if [[ "${1:-}" == vllm ]]; then envs=(.venv-vllm .venv); fi
    local on_path candidate
    on_path=$(command -v python || true)
    if [[ -n "$on_path" ]] && _sead_has_project "$on_path"; then
        PYTHON=python
        echo "python: $on_path (from PATH)" >&2
    else
        for candidate in "${envs[@]}"; do
            if [[ -x "$SEAD_REPO_ROOT/$candidate/bin/python" ]] \
                    && _sead_has_project "$SEAD_REPO_ROOT/$candidate/bin/python"; then
                PYTHON="$SEAD_REPO_ROOT/$candidate/bin/python"
                echo "python: $PYTHON (the checkout's $candidate; \`python\` on PATH" \
                     "${on_path:+($on_path) }lacks the project's packages)" >&2
                break
            fi
        done
        if [[ -z "${PYTHON:-}" ]]; then
            echo "no python with the project's packages: \`python\` on PATH ${on_path:+($on_path) }lacks them and" \
                 "there is no $SEAD_REPO_ROOT/.venv; run \`make install\` (then \`. .venv/bin/activate\`), or set" \
                 "PYTHON=/path/to/python" >&2
            exit 2
        fi
    fi
    export PYTHON
}
