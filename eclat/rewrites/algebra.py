"""Algebra: a rule set that only simplifies (`RULES`) and one that explores (`EXPLOSIVE`).

`RULES` runs to saturation. Each rule is a `Simplify`: its right side is smaller (fewer operations,
constants free, or as many with a negation moved outward), and the matched e-node is subsumed: it
stays in its class, but no rule matches it again and extraction skips it. Constants combine by
evaluation: two constants and the product (sum, max) that combined them become one new constant.

`EXPLOSIVE` explores (commutativity, associativity, factoring, a scale into or out of a
reduction) under the back-off scheduler, for a bounded number of chunks.

Why this terminates. Reassociated, a class can come to hold itself times a constant: 0 = 0 * 0.5
once 0.5 * 0 is folded, log2(x) = log2(x) * 0.99999998939 once exp(log(x)) is x, x = x * 7 * (1/7)
with a product that rounds off one. Around such a cycle folding makes c^2, c^4, ... without end:
`mul-const-const` with commutativity and associativity took `x*0.5*0.0` to the time limit,
`((x*3)*0.5)*2` out of memory, and (with x*2 = x+x and factoring) `(x*2)/2` to 54,000 e-nodes. So
the rules that compute a new constant from constants (FRESH) run only before the first exploring
stage (`schedule.Saturation` retracts the fact then), on the input's acyclic graph, where the
cycles identities make (x = x * 1) are subsumed. After exploration the rules only union with
existing classes or build constants of a fixed value (exp-log's 0 and NaN, a broadcast sum's
length): no family of constants. Subsumption alone is not enough in egglog 13.2: rules run under
the back-off scheduler still match subsumed nodes, so exploration reassociates them too.
"""

from __future__ import annotations

import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import Graph, Node
from ..ir.symbolic import as_int
from ..ir.view import View
from .lang import Rule, RuleSet

F = {"d": DType.float32, "s": (2, 3)}  # a float32 fill of the example tensors' shape
FRESH = "(= 1 (unexplored 0))"  # before exploration only: a rule computing a constant from constants
NEAR_ONE = 1e-6  # |c - 1| below this is one: the frontend's exp and log constants multiply to 1 - 1.1e-8


class Simplify(Rule):
    """A rule that replaces its left side: the matched e-node joins the right side's class and is
    subsumed (no rule matches it again; extraction skips it)."""

    def egglog(self, ruleset: str) -> str:
        # an identity never subsumes a node into its own class: it may be the class's last
        guard = [f"(!= __e {self.rhs})"] if self.rhs.isidentifier() else []
        facts = " ".join([f"(= __e {self.lhs})", *self.when, *guard])
        actions = f"(union __e {self.rhs}) (subsume {self.lhs})"
        return f'(rule ({facts}) ({actions}) :ruleset {ruleset} :name "{self.name}")'


def _sum_of_broadcast() -> Graph:
    """x [2, 3] read as [2, 4, 3] (broadcast along axis 1), summed over that axis."""
    x = g.input_("x", (2, 3))
    wide = g.movement(x, lambda v: v.reshape((2, 1, 3)).expand((2, 4, 3)))
    return Graph([x], [g.reduce("sum", wide, 1)], {})


def _scaled_product(swapped: bool) -> Graph:
    """(x * 0.5) [2, 3] @ w [3, 4] as the frontend writes a product: both read as [2, 4, 3], multiplied,
    summed over the last axis (the scaled operand second when swapped)."""
    x, w = g.input_("x", (2, 3)), g.input_("w", (3, 4))
    scaled = g.binary("mul", x, g.expand_to(g.const(0.5), (2, 3)))
    xe = g.movement(scaled, lambda v: v.reshape((2, 1, 3)).expand((2, 4, 3)))
    we = g.movement(w, lambda v: v.permute([1, 0]).reshape((1, 4, 3)).expand((2, 4, 3)))
    return Graph([x, w], [g.reduce("sum", g.binary("mul", *((we, xe) if swapped else (xe, we))), 2)], {})


def _view_of_fill() -> Graph:
    """x - 3 as the frontend writes it: the negated scalar broadcast to x's shape."""
    x = g.input_("x", (2, 3))
    c = g.expand_to(g.unary("neg", g.const(3.0)), (2, 3))
    return Graph([x], [g.binary("add", x, c)], {})


def _sum_with_weights() -> Graph:
    """(x + y) + z with y and z weights (Static: known when compiling)."""
    x = g.input_("x", (2, 3))
    y, z = (np.arange(6, dtype=np.float32).reshape(2, 3) / k for k in (3, 7))
    weight = lambda name, v: g.weight(name, v, DType.float32)  # noqa: E731
    out = g.binary("add", g.binary("add", x, weight("y", y)), weight("z", z))
    return Graph([x], [out], {"y": y, "z": z})


RULES = RuleSet("algebra", (
    # identities: the right side is a class that already exists
    Simplify("mul-one", "(Mul x (Fill 1.0 d s))", "x", example=F),
    Simplify("add-zero", "(Add x (Fill 0.0 d s))", "x", example=F),
    Simplify("neg-neg", "(Neg (Neg x))", "x"),
    Simplify("recip-recip", "(Recip (Recip x))", "x"),
    Simplify("log2-exp2", "(Log2 (Exp2 x))", "x"),
    # relu(relu(x)) = relu(x), and any clamp chain: max(max(x, a), b) = max(x, max(a, b))
    Simplify("max-const-const", "(Max (Max x (Fill a d s)) (Fill b d s))", "(Max x (Fill (max a b) d s))",
             ("(FloatDT d)", FRESH), example={**F, "a": 0.0, "b": 0.0}),
    # exp(log(x)) as the frontend writes it (exp2(log2(x) * ln 2 * log2 e), the constants folded):
    # x where log is defined (up to |c - 1| <= NEAR_ONE: relative error |c - 1| * |ln x|), NaN
    # where x < 0, as torch gives
    Simplify("exp-log", "(Exp2 (Mul (Log2 x) (Fill c d s)))",
             "(Where (Lt x (Fill 0.0 d s)) (Fill NaN d s) x)",
             ("(FloatDT d)", f"(< c {1 + NEAR_ONE})", f"(> c {1 - NEAR_ONE})"),
             example={**F, "c": 1 - NEAR_ONE / 2}),
    # a sum over an axis its operand is broadcast along: n copies of the same value. bsum(v, r, n, d)
    # = the view v without axis r, where v repeats dtype-d values n times along r (fill_sums)
    Simplify("sum-broadcast", "(Sum (View x v) r)", "(Mul (View x v2) (Fill (to-f64 n) d s2))",
             ("(= v2 (bsum v r n d))", "(= s2 (vshape v2))"), example=_sum_of_broadcast),
    # constants combine by evaluation. The frontend's x - c negates the scalar c, then broadcasts it:
    # a constant too, where the view has no mask
    Simplify("fold-neg-view", "(View (Neg (Fill a d s)) v)", "(Fill (neg a) d s2)",
             ("(= 1 (unmasked v))", "(= s2 (vshape v))", FRESH), example=_view_of_fill),
    Simplify("fold-mul", "(Mul (Fill a d s) (Fill b d s))", "(Fill (* a b) d s)", ("(FloatDT d)", FRESH),
             example={**F, "a": 1.5, "b": -3.0}),
    Simplify("fold-add", "(Add (Fill a d s) (Fill b d s))", "(Fill (+ a b) d s)", ("(FloatDT d)", FRESH),
             example={**F, "a": 1.5, "b": -3.0}),
    Simplify("fold-max", "(Max (Fill a d s) (Fill b d s))", "(Fill (max a b) d s)", ("(FloatDT d)", FRESH),
             example={**F, "a": 1.5, "b": -3.0}),
    Simplify("fold-neg", "(Neg (Fill a d s))", "(Fill (neg a) d s)", ("(FloatDT d)", FRESH),
             example={**F, "a": 2.5}),
    Simplify("fold-recip", "(Recip (Fill a d s))", "(Fill (/ 1.0 a) d s)",
             ("(FloatDT d)", "(!= a 0.0)", FRESH), example={**F, "a": 4.0}),
    Simplify("mul-const-const", "(Mul (Mul x (Fill a d s)) (Fill b d s))", "(Mul x (Fill (* a b) d s))",
             ("(FloatDT d)", FRESH), example={**F, "a": 0.5, "b": 3.0}),
    Simplify("add-const-const", "(Add (Add x (Fill a d s)) (Fill b d s))", "(Add x (Fill (+ a b) d s))",
             ("(FloatDT d)", FRESH), example={**F, "a": 0.5, "b": 3.0}),
    # negation outward (a - b * c as an FMA is the targets' fma-neg)
    Simplify("mul-minus-one", "(Mul x (Fill -1.0 d s))", "(Neg x)", example=F),
    Simplify("neg-mul", "(Mul (Neg x) y)", "(Neg (Mul x y))"),
    Simplify("neg-sum", "(Sum (Neg x) r)", "(Neg (Sum x r))", example={"r": 1}),
    Simplify("exp2-add", "(Mul (Exp2 x) (Exp2 y))", "(Exp2 (Add x y))"),
    # a division by a sum is also a product with its reciprocal, the form the recognisers match
    # (softmax's e / sum(e)). Only by a sum: elsewhere the product, not correctly rounded, would be a
    # faster candidate the search keeps (floor(0.77 / 0.77) would be 0 again)
    Rule("div-as-product", "(Div x (View (Sum e r) v))", "(Mul x (Recip (View (Sum e r) v)))",
         example={**F, "e": (2, 3), "r": 1, "v": View.contiguous((2,)).reshape((2, 1)).expand((2, 3))}),
))

EXPLOSIVE = RuleSet("assoc", (
    Rule("add-comm", "(Add x y)", "(Add y x)"),
    Rule("mul-comm", "(Mul x y)", "(Mul y x)"),
    # Sums regroup only around terms known when compiling (Static): two of them join (and fold),
    # one moves outward. Run-time terms keep the order written: x - max(x) - log(sum) regrouped as
    # x - (max(x) + log(sum)) loses log(sum) in max's rounding (log_softmax of logits near 1e6)
    Rule("add-assoc", "(Add (Add x y) z)", "(Add x (Add y z))", ("(Static y)", "(Static z)"),
         example=_sum_with_weights),
    Rule("add-known-out", "(Add (Add x y) z)", "(Add (Add x z) y)", ("(Static y)",),
         example=_sum_with_weights),
    Rule("mul-assoc", "(Mul (Mul x y) z)", "(Mul x (Mul y z))"),
    # not x*z + x*z: that is x * (1 + 1), a constant made from constants
    Rule("factor", "(Add (Mul x z) (Mul y z))", "(Mul (Add x y) z)", ("(!= x y)",)),
    Rule("recip-mul", "(Recip (Mul x y))", "(Mul (Recip x) (Recip y))"),
    # the frontend's mean: sum, keepdim view, then scale; the scale may move into the reduction
    Rule("scale-sum", "(Mul (View (Sum x r) vk) (Fill a d s1))", "(View (Sum (Mul x (Fill a d sx)) r) vk)",
         ("(FloatDT d)", "(= 1 (keep vk r))", "(= sx (shp x))"),
         example={"d": DType.float32, "s1": (2, 1), "a": 0.25, "r": 1, "vk": View.contiguous((2, 1))}),
    # a reduction of a scaled tensor is the scaled reduction: one multiply per output, not per input
    Rule("sum-scale", "(Sum (Mul x (Fill a d s)) r)", "(Mul (Sum x r) (Fill a d s2))", ("(= s2 (drop s r))",),
         example={**F, "a": 0.25, "r": 1}),
    # likewise a product one of whose operands is scaled before the view that reads it: the scale
    # moves past the contraction (softmax's probabilities scaled, then multiplied by values, are
    # then a softmax contracted with values: one attention kernel, rewrites/online.py)
    Rule("product-scale-out", "(Sum (Mul (View (Mul x (Fill a d s)) v) y) r)",
         "(Mul (Sum (Mul (View x v) y) r) (Fill a d s2))", ("(= s2 (drop (shp y) r))",),
         example=lambda: _scaled_product(False)),
    Rule("product-scale-out-swapped", "(Sum (Mul y (View (Mul x (Fill a d s)) v)) r)",
         "(Mul (Sum (Mul y (View x v)) r) (Fill a d s2))", ("(= s2 (drop (shp y) r))",),
         example=lambda: _scaled_product(True)),
), explosive=True)


def fill_sums(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """bsum(v, r, n, d) = v without axis r, for each Sum over axis r of a view v that reads every
    element n times along r (stride 0). d is the dtype read: keyed by the view, so only for a view
    the graph reads one float dtype through."""
    dtypes: dict[int, set[DType]] = {}
    sums = set()
    for node in enc.graph.nodes():
        if node.op == "view" and node.srcs[0].op != "const":  # a const's view is a Fill
            dtypes.setdefault(enc.view_id(node.arg), set()).add(node.dtype)
        elif node.op == "sum" and node.srcs[0].op == "view" and node.srcs[0].srcs[0].op != "const":
            sums.add((node.srcs[0].arg, node.arg))
    out = []
    for v, r in sums:
        (dtype, *more) = dtypes[enc.view_id(v)]
        n = as_int(v.shape[r])
        if more or not dtype.is_float or v.mask is not None or n is None or n < 2:
            continue
        if as_int(v.strides[r]) != 0:  # not a broadcast along r
            continue
        rest = [k for k in range(v.ndim) if k != r]
        v2 = View.make([v.shape[k] for k in rest], [v.strides[k] for k in rest], v.offset)
        out.append(("bsum", (enc.view_id(v), r, n, enc.dtype_id(dtype)), enc.view_id(v2)))
    return out


def fill_shapes(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """The shape ids the `types` analysis reads: vshape(view), leafshape(leaf), and drop(shape, axis)
    = the shape without that axis, closed under repeated drops; unmasked(view) = 1 for a view without
    a mask; known(leaf) = 1 for a leaf that is not an input. Runs after the fillers that add views
    and leaves (fill_sums among them)."""
    out = []
    for i, a in enumerate(list(enc.attrs)):
        if isinstance(a, View):
            out.append(("vshape", (i,), enc.shape_id(a.shape)))
            if a.mask is None:
                out.append(("unmasked", (i,), 1))
        elif isinstance(a, Node) and a.kind == "leaf":
            out.append(("leafshape", (i,), enc.shape_id(a.shape)))
            if a.op != "input":
                out.append(("known", (i,), 1))
    todo = [key[1] for key in enc.ids if key[0] == "shape"]
    done: set[tuple] = set()
    while todo:
        s = todo.pop()
        if s in done:
            continue
        done.add(s)
        for r in range(len(s)):
            out.append(("drop", (enc.shape_id(s), r), enc.shape_id(s[:r] + s[r + 1:])))
            todo.append(s[:r] + s[r + 1:])
    return out
