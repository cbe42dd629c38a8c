"""ChatLayout: a decoded agent-side chat split back into the messages the chat template rendered."""
from __future__ import annotations

import pytest

from llm_agent.rollout.chat_layout import ChatLayout


def _chat(scenario, *turns):
    """System prompt, the opening, then alternating assistant/user contents."""
    roles = ("assistant", "user")
    return [{"role": "system", "content": scenario.render_agent_prompt()},
            {"role": "user", "content": scenario.agent_opening},
            *({"role": roles[i % 2], "content": text} for i, text in enumerate(turns))]


def test_split_and_messages_give_back_the_rendered_chat_even_when_a_turn_lost_its_eos(tok, scenario):
    layout = ChatLayout(tok)
    chat = _chat(scenario, "<response>Hi</response>", "Who is this?", "<response>Mia, FoodLoop.</response>",
                 "Go on.")
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert layout.messages(text) == chat
    assert layout.split(text) == [(m["role"], m["content"]) for m in chat[1:]]
    cut = text.replace(f"Hi</response>{tok.eos_token}", "Hi</response>")  # a turn cut before its end-of-turn token
    assert cut != text and layout.messages(cut) == chat
    with pytest.raises(ValueError, match="no system message"):
        layout.split("just words")
    with pytest.raises(ValueError, match="does not start with a system message"):
        layout.messages("just words")


def test_a_tokenizer_without_a_chat_template_is_refused(tok):
    class NoTemplate:
        eos_token = tok.eos_token

        def apply_chat_template(self, *args, **kwargs):
            raise ValueError("no chat template is set")

    with pytest.raises(ValueError, match="ChatLayout: the tokenizer cannot render a chat"):
        ChatLayout(NoTemplate())
