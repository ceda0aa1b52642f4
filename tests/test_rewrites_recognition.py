"""Recognition on what the frontend emits: one-hot products as gathers, layer norm, attention
(scaled_dot_product_attention's safe softmax and a normalisation after the product included)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import eclat
from eclat.frontend.lower import lower
from eclat.ir import graph as g
from eclat.ir.graph import Graph
from eclat.ir.interpreter import run
from eclat.rewrites import composites, optimize


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
    assert best.get("attend") == 2 and "softmax" not in best  # both layers' attention, one pass each
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
    assert res.candidates[0].op_counts().get("attend") == 1
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


class _Sdpa(nn.Module):
    """Attention spelled as torch's scaled_dot_product_attention (no mask, causal, a boolean or an
    additive mask, an explicit scale), by hand, or normalised after the product with v."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def forward(self, q, k, v, mask):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        s = q @ k.transpose(-1, -2) / 8
        return {
            "plain": lambda: sdpa(q, k, v),
            "causal": lambda: sdpa(q, k, v, is_causal=True),
            "boolmask": lambda: sdpa(q, k, v, attn_mask=mask > 0, scale=0.3),
            "addmask": lambda: sdpa(q, k, v, attn_mask=mask),
            "hand": lambda: torch.softmax(s + mask, -1) @ v,
            "late": lambda: (torch.exp(s) @ v) / torch.exp(s).sum(-1, keepdim=True),
            "late-max": lambda: (torch.exp(s - s.amax(-1, keepdim=True)) @ v)
            / torch.exp(s - s.amax(-1, keepdim=True)).sum(-1, keepdim=True),
        }[self.kind]()


SDPA = ("plain", "causal", "boolmask", "addmask")


def _sdpa_inputs(seed: int, big: bool = False) -> tuple[torch.Tensor, ...]:
    """q, k, v [1, 4, 16, 64] and a [16, 16] mask whose row 3 is masked throughout (boolean: no
    entry above 0; additive: -inf); big: scores around 1e4 (torch's softmax subtracts the row max)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 4, 16, 64, generator=gen) for _ in range(3))
    if big:
        q, k = q * 100, k * 100
    mask = torch.randn(16, 16, generator=gen)
    mask[3] = -math.inf
    return q, k, v, mask


@pytest.mark.parametrize("kind", [*SDPA, "hand", "late", "late-max"])
def test_attention_however_it_is_spelled(kind: str):
    model = _Sdpa(kind)
    example = _sdpa_inputs(0)
    best = optimize(lower(model, example), "cpu", k=2).candidates[0]
    counts = best.op_counts()
    assert counts["attend"] == 1 and counts["matmul"] == 1, counts  # the scores' product, then one pass
    assert not {"softmax", "exp2", "sum", "max_reduce"} & counts.keys(), counts
    (att,) = [n for n in best.nodes() if n.op == "attend"]
    assert att.arg[2] is (kind in SDPA)  # the safe softmax exactly where torch's decomposition has it
    # late: exp(s) overflows in torch where the composite subtracts the row max (as softmax does)
    cases = [_sdpa_inputs(1)] + ([] if kind == "late" else [_sdpa_inputs(2, big=True)])
    fast = eclat.compile(model, example, target="cpu", autotune="none", k=1, quiet=True)
    for args in cases:
        with torch.no_grad():
            want = model(*args)
        if kind in SDPA:  # a fully masked row is 0, not NaN
            assert not torch.isnan(want).any()
        (got,) = run(best, [a.numpy() for a in args])
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)  # NaN rows (hand) equal too
        torch.testing.assert_close(fast(*args), want, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_safe_softmax_is_torchs_and_plain_softmax_keeps_nan():
    """The composite's safe flag gives 0 on a row of -inf (torch's _safe_softmax, what the attention
    decomposition uses); without it the row is NaN, as torch.softmax has it. The numpy reference and
    the decomposition the kernels are grouped from agree on both, a NaN row and a partly masked one."""
    x = np.random.default_rng(0).standard_normal((3, 4, 6)).astype(np.float32) * 10
    x[1, 2] = -np.inf
    x[2, 0, :5] = -np.inf
    x[0, 3, :5], x[0, 3, 5] = -np.inf, np.nan  # not -inf throughout: NaN, safe or not
    node = g.input_("x", x.shape)
    for safe, torch_fn in ((False, torch.softmax), (True, torch.ops.aten._safe_softmax)):
        graph = Graph([node], [composites.softmax(node, -1, safe)], {})
        want = torch_fn(torch.from_numpy(x), -1).numpy()
        assert np.isnan(want[1, 2]).all() != safe and np.isnan(want[0, 3]).all()
        for program in (graph, g.decompose_composites(graph)):
            np.testing.assert_allclose(run(program, [x])[0], want, rtol=1e-6, atol=1e-7)


class _LateNorm(nn.Module):
    """(e @ v) / sums of e that do not line up with the product's rows: e's column sums moved into
    place, or its row sums dividing a product that reads e transposed."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, s, v):
        e = torch.exp(s)
        if self.spelling == "column sums":
            return (e @ v) / e.sum(-2, keepdim=True).transpose(-1, -2)
        return (e.transpose(-1, -2) @ v) / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("spelling", ["column sums", "transposed product"])
def test_normalisation_after_the_product_needs_the_rows_to_line_up(spelling: str):
    s, v = torch.randn(2, 8, 8), torch.randn(2, 8, 8)
    model = _LateNorm(spelling)
    best = optimize(lower(model, (s, v)), "cpu", k=2).candidates[0]
    assert not {"attend", "softmax"} & best.op_counts().keys()
    with torch.no_grad():
        want = model(s, v).numpy()
    np.testing.assert_allclose(run(best, [s.numpy(), v.numpy()])[0], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["plain", "causal", "alibi", "window", "softcap"])
@pytest.mark.parametrize("queries", [1, 7])
def test_a_softmax_contracted_with_values_is_one_pass_whatever_made_the_scores(variant: str, queries: int):
    """The e-graph derives the one-pass form (rewrites/online.py: attend) from a softmax and its
    product with values, for score variants no rule names (a mask, ALiBi, a window, tanh
    soft-capping) and for one query (decode's product, a sum over one row), and it computes what
    the model does."""
    from tests.test_attention import Scores

    _assert_one_pass(Scores(variant, queries, 24).eval(), queries)


def _assert_one_pass(model: nn.Module, queries: int) -> None:
    """The e-graph's best candidate for model over [1, 2, queries, 16] queries and 24 keys holds one
    attend and no softmax, and computes what the model does."""
    torch.manual_seed(queries)
    q, k, v = torch.randn(1, 2, queries, 16), torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    best = optimize(lower(model, (q, k, v)), "cpu", k=2).candidates[0]
    counts = best.op_counts()
    assert counts.get("attend") == 1 and "softmax" not in counts, counts
    with torch.no_grad():
        want = model(q, k, v).numpy()
    np.testing.assert_allclose(run(best, [q.numpy(), k.numpy(), v.numpy()])[0], want, rtol=1e-4, atol=1e-5)


class _ScaledProbabilities(nn.Module):
    """Probabilities scaled after the softmax, then contracted with values (a scale on either side of
    the product)."""

    def __init__(self, values_first: bool):
        super().__init__()
        self.values_first = values_first

    def forward(self, q, k, v):
        p = torch.softmax(q @ k.transpose(-1, -2) / 4.0, -1) * 0.5
        return (v.transpose(-1, -2) @ p.transpose(-1, -2)).transpose(-1, -2) if self.values_first else p @ v


@pytest.mark.parametrize("values_first, queries", [(False, 1), (False, 7), (True, 7)])
def test_probabilities_scaled_after_the_softmax_still_make_one_pass(values_first: bool, queries: int):
    """The scale moves past the product (algebra's product-scale-out), so what is left is a softmax
    contracted with values: one attend, the scale applied to its output. (Values first with one
    query is not one pass even unscaled: no rule reads that product's probabilities as rows.)"""
    _assert_one_pass(_ScaledProbabilities(values_first), queries)


def test_the_one_pass_rule_holds_for_one_row():
    """The rule's soundness check (tests/test_rewrites.py) on one query row as well: a product with
    no row axis to broadcast, which only the frontend's form has (no Matmul is recognised)."""
    import dataclasses

    from eclat.rewrites import online
    from eclat.rewrites.check import check_rule

    rule = next(r for r in online.RULES.rules if r.name == "online-softmax-product")
    res = check_rule(dataclasses.replace(rule, example=online._example(1)))
    assert res.matches >= 1 and res.rewritten >= 1 and res.worst < 1e-5, res
