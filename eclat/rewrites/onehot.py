"""Recognition of a gather written as a one-hot product: sum over v of (iota_v == idx) * table[v, ...]
(or where(iota_v == idx, table[v, ...], 0)) is table[idx, ...], as embedding, one_hot(x) @ W and
index arithmetic write it. An index outside [0, V) selects no row (zeros), where `gather` would
clamp, so the rewrite keeps that: where(0 <= idx < V, gather(table, idx), 0).

Equality is `where(where(a < b, True, b < a), False, True)`, as the frontend lowers `eq`. Which
axes the one-hot, the index and the table run along is View arithmetic, planned in Python
(`plan_gather`) for every such sum of the graph and read by the rule from the oracles g_*.
"""

from __future__ import annotations

import math

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import Graph, Node
from ..ir.symbolic import as_int
from ..ir.view import View, contiguous_strides
from .lang import Rule

INDEX = (DType.int32, DType.int64)
EQ = "(Where (Where (Lt (View (Leaf lp) vp) (View (Leaf lq) vq)) (Fill 1.0 b s) " \
     "(Lt (View (Leaf lq) vq) (View (Leaf lp) vp))) (Fill 0.0 b s) (Fill 1.0 b s))"
KEY = "lp vp lq vq v1 w vt r"
OUTS = ("g_idx", "g_out", "g_cond", "g_ishape", "g_gshape", "g_idt", "g_n")
# idx in range: -1 < idx and idx < V, broadcast over the gathered rows; out of range reads zero
RHS = ("(View (Where (View (Where (Lt (Fill -1.0 di si) (Leaf ix)) (Lt (Leaf ix) (Fill (to-f64 n) di si)) "
       "(Fill 0.0 b si)) vc) (Gather (Leaf w) (Leaf ix)) (Fill 0.0 d gs)) vo)")
WHEN = tuple(f"(= {v} ({o} {KEY}))" for v, o in zip(("ix", "vo", "vc", "si", "gs", "di", "n"), OUTS))


def _ints(xs) -> list[int] | None:
    out = [as_int(x) for x in xs]
    return None if any(x is None for x in out) else out


def _axis_map(v1: View, o_shape: list[int]) -> list[list[int]] | None:
    """For each axis of v1 the run of axes of the contiguous o_shape tensor it walks ([]: broadcast),
    when v1 is a permute/expand/merging reshape of it; else None."""
    strides, shape = _ints(v1.strides), _ints(v1.shape)
    if strides is None or shape is None or as_int(v1.offset) != 0 or v1.mask is not None:
        return None
    cs = contiguous_strides(o_shape)
    out: list[list[int]] = []
    for n, st in zip(shape, strides):
        runs = [list(range(j, j2 + 1)) for j2 in range(len(o_shape)) for j in range(j2 + 1)
                if st != 0 and n != 1 and cs[j2] == st and math.prod(o_shape[j:j2 + 1]) == n]
        if st != 0 and n != 1 and not runs:
            return None
        out.append(runs[-1] if runs else [])  # the longest run ending there, ones included
    used = [j for run in out for j in run]
    if len(used) != len(set(used)) or any(j not in used for j, m in enumerate(o_shape) if m != 1):
        return None
    return out


def _lift(axes: list[list[int]], o_shape: list[int], st: list[int]) -> list[int] | None:
    """Strides of a view of the o_shape tensor over v1's axes, or None where a merged run of axes
    is not evenly strided in it."""
    out = []
    for run in axes:
        if any(st[a] != st[b] * o_shape[b] for a, b in zip(run, run[1:]) if o_shape[b] != 1):
            return None
        out.append(st[run[-1]] if run else 0)
    return out


def plan_gather(idx: Node, vi: View, iota: Node, vio: View, v1: View, table: Node, vt: View, r: int
                ) -> tuple[View, View] | None:
    """(out, cond) views with sum_r(view(eq(view(idx, vi), view(iota, vio)), v1) * view(table, vt))
    == view(where(view(in_range(idx), cond), gather(table, idx), 0), out), or None."""
    o_shape, t_shape, i_shape = _ints(vi.shape), _ints(table.shape), _ints(idx.shape)
    if None in (o_shape, t_shape, i_shape) or _ints(vio.shape) != o_shape or len(t_shape) < 1:
        return None
    if any(v.mask is not None for v in (vi, vio, vt)) or iota.shape != (t_shape[0],):
        return None
    axes = _axis_map(v1, o_shape)
    tst, ist, iost = _ints(vt.strides), _ints(vi.strides), _ints(vio.strides)
    if axes is None or None in (tst, ist, iost) or as_int(vio.offset) != 0:
        return None
    s_shape = _ints(v1.shape)
    s_iota, s_idx = _lift(axes, o_shape, iost), _lift(axes, o_shape, ist)
    if s_iota is None or s_idx is None:
        return None
    rows, row = t_shape[0], math.prod(t_shape[1:])
    others = [k for k in range(len(s_shape)) if k != r]
    if (s_shape[r] != rows or s_iota[r] != 1 or s_idx[r] != 0 or tst[r] != row
            or any(s_iota[k] != 0 for k in others) or any(tst[k] < 0 for k in others)):
        return None
    t_off, i_off = as_int(vt.offset), as_int(vi.offset)
    if t_off is None or i_off is None or not 0 <= t_off <= t_off + sum(
            (s_shape[k] - 1) * tst[k] for k in others) < row:
        return None  # the table view must stay inside one row
    out = View.make([s_shape[k] for k in others], [row * s_idx[k] + tst[k] for k in others],
                    row * i_off + t_off)
    cond = View.contiguous([*i_shape, *[1] * (len(t_shape) - 1)]).expand([*i_shape, *t_shape[1:]])
    return out, cond


def _eq_sides(terms: list, t: int) -> tuple[int, int] | None:
    """(p, q) when term t is the frontend's eq of p and q."""
    o = terms[t]
    if o[0] != "Where" or terms[o[1]][0] != "Where":
        return None
    inner = terms[o[1]]
    if terms[inner[1]][0] != "Lt" or terms[inner[3]][0] != "Lt":
        return None
    (_, p, q), (_, q2, p2) = terms[inner[1]], terms[inner[3]]
    return (p, q) if (p, q) == (p2, q2) else None


def fill_gather(enc) -> list[tuple[str, tuple[int, ...], int]]:
    terms, attrs, out = enc.terms, enc.attrs, []
    for t in terms:
        if t[0] != "Sum" or terms[t[1]][0] not in ("Mul", "Where"):
            continue
        body = terms[t[1]]
        pairs = [(body[1], body[2])] if body[0] == "Where" else [(body[1], body[2]), (body[2], body[1])]
        for one, tab in pairs:
            if terms[one][0] != "View" or terms[tab][0] != "View" or terms[terms[tab][1]][0] != "Leaf":
                continue
            eq = terms[one][1]
            if terms[eq][0] == "Cast":
                eq = terms[eq][1]
            sides = _eq_sides(terms, eq)
            if sides is None or any(terms[s][0] != "View" or terms[terms[s][1]][0] != "Leaf" for s in sides):
                continue
            (lp, vp), (lq, vq) = ((terms[terms[s][1]][1], terms[s][2]) for s in sides)
            w, vt, v1, r = terms[terms[tab][1]][1], terms[tab][2], terms[one][2], t[2]
            for (li, vi), (lo, vo) in (((lp, vp), (lq, vq)), ((lq, vq), (lp, vp))):
                idx, iota, table = attrs[li], attrs[lo], attrs[w]
                if iota.op != "iota" or idx.dtype is not iota.dtype or idx.dtype not in INDEX:
                    continue
                plan = plan_gather(idx, attrs[vi], iota, attrs[vo], attrs[v1], table, attrs[vt], r)
                if plan is None:
                    continue
                gshape = (*idx.shape, *table.shape[1:])
                values = (li, enc.view_id(plan[0]), enc.view_id(plan[1]), enc.shape_id(idx.shape),
                          enc.shape_id(gshape), enc.dtype_id(idx.dtype), int(table.shape[0]))
                out += [(name, (lp, vp, lq, vq, v1, w, vt, r), v) for name, v in zip(OUTS, values)]
    return out


def _example(where: bool):
    def example() -> Graph:
        """one_hot(idx [2, 3], 5) @ table [5, 4], written as the frontend writes it: eq as two
        compares, the product as expand, multiply, sum over the vocabulary axis."""
        idx = g.input_("idx", (2, 3), DType.int64)
        iota = g.iota(5, DType.int64)
        a = g.expand_to(g.movement(idx, lambda v: v.reshape((2, 3, 1))), (2, 3, 5))
        b = g.expand_to(iota, (2, 3, 5))
        t, f = (g.expand_to(g.const(v, DType.bool), (2, 3, 5)) for v in (True, False))
        eq = g.where(g.where(g.binary("lt", a, b), t, g.binary("lt", b, a)), f, t)
        table = g.input_("table", (5, 4))
        wide = (2, 3, 4, 5)
        one = g.movement(g.cast(eq, DType.float32) if not where else eq,
                         lambda v: v.reshape((2, 3, 1, 5)).expand(wide))
        tab = g.movement(table, lambda v: v.permute([1, 0]).reshape((1, 1, 4, 5)).expand(wide))
        zero = g.expand_to(g.const(0.0), wide)
        body = g.where(one, tab, zero) if where else g.binary("mul", one, tab)
        return Graph([idx, table], [g.reduce("sum", body, 3)], {})
    return example


RULES = (
    Rule("onehot-gather", f"(Sum (Mul (View (Cast {EQ} d) v1) (View (Leaf w) vt)) r)", RHS, WHEN,
         example=_example(False)),
    Rule("where-gather", f"(Sum (Where (View {EQ} v1) (View (Leaf w) vt) (Fill 0.0 d s2)) r)", RHS, WHEN,
         example=_example(True)),
)
