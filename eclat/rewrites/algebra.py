"""Algebra: identities, constant folding, exp2 laws, factoring. Commutativity and
associativity live in their own explosive set, run under the back-off scheduler."""

from __future__ import annotations

from ..ir.dtypes import DType
from ..ir.graph import Node
from ..ir.view import View
from .lang import Rule, RuleSet

F = {"d": DType.float32, "s": (2, 3)}  # a float32 fill of the example tensors' shape

RULES = RuleSet("algebra", (
    Rule("mul-one", "(Mul x (Fill 1.0 d s))", "x", example=F),
    Rule("add-zero", "(Add x (Fill 0.0 d s))", "x", example=F),
    Rule("mul-two", "(Mul x (Fill 2.0 d s))", "(Add x x)", example=F),  # exact: no multiply needed
    Rule("neg-neg", "(Neg (Neg x))", "x"),
    Rule("recip-recip", "(Recip (Recip x))", "x"),
    Rule("log2-exp2", "(Log2 (Exp2 x))", "x"),
    Rule("exp2-add", "(Mul (Exp2 x) (Exp2 y))", "(Exp2 (Add x y))"),
    Rule("neg-mul", "(Mul (Neg x) y)", "(Neg (Mul x y))"),
    Rule("recip-mul", "(Recip (Mul x y))", "(Mul (Recip x) (Recip y))"),
    Rule("fold-mul", "(Mul (Fill a d s) (Fill b d s))", "(Fill (* a b) d s)", ("(FloatDT d)",),
         example={**F, "a": 1.5, "b": -3.0}),
    Rule("fold-add", "(Add (Fill a d s) (Fill b d s))", "(Fill (+ a b) d s)", ("(FloatDT d)",),
         example={**F, "a": 1.5, "b": -3.0}),
    Rule("fold-neg", "(Neg (Fill a d s))", "(Fill (neg a) d s)", ("(FloatDT d)",), example={**F, "a": 2.5}),
    Rule("fold-recip", "(Recip (Fill a d s))", "(Fill (/ 1.0 a) d s)", ("(FloatDT d)", "(!= a 0.0)"),
         example={**F, "a": 4.0}),
    Rule("mul-const-const", "(Mul (Mul x (Fill a d s)) (Fill b d s))", "(Mul x (Fill (* a b) d s))",
         ("(FloatDT d)",), example={**F, "a": 0.5, "b": 3.0}),
    # not x*z + x*z: with x*2 = x + x (mul-two) and a class that holds x = (x*2)*0.5, that makes x*4,
    # then x*8, ... without end
    Rule("factor", "(Add (Mul x z) (Mul y z))", "(Mul (Add x y) z)", ("(!= x y)",)),
    # negation and subtraction forms (a - b * c as an FMA is the targets' fma-neg)
    Rule("mul-minus-one", "(Mul x (Fill -1.0 d s))", "(Neg x)", example=F),
    Rule("neg-sum", "(Sum (Neg x) r)", "(Neg (Sum x r))", example={"r": 1}),
    # the frontend's mean: sum, keepdim view, then scale; the scale may move into the reduction
    Rule("scale-sum", "(Mul (View (Sum x r) vk) (Fill a d s1))", "(View (Sum (Mul x (Fill a d sx)) r) vk)",
         ("(FloatDT d)", "(= 1 (keep vk r))", "(= sx (shp x))"),
         example={"d": DType.float32, "s1": (2, 1), "a": 0.25, "r": 1, "vk": View.contiguous((2, 1))}),
    # a reduction of a scaled tensor is the scaled reduction: one multiply per output, not per input
    Rule("sum-scale", "(Sum (Mul x (Fill a d s)) r)", "(Mul (Sum x r) (Fill a d s2))", ("(= s2 (drop s r))",),
         example={**F, "a": 0.25, "r": 1}),
))

EXPLOSIVE = RuleSet("assoc", (
    Rule("add-comm", "(Add x y)", "(Add y x)"),
    Rule("mul-comm", "(Mul x y)", "(Mul y x)"),
    Rule("add-assoc", "(Add (Add x y) z)", "(Add x (Add y z))"),
    Rule("mul-assoc", "(Mul (Mul x y) z)", "(Mul x (Mul y z))"),
), explosive=True)


def fill_shapes(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """The shape ids the `types` analysis reads: vshape(view), leafshape(leaf), and drop(shape, axis)
    = the shape without that axis, closed under repeated drops. Runs after the fillers that add
    views and leaves."""
    out = []
    for i, a in enumerate(list(enc.attrs)):
        if isinstance(a, View):
            out.append(("vshape", (i,), enc.shape_id(a.shape)))
        elif isinstance(a, Node) and a.kind == "leaf":
            out.append(("leafshape", (i,), enc.shape_id(a.shape)))
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
