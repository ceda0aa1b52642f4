"""Algebra: identities, constant folding, exp2 laws, factoring. Commutativity and
associativity live in their own explosive set, run under the back-off scheduler."""

from __future__ import annotations

from ..ir.dtypes import DType
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
    Rule("factor", "(Add (Mul x z) (Mul y z))", "(Mul (Add x y) z)"),
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


def fill_drop(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """drop(shape, axis) = the shape without that axis, for every fill shape of the graph."""
    out = []
    for key in list(enc.ids):
        if key[0] == "shape":
            s = key[1]
            out += [("drop", (enc.ids[key], r), enc.shape_id(s[:r] + s[r + 1:])) for r in range(len(s))]
    return out
