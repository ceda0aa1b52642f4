"""Online softmax: a softmax contracted with values along its own axis runs in one pass over that
axis. exp(x - max(x)) / sum(exp(x - max(x))) needs the row's maximum before its first term, but
the pair (m, l) of a running maximum and a sum rescaled by exp(m_old - m_new) whenever the maximum
grows is itself a reduction, and so is the product with values rescaled the same way: the max, the
sum and the contraction become one pass, and the normalisation moves after the contraction (one
division per output instead of per probability). That is attention's flash form, and nothing in
it depends on what computed x: a scale, an additive mask, a bias, soft-capping or a window are
whatever x is.

So the rule is stated on the contraction of any softmax, not on a named attention pattern:

    sum_k(view(softmax(x, r), va) * view(v, vb))  ==  attend(x, view(v, b2), r, p2)

where the product reads the softmax's axis r as its reduction axis and each row of probabilities
whole and in order (`plan_online`); the product as the frontend writes it (expand, multiply, sum
over a last axis, one row or many: `ir.view.product_operands`), or as a Matmul (the form a
normalisation after the product becomes, recognition's late rules). Extraction costs `Attend` as
one kernel that never writes the probabilities; a target that runs it as one kernel
(`Target.fused`, "attention") gets it from grouping as it was extracted, any other its
decomposition."""

from __future__ import annotations

from collections.abc import Callable

from ..ir import graph as g
from ..ir.graph import Graph
from ..ir.symbolic import as_int, mod, sym_eq
from ..ir.view import View, product_operands
from .composites import matmul as product
from .composites import softmax
from .lang import Rule, RuleSet
from .recognition import plan_matmul


def plan_online(vp: View, shape: tuple) -> bool:
    """Whether view(p, vp) of a p of `shape` reads p's last axis as its own last axis and nothing
    else along it: every row vp reads is a whole row of p, in order (a softmax's rows, which one
    pass reduces)."""
    if vp.mask is not None or not shape or not vp.shape:
        return False
    row = shape[-1]
    return (sym_eq(vp.shape[-1], row) and as_int(vp.strides[-1]) == 1
            and all(sym_eq(mod(s, row), 0) for s in (*vp.strides[:-1], vp.offset)))


def fill_online(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """For every product of two views in the graph, p read through va and v through vb over k (both
    orders): att_p / att_v(va, vb, k) = product_operands's views, and rows_whole(view, shape of p,
    last axis) = 1 for the views of p a product reads it through that plan_online accepts
    (product_operands's, and the matmul plan's that the Matmul rule sees); also for the views of a
    softmax composite (a rule's example). (From the graph's nodes: the terms do not carry p's shape.)"""
    out = []

    def online(view: View, shape: tuple) -> None:
        if plan_online(view, shape):
            out.append(("rows_whole", (enc.view_id(view), enc.shape_id(shape), len(shape) - 1), 1))

    for n in enc.graph.nodes():
        if n.op == "view" and n.srcs[0].op == "softmax":
            online(n.arg, tuple(n.srcs[0].shape))
        if n.op != "sum" or n.srcs[0].op != "mul" or any(x.op != "view" for x in n.srcs[0].srcs):
            continue
        x, y = n.srcs[0].srcs
        for pv, vv in ((x, y), (y, x)):
            shape = tuple(pv.srcs[0].shape)
            plan = product_operands(pv.arg, vv.arg, n.arg)
            if plan is not None and plan_online(plan[0], shape):
                key = (enc.view_id(pv.arg), enc.view_id(vv.arg), n.arg)
                out += [("att_p", key, enc.view_id(plan[0])), ("att_v", key, enc.view_id(plan[1]))]
                online(plan[0], shape)
            mm = plan_matmul(pv.arg, vv.arg, n.arg)
            if mm is not None:
                online(mm[0], shape)
    return out


def _example(rows: int, swapped: bool = False, matmul: bool = False) -> Callable[[], Graph]:
    def example() -> Graph:
        """softmax(x [2, rows, 5]) contracted with v [2, 5, 6]: as the frontend writes the product
        (expand, multiply, sum over a last axis; probabilities first or second), or as a Matmul (x
        [1, 2, rows, 5] through the frontend's reshape of 4-D attention to 3-D)."""
        x, v = g.input_("x", (1, 2, rows, 5) if matmul else (2, rows, 5)), g.input_("v", (2, 5, 6))
        p = softmax(x, -1)
        if matmul:
            return Graph([x, v], [product(g.movement(p, lambda w: w.reshape((2, rows, 5))), v)], {})
        full = (2, rows, 6, 5)
        pe = g.expand_to(g.movement(p, lambda w: w.reshape((2, rows, 1, 5))), full)
        ve = g.expand_to(g.movement(v, lambda w: w.permute((0, 2, 1)).reshape((2, 1, 6, 5))), full)
        return Graph([x, v], [g.reduce("sum", g.binary("mul", *((ve, pe) if swapped else (pe, ve))), 3)], {})
    return example


_WHEN = ("(= sx (shp x))", "(= p2 (att_p va vb k))", "(= b2 (att_v va vb k))", "(= 1 (rows_whole p2 sx r))")

RULES = RuleSet("online", (
    Rule("online-softmax-product", "(Sum (Mul (View (Softmax x r f) va) (View v vb)) k)",
         "(Attend x (View v b2) r p2 f)", _WHEN, example=_example(3)),
    Rule("online-softmax-product-swapped", "(Sum (Mul (View v vb) (View (Softmax x r f) va)) k)",
         "(Attend x (View v b2) r p2 f)", _WHEN, example=_example(3, swapped=True)),
    Rule("online-softmax-matmul", "(Matmul (View (Softmax x r f) vp) v)", "(Attend x v r vp f)",
         ("(= sx (shp x))", "(= 1 (rows_whole vp sx r))"), example=_example(3, matmul=True)),
))
