"""Hand-built primitive graphs that exercise every GPU lowering path (shared by the OpenCL,
CUDA and Metal tests): each case is (name, graph, inputs)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

import eclat.rewrites.composites  # noqa: F401  (registers the fma composite)
from eclat.backends.gpu import GpuSchedule, gpu_schedule_space, with_variants
from eclat.backends.gpu.packing import pack_weights
from eclat.compiler.group import group
from eclat.compiler.kernel import Program
from eclat.ir import graph as g
from eclat.ir.dtypes import DType, round_bfloat16
from eclat.ir.graph import Graph, Node
from eclat.ir.interpreter import run
from eclat.ir.view import View

RNG = np.random.default_rng(0)


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def matmul(a: Node, b: Node) -> Node:
    """[..., M, K] @ [..., K, N] from primitives (expand, mul, sum)."""
    *batch, m, k = a.shape
    n = b.shape[-1]
    full = (*batch, m, k, n)
    a3 = g.movement(a, lambda v: v.reshape((*batch, m, k, 1)).expand(full))
    b3 = g.movement(b, lambda v: v.reshape((*batch, 1, k, n)).expand(full))
    return g.reduce("sum", g.binary("mul", a3, b3), -2)


def softmax(x: Node) -> Node:
    rows = x.shape[:-1]
    mx = g.expand_to(g.movement(g.reduce("max_reduce", x, -1), lambda v: v.reshape((*rows, 1))), x.shape)
    e = g.unary("exp2", g.binary("mul", g.binary("add", x, g.unary("neg", mx)),
                                 g.expand_to(g.const(1.4426950408889634), x.shape)))
    s = g.expand_to(g.movement(g.reduce("sum", e, -1), lambda v: v.reshape((*rows, 1))), x.shape)
    return g.binary("mul", e, g.unary("recip", s))


def layer_norm(x: Node) -> Node:
    n = x.shape[-1]
    rows = x.shape[:-1]

    def mean(y: Node) -> Node:
        s = g.movement(g.reduce("sum", y, -1), lambda v: v.reshape((*rows, 1)))
        return g.expand_to(g.binary("mul", s, g.expand_to(g.const(1.0 / n), s.shape)), x.shape)

    d = g.binary("add", x, g.unary("neg", mean(x)))
    var = mean(g.binary("mul", d, d))
    eps = g.expand_to(g.const(1e-5), x.shape)
    return g.binary("mul", d, g.unary("recip", g.unary("sqrt", g.binary("add", var, eps))))


def elementwise() -> tuple[Graph, list[np.ndarray]]:
    x = g.input_("x", (8, 64))
    b = g.weight("b", _rand(64), DType.float32)
    y = g.binary("add", x, g.expand_to(b, x.shape))
    z = g.binary("max", g.unary("sin", y), g.unary("exp2", g.unary("neg", y)))
    w = g.binary("mul", z, g.unary("sqrt", g.binary("mul", y, y)))
    return Graph([x], [w, g.unary("recip", g.binary("add", w, g.expand_to(g.const(3.0), w.shape)))],
                 {"b": _rand(64)}), [_rand(8, 64)]


def reductions() -> tuple[Graph, list[np.ndarray]]:
    x = g.input_("x", (6, 300))
    y = g.input_("y", (3, 50, 5))
    outs = [g.reduce("sum", x, -1), g.reduce("max_reduce", x, 1), g.reduce("sum", y, 1),
            g.reduce("max_reduce", y, 2),
            g.reduce("sum", g.movement(x, lambda v: v.reshape((1800,))), 0),  # to a scalar
            softmax(x), layer_norm(y)]
    return Graph([x, y], outs, {}), [_rand(6, 300), _rand(3, 50, 5)]


def views() -> tuple[Graph, list[np.ndarray]]:
    x = g.input_("x", (5, 9))
    padded = g.movement(x, lambda v: v.pad(((1, 2), (3, 0))))  # masked
    flipped = g.movement(x, lambda v: v.flip((1,)))  # negative stride
    stepped = g.movement(x, lambda v: v.slice(1, 1, 9, 3))  # every third column
    back = g.movement(x, lambda v: v.slice(0, 4, -1, -2))  # negative step
    t = g.movement(x, lambda v: v.permute((1, 0)))
    outs = [g.binary("add", padded, padded), g.binary("mul", flipped, flipped), g.contiguous(stepped),
            g.unary("neg", back), g.reduce("sum", g.unary("exp2", t), 0)]
    return Graph([x], outs, {}), [_rand(5, 9)]


def gather() -> tuple[Graph, list[np.ndarray]]:
    table = _rand(10, 4)
    w = g.weight("table", table, DType.float32)
    idx = g.input_("idx", (2, 3), DType.int32)
    out = g.gather(w, idx)
    return Graph([idx], [g.binary("mul", out, out)], {"table": table}), \
        [np.array([[0, 9, -3], [12, 4, 4]], dtype=np.int32)]


def matmuls() -> tuple[Graph, list[np.ndarray]]:
    a, b = g.input_("a", (37, 29)), g.input_("b", (29, 45))
    bias = _rand(45)
    wb = g.weight("bias", bias, DType.float32)
    mm = matmul(a, b)
    zero = g.expand_to(g.const(0.0), mm.shape)
    relu = g.binary("max", g.binary("add", mm, g.expand_to(wb, mm.shape)), zero)
    ba, bb = g.input_("ba", (3, 5, 7)), g.input_("bb", (3, 7, 9))
    v = g.input_("v", (1, 29))
    long_v, wt = g.input_("long_v", (2, 300)), g.input_("wt", (45, 300))  # a decode step, weight [n, k]
    wt_kn = g.movement(wt, lambda x: x.permute((1, 0)))
    graph = Graph([a, b, ba, bb, v, long_v, wt],
                  [relu, matmul(ba, bb), matmul(v, b), matmul(long_v, wt_kn)], {"bias": bias})
    shapes = [(37, 29), (29, 45), (3, 5, 7), (3, 7, 9), (1, 29), (2, 300), (45, 300)]
    return graph, [_rand(*s) for s in shapes]


def integers() -> tuple[Graph, list[np.ndarray]]:
    a, b = g.input_("a", (4, 40), DType.int32), g.input_("b", (4, 40), DType.int32)
    f = g.input_("f", (4, 40))
    q = g.binary("mod", a, b)  # C remainder, 0 where b == 0
    less = g.binary("lt", a, b)
    pick = g.where(less, a, b)
    wide = g.binary("mul", g.cast(a, DType.int64), g.cast(b, DType.int64))
    truncated = g.cast(f, DType.int32)
    bf = g.cast(g.cast(f, DType.bfloat16), DType.float32)
    fmod = g.binary("mod", f, g.expand_to(g.const(0.75), f.shape))
    ifma = g.Node("fma", (a, b, a), None, a.shape, DType.int32)  # integer fma from the GPU rewrites
    return Graph([a, b, f], [q, less, pick, wide, g.reduce("max_reduce", a, 1), g.reduce("sum", wide, 1),
                             truncated, bf, fmod, g.cast(f, DType.bool), ifma], {}), [
        RNG.integers(-50, 50, (4, 40)).astype(np.int32), RNG.integers(-3, 4, (4, 40)).astype(np.int32),
        (RNG.standard_normal((4, 40)) * 10).astype(np.float32)]


def halves() -> tuple[Graph, list[np.ndarray]]:
    """float16 in and out: computed in float registers, stored as half; the cast rounds to nearest
    even through subnormals, the largest half, overflow, infinities and NaN. bfloat16 in and out,
    stored as its 16 bits."""
    x, y = g.input_("x", (6, 300), DType.float16), g.input_("y", (300, 7), DType.float16)
    f, z = g.input_("f", (16,)), g.input_("z", (6, 300), DType.bfloat16)
    special = np.array([0.0, -0.0, 3e-8, 2.9802322e-08, 6.1e-05, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 65504.0,
                        65519.0, 65520.0, 7e4, -7e4, np.inf, -np.inf, np.nan, 1e-3], np.float32)
    half = g.expand_to(g.const(0.5, DType.float16), x.shape)
    outs = [g.binary("add", x, half), g.reduce("max_reduce", x, 1), g.reduce("sum", x, 1), matmul(x, y),
            g.cast(f, DType.float16), g.cast(x, DType.float32),
            g.binary("add", z, z), g.reduce("max_reduce", z, 1), g.cast(f, DType.bfloat16)]
    return Graph([x, y, f, z], outs, {}), [_rand(6, 300).astype(np.float16), _rand(300, 7).astype(np.float16),
                                           special, round_bfloat16(_rand(6, 300))]


def packed() -> tuple[Graph, list[np.ndarray]]:
    """Weights rounded to each low-precision format, read packed by products (a matrix times a
    weight, a row times a transposed one, a tied table also gathered row by row)."""
    from eclat.compiler.quantize import FORMATS, fake

    shapes = {"w8": ((64, 48), "int8", 0), "w4": ((40, 64), "int4", 1), "wb": ((64, 24), "bf16", 0),
              "table": ((50, 64), "int8", 1)}
    weights = {n: fake(_rand(*s), FORMATS[f], axis) for n, (s, f, axis) in shapes.items()}
    w = {n: g.weight(n, a, DType.float32) for n, a in weights.items()}
    x, v = g.input_("x", (9, 64)), g.input_("v", (1, 64))
    ids = g.input_("ids", (3,), DType.int32)

    def t(n: Node) -> Node:
        return g.movement(n, lambda view: view.permute((1, 0)))

    outs = [matmul(x, w["w8"]), matmul(v, t(w["w4"])), matmul(x, t(w["w4"])), matmul(x, w["wb"]),
            matmul(v, t(w["table"])), g.gather(w["table"], ids)]
    graph = Graph([x, v, ids], outs, weights, formats={n: (f, axis) for n, (_, f, axis) in shapes.items()})
    return graph, [_rand(9, 64), _rand(1, 64), np.array([0, 49, 7], np.int32)]


def attention() -> tuple[Graph, list[np.ndarray]]:
    """softmax(q k^T / 4 + causal mask) v and a decode row against soft-capped scores, each an attend
    (as the e-graph derives it: rewrites/online.py) and one kernel (the scores never written). 64
    queries a head: a group of 32 or 64 threads holds one head's queries, which stage the keys in
    shared memory together."""
    from eclat.rewrites import composites as c

    q, k, v, row = g.input_("q", (2, 64, 16)), g.input_("k", (2, 37, 16)), g.input_("v", (2, 37, 16)), \
        g.input_("row", (2, 1, 16))
    causal = np.where(np.arange(37)[None, :] <= np.arange(64)[:, None], 0, -np.inf).astype(np.float32)
    mask = g.movement(g.weight("causal", causal, DType.float32), lambda view: view.reshape((1, 64, 37)))
    kt = g.movement(k, lambda view: view.permute((0, 2, 1)))
    const = lambda x, shape: g.expand_to(g.const(x, DType.float32), shape)
    scores = g.binary("add", g.binary("mul", c.matmul(q, kt), const(0.25, (2, 64, 37))),
                      g.expand_to(mask, (2, 64, 37)))
    capped = g.binary("mul", g.unary("sin", g.binary("mul", c.matmul(row, kt), const(0.1, (2, 1, 37)))),
                      const(10.0, (2, 1, 37)))
    outs = [c.attend(x, v, -1, View.contiguous(x.shape), False) for x in (scores, capped)]
    return Graph([q, k, v, row], outs, {"causal": causal}), [_rand(2, 64, 16)] + \
        [_rand(2, 37, 16) for _ in range(2)] + [_rand(2, 1, 16)]


def _seeded(case: Callable[[], tuple[Graph, list[np.ndarray]]], seed: int) -> Callable:
    """case drawing its random values from its own seed: the same values whichever cases ran first."""
    def make() -> tuple[Graph, list[np.ndarray]]:
        global RNG
        RNG = np.random.default_rng(seed)
        return case()
    return make


CASES = {name: _seeded(case, seed) for seed, (name, case) in enumerate({
    "elementwise": elementwise, "reductions": reductions, "views": views, "gather": gather,
    "matmuls": matmuls, "integers": integers, "halves": halves, "packed": packed,
    "attention": attention}.items())}


def lowered(graph: Graph) -> Program:
    """graph as a GPU target runs it: grouped into kernels (attention as one), its formatted weights
    packed."""
    return pack_weights(group(graph, frozenset({"attention"})))


def compare(outs: list[np.ndarray], ref: list[np.ndarray], rtol: float = 1e-4, atol: float = 1e-5) -> None:
    assert len(outs) == len(ref)
    for j, (o, r) in enumerate(zip(outs, ref)):
        r = np.asarray(r)
        assert o.shape == r.shape and o.dtype == r.dtype, (j, o.shape, r.shape, o.dtype, r.dtype)
        if r.dtype.kind in "biu":
            np.testing.assert_array_equal(o, r, err_msg=f"output {j}")
        elif r.dtype == np.float16:  # rounded once from float registers, not after every op: a sum of
            # 300 products rounded to half apart from each other differs by about sqrt(300) half ulps
            np.testing.assert_allclose(o, r, rtol=4e-3, atol=1.5e-2, err_msg=f"output {j}")
        else:
            np.testing.assert_allclose(o, r, rtol=rtol, atol=atol, err_msg=f"output {j}")


def opencl_or_skip() -> None:
    """Skip the calling test where pyopencl or an OpenCL platform is missing, saying how to get one."""
    import pytest

    pytest.importorskip("pyopencl")
    from eclat.backends.opencl.runtime import context

    try:
        context()
    except Exception as e:  # no ICD or no platform
        pytest.skip(f"no OpenCL device ({e}); apt-get install -y pocl-opencl-icd ocl-icd-libopencl1",
                    allow_module_level=True)


def assert_zoo_model_matches_torch(name: str, target: str) -> None:
    """The zoo model compiled for target gives torch's outputs (rtol 1e-3, atol 1e-4)."""
    import warnings

    import torch

    import eclat
    from tests.zoo import ZOO

    model, inputs = ZOO[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = eclat.compile(model, inputs, target=target, autotune="none", k=1, quiet=True)
        with torch.no_grad():
            want = torch.utils._pytree.tree_leaves(model(*inputs))
    got = torch.utils._pytree.tree_leaves(fast(*inputs))
    assert len(got) == len(want)
    for g_, w in zip(got, want):
        np.testing.assert_allclose(g_.numpy(), w.numpy(), rtol=1e-3, atol=1e-4)


def sample(space: list[GpuSchedule]) -> list[GpuSchedule]:
    """The default and the first schedule of every other (strategy, vector) pair: every
    code path of the space, at a fraction of the PoCL build time."""
    out = space[:1]
    for s in space[1:]:
        if all((s.strategy, s.vector) != (o.strategy, o.vector) for o in out[1:]):
            out.append(s)
    return out


def check_schedule_space(make: Callable[[Program, dict[str, GpuSchedule]], object], case: str,
                         full: bool) -> None:
    """Every (or a sample of every) schedule of every kernel of case gives the default's values,
    and the defaults match the interpreter. make(program, schedules) -> an executable."""
    graph, inputs = CASES[case]()
    program = lowered(graph)
    spaces = {k.name: gpu_schedule_space(k) for k in program.kernels}
    prog, chosen, variants = with_variants(program, spaces if full else
                                           {name: sample(space) for name, space in spaces.items()})
    assert len(variants) >= 2 * len(program.kernels)
    outs = dict(zip(prog.outputs, make(prog, chosen).run(inputs)))
    compare([outs[o] for o in program.outputs], run(graph, inputs))
    default = {v.kernel: outs[v.out] for v in reversed(variants)}  # each kernel's first: its default
    for v in variants:
        np.testing.assert_allclose(outs[v.out], default[v.kernel], rtol=1e-4, atol=1e-5,
                                   err_msg=f"{v.name} with {v.schedule}")
    tried = {v.schedule.strategy for v in variants}
    assert case == "attention" or "flat" in tried and (case == "elementwise" or "row" in tried)
    assert case != "attention" or tried == {"attention", "decode"}
    assert case != "matmuls" or "tile" in tried
    assert case != "elementwise" or any(v.schedule.vector == 4 for v in variants)
