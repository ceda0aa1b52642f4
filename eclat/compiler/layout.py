"""Channels-last: a graph whose feature maps are computed with their channels innermost.

A feature map [N, C, H, W] is computed channels-first by the lowering; `channels_last` rebuilds the
graph so that those of at most `pixels` positions are computed as [N, H, W, C] instead, the order
pushed down through what computes them (elementwise ops, reductions, copies, views) to the weights
and inputs, which are read through transposed views (weights are laid out at compile time). A
reader that wants the other order (an output, a map of more pixels) reads the stored value through
a transposing view: the network converts where a region's maps begin and end, not around every
convolution. Grouping runs on the result as on any graph; the search times it against the
channels-first program, so the layout is a measured choice (`compiler/pipeline._programs`).

Why: a depthwise convolution over few pixels and many channels (a mobile network's last stages, 7x7
pixels by 576 channels) fills few lanes along its rows channels-first, and every lane along its
channels channels-last, where each tap's filter vector serves several pixels (`emitter` runs such a
kernel's pixels in blocks, `Schedule.jam`)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence

import numpy as np

from ..ir import graph as g
from ..ir.graph import Graph, Node
from ..ir.symbolic import as_int
from ..ir.view import View, compose

Perm = tuple[int, ...]
CHANNELS_LAST: Perm = (0, 2, 3, 1)
DEEP = 100_000  # recursion limit while rebuilding: a model's chain of values is one call per node


def feature_maps(graph: Graph, pixels: int) -> bool:
    """Whether channels_last(graph, pixels) has feature maps to lay out: a graph of fixed sizes that
    reads windows of a map (a convolution or a pooling: a transformer's [batch, heads, tokens, dim]
    values are no feature maps)."""
    nodes = graph.nodes()
    return all(as_int(d) is not None for n in nodes for d in n.shape) and \
        any(n.op == "view" and len(n.srcs[0].shape) == 4 and n.arg.overlap() > 1 for n in nodes) and \
        any(_feature_map(n, pixels) for n in nodes)


def channels_last(graph: Graph, pixels: int) -> Graph | None:
    """graph with every feature map of at most `pixels` positions computed channels-last; None where
    there is none (or a size is known only at run time)."""
    if not feature_maps(graph, pixels):
        return None
    wish = {id(n): CHANNELS_LAST for n in graph.nodes() if _feature_map(n, pixels)}
    weights = dict(graph.weights)
    rebuild = _Rebuild(wish, weights, set(graph.formats), _read_in_part(graph))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, DEEP))
    try:
        outputs = [rebuild.get(o, None) for o in graph.outputs]
    finally:
        sys.setrecursionlimit(limit)
    return Graph(graph.inputs, outputs, weights, graph.out_spec, graph.index_ranges, graph.divisors,
                 graph.states, graph.formats)


def _feature_map(n: Node, pixels: int) -> bool:
    """A computed [N, C, H, W] value of several channels over at most `pixels` positions."""
    if len(n.shape) != 4 or n.kind in ("leaf", "view") or not n.dtype.is_float:
        return False
    _, c, h, w = (as_int(d) for d in n.shape)
    return c > 1 and h * w > 1 and h * w <= pixels


def _read_in_part(graph: Graph) -> set[int]:
    """The copies of computed values whose every reader is a view that skips some of their elements."""
    readers: dict[int, list[Node]] = {}
    for n in graph.nodes():
        for s in n.srcs:
            readers.setdefault(id(s), []).append(n)
    outputs = {id(o) for o in graph.outputs}
    return {id(n) for n in graph.nodes() if n.op == "contiguous" and n.srcs[0].kind not in ("leaf", "view")
            and id(n) not in outputs and readers.get(id(n)) and all(
                r.op == "view" and r.arg.mask is None and 0 not in r.arg.strides[1:] and
                math.prod(r.shape) < math.prod(n.shape) for r in readers[id(n)])}


def _inverse(q: Perm) -> Perm:
    return tuple(sorted(range(len(q)), key=q.__getitem__))


def _transposed(x: Node, q: Perm | None) -> Node:
    """x's values transposed by q (numpy's transpose order), as a view of x's source."""
    if q is None or q == tuple(range(len(q))):
        return x
    return g.movement(x, lambda v: v.permute(q))


def _reader_order(shape: Sequence[int], v: View) -> Perm:
    """The order to store a value of `shape` in for the view v that reads it: each axis placed
    where the first of v's axes that steps along it is (an axis v reads at one index first), so
    that v's innermost axis runs along the stored innermost one."""
    rows = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    first = [-1] * len(shape)
    for k, (n, s) in enumerate(zip(v.shape, v.strides)):
        n, s = as_int(n), abs(as_int(s))
        if n <= 1 or s == 0:
            continue
        for d, r in enumerate(rows):  # the axes it moves along: a flat axis over rows moves along two
            if shape[d] > 1 and r <= (n - 1) * s and s < r * shape[d]:
                first[d] = k if first[d] < 0 else min(first[d], k)
    return tuple(sorted(range(len(shape)), key=lambda d: (first[d], d)))


class _Rebuild:
    """Each node computed in the order its first reader asks for (a feature map: channels-last);
    later readers asking for another order read it through a transposing view."""

    def __init__(self, wish: dict[int, Perm], weights: dict[str, np.ndarray], rounded: set[str],
                 partial: set[int]):
        self.wish, self.weights, self.rounded, self.partial = wish, weights, rounded, partial
        self.built: dict[tuple[int, Perm | None], Node] = {}
        self.claimed: dict[int, Perm | None] = {}
        self.laid: dict[tuple[str, Perm], Node] = {}

    def get(self, n: Node, q: Perm | None) -> Node:
        """n's value transposed by q (None: as it is)."""
        if q is not None and q == tuple(range(len(q))):
            q = None
        key = (id(n), q)
        if key in self.built:
            return self.built[key]
        if n.kind == "leaf":
            out = _transposed(n, q)
        else:
            own = self.wish.get(id(n), self.claimed.setdefault(id(n), q))
            if own != q:  # computed once, in its own order; this reader reads it transposed
                back = _inverse(own) if own is not None else tuple(range(len(n.shape)))
                out = _transposed(self.get(n, own), tuple(back[a] for a in q) if q is not None else back)
            else:
                out = self._computed(n, q)
        self.built[key] = out
        return out

    def _computed(self, n: Node, q: Perm | None) -> Node:
        if n.op == "view":
            return self._view(n, q)
        pushed = n.kind in ("unary", "binary", "ternary", "contiguous", "reduce") or \
            n.kind == "composite" and all(tuple(s.shape) == tuple(n.shape) for s in n.srcs)
        if q is None or not pushed:  # as it is (a gather, an attention, a Winograd transform)
            srcs = [self.get(s, None) for s in n.srcs]
            kept = all(a is b for a, b in zip(srcs, n.srcs))
            return _transposed(n if kept else Node(n.op, srcs, n.arg, n.shape, n.dtype), q)
        shape = tuple(n.shape[a] for a in q)
        if n.op == "contiguous" and id(n) in self.partial:
            # a value the lowering stores whole, padding columns and all, so that its rows vectorise
            # channels-first (a depthwise convolution's flat rows): channels-last, its readers
            # compute only what they read of it
            return self.get(n.srcs[0], q)
        if n.kind == "reduce":  # its input in the order its loops run: the reduced axis next to last
            a = n.arg
            outer = tuple(d if d < a else d + 1 for d in q)
            return Node(n.op, [self.get(n.srcs[0], (*outer[:-1], a, outer[-1]))], len(outer) - 1, shape,
                        n.dtype)
        return Node(n.op, [self.get(s, q) for s in n.srcs], n.arg, shape, n.dtype)

    def _view(self, n: Node, q: Perm | None) -> Node:
        """A view read transposed by q: its source asked for in the order the view then steps along
        it (a weight laid out so), the two views composed into one where they can be."""
        y, v = n.srcs[0], n.arg if q is None else n.arg.permute(q)
        shape = [as_int(d) for d in y.shape]
        order = None if q is None else _reader_order(shape, v)
        if order is not None and (order == tuple(range(len(shape))) or compose(
                View.contiguous([shape[a] for a in order]).permute(_inverse(order)), v) is None):
            order = None
        if y.kind == "leaf":
            if y.op != "weight" or order is None or y.arg in self.rounded:
                return g.view(y, v)
            laid = self._laid_out(y, order)
            return g.view(laid, compose(View.contiguous(laid.shape).permute(_inverse(order)), v))
        stored = self.get(y, order)
        src, inner = (stored.srcs[0], stored.arg) if stored.op == "view" else \
            (stored, View.contiguous(stored.shape))
        both = compose(inner if order is None else inner.permute(_inverse(order)), v)
        if both is not None:
            return g.view(src, both)
        # v reads y's own order: a copy in it (stored holds y transposed by order)
        back = _transposed(stored, _inverse(order)) if order is not None else stored
        return g.view(g.contiguous(back) if back.op == "view" else back, v)

    def _laid_out(self, w: Node, order: Perm) -> Node:
        """The weight w as a new weight of its elements in `order` (laid out at compile time)."""
        if (w.arg, order) not in self.laid:
            name = f"{w.arg}.t{''.join(map(str, order))}"
            self.weights[name] = np.ascontiguousarray(self.weights[w.arg].transpose(order))
            self.laid[w.arg, order] = g.weight(name, self.weights[name], w.dtype)
        return self.laid[w.arg, order]
