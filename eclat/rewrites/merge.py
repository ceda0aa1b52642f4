"""Horizontal merges: products of one input against several constant weights (Q, K and V; gate
and up; branches of one input) become one product over the weights joined at compile time,
each original product a free slice of it.

A product is the primitive form the frontend writes a linear layer in, a broadcast multiply
summed over one axis: `Sum(Mul(View x va, View (Leaf w) vb), r)`, x read broadcast along one
axis n (the output features), w not. The rules are egglog multi-patterns (Tensat's): a query
holding two products of the same x and r, run once after recognition. Which products merge,
the joined weight and every view are planned in Python at insertion (`fill_merge`), one group
per x: the merged product `Sum(Mul(View x vaJ, View (Leaf J) vbJ), r)` reads x along
n = N1 + N2 + ... and J holds every member's weight joined along n, so the pair of a group's
members always unions with one product, however many members it has (QKV in one step). Its
plan as a matmul and J's layout for it are planned too, so the next recognition and layout
runs treat it like any product. Soundness holds for any x the rule binds: the oracles are keyed
by every view the rule reads (va, vb, r, the weights), so a product that reads x otherwise
never matches.

The greedy extraction decides per e-class, where a slice pays the whole merged product and
always loses; `extract.prefer` tries each group (`slices`) taken by all its members at once and
keeps it where the program's cost falls (one launch saved per merged product, x read once).
`check.check_merges` is their soundness check.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import Graph, Node
from ..ir.interpreter import read_view
from ..ir.symbolic import as_int
from ..ir.view import View, contiguous_strides
from . import layout, recognition
from .lang import RuleSet


@dataclass(frozen=True)
class Joined:
    """A weight made at compile time: each part (weight name, view) read, the parts joined
    along axis, the result read through `then` (a layout) when given."""
    parts: tuple[tuple[str, View], ...]
    axis: int
    then: View | None = None

    @property
    def name(self) -> str:
        digest = hashlib.sha1(repr(self).encode()).hexdigest()[:10]
        return f"{self.parts[0][0]}.cat{digest}"

    def array(self, weights: dict[str, np.ndarray]) -> np.ndarray:
        joined = np.concatenate([read_view(np.ascontiguousarray(weights[w]).reshape(-1), v)
                                 for w, v in self.parts], self.axis)
        return joined if self.then is None else read_view(joined.reshape(-1), self.then)

    def renamed(self, names: Callable[[str], str]) -> Joined:
        return replace(self, parts=tuple((names(w), v) for w, v in self.parts))


# --- planning at insertion -------------------------------------------------------------------

@dataclass(frozen=True)
class _Member:
    leaf: int  # the weight's leaf id
    vb: int    # view ids
    va: int


def _product(enc, xs: int, ws: int, r: int) -> tuple[tuple, _Member] | None:
    """(group key, member) when terms xs, ws are View x va, View (Leaf w) vb of a product
    summed over r with w a constant weight, x broadcast along exactly one axis w is not."""
    xt, wt = enc.terms[xs], enc.terms[ws]
    if xt[0] != "View" or wt[0] != "View" or enc.terms[wt[1]][0] != "Leaf":
        return None
    leaf = enc.terms[wt[1]][1]
    w, va, vb = enc.attrs[leaf], enc.attrs[xt[2]], enc.attrs[wt[2]]
    if w.op != "weight" or w.arg not in enc.graph.weights or va.mask is not None or vb.mask is not None:
        return None
    strides = [as_int(s) for s in vb.strides]
    # symbolic sizes: decode could not compose the slices with their readers' views (copies)
    if None in (*strides, as_int(vb.offset), *(as_int(d) for d in va.shape)) or strides[r] == 0:
        return None
    ns = [k for k in range(va.ndim) if k != r and as_int(va.strides[k]) == 0
          and as_int(va.shape[k]) != 1 and strides[k] != 0]
    if len(ns) != 1:
        return None
    n = ns[0]
    shape = (*va.shape[:n], None, *va.shape[n + 1:])  # members differ in their number of features only
    key = (xt[1], r, n, shape, va.strides, va.offset, tuple(s == 0 for s in strides), w.dtype)
    return key, _Member(leaf, wt[2], xt[2])


def fill_merge(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """cat(w1, vb1, w2, vb2) = the group's joined weight J; catx(va, r, J) = x's view for the
    merged product, catw(J) = J's; part(w, vb, J) = the member's slice of the merged product.
    Also the merged product's matmul plan (mm_a, mm_b, mm_o) and J's layout for it (laid)."""
    groups: dict[tuple, list[_Member]] = {}
    for t in enc.terms:
        if t[0] != "Sum" or enc.terms[t[1]][0] != "Mul":
            continue
        _, i, j = enc.terms[t[1]]
        for xs, ws in ((i, j), (j, i)):
            found = _product(enc, xs, ws, t[2])
            if found is not None:
                members = groups.setdefault(found[0], [])
                if all((m.leaf, m.vb) != (found[1].leaf, found[1].vb) for m in members):
                    members.append(found[1])
    out = []
    for (_, r, n, *_), members in groups.items():
        if len(members) > 1:
            out += _join(enc, r, n, members)
    return out


def _join(enc, r: int, n: int, members: list[_Member]) -> list[tuple[str, tuple[int, ...], int]]:
    vbs = [enc.attrs[m.vb] for m in members]
    va = enc.attrs[members[0].va]
    core = [k for k, s in enumerate(vbs[0].strides) if as_int(s) != 0]  # the axes w itself spans
    parts = tuple((enc.attrs[m.leaf].arg, View.make([v.shape[k] for k in core], [v.strides[k] for k in core],
                                                      v.offset)) for m, v in zip(members, vbs))
    sizes = [as_int(v.shape[n]) for v in vbs]
    total = sum(sizes)
    joined = Joined(parts, core.index(n))
    jshape = tuple(total if k == n else as_int(vbs[0].shape[k]) for k in core)
    j = _leaf(enc, joined, jshape, enc.attrs[members[0].leaf].dtype)
    wide = tuple(total if k == n else d for k, d in enumerate(va.shape))
    va_j = View.make(wide, va.strides, va.offset)
    jstrides = dict(zip(core, contiguous_strides(jshape)))
    vb_j = View.make(wide, [jstrides.get(k, 0) for k in range(len(wide))])
    out_shape = wide[:r] + wide[r + 1:]
    axis = n - (r < n)
    out = [("catw", (j,), enc.view_id(vb_j))]
    start = 0
    for m, size in zip(members, sizes):
        bounds = [(start, start + size) if k == axis else (0, d) for k, d in enumerate(out_shape)]
        out += [("catx", (m.va, r, j), enc.view_id(va_j)),
                ("part", (m.leaf, m.vb, j), enc.view_id(View.contiguous(out_shape).shrink(bounds)))]
        out += [("cat", (m.leaf, m.vb, o.leaf, o.vb), j) for o in members if o is not m]
        start += size
    plan = recognition.plan_matmul(va_j, vb_j, r)
    if plan is not None:  # recognition makes it a matmul; its weight operand laid out as J'
        key = (enc.view_id(va_j), enc.view_id(vb_j), r)
        out += [(name, key, enc.view_id(v)) for name, v in zip(("mm_a", "mm_b", "mm_o"), plan)]
        if layout.is_permutation(plan[1], math.prod(jshape)):
            laid = _leaf(enc, replace(joined, then=plan[1]), tuple(plan[1].shape), enc.attrs[j].dtype)
            out.append(("laid", (j, enc.view_id(plan[1])), laid))
    return out


def _leaf(enc, joined: Joined, shape: tuple, dtype: DType) -> int:
    enc.joined[joined.name] = joined
    return enc.leaf_id(Node("weight", (), joined.name, shape, dtype))


# --- the rules ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class MultiRule:
    """An egglog rule whose query holds several terms (facts) and whose actions union each of
    them with a new form; checked like a Rule through `example` (a Graph where it fires)."""
    name: str
    facts: tuple[str, ...]
    actions: tuple[str, ...]
    example: Callable[[], Graph]

    def egglog(self, ruleset: str) -> str:
        return (f'(rule ({" ".join(self.facts)}) ({" ".join(self.actions)}) '
                f':ruleset {ruleset} :name "{self.name}")')


def _operands(k: int, x_first: bool) -> str:
    x, w = f"(View x va{k})", f"(View (Leaf w{k}) vb{k})"
    return f"{x} {w}" if x_first else f"{w} {x}"


def _rule(first: bool, second: bool) -> MultiRule:
    """The pair rule for one order of each product's operands (x first or the weight first)."""
    order = lambda f: "xw" if f else "wx"
    return MultiRule(
        f"merge-{order(first)}-{order(second)}",
        (f"(= e1 (Sum (Mul {_operands(1, first)}) r))", f"(= e2 (Sum (Mul {_operands(2, second)}) r))",
         "(= j (cat w1 vb1 w2 vb2))", "(= vaj (catx va1 r j))", "(= vaj (catx va2 r j))",
         "(= vbj (catw j))", "(= s1 (part w1 vb1 j))", "(= s2 (part w2 vb2 j))"),
        ("(let m (Sum (Mul (View x vaj) (View (Leaf j) vbj)) r))", "(union e1 (View m s1))",
         "(union e2 (View m s2))"),
        example=lambda: example(first, second))


def example(first: bool = True, second: bool = True, m: int = 3) -> Graph:
    """x [m, 4] times two weights [5, 4] and [6, 4] (torch's Linear layout), written as broadcast
    multiply and sum with each product's operands in the order given (x first when True); the
    output holds both products side by side (a padded view of each, added)."""
    rng = np.random.default_rng(0)
    x = g.input_("x", (m, 4))
    weights = {f"w{i}": rng.standard_normal((n, 4)).astype(np.float32) for i, n in ((1, 5), (2, 6))}

    def product(name: str, w: np.ndarray, x_first: bool) -> Node:
        full = (m, w.shape[0], 4)
        xv = g.movement(x, lambda v: v.reshape((m, 1, 4)).expand(full))
        wv = g.movement(g.weight(name, w, DType.float32), lambda v: v.reshape((1, *w.shape)).expand(full))
        return g.reduce("sum", g.binary("mul", *((xv, wv) if x_first else (wv, xv))), 2)

    outs = [product(name, w, f) for (name, w), f in zip(weights.items(), (first, second))]
    p1 = g.movement(outs[0], lambda v: v.pad(((0, 0), (0, 6))))
    p2 = g.movement(outs[1], lambda v: v.pad(((0, 0), (5, 0))))
    return Graph([x], [g.binary("add", p1, p2)], weights)


# one order of the operands per product, x first or the weight first (the mirror of a mixed pair
# is the same pair)
RULES = RuleSet("merge", (_rule(True, True), _rule(True, False), _rule(False, False)))


# --- extraction ----------------------------------------------------------------------------------

def slices(enc) -> dict[int, tuple[int, set[int]]]:
    """Each group by joined weight: (the view J is read through, the members' slice views)."""
    out: dict[int, tuple[int, set[int]]] = {}
    for name, keys, value in enc.oracles:
        if name == "catw":
            out.setdefault(keys[0], (value, set()))
    for name, keys, value in enc.oracles:
        if name == "part":
            out[keys[2]][1].add(value)
    return out


def rebound(cand: Graph, m: dict[int, Node], joined: dict[str, Joined], rep_weights: dict[str, Node],
            weights: dict[str, np.ndarray], made: dict[str, np.ndarray]) -> dict[int, Node]:
    """m (a block's match, see blocks.rebind) with each joined weight of cand mapped to the same
    join of the block's own weights; weights gains their arrays (made caches them)."""
    out = dict(m)
    for n in cand.nodes():
        if n.op == "weight" and n.arg in joined:
            mine = joined[n.arg].renamed(lambda w: m.get(id(rep_weights[w]), rep_weights[w]).arg)
            if mine.name not in made:
                made[mine.name] = mine.array(weights)
            weights[mine.name] = made[mine.name]
            out[id(n)] = Node("weight", (), mine.name, n.shape, n.dtype)
    return out
