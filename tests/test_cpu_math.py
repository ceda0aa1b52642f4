"""Accuracy of the CPU's transcendental lowerings end to end (frontend, rewrites, LLVM),
against float64 references rather than torch's own float32 results."""

from __future__ import annotations

import numpy as np
import torch

import eclat


def test_gelu_is_float32_accurate_and_keeps_special_values():
    x = torch.cat([torch.linspace(-12, 12, 48001),
                   torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-30, -1e-30, 1e30, -1e30])])
    fast = eclat.compile(torch.nn.GELU(), (x,), target="cpu", autotune="none", quiet=True)
    got = fast(x.numpy())
    want = torch.nn.functional.gelu(x.double()).numpy()
    finite = np.isfinite(want)
    positive = finite & (x.numpy() > 0)
    # torch's own float32 GELU: 4.8e-7 relative for x > 0, 2.6e-7 absolute for x <= 0 (eclat's
    # rational fit divides, then adds 0.5: two roundings since the division is a true one)
    assert np.max(np.abs(got[finite & ~positive] - want[finite & ~positive])) < 9e-7
    assert np.max(np.abs(got[positive] / want[positive] - 1)) < 2.5e-7
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert got[-6] == np.inf

