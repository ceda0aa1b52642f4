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
