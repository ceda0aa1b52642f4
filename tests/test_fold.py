"""Compile-time folding (eclat.rewrites.fold): weight-only values computed once, equal to the graph
they replace, nothing that an input reaches folded, sizes bounded, and a compiled `W * scale`
reading one folded weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import eclat
from eclat.compiler import pipeline
from eclat.ir import graph as g
from eclat.ir.dtypes import DType
from eclat.ir.graph import Graph, Node
from eclat.ir.interpreter import run
from eclat.rewrites.composites import matmul
from eclat.rewrites.fold import SLACK_BYTES, fold_weights

F32 = DType.float32


def _weights(rng: np.random.Generator, **shapes: tuple[int, ...]
             ) -> tuple[dict[str, np.ndarray], dict[str, Node]]:
    arrays = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    return arrays, {k: g.weight(k, a, F32) for k, a in arrays.items()}


def _t(x: Node) -> Node:
    return g.movement(x, lambda v: v.permute([1, 0]))


def _linear(x: Node, w: Node) -> Node:
    """x [m, k] @ w.T for w [n, k], as the frontend writes it (a sum of an expanded product)."""
    m, k = x.shape
    n = w.shape[0]
    xe = g.movement(x, lambda v: v.reshape((m, 1, k)).expand((m, n, k)))
    we = g.movement(w, lambda v: v.reshape((1, n, k)).expand((m, n, k)))
    return g.reduce("sum", g.binary("mul", xe, we), -1)


def _scaled_linear(seed: int) -> Graph:
    """y = x @ (w * scale).T + b: w * scale folds, the bias stays a broadcast view."""
    arrays, w = _weights(np.random.default_rng(seed), w=(6, 5), scale=(6, 1), b=(6,))
    x = g.input_("x", (3, 5))
    scaled = g.binary("mul", w["w"], g.expand_to(w["scale"], (6, 5)))
    return Graph([x], [g.binary("add", _linear(x, scaled), g.expand_to(w["b"], (3, 6)))], arrays)


def _lora(seed: int, d: int = 64, r: int = 2) -> Graph:
    """y = x @ (W + A @ B) and z = x @ (A @ B): the first folds whole, the second's product is
    d*d from 2*d*r weights and must not."""
    arrays, w = _weights(np.random.default_rng(seed), W=(d, d), A=(d, r), B=(r, d))
    x = g.input_("x", (4, d))
    ab = matmul(w["A"], w["B"])
    return Graph([x], [matmul(x, g.binary("add", w["W"], ab)), matmul(x, ab)], arrays)


def _batchnorm(seed: int) -> Graph:
    """(x - mean) * (gamma / sqrt(var + eps)) + beta over [n, c, h, w], every statistic expanded first."""
    rng = np.random.default_rng(seed)
    arrays, w = _weights(rng, mean=(4,), gamma=(4,), beta=(4,))
    arrays["var"] = rng.uniform(0.5, 1.5, 4).astype(np.float32)
    var = g.weight("var", arrays["var"], F32)
    full = (2, 4, 3, 3)

    def chan(n: Node) -> Node:
        return g.movement(n, lambda v: v.reshape((1, 4, 1, 1)).expand(full))

    x = g.input_("x", full)
    eps = g.expand_to(g.const(1e-5), full)
    inv_std = g.unary("recip", g.unary("sqrt", g.binary("add", chan(var), eps)))
    scale = g.binary("mul", inv_std, chan(w["gamma"]))
    centred = g.binary("add", x, g.unary("neg", chan(w["mean"])))
    return Graph([x], [g.binary("add", g.binary("mul", centred, scale), chan(w["beta"]))], arrays)


def _misc(seed: int) -> Graph:
    """A constant transpose of a computed value, a long reduction, scalar arithmetic on constants,
    casts, a causal mask from iota, and a weight-only output."""
    arrays, w = _weights(np.random.default_rng(seed), p=(5, 7), q=(5, 7), v=(1000,))
    x = g.input_("x", (7, 5))
    pq_t = _t(g.binary("mul", w["p"], w["q"]))  # [7, 5], read transposed
    six = g.binary("mul", g.const(2.0), g.const(3.0))
    total = g.binary("mul", g.reduce("sum", w["v"], 0), six)
    y = g.binary("mul", g.binary("add", x, pq_t), g.expand_to(total, (7, 5)))
    half = g.cast(g.cast(w["p"], DType.float16), F32)  # rounded to float16 on the way
    z = g.binary("add", _t(x), half)
    i = g.iota(5)
    upper = g.binary("lt", g.movement(i, lambda v: v.reshape((5, 1)).expand((5, 5))),
                     g.movement(i, lambda v: v.reshape((1, 5)).expand((5, 5))))
    corner = g.movement(x, lambda v: v.shrink([(0, 5), (0, 5)]))
    masked = g.where(upper, corner, g.expand_to(g.const(0.0), (5, 5)))
    return Graph([x], [y, z, masked, g.unary("neg", w["v"])], arrays)


GRAPHS = {"scaled_linear": _scaled_linear, "lora": _lora, "batchnorm": _batchnorm, "misc": _misc}


def _runtime_ops(graph: Graph) -> list[str]:
    """The ops of every value an input reaches, sorted."""
    reached: set[int] = set()
    for n in graph.nodes():
        if n.op == "input" or any(id(s) in reached for s in n.srcs):
            reached.add(id(n))
    return sorted(n.op for n in graph.nodes() if id(n) in reached)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("name", list(GRAPHS))
def test_folded_graph_computes_the_same(name, seed):
    graph = GRAPHS[name](seed)
    folded = fold_weights(graph)
    rng = np.random.default_rng(100 + seed)
    inputs = [rng.standard_normal([int(d) for d in n.shape]).astype(np.float32) for n in graph.inputs]
    for got, want in zip(run(folded, inputs), run(graph, inputs)):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert _runtime_ops(folded) == _runtime_ops(graph)  # nothing an input reaches was folded
    assert folded is not graph and set(folded.weights) != set(graph.weights)


def test_w_times_scale_folds_into_one_weight_and_the_bias_stays_a_view():
    graph = _scaled_linear(0)
    folded = fold_weights(graph)
    weights = {n.arg: n for n in folded.nodes() if n.op == "weight"}
    assert sorted(weights) == ["b", "mul(scale,w)"] and sorted(folded.weights) == sorted(weights)
    np.testing.assert_array_equal(folded.weights["mul(scale,w)"], graph.weights["w"] * graph.weights["scale"])
    assert _runtime_ops(folded).count("mul") == 1  # x * W' only


def test_an_input_dependent_graph_is_left_alone():
    arrays, w = _weights(np.random.default_rng(0), w=(3, 4))
    x = g.input_("x", (3, 4))
    graph = Graph([x], [g.binary("mul", g.binary("add", x, w["w"]), g.movement(w["w"], lambda v: v))], arrays)
    assert fold_weights(graph) is graph


def test_size_bound_keeps_a_low_rank_product_alone_but_folds_w_plus_it():
    d, r = 64, 2  # A @ B alone: 16 KiB from 1 KiB of weights; W + A @ B: 16 KiB from 17 KiB
    graph = _lora(0, d, r)
    folded = fold_weights(graph)
    whole, alone = folded.outputs
    assert whole.srcs[1].op == "weight" and whole.srcs[1].arg == "add(A,B,W)"
    a, b, w = (graph.weights[k].astype(np.float64) for k in "ABW")
    np.testing.assert_array_equal(folded.weights["add(A,B,W)"], (w + a @ b).astype(np.float32))
    assert alone.srcs[1].op == "matmul" and d * d * 4 > (2 * d * r) * 4 + SLACK_BYTES
    for name, array in folded.weights.items():  # the bound, for every folded weight
        if name not in graph.weights:
            assert array.nbytes <= sum(a.nbytes for a in graph.weights.values()) + SLACK_BYTES


def test_broadcast_values_are_stored_once_and_read_through_views():
    graph = _batchnorm(0)
    folded = fold_weights(graph)
    new = {k: a for k, a in folded.weights.items() if k not in graph.weights}
    assert new and all(a.shape == (4,) for a in new.values())  # per channel, not [2, 4, 3, 3]
    assert set(folded.weights) >= {"beta"} and "var" not in folded.weights and "gamma" not in folded.weights
    assert not {"sqrt", "recip"} & set(folded.op_counts())
    var, gamma = graph.weights["var"].astype(np.float64), graph.weights["gamma"].astype(np.float64)
    expect = (np.reciprocal(np.sqrt(var + np.float64(np.float32(1e-5)))) * gamma).astype(np.float32)
    np.testing.assert_array_equal(new["mul(gamma,var)"], expect)
    np.testing.assert_array_equal(new["neg(mean)"], -graph.weights["mean"])


def test_reductions_in_float64_casts_rounding_scalars_constants_and_iota():
    graph = _misc(0)
    folded = fold_weights(graph)
    consts = [n.arg[0] for n in folded.nodes() if n.op == "const"]
    assert float(np.float32(np.sum(graph.weights["v"].astype(np.float64)) * 6.0)) in consts
    assert 2.0 not in consts and 3.0 not in consts  # sum(v) * (2 * 3) is one constant
    p, q = graph.weights["p"], graph.weights["q"]
    np.testing.assert_array_equal(folded.weights["cast(p)"], p.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(folded.weights["lt(iota)"], np.triu(np.ones((5, 5), bool), 1))
    np.testing.assert_array_equal(folded.weights["mul(p,q)"], (p * q).T)  # laid out as it is read
    assert folded.outputs[3].op == "weight"  # a weight-only output is a weight (copied out)
    assert {"p", "q", "v"}.isdisjoint(folded.weights)


def test_identical_folds_share_one_weight():
    arrays, w = _weights(np.random.default_rng(0), a=(4, 4), b=(4, 4))
    x = g.input_("x", (4, 4))
    one, two = g.binary("mul", w["a"], w["b"]), g.binary("mul", w["a"], w["b"])
    graph = Graph([x], [g.binary("add", g.binary("add", x, one), two)], arrays)
    folded = fold_weights(graph)
    assert list(folded.weights) == ["mul(a,b)"]
    assert sum(1 for n in folded.nodes() if n.op == "weight") == 1


class Scaled(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d ** 0.5)
        self.scale = nn.Parameter(torch.rand(d, 1) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.w * self.scale).T


def test_compiled_w_times_scale_reads_one_folded_weight():
    torch.manual_seed(0)
    model, x = Scaled().eval(), torch.randn(4, 32)
    compiled = eclat.compile(model, (x,), target="cpu", autotune="none", quiet=True)
    program = compiled.executable.program
    weights = {b.name for b in program.buffers.values() if b.role == "weight"}
    # (a candidate whose folded value differs from another's is named apart: #2)
    assert any(n.startswith("w_mul(scale,w)") for n in weights) and all("mul(scale,w)" in n for n in weights)
    read = {name for k in program.kernels for name in _reads(k)}
    assert read and all(name.startswith("in") or "mul(scale,w)" in name for name in read)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def _reads(kernel) -> set[str]:
    from eclat.compiler.kernel import loads

    return {x.buffer for x in loads(kernel.body)}


def test_every_candidate_is_folded():
    graph = _scaled_linear(0)
    candidates, _ = pipeline._candidates(graph, "cpu", 4)
    assert candidates
    for cand in candidates:
        names = {n.arg for n in cand.nodes() if n.op == "weight"}
        # candidates share the folded values they agree on; one that differs is named apart (#2)
        assert "w" not in names and "scale" not in names and any(n.startswith("mul(scale,w)") for n in names)


def test_a_weight_read_at_a_symbolic_position_is_left_to_run_time():
    from eclat.ir.symbolic import Var
    from eclat.ir.view import View

    s = Var("s", 1, 8)
    arrays, w = _weights(np.random.default_rng(0), table=(8, 4))
    x = g.input_("x", (s, 4))
    last = g.view(w["table"], View.make((1, 4), (4, 1), (s - 1) * 4))  # the row at the input's length
    squared = g.binary("mul", last, last)
    graph = Graph([x], [g.binary("add", x, g.movement(squared, lambda v: v.expand((s, 4))))], arrays)
    assert fold_weights(graph) is graph
    x5 = np.ones((5, 4), np.float32)
    np.testing.assert_array_equal(run(graph, [x5])[0], np.broadcast_to(1 + arrays["table"][4] ** 2, (5, 4)))


def test_a_comparison_sees_its_operands_as_the_program_holds_them():
    """1 + 2**-30 is 1 in float32: a fold computing the sum in float64 must round it before
    comparing, or the mask flips."""
    arrays = {"one": np.ones(4, np.float32), "tiny": np.full(4, 2.0 ** -30, np.float32)}
    one, tiny = (g.weight(k, a, F32) for k, a in arrays.items())
    x = g.input_("x", (4,))
    above = g.binary("lt", g.expand_to(g.const(1.0), (4,)), g.binary("add", one, tiny))
    graph = Graph([x], [g.where(above, x, g.expand_to(g.const(0.0), (4,)))], arrays)
    folded = fold_weights(graph)
    assert folded is not graph and "one" not in folded.weights
    ones = np.ones(4, np.float32)
    np.testing.assert_array_equal(run(folded, [ones])[0], run(graph, [ones])[0])
    np.testing.assert_array_equal(run(folded, [ones])[0], np.zeros(4, np.float32))


def test_a_folded_broadcast_read_through_a_symbolic_view():
    """b1 + b2 computed at [3, 4] repeats along rows (stored once, read through a view), but a
    view over it that only the run time sizes needs it whole: two views do not compose."""
    from eclat.ir.symbolic import Var

    s = Var("s", 1, 8)
    arrays, w = _weights(np.random.default_rng(0), b1=(4,), b2=(4,))
    x = g.input_("x", (s, 3, 4))
    total = g.binary("add", g.expand_to(w["b1"], (3, 4)), g.expand_to(w["b2"], (3, 4)))
    spread = g.movement(total, lambda v: v.reshape((1, 3, 4)).expand((s, 3, 4)))
    graph = Graph([x], [g.binary("add", x, spread), g.binary("mul", total, total)], arrays)
    folded = fold_weights(graph)
    assert {k: a.shape for k, a in folded.weights.items()} == {"add(b1,b2)": (3, 4), "mul(b1,b2)": (4,)}
    xs = np.random.default_rng(1).standard_normal((5, 3, 4)).astype(np.float32)
    for got, want in zip(run(folded, [xs]), run(graph, [xs])):
        np.testing.assert_allclose(got, want, rtol=1e-6)


class LoRALinear(nn.Module):
    """A Linear with a rank-r adapter, as peft writes it: base(x) + B(A(x)) * scaling."""

    def __init__(self, d: int, r: int, bias: bool):
        super().__init__()
        self.base = nn.Linear(d, d, bias=bias)
        self.lora_a, self.lora_b = nn.Linear(d, r, bias=False), nn.Linear(r, d, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)
        self.scaling = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x)) * self.scaling


@pytest.mark.parametrize("bias", [False, True])
def test_a_lora_adapter_runs_as_one_gemm(bias):
    """x @ W' + (x @ A') @ B' * s is x @ (W' + s A' B'): the extraction sees that the weight-only
    sum folds (and the rank-r product under it with it), so the e-graph's first candidate is one
    GEMM, with the bias as its epilogue. (The measured search may still pick a 3-GEMM candidate:
    at batch 16 the rank-8 products cost 1.6% of the GEMM, within timing noise.)"""
    from eclat.frontend import lower

    torch.manual_seed(0)
    d, r = 256, 8
    model, x = LoRALinear(d, r, bias).eval(), torch.randn(16, d)
    first = pipeline._candidates(lower(model, (x,)), "cpu", 4)[0][0]
    weights = [n for n in first.nodes() if n.op == "weight"]
    assert first.op_counts()["matmul"] == 1 and len(weights) == 1 + bias
    compiled = eclat.compile(model, (x,), target="cpu", autotune="none", k=1, quiet=True)
    kernels = compiled.compile_report.kernels
    assert len(kernels) == 1 and 2 * 16 * d * d <= kernels[0].flops < 2 * 16 * d * d + 4 * 16 * d
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("product", [_linear, lambda x, w: matmul(x, _t(w))])
def test_a_uniform_weight_a_product_reads_is_stored_whole(product):
    """w * scale with a scale of zeros (timm's zero-initialised last BatchNorm, folded into the
    convolution before it) is one number; folded to a constant the product was no contraction and
    ran as loops over a broadcast (gernet_s: a third of its time). A product's operand is stored
    whole (it costs no more than w); a uniform value nothing multiplies stays a constant."""
    arrays, w = _weights(np.random.default_rng(0), w=(6, 5))
    np.abs(arrays["w"], out=arrays["w"])  # no -0.0 in w * 0: one number, bit for bit
    arrays["zeros"] = np.zeros((6, 1), np.float32)
    zeros = g.weight("zeros", arrays["zeros"], F32)
    x = g.input_("x", (3, 5))
    scaled = g.binary("mul", w["w"], g.expand_to(zeros, (6, 5)))
    shift = g.reduce("sum", g.binary("mul", zeros, zeros), 1)  # weight-only, uniform, no product reads it
    graph = Graph([x], [product(x, scaled), shift], arrays)
    folded = fold_weights(graph)
    xs = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    for got, want in zip(run(folded, [xs]), run(graph, [xs])):
        np.testing.assert_array_equal(got, want)
    stored = [n for n in folded.nodes() if n.op == "weight" and n.arg not in ("w", "zeros")]
    assert [sorted(n.shape) for n in stored] == [[5, 6]]  # the product's operand, whole
    assert folded.outputs[1].op != "weight" and not any(n.op == "weight" for n in _reach(folded.outputs[1]))


def _reach(n: Node) -> list[Node]:
    out, stack = [], [n]
    while stack:
        m = stack.pop()
        out.append(m)
        stack.extend(m.srcs)
    return out
