"""The primitive IR: constructors' shape and dtype rules, graphs, composites, and the
reference interpreter's semantics where they differ from plain numpy."""

from __future__ import annotations

import numpy as np
import pytest

from eclat.ir import graph as g
from eclat.ir.dtypes import DType, from_numpy, round_bfloat16
from eclat.ir.graph import Graph
from eclat.ir.interpreter import run
from eclat.ir.symbolic import Var


def _run1(node: g.Node, inputs: list[g.Node] = (), arrays: list[np.ndarray] = (), weights=None) -> np.ndarray:
    return run(Graph(list(inputs), [node], weights or {}), list(arrays))[0]


def test_binary_ops_need_equal_shapes_and_dtypes() -> None:
    a, b = g.input_("a", (2, 3)), g.input_("b", (3,))
    with pytest.raises(ValueError, match="broadcast with an expand view first"):
        g.binary("add", a, b)
    with pytest.raises(TypeError, match="dtypes differ"):
        g.binary("add", a, g.input_("c", (2, 3), DType.int32))
    with pytest.raises(TypeError, match=r"where needs \(bool, T, T\)"):
        g.where(a, a, a)
    with pytest.raises(TypeError, match="needs a floating-point operand"):
        g.unary("exp2", g.input_("i", (2,), DType.int64))
    with pytest.raises(TypeError, match="gather indices must be integers"):
        g.gather(a, a)
    assert g.binary("lt", a, a).dtype is DType.bool


def test_reduce_removes_its_axis_and_checks_range() -> None:
    x = g.input_("x", (2, 3, 4))
    assert g.reduce("sum", x, -1).shape == (2, 3) and g.reduce("sum", x, -1).arg == 2
    with pytest.raises(ValueError, match="axis 3 out of range"):
        g.reduce("sum", x, 3)


def test_views_compose_and_fall_back_to_contiguous() -> None:
    x = g.input_("x", (2, 3))
    t = g.movement(x, lambda v: v.permute([1, 0]))
    tt = g.movement(t, lambda v: v.permute([1, 0]))
    assert tt is x  # the identity view is the source itself
    flat = g.movement(t, lambda v: v.reshape((6,)))
    assert flat.op == "view" and flat.srcs[0].op == "contiguous"
    with pytest.raises(ValueError, match="a view's source is never a view"):
        g.view(t, t.arg)
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(_run1(flat, [x], [a]), a.T.reshape(-1))


def test_expand_to_broadcasts_like_numpy() -> None:
    x = g.input_("x", (3, 1))
    e = g.expand_to(x, (2, 3, 4))
    a = np.arange(3, dtype=np.float32).reshape(3, 1)
    np.testing.assert_array_equal(_run1(e, [x], [a]), np.broadcast_to(a, (2, 3, 4)))
    with pytest.raises(ValueError, match="cannot broadcast"):
        g.expand_to(g.input_("y", (2, 2, 2)), (2, 2))


def test_interpreter_semantics() -> None:
    i = g.input_("i", (4,), DType.int32)
    j = g.input_("j", (4,), DType.int32)
    a, b = np.array([7, -7, 7, 5], np.int32), np.array([3, 3, -3, 0], np.int32)
    np.testing.assert_array_equal(_run1(g.binary("mod", i, j), [i, j], [a, b]), [1, -1, 1, 0])  # C, x % 0 = 0
    table = g.input_("t", (3, 2))
    idx = g.input_("k", (4,), DType.int64)
    t = np.arange(6, dtype=np.float32).reshape(3, 2)
    got = _run1(g.gather(table, idx), [table, idx], [t, np.array([0, 2, -5, 9])])
    np.testing.assert_array_equal(got, t[[0, 2, 0, 2]])  # out-of-range indices are clamped
    empty, zeros = g.input_("e", (2, 0)), np.zeros((2, 0), np.float32)
    np.testing.assert_array_equal(_run1(g.reduce("max_reduce", empty, 1), [empty], [zeros]), [-np.inf] * 2)
    np.testing.assert_array_equal(_run1(g.reduce("sum", empty, 1), [empty], [zeros]), [0, 0])


@pytest.mark.parametrize("reduction", ["sum", "max_reduce"])
def test_a_large_product_read_only_by_a_reduction_is_made_in_slabs(reduction, monkeypatch) -> None:
    """A matmul written as a sum of products ([3, 1000, 5000] of them, 60 MB here; GPT-2's output
    head 154 MB, its compile's peak) is made and reduced a slab at a time: the same values, bit for
    bit, while at most a slab and a few of its reductions are held at once."""
    import tracemalloc

    from eclat.ir import interpreter

    rng = np.random.default_rng(0)
    x, w = g.input_("x", (3, 1000)), rng.standard_normal((1000, 5000)).astype(np.float32)
    xe = g.movement(x, lambda v: v.reshape((3, 1000, 1)).expand((3, 1000, 5000)))
    we = g.movement(g.weight("w", w, DType.float32),
                    lambda v: v.reshape((1, 1000, 5000)).expand((3, 1000, 5000)))
    graph = Graph([x], [g.reduce(reduction, g.binary("mul", xe, we), 1)], {"w": w})
    xs = rng.standard_normal((3, 1000)).astype(np.float32)
    slab = 4 << 20
    monkeypatch.setattr(interpreter, "SLAB_BYTES", slab)
    tracemalloc.start()
    slabbed = run(graph, [xs])[0]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    monkeypatch.setattr(interpreter, "SLAB_BYTES", 1 << 40)
    whole = run(graph, [xs])[0]
    np.testing.assert_array_equal(slabbed, whole)
    assert peak < 4 * slab < 60e6
    if reduction == "sum":
        np.testing.assert_allclose(whole, xs @ w, rtol=1e-4, atol=1e-3)


def test_casts_and_dtypes() -> None:
    x = g.input_("x", (3,))
    out = _run1(g.cast(x, DType.int32), [x], [np.array([1.7, -1.7, 2.0], np.float32)])
    assert out.dtype == np.int32 and out.tolist() == [1, -1, 2]  # truncation
    assert g.cast(x, DType.float32) is x
    bf = _run1(g.cast(x, DType.bfloat16), [x], [np.array([1 + 2**-9, 3.0, 1 + 3 * 2**-9], np.float32)])
    assert bf.tolist() == [1.0, 3.0, 1 + 2**-7]  # nearest, ties to even
    assert round_bfloat16(np.array([1.0], np.float32)).tolist() == [1.0]
    assert from_numpy(np.dtype("int64")) is DType.int64
    with pytest.raises(TypeError, match="no dtype for numpy float64"):
        from_numpy(np.dtype("float64"))


def test_graph_order_sharing_and_counts() -> None:
    x = g.input_("x", (2,))
    w = g.weight("w", np.ones(2, np.float32), DType.float32)
    s = g.binary("add", x, w)
    out = g.binary("mul", s, s)
    graph = Graph([x], [out, s], {"w": np.ones(2, np.float32)})
    order = graph.nodes()
    assert order.index(s) < order.index(out) and len(order) == 4
    assert graph.op_counts() == {"input": 1, "weight": 1, "add": 1, "mul": 1}
    got = run(graph, [np.array([1.0, 2.0], np.float32)])
    assert got[0].tolist() == [4.0, 9.0] and got[1].tolist() == [2.0, 3.0]
    with pytest.raises(ValueError, match="expected 1 inputs, got 0"):
        run(graph, [])
    assert "return" in str(graph)


def test_symbolic_input_sizes_bind_from_arrays() -> None:
    n = Var("n", 1, 100)
    x = g.input_("x", (n, 3))
    out = g.reduce("sum", g.iota(n, DType.int32), 0)
    graph = Graph([x], [g.reduce("sum", x, 0), out], {})
    for rows in (2, 7):
        s, total = run(graph, [np.ones((rows, 3), np.float32)])
        assert s.tolist() == [rows] * 3 and int(total) == rows * (rows - 1) // 2


def test_affine_symbolic_input_sizes_bind() -> None:
    n = Var("n", 1, 100)
    x = g.input_("x", (n * 2 + 1,))
    (out,) = run(Graph([x], [g.reduce("sum", g.iota(n, DType.int32), 0)], {}), [np.ones(9, np.float32)])
    assert int(out) == sum(range(4))


def test_composites_decompose_to_primitives() -> None:
    def square_numpy(node, a):
        return a * a

    def square_decompose(node):
        return g.binary("mul", node.srcs[0], node.srcs[0])

    g.register("test_square", "composite", square_numpy, decompose=square_decompose)
    try:
        _check_square_composite()
    finally:  # OPS is global: other tests may enumerate it
        del g.OPS["test_square"]
    with pytest.raises(ValueError, match="needs a decomposition"):
        g.register("test_bad", "composite", square_numpy)
    assert "test_bad" not in g.OPS


def _check_square_composite() -> None:
    x = g.input_("x", (3,))
    sq = g.Node("test_square", (x,), None, x.shape, x.dtype)
    graph = Graph([x], [g.binary("add", sq, x)], {})
    flat = g.decompose_composites(graph)
    assert "test_square" not in flat.op_counts() and flat.op_counts()["mul"] == 1
    assert "test_square" in g.decompose_composites(graph, keep={"test_square"}).op_counts()
    a = np.array([1.0, 2.0, -3.0], np.float32)
    np.testing.assert_array_equal(run(graph, [a])[0], run(flat, [a])[0])


def test_the_interpreter_frees_each_value_after_its_last_reader() -> None:
    import tracemalloc

    x = g.input_("x", (1 << 18,))  # 1 MiB of float32
    node, nodes = x, []
    for _ in range(12):
        node = g.unary("exp2", g.unary("neg", node))
        nodes.append(node)
    graph = Graph([x], [node, nodes[0]], {})  # an intermediate that is also an output is kept
    a = np.random.default_rng(0).standard_normal(1 << 18).astype(np.float32) * 0.1
    tracemalloc.start()
    try:
        got = run(graph, [a])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 6 << 20  # 24 intermediates of 1 MiB if none were freed
    want, first = a, None
    for k in range(12):
        want = np.exp2(-want)
        first = want if k == 0 else first
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    np.testing.assert_allclose(got[1], first, rtol=1e-6)


def test_division_of_a_nested_sum_drops_the_terms_it_divides() -> None:
    """A flat index divided by the strides of a reshape, (i0 * 614656 + i1 * 392 + i2) // 7 % 7,
    keeps only the term the divisor does not divide: (i2 // 7) % 7, its value the same at every
    point (checked exhaustively on a grid of random sums of non-negative terms)."""
    import random

    from eclat.ir.symbolic import evaluate, floordiv, mod

    i0, i1, i2 = Var("i0", 0, 3), Var("i1", 0, 9), Var("i2", 0, 391)
    flat = i0 * 614656 + i1 * 392 + i2
    assert str(mod(floordiv(flat, 7), 7)) == "((i2 / 7) % 7)" and str(mod(flat, 7)) == "(i2 % 7)"
    assert str(mod(floordiv(flat, 49), 8)) == "(i2 / 49)"
    rng = random.Random(0)
    a, b, c = Var("a", 0, 5), Var("b", 0, 6), Var("c", 0, 40)
    points = {"a": np.arange(6)[:, None, None], "b": np.arange(7)[None, :, None],
              "c": np.arange(41)[None, None, :]}
    for _ in range(200):
        d = rng.choice([2, 3, 4, 6, 7, 8, 12])
        e = a * (d * rng.randint(0, 9)) + b * rng.choice([d * rng.randint(1, 5), rng.randint(1, 20)]) + c \
            + rng.randint(0, 30)
        value = evaluate(e, points)
        for got, want in ((floordiv(e, d), value // d), (mod(e, d), value % d),
                          (mod(floordiv(e, d), 5), value // d % 5)):
            same = np.broadcast_to(evaluate(got, points), want.shape)
            np.testing.assert_array_equal(same, want, err_msg=str(e))
