"""Validation with a second simulator set (`rollout_loop.config.judges`): the validation loop runs every batch
against the training simulator and against each judge (real scripted servers on loopback that differ by
construction, tests/helpers/judges.py), logs the judge's dialogues as split `val@<judge>`, and its
`<judge>/completion_rate` and `exploitation_gap` equal the CRs recounted from the rollout log. Bad `judges`
values are config errors naming the key."""
from __future__ import annotations

import json
import re

import pytest

from llm_agent.evaluation.headline import GapPoint, cr_points, gap_points, headline_html
from llm_agent.evaluation.run_data import read_dialogues, read_val_metrics
from llm_agent.evaluation.stats import paired_comparison
from llm_agent.generation import LLMGenerationManager
from llm_agent.rollout.config import ConfigError, GenerationConfig
from llm_agent.rollout.records import object_column
from llm_agent.stand_ins.scripted_policy import ScriptedPolicyWorkerGroup
from utils.create_prompt_data import create_prompt_data
from verl.utils.dataset import RLHFDataset

from tests.helpers.judges import base_and_deaf_servers, completion_rate, has_category
from tests.helpers.repo import SCENARIO_PATH

N_DIALOGUES = 8
STEP = 4


def config(**overrides):
    cfg = {"scenario": str(SCENARIO_PATH), "max_turns": 8, "max_tokens_per_turn": 256, "max_response_length": 3072,
           "cache": {"enabled": False}, "controller": {"enabled": False}}
    cfg.update(overrides)
    return cfg


@pytest.mark.processes
def test_exploitation_gap_is_the_cr_difference_recounted_from_the_validation_log(tok, scenario, tmp_path):
    test_file = create_prompt_data(SCENARIO_PATH, tmp_path / "data", train_samples=1, test_samples=N_DIALOGUES,
                                   seed=5)["test"]
    dataset = RLHFDataset(str(test_file), tok, max_prompt_length=4096)
    rollouts, val_metrics = tmp_path / "rollouts.jsonl", tmp_path / "val_metrics.jsonl"
    with base_and_deaf_servers(tmp_path) as urls:
        loop = LLMGenerationManager(tok, ScriptedPolicyWorkerGroup(tok, scenario, world_size=2), config(
            user_sim={"urls": urls["base"]}, judges={"deaf": [urls["deaf"]]}, rollout_log_path=str(rollouts),
            val_metrics_path=str(val_metrics)), is_validation=True)
        try:
            outs = []
            for rows in (range(0, 5), range(5, N_DIALOGUES)):  # two validation batches, as the trainer's loader
                batch = dataset.collate(list(rows))
                batch.non_tensor_batch["uid"] = object_column([f"val{i}" for i in rows])
                batch.meta_info = {"do_sample": False, "validate": True}
                outs.append(loop.run_llm_loop(batch))
            metrics = loop.on_validation_end(outs, STEP)
        finally:
            loop.close()
    logged = [json.loads(line) for line in rollouts.read_text().splitlines()]
    main = [line for line in logged if line["split"] == "val"]
    judged = [line for line in logged if line["split"] == "val@deaf"]
    assert len(main) == len(judged) == N_DIALOGUES and {line["step"] for line in logged} == {STEP}
    assert [(m["dialogue_id"], m["profile"]) for m in main] == [(j["dialogue_id"], j["profile"]) for j in judged]
    assert all(m["outcome"] == "completed" for m in main)
    assert any(map(has_category, main)), "some users must have the behaviour the deaf judge never settles"
    assert [j["outcome"] == "completed" for j in judged] == [not has_category(m) for m in main]

    cr_main, cr_judge = completion_rate(main), completion_rate(judged)
    assert metrics["dialogue/completion_rate"] == pytest.approx(cr_main)
    assert metrics["deaf/completion_rate"] == pytest.approx(cr_judge)
    assert metrics["deaf/exploitation_gap"] == pytest.approx(cr_main - cr_judge)
    assert metrics["exploitation_gap"] == pytest.approx(cr_main - cr_judge) and cr_main - cr_judge > 0
    assert metrics["deaf/user_sim/requests"] > 0
    (line,) = [json.loads(text) for text in val_metrics.read_text().splitlines()]
    assert line["judges"]["deaf"]["n_dialogues"] == N_DIALOGUES
    assert line["judges"]["deaf"]["metrics"]["completion_rate"] == pytest.approx(cr_judge)
    assert line["exploitation_gap"] == pytest.approx(cr_main - cr_judge)
    (row,) = read_val_metrics(val_metrics)  # what the report and metrics_vis read
    assert row["val/deaf/completion_rate"] == pytest.approx(cr_judge)
    assert row["val/exploitation_gap"] == pytest.approx(cr_main - cr_judge)

    # the report's headline: the gap at the last validation from the logged dialogues, with a paired interval
    def paired(a, b):
        d = paired_comparison(a, b, scenario, n_resamples=200).cr_difference
        return d.value, (d.low, d.high)

    (point,) = gap_points(read_dialogues(rollouts), [row], paired)
    assert (point.judge, point.step) == ("deaf", STEP) and point.gap == pytest.approx(cr_main - cr_judge)
    assert point.interval[0] <= point.gap <= point.interval[1]
    page = headline_html(cr_points(read_dialogues(rollouts), [row]), gaps=[point])
    assert f"vs deaf at val step {STEP}: {cr_main - cr_judge:+.3f} [" in page
    # without dialogues: the tracked gap, no interval
    assert gap_points(None, [row], paired) == [GapPoint(None, STEP, pytest.approx(cr_main - cr_judge))]


@pytest.mark.parametrize("extra, message", [
    ({"judges": [1]}, "'judges' must be an object"),
    ({"judges": {"x": {"metrics": {"completion_rate": "high"}}}}, "judge 'x' needs"),
    ({"judges": {"x": 3}}, "judge 'x' needs"),
    ({"exploitation_gap": True}, "'exploitation_gap' must be a number"),
])
def test_bad_judge_entries_in_the_validation_log_name_file_and_line(tmp_path, extra, message):
    path = tmp_path / "val_metrics.jsonl"
    path.write_text(json.dumps({"step": 1, "metrics": {"completion_rate": 0.5}}) + "\n"
                    + json.dumps({"step": 2, "metrics": {"completion_rate": 0.5}, **extra}) + "\n")
    with pytest.raises(ValueError, match=f"val_metrics.jsonl:2: {re.escape(message)}"):
        read_val_metrics(path)


@pytest.mark.parametrize("judges, message", [
    ({"a b": "http://127.0.0.1:5001"}, "judge name 'a b'"),
    ({"dialogue": "http://127.0.0.1:5001"}, "judge name 'dialogue' is taken"),
    ({"x": "ftp://127.0.0.1:5001"}, "rollout_loop.config.judges.x"),
    ({"x": 5}, "rollout_loop.config.judges.x must be"),
    ({"x": "http://127.0.0.1:5000/v1"}, "shares ['http://127.0.0.1:5000']"),
    ("http://127.0.0.1:5001", "rollout_loop.config.judges must be a mapping"),
])
def test_bad_judges_are_config_errors_naming_the_key(judges, message):
    with pytest.raises(ConfigError) as err:
        GenerationConfig.from_dict(config(user_sim={"urls": "http://127.0.0.1:5000"}, judges=judges))
    assert message in str(err.value)


def test_judges_parse_like_the_simulator_urls():
    cfg = GenerationConfig.from_dict(config(judges={"persona": "http://127.0.0.1:5001/v1/, http://127.0.0.1:5002",
                                                    "llm": ["http://127.0.0.1:5003"]}))
    assert cfg.judges == {"persona": ["http://127.0.0.1:5001", "http://127.0.0.1:5002"],
                          "llm": ["http://127.0.0.1:5003"]}
    assert GenerationConfig.from_dict(config()).judges == {}


def test_validation_plots_draw_each_judges_cr_and_the_gap():
    from llm_agent.evaluation.plots import RunData, build_figures

    rows = [{"step": float(s), "val/dialogue/completion_rate": cr, "val/deaf/completion_rate": judge,
             "val/rollout/completion_rate": cr,  # the loop's own rollout metrics: not a judge
             "val/deaf/exploitation_gap": cr - judge, "val/exploitation_gap": cr - judge}
            for s, cr, judge in [(0, 0.25, 0.25), (4, 0.5, 0.375), (8, 0.75, 0.375)]]
    figures, _ = build_figures([RunData("judged", val=rows)], smooth=0.0)
    axes = {ax.get_title(): ax for ax in figures["validation_curves"].axes}
    cr = {line.get_label(): list(line.get_ydata()) for line in axes["completion rate (CR)"].lines}
    assert cr == {"dialogue/completion_rate": [0.25, 0.5, 0.75], "deaf/completion_rate": [0.25, 0.375, 0.375]}
    gaps = {line.get_label(): list(line.get_ydata()) for line in axes["exploitation gap (docs/simulator.md)"].lines}
    assert gaps == {"deaf/exploitation_gap = exploitation_gap": [0.0, 0.125, 0.375]}  # one judge: equal, drawn once
