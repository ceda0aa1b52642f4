"""The composite ops the rewrites introduce. Each has an exact decomposition into primitives
(`eclat.ir.graph.decompose_composites`), so a backend that does not know one still runs it.

- matmul(a, b): a [*B, M, K], b [*B, K, N] -> [*B, M, N], same batch dims B (0 or more; any
  broadcast of a batch dim is an expand view on the operand). Sums over K in the operand dtype.
- fma(a, b, c): a * b + c, elementwise, all operands one shape and dtype (may round once).
- rsqrt(x): 1 / sqrt(x), elementwise, float.
- softmax(x, axis, safe): exp(x - max) / sum(exp(x - max)) along axis (arg = (axis, safe)); exp as
  exp2 of x * log2(e), as the frontend writes it. A row of -inf is NaN, as in torch.softmax; safe
  makes it 0, as torch's scaled_dot_product_attention has it (its "safe softmax").
- rmsnorm(x, axis, scale, eps): x / sqrt(sum(x * x along axis) * scale + eps), the sum
  broadcast back along axis (arg = (axis, scale, eps); scale is 1/n for a mean).
- layernorm(x, w, b, axis, scale, eps): rmsnorm(y - sum(y along axis) * scale) * w + b for
  y = x - p (p the row's first element: `center`), broadcast back along axis; w and b have x's
  shape (a broadcast view of a [D] weight; a constant 1 / 0 when the norm has no affine part,
  which the decomposition leaves out).
- attend(x, v, axis, vp, safe): matmul(view(softmax(x, axis, safe), vp), v), a softmax contracted
  with values along its own axis, whatever computed x (arg = (axis, vp, safe)): the form the e-graph
  derives (rewrites/online.py) for one pass over the keys with a running max and a rescaled sum,
  which grouping runs as one kernel where the target has one (compiler/group.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType, accumulator
from ..ir.graph import LOG2E, Graph, Node
from ..ir.interpreter import bind_dims, read_view
from ..ir.symbolic import sym_eq
from ..ir.view import View


def _same(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(sym_eq(x, y) for x, y in zip(a, b))


def matmul(a: Node, b: Node) -> Node:
    if len(a.shape) < 2 or len(b.shape) != len(a.shape):
        raise ValueError(f"matmul needs [*B, M, K] and [*B, K, N], got {list(a.shape)} and {list(b.shape)}")
    if not _same(a.shape[:-2], b.shape[:-2]) or not sym_eq(a.shape[-1], b.shape[-2]):
        raise ValueError(f"matmul operand shapes differ: {list(a.shape)} @ {list(b.shape)}")
    if a.dtype is not b.dtype:
        raise TypeError(f"matmul operand dtypes differ: {a.dtype.short} and {b.dtype.short}")
    return Node("matmul", (a, b), None, (*a.shape[:-1], b.shape[-1]), a.dtype)


def _decompose_matmul(node: Node) -> Node:
    a, b = node.srcs
    *batch, m, k = a.shape
    n = b.shape[-1]
    nb = len(batch)
    full = (*batch, m, n, k)
    a2 = g.movement(a, lambda v: v.reshape((*batch, m, 1, k)).expand(full))
    order = [*range(nb), nb + 1, nb]  # [*B, K, N] -> [*B, N, K]
    b2 = g.movement(b, lambda v: v.permute(order).reshape((*batch, 1, n, k)).expand(full))
    return g.reduce("sum", g.binary("mul", a2, b2), -1)


def fma(a: Node, b: Node, c: Node) -> Node:
    g.binary("add", g.binary("mul", a, b), c)  # checks shapes and dtypes
    return Node("fma", (a, b, c), None, a.shape, a.dtype)


def products_once(graph: Graph) -> Graph:
    """graph with every Fma whose product the program also computes alone made an add of that
    product. Fused, the product is unrounded there and rounded elsewhere, so a value compared with
    or truncated against itself disagrees with itself (frac(a * b), which is a * b - trunc(a * b),
    came out negative). A negated operand counts as the same product (negation is exact)."""
    def bare(x: Node) -> Node:
        return x.srcs[0] if x.op == "neg" else x

    def key(a: Node, b: Node) -> frozenset:
        return frozenset((id(bare(a)), id(bare(b))))

    def negative(a: Node, b: Node) -> bool:
        return (a.op == "neg") != (b.op == "neg")

    nodes = graph.nodes()
    alone = {key(*n.srcs): n for n in nodes if n.op == "mul"}
    if not any(n.op == "fma" and key(*n.srcs[:2]) in alone for n in nodes):
        return graph
    new: dict[int, Node] = {}

    def rebuilt(n: Node) -> Node:  # the product alone may come after the Fma in the graph's order
        if id(n) in new:
            return new[id(n)]
        srcs = [rebuilt(s) for s in n.srcs]
        product = alone.get(key(*n.srcs[:2])) if n.op == "fma" else None
        if product is not None:
            term = rebuilt(product)
            if negative(*n.srcs[:2]) != negative(*product.srcs):
                term = g.unary("neg", term)
            out = g.binary("add", term, srcs[2])
        elif all(a is b for a, b in zip(srcs, n.srcs)):
            out = n
        else:
            out = Node(n.op, tuple(srcs), n.arg, n.shape, n.dtype)
        new[id(n)] = out
        return out

    for n in nodes:  # sources first: the recursion stays shallow
        rebuilt(n)
    return dataclasses.replace(graph, outputs=[new[id(o)] for o in graph.outputs])


def rsqrt(x: Node) -> Node:
    g.unary("sqrt", x)
    return Node("rsqrt", (x,), None, x.shape, x.dtype)


g.register("matmul", "composite",
           lambda node, a, b: np.matmul(a, b, dtype=accumulator(node.dtype)).astype(node.dtype.np,
                                                                                       copy=False),
           decompose=_decompose_matmul)
g.register("fma", "composite", lambda node, a, b, c: (a * b + c).astype(node.dtype.np, copy=False),
           decompose=lambda n: g.binary("add", g.binary("mul", n.srcs[0], n.srcs[1]), n.srcs[2]))
g.register("rsqrt", "composite",
           lambda node, x: np.reciprocal(np.sqrt(x, dtype=node.dtype.np), dtype=node.dtype.np),
           decompose=lambda n: g.unary("recip", g.unary("sqrt", n.srcs[0])))



def _keep_expand(t: Node, axis: int, full: tuple) -> tuple[Node, Callable[[Node], Node]]:
    """A reduction's result t broadcast back along axis, through a keepdim view as torch has it."""
    kept = g.movement(t, lambda v: v.reshape((*full[:axis], 1, *full[axis + 1:])))
    return kept, lambda x: g.movement(x, lambda v: v.expand(full))


def softmax(x: Node, axis: int, safe: bool = False) -> Node:
    g.unary("exp2", x)
    return Node("softmax", (x,), (axis % len(x.shape), bool(safe)), x.shape, x.dtype)


def _softmax_prims(x: Node, axis: int, safe: bool) -> Node:
    full = tuple(x.shape)
    m, expand = _keep_expand(g.reduce("max_reduce", x, axis), axis, full)
    shifted = g.binary("add", x, expand(g.unary("neg", m)))
    e = g.unary("exp2", g.binary("mul", shifted, g.expand_to(g.const(LOG2E, x.dtype), full)))
    total, _ = _keep_expand(g.reduce("sum", e, axis), axis, full)
    out = g.binary("mul", e, expand(g.unary("recip", total)))
    if not safe:
        return out
    # the row is -inf throughout where its max is -inf: not above -inf, yet below +inf (NaN is neither)
    c = lambda v, dtype=x.dtype: g.expand_to(g.const(v, dtype), m.shape)
    dead = g.where(g.binary("lt", c(-math.inf), m), c(False, DType.bool), g.binary("lt", m, c(math.inf)))
    return g.where(expand(dead), g.expand_to(g.const(0.0, x.dtype), full), out)


def _softmax_numpy(node: Node, x: np.ndarray) -> np.ndarray:
    axis, safe = node.arg
    with np.errstate(all="ignore"):
        e = np.exp2((x - np.max(x, axis=axis, keepdims=True)) * x.dtype.type(LOG2E))
        out = e * np.reciprocal(np.sum(e, axis=axis, keepdims=True))
    if safe:
        out = np.where(np.all(x == -np.inf, axis=axis, keepdims=True), x.dtype.type(0), out)
    return out.astype(node.dtype.np)


def rmsnorm(x: Node, axis: int, scale: float, eps: float) -> Node:
    g.unary("sqrt", x)
    return Node("rmsnorm", (x,), (axis % len(x.shape), float(scale), float(eps)), x.shape, x.dtype)


def _decompose_rmsnorm(node: Node) -> Node:
    (x,), (axis, scale, eps), full = node.srcs, node.arg, tuple(node.shape)
    ms, expand = _keep_expand(g.reduce("sum", g.binary("mul", x, x), axis), axis, full)
    c = lambda v: g.expand_to(g.const(v, x.dtype), ms.shape)
    r = g.unary("recip", g.unary("sqrt", g.binary("add", g.binary("mul", ms, c(scale)), c(eps))))
    return g.binary("mul", x, expand(r))


def _rmsnorm_numpy(node: Node, x: np.ndarray) -> np.ndarray:
    axis, scale, eps = node.arg
    t = x.dtype.type
    ms = np.sum(x * x, axis=axis, keepdims=True) * t(scale) + t(eps)
    return (x * np.reciprocal(np.sqrt(ms))).astype(node.dtype.np)


def center(x: Node, axis: int, scale: float) -> Node:
    """x - mean as the frontend takes it: y - sum(y along axis) * scale for y = x - p, p the row's
    first element. A constant row's deviations are then exactly 0, as torch's (sum(x) * scale
    rounds off a constant row's value: LayerNorm of 3.7s gave 7e-4, not 0)."""
    full = tuple(x.shape)
    pivot = g.movement(x, lambda v: v.shrink([(0, 1) if k == axis else (0, n) for k, n in enumerate(full)]))
    spread = lambda t: g.movement(t, lambda v: v.expand(full))  # noqa: E731
    y = g.binary("add", x, spread(g.unary("neg", pivot)))
    total, _ = _keep_expand(g.reduce("sum", y, axis), axis, full)
    shift = g.binary("mul", total, g.expand_to(g.const(scale, x.dtype), total.shape))
    return g.binary("add", y, spread(g.unary("neg", shift)))


def layernorm(x: Node, w: Node, b: Node, axis: int, scale: float, eps: float) -> Node:
    g.binary("add", g.binary("mul", g.unary("sqrt", x), w), b)  # checks shapes and dtypes
    return Node("layernorm", (x, w, b), (axis % len(x.shape), float(scale), float(eps)), x.shape, x.dtype)


def _constant(n: Node, value: float) -> bool:
    src = n.srcs[0] if n.op == "view" else n
    return src.op == "const" and src.arg[0] == value


def _decompose_layernorm(node: Node) -> Node:
    (x, w, b), (axis, scale, eps) = node.srcs, node.arg
    y = rmsnorm(center(x, axis, scale), axis, scale, eps)
    y = y if _constant(w, 1.0) else g.binary("mul", y, w)
    return y if _constant(b, 0.0) else g.binary("add", y, b)


def _layernorm_numpy(node: Node, x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    axis, scale, eps = node.arg
    t = x.dtype.type
    y = x + -np.take(x, [0], axis=axis)
    c = y + -(np.sum(y, axis=axis, keepdims=True) * t(scale))
    ms = np.sum(c * c, axis=axis, keepdims=True) * t(scale) + t(eps)
    return (c * np.reciprocal(np.sqrt(ms)) * w + b).astype(node.dtype.np)


def attend(x: Node, v: Node, axis: int, vp: View, safe: bool) -> Node:
    """matmul(view(softmax(x, axis, safe), vp), v): a softmax contracted with values along its own
    axis, whatever computed x."""
    out = matmul(g.view(softmax(x, axis, safe), vp), v)  # checks shapes
    return Node("attend", (x, v), (axis % len(x.shape), vp, bool(safe)), out.shape, x.dtype)


def _decompose_attend(node: Node) -> Node:
    (x, v), (axis, vp, safe) = node.srcs, node.arg
    return matmul(g.view(softmax(x, axis, safe), vp), v)


def _attend_numpy(node: Node, x: np.ndarray, v: np.ndarray) -> np.ndarray:
    axis, vp, safe = node.arg
    env = bind_dims(SimpleNamespace(inputs=node.srcs), [x, v])
    p = _softmax_numpy(SimpleNamespace(arg=(axis, safe), dtype=node.dtype), x)
    return np.matmul(read_view(p.reshape(-1), vp, env), v).astype(node.dtype.np)


g.register("attend", "composite", _attend_numpy, decompose=_decompose_attend)
g.register("softmax", "composite", _softmax_numpy,
           decompose=lambda n: _softmax_prims(n.srcs[0], *n.arg))
g.register("rmsnorm", "composite", _rmsnorm_numpy, decompose=_decompose_rmsnorm)
g.register("layernorm", "composite", _layernorm_numpy, decompose=_decompose_layernorm)

# the non-operand constructor arguments of a composite, from its node.arg
COMPOSITE_ARGS: dict[str, Callable[[object], tuple]] = {"softmax": tuple, "rmsnorm": tuple,
                                                        "layernorm": tuple, "attend": tuple}
BUILDERS = {"matmul": matmul, "fma": fma, "rsqrt": rsqrt, "softmax": softmax, "rmsnorm": rmsnorm,
             "layernorm": layernorm, "attend": attend}


def build_composite(op: str, args: Sequence[Node]) -> Node:
    return BUILDERS[op](*args)
