"""Buffers a model updates in place (a KV cache, a running count) are the compiled model's states:
kept between calls, updated by rows where the model writes rows, and matching torch call by call."""

import numpy as np
import pytest
import torch

import eclat
from eclat.compiler.kernel import walk


class RowCache(torch.nn.Module):
    """A KV-cache-like buffer written at run-time positions, a counter, and a read of both."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 2, 8, 4))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, positions):
        self.cache.index_copy_(2, positions, self.proj(x))
        self.calls.add_(1)
        return self.cache.softmax(2).sum(2), self.calls * 1


class Running(torch.nn.Module):
    """A whole-buffer update: an exponential moving average of the input."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(3))

    def forward(self, x):
        self.mean.mul_(0.5).add_(x.mean(0) * 0.5)
        return x - self.mean


def _pair(cls):
    torch.manual_seed(0)
    model = cls().eval()
    twin = cls().eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def test_a_row_cache_is_updated_in_place_call_after_call():
    model, twin = _pair(RowCache)
    x, pos = torch.randn(1, 2, 2, 4), torch.tensor([0, 1])
    compiled = eclat.compile(model, (x, pos), autotune="none", quiet=True)
    assert [(s.name, s.axis) for s in compiled.state_specs] == [("cache", 2), ("calls", None)]
    assert [s.name for s in compiled.inputs] == ["x", "positions"]  # the states are not arguments
    cache = compiled.states["cache"]
    for step in range(4):
        x, pos = torch.randn(1, 2, 2, 4), torch.tensor([2 * step, 2 * step + 1])
        with torch.no_grad():
            want = twin(x, pos)
        got = compiled(x, pos)
        np.testing.assert_allclose(got[0].numpy(), want[0].numpy(), rtol=1e-5, atol=1e-6)
        assert int(got[1]) == int(want[1]) == step + 1
    assert compiled.states["cache"] is cache  # written in place, never replaced
    np.testing.assert_allclose(cache, twin.cache.numpy(), rtol=1e-5, atol=1e-6)
    compiled.reset_states()
    assert not cache.any() and int(compiled.states["calls"]) == 0
    with pytest.raises(ValueError, match="4 inputs .states included., given 2"):  # not a crash
        compiled.executable.profile([x.numpy(), pos.numpy()])


def test_updating_the_states_alone_skips_the_outputs_kernels(monkeypatch):
    """update_states runs the kernels the states' updates need and none that only the model's
    outputs need (a softmax over the cache here): the states end as after full calls."""
    from eclat.backends.cpu import runtime

    model, twin = _pair(RowCache)
    x, pos = torch.randn(1, 2, 2, 4), torch.tensor([0, 1])
    compiled = eclat.compile(model, (x, pos), autotune="none", quiet=True)
    ran = []
    kernels_for = runtime.NativeRun._kernels_for
    monkeypatch.setattr(runtime.NativeRun, "_kernels_for",
                        lambda self, wanted: ran.append(wanted) or kernels_for(self, wanted))
    for step in range(3):
        x, pos = torch.randn(1, 2, 2, 4), torch.tensor([2 * step, 2 * step + 1])
        with torch.no_grad():
            twin(x, pos)
        assert compiled.update_states(x, pos) is None
    np.testing.assert_allclose(compiled.states["cache"], twin.cache.numpy(), rtol=1e-5, atol=1e-6)
    assert int(compiled.states["calls"]) == 3
    program = compiled.executable.program
    assert ran and len(kernels_for(compiled.executable, ran[0])) < len(program.kernels)
    with pytest.raises(ValueError, match="no states"):
        eclat.compile(torch.nn.Linear(4, 4), (x,), autotune="none", quiet=True).update_states(x)


def test_compiling_does_not_touch_the_models_own_buffers():
    model, _ = _pair(RowCache)
    eclat.compile(model, (torch.randn(1, 2, 2, 4), torch.tensor([3, 4])), autotune="none", quiet=True)
    assert not model.cache.any() and int(model.calls) == 0


def test_a_whole_buffer_update():
    model, twin = _pair(Running)
    compiled = eclat.compile(model, (torch.randn(5, 3),), autotune="none", quiet=True)
    assert [s.axis for s in compiled.state_specs] == [None]
    for _ in range(3):
        x = torch.randn(5, 3)
        with torch.no_grad():
            want = twin(x)
        np.testing.assert_allclose(compiled(x).numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_an_update_at_a_position_outside_the_buffer_is_an_index_error():
    model, _ = _pair(RowCache)
    compiled = eclat.compile(model, (torch.randn(1, 2, 2, 4), torch.tensor([0, 1])), autotune="none",
                             quiet=True)
    with pytest.raises(IndexError, match="out of range"):
        compiled(torch.randn(1, 2, 2, 4), torch.tensor([7, 8]))


def test_an_artifact_keeps_the_states_and_starts_from_their_initial_values(tmp_path):
    model, twin = _pair(RowCache)
    x, pos = torch.randn(1, 2, 2, 4), torch.tensor([0, 1])
    compiled = eclat.compile(model, (x, pos), autotune="none", quiet=True)
    compiled(x, pos)  # a call before saving does not change what is saved
    compiled.save(str(tmp_path / "cache.eclat"))
    loaded = eclat.load(str(tmp_path / "cache.eclat"))
    assert [(s.name, s.axis) for s in loaded.state_specs] == [("cache", 2), ("calls", None)]
    assert not loaded.states["cache"].any()
    for step in range(3):
        x, pos = torch.randn(1, 2, 2, 4), torch.tensor([2 * step, 2 * step + 1])
        with torch.no_grad():
            want = twin(x, pos)
        got = loaded(x.numpy(), pos.numpy())
        np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-5, atol=1e-6)
        assert int(got[1]) == step + 1


class CachedProduct(torch.nn.Module):
    """p @ values, the values a cache of rows written at run-time positions (decode attention's
    product with V, the cache read through the rows the step writes)."""

    def __init__(self, heads: int, length: int, dim: int):
        super().__init__()
        self.register_buffer("values", torch.zeros(1, heads, length, dim))

    def forward(self, p, v, positions):
        self.values.index_copy_(2, positions, v)
        return p @ self.values


@pytest.mark.parametrize("rows,dim", [(1, 64), (1, 80), (1, 72), (5, 48)])
def test_a_product_with_a_cache_read_through_its_update(rows, dim):
    """The product's right operand selects, per step of k, between the cache and the new row: for
    one row the micro-kernel reads it as vectors (whole panels) and element by element (the last
    partial panel: 80 and 72 columns)."""
    from eclat.backends.cpu.contraction import columnwise, contraction_of

    heads, length = 2, 19
    model = CachedProduct(heads, length, dim).eval()
    twin = CachedProduct(heads, length, dim).eval()
    p = torch.rand(1, heads, rows, length)
    # the best-cost candidate alone (k=1): which of several runs fastest is the timing's choice
    compiled = eclat.compile(model, (p, torch.randn(1, heads, 1, dim), torch.tensor([0])),
                             autotune="none", quiet=True, k=1)
    program = compiled.executable.program
    products = [c for c in (contraction_of(k, program.buffers) for k in program.kernels) if c is not None]
    selects = [c for c in products if any(getattr(x, "op", None) == "where" for x in walk(c.b))]
    assert all(columnwise(c.b, f"i{c.n_axis}") for c in selects) and (selects or rows > 1)
    for step in range(4):
        p, v = torch.rand(1, heads, rows, length), torch.randn(1, heads, 1, dim)
        pos = torch.tensor([3 * step])
        with torch.no_grad():
            want = twin(p, v, pos)
        np.testing.assert_allclose(compiled(p, v, pos).numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
