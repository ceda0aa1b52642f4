"""Recognition on what the frontend emits: one-hot products as gathers, layer norm, attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from eclat.frontend.lower import lower
from eclat.ir.interpreter import run
from eclat.rewrites import optimize


class OneHotEmbedding(nn.Module):
    def __init__(self, vocab: int = 10, d: int = 6):
        super().__init__()
        self.w = nn.Parameter(torch.randn(vocab, d))
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # F.one_hot(ids, V).float() @ W, with one_hot as the compare it lowers to
        return (ids[..., None] == torch.arange(self.vocab)).float() @ self.w


def _check(graph, arrays, cand) -> None:
    for p, q in zip(run(graph, arrays), run(cand, arrays)):
        np.testing.assert_allclose(q, p, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(5,), (2, 4)])
def test_one_hot_matmul_is_a_gather(shape):
    torch.manual_seed(0)
    model = OneHotEmbedding()
    ids = torch.randint(0, 10, shape)
    graph = lower(model, (ids,))
    res = optimize(graph, "cpu", k=4)
    best = res.candidates[0].op_counts()
    assert best.get("gather") == 1 and "sum" not in best and "matmul" not in best
    # out-of-range ids select no row (zeros), as the compare does; gather alone would clamp
    for arr in (ids.numpy(), np.array([-1, 0, 9, 10, 3]).reshape(shape) if shape == (5,) else
                np.array([[-3, 9, 10, 2], [0, 1, 11, 5]])):
        with torch.no_grad():
            want = model(torch.from_numpy(arr)).numpy()
        (got,) = run(res.candidates[0], [arr])
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        for cand in res.candidates:
            _check(graph, [arr], cand)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_is_one_composite(affine: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16, elementwise_affine=affine), nn.ReLU())
    if affine:
        with torch.no_grad():
            model[1].weight.normal_()
            model[1].bias.normal_()
    x = torch.randn(3, 5, 8)
    graph = lower(model, (x,))
    res = optimize(graph, "cpu", k=4)
    best = res.candidates[0].op_counts()
    assert best.get("layernorm") == 1 and "sum" not in best and "sqrt" not in best
    if affine:
        ln = next(n for n in res.candidates[0].nodes() if n.op == "layernorm")
        assert {s.srcs[0].op for s in ln.srcs[1:]} == {"weight"}  # weight and bias live in the norm
    for cand in res.candidates:
        _check(graph, [x.numpy()], cand)


@pytest.mark.parametrize("name", ["llama", pytest.param("hf_gpt2", marks=pytest.mark.slow),
                                  pytest.param("hf_bert", marks=pytest.mark.slow)])
def test_attention_is_one_composite(name: str):
    from tests.zoo import ZOO

    model, example = ZOO[name]()
    graph = lower(model, example)
    res = optimize(graph, "cpu", k=3)
    best = res.candidates[0].op_counts()
    assert best.get("attention") == 2 and "softmax" not in best  # both layers' attention
    arrays = [x.numpy() for x in example]
    with torch.no_grad():
        out = model(*example)
    want = (out if isinstance(out, torch.Tensor) else out[0]).numpy()
    (got, *_) = run(res.candidates[0], arrays)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for cand in res.candidates:
        _check(graph, arrays, cand)


@pytest.mark.slow
def test_attention_over_a_symbolic_sequence():
    from tests.zoo import make_llama

    model, (ids,) = make_llama(layers=1)
    graph = lower(model, (ids,), dynamic_shapes=({1: torch.export.Dim("seq", min=2, max=30)},))
    res = optimize(graph, "cpu", k=2)
    assert res.candidates[0].op_counts().get("attention") == 1
    for n in (3, 11):
        x = np.random.default_rng(n).integers(0, 128, (1, n))
        with torch.no_grad():
            want = model(torch.from_numpy(x)).numpy()
        for cand in res.candidates:
            np.testing.assert_allclose(run(cand, [x])[0], want, rtol=1e-4, atol=1e-4)


class _Softmax(nn.Module):
    """Softmax over the last axis, spelled as people write it by hand."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shift = {"amax": lambda: torch.amax(x, dim=-1, keepdim=True),
                 "max": lambda: x.max(dim=-1, keepdim=True).values,
                 "unsqueezed": lambda: torch.amax(x, dim=-1).unsqueeze(-1),
                 "none": lambda: None}[self.spelling]()
        e = torch.exp(x if shift is None else x - shift)
        return e / e.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("spelling", ["amax", "max", "unsqueezed", "none"])
def test_softmax_is_recognised_however_it_is_spelled(spelling):
    x = torch.randn(3, 4, 16)
    model = _Softmax(spelling)
    graph = lower(model, (x,))
    best = optimize(graph, "cpu", k=2).candidates[0]
    assert best.op_counts() == {"input": 1, "softmax": 1}
    np.testing.assert_allclose(run(best, [x.numpy()])[0], torch.softmax(x, -1).numpy(), rtol=1e-5, atol=1e-6)
