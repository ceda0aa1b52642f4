"""The e-graph stage: equality saturation over the primitive IR, K candidate programs out.

    optimize(graph, target="cpu", k=8) -> Optimized(candidates=[Graph, ...], stats={...})

Every candidate computes the same values as `graph` (same inputs, same out_spec; it may
add weights laid out at compile time); candidates[0] is the cheapest by the DAG cost.
Composite ops the candidates may contain are documented in `eclat.rewrites.composites`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..ir.graph import Graph
from .encode import Encoding, decode
from .extract import candidates, costs, read_egraph
from .registry import EXPLOSIVE, FUSION, STAGES, backend_rules
from .schedule import Saturation


@dataclass
class Optimized:
    candidates: list[Graph]
    stats: dict = field(default_factory=dict)


def optimize(graph: Graph, target: str = "cpu", k: int = 8, *, time_limit: float = 5.0,
             node_limit: int = 30000) -> Optimized:
    """Saturate graph under the rule sets (and target's own), extract k distinct candidates."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    start = time.perf_counter()
    main = [*STAGES, *backend_rules(target)]
    enc = Encoding.of(graph)
    sat = Saturation.start([*main, *EXPLOSIVE, *FUSION], time_limit * 0.6, node_limit)
    enc.insert(sat.egraph)
    sat.run(main)
    sat.run(list(EXPLOSIVE), max_chunks=2)
    sat.run(main)
    sat.run(list(FUSION), max_chunks=3)
    data = read_egraph(sat.egraph, enc.attrs)
    cost = costs(data, enc.attrs)
    deadline = start + time_limit
    choices = candidates(data, cost, k, deadline=lambda: time.perf_counter() > deadline)
    graphs = [decode(enc, lambda c, ch=ch: data.nodes[ch[c]], data.roots) for ch in choices]
    stats = {
        "enodes": len(data.nodes),
        "eclasses": len(set(data.node_class)),
        "iterations": sat.iterations,
        "seconds": round(time.perf_counter() - start, 3),
        "rules": sat.matches,
        "extracted": len(graphs),
        "stopped": sat.stopped,
        "costs": [round(sum(cost[n] for n in ch.values()), 1) for ch in choices],
    }
    return Optimized(graphs, stats)


__all__ = ["Optimized", "backend_rules", "optimize"]
