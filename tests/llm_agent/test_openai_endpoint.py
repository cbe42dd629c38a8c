"""Hostile answers from OpenAI-compatible endpoints (the profile LLM, a hosted agent): every request ends within
its deadline, a flood is refused without being buffered, deep nesting and lone surrogates never crash a caller."""
from __future__ import annotations

import json

import pytest
import torch

from llm_agent.evaluation.agents import OpenAIChatAgent
from llm_agent.openai_endpoint import EndpointError, OpenAIEndpoint
from llm_agent.profiles.rules import load_rule_table
from llm_agent.profiles.sources import ChatEndpoint
from llm_agent.profiles.writer import REJECTED_ANSWER_CHARS, ProfileWriter, WriterSettings
from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from verl.protocol import DataProto
from verl.utils.dataset import load_tokenizer
from tests.helpers.hostile_openai import HostileOpenAIServer, timed

MESSAGES = [{"role": "user", "content": "hi"}]
SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
RULES = load_rule_table()


@pytest.mark.parametrize("mode, kind, limit_s", [("trickle", "timeout", 2.5), ("stall", "timeout", 3.5),
                                                 ("flood", "too_large", 5.0), ("nested", "garbage", 5.0),
                                                 ("nested_503", "http", 5.0)])
def test_hostile_answer_fails_one_request_cleanly_and_in_time(mode, kind, limit_s):
    with HostileOpenAIServer(mode) as server:
        endpoint = ChatEndpoint(server.url, "m", timeout_s=1.5)
        error, seconds = timed(endpoint.complete, MESSAGES, seed=1)
        endpoint.close()
    assert isinstance(error, EndpointError), error
    assert error.kind == kind, error
    assert seconds < limit_s


def test_lone_surrogates_in_an_answer_are_replaced():
    with HostileOpenAIServer("surrogate") as server:
        endpoint = OpenAIEndpoint(server.url, timeout_s=5)
        text, finish = endpoint.chat({"model": "m", "messages": MESSAGES})
        assert endpoint.served_models() == ["m"]
        endpoint.close()
    assert text == "hello \ufffd there" and finish == "stop"
    text.encode("utf-8")


def test_the_api_key_never_appears_in_an_error():
    with HostileOpenAIServer("nested_503") as server:
        endpoint = OpenAIEndpoint(server.url, api_key="sk-secret-123", timeout_s=5)
        error, _ = timed(endpoint.chat, {"model": "m", "messages": MESSAGES})
        endpoint.close()
    assert isinstance(error, EndpointError) and "sk-secret-123" not in str(error)


@pytest.mark.parametrize("mode", ["trickle", "nested", "flood"])
def test_the_profile_writer_finishes_every_row_against_a_hostile_llm(tmp_path, mode):
    out = tmp_path / "p.jsonl"
    with HostileOpenAIServer(mode) as server:
        endpoint = ChatEndpoint(server.url, "m", timeout_s=1.0)
        writer = ProfileWriter(SCENARIO, out, WriterSettings(n=6, concurrency=3, max_attempts=1, breaker=3), RULES,
                               endpoint=endpoint)
        (stats, seconds) = timed(writer.run)
        endpoint.close()
    assert not isinstance(stats, Exception), stats
    assert [json.loads(line)["index"] for line in out.read_text().splitlines()] == list(range(6))
    assert seconds < 15
    assert out.with_name(out.name + ".rejected.jsonl").stat().st_size < 10_000


def test_a_huge_answer_is_kept_truncated_in_the_rejected_file(tmp_path):
    out = tmp_path / "p.jsonl"
    with HostileOpenAIServer("ok", content="no profile here " * 200_000) as server:  # 3.2 MB of text
        endpoint = ChatEndpoint(server.url, "m", timeout_s=10.0)
        ProfileWriter(SCENARIO, out, WriterSettings(n=2, concurrency=2, max_attempts=2), RULES,
                      endpoint=endpoint).run()
        endpoint.close()
    rejected = [json.loads(line) for line in out.with_name(out.name + ".rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == 4
    for item in rejected:
        assert len(item["answer"]) == REJECTED_ANSWER_CHARS and item["answer_chars"] == 3_200_000


def test_an_evaluated_endpoint_agent_gives_up_in_bounded_time(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([prompt])
    batch = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                         "position_ids": torch.arange(ids.size(1))[None]},
                                meta_info={"response_length": 8, "eos_token_id": tokenizer.eos_token_id,
                                           "pad_token_id": tokenizer.pad_token_id})
    with HostileOpenAIServer("trickle") as server:
        agent = OpenAIChatAgent(server.url, tokenizer, model="m", timeout_s=1.0, max_attempts=2)
        error, seconds = timed(agent.generate_sequences, batch)
        agent.close()
    assert isinstance(error, RuntimeError) and "2 attempts failed, last: timeout" in str(error), error
    assert seconds < 6
