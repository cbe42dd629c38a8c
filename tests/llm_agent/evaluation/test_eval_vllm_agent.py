"""Evaluation agents generating through the trainer's vLLMRollout (`--engine vllm`), in the vLLM environment.

The expected dialogues come from the other engine: the same weights generating through HFRollout (transformers
`generate`) on the HF model directory. The vLLM agent reads a trainer checkpoint saved without its HF export
(only `sharded_state/`), so the weights reach the engine the way the trainer's do (in memory, never from disk).
Needs vLLM (`make vllm-env`); skipped with that reason elsewhere.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from llm_agent.evaluation.local_agents import HFRolloutAgent, VLLMRolloutAgent
from llm_agent.evaluation.runner import EvalSettings, dialogues_path, evaluate_agent
from llm_agent.stand_ins.inprocess_user_sim import InProcessUserSim
from utils.create_prompt_data import create_prompt_data

from tests.helpers.checkpoint_fixtures import write_checkpoint
from tests.helpers.repo import COMPACT_SYSTEM_PROMPT, REPO, SCENARIO_PATH

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vLLM: run with the vLLM environment's python (make vllm-env)")]

N_DIALOGUES = 6
LOOP = dict(max_turns=4, max_tokens_per_turn=128, max_response_length=800, max_prompt_length=512)


@pytest.fixture(scope="module")
def test_file(tmp_path_factory):
    """The test split with a different agent system prompt per row, so that the greedy dialogues start from
    different contexts whatever the tiny model writes (its turns may all be format errors on another CPU)."""
    import pyarrow as pa
    import pyarrow.parquet as pq  # (pandas is not in the vLLM environment)

    out = tmp_path_factory.mktemp("prompt_data")
    path = create_prompt_data(SCENARIO_PATH, out, train_samples=1, test_samples=N_DIALOGUES, seed=5,
                              system_prompt=COMPACT_SYSTEM_PROMPT)["test"]
    table = pq.read_table(path)
    rows = table.to_pylist()
    for i, row in enumerate(rows):
        row["prompt"] = [{**m, "content": f"{m['content']} This is call {i + 1} of the day."}
                         if m["role"] == "system" else m for m in row["prompt"]]
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoint_root(warm_model_path, tmp_path_factory):
    """A trainer checkpoint root of the warm model whose step holds no HF export (sharded state only)."""
    root = tmp_path_factory.mktemp("ckpt")
    step = write_checkpoint(warm_model_path, root, step=2, hf_export=False)
    assert not list((step / "actor").glob("*.safetensors")) and (step / "actor" / "sharded_state").is_dir()
    return root


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _evaluate(name, agent, tok, scenario, test_file, out):
    settings = EvalSettings(scenario=str(SCENARIO_PATH), test_file=test_file, max_dialogues=N_DIALOGUES, **LOOP)
    try:
        return evaluate_agent(name, agent, tok, settings, out, client=InProcessUserSim(scenario), chunk_size=3,
                              n_resamples=50)
    finally:
        if hasattr(agent, "close"):
            agent.close()


@pytest.mark.numerics  # two engines' kernels must agree on every greedy argmax
def test_vllm_and_hf_agents_hold_identical_greedy_dialogues(warm_model_path, checkpoint_root, tok, scenario,
                                                             test_file, tmp_path):
    hf = HFRolloutAgent(warm_model_path)
    _evaluate("hf", hf, hf.tokenizer, scenario, test_file, tmp_path)
    vllm = VLLMRolloutAgent(checkpoint_root, max_model_len=LOOP["max_prompt_length"] + LOOP["max_response_length"])
    assert vllm.model_dir == checkpoint_root / "global_step_2" / "actor"
    _evaluate("vllm", vllm, vllm.tokenizer, scenario, test_file, tmp_path)

    want, got = lines(dialogues_path(tmp_path, "hf")), lines(dialogues_path(tmp_path, "vllm"))
    assert [r["dialogue_id"] for r in got] == [f"test{i}#0" for i in range(N_DIALOGUES)]
    # whatever the tiny model writes (turns that reach the simulator or format errors, any outcome), every
    # dialogue starts from its own context (its own system prompt), and goes on after a turn unless the user ended it
    import pyarrow.parquet as pq

    prompts = pq.read_table(test_file).to_pylist()[:N_DIALOGUES]
    assert len({json.dumps(row["prompt"]) for row in prompts}) == N_DIALOGUES
    assert all(r["num_turns"] == len(r["turns"]) >= 1 for r in want)
    for g, w in zip(got, want):
        assert [t["agent_text"] for t in g["turns"]] == [t["agent_text"] for t in w["turns"]], g["dialogue_id"]
        # everything but the dialogue's share of its call's wall time (a measurement, never equal across engines)
        assert {**g, "wall_s": None} == {**w, "wall_s": None}, g["dialogue_id"]
        assert g["wall_s"] > 0 and w["wall_s"] > 0


@pytest.mark.extended  # 41 s measured: make test-extended (CI), out of make test's 20 minutes
def test_evaluate_cli_with_the_vllm_engine_runs_a_checkpoint_and_a_model_dir_in_one_process(
        warm_model_path, checkpoint_root, test_file, tmp_path):
    out = tmp_path / "eval"
    cmd = [sys.executable, str(REPO / "for_evaluation" / "evaluate.py"), "--engine", "vllm",
           "--agent", f"ckpt={checkpoint_root}", "--agent", f"warm={warm_model_path}", "--test-file", test_file,
           "--out", str(out), "--max-dialogues", "3", "--max-turns", str(LOOP["max_turns"]),
           "--max-tokens-per-turn", str(LOOP["max_tokens_per_turn"]), "--max-response-length",
           str(LOOP["max_response_length"]), "--max-prompt-length", str(LOOP["max_prompt_length"]),
           "--chunk-size", "3", "--n-resamples", "50", "--num-sims", "1"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "ckpt at global_step 2: 3 dialogues (0 resumed, 3 run)" in proc.stdout, proc.stdout
    assert "warm: 3 dialogues (0 resumed, 3 run)" in proc.stdout, proc.stdout
    results = {name: json.loads((out / f"{name}_results.json").read_text()) for name in ("ckpt", "warm")}
    assert results["ckpt"]["step"] == results["ckpt"]["global_step"] == 2
    assert results["ckpt"]["checkpoint"] == str(checkpoint_root / "global_step_2")
    assert results["ckpt"]["agent"] == f"{checkpoint_root} (vllm)"
    assert results["warm"]["agent"] == f"{warm_model_path} (vllm)" and results["warm"]["global_step"] is None
    ckpt, warm = lines(dialogues_path(out, "ckpt")), lines(dialogues_path(out, "warm"))
    assert [r["turns"] for r in ckpt] == [r["turns"] for r in warm], "same weights, same greedy dialogues"
    assert all(r["num_turns"] == len(r["turns"]) >= 1 for r in ckpt)
