"""Soundness checking of rules: instantiate a rule on small random tensors, let egglog apply
it, and compare every program the e-graph then holds with the interpreter."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import Graph, Node
from ..ir.interpreter import run
from . import layout, merge, recognition
from .encode import Encoding, build, decode, fill
from .extract import costs, extract, prefer, reachable, read_egraph
from .lang import CTORS, Rule, RuleSet, parse
from .schedule import Saturation

DEFAULT_SHAPE = (2, 3)


def example_graph(rule: Rule) -> Graph:
    """A graph whose output has the form of the rule's left-hand side."""
    if callable(rule.example):
        return rule.example()
    holder = Encoding(Graph([], [], {}))
    inputs: dict[str, Node] = {}

    def tensor(name: str) -> Node:
        if name not in inputs:
            spec = rule.example.get(name, DEFAULT_SHAPE)
            shape, dtype = spec if isinstance(spec[-1], DType) else (spec, DType.float32)
            inputs[name] = g.input_(name, shape, dtype)
        return inputs[name]

    def walk(e, kind: str):
        if isinstance(e, str):
            if kind == "T":
                return tensor(e)
            value = rule.example[e]
            return holder.attr(("example", value), value) if kind == "attr" else value
        if not isinstance(e, tuple):
            return e
        ctor, *args = e
        kinds = CTORS[ctor][1]
        vals = [walk(a, k) for a, k in zip(args, kinds)]
        if ctor == "Fill":
            return fill(vals[0], holder.attrs[vals[1]], holder.attrs[vals[2]])
        return build(holder, ctor, vals)

    out = walk(parse(rule.lhs), "T")
    return Graph(list(inputs.values()), [out], {})


def random_inputs(graph: Graph, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for n in graph.inputs:
        shape = tuple(int(d) for d in n.shape)
        if n.dtype is DType.bool:
            out.append(rng.random(shape) < 0.5)
        elif not n.dtype.is_float:
            out.append(rng.integers(0, 4, shape).astype(n.dtype.np))
        else:  # positive, away from zero: every rule's domain
            out.append(rng.uniform(0.5, 2.0, shape).astype(n.dtype.np))
    return out


@dataclass
class RuleCheck:
    rule: str
    matches: int
    programs: int  # distinct programs compared with the interpreter
    rewritten: int  # how many of them differ from the example
    worst: float   # largest relative error among them


def check_rule(rule: Rule, explosive: bool = False) -> RuleCheck:
    graph = example_graph(rule)
    inputs = random_inputs(graph)
    (ref,) = run(graph, inputs)
    enc = Encoding.of(graph)
    rs = RuleSet("check", (rule,), explosive)
    sat = Saturation.start([rs], time_limit=10.0, node_limit=5000)
    enc.insert(sat.egraph)
    sat.run([rs], max_chunks=3)
    data = read_egraph(sat.egraph, enc.attrs)
    base = costs(data, enc.attrs, copy_leaves=True)
    seen: set[frozenset] = set()
    worst, rewritten = 0.0, 0
    for n in range(len(data.nodes)):
        if base[n] == math.inf:
            continue
        forced = list(base)
        forced[n] = -1e12  # choose this node wherever it is reachable
        choice = reachable(data, extract(data, forced))
        if choice is None or frozenset(choice.values()) in seen:
            continue
        seen.add(frozenset(choice.values()))
        cand = decode(enc, lambda c, ch=choice: data.nodes[ch[c]], data.roots)
        (got,) = run(cand, inputs)
        if got.shape != ref.shape:
            return RuleCheck(rule.name, 0, len(seen), 0, math.inf)
        rewritten += str(cand) != str(graph)
        worst = max(worst, _error(got, ref))
    return RuleCheck(rule.name, sum(sat.matches.get("check", {}).values()), len(seen), rewritten, worst)


def _error(got: np.ndarray, ref: np.ndarray) -> float:
    """Largest relative error; a NaN or infinity on one side only (a safe softmax's zeros turned NaN,
    say) is an infinite one, where plain arithmetic would drop it (max ignores NaN)."""
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))
    with np.errstate(invalid="ignore"):
        err = np.abs(got - ref) / (np.abs(ref) + 1e-3)
    return float(np.max(np.where(same, 0.0, np.nan_to_num(err, nan=np.inf)), initial=0.0))


def check_merges(graph: Graph, seed: int = 0) -> tuple[Graph, int, float]:
    """Soundness of the merges on graph (any number of outputs): saturate with recognition,
    layout and the merge rules, extract the merged program as optimize does and compare it with
    the interpreter on random inputs. (the program, groups merged, largest relative error)"""
    enc = Encoding.of(graph)
    sat = Saturation.start([recognition.RULES, layout.RULES, merge.RULES], time_limit=10.0, node_limit=20000)
    enc.insert(sat.egraph)
    plain = [recognition.RULES, layout.RULES]
    for rulesets, chunks in ((plain, 50), ([merge.RULES], 1), (plain, 50)):
        sat.run(rulesets, max_chunks=chunks)
    data = read_egraph(sat.egraph, enc.attrs)
    cost = costs(data, enc.attrs)
    base = reachable(data, extract(data, cost))
    assert base is not None, "the e-graph has no acyclic program"
    (choice, *_), taken = prefer(data, cost, merge.slices(enc), [base], 1)
    program = decode(enc, lambda c: data.nodes[choice[c]], data.roots)
    inputs = random_inputs(graph, seed)
    worst = 0.0
    for got, ref in zip(run(program, inputs), run(graph, inputs)):
        if got.shape != ref.shape:
            return program, taken, math.inf
        worst = max(worst, _error(got, ref))
    return program, taken, worst
