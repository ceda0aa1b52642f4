"""Contraction algebra: the order of a chain of (batched) matmuls, distributivity, scalars.

A product the recognition rule found is `Sum(Mul(View x va, View y vb), r)` in its class
beside `View(Matmul(View x a2, View y b2), o)`. A product read by another product is read
through a view w of the Sum; where w undoes o exactly (Python checks it: `compose`), that
read *is* the Matmul, and plain associativity of Matmul terms applies:

- `product-unview`: View(Sum-product, w) = Matmul(View x a2, View y b2) where mmid says so;
- `matmul-assoc-right/left`: (p @ q) @ c = p @ (q @ c);
- `matmul-unbatch`: a batched product of two operands both broadcast along a batch axis is
  computed once and broadcast (what the new inner product of `x[B] @ (A @ C)` is);
- `matmul-distribute-right/left`: a @ b + a @ c = a @ (b + c), and on the left;
- `matmul-scale-right/left`: (a @ b) * c = a @ (b * c) = (a * c) @ b for a scalar c.

Which order is cheap is the extraction's roofline cost (eclat.rewrites.extract). The rules
run in the back-off set: associativity grows with the length of a chain.
"""

from __future__ import annotations

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import Graph
from ..ir.symbolic import as_int
from ..ir.view import View, compose
from .composites import matmul
from .lang import Rule, RuleSet
from .recognition import plan_matmul

Plan = tuple[int, int, int, View, View, View]  # va, vb, r (ids and axis), a2, b2, o


def unbatch(u: View, v: View) -> tuple[View, View, View] | None:
    """(u2, v2, out): the product of View x u and View y v, both broadcast along the same batch
    axes, as View(Matmul(View x u2, View y v2), out) with those axes computed once."""
    nb = len(u.shape) - 2
    if nb < 1 or len(v.shape) != len(u.shape) or u.mask is not None or v.mask is not None:
        return None
    both = [i for i in range(nb) if as_int(u.shape[i]) not in (None, 1)
            and as_int(u.strides[i]) == 0 and as_int(v.strides[i]) == 0]
    if not both:
        return None
    once = lambda x: x.shrink([(0, 1) if i in both else (0, n) for i, n in enumerate(x.shape)])
    u2, v2 = once(u), once(v)
    out = View.contiguous((*u2.shape[:-1], v2.shape[-1])).expand((*u.shape[:-1], v.shape[-1]))
    return u2, v2, out


def product_plans(enc) -> dict[int, list[Plan]]:
    """The matmul plans of every product term (as recognition's fill_matmul makes them)."""
    terms, out = enc.terms, {}
    for k, t in enumerate(terms):
        if t[0] != "Sum" or terms[t[1]][0] != "Mul":
            continue
        _, i, j = terms[t[1]]
        if terms[i][0] != "View" or terms[j][0] != "View":
            continue
        for va, vb in ((terms[i][2], terms[j][2]), (terms[j][2], terms[i][2])):
            plan = plan_matmul(enc.attrs[va], enc.attrs[vb], t[2])
            if plan is not None:
                out.setdefault(k, []).append((va, vb, t[2], *plan))
    return out


def fill_contraction(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """mmid(va, vb, r, w) = 1 where the product's view w is its Matmul; ub_a/ub_b/ub_o(u, v) for
    pairs of operand views a product (or a reassociated one) may have. Runs after fill_matmul."""
    terms, plans = enc.terms, product_plans(enc)
    reads: dict[int, set[View]] = {}  # product term -> the views it is read through
    pairs: set[tuple[View, View]] = set()  # operand views of possible products
    for t in terms:
        if t[0] == "View" and t[1] in plans:
            reads.setdefault(t[1], set()).add(enc.attrs[t[2]])
        if t[0] == "Matmul" and terms[t[1]][0] == "View" and terms[t[2]][0] == "View":
            pairs.add((enc.attrs[terms[t[1]][2]], enc.attrs[terms[t[2]][2]]))
    for k, ps in plans.items():
        _, i, j = terms[terms[k][1]]
        for va, _, _, a2, b2, _ in ps:
            pairs.add((a2, b2))
            left, right = (terms[i], terms[j]) if va == terms[i][2] else (terms[j], terms[i])
            # an inner product read as this one's left operand (through a2): reassociated, its
            # right operand meets this one's right operand; likewise on the right
            for inner in plans.get(left[1], ()):
                reads.setdefault(left[1], set()).add(a2)
                pairs.add((inner[4], b2))
            for inner in plans.get(right[1], ()):
                reads.setdefault(right[1], set()).add(b2)
                pairs.add((a2, inner[3]))
    out = []
    for k, views in reads.items():
        for va, vb, r, a2, b2, o in plans[k]:
            shape = (*a2.shape[:-1], b2.shape[-1])
            for w in views:
                if tuple(w.shape) == shape and compose(o, w) == View.contiguous(shape):
                    out.append(("mmid", (va, vb, r, enc.view_id(w)), 1))
    for u, v in pairs:
        got = unbatch(u, v)
        if got is not None:
            key = (enc.view_id(u), enc.view_id(v))
            out += [(name, key, enc.view_id(x)) for name, x in zip(("ub_a", "ub_b", "ub_o"), got)]
    return out


# --- examples for the soundness check -------------------------------------------------------

def _unview_example() -> Graph:
    """B^T @ (x @ A)^T, x @ A written as sum(A' * x') (A's operand first): the transposed read of
    the product is the product A^T @ x^T, the plan of that operand order."""
    x, a, b = g.input_("x", (3, 4)), g.input_("a", (4, 5)), g.input_("b", (2, 5))
    xe = g.movement(x, lambda v: v.reshape((3, 1, 4)).expand((3, 5, 4)))
    ae = g.movement(a, lambda v: v.permute([1, 0]).reshape((1, 5, 4)).expand((3, 5, 4)))
    s = g.reduce("sum", g.binary("mul", ae, xe), 2)
    return Graph([x, a, b], [matmul(b, g.movement(s, lambda v: v.permute([1, 0])))], {})


def _bcast(shape: tuple, batch: int) -> View:
    return View.contiguous((1, *shape)).expand((batch, *shape))


_MM = {"a": (2, 3), "b": (3, 4), "c": (3, 4), "o": View.contiguous((2, 4)).permute([1, 0])}
_F = {"d": DType.float32, "s": (4, 2), "c": 0.5, "o": _MM["o"]}

RULES = RuleSet("contraction", (
    Rule("product-unview", "(View (Sum (Mul (View x va) (View y vb)) r) w)",
         "(Matmul (View x a2) (View y b2))",
         ("(= 1 (mmid va vb r w))", "(= a2 (mm_a va vb r))", "(= b2 (mm_b va vb r))"),
         example=_unview_example),
    Rule("matmul-assoc-right", "(Matmul (Matmul p q) c)", "(Matmul p (Matmul q c))",
         example={"p": (2, 3), "q": (3, 4), "c": (4, 5)}),
    Rule("matmul-assoc-left", "(Matmul p (Matmul q c))", "(Matmul (Matmul p q) c)",
         example={"p": (2, 3), "q": (3, 4), "c": (4, 5)}),
    Rule("matmul-unbatch", "(Matmul (View x u) (View y v))", "(View (Matmul (View x u2) (View y v2)) vo)",
         ("(= u2 (ub_a u v))", "(= v2 (ub_b u v))", "(= vo (ub_o u v))"),
         example={"x": (2, 3), "y": (3, 4), "u": _bcast((2, 3), 5), "v": _bcast((3, 4), 5)}),
    Rule("matmul-distribute-right", "(Add (View (Matmul a b) o) (View (Matmul a c) o))",
         "(View (Matmul a (Add b c)) o)", ("(!= b c)",), example=_MM),
    Rule("matmul-distribute-left", "(Add (View (Matmul b a) o) (View (Matmul c a) o))",
         "(View (Matmul (Add b c) a) o)", ("(!= b c)",),
         example={"a": (3, 4), "b": (2, 3), "c": (2, 3), "o": _MM["o"]}),
    Rule("matmul-scale-right", "(Mul (View (Matmul a (View y vb)) o) (Fill c d s))",
         "(View (Matmul a (Mul (View y vb) (Fill c d sb))) o)", ("(= sb (vshape vb))",),
         example={**_F, "y": (4, 3), "vb": View.contiguous((4, 3)).permute([1, 0])}),
    Rule("matmul-scale-left", "(Mul (View (Matmul (View x va) b) o) (Fill c d s))",
         "(View (Matmul (Mul (View x va) (Fill c d sa)) b) o)", ("(= sa (vshape va))",),
         example={**_F, "x": (3, 2), "va": View.contiguous((3, 2)).permute([1, 0]), "b": (3, 4)}),
), explosive=True)
