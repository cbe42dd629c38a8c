"""The scripted persona's cost and memory stay bounded on hostile conversations (issue 12, items 2 and 4)."""
from __future__ import annotations

import difflib
import gc
import random
import tracemalloc


from llm_agent.scenario import DEFAULT_SCENARIO_PATH, load_scenario
from llm_agent.user_sim.server.backend import SamplingParams
from llm_agent.user_sim.server.repetition import REPETITION_WINDOW
from llm_agent.user_sim.server.scripted import ScriptedPersona, ScriptedPersonaBackend
from tests.helpers.profiles import profile3

SCENARIO = load_scenario(DEFAULT_SCENARIO_PATH)
PROFILE = profile3(2, 2, 2, behaviors=())
GREEDY = SamplingParams(n=1, temperature=0.0, top_p=1.0, seed=None, max_tokens=None)


def _turns(n: int, seed: int = 0) -> list[str]:
    """`n` distinct turns over a 50-word vocabulary: similar enough that the cheap similarity bounds pass."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(50)}" for _ in range(40)) for _ in range(n)]


def test_repetition_check_is_linear_in_the_number_of_turns(monkeypatch):
    """Every turn was compared with every earlier one (1,000 turns: 499,500 comparisons, ~21 s); now each turn
    meets at most REPETITION_WINDOW earlier ones. Counted, not timed, so a loaded machine cannot flake it."""
    comparisons = 0
    real = difflib.SequenceMatcher.real_quick_ratio

    def counting(self):
        nonlocal comparisons
        comparisons += 1
        return real(self)

    monkeypatch.setattr(difflib.SequenceMatcher, "real_quick_ratio", counting)
    persona = ScriptedPersona(SCENARIO, PROFILE)
    turns = _turns(1000)
    for text in turns:
        persona._detect(text)
    assert 0 < comparisons <= REPETITION_WINDOW * len(turns)


def test_repetition_is_still_heard_near_and_far():
    """The same words any number of turns later, or nearly the same words within the window, are repetition."""
    filler = _turns(REPETITION_WINDOW + 5, seed=1)
    first = "hello this is anna from the bakery down the street calling about your order today"
    persona = ScriptedPersona(SCENARIO, PROFILE)
    assert "repetition" not in persona._detect(first)[0]
    for text in filler:
        persona._detect(text)
    assert "repetition" in persona._detect(first.upper() + " !")[0] or "repetition" in persona._detect(first)[0]
    near = ScriptedPersona(SCENARIO, PROFILE)
    near._detect(first)
    assert "repetition" in near._detect(first.replace("today", "now"))[0]
    assert "repetition" not in near._detect("something else entirely, about the weather")[0]


def _request(big_turn: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SCENARIO.render_user_prompt(PROFILE)},
            {"role": "user", "content": big_turn}]


def test_persona_cache_memory_is_bounded():
    """Distinct 900 KB agent turns were retained whole in the persona cache (60 of them: 61 MB); now <= 16 KB each."""
    backend = ScriptedPersonaBackend(SCENARIO)
    requests = [_request(f"turn {i} " + "y" * 900_000) for i in range(12)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for messages in requests:
        backend.complete(messages, GREEDY)
    gc.collect()
    retained = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert retained < 4 << 20, retained  # the old cache kept all 12 (10.8 MB)


def test_persona_cache_respects_its_byte_bound():
    backend = ScriptedPersonaBackend(SCENARIO, cache_bytes=200_000)
    for i, text in enumerate(_turns(300, seed=2)):
        backend.complete(_request(f"turn {i} {text}"), GREEDY)
    entries, size = backend.cache_footprint
    assert 0 < size <= 200_000 and entries < 300
