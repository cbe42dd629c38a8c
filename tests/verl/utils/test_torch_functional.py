"""Tests of verl.utils.torch_functional against independent float64 / plain-Python computations."""

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import verl.utils.torch_functional as verl_F

pytestmark = pytest.mark.oldest  # also run under the lowest declared transformers (.venv-vllm)


def _masked_values(values: torch.Tensor, mask: torch.Tensor) -> list[float]:
    return [float(v) for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m]


def test_masked_sum_and_mean_ignore_masked_nan():
    values = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert verl_F.masked_sum(values, mask).item() == pytest.approx(13.0)
    assert verl_F.masked_mean(values, mask).item() == pytest.approx(13.0 / 4)
    assert verl_F.masked_sum(values, mask, axis=1).tolist() == pytest.approx([3.0, 10.0])
    assert verl_F.masked_mean(values, mask, axis=-1).tolist() == pytest.approx([1.5, 5.0])
    assert verl_F.masked_mean(values, torch.zeros_like(mask)).item() == 0.0


def test_masked_sum_and_mean_weight_by_a_fractional_mask():
    """veRL semantics: masked_sum is sum(values * mask), masked_mean divides by sum(mask)."""
    values = torch.tensor([[2.0, 4.0, float("nan")]])
    mask = torch.tensor([[0.5, 1.0, 0.0]])
    assert verl_F.masked_sum(values, mask).item() == pytest.approx(5.0)
    assert verl_F.masked_mean(values, mask).item() == pytest.approx(5.0 / 1.5)


def test_masked_var_and_whiten_match_plain_python():
    torch.manual_seed(0)
    values = torch.randn(4, 7, dtype=torch.float64) * 3 + 1
    mask = (torch.rand(4, 7) > 0.4).long()
    xs = _masked_values(values, mask)
    n = len(xs)
    mean = sum(xs) / n
    var_biased = sum((x - mean) ** 2 for x in xs) / n
    var_unbiased = sum((x - mean) ** 2 for x in xs) / (n - 1)
    assert verl_F.masked_var(values, mask, unbiased=False).item() == pytest.approx(var_biased, rel=1e-6)
    assert verl_F.masked_var(values, mask).item() == pytest.approx(var_unbiased, rel=1e-6)
    whitened = verl_F.masked_whiten(values, mask)
    expected = [(x - mean) / math.sqrt(var_unbiased + 1e-8) for x in xs]
    assert _masked_values(whitened, mask) == pytest.approx(expected, rel=1e-6)
    unshifted = verl_F.masked_whiten(values, mask, shift_mean=False)
    assert _masked_values(unshifted, mask) == pytest.approx([e + mean for e in expected], rel=1e-6)


def test_masked_var_unbiased_rejects_tiny_masks():
    values = torch.arange(4.0)
    with pytest.raises(ValueError, match="empty"):
        verl_F.masked_var(values, torch.zeros(4))
    with pytest.raises(ValueError, match="single element"):
        verl_F.masked_var(values, torch.tensor([0, 1, 0, 0]))


def _reference_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy by an explicit loop over rows: -sum_j p_j log p_j with p from a float64 softmax."""
    flat = logits.double().reshape(-1, logits.shape[-1])
    out = []
    for row in flat:
        m = max(row.tolist())
        exps = [math.exp(z - m) for z in row.tolist()]
        total = sum(exps)
        out.append(-sum((e / total) * math.log(e / total) for e in exps if e > 0))
    return torch.tensor(out, dtype=torch.float64).view(logits.shape[:-1])


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 4, 100])
def test_logprobs_and_entropy_values_across_chunk_boundaries(chunk_size):
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 11) * 4
    labels = torch.randint(0, 11, (2, 5))
    lp = verl_F.logprobs_from_logits(logits, labels, chunk_size=chunk_size)
    assert lp.shape == (2, 5) and lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), _reference_logprobs(logits, labels), rtol=1e-5, atol=1e-5)
    ent = verl_F.entropy_from_logits(logits, chunk_size=chunk_size)
    torch.testing.assert_close(ent.double(), _reference_entropy(logits), rtol=1e-5, atol=1e-5)


def test_non_contiguous_logits_slice():
    torch.manual_seed(2)
    full = torch.randn(3, 9, 13, dtype=torch.float64)
    logits = full[:, 2:8, :]
    assert not logits.is_contiguous()
    labels = torch.randint(0, 13, (3, 6))
    logprobs = verl_F.logprobs_from_logits(logits, labels, chunk_size=4)
    torch.testing.assert_close(logprobs, _reference_logprobs(logits, labels))
    torch.testing.assert_close(verl_F.entropy_from_logits(logits, chunk_size=4), _reference_entropy(logits))


@pytest.mark.parametrize("chunk_size", [2, 5, None])
def test_logprob_and_entropy_gradients_match_autograd_reference(chunk_size):
    torch.manual_seed(3)
    base = torch.randn(3, 4, 7, dtype=torch.float64) * 2
    labels = torch.randint(0, 7, (3, 4))
    weights = torch.randn(3, 4, dtype=torch.float64)

    ours = base.clone().requires_grad_(True)
    loss = (verl_F.logprobs_from_logits(ours, labels, chunk_size=chunk_size) * weights).sum()
    loss = loss + (verl_F.entropy_from_logits(ours, chunk_size) * weights.flip(0)).sum()
    loss.backward()

    ref = base.clone().requires_grad_(True)
    logp = torch.log_softmax(ref, dim=-1)
    ref_loss = (logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1) * weights).sum()
    ref_loss = ref_loss + ((-(logp.exp() * logp).sum(-1)) * weights.flip(0)).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(ours.grad, ref.grad)


def test_gradcheck_float64():
    torch.manual_seed(4)
    logits = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 6, (5,))
    assert torch.autograd.gradcheck(lambda z: verl_F.logprobs_from_logits(z, labels, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda z: verl_F.entropy_from_logits(z, 2), (logits,))


def test_bf16_logits_give_float32_results_and_bf16_grads():
    torch.manual_seed(5)
    logits = (torch.randn(4, 3, 17) * 3).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 17, (4, 3))
    lp = verl_F.logprobs_from_logits(logits, labels, chunk_size=5)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), _reference_logprobs(logits.detach(), labels), rtol=1e-5, atol=1e-5)
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad).all()


def test_logprobs_shape_mismatch_is_an_error():
    with pytest.raises(ValueError, match="do not match labels"):
        verl_F.logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_get_response_mask_single_and_multiple_eos():
    responses = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 0, 0, 0, 0], [4, 9, 3, 2, 1]])
    assert verl_F.get_response_mask(responses, eos_token=2).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
        [1, 1, 1, 1, 0],
    ]
    mask = verl_F.get_response_mask(responses, eos_token=[9, 2], dtype=torch.float32)
    assert mask.dtype == torch.float32
    assert mask[3].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_compute_position_id_with_mask_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert verl_F.compute_position_id_with_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_padding_helpers():
    t = torch.tensor([[1, 2], [3, 4]])
    assert verl_F.pad_sequence_to_length(t, 4, 0).tolist() == [[1, 2, 0, 0], [3, 4, 0, 0]]
    assert verl_F.pad_sequence_to_length(t, 3, 9, left_pad=True).tolist() == [[9, 1, 2], [9, 3, 4]]
    assert verl_F.pad_sequence_to_length(t, 2, 0) is t
    assert verl_F.pad_2d_list_to_length([[1], [2, 3, 4]], 0).tolist() == [[1, 0, 0], [2, 3, 4]]
    assert verl_F.pad_2d_list_to_length([[1], [2, 3]], -1, max_length=4).tolist() == [[1, -1, -1, -1], [2, 3, -1, -1]]


def test_entropy_with_minus_inf_logits_is_finite():
    inf = float("inf")
    logits = torch.tensor([[0.0, 0.0, -inf, -inf], [1.0, 2.0, 3.0, -inf]], requires_grad=True)
    ent = verl_F.entropy_from_logits(logits)
    expected = _reference_entropy(logits.detach())
    torch.testing.assert_close(ent.double(), expected, rtol=1e-5, atol=1e-6)
    assert ent[0].item() == pytest.approx(math.log(2))
    ent.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[:, -1].tolist() == [0.0, 0.0]


class _LargestAllocation(TorchDispatchMode):
    """Records the largest new storage (in elements) allocated by any aten op run inside the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        known = {t.untyped_storage().data_ptr() for t in inputs}
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in known:
                self.largest = max(self.largest, tensor.untyped_storage().nbytes() // tensor.element_size())
        return out


def test_forward_never_builds_a_full_vocab_tensor():
    torch.manual_seed(6)
    vocab, chunk = 1000, 3
    logits = torch.randn(4, 9, vocab, requires_grad=True)[:, 1:, :]
    labels = torch.randint(0, vocab, (4, 8))
    with _LargestAllocation() as probe:
        logprobs = verl_F.logprobs_from_logits(logits, labels, chunk_size=chunk)
        entropy = verl_F.entropy_from_logits(logits, chunk_size=chunk)
    assert 0 < probe.largest <= chunk * vocab
    (logprobs.sum() + entropy.sum()).backward()
    torch.testing.assert_close(logprobs.double(), _reference_logprobs(logits.detach(), labels), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.2])
def test_bf16_logits_with_temperature_match_the_float32_path_in_values_and_gradients(temperature):
    """The update's log-probs and entropy from bf16 logits kept as they are, against the float32 path (the logits
    cast to float32, divided by the temperature, torch's log_softmax, autograd), on random inputs where a mask
    zeroes the loss of some positions (user turns) and the entropy has its own weights."""
    torch.manual_seed(7)
    rows, vocab = 37, 1531
    logits = (torch.randn(rows, vocab) * 3).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,))
    mask = (torch.rand(rows) > 0.3).float()
    weights, entropy_weights = torch.randn(rows) * mask, torch.randn(rows) * mask

    ours = logits.clone().requires_grad_(True)
    log_probs, entropy = verl_F.log_probs_and_entropy(ours, labels, temperature, chunk_size=8)
    ((log_probs * weights).sum() + (entropy * entropy_weights).sum()).backward()

    fp32 = logits.float().requires_grad_(True)
    log_softmax = torch.log_softmax(fp32 / temperature, -1)
    ref_log_probs = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ((ref_log_probs * weights).sum() + (ref_entropy * entropy_weights).sum()).backward()

    assert log_probs.dtype == entropy.dtype == torch.float32 and ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(log_probs, ref_log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)
    # the float32 path's gradient reached the bf16 logits through the cast: the same rounding, one ulp apart at most
    torch.testing.assert_close(ours.grad.float(), fp32.grad.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-7)
    assert not ours.grad[mask == 0].any()  # masked positions get no gradient


def test_gradients_flow_only_from_the_outputs_in_the_loss():
    torch.manual_seed(8)
    base = torch.randn(6, 9, dtype=torch.float64)
    labels = torch.randint(0, 9, (6,))
    for use_log_probs, use_entropy in [(True, False), (False, True)]:
        ours = base.clone().requires_grad_(True)
        log_probs, entropy = verl_F.log_probs_and_entropy(ours, labels, 1.3)
        (log_probs.sum() if use_log_probs else entropy.sum()).backward()
        ref = base.clone().requires_grad_(True)
        log_softmax = torch.log_softmax(ref / 1.3, -1)
        ref_out = log_softmax.gather(-1, labels.unsqueeze(-1)) if use_log_probs else \
            -(log_softmax.exp() * log_softmax).sum(-1)
        ref_out.sum().backward()
        torch.testing.assert_close(ours.grad, ref.grad)


@pytest.mark.parametrize("temperature", [0.0, -1.0, float("nan"), float("inf")])
def test_temperature_must_be_finite_and_positive(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        verl_F.log_probs_and_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature)
