"""Graph <-> egglog terms.

`Encoding.of(graph)` turns a Graph into terms (shared subterms stay shared), interning
attributes egglog cannot reason about into `attrs`. `insert` adds them to an egglog
e-graph as one rule with an empty body whose actions are `let`s (the fastest insertion
measured), with every output under the `Out` relation so that all outputs and their
sharing survive extraction. `decode` builds a Graph back from a chosen e-node per class.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import egglog.bindings as eb
import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import OPS, Graph, Node
from ..ir.symbolic import as_int
from ..ir.view import View, compose
from .composites import COMPOSITE_ARGS, build_composite
from .lang import CTOR_OF_OP, CTORS
from .layout import laid_out

Term = tuple  # (ctor, *args) with T arguments as term indices


@dataclass
class Encoding:
    graph: Graph
    attrs: list[Any] = field(default_factory=list)
    ids: dict[Hashable, int] = field(default_factory=dict)
    terms: list[Term] = field(default_factory=list)
    term_ids: dict[Term, int] = field(default_factory=dict)
    roots: list[int] = field(default_factory=list)
    new_weights: dict[str, tuple[str, View]] = field(default_factory=dict)  # name -> (source, view)
    joined: dict[str, Any] = field(default_factory=dict)  # name -> merge.Joined (weights joined)
    oracles: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)
    made: dict[str, np.ndarray] = field(default_factory=dict)
    constants: dict[str, np.ndarray] = field(default_factory=dict)  # weights the rules' right sides add

    def attr(self, key: Hashable, value: Any = None) -> int:
        if key not in self.ids:
            self.ids[key] = len(self.attrs)
            self.attrs.append(key[1] if value is None else value)
        return self.ids[key]

    def shape_id(self, shape) -> int:
        return self.attr(("shape", tuple(shape)))

    def dtype_id(self, dtype: DType) -> int:
        return self.attr(("dtype", dtype))

    def view_id(self, v: View) -> int:
        return self.attr(("view", v))

    def arg_id(self, a: Any) -> int:
        """The id of a composite's non-operand argument (a View, or a hashable description)."""
        return self.view_id(a) if isinstance(a, View) else self.attr(("arg", a))

    def leaf_id(self, node: Node) -> int:
        return self.attr(("leaf", id(node)), node)

    def constant(self, name: str, array: np.ndarray) -> int:
        """The leaf id of a constant tensor a rule's right side reads (a transform's matrix)."""
        self.constants[name] = array
        return self.attr(("constant", name), Node("weight", (), name, array.shape, DType.float32))

    def term(self, t: Term) -> int:
        if t not in self.term_ids:
            self.term_ids[t] = len(self.terms)
            self.terms.append(t)
        return self.term_ids[t]

    @staticmethod
    def of(graph: Graph) -> Encoding:
        from .registry import ORACLE_FILLERS

        enc = Encoding(graph)
        for n in graph.inputs:
            enc.leaf_id(n)  # inputs keep their order even when unused
        index: dict[int, int] = {}
        for node in graph.nodes():
            index[id(node)] = enc.term(enc._term_of(node, [index[id(s)] for s in node.srcs]))
        enc.roots = [index[id(o)] for o in graph.outputs]
        for fill in ORACLE_FILLERS:
            enc.oracles += fill(enc)
        return enc

    def _term_of(self, node: Node, srcs: list[int]) -> Term:
        if node.op == "const":
            return ("Fill", float(node.arg[0]), self.dtype_id(node.dtype), self.shape_id(()))
        if node.kind == "leaf":
            return ("Leaf", self.leaf_id(node))
        if node.op == "view":
            src, v = node.srcs[0], node.arg
            if src.op == "const" and v.mask is None and as_int(v.offset) == 0:
                return ("Fill", float(src.arg[0]), self.dtype_id(src.dtype), self.shape_id(v.shape))
            return ("View", srcs[0], self.view_id(v))
        if node.op == "cast":
            return ("Cast", srcs[0], self.dtype_id(node.dtype))
        if node.kind == "reduce":
            return (CTOR_OF_OP[node.op], srcs[0], node.arg)
        if node.op in CTOR_OF_OP:
            kinds = CTORS[CTOR_OF_OP[node.op]][1][len(srcs):]
            args = [self.arg_id(a) if kind == "attr" else a
                    for a, kind in zip(COMPOSITE_ARGS.get(node.op, lambda a: ())(node.arg), kinds)]
            return (CTOR_OF_OP[node.op], *srcs, *args)
        if not 1 <= len(srcs) <= 3:
            raise NotImplementedError(f"the e-graph cannot hold op {node.op!r} with {len(srcs)} operands")
        key = (node.op, node.arg, tuple(node.shape), node.dtype)
        try:
            hash(key)
        except TypeError:
            key = (node.op, id(node))
        return (f"Op{len(srcs)}", self.attr(("op", key), (node.op, node.arg, tuple(node.shape), node.dtype)),
                *srcs)

    # --- into egglog -----------------------------------------------------------------------
    def insert(self, egraph: eb.EGraph) -> None:
        sp = eb.RustSpan("eclat.rewrites.encode", 0, 0)
        lit = {"f64": eb.Float, "int": eb.Int, "attr": eb.Int}
        actions: list[Any] = []
        for k, (ctor, *args) in enumerate(self.terms):
            kinds = CTORS[ctor][1]
            exprs = [eb.Var(sp, f"t{a}") if kind == "T" else eb.Lit(sp, lit[kind](a))
                     for kind, a in zip(kinds, args)]
            actions.append(eb.Let(sp, f"t{k}", eb.Call(sp, ctor, exprs)))
        for i, r in enumerate(self.roots):
            actions.append(eb.Expr_(sp, eb.Call(sp, "Out", [eb.Lit(sp, eb.Int(i)), eb.Var(sp, f"t{r}")])))
        for key, i in self.ids.items():
            if key[0] == "dtype" and key[1].is_float:
                actions.append(eb.Expr_(sp, eb.Call(sp, "FloatDT", [eb.Lit(sp, eb.Int(i))])))
        for name, keys, value in self.oracles:
            actions.append(eb.Set(sp, name, [eb.Lit(sp, eb.Int(k)) for k in keys], eb.Lit(sp, eb.Int(value))))
        egraph.run_program(eb.RuleCommand(eb.Rule(sp, actions, [], "insert_graph", "")),
                           eb.RunSchedule(eb.Run(sp, eb.RunConfig("", None))))


# --- back to the IR ----------------------------------------------------------------------------

def make_view(x: Node, v: View) -> Node:
    """x read through v (v indexes x's elements in row-major order)."""
    if x.op == "view":
        composed = compose(x.arg, v)
        if composed is None:
            x = g.contiguous(x)  # two views of arbitrary strides do not compose in general
        else:
            x, v = x.srcs[0], composed
    if v.is_contiguous and tuple(v.shape) == tuple(x.shape):
        return x
    return g.view(x, v)


def fill(value: float, dtype: DType, shape: tuple) -> Node:
    py = float if dtype.is_float else (bool if dtype is DType.bool else int)
    c = g.const(py(value), dtype)
    return g.expand_to(c, shape) if shape else c


_BUILD: dict[str, Callable[..., Node]] = {
    "Leaf": lambda enc, a: enc.attrs[a],
    "Fill": lambda enc, v, d, s: fill(v, enc.attrs[d], enc.attrs[s]),
    "Cast": lambda enc, x, d: g.cast(x, enc.attrs[d]),
    "View": lambda enc, x, v: make_view(x, enc.attrs[v]),
    "Where": lambda enc, c, a, b: g.where(c, a, b),
    "Contiguous": lambda enc, x: g.contiguous(x),
    "Gather": lambda enc, t, i: g.gather(t, i),
}


def build(enc: Encoding, ctor: str, args: list[Any]) -> Node:
    """One IR node from a constructor and its (already built) arguments."""
    if ctor in _BUILD:
        return _BUILD[ctor](enc, *args)
    op, kinds = CTORS[ctor]
    if ctor.startswith("Op"):
        name, arg, shape, dtype = enc.attrs[args[0]]
        return Node(name, args[1:], arg, shape, dtype)
    kind = OPS[op].kind
    if kind == "unary":
        return g.unary(op, args[0])
    if kind == "binary":
        return g.binary(op, *args)
    if kind == "reduce":
        return g.reduce(op, *args)
    return build_composite(op, [enc.attrs[a] if k == "attr" else a for k, a in zip(kinds, args)])


def decode(enc: Encoding, choice: Callable[[int], tuple], roots: list[int]) -> Graph:
    """A Graph from `choice(cls) -> (ctor, *args)` (T args are class ids), for the root classes."""
    built: dict[int, Node] = {}
    stack = list(roots)
    while stack:
        cls = stack[-1]
        if cls in built:
            stack.pop()
            continue
        ctor, *args = choice(cls)
        kinds = CTORS[ctor][1]
        missing = [a for k, a in zip(kinds, args) if k == "T" and a not in built]
        if missing:
            stack.extend(missing)
            continue
        stack.pop()
        built[cls] = build(enc, ctor, [built[a] if k == "T" else a for k, a in zip(kinds, args)])
    outputs = [built[r] for r in roots]
    weights = enc.graph.weights | enc.constants
    for n in Graph([], outputs, {}).nodes():
        if n.op == "weight" and n.arg in enc.new_weights:
            if n.arg not in enc.made:  # laid out once, when a candidate first uses it
                src, v = enc.new_weights[n.arg]
                enc.made[n.arg] = laid_out(enc.graph.weights[src], v)
            weights[n.arg] = enc.made[n.arg]
        elif n.op == "weight" and n.arg in enc.joined:
            if n.arg not in enc.made:
                enc.made[n.arg] = enc.joined[n.arg].array(enc.graph.weights)
            weights[n.arg] = enc.made[n.arg]
    return Graph(enc.graph.inputs, outputs, weights, enc.graph.out_spec)
