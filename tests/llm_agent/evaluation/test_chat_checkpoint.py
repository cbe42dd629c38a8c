"""A checkpoint agent talks with the settings it was trained with: its prompt file's prompt, its turn limit and its
step, read from the checkpoint's training config (the model itself is replaced by the scripted agent here; the
engines are evaluate.py's and tested there)."""
from __future__ import annotations

import threading

import llm_agent.evaluation.agents as agents
from for_evaluation.chat import build_server, parse_args
from llm_agent.evaluation.human_calls import HUMAN_FILE
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from utils.create_prompt_data import create_prompt_data
from verl.utils.dataset import load_tokenizer

from tests.helpers.chat_fixtures import read_lines, request
from tests.helpers.checkpoint_fixtures import demo_config, fake_checkpoint
from tests.helpers.repo import SCENARIO_PATH

COMPACT = "You are Mia from FoodLoop; a compact prompt only this checkpoint's prompt file has."


def test_a_checkpoint_brings_its_prompt_turns_and_step(tiny_model_path, scenario, tmp_path, monkeypatch):
    prompts = create_prompt_data(SCENARIO_PATH, tmp_path / "data", train_samples=1, test_samples=2, seed=1,
                                 system_prompt=COMPACT)["test"]
    config = demo_config(max_turns=3, val_files=str(prompts))
    config["data"]["max_prompt_length"] = 512
    step_dir = fake_checkpoint(tmp_path / "ckpt", 7, config)
    seen, built = [], []
    tok = load_tokenizer(tiny_model_path)

    def fake_build(spec, scenario_, **kwargs):
        built.append(spec)
        agent = ScriptedPolicyWorkerGroup(tok, scenario_, world_size=1, quality="good")
        generate = agent.generate_sequences

        def recording(batch):
            seen.append(tok.decode(batch.batch["input_ids"][0][batch.batch["attention_mask"][0].bool()]))
            return generate(batch)

        agent.generate_sequences = recording
        return agent, tok

    monkeypatch.setattr(agents, "build_agent", fake_build)
    args = parse_args(["--agent", f"rl={tmp_path / 'ckpt'}", "--out", str(tmp_path / "out"), "--engine", "hf"])
    server, owned = build_server(args, tmp_path)
    try:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        status, call = request(server, "POST", "/api/call", {"profile": "sample"})
        state = call["card"]["state"]
        for reply in ("Yes, speaking.", "Go on.", "Hmm."):
            status, call = request(server, "POST", "/api/turn", {"reply": reply, "state": state, "end": None})
            assert status == 200, call
    finally:
        server.shutdown()
        for thing in owned:
            thing.close()
    assert built == [str(step_dir)]
    assert seen and COMPACT in seen[0]
    line = read_lines(tmp_path / "out" / HUMAN_FILE)[-1]
    assert (line["outcome"], line["num_turns"], line["step"]) == ("timeout", 3, 7)
    assert line["settings"]["max_turns"] == 3 and line["settings"]["test_file"] == str(prompts)
    assert line["agent"].startswith(str(tmp_path / "ckpt"))
