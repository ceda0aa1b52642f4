"""Repeated blocks: optimise one transformer layer, reuse it for every identical layer.

`split` cuts the graph where one value computed there is all that flows onward besides
the side values later layers read (a decoder's rotary tables and attention mask: the values
live longest, as many as make the most of the graph repeat). A segment reads the values of
earlier segments it needs (`ins`) and hands on those later ones read or the graph returns
(`outputs`: the residual stream, a KV cache's update). Segments with the same structure
(weights and inputs compared by shape and dtype, not by name) form a group; one
representative per group goes through the e-graph and its candidates are re-bound to every
member's own leaves and ins.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.graph import Graph, Node
from ..ir.view import View
from .layout import laid_out

LEAVES = ("input", "weight", "const", "iota")
CUT = "__cut__"
MAX_SIDES = 8  # side values (a decoder's rotary tables and mask) tried, the longest-lived first


@dataclass
class Segment:
    ins: list[Node]      # values of earlier segments it reads, by where they are computed
    outputs: list[Node]  # values it computes that later segments read or the graph returns


def _constant(graph: Graph) -> set[int]:
    """Nodes that depend on no input: compile-time values every segment may recompute."""
    const: set[int] = set()
    for n in graph.nodes():
        if n.op != "input" and all(id(s) in const for s in n.srcs):
            const.add(id(n))
    return const


def _order(graph: Graph) -> list[Node]:
    """The computed nodes segments are cut from, sources first. A value only the graph returns
    (a cache update after the logits), and the views that only it reads, come right after their
    sources, not at the end where the walk from the outputs puts them: there they would keep
    every layer's values live to the end."""
    const = _constant(graph)
    order = [n for n in graph.nodes() if n.op not in LEAVES and id(n) not in const]
    pos = {id(n): p for p, n in enumerate(order)}
    read: dict[int, list[Node]] = {}
    for n in order:
        for s in n.srcs:
            read.setdefault(id(s), []).append(n)
    early: set[int] = set()
    for n in reversed(order):
        users = read.get(id(n), [])
        if not users or n.op == "view" and all(id(u) in early for u in users):
            early.add(id(n))
    anchor: dict[int, int] = {}
    for n in order:
        if id(n) in early:
            anchor[id(n)] = max((anchor.get(id(s), pos[id(s)]) for s in n.srcs if id(s) in pos), default=-1)
    place = {id(n): (anchor[id(n)], 1, pos[id(n)]) if id(n) in early else (pos[id(n)], 0, 0) for n in order}
    return sorted(order, key=lambda n: place[id(n)])


def split(graph: Graph, min_nodes: int = 16) -> list[Segment]:
    """Segments between cuts, in order."""
    order, cuts, _ = _cuts(graph, min_nodes)
    return segments(graph, order, cuts)


def _cuts(graph: Graph, min_nodes: int) -> tuple[list[Node], list[int], list]:
    """The computed nodes, the positions among them a segment ends at (after a value that is,
    with the side values, all that is live there) and the groups of those segments. The side
    values are the j values live longest, for the j (at most MAX_SIDES) whose segments repeat the
    most nodes. A graph output nothing reads later is handed on by its segment and does not stay
    live."""
    order = _order(graph)
    pos = {id(n): p for p, n in enumerate(order)}
    last = {id(n): p for p, n in enumerate(order)}
    for p, n in enumerate(order):
        for s in n.srcs:
            if id(s) in pos:
                last[id(s)] = max(last[id(s)], p)
    longest = sorted((n for n in order if last[id(n)] > pos[id(n)]), key=lambda n: pos[id(n)] - last[id(n)])
    straddled = _straddled(order, pos)
    best: tuple[int, list[int], list] = (-1, [], [])
    for j in range(min(MAX_SIDES, len(longest)) + 1):
        cuts = _cut_points(order, pos, last, {id(n) for n in longest[:j]}, straddled)
        reps = group(segments(graph, order, cuts))
        saved = sum((len(members) - 1) * size for _, members, size in _reused(reps, min_nodes))
        best = max(best, (saved, cuts, reps), key=lambda t: t[0])
    return order, best[1], best[2]


def _reused(reps: list, min_nodes: int) -> list[tuple[Segment, list, int]]:
    """The groups worth reusing (repeated, at least min_nodes nodes), with their size."""
    sized = [(rep, members, len(_nodes(rep))) for rep, members in reps if len(members) > 1]
    return [r for r in sized if r[2] >= min_nodes]


def _cut_points(order: list[Node], pos: dict[int, int], last: dict[int, int], side: set[int],
                straddled: set[int]) -> list[int]:
    """The positions after which one value besides the side values is live, that value just computed,
    except those a product straddles (`_straddled`)."""
    starts = np.zeros(len(order) + 1, np.int64)
    ends = np.zeros(len(order) + 1, np.int64)
    for n in order:
        if id(n) not in side:
            starts[pos[id(n)]] += 1
            ends[last[id(n)]] += 1
    live = np.cumsum(starts) - np.cumsum(ends)  # values computed at or before p and read after it
    return [p for p in range(len(order) - 1)
            if live[p] == 1 and last[id(order[p])] > p and id(order[p]) not in side and p not in straddled]


def _straddled(order: list[Node], pos: dict[int, int]) -> set[int]:
    """Positions from where a product (a multiply a sum reduces) has one operand computed to where
    it has the other. A cut there would part the product from its first operand's producer, which
    the rules rewriting a product together with what made its operand need in one e-graph (a
    softmax contracted with values computed after it from inputs alone: online.py)."""
    readers: dict[int, list[Node]] = {}
    for n in order:
        for s in n.srcs:
            readers.setdefault(id(s), []).append(n)

    def source(n: Node) -> Node:
        while n.op == "view":
            n = n.srcs[0]
        return n

    out = set()
    for n in order:
        if n.op != "mul" or not any(r.op == "sum" for r in readers.get(id(n), ())):
            continue
        at = sorted(pos[id(m)] for m in map(source, n.srcs) if id(m) in pos)
        if len(at) == 2:
            out.update(range(at[0], at[1]))
    return out


def segments(graph: Graph, order: list[Node], cuts: list[int]) -> list[Segment]:
    """The segments of order ending at each cut position (and at its end): what each reads from
    earlier ones and hands on."""
    seg_of: dict[int, int] = {}
    bounds = [*cuts, len(order) - 1]
    j = 0
    for p, n in enumerate(order):
        seg_of[id(n)] = j
        if p == bounds[j] and j < len(bounds) - 1:
            j += 1
    count = j + 1
    ins: list[dict[int, Node]] = [{} for _ in range(count)]
    outs: list[dict[int, Node]] = [{} for _ in range(count)]
    for n in order:
        for s in n.srcs:
            if id(s) in seg_of and seg_of[id(s)] != seg_of[id(n)]:
                ins[seg_of[id(n)]][id(s)] = s
                outs[seg_of[id(s)]][id(s)] = s
    for o in graph.outputs:
        if id(o) in seg_of:
            outs[seg_of[id(o)]][id(o)] = o
    pos = {id(n): p for p, n in enumerate(order)}
    by_pos = lambda d: sorted(d.values(), key=lambda n: pos[id(n)])
    return [Segment(by_pos(ins[j]), by_pos(outs[j])) for j in range(count)]


def _key(n: Node) -> tuple:
    arg = n.arg
    try:
        hash(arg)
    except TypeError:
        arg = repr(arg)
    if n.op in ("weight", "input"):
        arg = None  # weights and inputs (a layer's own KV cache) of one shape are interchangeable
    return (n.op, arg, tuple(map(str, n.shape)), n.dtype)


def _nodes(seg: Segment) -> list[Node]:
    """The segment's nodes, sources first, its ins first, not looking past them."""
    order, seen = list(seg.ins), {id(n) for n in seg.ins}
    stack: list[tuple[Node, bool]] = [(o, False) for o in reversed(seg.outputs)]
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
    if len(a.outputs) != len(b.outputs) or len(a.ins) != len(b.ins):
        return None
    m: dict[int, Node] = {}
    back: dict[int, int] = {}
    pairs = list(zip(a.outputs, b.outputs))
    for x, y in zip(a.ins, b.ins):  # computed elsewhere: only their shapes need agree
        if (x.shape, x.dtype) != (y.shape, y.dtype) or id(x) in m or id(y) in back:
            return None
        m[id(x)], back[id(y)] = y, id(x)
    while pairs:
        x, y = pairs.pop()
        if id(x) in m or id(y) in back:
            if m.get(id(x)) is not y or back.get(id(y)) != id(x):
                return None  # the sharing differs
            continue
        if _key(x) != _key(y) or len(x.srcs) != len(y.srcs):
            return None
        m[id(x)], back[id(y)] = y, id(x)
        pairs.extend(zip(x.srcs, y.srcs))
    return m


def blocks(graph: Graph, min_nodes: int = 16) -> tuple[list[Segment], list[tuple[Segment, list]]]:
    """Segments and their groups. Segments worth reusing (repeated, at least min_nodes nodes)
    stand alone; each run of the others between them is merged into one segment."""
    order, cuts, reps = _cuts(graph, min_nodes)
    keep = {i for _, members, _ in _reused(reps, min_nodes) for i, _ in members}
    # a cut stays where the segment before or after it is kept: the others merge into runs
    merged = segments(graph, order, [p for i, p in enumerate(cuts) if i in keep or i + 1 in keep])
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
    """The segment as a graph of its own: its k-th in becomes the input CUT + k."""
    new: dict[int, Node] = {}
    for k, v in enumerate(seg.ins):
        new[id(v)] = Node("input", (), f"{CUT}{k}", v.shape, v.dtype)
    inputs = [new[id(v)] for v in seg.ins] + list(graph.inputs)
    for n in _nodes(seg):
        if id(n) in new:
            continue
        srcs = [new[id(s)] for s in n.srcs]
        changed = any(a is not b for a, b in zip(srcs, n.srcs))
        new[id(n)] = Node(n.op, srcs, n.arg, n.shape, n.dtype) if changed else n
    outputs = [new[id(o)] for o in seg.outputs]
    used = {n.arg for n in Graph([], outputs, {}).nodes() if n.op == "weight"}
    return Graph(inputs, outputs, {w: a for w, a in graph.weights.items() if w in used})


def rebind(cand: Graph, m: dict[int, Node], ins: list[Node], recipes: dict[str, tuple[str, View]],
           rep_weights: dict[str, Node], weights: dict[str, np.ndarray],
           made: dict[str, np.ndarray]) -> list[Node]:
    """cand's outputs rebuilt on another segment's leaves (m: the match of the representative
    to it; ins: the values flowing in). A laid-out weight is re-made from its new source
    (rep_weights: the representative's weights by name; weights gains the new arrays, made
    caches them between candidates)."""
    cut = {f"{CUT}{k}": v for k, v in enumerate(ins)}
    leaf = lambda n: cut[n.arg] if n.op == "input" and n.arg in cut else m.get(id(n), n)
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
