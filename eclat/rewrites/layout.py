"""Layout: a weight read through a permutation is, at compile time, a new weight laid out
in that order, so its consumer reads it contiguously (e.g. a linear layer's W^T)."""

from __future__ import annotations

import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import Graph, Node
from ..ir.symbolic import as_int
from ..ir.view import View
from .lang import Rule, RuleSet


def is_permutation(v: View, numel: int) -> bool:
    """v reads each of numel contiguous elements exactly once, in some axis order."""
    if v.mask is not None or as_int(v.offset) != 0 or v.is_contiguous:
        return False
    axes = [(as_int(n), as_int(s)) for n, s in zip(v.shape, v.strides) if as_int(n) != 1]
    if any(n is None or s is None or s <= 0 for n, s in axes):
        return False
    acc = 1
    for n, s in sorted(axes, key=lambda a: a[1]):
        if s != acc:
            return False
        acc *= n
    return acc == numel


def laid_out(array: np.ndarray, v: View) -> np.ndarray:
    """The elements array's view v reads, in the view's order: a read-only strided view, not a copy.
    Whoever needs the elements contiguous copies them then (the CPU packs a weight it multiplies by
    into panels, reading this view once; code that reads the weight directly binds one copy), so a
    compile does not hold a laid-out copy of every weight beside the packed one."""
    shape, strides = [int(n) for n in v.shape], [int(s) for s in v.strides]
    order = sorted(range(len(shape)), key=lambda a: -strides[a])  # the axes as they lie, outermost first
    laid = np.ascontiguousarray(array).reshape([shape[a] for a in order]).transpose(np.argsort(order))
    laid.flags.writeable = False  # a view made by numpy, so that its base is the array it reads
    return laid


def fill_layout(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """laid(weight, view) = a new weight holding the view's elements contiguously."""
    weights = [(i, n) for i, n in enumerate(enc.attrs)
               if isinstance(n, Node) and n.op == "weight" and n.arg in enc.graph.weights]
    by_numel: dict[int, list[tuple[int, View]]] = {}
    for i, v in enumerate(enc.attrs):
        if isinstance(v, View) and as_int(v.numel) is not None:
            by_numel.setdefault(as_int(v.numel), []).append((i, v))
    out = []
    for wi, w in weights:
        array = enc.graph.weights[w.arg]
        for vi, v in by_numel.get(array.size, []):
            if is_permutation(v, array.size):
                name = f"{w.arg}.laid{vi}"
                enc.new_weights[name] = (w.arg, v)
                out.append(("laid", (wi, vi), enc.leaf_id(Node("weight", (), name, v.shape, w.dtype))))
    return out


def _example() -> Graph:
    x = g.input_("x", (3, 4))
    w = g.weight("w", np.zeros((4, 3), np.float32), DType.float32)
    wt = g.movement(w, lambda v: v.permute([1, 0]))
    rng = np.random.default_rng(0)
    return Graph([x], [g.binary("add", x, wt)], {"w": rng.standard_normal((4, 3)).astype(np.float32)})


RULES = RuleSet("layout", (
    Rule("weight-laid-out", "(View (Leaf w) v)", "(Leaf w2)", ("(= w2 (laid w v))",), example=_example),
))
