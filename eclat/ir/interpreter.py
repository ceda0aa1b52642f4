"""The numpy reference interpreter: the ground truth for every later stage."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from .graph import OPS, Graph, Node
from .symbolic import bind_sizes, evaluate, var_list
from .view import View


def read_view(flat: np.ndarray, v: View, env: Mapping[str, int] | None = None) -> np.ndarray:
    """Gather the elements of v from a flat source array; masked elements read 0."""
    shape = tuple(int(evaluate(n, env)) for n in v.shape)
    offset, strides = int(evaluate(v.offset, env)), [int(evaluate(s, env)) for s in v.strides]
    if v.mask is None and all(s >= 0 for s in strides) and flat.size and 0 not in shape and \
            offset + sum((n - 1) * s for n, s in zip(shape, strides)) < flat.size:
        # an unmasked view is numpy's own strided view: no index arrays, and a broadcast stays one
        flat = np.ascontiguousarray(flat).reshape(-1)
        item = flat.itemsize
        return np.lib.stride_tricks.as_strided(flat[offset:], shape, [s * item for s in strides],
                                               writeable=False)
    index = np.full(shape, offset, dtype=np.int64)
    valid = np.ones(shape, dtype=bool)
    for axis, n in enumerate(shape):
        ar = np.arange(n, dtype=np.int64).reshape([n if k == axis else 1 for k in range(len(shape))])
        index = index + ar * strides[axis]
        if v.mask is not None:
            lo, hi = (int(evaluate(b, env)) for b in v.mask[axis])
            valid = valid & (ar >= lo) & (ar < hi)
    if flat.size == 0 or not valid.any():
        return np.zeros(shape, dtype=flat.dtype)
    return np.where(valid, flat[np.where(valid, index, 0)], np.zeros((), dtype=flat.dtype))


def bind_dims(graph: Graph, arrays: Sequence[np.ndarray]) -> dict[str, int]:
    """Values of symbolic dimensions, read off the inputs' shapes (ValueError where they do not fit).
    Fixed sizes bind nothing and are not checked: numpy broadcasts, say, a [1] given for a []."""
    shapes = [tuple(n.shape) for n in graph.inputs]
    if not any(var_list(d) for shape in shapes for d in shape):
        return {}
    return bind_sizes(shapes, [np.shape(a) for a in arrays])


# An elementwise value read only by a reduction (a product written as a sum of products: GPT-2's
# output head is [1, 50257, 768] of them, 154 MB, the peak of its compile) is made a slab at a time
# along an axis the reduction keeps, each slab reduced as it is made: the same arithmetic, element for
# element, without the whole value at once.
SLAB_BYTES = 16 << 20


def run(graph: Graph, inputs: Sequence[np.ndarray], env: Mapping[str, int] | None = None
        ) -> list[np.ndarray]:
    """Evaluate graph on inputs (in graph.inputs order); returns one array per output."""
    if len(inputs) != len(graph.inputs):
        raise ValueError(f"expected {len(graph.inputs)} inputs, got {len(inputs)}")
    arrays = [np.asarray(a) for a in inputs]
    env = dict(env or bind_dims(graph, arrays))
    values: dict[int, np.ndarray] = {id(n): a.astype(n.dtype.np, copy=False)
                                     for n, a in zip(graph.inputs, arrays)}
    order = graph.nodes()
    last_read = {id(s): k for k, node in enumerate(order) for s in node.srcs}
    kept = {id(o) for o in graph.outputs}
    slabbed = _slabbed(order, kept, env)
    for node in order:  # a slabbed value's operands live until its reduction reads them
        if id(node) in slabbed:
            last_read.update({id(s): max(last_read[id(s)], last_read[id(node)]) for s in node.srcs})
    for k, node in enumerate(order):
        if id(node) not in values and id(node) not in slabbed:  # a slabbed value: made by its reader
            values[id(node)] = _by_slabs(node, [values[id(s)] for s in node.srcs[0].srcs], graph, env) \
                if node.srcs and id(node.srcs[0]) in slabbed else \
                evaluate_node(node, [values[id(s)] for s in node.srcs], graph, env)
        for s in node.srcs:  # a model's intermediates (a weight's transposed copy, say) die when read last
            if last_read[id(s)] == k and id(s) not in kept:
                values.pop(id(s), None)
    return [values[id(o)] for o in graph.outputs]


def _slabbed(order: list[Node], kept: set[int], env: Mapping[str, int]) -> set[int]:
    """The elementwise nodes read only by one reduction, over SLAB_BYTES, and not outputs."""
    readers: dict[int, list[Node]] = {}
    for node in order:
        for s in node.srcs:
            readers.setdefault(id(s), []).append(node)
    out = set()
    for node in order:
        users = readers.get(id(node), [])
        if node.kind in ("unary", "binary", "ternary") and id(node) not in kept and len(users) == 1 \
                and users[0].kind == "reduce" and len(node.shape) > 1:
            size = int(np.prod([int(evaluate(n, env)) for n in node.shape])) * node.dtype.np.itemsize
            if size > SLAB_BYTES:
                out.add(id(node))
    return out


def _by_slabs(reduction: Node, operands: list[np.ndarray], graph: Graph,
              env: Mapping[str, int]) -> np.ndarray:
    """reduction of its elementwise operand node (whose operands are `operands`), made and reduced
    a slab at a time along the longest axis the reduction keeps."""
    inner = reduction.srcs[0]
    shape = np.broadcast_shapes(*(np.shape(a) for a in operands))
    axis = max((a for a in range(len(shape)) if a != reduction.arg), key=lambda a: shape[a])
    step = max(1, shape[axis] * SLAB_BYTES // max(1, int(np.prod(shape)) * inner.dtype.np.itemsize))
    parts = []
    for at in range(0, shape[axis], step):
        cut = tuple(slice(at, at + step) if a == axis else slice(None) for a in range(len(shape)))
        slab = evaluate_node(inner, [np.broadcast_to(a, shape)[cut] for a in operands], graph, env)
        parts.append(evaluate_node(reduction, [slab], graph, env))
    return np.concatenate(parts, axis=axis if axis < reduction.arg else axis - 1)


def evaluate_node(node: Node, srcs: list[np.ndarray], graph: Graph, env: Mapping[str, int]) -> np.ndarray:
    if node.op == "input":
        raise ValueError(f"input {node.arg!r} is not an input of this graph")
    if node.op == "weight":
        return np.asarray(graph.weights[node.arg], dtype=node.dtype.np)
    if node.op == "view":
        return read_view(np.ascontiguousarray(srcs[0]).reshape(-1), node.arg, env)
    if node.op == "iota":
        return np.arange(int(evaluate(node.shape[0], env)), dtype=node.dtype.np)
    return OPS[node.op].numpy(node, *srcs)
