"""The e-graph stage: equality saturation over the primitive IR, K candidate programs out.

    optimize(graph, target="cpu", k=8) -> Optimized(candidates=[Graph, ...], stats={...})

Every candidate computes the same values as `graph` (same input nodes, same out_spec; it
may add weights laid out at compile time, named "<weight>.laid<n>"); candidates[0] is the
cheapest by `extract.dag_cost` (a fused value is paid once per kernel evaluating it).
Candidates differ in algebraic form, recognised composites (`eclat.rewrites.composites`:
matmul, fma, rsqrt, softmax, rmsnorm, layernorm, attend: a softmax contracted with values in one
pass, `eclat.rewrites.online`; one-hot products become the
primitive gather), weight layout and where `contiguous` materialises a value (a kernel
boundary) and which products sharing an input are merged into one (`eclat.rewrites.merge`); never
only in the order of commutative operands. stats: enodes, eclasses, iterations, seconds,
rules ({rule set: {rule: matches}}), merged (products merged into one in the first candidate,
counted per group), extracted, stopped (why saturation ended), costs, and
for graphs with repeated blocks: segments, blocks (e-graphs actually built).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..ir.graph import Graph, Node
from . import blocks, merge, registry
from .composites import products_once
from .encode import Encoding, decode
from .extract import CPU, Roofline, candidates, costs, dag_cost, differences, prefer, read_egraph
from .registry import EXPLOSIVE, FUSION, STAGES, backend_rules
from .schedule import Saturation, declared, keeping


@dataclass
class Optimized:
    candidates: list[Graph]
    stats: dict = field(default_factory=dict)


def optimize(graph: Graph, target: str = "cpu", k: int = 8, *, time_limit: float = 5.0,
             node_limit: int = 30000, roof: Roofline = CPU) -> Optimized:
    """Saturate graph under the rule sets (and target's own), extract k distinct candidates by
    their estimated time on roof (the target device's measured peaks, when the driver has them).
    Structurally identical blocks (transformer layers) are optimised once and reused."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    backend_rules(target)  # an unknown target fails before any work
    with keeping():  # the blocks reuse one declared e-graph, dropped at the end
        opt = _optimize(graph, target, k, time_limit, node_limit, roof)
    opt.candidates = [products_once(c) for c in opt.candidates]
    return opt


def _optimize(graph: Graph, target: str, k: int, time_limit: float, node_limit: int,
              roof: Roofline) -> Optimized:
    start = time.perf_counter()
    segments, reps = blocks.blocks(graph)
    if len(reps) == len(segments):
        opt, _ = _optimize_one(graph, target, k, time_limit, node_limit, roof)
        return opt
    share = time_limit / len(reps)
    parts = []
    for rep, _ in reps:
        sub = blocks.rep_graph(rep, graph)
        opt, enc = _optimize_one(sub, target, k, share, node_limit, roof)
        if not opt.candidates:  # nothing extracted (classes left untyped): the block as lowered
            opt = Optimized([sub], {**opt.stats, "costs": [0.0], "differs": ["as lowered"]})
        parts.append((opt, enc, {n.arg: n for n in sub.nodes() if n.op == "weight"}))
    of_segment = {i: (r, m) for r, (_, members) in enumerate(reps) for i, m in members}
    graphs, made = [], {}
    for c in range(max(len(opt.candidates) for opt, _, _ in parts)):
        weights = dict(graph.weights)
        value: dict[int, Node] = {}
        for i, seg in enumerate(segments):
            r, m = of_segment[i]
            opt, enc, rep_weights = parts[r]
            cand = _pick(opt.candidates, c)
            ins = [value[id(v)] for v in seg.ins]
            m = merge.rebound(cand, m, enc.joined, rep_weights, weights, made)
            outs = blocks.rebind(cand, m, ins, enc.new_weights, rep_weights, weights, made)
            weights |= enc.constants
            value.update((id(o), v) for o, v in zip(seg.outputs, outs))
        outputs = [value.get(id(o), o) for o in graph.outputs]  # a leaf output is no segment's
        graphs.append(Graph(graph.inputs, outputs, weights, graph.out_spec))
    stats = {
        "enodes": sum(o.stats["enodes"] for o, _, _ in parts),
        "eclasses": sum(o.stats["eclasses"] for o, _, _ in parts),
        "iterations": max(o.stats["iterations"] for o, _, _ in parts),
        "seconds": round(time.perf_counter() - start, 3),
        "rules": _merge([o.stats["rules"] for o, _, _ in parts]),
        "merged": sum(o.stats["merged"] * len(reps[r][1]) for r, (o, _, _) in enumerate(parts)),
        "extracted": len(graphs),
        "stopped": ", ".join(sorted({o.stats["stopped"] for o, _, _ in parts})),
        "segments": len(segments),
        "blocks": len(reps),
        "costs": [round(sum(_pick(parts[r][0].stats["costs"], c) for r, _ in of_segment.values()), 1)
                  for c in range(len(graphs))],
        # what each candidate changes, in each kind of block (the first: "first")
        "differs": ["; ".join(dict.fromkeys(_pick(o.stats["differs"], c) for o, _, _ in parts))
                    for c in range(len(graphs))],
    }
    return Optimized(graphs, stats)


def _pick(items: list, c: int):
    """The c-th candidate of a block, or its last when it has fewer."""
    return items[min(c, len(items) - 1)]


def _merge(counts: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for per_set in counts:
        for rs, rules in per_set.items():
            for rule, n in rules.items():
                out.setdefault(rs, {})[rule] = out.get(rs, {}).get(rule, 0) + n
    return out


def _optimize_one(graph: Graph, target: str, k: int, time_limit: float, node_limit: int,
                  roof: Roofline = CPU) -> tuple[Optimized, Encoding]:
    start = time.perf_counter()
    main = [*STAGES, *backend_rules(target)]
    merges = list(registry.MERGE)
    enc = Encoding.of(graph)
    rulesets = [*main, *EXPLOSIVE, *merges, *FUSION]
    with declared(rulesets) as egraph:
        sat = Saturation.start(rulesets, time_limit * 0.6, node_limit, egraph)
        enc.insert(sat.egraph)
        sat.run(main)
        sat.run(list(EXPLOSIVE), max_chunks=2)
        sat.run(main)
        if merges:  # every group merges in one step (the next ones find it done); then recognise the merged
            sat.run(merges, max_chunks=3)
            sat.run(main)
            sat.run(list(registry.AFTER_MERGE), max_chunks=2)
        sat.run(list(FUSION), max_chunks=3)
        data = read_egraph(sat.egraph, enc.attrs)
    cost = costs(data, enc.attrs, roof=roof)
    deadline = start + time_limit
    choices = candidates(data, cost, k, deadline=lambda: time.perf_counter() > deadline)
    choices, merged = prefer(data, cost, merge.slices(enc) if merges else {}, choices, k)
    graphs = [decode(enc, lambda c, ch=ch: data.nodes[ch[c]], data.roots) for ch in choices]
    stats = {
        "enodes": len(data.nodes),
        "eclasses": len(set(data.node_class)),
        "iterations": sat.iterations,
        "seconds": round(time.perf_counter() - start, 3),
        "rules": sat.matches,
        "merged": merged,
        "extracted": len(graphs),
        "stopped": sat.stopped,
        "costs": [round(dag_cost(data, cost, ch), 1) for ch in choices],
        "differs": differences(data, choices),
    }
    return Optimized(graphs, stats), enc


__all__ = ["Optimized", "backend_rules", "optimize"]
