"""Kernel-level tests: hand-built primitive graphs, grouped and compiled for the CPU,
against the numpy interpreter."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import numpy as np
import pytest

from eclat.backends.cpu.contraction import contraction_of
from eclat.backends.cpu.runtime import CpuExecutable
from eclat.backends.cpu.schedules import default_schedule, schedule_space
from eclat.compiler.group import group
from eclat.compiler.kernel import Reduce, Schedule, as_contraction, flops, loads, reduces, walk
from eclat.compiler.memplan import plan_memory
from eclat.ir import graph as G
from eclat.ir.dtypes import DType
from eclat.ir.interpreter import run
from eclat.ir.view import View

RNG = np.random.default_rng(0)


def compiled(graph: G.Graph, inputs: list[np.ndarray], threads: int = 1):
    program = group(graph)
    exe = CpuExecutable(program, threads)
    return program, exe.run([np.ascontiguousarray(a) for a in inputs])


def check(graph: G.Graph, inputs: list[np.ndarray], rtol: float = 1e-5, atol: float = 1e-6):
    program, outs = compiled(graph, inputs)
    for got, want in zip(outs, run(graph, inputs)):
        assert got.shape == want.shape and got.dtype == want.dtype
        if want.dtype.kind in "biu":
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    return program


def on_two_threads(program):
    """program compiled with every kernel's schedule asking for two threads."""
    for k in program.kernels:
        k.schedule = replace(k.schedule or default_schedule(k), threads=2)
    return CpuExecutable(program, threads=2)


def kernel_code(program, kern, optimised: bool = True) -> str:
    """kern's function for the host's vectors: the IR the emitter writes, or LLVM's optimised IR
    (what runs), for tests that check how a kernel is emitted. Unscheduled, it gets its default."""
    import llvmlite.ir as ir

    from eclat.backends.cpu import host
    from eclat.backends.cpu.codegen import emitter
    from eclat.backends.cpu.jit import kernel_codes

    kern.schedule = kern.schedule or default_schedule(kern)
    mod = ir.Module(name="k")
    emitter(mod, kern, program.buffers, {}, host.vector_lanes()).function("k")
    return kernel_codes([mod])[0][1] if optimised else str(mod)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def matmul(a: G.Node, b: G.Node) -> G.Node:
    (m, k), (_, n) = a.shape, b.shape
    ae = G.movement(a, lambda v: v.reshape((m, k, 1)).expand((m, k, n)))
    be = G.movement(b, lambda v: v.reshape((1, k, n)).expand((m, k, n)))
    return G.reduce("sum", G.binary("mul", ae, be), 1)


@pytest.mark.parametrize("op", ["exp2", "log2", "sin", "sqrt", "recip", "neg"])
def test_unary_float_ops_with_special_values(op):
    x = G.input_("x", (64,))
    special = np.array([0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, np.nan, 1e-40, 3e38, -200.0, 200.0, 0.5],
                       dtype=np.float32)
    data = np.concatenate([special, rand(52) * 20]).astype(np.float32)
    with np.errstate(all="ignore"):
        want = run(G.Graph([x], [G.unary(op, x)], {}), [data])[0]
    _, (got,) = compiled(G.Graph([x], [G.unary(op, x)], {}), [data])
    finite = np.isfinite(want) & (np.abs(data) < 1e4)  # sin of huge arguments is not range-reduced exactly
    np.testing.assert_allclose(got[finite], want[finite], rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.isnan(got[:12]), np.isnan(want[:12]))
    np.testing.assert_array_equal(got[:12][np.isinf(want[:12])], want[:12][np.isinf(want[:12])])



def test_exp2_is_float32_accurate_over_its_range():
    """Dense sweep: relative error a few ulp wherever the result is a normal float."""
    data = np.linspace(-125.9, 127.4, 1 << 16, dtype=np.float32)  # 2^127.5.. rounds to 2^128 * p: inf
    x = G.input_("x", data.shape)
    _, (got,) = compiled(G.Graph([x], [G.unary("exp2", x)], {}), [data])
    want = np.exp2(data.astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 4e-7


@pytest.mark.parametrize("dtype", [DType.float32, DType.int32, DType.int64])
def test_binary_ops(dtype):
    a, b = G.input_("a", (5, 7), dtype), G.input_("b", (5, 7), dtype)
    outs = [G.binary(op, a, b) for op in ("add", "mul", "mod", "lt", "max")]
    outs.append(G.where(G.binary("lt", a, b), a, b))
    if dtype.is_float:
        x, y = rand(5, 7) * 4, rand(5, 7) * 4
        x[0, :3] = [np.nan, 1.0, -np.inf]
        y[0, :3] = [1.0, np.nan, 2.0]
    else:
        x = RNG.integers(-9, 9, (5, 7)).astype(dtype.np)
        y = RNG.integers(-9, 9, (5, 7)).astype(dtype.np)
        y[0, 0] = 0  # remainder by zero is 0, as the interpreter says
    check(G.Graph([a, b], outs, {}), [x, y])


def test_casts_and_bool():
    x = G.input_("x", (6,))
    outs = [G.cast(x, DType.int32), G.cast(x, DType.bool), G.cast(G.cast(x, DType.int64), DType.float32),
            G.cast(x, DType.bfloat16), G.cast(G.cast(x, DType.bool), DType.float32),
            G.reduce("sum", G.cast(x, DType.bool), 0), G.cast(x, DType.float16)]
    check(G.Graph([x], outs, {}), [np.array([1.7, -2.5, 0.0, 3.9, -0.2, 1e3], dtype=np.float32)])


@pytest.mark.parametrize("op", ["sum", "max_reduce"])
@pytest.mark.parametrize("shape,axis", [((4, 6), 1), ((4, 6), 0), ((2, 3, 5), 1), ((3, 0), 1), ((0, 3), 0)])
def test_reductions_including_empty(op, shape, axis):
    x = G.input_("x", shape)
    check(G.Graph([x], [G.reduce(op, x, axis)], {}), [rand(*shape)])


@pytest.mark.parametrize("size", [3, 100])  # unrolled, and the vectorised loop with its remainder
def test_float_max_reduce_propagates_nan_wherever_it_sits(size):
    x = rand(8, size)
    x[0, 0] = x[1, size // 2] = x[2, size - 1] = np.nan
    x[3, :] = -np.inf
    x[4, 1] = np.inf
    x[5, 0], x[5, -1] = np.inf, -np.inf  # infinities of both signs, no NaN (the code's sum is NaN)
    x[6, ::2], x[6, 1::2] = 3e38, -3e38  # a sum that overflows both ways
    want = x.max(axis=1)
    assert np.isnan(want[:3]).all() and want[3] == -np.inf and want[4] == want[5] == np.inf
    node = G.input_("x", (8, size))
    check(G.Graph([node], [G.reduce("max_reduce", node, 1)], {}), [x])


def test_integer_and_bool_max_reduce_of_empty_axis():
    x = G.input_("x", (3, 0), DType.int32)
    check(G.Graph([x], [G.reduce("max_reduce", x, 1)], {}), [np.zeros((3, 0), np.int32)])


def test_reduce_of_reduce_along_other_axes():
    x = G.input_("x", (5, 6, 7))
    inner = G.reduce("sum", x, 2)
    outer = G.reduce("max_reduce", G.unary("exp2", inner), 0)
    check(G.Graph([x], [outer], {}), [rand(5, 6, 7)])


def test_column_sum_read_per_row_is_materialised():
    x = G.input_("x", (8, 9))
    col = G.reduce("sum", x, 0)
    out = G.binary("mul", x, G.expand_to(col, (8, 9)))
    program = check(G.Graph([x], [out], {}), [rand(8, 9)])
    assert len(program.kernels) == 2


def test_each_product_of_a_chain_gets_a_kernel_and_the_last_keeps_its_epilogue():
    x = G.input_("x", (5, 8))
    h, inputs = x, [x]
    for k, (m, n) in enumerate([(8, 12), (12, 12), (12, 6)]):
        w, b = G.input_(f"w{k}", (m, n)), G.input_(f"b{k}", (n,))
        inputs += [w, b]
        row = G.movement(b, lambda v, n=n: v.reshape((1, n)))
        h = G.binary("add", matmul(h, w), G.expand_to(row, (5, n)))
        h = G.unary("exp2", h) if k < 2 else h
    graph = G.Graph(inputs, [h], {})
    program = check(graph, [rand(*n.shape) * 0.3 for n in inputs], rtol=1e-4, atol=1e-5)
    products = [k for k in program.kernels if any(isinstance(r, Reduce) for r in walk(k.body))]
    assert len(products) == 3 and all(sum(isinstance(r, Reduce) for r in walk(k.body)) == 1 for k in products)
    assert products[-1] is program.kernels[-1]  # the output's bias is added where its product is computed


def rows(x: G.Node, cols: int) -> G.Node:
    """A per-row value [R] broadcast to [R, cols]."""
    return G.expand_to(G.movement(x, lambda v: v.reshape((x.shape[0], 1))), (x.shape[0], cols))


def test_layer_norm_row_is_one_kernel():
    x = G.input_("x", (6, 33))
    inv_n = G.expand_to(G.const(1 / 33), (6,))
    mean = G.binary("mul", G.reduce("sum", x, 1), inv_n)
    xc = G.binary("add", x, G.unary("neg", rows(mean, 33)))
    var = G.binary("mul", G.reduce("sum", G.binary("mul", xc, xc), 1), inv_n)
    out = G.binary("mul", xc, rows(G.unary("recip", G.unary("sqrt", var)), 33))
    program = check(G.Graph([x], [out], {}), [rand(6, 33) * 3], rtol=1e-4, atol=1e-5)
    assert len(program.kernels) == 1


def test_softmax_reductions_are_hoisted():
    """max and sum run once per row; exp2 is costly enough to be stored once rather
    than computed twice, so softmax is two kernels, never one per reduction."""
    x = G.input_("x", (6, 33))
    m = G.reduce("max_reduce", x, 1)
    e = G.unary("exp2", G.binary("add", x, G.unary("neg", rows(m, 33))))
    s = G.reduce("sum", e, 1)
    out = G.binary("mul", e, rows(G.unary("recip", s), 33))
    program = check(G.Graph([x], [out], {}), [rand(6, 33) * 3])
    assert len(program.kernels) == 2
    assert flops(program.kernels[0]) < 6 * 33 * 20


def test_exp_of_a_row_minus_its_max_skips_the_overflow_clamp_only_there():
    """exp2(x - max(x)) cannot overflow, so it is emitted without the upper clamp, extreme rows
    included; exp2(x - max(y)) can, and keeps the clamp (inf where x - max(y) > 128)."""
    x, y = G.input_("x", (6, 40)), G.input_("y", (6, 40))

    def minus_max(of: G.Node) -> G.Node:
        return G.binary("add", x, G.unary("neg", rows(G.reduce("max_reduce", of, 1), 40)))
    own = G.unary("exp2", G.binary("mul", minus_max(x), G.expand_to(G.const(1.4426950408889634), (6, 40))))
    other = G.unary("exp2", minus_max(y))
    xs, ys = rand(6, 40) * 30, rand(6, 40)
    xs[0, 3], xs[1, :], xs[2, 5], xs[3, 7], xs[4, 9] = 1e30, -np.inf, np.inf, np.nan, -1e30
    xs[5, :] = 200.0
    ys[5, :] = 0.0
    for out, clamped in ((own, False), (other, True)):
        graph = G.Graph([x, y], [out], {})
        check(graph, [xs, ys])
        ir_text = CpuExecutable(group(graph), 1).module.text()
        assert ("eclat_exp2_nonpositivef" in ir_text) is not clamped
    assert np.isinf(run(G.Graph([x, y], [other], {}), [xs, ys])[0][5]).all()


def test_a_softmax_over_huge_scaled_scores_stays_finite():
    """softmax(q @ q.T * 0.7) with scores near 1e10: the scaled score is computed once for the row
    max and again for the exponent. LLVM's contraction fused one evaluation into a multiply-add
    and not the other, so x - max came out ulps above 0 and exp overflowed (NaN rows, found by
    fuzzing). Only a sum of products contracts now, the same way everywhere."""
    import torch

    import eclat

    class ScaledSoftmax(torch.nn.Module):
        def forward(self, q):
            return torch.softmax((q @ q.transpose(-1, -2)) * 0.7, -1)

    model = ScaledSoftmax()
    compiled = eclat.compile(model, (torch.randn(8, 4),), autotune="none", quiet=True)
    q = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)) * 1e5
    np.testing.assert_allclose(compiled(q.numpy()), model(q).numpy(), atol=1e-6)


def test_a_value_compared_with_its_own_transpose_is_never_below_itself():
    """v.T < v along a diagonal compares a value with itself: false. The grouped convolution
    behind v is computed in the comparing kernel twice, once per side, and LLVM reassociated the
    two copies of its sum differently, so 32 diagonal elements came out true (found by fuzzing).
    Only a loop's running sum is reassociable now."""
    import torch

    import eclat

    class SelfCompare(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 1) * 0.3)
            self.conv = torch.nn.Conv2d(16, 4, 3, padding=1, groups=4)

        def forward(self, x):
            v1 = self.conv(x @ self.w)
            v = v1[:6] + v1[12:].sum()
            vt = torch.nan_to_num(v).transpose(0, 3)
            return torch.lt(vt, v).float()

    torch.manual_seed(147)
    model = SelfCompare().eval()
    x = torch.randn(16, 16, 16, 8)
    compiled = eclat.compile(model, (x,), autotune="none", quiet=True, verify=False)
    np.testing.assert_array_equal(compiled(x.numpy()), model(x).detach().numpy())


def test_max_of_a_negation_and_a_constant_is_an_exact_min():
    """max(-x, c), as a clamp's upper bound is written, is emitted as -minimum(x, -c): the same
    bits as the interpreter for NaN, infinities and zeros of both signs. (For c = 0, max(+0, -0)
    is compared by value: numpy picks either zero, IEEE maximum +0.)"""
    x = G.input_("x", (64,))
    xs = rand(64)
    xs[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 2.0, -2.0, 1e-40]
    for c in (2.0, -1.5, 0.0):
        cst = G.expand_to(G.const(c), (64,))
        neg = G.unary("neg", x)
        graph = G.Graph([x], [G.binary("max", neg, cst), G.binary("max", cst, neg)], {})
        assert "llvm.minimum" in CpuExecutable(group(graph), 1).module.text()
        _, got = compiled(graph, [xs])
        for g, w in zip(got, run(graph, [xs])):
            np.testing.assert_array_equal(g, w)
            if c != 0:
                np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))


def test_row_sums_of_a_kernel_output_are_folded_into_its_writer():
    """y = x * 2 + 1 is a kernel; the sums over the rows of y*y and of softmax's exponentials are
    computed by their writers as they write them, the readers load one value per row; softmax's
    max stays with its reader (sides.py says why); NaN, infinities of both signs and -inf rows
    reduce as the interpreter does, on one thread and two."""
    from eclat.backends.cpu.sides import fold_row_reductions

    x = G.input_("x", (7, 40))
    two, one = (G.expand_to(G.const(v), (7, 40)) for v in (2.0, 1.0))
    y = G.contiguous(G.binary("add", G.binary("mul", x, two), one))
    m = G.reduce("max_reduce", y, 1)
    e = G.unary("exp2", G.binary("add", y, G.unary("neg", rows(m, 40))))
    out = G.binary("mul", e, rows(G.unary("recip", G.reduce("sum", e, 1)), 40))
    sq = G.reduce("sum", G.binary("mul", y, y), 1)
    graph = G.Graph([x], [out, sq], {})
    xs = rand(7, 40)
    xs[1, 3], xs[2, 0], xs[2, 39], xs[4, :], xs[5, 7] = np.nan, np.inf, -np.inf, -np.inf, 3e38
    program = check(graph, [xs])
    folded = fold_row_reductions(program)
    assert sum(len(k.sides) for k in folded.kernels) == 2
    left = [r.op for k in folded.kernels[1:] for r in walk(k.body) if isinstance(r, Reduce)]
    assert left == ["max_reduce"], left
    assert [k.sides for k in program.kernels] == [()] * len(program.kernels)  # the original stays
    got = on_two_threads(program).run([xs])
    for g, w in zip(got, run(graph, [xs])):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_views_with_masks_negative_strides_and_steps():
    x = G.input_("x", (5, 8))
    flipped = G.movement(x, lambda v: v.flip([1]))
    padded = G.movement(x, lambda v: v.pad([(1, 2), (3, 0)]))
    stepped = G.movement(x, lambda v: v.slice(1, 7, 0, -2))
    both = G.movement(G.unary("exp2", x), lambda v: v.pad([(2, 0), (0, 1)]).flip([0]))
    permuted = G.contiguous(G.movement(x, lambda v: v.permute([1, 0])))
    reshaped = G.movement(permuted, lambda v: v.reshape((4, 10)))
    check(G.Graph([x], [flipped, padded, stepped, both, reshaped], {}), [rand(5, 8)])


def test_padded_outputs_are_written_as_zeros_interior_zeros():
    """A computed value padded on its last two axes: rows outside the mask are zeros, and the
    interior is computed with the mask's ranges assumed (no per-element mask left); rows of 8
    (the vectoriser's own threshold is 16) and of 21; a 2x2 max pool as in a CNN."""
    from eclat.compiler.kernel import Index, Op, assume_in, loads
    from eclat.ir.symbolic import Num

    x = G.input_("x", (2, 3, 6, 16))
    pooled = G.reduce("max_reduce", G.reduce("max_reduce", G.movement(
        G.unary("exp2", x), lambda v: v.reshape((2, 3, 3, 2, 8, 2))), 5), 3)  # [2, 3, 3, 8]
    short = G.movement(pooled, lambda v: v.pad([(0, 0), (0, 0), (1, 1), (1, 1)]))
    wide = G.movement(G.unary("sin", x), lambda v: v.pad([(0, 0), (0, 0), (0, 2), (3, 2)]))
    program = check(G.Graph([x], [G.contiguous(short), G.contiguous(wide)], {}), [rand(2, 3, 6, 16)])
    padded = [k.body for k in program.kernels
              if isinstance(k.body, Op) and k.body.op == "where" and isinstance(k.body.srcs[0], Index)]
    assert len(padded) == 2
    for body in padded:
        inside = loads(assume_in(body.srcs[1], body.srcs[0].expr))
        assert inside and all(ld.valid == Num(1) for ld in inside)


def test_gather_clamps_indices():
    table = G.weight("emb", rand(10, 4), DType.float32)
    idx = G.input_("idx", (2, 3), DType.int64)
    out = G.gather(table, idx)
    graph = G.Graph([idx], [out, G.unary("exp2", out)], {"emb": rand(10, 4)})
    check(graph, [np.array([[0, 9, 3], [-4, 12, 5]], dtype=np.int64)])


def test_a_gathered_table_counts_the_rows_read_not_the_table():
    """An embedding lookup of 3 tokens reads 3 rows of 64 floats (and 3 indices), not the
    1000-row table: the roofline estimate, and so pruning, sees the kernel as it runs."""
    from eclat.compiler.kernel import bytes_moved

    emb = rand(1000, 64)
    idx = G.input_("idx", (3,), DType.int64)
    program = check(G.Graph([idx], [G.unary("exp2", G.gather(G.weight("emb", emb, DType.float32), idx))],
                            {"emb": emb}), [np.array([5, 999, 5], dtype=np.int64)])
    (kern,) = program.kernels
    assert bytes_moved(kern, program.buffers) == 3 * 64 * 4 + 3 * 8 + 3 * 64 * 4


def test_iota_const_and_scalar_outputs():
    x = G.input_("x", (5,))
    ramp = G.cast(G.iota(5), DType.float32)
    out = G.binary("add", x, ramp)
    total = G.reduce("sum", out, 0)
    check(G.Graph([x], [out, total, x, total], {}), [rand(5)])


def test_every_output_starts_on_a_cache_line():
    """Threads splitting an output's columns share no line at their boundary only if its rows start
    on lines: numpy starts an array 16 bytes into one about half the time."""
    x = G.input_("x", (33, 196))
    outs = [G.binary("mul", x, x), G.cast(G.binary("mul", x, x), DType.float16)]
    exe = on_two_threads(group(G.Graph([x], outs, {})))
    xs = rand(33, 196)
    for _ in range(8):  # allocations land at several offsets
        got = exe.run([xs])
        assert [o.ctypes.data % 64 for o in got] == [0, 0]
        np.testing.assert_allclose(got[0], xs * xs, rtol=1e-6)
        np.testing.assert_allclose(got[1], (xs * xs).astype(np.float16), rtol=1e-3)
        assert got[1].dtype == np.float16 and got[0].flags.c_contiguous and got[0].flags.writeable


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 13, 19), (6, 16, 16), (13, 5, 33), (2, 64, 40), (25, 9, 8),
                                   (1, 7, 45), (1, 64, 100)])  # one row: k over sets of accumulators
@pytest.mark.parametrize("weight", [True, False])
def test_matmul_tile_edges(m, k, n, weight):
    a = G.input_("a", (m, k))
    bw = rand(k, n)
    b = G.weight("b", bw, DType.float32) if weight else G.input_("b", (k, n))
    out = G.binary("add", matmul(a, b), G.expand_to(G.weight("bias", rand(n), DType.float32), (m, n)))
    graph = G.Graph([a] if weight else [a, b], [G.unary("sqrt", G.binary("mul", out, out))],
                    {"b": bw, "bias": rand(n)})
    program = check(graph, [rand(m, k)] if weight else [rand(m, k), bw], rtol=1e-4, atol=1e-5)
    assert n == 1 or any(as_contraction(kern) is not None for kern in program.kernels)


@pytest.mark.parametrize("m", [25, 3, 1])
def test_a_weight_on_the_left_is_read_packed_in_blocks_of_rows(m):
    """A weight broadcast a row at a time (a convolution's, its pixels the columns) is packed into
    [row blocks, K, MR] and read there alone: its own data is not held. Rows past the last block's
    end, and a single row (a matrix-vector product, read in place), still give the right sums."""
    from eclat.backends.cpu.codegen import PACKED

    wa = rand(m, 40)
    a = G.weight("wa", wa, DType.float32)
    b = G.input_("b", (40, 50))
    graph = G.Graph([b], [matmul(a, b)], {"wa": wa})
    program = group(graph)
    for kern in program.kernels:
        kern.schedule = replace(default_schedule(kern), transposed=False)
    exe = CpuExecutable(program)
    x = rand(40, 50)
    np.testing.assert_allclose(exe.run([x])[0], wa @ x, rtol=1e-4, atol=1e-4)
    rows = [n for n in exe.program.buffers if n.startswith(f"{PACKED}w_wa_a")]
    assert len(rows) == (m > 1) and ("w_wa" in exe.module.used) == (m == 1), (rows, exe.module.used)


def test_a_weight_per_batch_on_the_left_is_packed_batch_by_batch():
    """A left weight with a batch axis (a Winograd product's transformed filters) is packed in row
    blocks batch after batch, each batch reading its own: the sums match."""
    from eclat.backends.cpu.codegen import PACKED
    from tests.gpu_cases import matmul as batched_matmul

    wa = rand(3, 13, 20)
    b = G.input_("b", (3, 20, 24))
    graph = G.Graph([b], [batched_matmul(G.weight("wa", wa, DType.float32), b)], {"wa": wa})
    program = group(graph)
    for kern in program.kernels:
        kern.schedule = replace(default_schedule(kern), transposed=False)
    exe = CpuExecutable(program)
    x = rand(3, 20, 24)
    np.testing.assert_allclose(exe.run([x])[0], wa @ x, rtol=1e-4, atol=1e-4)
    packed = [n for n in exe.program.buffers if n.startswith(f"{PACKED}w_wa_a")]
    assert packed and "w_wa" not in exe.module.used, (packed, exe.module.used)


@pytest.mark.parametrize("m,k,n,depth", [(19, 70, 45, 16), (9, 64, 32, 8), (40, 33, 70, 24), (8, 50, 16, 48)])
@pytest.mark.parametrize("weight", [True, False])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_reduction_in_chunks_gives_the_same_sums(m, k, n, depth, weight, transposed):
    """Schedule.depth: the reduction in chunks, each over every row block of the panel, the sums kept
    between them; edge tiles, a last chunk shorter than the others (or of one step), a packed weight
    and a runtime operand copied per panel, both orientations, and an epilogue read after the last
    chunk only."""
    a = G.input_("a", (m, k))
    bw = rand(k, n)
    b = G.weight("b", bw, DType.float32) if weight else G.input_("b", (k, n))
    out = G.unary("sqrt", G.binary("mul", matmul(a, b), matmul(a, b)))
    graph = G.Graph([a] if weight else [a, b], [out], {"b": bw})
    inputs = [rand(m, k)] if weight else [rand(m, k), bw]
    program = group(graph)
    program.kernels = [replace(kern, schedule=Schedule(tile=(8, 32), transposed=transposed, depth=depth))
                       if as_contraction(kern) is not None else kern for kern in program.kernels]
    for threads in (1, 2):
        got = CpuExecutable(program, threads).run([np.ascontiguousarray(x) for x in inputs])[0]
        np.testing.assert_allclose(got, run(graph, inputs)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("m,depth", [(5, 0), (17, 0), (64, 0), (17, 40), (64, 32)])
def test_rows_of_a_packed_weight_prefetch_the_next_panel(m, depth):
    """Over several row blocks each block brings its share of the next packed panel (or, with the
    reduction in chunks, the next chunk) into L2 (prefetch locality 2); a single block streams its
    own panel ahead (locality 3). The last panel's prefetches run past the weight's end: harmless,
    and the values are checked."""
    k, n = 96, 70  # 70 columns: a partial last panel; chunks of 40: a short last one
    bw = rand(k, n)
    a = G.input_("a", (m, k))
    graph = G.Graph([a], [matmul(a, G.weight("b", bw, DType.float32))], {"b": bw})
    program = group(graph)
    program.kernels = [replace(kern, schedule=Schedule(tile=(8, 32), depth=depth))
                       for kern in program.kernels]
    exe = CpuExecutable(program, 1)
    a_data = rand(m, k)
    np.testing.assert_allclose(exe.run([a_data])[0], run(graph, [a_data])[0], rtol=1e-4, atol=1e-5)
    prefetches = re.findall(r"call void @llvm\.prefetch\.p0\(ptr %[^,]+, i32 0, i32 (\d), i32 1\)",
                            exe.module.text())
    assert set(prefetches) == ({"3"} if m <= 8 else {"2"})


def test_the_copies_of_a_runtime_operand_start_on_a_cache_line():
    """A runtime right operand is copied panel by panel into a stack array that every row block reads
    as vectors: the array (and the accumulators' spill) starts on a cache line, whatever the stack
    is aligned to, and the product is right."""
    m, k, n = 40, 70, 100
    a, b = G.input_("a", (m, k)), G.input_("b", (k, n))
    graph = G.Graph([a, b], [matmul(a, b)], {})
    program = group(graph)
    program.kernels = [replace(kern, schedule=Schedule(tile=(8, 32))) for kern in program.kernels]
    exe = CpuExecutable(program, 1)
    inputs = [rand(m, k), rand(k, n)]
    np.testing.assert_allclose(exe.run(inputs)[0], run(graph, inputs)[0], rtol=1e-4, atol=1e-5)
    arrays = re.findall(r"alloca float, i\d+ (\d+)(, align \d+)?", exe.module.text())
    assert ("2240", ", align 64") in arrays and all(align == ", align 64" for _, align in arrays)


@pytest.mark.parametrize("cache", ["input", "weight"])
def test_one_row_against_rows_of_a_runtime_matrix_runs_as_dot_products(cache):
    """q @ K^T with K a runtime matrix [T, D] (decode attention's scores): its columns step by D,
    so the register-blocked micro-kernel would gather K element by element; the plain loops
    vectorise each dot product instead. p @ V (columns step by one) and a constant K (packed at
    compile time) keep the micro-kernel."""
    q, p = G.input_("q", (1, 64)), G.input_("p", (1, 37))
    kv = rand(37, 64)
    k = G.input_("k", (37, 64)) if cache == "input" else G.weight("k", kv, DType.float32)
    v = G.input_("v", (37, 64))
    scores = matmul(q, G.movement(k, lambda view: view.permute((1, 0))))
    graph = G.Graph([q, p, v] + ([k] if cache == "input" else []), [scores, matmul(p, v)], {"k": kv})
    inputs = [rand(1, 64), rand(1, 37), rand(37, 64)] + ([kv] if cache == "input" else [])
    program = check(graph, inputs, rtol=1e-4, atol=1e-5)
    micro = [contraction_of(kern, program.buffers) is not None for kern in program.kernels]
    assert micro == [cache == "weight", True]


def test_matmul_with_transposed_weight_and_batches():
    x = G.input_("x", (3, 5, 12))
    w = rand(10, 12)  # torch Linear layout: out x in
    wt = G.movement(G.weight("w", w, DType.float32), lambda v: v.permute([1, 0]))
    xe = G.movement(x, lambda v: v.reshape((3, 5, 12, 1)).expand((3, 5, 12, 10)))
    we = G.movement(wt, lambda v: v.reshape((1, 1, 12, 10)).expand((3, 5, 12, 10)))
    out = G.reduce("sum", G.binary("mul", xe, we), 2)
    check(G.Graph([x], [out], {"w": w}), [rand(3, 5, 12)], rtol=1e-4, atol=1e-5)


def test_a_product_over_an_axis_of_one_element():
    """A product of one row whose row axis stayed (a program with run-time sizes specialised to one
    row, compiler.buckets): that axis has stride 0, and dividing by it made every output NaN."""
    from eclat.compiler.kernel import Buffer, Kernel, Load, Op, Program
    from eclat.ir.symbolic import Num, Var

    i0, i1, r = Var("i0", 0, 0), Var("i1", 0, 63), Var("r0", 0, 39)
    w = rand(40, 64)
    body = Reduce("sum", 40, r, Op("mul", (Load("x", i0 * 40 + r, Num(1), DType.float32),
                                             Load("w", i1 + r * 64, Num(1), DType.float32)), DType.float32),
                  DType.float32)
    buffers = {"x": Buffer("x", 40, DType.float32, "input"), "y": Buffer("y", 64, DType.float32, "output"),
               "w": Buffer("w", w.size, DType.float32, "weight", w)}
    program = Program(buffers, [Kernel("k0", "y", (1, 64), body)], ["x"], ["y"], [(1, 40)], [(1, 64)])
    x = rand(1, 40)
    np.testing.assert_allclose(CpuExecutable(program).run([x])[0], x @ w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("batch", [1, 2])
def test_a_one_row_product_over_windows_read_at_every_step(batch):
    """A convolution with one output channel: a product of one row (a GEMV) whose right operand is
    read through its windows, by an index computed per step of the reduction. The row's unrolled
    steps were emitted in one block, and a step reused the index of the step before it (max error
    1.4 against an output of 1.2, found by fuzzing)."""
    import torch

    import eclat

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 1, 3, bias=False).eval()
    x = torch.randn(batch, 3, 8, 7)
    compiled = eclat.compile(conv, (x,), autotune="none", quiet=True, verify=False)
    with torch.no_grad():
        np.testing.assert_allclose(compiled(x.numpy()), conv(x).numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [9, 1])
def test_schedules_change_nothing_but_speed(rows):
    a, b = G.input_("a", (rows, 21)), G.input_("b", (21, 27))
    graph = G.Graph([a, b], [matmul(a, b)], {})
    inputs = [rand(rows, 21), rand(21, 27)]
    want = run(graph, inputs)[0]
    program = group(graph)
    (kern,) = program.kernels
    space = schedule_space(kern, threads=2)
    assert len(space) > 4 and space[0] == default_schedule(kern, threads=2)
    for s in space:
        kern.schedule = s
        got = CpuExecutable(program, s.threads).run(inputs)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert flops(kern) == 2 * rows * 21 * 27


def test_threads_split_large_kernels():
    a, b = G.input_("a", (96, 64)), G.input_("b", (64, 80))
    x = G.input_("x", (256, 300))
    graph = G.Graph([a, b, x], [matmul(a, b), G.unary("exp2", x)], {})
    inputs = [rand(96, 64), rand(64, 80), rand(256, 300)]
    program = group(graph)
    exe = on_two_threads(program)
    assert exe.module.parallel, "large kernels should run on the thread pool"
    for _ in range(3):
        for got, want in zip(exe.run(inputs), run(graph, inputs)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_threads_split_a_single_panel_contraction_over_its_batches():
    """A batched product with one 16-column panel (a convolution's GEMM per image row) still
    runs on both threads: the outer loop is (panel, batch) pairs."""
    from tests.gpu_cases import matmul as batched_matmul

    a, b = G.input_("a", (32, 24, 64)), G.input_("b", (32, 64, 16))
    graph = G.Graph([a, b], [batched_matmul(a, b)], {})
    inputs = [rand(32, 24, 64), rand(32, 64, 16)]
    program = group(graph)
    exe = on_two_threads(program)
    assert exe.module.parallel
    for got, want in zip(exe.run(inputs), run(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n", [1, 3, 8, 100, 1001])
def test_thread_pool_cuts_a_call_into_slices_any_free_thread_takes(n):
    """A call's [0, n) is cut into contiguous slices, several per thread (at most n), each run once:
    a thread that stalls leaves its slices to the others instead of the caller waiting for it."""
    import ctypes
    import threading

    from eclat.backends.cpu import threads

    address = threads.pool_address()
    if address is None:
        pytest.skip(threads.pool_unavailable())
    slices, lock = [], threading.Lock()
    kernel_t = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)

    def record(_args, lo, hi):
        with lock:
            slices.append((lo, hi))
    callback = kernel_t(record)
    pool = ctypes.CFUNCTYPE(None, kernel_t, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)(address)
    pool(callback, None, n, 2)
    covered = sorted(s for s in slices if s[0] < s[1])
    assert [lo for lo, _ in covered] == [0] + [hi for _, hi in covered[:-1]] and covered[-1][1] == n
    assert len(covered) == min(n, 2 * 4)


def test_thread_pool_sleeps_when_idle():
    """Workers watch for the next kernel only briefly (SPIN_NS), then sleep: an idle model
    costs no CPU time (a spinning pool steals the cores of a shared VM)."""
    import time

    x = G.input_("x", (512, 512))
    program = group(G.Graph([x], [G.unary("exp2", x)], {}))
    exe = on_two_threads(program)
    exe.run([rand(512, 512)])
    cpu, wall = time.process_time(), time.perf_counter()
    time.sleep(0.3)
    assert time.process_time() - cpu < 0.05 * (time.perf_counter() - wall) / 0.3


def test_memory_plan_reuses_dead_temporaries():
    x = G.input_("x", (64, 64))
    h = x
    for _ in range(4):  # a chain of materialised temporaries: only two live at a time
        h = G.contiguous(G.unary("exp2", G.movement(h, lambda v: v.permute([1, 0]))))
    graph = G.Graph([x], [G.unary("neg", h)], {})
    program = check(graph, [rand(64, 64) * 0.01])
    plan = plan_memory(program)
    assert plan.arena_bytes <= plan.naive_bytes / 2
    assert plan.arena_bytes >= 2 * 64 * 64 * 4


def test_empty_output():
    x = G.input_("x", (0, 4))
    check(G.Graph([x], [G.unary("exp2", x)], {}), [np.zeros((0, 4), np.float32)])


def test_kernel_flops_count_hoisted_reductions_once():
    x = G.input_("x", (8, 16))
    m = G.reduce("max_reduce", x, 1)
    out = G.binary("add", x, G.expand_to(G.movement(m, lambda v: v.reshape((8, 1))), (8, 16)))
    (kern,) = group(G.Graph([x], [out], {})).kernels
    assert flops(kern) == 8 * 16 + 8 * 16  # one add per element, one max step per element
    assert math.prod(kern.shape) == 128


def test_two_contractions_in_one_expression_get_their_own_kernels():
    """silu(x @ g) * (x @ u): each product is register-blocked, not a strided loop nest."""
    x = G.input_("x", (5, 12))
    gw, uw = rand(12, 16), rand(12, 16)
    gate = matmul(x, G.weight("g", gw, DType.float32))
    up = matmul(x, G.weight("u", uw, DType.float32))
    out = G.binary("mul", G.unary("recip", G.binary("add", G.unary("exp2", G.unary("neg", gate)),
                                                      G.expand_to(G.const(1.0), (5, 16)))), up)
    program = check(G.Graph([x], [out], {"g": gw, "u": uw}), [rand(5, 12)], rtol=1e-4, atol=1e-5)
    assert sum(as_contraction(k) is not None for k in program.kernels) >= 2


def test_backend_registry_and_render():
    from eclat.backends import TARGETS, get_target

    assert "cpu" in TARGETS and get_target("cpu").name == "cpu"
    x = G.input_("x", (4, 4))
    text = get_target("cpu").render(group(G.Graph([x], [G.unary("sqrt", x)], {})))
    assert "define void @eclat_run" in text.replace('"', "") and "llvm.sqrt" in text


def test_thread_pool_survives_fork():
    """A forked child (isolated tuning runs) has none of the parent's workers and must not wait for them."""
    import os

    x = G.input_("x", (512, 512))
    program = group(G.Graph([x], [G.unary("exp2", x)], {}))
    exe = on_two_threads(program)
    a = rand(512, 512)
    exe.run([a])
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit code
        ok = np.allclose(exe.run([a])[0], np.exp2(a), rtol=1e-5)
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_layers_that_differ_only_in_weights_share_code():
    x = G.input_("x", (4, 8))
    h, weights = x, {}
    for layer in range(3):
        weights[f"w{layer}"] = rand(8, 8)
        y = matmul(h, G.weight(f"w{layer}", weights[f"w{layer}"], DType.float32))
        h = G.unary("sqrt", G.binary("mul", y, y))
    graph = G.Graph([x], [h], weights)
    program = check(graph, [rand(4, 8)], rtol=1e-4, atol=1e-5)
    exe = CpuExecutable(program)
    assert len(exe.module.kernels) < len(program.kernels)


@pytest.mark.parametrize("composite", [True, False], ids=["matmul", "sum-of-product"])
@pytest.mark.parametrize("reader", ["padded-pool", "padded-for-next-conv", "concatenated"])
def test_a_product_read_through_a_mask_keeps_its_register_blocked_kernel(reader, composite):
    """relu(x @ w + b) read through a zero-padding mask (a convolution's output pooled with
    padding, padded for the next convolution, or concatenated with another value): the product
    and its epilogue are one kernel the backend register-blocks; the mask reads its result.
    Inlined into the masked reader, the product's index unravels through the mask and it runs as
    a scalar loop (20x slower)."""
    from eclat.rewrites.composites import matmul as matmul_composite

    x = G.input_("x", (16, 24))
    wv, bv = rand(24, 32), rand(32)
    w, b = G.weight("w", wv, DType.float32), G.weight("b", bv, DType.float32)
    product = matmul_composite(x, w) if composite else matmul(x, w)
    act = G.binary("max", G.binary("add", product, G.expand_to(b, (16, 32))),
                   G.expand_to(G.const(0.0), (16, 32)))
    padded = G.movement(act, lambda v: v.pad([(1, 1), (1, 1)]))  # [18, 34], zeros around
    if reader == "concatenated":  # torch.cat as the frontend writes it: padded pieces added
        padded = G.movement(act, lambda v: v.pad([(0, 0), (0, 24)]))
        other = G.movement(G.unary("neg", x), lambda v: v.pad([(0, 0), (32, 0)]))
        out = G.binary("add", padded, other)
    else:
        out = G.reduce("max_reduce", padded, 1) if reader == "padded-pool" else G.contiguous(padded)
    program = check(G.Graph([x], [out], {"w": wv, "b": bv}), [rand(16, 24)], rtol=1e-4, atol=1e-5)
    products = [k for k in program.kernels
                if any(isinstance(r, Reduce) and r.op == "sum" for r in walk(k.body))]
    assert len(products) == 1 and as_contraction(products[0]) is not None


@pytest.mark.parametrize("kernel, stride", [(3, 2), (3, 1), (2, 2)])
def test_a_product_read_through_overlapping_windows_is_computed_once(kernel, stride):
    """x * exp2(x) for x = w @ h (the product read by several elementwise ops, as GELU reads it),
    read by the next 1-d convolution's windows without padding (wav2vec2's feature encoder):
    the windows read each element kernel/stride times, and a product fused into their copy would
    be computed once per read. The product is computed at most once per element."""
    n, length = 8, 41
    h = G.input_("h", (n, length))
    wv = rand(n, n)
    y = matmul(G.weight("w", wv, DType.float32), h)  # [n, length]
    act = G.binary("mul", y, G.unary("exp2", y))
    out_len = (length - kernel) // stride + 1
    windows = G.contiguous(G.movement(act, lambda v: View.make((n, kernel, out_len), (length, 1, stride))))
    program = check(G.Graph([h], [windows], {"w": wv}), [rand(n, length)], rtol=1e-4, atol=1e-5)
    products = [k for k in program.kernels
                if any(isinstance(r, Reduce) and r.op == "sum" for r in walk(k.body))]
    assert len(products) == 1 and as_contraction(products[0]) is not None
    assert math.prod(products[0].shape) <= n * length, products[0].shape


def test_a_value_copied_for_two_readers_is_computed_once():
    """relu(w @ h + b) read by a product through a reshape and by a padded copy (a squeeze
    convolution's output, read by the fire module's 1x1 and 3x3 expansions), each reader asking for
    it contiguous: one kernel computes it, and every reader reads that buffer."""
    c, hw = 4, 6
    h = G.input_("h", (8, hw * hw))
    wv, bv = rand(c, 8), rand(c, 1)
    y = G.binary("add", matmul(G.weight("w", wv, DType.float32), h),
                 G.expand_to(G.weight("b", bv, DType.float32), (c, hw * hw)))
    act = G.binary("max", y, G.expand_to(G.const(0.0, DType.float32), y.shape))
    flat = G.contiguous(G.movement(act, lambda v: v.reshape((1, c, hw * hw))))
    planes = G.contiguous(G.movement(act, lambda v: v.reshape((c, hw, hw))))
    padded = G.contiguous(G.movement(planes, lambda v: v.pad([(0, 0), (1, 1), (1, 1)])))
    graph = G.Graph([h], [G.unary("neg", flat), padded], {"w": wv, "b": bv})
    program = check(graph, [rand(8, hw * hw)], rtol=1e-4, atol=1e-5)
    biased = [k.name for k in program.kernels if any(x.buffer.endswith("_b") for x in loads(k.body))]
    assert len(biased) == 1, biased


def test_output_axes_read_as_one_flat_axis_are_merged():
    """A 1x1 convolution over 4x5 pixels is a contraction with 20 columns (kernel.coalesce); axes
    a mask or a transposed read tells apart stay apart; every form matches the interpreter."""
    x, w = G.input_("x", (1, 6, 4, 5)), G.input_("w", (3, 6))
    xs = G.movement(x, lambda v: v.reshape((1, 1, 6, 4, 5)).expand((1, 3, 6, 4, 5)))
    ws = G.movement(w, lambda v: v.reshape((1, 3, 6, 1, 1)).expand((1, 3, 6, 4, 5)))
    conv = G.reduce("sum", G.binary("mul", ws, xs), 2)  # [1, 3, 4, 5]
    padded = G.movement(conv, lambda v: v.pad([(0, 0), (0, 0), (1, 1), (0, 0)]))  # masked rows
    flipped = G.unary("neg", G.movement(G.contiguous(conv), lambda v: v.permute([0, 1, 3, 2])))
    graph = G.Graph([x, w], [G.contiguous(conv), padded, flipped], {})
    program = check(graph, [rand(1, 6, 4, 5), rand(3, 6)])
    shapes = [k.shape for k in program.kernels]
    assert shapes[0] == (3, 20), shapes
    c = as_contraction(program.kernels[0])
    assert c is not None and program.kernels[0].shape[c.n_axis] == 20
    assert (3, 6, 5) in shapes and (3, 5, 4) in shapes, shapes  # the mask's rows; the transpose


@pytest.mark.parametrize("stride, threads", [(2, 1), (1, 2)])
def test_windows_read_through_padding_run_unmasked_inside_the_rows(stride, threads):
    """A 3x3 max pool and a sum pool over a -inf / zero padded input (a conv's taps alike): their
    rows run masked at the edges and unmasked in between (`KernelEmitter._interior`), and match
    the interpreter there, NaN and infinities included, on rows of odd length."""
    from eclat.backends.cpu.emitter import KernelEmitter

    x = G.input_("x", (3, 17, 21))
    pads = [(0, 0), (1, 1), (1, 1)]
    inside = G.movement(G.expand_to(G.const(True, DType.bool), (3, 17, 21)), lambda v: v.pad(pads))
    rows, cols = (19 - 3) // stride + 1, (23 - 3) // stride + 1
    windows = View.make((3, rows, cols, 3, 3), (19 * 23, 23 * stride, stride, 23, 1))
    outs = []
    for op, fill in (("max_reduce", -math.inf), ("sum", 0.0)):
        fills = G.expand_to(G.const(fill), (3, 19, 23))
        padded = G.where(inside, G.movement(x, lambda v: v.pad(pads)), fills)
        outs.append(G.reduce(op, G.reduce(op, G.view(padded, windows), 4), 3))
    graph = G.Graph([x], outs, {})
    program = group(graph)
    split = [k for k in program.kernels if KernelEmitter(None, k, program.buffers, {}, 8)._interior(k.body)]
    assert len(program.kernels) == len(split) == 2  # each pool reads x through its padding, split
    xs = rand(3, 17, 21)
    xs[0, 0, 0], xs[1, 16, 20], xs[2, 5, 0], xs[2, 8, 9] = np.nan, np.inf, -np.inf, np.nan
    exe = on_two_threads(program) if threads > 1 else CpuExecutable(program)
    for got, want in zip(exe.run([xs]), run(graph, [xs])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("width, stride", [(25, 1), (25, 2), (7, 1), (9, 2)])
def test_a_panel_crossing_the_end_of_an_output_row_reads_two_runs(width, stride):
    """A convolution's product reads its input's windows in place, column by column of the output:
    a panel of the default's columns (32 with AVX-512, 16 with AVX2) over rows of 25 (or 13)
    crosses into the next row, where the windows jump on. Each vector of it is read as the two runs
    it is (two loads, or two pairs and their shuffles at stride 2, blended on the lanes of the
    first), not gathered; a vector crossing two rows (rows of 7 and 5) is gathered. Right against
    torch in every case."""
    import torch

    from eclat.backends.cpu.schedules import gemm_tiles
    from eclat.frontend import lower

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 40, 3, stride=stride, padding=1).eval()
    x = torch.randn(1, 6, 27, width)
    # grouped as the CPU groups it, its windows read in place (a compile's search may also time the
    # grouping that copies them, and keep it where it times faster)
    exe = CpuExecutable(group(lower(conv, (x,)), frozenset({"windows"})), 1)
    products = [k for k in exe.program.kernels if as_contraction(k) is not None]
    assert [k.schedule.tile[1] for k in products] == [gemm_tiles()[0][1]]  # the host's default
    np.testing.assert_allclose(exe.run([x.numpy()])[0], conv(x).detach().numpy(), rtol=1e-4, atol=1e-4)
    if width > 16:  # the lanes of each run are found (narrower rows: whatever the lowering chose)
        assert any(f"icmp eq <{exe.module.lanes} x i64>" in text for text in exe.module.kernels.values())


@pytest.mark.parametrize("make", ["make_hf_llama", "make_mobile"])
def test_grouping_reuses_kernels_only_where_nothing_they_inline_changed(make, monkeypatch):
    """Each attempt of grouping's fixpoint takes the kernels of the previous one that inline nothing
    it materialises since; the program is the one attempts built from nothing give."""
    from eclat.compiler import group as grouping
    from eclat.frontend.lower import lower
    from tests import zoo

    model, inputs = getattr(zoo, make)()
    graph = lower(model, inputs)
    reused = group(graph)
    built = grouping._Grouping.__init__
    calls = []

    def from_nothing(self, graph, nodes, materialised, previous=None):
        calls.append(previous is not None)
        built(self, graph, nodes, materialised, None)
    monkeypatch.setattr(grouping._Grouping, "__init__", from_nothing)
    fresh = group(graph)
    assert any(calls), "the fixpoint took one attempt: nothing was reused"
    assert [(k.name, k.out, k.shape, k.body) for k in reused.kernels] == \
        [(k.name, k.out, k.shape, k.body) for k in fresh.kernels]


def test_a_recurrence_is_grouped_in_a_few_attempts(monkeypatch):
    """An LSTM's steps each hand their cell state to the next, so the first, fully fused attempt
    nests every step in the next. The fixpoint materialises each step's shared values at once
    (costly even with the others loaded from buffers), not one step per attempt, and the program
    computes what the graph does."""
    import torch

    from eclat.compiler import group as grouping
    from eclat.frontend.lower import lower
    from tests.zoo import StackedOutputs

    torch.manual_seed(0)
    lstm = StackedOutputs(torch.nn.LSTM(4, 8))
    x = torch.randn(24, 1, 4)
    graph = lower(lstm, (x,))
    attempts = []
    offenders = grouping._Grouping.offenders
    monkeypatch.setattr(grouping._Grouping, "offenders", lambda self: attempts.append(1) or offenders(self))
    program = group(graph)
    assert len(attempts) <= 3  # one attempt per step or two before (24 steps: 14)
    got, = CpuExecutable(program).run([x.numpy()])
    want, = run(graph, [x.numpy()])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, lstm(x).detach().numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["GRU", "LSTM"])
def test_grouping_a_recurrence_builds_expressions_in_proportion_to_its_steps(monkeypatch, kind):
    """Each step's product reads the state before it, which the first attempt inlined with every
    step before that (a 100-step GRU grouped in 43 s, 2 s now): the states a product reads and the
    long chains of shared values (an LSTM's cell state) are materialised before the first attempt.
    Counted in expressions built, not seconds: twice the steps build at most 2.5x as many (the
    square would build 4x). The programs compute what the graph does."""
    import torch

    from eclat.compiler import group as grouping
    from eclat.frontend.lower import lower
    from tests.zoo import StackedOutputs

    built = []
    compute = grouping._Grouping._compute
    monkeypatch.setattr(grouping._Grouping, "_compute",
                        lambda self, *a: built.append(1) or compute(self, *a))
    torch.manual_seed(0)
    layer = StackedOutputs(getattr(torch.nn, kind)(4, 8))
    counts = []
    for steps in (40, 80):
        x = torch.randn(steps, 1, 4)
        graph = lower(layer, (x,))
        built.clear()
        program = group(graph)
        counts.append(len(built))
        got, = CpuExecutable(program).run([x.numpy()])
        np.testing.assert_allclose(got, layer(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    assert counts[1] <= 2.5 * counts[0], counts


@pytest.mark.parametrize("threads", [1, 2])
def test_a_recurrences_steps_share_their_kernel_functions(threads):
    """Each step's kernels read their slice of the input's projection at a constant offset; the
    caller moves the pointer by it, so the steps are one function each (a 50-step bidirectional
    LSTM's 403 kernels were 113 functions, 13 now), and the program computes what torch does."""
    import torch

    from eclat.frontend.lower import lower
    from tests.zoo import StackedOutputs

    torch.manual_seed(0)
    layer = StackedOutputs(torch.nn.GRU(6, 8, bidirectional=True))
    x = torch.randn(30, 2, 6)
    program = group(lower(layer, (x,)))
    exe = CpuExecutable(program, threads)
    functions = set(exe.module.functions.values())
    assert len(program.kernels) > 100 and len(functions) < 20, (len(program.kernels), len(functions))
    got, = exe.run([x.numpy()])
    np.testing.assert_allclose(got, layer(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def _cat(parts: list[G.Node], axis: int) -> G.Node:
    """torch.cat as the frontend lowers it: each part padded with zeros to the whole, added up."""
    total, at, out = sum(p.shape[axis] for p in parts), 0, None
    for p in parts:
        pads = [(0, 0)] * len(p.shape)
        pads[axis] = (at, total - at - p.shape[axis])
        at += p.shape[axis]
        padded = G.movement(p, lambda v, pads=pads: v.pad(pads))
        out = padded if out is None else G.binary("add", out, padded)
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_a_concatenation_runs_in_pieces_with_its_masks_folded(threads):
    """A concatenation's reader loads every part under a mask per element. Where the masks depend
    on one axis alone, that axis's loop runs in pieces, one per part, each load unmasked
    (`KernelEmitter._pieces`): a 3x3 max pool reading parts joined along channels (the axis threads
    split), and an exp2 reading parts joined along a middle axis."""
    from eclat.backends.cpu.emitter import KernelEmitter

    parts = [G.input_(f"c{j}", (n, 9, 11)) for j, n in enumerate((5, 3, 2))]
    joined = _cat(parts, 0)
    windows = View.make((10, 4, 5, 3, 3), (99, 22, 2, 11, 1))
    pool = G.reduce("max_reduce", G.reduce("max_reduce", G.view(joined, windows), 4), 3)
    rows = [G.input_(f"r{j}", (4, n, 16)) for j, n in enumerate((6, 1, 9))]
    middle = G.unary("exp2", _cat(rows, 1))
    graph = G.Graph(parts + rows, [pool, middle], {})
    program = group(graph)
    pieces = {k.out: len(KernelEmitter(None, k, program.buffers, {}, 8)._pieces(k.body, axis))
              for k in program.kernels for axis in range(len(k.shape) - 1)
              if len(KernelEmitter(None, k, program.buffers, {}, 8)._pieces(k.body, axis)) > 1}
    assert list(pieces.values()) == [3, 3], pieces
    inputs = [rand(n, 9, 11) for n in (5, 3, 2)] + [rand(4, n, 16) for n in (6, 1, 9)]
    exe = on_two_threads(program) if threads > 1 else CpuExecutable(program)
    for got, want in zip(exe.run(inputs), run(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_concatenation_along_the_innermost_axis_runs_in_pieces_that_vectorise():
    """relu(g) * cat(i, c) along the last axis (a gated block's channels-last concatenation, RoPE's
    rotate-half): the row runs in one loop per part, each load unmasked, so each vectorises; with a
    mask per element it stayed scalar (a 3136x128 GELU gate 799 -> 132 us, znver4)."""
    g, i, c = (G.input_(name, (40, n)) for name, n in (("g", 128), ("i", 48), ("c", 80)))
    gate = G.binary("max", g, G.expand_to(G.const(0.0), g.shape))
    graph = G.Graph([g, i, c], [G.binary("mul", gate, _cat([i, c], 1))], {})
    program = check(graph, [rand(40, 128), rand(40, 48), rand(40, 80)])
    (kern,) = program.kernels
    code = kernel_code(program, kern)
    # each part's loads are plain vector loads (masked per element, they were masked gathers)
    assert "masked.gather" not in code and len(re.findall(r"= load <\d+ x float>", code)) >= 3


@pytest.mark.parametrize("threads", [1, 2])
def test_reads_transposed_along_the_row_are_staged_a_block_of_rows_at_a_time(threads):
    """A channels-first value read channels-last (x[c, p] as [p, c]: a transpose, and a LayerNorm
    over channels whose sums read it the same way) is staged for STAGE_ROWS rows at a time: a line
    of each channel copied into a tile on the stack, which the rows read, the rows' sums and maxima
    taken for the block together along it (a 48x1024 transpose 147 -> 27 us, the LayerNorm 417 ->
    65 us, znver4); so is one whose rows step by a few (a patch's pixels interleaved, MobileViT's
    unfolding: its LayerNorms 385 -> 146-219 us). Rows that fill no block (70 = 4 x 16 + 6) read in
    place; an outer axis (a batch, a patch's phase) is bound while the tiles fill. Values match
    the interpreter, NaN and infinities too."""
    from eclat.backends.cpu.emitter import STAGE_ROWS

    c, rows = 40, 70
    x = G.input_("x", (2, c, rows))
    xt = G.movement(x, lambda v: v.permute([0, 2, 1]))  # [2, rows, c], read across c with a stride
    mean = G.binary("mul", G.reduce("sum", xt, 2), G.expand_to(G.const(-1.0 / c), (2, rows)))
    centred = G.binary("add", xt, G.movement(mean, lambda v: v.reshape((2, rows, 1)).expand((2, rows, c))))
    peak = G.binary("mul", G.reduce("max_reduce", xt, 2), G.expand_to(G.const(-1.0), (2, rows)))
    below = G.binary("add", xt, G.movement(peak, lambda v: v.reshape((2, rows, 1)).expand((2, rows, c))))
    # a patch's pixels interleaved (MobileViT's unfolding): the rows step by 4, each phase an outer axis
    y = G.input_("y", (c, rows * 4))
    patches = G.view(y, View.make((4, rows, c), (1, 4, rows * 4)))
    outs = [G.binary("mul", xt, G.expand_to(G.const(2.0), xt.shape)), centred, below,
            G.binary("mul", patches, G.expand_to(G.const(3.0), patches.shape))]
    graph = G.Graph([x, y], outs, {})
    inputs = [rand(2, c, rows), rand(c, rows * 4)]
    inputs[0][0, 3, 5], inputs[0][1, 7, 20], inputs[0][1, :, 33] = np.nan, np.inf, -np.inf
    program = group(graph)
    exe = on_two_threads(program) if threads > 1 else CpuExecutable(program)
    for got, want in zip(exe.run(inputs), run(graph, inputs)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    for kern in program.kernels:  # the tile: a line per channel, four for the patches'
        step = 4 if kern.shape[0] == 4 else 1
        emitted = kernel_code(program, kern, optimised=False)
        assert f"alloca float, i32 {c * STAGE_ROWS * step}" in emitted, kern.body


def test_a_sum_over_channels_4_kb_apart_runs_in_passes():
    """A one-row kernel summing 48 channels of a [48, 1024] value reads 48 streams 4 KB apart, all in
    one L1 set: unrolled, they evicted each other (144 us). Its terms run in passes of a few over a
    row of accumulators (2.7 us, znver4), the row a thread's part of the kernel."""
    x = G.input_("x", (48, 1024))
    graph = G.Graph([x], [G.reduce("sum", x, 0)], {})
    inputs = [rand(48, 1024)]
    program = check(graph, inputs, rtol=1e-5, atol=1e-5)
    (kern,) = program.kernels
    assert "alloca float, i32 1024" in kernel_code(program, kern, optimised=False)  # the row of accumulators
    np.testing.assert_allclose(on_two_threads(program).run(inputs)[0], inputs[0].sum(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight", [True, False])
def test_a_product_with_few_columns_runs_transposed(weight):
    """W[64, 96] @ P[96, 4] (a convolution over 4 pixels) fills 4 of a tile's 16 or 32 columns; its
    default schedule turns the tile (`Schedule.transposed`: the vectors run along W's 64 rows, W
    packed as the right operand), and every schedule of its space gives the same values."""
    w = rand(64, 96)
    left = G.weight("w", w, DType.float32) if weight else G.input_("w", (64, 96))
    p = G.input_("p", (96, 4))
    relu = G.binary("max", matmul(left, p), G.expand_to(G.const(0.0), (64, 4)))
    graph = G.Graph([p] if weight else [left, p], [relu], {"w": w} if weight else {})
    inputs = [rand(96, 4)] if weight else [w, rand(96, 4)]
    want = run(graph, inputs)[0]
    program = group(graph)
    (kern,) = program.kernels
    assert default_schedule(kern).transposed
    space = schedule_space(kern)
    assert any(not s.transposed for s in space)
    for s in space:
        kern.schedule = s
        got = CpuExecutable(program).run(inputs)[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("width", [5, 7, 14])
def test_rows_shorter_than_the_vectoriser_likes_run_as_masked_vectors(width):
    """exp2 over [6, 7, width] read through a slice of wider rows (a depthwise convolution's output
    without its padding columns): the rows neither merge into one flat axis nor fill a whole
    number of vectors, so each runs as vectors with the lanes past its end masked off
    (`loop_hint`), a row in one iteration of as many vectors as it needs (masks known when
    compiling), and matches the interpreter, infinities and NaN included."""
    import llvmlite.ir as ir

    from eclat.backends.cpu.emitter import loop_hint

    for lanes in (8, 16):
        hint = ir.Module(name="h")
        loop_hint(hint, 1, lanes, width)
        text = "\n".join(str(m) for m in hint.metadata)
        vector = min(lanes, 1 << (width - 1).bit_length())
        assert f'"llvm.loop.vectorize.width", i32 {vector}' in text and "predicate.enable" in text
        assert f'"llvm.loop.interleave.count", i32 {-(-width // vector)}' in text

    x = G.input_("x", (6, 7, width + 4))
    out = G.unary("exp2", G.movement(x, lambda v: v.slice(2, 0, width)))
    graph = G.Graph([x], [out], {})
    xs = rand(6, 7, width + 4)
    xs[0, 0, 0], xs[1, 2, 3], xs[2, 3, 4] = np.inf, -np.inf, np.nan
    program, (got,) = compiled(graph, [xs])
    np.testing.assert_allclose(got, run(graph, [xs])[0], rtol=1e-6, equal_nan=True)
    (kern,) = program.kernels
    assert "llvm.masked.load" in kernel_code(program, kern)


@pytest.mark.parametrize("width, lanes, vector", [(28, 16, 8), (14, 16, 4), (14, 8, 4), (56, 16, 8),
                                                 (64, 16, 0), (7, 16, 4)])
def test_rows_read_with_a_stride_run_the_vectors_that_fit_them(width, lanes, vector):
    """An output row read with a stride (a stride-2 depthwise convolution's 28 pixels) runs vectors
    of the width leaving the fewest iterations: 3 of 8 and 4 scalars, not 1 of 16 and 12 scalars
    (`_row_width`; 0: the vectoriser's own choice). The hint names that width; a loop that is not
    such a row keeps the vectoriser's choice. A stride-2 row of 28 matches the interpreter."""
    import llvmlite.ir as ir

    from eclat.backends.cpu.emitter import _row_width, loop_hint

    assert _row_width(lanes, width) == vector

    def hint(strided_row: bool) -> str:
        mod = ir.Module(name="k")
        loop_hint(mod, 1, lanes, width, True, strided_row)
        return "\n".join(str(m) for m in mod.metadata)
    row, other = hint(True), hint(False)
    assert ('"llvm.loop.vectorize.width", i32 ' + str(vector)) in row if vector else "width" not in row
    assert "width" not in other
    x = G.input_("x", (6, 5, 2 * width))
    out = G.unary("exp2", G.movement(x, lambda v: v.slice(2, 0, 2 * width, 2)))
    xs = rand(6, 5, 2 * width)
    graph = G.Graph([x], [out], {})
    np.testing.assert_allclose(compiled(graph, [xs])[1][0], run(graph, [xs])[0], rtol=1e-6)


def test_a_kernel_function_is_emitted_once_per_process(monkeypatch):
    """Another program with the same kernels (a compile's next candidate, a tuner's trial) reuses
    their emitted functions (`codegen._function`) and compiled code, and runs the same."""
    from eclat.backends.cpu.emitter import KernelEmitter

    w = rand(8, 9)
    x = G.input_("x", (5, 8))
    y = matmul(x, G.weight("w", w, DType.float32))
    graph = G.Graph([x], [G.unary("sqrt", G.binary("mul", y, y))], {"w": w})
    xs = rand(5, 8)
    first = compiled(graph, [xs])[1][0]
    emitted = []
    real = KernelEmitter.function
    monkeypatch.setattr(KernelEmitter, "function", lambda em, name: emitted.append(name) or real(em, name))
    program, (again,) = compiled(graph, [xs])
    assert emitted == [] and len(program.kernels) >= 1
    np.testing.assert_array_equal(again, first)
    np.testing.assert_allclose(again, run(graph, [xs])[0], rtol=1e-5)


def test_packed_forms_are_shared_by_content_and_freed_with_their_last_reader():
    """Two programs' own copies of one weight (each made its transposed layout) read one packed
    form; a form no executable holds any more (a tile a search discarded) is not kept."""
    import gc

    from eclat.backends.cpu.contraction import packed_panels
    from eclat.compiler import derived as cache
    from eclat.ir.symbolic import Var

    n, k = Var("n"), Var("k")
    w = np.random.default_rng(0).standard_normal(24 * 40).astype(np.float32)
    index = n * 40 + k  # w as [24, 40] read transposed: panels over n
    first = packed_panels(w, index, "n", "k", 24, 40, 16)
    again = packed_panels(w.copy(), index, "n", "k", 24, 40, 16)
    assert again[0] is first[0]
    np.testing.assert_array_equal(first[0].reshape(2, 40, 16)[1, :, :8], w.reshape(24, 40)[16:].T)
    assert not first[0].reshape(2, 40, 16)[1, :, 8:].any()  # zero past the last column
    held = {key for key, (_, refs) in cache._DERIVED.items() if any(r() is first[0] for r in refs)}
    assert len(held) == 1
    del first, again
    gc.collect()
    assert not held & cache._DERIVED.keys()  # other tests' forms may go at this collect too
    assert packed_panels(w, index, "n", "k", 24, 40, 32)[0].size == 40 * 32


def test_a_weight_and_a_transposed_view_of_it_read_one_packed_form():
    """The prefill reads a Linear's weight as it is stored, the decode a view laid out for its one-row
    products (rewrites.layout): one matrix, so one packed form, packed from the stored array."""
    from eclat.backends.cpu.contraction import packed_panels
    from eclat.ir.symbolic import Var
    from eclat.ir.view import View
    from eclat.rewrites.layout import laid_out

    n, k = Var("n"), Var("k")
    w = np.random.default_rng(1).standard_normal((40, 24)).astype(np.float32)  # [K, N]
    stored = packed_panels(w, k * 24 + n, "n", "k", 24, 40, 16)
    view = laid_out(w, View.contiguous((40, 24)).permute([1, 0]))  # [N, K], read n * 40 + k
    assert packed_panels(view, n * 40 + k, "n", "k", 24, 40, 16)[0] is stored[0]
    np.testing.assert_array_equal(stored[0].reshape(2, 40, 16)[0], w[:, :16])
    # a view whose reduction walks two of its axes ([4, 24, 10] read as [4, 240]): packed as it reads
    deep = laid_out(w.reshape(4, 10, 24), View.contiguous((4, 10, 24)).permute([0, 2, 1]))
    odd = packed_panels(deep, n * 240 + k, "n", "k", 4, 240, 16)
    np.testing.assert_array_equal(odd[0].reshape(240, 16)[:, :4], deep.reshape(4, 240).T)


def _windows(x: G.Node, taps: tuple[int, ...], dilation: int = 1) -> G.Node:
    """x [C, *spatial] read as [C, *outputs, *taps] sliding windows (stride 1, no padding)."""
    c, *spatial = x.shape
    outs = [n - dilation * (t - 1) for n, t in zip(spatial, taps)]
    strides = View.contiguous(x.shape).strides
    taps_strides = [dilation * s for s in strides[1:]]
    return G.view(x, View.make((c, *outs, *taps), (strides[0], *strides[1:], *taps_strides)))


@pytest.mark.parametrize("spatial, taps, dilation, op", [
    ((20, 30), (9, 9), 1, "sum"),  # a 9x9 depthwise convolution: 81 taps, past unrolling
    ((22, 40), (9, 9), 2, "sum"),  # dilated
    ((9, 1040), (9, 9), 1, "sum"),  # a row past PASS_ROW: a segment and a short one
    ((14, 60), (13, 13), 1, "max_reduce"),  # a 13x13 max pool: NaN and -inf among the terms
])
def test_reductions_too_long_to_unroll_run_in_passes_along_the_row(spatial, taps, dilation, op):
    """A reduction along a row too long to unroll (a large depthwise convolution's taps, a large
    pooling window) accumulates in a row of the stack, a chunk of its terms per pass, so that the
    loop along the row vectorises (9.8 -> 0.26 ms for a 9x9 depthwise convolution at 28x28 with 96
    channels): the kernel's optimised code holds vector arithmetic along the row, and it matches
    the interpreter, NaN and infinities included."""


    c = 3
    x = G.input_("x", (c, *spatial))
    win = _windows(x, taps, dilation)
    if op == "sum":
        w = G.input_("w", (c, *taps))
        lifted = G.movement(w, lambda v: v.reshape((c, *[1] * len(spatial), *taps)).expand(win.shape))
        out = G.binary("mul", win, lifted)
        args = [rand(c, *spatial), rand(c, *taps)]
    else:
        out, args = win, [rand(c, *spatial)]
        args[0][0, 3, 4], args[0][1, 5, 6] = np.nan, -np.inf
    for _ in taps:
        out = G.reduce(op, out, len(out.shape) - 1)
    graph = G.Graph([x, w] if op == "sum" else [x], [out], {})
    program = check(graph, args, rtol=1e-5, atol=1e-5)
    (kern,) = program.kernels
    code = kernel_code(program, kern)
    # the loop along the row vectorised, a vector op per term (not a loop over the taps per element)
    assert len(re.findall(r"= (?:tail call|call) <\d+ x float>", code)) >= math.prod(taps) - 1


def test_a_strided_depthwise_convolutions_phases_run_in_passes_when_together_too_long():
    """A stride-2 11x11 depthwise convolution runs as four stride-1 ones over the input's phase
    planes (5x5 to 6x6 taps each): each unrolls, but 121 taps in one body left LLVM's vectoriser
    mostly scalar (372 -> 79 us at 144 channels and 14x14, znver4). Together past ROW_OPS, they
    accumulate in passes: the code holds a vector multiply-add per tap, and matches torch."""
    import torch

    import eclat

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(16, 16, 11, stride=2, padding=5, groups=16).eval()
    x = torch.randn(1, 16, 40, 40)
    # k=1: "none" still races two candidates, and the second splits the planes over two kernels
    compiled = eclat.compile(conv, (x,), target="cpu", autotune="none", k=1, quiet=True)
    np.testing.assert_allclose(compiled(x.numpy()), conv(x).detach().numpy(), rtol=1e-4, atol=1e-5)
    program = compiled.executable.program
    (kern,) = [k for k in program.kernels if len(reduces(k.body)) >= 4]
    assert len(re.findall(r"fmuladd\.v\d+f32\(", kernel_code(program, kern))) >= 121
