"""HFRollout on the tiny model (plain module, one process): shapes, masks, greedy and seeded determinism."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl.utils.torch_functional import get_response_mask
from verl.workers.rollout.hf_rollout import HFRollout

from tests.helpers.ppo_batch_helpers import PROMPT_LEN, make_prompts

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)

RESPONSE_LEN = 7


@pytest.fixture(scope="module")
def rollout(tiny_model_path) -> HFRollout:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    config = OmegaConf.create(
        {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "response_length": RESPONSE_LEN,
         "micro_batch_size_per_gpu": 3}
    )  # fmt: skip
    return HFRollout(model, config)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path, padding_side="left")


def _prompts(tokenizer, n: int = 5, **meta):
    data = make_prompts(n, len(tokenizer), seed=11)
    data.meta_info.update({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id, **meta})
    return data


def test_generate_shapes_and_masks(rollout, tokenizer):
    prompts = _prompts(tokenizer)
    out = rollout.generate_sequences(prompts).batch
    assert out["prompts"].shape == (5, PROMPT_LEN) and out["responses"].shape == (5, RESPONSE_LEN)
    full_shape = (5, PROMPT_LEN + RESPONSE_LEN)
    assert out["input_ids"].shape == out["attention_mask"].shape == out["position_ids"].shape == full_shape
    assert torch.equal(out["prompts"], prompts.batch["input_ids"])
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], dim=1))
    assert torch.equal(out["attention_mask"][:, PROMPT_LEN:], out["response_mask"])
    assert torch.equal(out["attention_mask"][:, :PROMPT_LEN], prompts.batch["attention_mask"])
    last = prompts.batch["position_ids"][:, -1:]
    assert torch.equal(out["position_ids"][:, PROMPT_LEN:], last + torch.arange(1, RESPONSE_LEN + 1))


def test_greedy_is_deterministic_and_sampling_follows_the_seed(rollout, tokenizer):
    greedy = [rollout.generate_sequences(_prompts(tokenizer, do_sample=False)).batch["responses"] for _ in range(2)]
    assert torch.equal(greedy[0], greedy[1])
    sampled = []
    for _ in range(2):
        torch.manual_seed(123)
        sampled.append(rollout.generate_sequences(_prompts(tokenizer)).batch["responses"])
    assert torch.equal(sampled[0], sampled[1])
    assert not torch.equal(sampled[0], greedy[0])


def test_eos_ends_the_response_and_pads_after_it(rollout, tokenizer):
    greedy = rollout.generate_sequences(_prompts(tokenizer, do_sample=False)).batch["responses"]
    stop = int(greedy[0, 1])  # row 0 must stop after its second token when this token is the EOS
    out = rollout.generate_sequences(_prompts(tokenizer, do_sample=False, eos_token_id=stop)).batch
    mask = out["response_mask"][0]
    first = int((out["responses"][0] == stop).nonzero()[0])
    assert first <= 1
    assert mask[: first + 1].eq(1).all() and mask[first + 1 :].eq(0).all()
    assert out["responses"][0, first + 1 :].eq(tokenizer.pad_token_id).all()
    assert torch.equal(get_response_mask(out["responses"], stop), out["response_mask"])


def test_bad_settings_are_rejected(rollout, tokenizer):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        rollout.generate_sequences(_prompts(tokenizer, temperature=0.0))
    with pytest.raises(ValueError, match="response_length"):
        rollout.generate_sequences(_prompts(tokenizer, response_length=0))


def test_right_padded_prompts_are_rejected(rollout, tokenizer):
    """Generation appends after the last column, so a right-padded prompt would continue from its padding."""
    prompts = _prompts(tokenizer)
    prompts.batch["attention_mask"][2, -1] = 0
    with pytest.raises(ValueError, match=r"must be left-padded .* rows \[2\] end with padding"):
        rollout.generate_sequences(prompts)


@pytest.mark.parametrize("temperature,do_sample", [(1.0, True), (0.7, True), (0.7, False)])
def test_calculate_log_probs_match_the_models_log_probs(tiny_model_path, tokenizer, temperature, do_sample):
    """rollout_log_probs are log softmax(logits / temperature) of the sampled tokens, as a full forward of the
    same model computes them, and 0 after EOS."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    config = OmegaConf.create({"do_sample": True, "temperature": temperature, "top_p": 1.0, "top_k": -1,
                               "response_length": RESPONSE_LEN, "micro_batch_size_per_gpu": 3,
                               "calculate_log_probs": True})
    torch.manual_seed(0)
    out = HFRollout(model, config).generate_sequences(_prompts(tokenizer, n=6, do_sample=do_sample)).batch
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits[:, PROMPT_LEN - 1:-1] / temperature
    expected = torch.log_softmax(logits.double(), -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)
    mask = out["response_mask"].bool()
    assert out["rollout_log_probs"].dtype == torch.float32
    assert (out["rollout_log_probs"].double() - expected).abs()[mask].max() < 1e-4
    assert (out["rollout_log_probs"][~mask] == 0).all()


def test_a_token_listener_hears_each_token_and_changes_nothing(rollout, tokenizer):
    """One row: the listener gets the response's tokens (through the first EOS) in order, then None, and the output
    is the one without it (greedy and seeded sampling); a batch of several rows is not streamed."""
    for meta in ({"do_sample": False}, {"do_sample": True}):
        prompts = _prompts(tokenizer, n=1, **meta)
        torch.manual_seed(7)
        plain = rollout.generate_sequences(prompts).batch
        heard = []
        rollout.token_listener = heard.append
        try:
            torch.manual_seed(7)
            streamed = rollout.generate_sequences(prompts).batch
        finally:
            rollout.token_listener = None
        for key in ("responses", "response_mask", "input_ids"):
            assert torch.equal(plain[key], streamed[key]), key
        n = int(plain["response_mask"][0].sum())
        assert heard == plain["responses"][0, :n].tolist() + [None], meta
    heard = []
    rollout.token_listener = heard.append
    try:
        rollout.generate_sequences(_prompts(tokenizer, n=2, do_sample=False))
    finally:
        rollout.token_listener = None
    assert heard == []
