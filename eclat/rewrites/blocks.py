"""Repeated blocks: optimise one transformer layer, reuse it for every identical layer.

`split` cuts the graph where a single computed value is all that flows onward (the
residual stream between layers). Segments with the same structure (weights compared by
shape and dtype, not by name) form a group; one representative per group goes through
the e-graph and its candidates are re-bound to every member's own leaves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.graph import Graph, Node
from ..ir.view import View
from .layout import laid_out

LEAVES = ("input", "weight", "const", "iota")
CUT = "__cut__"


@dataclass
class Segment:
    cut_in: Node | None       # the value flowing in from the previous segment
    outputs: list[Node]


def _constant(graph: Graph) -> set[int]:
    """Nodes that depend on no input: compile-time values every segment may recompute."""
    const: set[int] = set()
    for n in graph.nodes():
        if n.op != "input" and all(id(s) in const for s in n.srcs):
            const.add(id(n))
    return const


def split(graph: Graph) -> list[Segment]:
    """Segments between single-value cuts, in order."""
    const = _constant(graph)
    order = [n for n in graph.nodes() if n.op not in LEAVES and id(n) not in const]
    pos = {id(n): p for p, n in enumerate(order)}
    last = {id(n): p for p, n in enumerate(order)}
    for p, n in enumerate(order):
        for s in n.srcs:
            if id(s) in pos:
                last[id(s)] = max(last[id(s)], p)
    for o in graph.outputs:
        last[id(o)] = len(order)
    # live[p] = how many values computed at or before p are still needed after p
    starts = np.zeros(len(order) + 1, np.int64)
    ends = np.zeros(len(order) + 1, np.int64)
    for n in order:
        starts[pos[id(n)]] += 1
        ends[last[id(n)]] += 1
    live = np.cumsum(starts) - np.cumsum(ends)
    cuts = [order[p] for p in range(len(order) - 1) if live[p] == 1 and last[id(order[p])] > p]
    segments, prev = [], None
    for c in cuts:
        segments.append(Segment(prev, [c]))
        prev = c
    segments.append(Segment(prev, list(graph.outputs)))
    return segments


def _key(n: Node) -> tuple:
    arg = n.arg
    try:
        hash(arg)
    except TypeError:
        arg = repr(arg)
    if n.op == "weight":
        arg = None  # weights of one shape are interchangeable between blocks
    return (n.op, arg, tuple(map(str, n.shape)), n.dtype)


def _nodes(seg: Segment) -> list[Node]:
    """The segment's nodes, sources first, not looking past its cut_in."""
    order, seen = [], {id(seg.cut_in)} if seg.cut_in is not None else set()
    stack: list[tuple[Node, bool]] = [(o, False) for o in reversed(seg.outputs)]
    if seg.cut_in is not None:
        order.append(seg.cut_in)
    while stack:
        n, done = stack.pop()
        if done:
            order.append(n)
        elif id(n) not in seen:
            seen.add(id(n))
            stack.append((n, True))
            stack.extend((s, False) for s in reversed(n.srcs) if id(s) not in seen)
    return order


def match(a: Segment, b: Segment) -> dict[int, Node] | None:
    """b's node for each of a's (by id) when the two segments have one structure, else None."""
    if len(a.outputs) != len(b.outputs) or (a.cut_in is None) != (b.cut_in is None):
        return None
    m: dict[int, Node] = {}
    back: dict[int, int] = {}
    pairs = list(zip(a.outputs, b.outputs))
    if a.cut_in is not None:
        pairs.append((a.cut_in, b.cut_in))
        m[id(a.cut_in)], back[id(b.cut_in)] = b.cut_in, id(a.cut_in)
    while pairs:
        x, y = pairs.pop()
        if id(x) in m or id(y) in back:
            if m.get(id(x)) is not y or back.get(id(y)) != id(x):
                return None  # the sharing differs
            continue
        if _key(x) != _key(y) or len(x.srcs) != len(y.srcs) or (x.op == "input" and x is not y):
            return None
        m[id(x)], back[id(y)] = y, id(x)
        pairs.extend(zip(x.srcs, y.srcs))
    return m


def blocks(graph: Graph, min_nodes: int = 16) -> tuple[list[Segment], list[tuple[Segment, list]]]:
    """Segments and their groups. Segments worth reusing (repeated, at least min_nodes nodes)
    stand alone; each run of the others between them is merged into one segment."""
    segments = split(graph)
    reps = group(segments)
    keep = {i for rep, members in reps if len(members) > 1 and len(_nodes(rep)) >= min_nodes
            for i, _ in members}
    merged: list[Segment] = []
    for i, seg in enumerate(segments):
        if i in keep or i == 0 or i - 1 in keep:
            merged.append(seg)
        else:
            merged[-1] = Segment(merged[-1].cut_in, seg.outputs)
    return merged, group(merged)


def group(segments: list[Segment]) -> list[tuple[Segment, list[tuple[int, dict[int, Node]]]]]:
    """(representative, [(segment index, match)]) for each structure, in order of appearance."""
    reps: list[tuple[Segment, list[tuple[int, dict[int, Node]]]]] = []
    for i, s in enumerate(segments):
        for rep, members in reps:
            m = match(rep, s)
            if m is not None:
                members.append((i, m))
                break
        else:
            reps.append((s, [(i, {})]))
    return reps


def rep_graph(seg: Segment, graph: Graph) -> Graph:
    """The segment as a graph of its own: the cut value becomes the input CUT."""
    inputs = list(graph.inputs)
    new: dict[int, Node] = {}
    if seg.cut_in is not None:
        inputs.insert(0, Node("input", (), CUT, seg.cut_in.shape, seg.cut_in.dtype))
        new[id(seg.cut_in)] = inputs[0]
    for n in _nodes(seg):
        if id(n) in new:
            continue
        srcs = [new[id(s)] for s in n.srcs]
        changed = any(a is not b for a, b in zip(srcs, n.srcs))
        new[id(n)] = Node(n.op, srcs, n.arg, n.shape, n.dtype) if changed else n
    outputs = [new[id(o)] for o in seg.outputs]
    used = {n.arg for n in Graph([], outputs, {}).nodes() if n.op == "weight"}
    return Graph(inputs, outputs, {w: a for w, a in graph.weights.items() if w in used})


def rebind(cand: Graph, m: dict[int, Node], cut: Node | None, recipes: dict[str, tuple[str, View]],
           rep_weights: dict[str, Node], weights: dict[str, np.ndarray],
           made: dict[str, np.ndarray]) -> list[Node]:
    """cand's outputs rebuilt on another segment's leaves (m: the match of the representative
    to it; cut: the value flowing in). A laid-out weight is re-made from its new source
    (rep_weights: the representative's weights by name; weights gains the new arrays, made
    caches them between candidates)."""
    leaf = lambda n: cut if n.op == "input" and n.arg == CUT else m.get(id(n), n)
    new: dict[int, Node] = {}
    for n in cand.nodes():
        if n.op == "weight" and n.arg in recipes:
            src, v = recipes[n.arg]
            target = leaf(rep_weights[src]).arg
            name = f"{target}.{n.arg.rsplit('.', 1)[1]}"
            if name not in made:
                made[name] = laid_out(weights[target], v)
            weights[name] = made[name]
            new[id(n)] = Node("weight", (), name, n.shape, n.dtype)
        elif n.op in LEAVES:
            new[id(n)] = leaf(n)
        else:
            srcs = [new[id(s)] for s in n.srcs]
            changed = any(a is not b for a, b in zip(srcs, n.srcs))
            new[id(n)] = Node(n.op, srcs, n.arg, n.shape, n.dtype) if changed else n
    return [new[id(o)] for o in cand.outputs]
