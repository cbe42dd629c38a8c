"""A streamed chat completion (Server-Sent Events) read by `OpenAIEndpoint.chat_stream` and the endpoint agent:
the same text and turn as the plain completion, handed on in pieces as they come; a hostile stream (trickled,
flooded, garbage or deeply nested events, an error event, no finish_reason or no [DONE]) fails the request with
its kind within its deadline, and the API key appears in no error or log. A local model's decoded pieces join to
its decoded turn."""
from __future__ import annotations

import logging

import pytest
import torch

from llm_agent.evaluation.agents import OpenAIChatAgent
from llm_agent.evaluation.local_agents import DecodedPieces
from llm_agent.openai_endpoint import EndpointError, OpenAIEndpoint
from verl.protocol import DataProto
from verl.utils.dataset import load_tokenizer
from tests.helpers.hostile_openai import HostileOpenAIServer, timed

MESSAGES = [{"role": "user", "content": "hi"}]
KEY = "sk-stream-" + "q" * 20
# an emoji travels as a JSON-escaped surrogate pair; here its halves come in two events
CONTENT = "Hello, I\u2019m Dana from Acme \U0001F600 \u2014 a minute about your listing?"
PIECES = ["Hello, ", "I\u2019m Dana", " from Acme ", "\ud83d", "\ude00 \u2014 a", " minute about your listing?"]


def test_the_pieces_put_together_are_the_content():
    assert PIECES[3] + PIECES[4] != "\U0001F600 \u2014 a"  # the halves are not the character on their own
    assert "".join(PIECES).encode("utf-16", "surrogatepass").decode("utf-16") == CONTENT


def test_a_streamed_completion_is_the_plain_one_in_pieces():
    with HostileOpenAIServer("ok", content=CONTENT) as server:
        endpoint = OpenAIEndpoint(server.url, timeout_s=5)
        plain = endpoint.chat({"model": "m", "messages": MESSAGES})
        server.stream_in(PIECES)
        heard: list[str] = []
        streamed = endpoint.chat_stream({"model": "m", "messages": MESSAGES}, heard.append)
        endpoint.close()
        assert server.streamed == 1 and server.requests == 2
    assert plain == (CONTENT, "stop")
    assert streamed == plain
    # the character split between two events reaches the listener whole, with the piece after it
    assert heard == ["Hello, ", "I\u2019m Dana", " from Acme ", "\U0001F600 \u2014 a", " minute about your listing?"]


def test_a_server_that_does_not_stream_is_read_whole():
    with HostileOpenAIServer("raw", content=CONTENT) as server:  # answers every request with one JSON completion
        endpoint = OpenAIEndpoint(server.url, timeout_s=5)
        heard: list[str] = []
        assert endpoint.chat_stream({"model": "m", "messages": MESSAGES}, heard.append) == (CONTENT, "stop")
        endpoint.close()
    assert heard == [CONTENT]


@pytest.mark.parametrize("mode, kind, says, limit_s", [
    ("sse_trickle", "timeout", "not complete after 1s", 2.5), ("sse_stall", "timeout", "ReadTimeout", 3.5),
    ("sse_flood", "too_large", f"over {8 << 20} bytes", 5.0), ("sse_garbage", "garbage", "not valid JSON", 2.5),
    ("sse_nested", "garbage", "nested 200000 levels deep", 2.5), ("sse_error", "http", "model crashed", 2.5),
    ("sse_no_done", "connection", "without data: [DONE]", 2.5),
    ("sse_no_finish", "garbage", "without a finish_reason", 2.5)])
def test_a_hostile_stream_fails_the_request_in_time(mode, kind, says, limit_s):
    with HostileOpenAIServer(mode, content=CONTENT, api_key=KEY) as server:
        endpoint = OpenAIEndpoint(server.url, api_key=KEY, timeout_s=1.0)
        heard: list[str] = []
        error, seconds = timed(endpoint.chat_stream, {"model": "m", "messages": MESSAGES}, heard.append)
        endpoint.close()
    assert isinstance(error, EndpointError), error
    assert error.kind == kind and says in str(error), error
    assert KEY not in str(error)
    assert seconds < limit_s
    assert sum(map(len, heard)) <= 8 << 20  # what reached the listener is bounded by the cap too


def _one_row_batch(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = torch.tensor([prompt])
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                        "position_ids": torch.arange(ids.size(1))[None]},
                               meta_info={"response_length": 64, "eos_token_id": tokenizer.eos_token_id,
                                          "pad_token_id": tokenizer.pad_token_id})


def test_the_endpoint_agent_streams_the_turn_it_would_answer_whole(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    with HostileOpenAIServer("ok", content=CONTENT, api_key=KEY) as server:
        server.stream_in(PIECES)
        agent = OpenAIChatAgent(server.url, tokenizer, model="m", api_key=KEY, timeout_s=5)
        plain = agent.generate_sequences(_one_row_batch(tokenizer))
        heard: list[str | None] = []
        agent.stream_text(heard.append)
        streamed = agent.generate_sequences(_one_row_batch(tokenizer))
        agent.stream_text(None)
        again = agent.generate_sequences(_one_row_batch(tokenizer))
        agent.close()
        assert (server.requests, server.streamed) == (3, 1)
    assert torch.equal(streamed.batch["responses"], plain.batch["responses"])
    assert torch.equal(again.batch["responses"], plain.batch["responses"])
    assert heard[-1] is None and "".join(heard[:-1]) == CONTENT
    ids = plain.batch["responses"][0][plain.batch["response_mask"][0].bool()].tolist()
    assert tokenizer.decode(ids, skip_special_tokens=True) == CONTENT


def test_a_failed_streamed_attempt_is_ended_for_the_listener_and_keeps_the_key_out(tiny_model_path, caplog):
    tokenizer = load_tokenizer(tiny_model_path)
    with HostileOpenAIServer("sse_no_done", content=CONTENT, api_key=KEY) as server:
        agent = OpenAIChatAgent(server.url, tokenizer, model="m", api_key=KEY, timeout_s=1.0, max_attempts=2)
        heard: list[str | None] = []
        agent.stream_text(heard.append)
        with caplog.at_level(logging.DEBUG):
            error, _ = timed(agent.generate_sequences, _one_row_batch(tokenizer))
        agent.close()
        assert server.streamed == 2
    assert isinstance(error, RuntimeError) and "2 attempts failed, last: connection" in str(error), error
    # each attempt's pieces, then None: a listener starts afresh with the retry
    first = heard.index(None)
    assert "".join(heard[:first]) == CONTENT and heard[first + 1:-1] == heard[:first] and heard[-1] is None
    assert KEY not in str(error) and KEY not in caplog.text


def test_a_local_models_pieces_join_to_its_decoded_turn(tiny_model_path):
    tokenizer = load_tokenizer(tiny_model_path)
    text = "Hi \u2014 I'm calling about Caf\u00e9 M\u00fcller \U0001F600 , isn't it ?  Bye."
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    heard: list[str | None] = []
    pieces = DecodedPieces(tokenizer, heard.append)
    for token in ids:
        pieces(token)
    shown_before_end = "".join(heard)
    pieces(None)
    assert heard[-1] is None and "".join(heard[:-1]) == tokenizer.decode(ids, skip_special_tokens=True)
    assert len(heard) > 5 and "\ufffd" not in shown_before_end  # in pieces, never half a character
