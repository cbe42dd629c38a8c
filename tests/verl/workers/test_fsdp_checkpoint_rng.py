"""RNG states captured for a checkpoint survive torch.save / torch.load(weights_only=True) exactly."""

from __future__ import annotations

import io
import random

import numpy as np
import torch

from verl.workers.fsdp_checkpoint import _rng_state, _set_rng_state


def _draw() -> tuple:
    return random.random(), random.gauss(0, 1), np.random.randn(3), np.random.normal(), torch.rand(2)


def test_rng_state_round_trip_through_weights_only_load():
    random.gauss(0, 1)
    np.random.randn()  # leave a cached gaussian in both generators
    buffer = io.BytesIO()
    torch.save(_rng_state(), buffer)
    expected = _draw()
    buffer.seek(0)
    _set_rng_state(torch.load(buffer, weights_only=True))
    got = _draw()
    assert got[:2] == expected[:2]
    assert np.array_equal(got[2], expected[2]) and got[3] == expected[3]
    assert torch.equal(got[4], expected[4])
