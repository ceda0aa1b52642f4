"""Compile-time folding: a value that depends only on weights and constants is computed once, here,
and becomes a weight of the program, so no kernel recomputes it (or reads its sources) per call.

    fold_weights(graph) -> the same graph with every worthwhile weight-only value precomputed

Each weight-only value read by a run-time node (or returned) is folded when it is worth it, else
its operands are tried in turn:

  * not a leaf, nor a view of a leaf: views are free, and the e-graph already lays weights out in
    the order their readers want (layout.py);
  * stored without its broadcast axes: where the value repeats along an axis (a bias, a BatchNorm
    scale expanded to [batch, c, h, w]) one copy is kept and the expand stays a view; a value
    that repeats along every axis becomes a constant;
  * not much larger than the weights it reads (bytes stored <= FOLD_GROWTH x their bytes +
    SLACK_BYTES): a rank-8 product A @ B alone is d*d from 2*d*8 and stays two thin GEMMs;
    W + A @ B folds, and so does a Winograd filter transform (16 taps from 9).

Values are computed by the reference interpreter with floating-point operations in float64
(casts and comparisons read their operands rounded, as the program holds them), then rounded
once to the value's dtype. Identical results are
stored once; a folded weight is named after what it computes from which weights, e.g.
"mul(scale,w)".
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType, round_bfloat16
from ..ir.graph import Graph, Node, numel
from ..ir.interpreter import evaluate_node
from ..ir.symbolic import as_int
from ..ir.view import View

SLACK_BYTES = 4096  # a fold may exceed the weights it reads by this (a small table made from iota)
FOLD_GROWTH = 2  # and store up to this many times their bytes (a Winograd filter: 16 taps for 9)


def worth_storing(stored_bytes: float, read_bytes: float) -> bool:
    """Whether a folded value of stored_bytes, made from weights of read_bytes, is worth storing."""
    return stored_bytes <= FOLD_GROWTH * read_bytes + SLACK_BYTES
EVAL_LIMIT = 1 << 24  # elements of one value the interpreter may build here
NAME_SOURCES = 3  # weights named in a folded weight's name, at most

_WIDE = SimpleNamespace(np=np.dtype(np.float64), is_float=True)  # a float dtype stand-in for numpy


@dataclass
class Shared:
    """What the candidates of one compile share: the folded weights by content, so that equal
    values are one array (the backend then prepares each once: a CPU packing of a large weight
    costs seconds), and the values computed, by what computes them (the candidates repeat most
    of each other's)."""
    made: dict[tuple, tuple[Node, np.ndarray]] = field(default_factory=dict)
    ids: dict[tuple, int] = field(default_factory=dict)  # (op, arg, shape, dtype, operand ids) -> id
    stored: dict[int, np.ndarray | None] = field(default_factory=dict)  # id -> the value to store, if any
    digests: dict[int, tuple[np.ndarray, str]] = field(default_factory=dict)  # id(array) -> (it, its digest)


def fold_weights(graph: Graph, shared: Shared | None = None) -> Graph:
    """graph with every weight-only value worth materialising replaced by a precomputed weight
    (read through a broadcast view where it repeats) or a constant."""
    shared = Shared() if shared is None else shared
    nodes = graph.nodes()
    sources = _weight_only(graph, nodes)
    values: dict[int, np.ndarray] = {}
    chosen = _chosen(graph, nodes, sources, values, _structure(nodes, shared.ids), shared.stored)
    if not chosen:
        return graph
    # a folded value that a view reads at run time (symbolic, or too large to compute here) is
    # stored whole: two views do not compose
    whole = {id(n.srcs[0]) for n in nodes
             if n.op == "view" and id(n) not in sources and id(n.srcs[0]) in chosen}
    # a uniform value a product reads (a convolution's weights times a BatchNorm scale of zeros,
    # timm's zero-initialised last norm) is stored whole where that costs no more than its weights:
    # as a constant the product is no contraction, and runs as loops (gernet_s: 6.7 of 20 ms)
    read, by_id = _product_operands(nodes)
    for i in [i for i, stored in chosen.items() if stored.size == 1 and i in read]:
        n = by_id[i]
        while n.op == "view" and id(n.srcs[0]) in sources:  # the value under its broadcasts
            n = n.srcs[0]
        size = numel(n.shape)
        if size is None or not worth_storing(size * n.dtype.itemsize, sum(sources[id(n)].values())):
            continue
        if n is not by_id[i]:
            del chosen[i]  # the view reads what is stored
        if n.kind != "leaf":
            whole.add(id(n))
    for n in nodes:
        if id(n) in whole:
            chosen[id(n)] = _rounded(n, _value(n, graph, values))
    made = shared.made  # identical results share one weight
    weights = {node.arg: array for node, array in made.values()}
    new: dict[int, Node] = {}
    for n in nodes:
        srcs = [new[id(s)] for s in n.srcs]
        if n.op == "view" and id(n) not in chosen and id(n.srcs[0]) in chosen and srcs[0].op == "view":
            chosen[id(n)] = _stored(n, _value(n, graph, values))  # a view of a folded broadcast folds too
        if id(n) in chosen:
            new[id(n)] = _leaf(n, chosen[id(n)], sources[id(n)], graph.weights, weights, shared,
                               id(n) in whole)
        elif all(a is b for a, b in zip(srcs, n.srcs)):
            new[id(n)] = n
        else:
            new[id(n)] = Node(n.op, srcs, n.arg, n.shape, n.dtype)
    out = dataclasses.replace(graph, outputs=[new[id(o)] for o in graph.outputs])
    arrays = graph.weights | weights  # no name in both (_leaf)
    out.weights = {n.arg: arrays[n.arg] for n in out.nodes() if n.op == "weight"}  # those still read
    return out


def _product_operands(nodes: list[Node]) -> tuple[set[int], dict[int, Node]]:
    """The ids of the values a product (a matmul, a sum of a mul) reads, directly or through views,
    and each such node by id."""
    by_id = {id(n): n for n in nodes}
    stack = [s for n in nodes if n.op == "matmul" for s in n.srcs]
    stack += [s for n in nodes if n.op == "sum" and n.srcs[0].op == "mul" for s in n.srcs[0].srcs]
    seen: set[int] = set()
    while stack:
        n = stack.pop()
        if id(n) not in seen:
            seen.add(id(n))
            if n.op == "view":
                stack.append(n.srcs[0])
    return seen, by_id


def _weight_only(graph: Graph, nodes: list[Node]) -> dict[int, dict[str, int]]:
    """For each value no input reaches (and small enough to compute here): the weights it reads,
    name -> bytes."""
    sources: dict[int, dict[str, int]] = {}
    for n in nodes:
        size = numel(n.shape)
        if n.op == "input" or size is None or size > EVAL_LIMIT or not _concrete(n.arg):
            continue
        if n.op == "weight":
            sources[id(n)] = {n.arg: graph.weights[n.arg].size * n.dtype.itemsize}
        elif n.kind == "leaf":  # const, iota of a known length
            sources[id(n)] = {}
        elif all(id(s) in sources for s in n.srcs):
            sources[id(n)] = {k: v for s in n.srcs for k, v in sources[id(s)].items()}
    return sources


def _concrete(arg: object) -> bool:
    """Whether the views in a node's argument have known sizes, strides and offsets (a table
    sliced at a symbolic position is read at run time)."""
    if isinstance(arg, View):
        bounds = [b for pair in arg.mask or () for b in pair]
        return all(as_int(x) is not None for x in (*arg.shape, *arg.strides, arg.offset, *bounds))
    return all(_concrete(a) for a in arg) if isinstance(arg, tuple) else True


def _structure(nodes: list[Node], ids: dict[tuple, int]) -> dict[int, int]:
    """node id -> a number equal for nodes that compute the same value from the same leaves (the
    copies of a value in two candidates), numbered in ids."""
    out: dict[int, int] = {}
    for n in nodes:  # operands first
        key = (n.op, n.arg, tuple(n.shape), n.dtype, tuple(out[id(s)] for s in n.srcs))
        try:
            out[id(n)] = ids.setdefault(key, len(ids))
        except TypeError:  # an argument that does not hash: numbered apart
            out[id(n)] = ids.setdefault(("unhashable", id(n)), len(ids))
    return out


def _chosen(graph: Graph, nodes: list[Node], sources: dict[int, dict[str, int]],
            values: dict[int, np.ndarray], structure: dict[int, int], known: dict[int, np.ndarray | None]
            ) -> dict[int, np.ndarray]:
    """The weight-only values to fold, outermost first under each run-time reader: node id -> the
    array to store (broadcast axes kept at size 1). known: stored values by structure, computed
    once for all candidates."""
    roots = [o for o in graph.outputs if id(o) in sources]
    roots += [s for n in nodes if id(n) not in sources for s in n.srcs if id(s) in sources]
    chosen: dict[int, np.ndarray] = {}
    seen: set[int] = set()
    while roots:
        n = roots.pop()
        if id(n) in seen or n.kind == "leaf" or (n.op == "view" and n.srcs[0].kind == "leaf"):
            continue
        seen.add(id(n))
        key = structure[id(n)]
        if key not in known:
            stored = _stored(n, _value(n, graph, values))
            values.clear()  # float64 copies of weights: held for one value at a time
            fits = worth_storing(stored.size * n.dtype.itemsize, sum(sources[id(n)].values()))
            known[key] = stored if fits else None  # None: too large, its operands are folded instead
        if known[key] is not None:
            chosen[id(n)] = known[key]
        else:
            roots.extend(n.srcs)
    return chosen


def _value(n: Node, graph: Graph, values: dict[int, np.ndarray]) -> np.ndarray:
    """n's value (floating point in float64), computing what it needs once."""
    stack = [n]
    while stack:
        m = stack[-1]
        todo = [s for s in m.srcs if id(s) not in values]
        if todo:
            stack.extend(todo)
            continue
        if id(m) not in values:
            values[id(m)] = _wide(m, [values[id(s)] for s in m.srcs], graph)
        stack.pop()
    return values[id(n)]


def _wide(n: Node, srcs: list[np.ndarray], graph: Graph) -> np.ndarray:
    """One node's value; a float one in float64. Leaves keep their own rounding; a cast, or an op
    with a discrete result (a comparison), reads its operands rounded to their dtypes, as the
    program holds them."""
    exact = n.kind == "leaf" or n.op == "cast" or not n.dtype.is_float
    if exact:
        srcs = [_rounded(s, v) for s, v in zip(n.srcs, srcs)]
    node = n if exact else SimpleNamespace(op=n.op, srcs=n.srcs, arg=n.arg, shape=n.shape, dtype=_WIDE)
    with np.errstate(all="ignore"):  # inf and nan are values like any other
        out = np.asarray(evaluate_node(node, srcs, graph, {}))
    return out.astype(np.float64, copy=False) if n.dtype.is_float else out


def _rounded(n: Node, value: np.ndarray) -> np.ndarray:
    value = np.array(value, dtype=n.dtype.np, order="C", copy=None)  # ascontiguousarray: a scalar 1-d
    return round_bfloat16(value) if n.dtype is DType.bfloat16 else value


def _stored(n: Node, value: np.ndarray) -> np.ndarray:
    """value rounded to n's dtype, taken once along every axis it repeats on (bit for bit)."""
    value = _rounded(n, value)
    bits = np.dtype(f"u{value.itemsize}")
    for axis in range(value.ndim):
        if value.shape[axis] > 1:
            first = np.take(value, [0], axis=axis)
            if np.array_equal(value.view(bits), np.broadcast_to(first.view(bits), value.shape)):
                value = first
    return value


def _leaf(n: Node, stored: np.ndarray, sources: dict[str, int], taken: dict[str, np.ndarray],
          weights: dict[str, np.ndarray], shared: Shared, whole: bool = False) -> Node:
    """The folded value: a constant if one number (unless whole: a leaf of n's shape, which a view
    may read), else a weight, read through a broadcast view where stored repeats."""
    if stored.size == 1 and not whole:
        return g.expand_to(g.const(stored.item(), n.dtype), n.shape)
    whole = whole or stored.shape == tuple(n.shape)
    squeezed = stored if whole else stored.reshape([d for d in stored.shape if d != 1])
    key = (n.dtype, squeezed.shape, _digest(stored, shared.digests))
    made = shared.made
    if key not in made:
        names = sorted(sources) or ["iota"]  # sorted: a commuted candidate's fold gets the same name
        src = n
        while src.op in ("view", "contiguous"):  # named by what they read
            src = src.srcs[0]
        base = f"{src.op}({','.join(names[:NAME_SOURCES] + ['...'] * (len(names) > NAME_SOURCES))})"
        name, k = base, 1
        while name in weights or name in taken:
            k += 1
            name = f"{base}#{k}"
        weights[name] = squeezed
        made[key] = g.weight(name, squeezed, n.dtype), squeezed
    return g.movement(made[key][0], lambda v: v.reshape(stored.shape).expand(n.shape))


def _digest(stored: np.ndarray, digests: dict[int, tuple[np.ndarray, str]]) -> str:
    """A digest of stored's bytes, computed once per array (the candidates share their folded values;
    the array is kept with it, so that its id is not reused)."""
    kept = digests.get(id(stored))
    if kept is None or kept[0] is not stored:
        kept = digests[id(stored)] = stored, hashlib.sha1(stored.tobytes()).hexdigest()  # C order
    return kept[1]
