"""Reading a decoded agent-side chat back into messages, with the tokenizer's own chat template.

`ChatLayout` renders a probe conversation once to learn the text a chat template puts before the system prompt
and at each role switch, then splits a decoded context (system prompt, the opening user message, alternating
assistant and user turns, the generation prompt) into chat messages. Agents that take chat messages instead of
token ids (an OpenAI-compatible endpoint, the scripted stand-in) read the rollout loop's contexts through it.
"""
from __future__ import annotations

import re
from typing import Any

__all__ = ["ChatLayout"]


class ChatLayout:
    """Where a tokenizer's chat template puts role switches, learnt by rendering a probe conversation.

    `split(text)` turns a decoded agent-side chat (system prompt, opening, then assistant and user turns, ending
    with the generation prompt) into (role, content) pairs after the system prompt; `messages(text)` returns the
    whole chat, system message first. The end-of-turn token before a role switch is optional, so a turn that was
    cut before its EOS still splits.
    """

    _PROBE = ("@@S0@@", "@@U1@@", "@@A1@@", "@@U2@@")

    def __init__(self, tokenizer: Any) -> None:
        sys_, u1, a1, u2 = self._PROBE
        messages = [{"role": "system", "content": sys_}, {"role": "user", "content": u1},
                    {"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"ChatLayout: the tokenizer cannot render a chat ({exc}); it needs a chat template") \
                from None
        positions = [text.find(s) for s in self._PROBE]
        if min(positions) < 0 or positions != sorted(positions):
            raise ValueError("ChatLayout: the chat template does not render system, user and assistant contents "
                             "in order; a decoded chat cannot be split into messages")
        self.system_prefix = text[:positions[0]]
        self.system_to_user = text[positions[0] + len(sys_):positions[1]]
        self.to_assistant = text[positions[1] + len(u1):positions[2]]
        self.to_user = text[positions[2] + len(a1):positions[3]]
        self.generation_prompt = text[positions[3] + len(u2):]
        eos = getattr(tokenizer, "eos_token", None) or ""
        self._split = re.compile("|".join(f"({self._optional_eos(sep, eos)})"
                                          for sep in (self.to_assistant, self.to_user)))

    @staticmethod
    def _optional_eos(separator: str, eos: str) -> str:
        """A regex for `separator` whose leading end-of-turn token may be missing."""
        if eos and separator.startswith(eos):
            return f"(?:{re.escape(eos)})?{re.escape(separator[len(eos):])}"
        return re.escape(separator)

    def split(self, text: str) -> list[tuple[str, str]]:
        """(role, content) pairs after the system prompt; ValueError when the text has no system-to-user switch."""
        start = text.find(self.system_to_user)
        if start < 0:
            raise ValueError("the decoded prompt has no system message followed by a user message")
        rest = text[start + len(self.system_to_user):]
        if rest.endswith(self.generation_prompt):
            rest = rest[: len(rest) - len(self.generation_prompt)]
        pairs: list[tuple[str, str]] = []
        role, pos = "user", 0
        for m in self._split.finditer(rest):
            pairs.append((role, rest[pos:m.start()]))
            role = "assistant" if m.group(1) is not None else "user"
            pos = m.end()
        pairs.append((role, rest[pos:]))
        return pairs

    def messages(self, text: str) -> list[dict[str, str]]:
        """The chat messages of a decoded context: its system prompt, then the user and assistant turns.

        ValueError when the text does not start with the template's system message followed by a user message.
        """
        start = text.find(self.system_prefix)
        end = text.find(self.system_to_user)
        if start < 0 or end < start:
            raise ValueError("the decoded context does not start with a system message of the chat template")
        system = text[start + len(self.system_prefix):end]
        return [{"role": "system", "content": system},
                *({"role": role, "content": content} for role, content in self.split(text))]
