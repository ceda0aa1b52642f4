"""torch.compile(model, backend="eclat"): compiled graphs match PyTorch; graphs eclat cannot
lower fall back to PyTorch with a warning naming the op."""

from __future__ import annotations

import warnings

import pytest
import torch

import eclat.dynamo


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_and_call(model, *args, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="eclat", **options)(*args)
    return out, [str(w.message) for w in caught if "eclat" in str(w.message)]


def test_backend_is_registered_by_name():
    assert "eclat" in torch._dynamo.list_backends(exclude_tags=())
    assert torch._dynamo.lookup_backend("eclat") is eclat.dynamo.eclat_backend


def test_compiled_graph_matches_pytorch(monkeypatch):
    calls = []
    real = eclat.compile
    monkeypatch.setattr(eclat, "compile", lambda *a, **k: calls.append(k) or real(*a, **k))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        got, notes = _compile_and_call(model, x, options={"k": 1})
        want = model(x)
    assert notes == [] and len(calls) == 1 and calls[0]["autotune"] == "none"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


class Unsupported(torch.nn.Module):
    def forward(self, x):
        return torch.linalg.qr(x)[0] * 2


def test_unsupported_op_falls_back_to_pytorch_with_a_warning():
    x = torch.randn(4, 4)
    got, notes = _compile_and_call(Unsupported(), x)
    torch.testing.assert_close(got, Unsupported()(x))
    assert len(notes) == 1 and "falling back to PyTorch" in notes[0] and "linalg_qr" in notes[0]


def test_unknown_option_is_an_error():
    with pytest.raises(Exception, match="unknown options"):
        torch.compile(torch.nn.Linear(2, 2), backend="eclat", options={"tile": 4})(torch.randn(1, 2))


class Breaks(torch.nn.Module):
    """A data-dependent graph break: dynamo compiles the graphs around it, and recompiles one."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x).relu()
        if y.sum().item() > 3.0:
            y = y * 2
        return self.lin(y)


def test_graphs_around_a_graph_break_and_their_recompiles_are_compiled_by_eclat(monkeypatch):
    """Each graph is compiled at its first call: compiled while dynamo built its frame's guards (as
    the backend was called), a recompiled graph failed in torch.export (NameError: L) and ran in
    PyTorch."""
    compiles = []
    real = eclat.compile
    monkeypatch.setattr(eclat, "compile", lambda *a, **k: compiles.append(1) or real(*a, **k))
    model = Breaks().eval()
    fast = torch.compile(model, backend="eclat")
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for seed in range(4):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)) * (1 + seed)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    assert not [w for w in caught if "falling back" in str(w.message)]
    assert len(compiles) >= 3


def test_dynamic_true_keeps_the_sizes_a_graph_pins_static():
    """dynamic=True makes every size symbolic, a Linear's features too: eclat let torch.export keep
    the pinned ones static (Dim.AUTO), where a Dim for each failed and every graph ran in PyTorch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    fast = torch.compile(model, backend="eclat", dynamic=True)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        for n in (3, 5, 7):
            x = torch.randn(2, n, 8)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-6)
    assert not [w for w in caught if "falling back" in str(w.message)]
