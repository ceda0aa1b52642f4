"""The composite ops the rewrites introduce. Each has an exact decomposition into primitives
(`eclat.ir.graph.decompose_composites`), so a backend that does not know one still runs it.

- matmul(a, b): a [*B, M, K], b [*B, K, N] -> [*B, M, N], same batch dims B (0 or more; any
  broadcast of a batch dim is an expand view on the operand). Sums over K in the operand dtype.
- fma(a, b, c): a * b + c, elementwise, all operands one shape and dtype (may round once).
- rsqrt(x): 1 / sqrt(x), elementwise, float.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..ir import graph as g
from ..ir.graph import Node
from ..ir.symbolic import sym_eq


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


def rsqrt(x: Node) -> Node:
    g.unary("sqrt", x)
    return Node("rsqrt", (x,), None, x.shape, x.dtype)


g.register("matmul", "composite",
           lambda node, a, b: np.matmul(a, b, dtype=node.dtype.np), decompose=_decompose_matmul)
g.register("fma", "composite", lambda node, a, b, c: (a * b + c).astype(node.dtype.np),
           decompose=lambda n: g.binary("add", g.binary("mul", n.srcs[0], n.srcs[1]), n.srcs[2]))
g.register("rsqrt", "composite",
           lambda node, x: np.reciprocal(np.sqrt(x, dtype=node.dtype.np), dtype=node.dtype.np),
           decompose=lambda n: g.unary("recip", g.unary("sqrt", n.srcs[0])))

_BUILDERS = {"matmul": matmul, "fma": fma, "rsqrt": rsqrt}


def build_composite(op: str, args: Sequence[Node]) -> Node:
    return _BUILDERS[op](*args)
