"""Affine maps moved into the products beside them, where compile-time folding absorbs them.

A BatchNorm after a convolution scales each output channel and shifts it; a LayerNorm's (or
RMSNorm's) affine part before a Linear scales and shifts each input feature. Moved into the
product's weight operand, the scale becomes weight-only (`W * s`, folded by eclat.rewrites.fold)
and the shift a weight-only product (`beta @ W`, one bias row), so no run-time kernel reads the
norm's weights or statistics:

- `product-scale-a/b`: (x (*) y summed over r, read through w) * s = a product whose operand a
  (rows, M) or b (columns, N) is multiplied by s first, where s read through vs varies only
  along the product's M (or N) axis. The frontend's convolutions and Linears are such sums; which
  axes are M and N is recognition's matmul plan (`plan_matmul`), so the oracles `scale_a/scale_b`
  (the view of s over the operand) and `mm_ow` (the product read through w, as one view) come
  from Python, for every plan, every view the sum is read through and every view of its shape.
- `product-scale-distribute`: (P + z) * s = P * s + z * s where P is such a product and s can
  move into it (a convolution's bias before the BatchNorm).
- `matmul-shift-split-a/b`: (x + view(l)) @ b = x @ b + view(l) @ b for a weight l (a norm's
  shift): the second product is weight-only where b is; `matmul-shift-bias-a` adds it to the
  bias that follows the product (read through a view, which hides the sum from add-assoc).
- `matmul-scale-k-a/b`: (x * view(l)) @ (View y vb) = x @ (y * l along K), where view(l) read as
  the operand varies only along the contraction axis K (a norm's scale); likewise on the right.
- `matmul-scale-k-copied-a/b`: the same for any scale (a squeeze-excitation's, computed) of an
  operand read from a copy of a view (a 1x1 convolution's im2col), where the other operand is the
  smaller: the weights are scaled (out x in values) where x * s was a pass over every pixel, and
  the product reads the copy's source through one view (`vcomp`); `-twice` where the scaled value
  is a copy itself (the frontend's, of a value convolutions read). Not folded: the search's cost
  and timing choose (efficientnet_b0 and mobilenet_v3_large 1.04x).
"""

from __future__ import annotations

import math

import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import Graph
from ..ir.symbolic import as_int
from ..ir.view import View, compose
from .composites import matmul
from .contraction import product_plans
from .lang import Rule, RuleSet


def _ints(xs) -> list[int] | None:
    out = [as_int(x) for x in xs]
    return None if None in out else out


def operand_scale(ow: View, vs: View, mm: list[int], axis: int, operand: View) -> View | None:
    """The view of s over operand's shape that scales the product's output axis `axis` (of the
    contiguous product shape mm) as vs scales the product read through ow; None unless s varies
    only along that axis, and ow reads all of it (so the view stays inside s)."""
    shape, strides, sstrides = _ints(ow.shape), _ints(ow.strides), _ints(vs.strides)
    if ow.mask is not None or vs.mask is not None or None in (shape, strides, sstrides) \
            or as_int(ow.offset) is None or as_int(vs.offset) is None or tuple(vs.shape) != tuple(ow.shape):
        return None
    row = [math.prod(mm[j + 1:]) for j in range(len(mm))]
    if (as_int(ow.offset) // row[axis]) % mm[axis]:
        return None
    walks: list[tuple[int, int]] = []  # (step along axis, extent) of ow's axes that walk it
    sigma = None  # s's stride per step along the axis
    for n, st, ss in zip(shape, strides, sstrides):
        if n == 1:
            continue
        j = next((j for j in range(len(mm)) if st and st % row[j] == 0 and abs(st) < row[j] * mm[j]), None)
        if j != axis:
            if ss:
                return None  # s varies along an axis that is not the product's `axis`
            continue
        step = st // row[j]
        if step <= 0 or ss % step or (sigma is not None and ss // step != sigma):
            return None
        sigma = ss // step
        walks.append((step, n))
    walks.sort(reverse=True)
    covered = 1
    for step, n in reversed(walks):  # a mixed radix from step 1 up: every index read once
        if step != covered:
            return None
        covered *= n
    if covered != mm[axis]:
        return None
    nd = len(operand.shape)
    at = nd - 2 if axis == len(mm) - 2 else nd - 1
    return View.make(operand.shape, [sigma if k == at else 0 for k in range(nd)], as_int(vs.offset))


def k_scale(vl: View, this: View, other: View, left: bool) -> View | None:
    """The view over `other`'s shape reading the weight l along the contraction axis K, where l
    read through vl then `this` (the operand it scales: a [*B, M, K] on the left, b [*B, K, N]
    on the right) varies only along K; None otherwise."""
    v = compose(vl, this)
    if v is None or v.mask is not None or _ints(v.strides) is None or as_int(v.offset) is None:
        return None
    nd = len(v.shape)
    k_this, k_other = (nd - 1, nd - 2) if left else (nd - 2, nd - 1)
    strides = _ints(v.strides)
    if any(s for i, (s, n) in enumerate(zip(strides, _ints(v.shape))) if i != k_this and n != 1):
        return None
    along_k = [strides[k_this] if i == k_other else 0 for i in range(nd)]
    return View.make(other.shape, along_k, as_int(v.offset))


def fill_affine(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """scale_a/scale_b(va, vb, r, w, vs), mm_ow(va, vb, r, w) for every product plan read through
    w and every view vs of w's shape; vcomp(vl, v), kscale_a/kscale_b(vl, va, vb) for every view
    of a weight and every operand pair of a plan. Runs after fill_matmul and fill_merge."""
    terms, attrs, plans = enc.terms, enc.attrs, product_plans(enc)
    reads: dict[int, set[int]] = {}  # product term -> views it is read through
    by_shape: dict[tuple, set[int]] = {}  # shape -> ids of the views of that shape
    leaf_views: set[int] = set()
    # operand views of every product the e-graph will hold: recognition's and the merges' plans
    plan = {(name, key): value for name, key, value in enc.oracles if name in ("mm_a", "mm_b")}
    pairs = {(a, plan["mm_b", key]) for (name, key), a in plan.items()
             if name == "mm_a" and ("mm_b", key) in plan}
    for t in terms:
        if t[0] == "Matmul" and terms[t[1]][0] == "View" and terms[t[2]][0] == "View":
            pairs.add((terms[t[1]][2], terms[t[2]][2]))
        if t[0] == "View":
            by_shape.setdefault(tuple(attrs[t[2]].shape), set()).add(t[2])
            if t[1] in plans:
                reads.setdefault(t[1], set()).add(t[2])
            if terms[t[1]][0] == "Leaf":
                leaf_views.add(t[2])
    out = []
    for k, ps in plans.items():
        for va, vb, r, a2, b2, o in ps:
            mm = _ints((*a2.shape[:-1], b2.shape[-1]))
            for w in reads.get(k, ()):
                ow = compose(o, attrs[w])
                if ow is None or mm is None:
                    continue
                out.append(("mm_ow", (va, vb, r, w), enc.view_id(ow)))
                for vs in by_shape.get(tuple(ow.shape), ()):
                    for name, axis, operand in (("scale_a", len(mm) - 2, a2), ("scale_b", len(mm) - 1, b2)):
                        got = operand_scale(ow, attrs[vs], mm, axis, operand)
                        if got is not None:
                            out.append((name, (va, vb, r, w, vs), enc.view_id(got)))
    operands = {v for pair in pairs for v in pair}
    for vl in leaf_views:
        for this in operands:  # each operand view once, however many pairs it is in
            v = compose(attrs[vl], attrs[this])
            if v is not None:
                out.append(("vcomp", (vl, this), enc.view_id(v)))
        for ida, idb in pairs:
            a2, b2 = attrs[ida], attrs[idb]
            for name, left in (("kscale_a", True), ("kscale_b", False)):
                got = k_scale(attrs[vl], a2 if left else b2, b2 if left else a2, left)
                if got is not None:
                    out.append((name, (vl, ida, idb), enc.view_id(got)))
    # a computed scale along K of a product's operand copied first (a squeeze-excitation's, before
    # the 1x1 convolution after it, whose im2col copies it): for that product's plans, and for the
    # matmuls the graph holds
    operands = []  # (operand term (a View), left, ids of the plan's a and b views)
    for k, ps in plans.items():
        _, i, j = terms[terms[k][1]]
        for va, vb, _, a2, b2, _ in ps:
            ids = (enc.view_id(a2), enc.view_id(b2))
            operands += [(i, True, ids)] if terms[i][2] == va else [(j, True, ids)]
            operands += [(j, False, ids)] if terms[j][2] == vb else [(i, False, ids)]
    operands += [(t[1 + side], side == 0, (terms[t[1]][2], terms[t[2]][2])) for t in terms if t[0] == "Matmul"
                 and terms[t[1]][0] == "View" and terms[t[2]][0] == "View" for side in (0, 1)]
    for operand, left, (ida, idb) in operands:
        copy = terms[terms[operand][1]]
        if copy[0] != "Contiguous" or terms[copy[1]][0] != "View":
            continue
        scaled = terms[copy[1]][1]
        scaled = terms[scaled][1] if terms[scaled][0] == "Contiguous" else scaled  # a copy of it
        if terms[scaled][0] != "Mul":
            continue
        vw, this, other = terms[copy[1]][2], attrs[ida if left else idb], attrs[idb if left else ida]
        direct = compose(attrs[vw], this)  # the operand read from the copy's source
        if math.prod(_ints(other.shape) or [0]) >= math.prod(_ints(this.shape) or [0]):
            continue  # the scale moves to the smaller operand only (7x7 pixels, 960 channels: stays)
        for factor in terms[scaled][1:]:
            vl = terms[factor][2] if terms[factor][0] == "View" else None
            through = None if vl is None or direct is None else compose(attrs[vl], attrs[vw])
            got = None if through is None else k_scale(through, this, other, left)
            if got is not None:
                out += [(f"kscale_copied_{'a' if left else 'b'}", (vl, vw, ida, idb), enc.view_id(got)),
                        ("vcomp", (vw, ida if left else idb), enc.view_id(direct))]
    return out


# --- examples for the soundness check -------------------------------------------------------

def _scaled_product(rows: bool, bias: bool = False) -> Graph:
    """(x @ y read as [1, 3, 5]) * s, s [3] along the rows (or [5] along the columns), written
    as the frontend writes a Linear: a sum of a broadcast product; with a bias added first."""
    x, y, z = g.input_("x", (3, 4)), g.input_("y", (4, 5)), g.input_("z", (5,))
    s = g.input_("s", (3,) if rows else (5,))
    xe = g.movement(x, lambda v: v.reshape((3, 1, 4)).expand((3, 5, 4)))
    ye = g.movement(y, lambda v: v.permute([1, 0]).reshape((1, 5, 4)).expand((3, 5, 4)))
    p = g.movement(g.reduce("sum", g.binary("mul", xe, ye), 2), lambda v: v.reshape((1, 3, 5)))
    if bias:
        p = g.binary("add", p, g.movement(z, lambda v: v.reshape((1, 1, 5)).expand((1, 3, 5))))
    along = (lambda v: v.reshape((1, 3, 1)).expand((1, 3, 5))) if rows else (
        lambda v: v.reshape((1, 1, 5)).expand((1, 3, 5)))
    return Graph([x, y, s, *[z] * bias], [g.binary("mul", p, g.movement(s, along))], {})


def _affine_into_matmul(shift: bool, left: bool, bias: bool = False, copied: bool = False,
                        twice: bool = False) -> Graph:
    """(x * l + m) @ y with l, m weights [4] along K (on the left), or y @ (x * l + m) with l, m
    [3] along K (on the right); the weights are graph weights, as a norm's affine part is. With
    bias: the product read transposed, plus an input."""
    rng = np.random.default_rng(0)
    k = 4 if left else 3
    arrays = {"l": rng.uniform(0.5, 2, k).astype(np.float32), "m": rng.uniform(0.5, 2, k).astype(np.float32)}
    lw, mw = (g.weight(n, a, DType.float32) for n, a in arrays.items())
    x = g.input_("x", (3, 4))
    if left:
        along = lambda n: g.movement(n, lambda v: v.reshape((1, 4)).expand((3, 4)))
    else:
        along = lambda n: g.movement(n, lambda v: v.reshape((3, 1)).expand((3, 4)))
    a = g.binary("mul", x, along(g.unary("exp2", lw) if copied else lw))
    if copied:  # a computed scale, read through a copy of a view (a 1x1 convolution's im2col)
        a = g.contiguous(g.view(g.contiguous(a) if twice else a, View.contiguous(a.shape)))
    elif shift:
        a = g.binary("add", a, along(mw))
    a = g.view(a, View.contiguous(a.shape))  # the matmul reads its operands through views
    if left:
        y = g.input_("y", (4, 2))
        p = matmul(a, g.view(y, View.contiguous(y.shape)))
        if bias:
            c = g.input_("c", (2, 3))
            return Graph([x, y, c], [g.binary("add", g.movement(p, lambda v: v.permute([1, 0])), c)], arrays)
        return Graph([x, y], [p], arrays)
    y = g.input_("y", (2, 3))
    return Graph([x, y], [matmul(g.view(y, View.contiguous(y.shape)), a)], arrays)


_PRODUCT = "(Sum (Mul (View x va) (View y vb)) r)"
_SCALED = "(Mul x (View l vl))"
_COPIED = (("", _SCALED, False), ("-twice", f"(Contiguous {_SCALED})", True))  # tag, scaled operand, example
_MM = ("(= a2 (mm_a va vb r))", "(= b2 (mm_b va vb r))", "(= ow (mm_ow va vb r w))")

RULES = RuleSet("affine", (
    Rule("product-scale-a", f"(Mul (View {_PRODUCT} w) (View s vs))",
         "(View (Matmul (Mul (View x a2) (View s sa)) (View y b2)) ow)",
         ("(= sa (scale_a va vb r w vs))", *_MM), example=lambda: _scaled_product(rows=True)),
    Rule("product-scale-b", f"(Mul (View {_PRODUCT} w) (View s vs))",
         "(View (Matmul (View x a2) (Mul (View y b2) (View s sb))) ow)",
         ("(= sb (scale_b va vb r w vs))", *_MM), example=lambda: _scaled_product(rows=False)),
    *(Rule(f"product-scale-distribute-{side}", f"(Mul (Add (View {_PRODUCT} w) z) (View s vs))",
           f"(Add (Mul (View {_PRODUCT} w) (View s vs)) (Mul z (View s vs)))",
           (f"(= sc (scale_{side} va vb r w vs))",),
           example=lambda rows=side == "a": _scaled_product(rows, True))
      for side in "ab"),
    Rule("matmul-shift-split-a", "(Matmul (View (Add x (View (Leaf l) vl)) va) b)",
         "(Add (Matmul (View x va) b) (Matmul (View (Leaf l) vc) b))", ("(= vc (vcomp vl va))",),
         example=lambda: _affine_into_matmul(shift=True, left=True)),
    Rule("matmul-shift-split-b", "(Matmul a (View (Add x (View (Leaf l) vl)) vb))",
         "(Add (Matmul a (View x vb)) (Matmul a (View (Leaf l) vc)))", ("(= vc (vcomp vl vb))",),
         example=lambda: _affine_into_matmul(shift=True, left=False)),
    # with the product's own bias after it: the two weight-only terms meet (and fold into one)
    Rule("matmul-shift-bias-a", "(Add (View (Matmul (View (Add x (View (Leaf l) vl)) va) b) o) c)",
         "(Add (View (Matmul (View x va) b) o) (Add (View (Matmul (View (Leaf l) vc) b) o) c))",
         ("(= vc (vcomp vl va))",), example=lambda: _affine_into_matmul(shift=True, left=True, bias=True)),
    Rule("matmul-scale-k-a", "(Matmul (View (Mul x (View (Leaf l) vl)) va) (View y vb))",
         "(Matmul (View x va) (Mul (View y vb) (View (Leaf l) vk)))", ("(= vk (kscale_a vl va vb))",),
         example=lambda: _affine_into_matmul(shift=False, left=True)),
    Rule("matmul-scale-k-b", "(Matmul (View y va) (View (Mul x (View (Leaf l) vl)) vb))",
         "(Matmul (Mul (View y va) (View (Leaf l) vk)) (View x vb))", ("(= vk (kscale_b vl va vb))",),
         example=lambda: _affine_into_matmul(shift=False, left=False)),
    # any scale along K (a computed one: a squeeze-excitation's) of an operand the product reads
    # from a copy (a 1x1 convolution's im2col): the other operand (the weights, far fewer
    # elements) is scaled instead, and the product reads the copy's source
    # (also where the scaled value is itself a copy: the frontend materialises a computed value that
    # convolutions read, so that one copy serves them all)
    *(Rule(f"matmul-scale-k-copied-a{tag}",
           f"(Matmul (View (Contiguous (View {scaled} vw)) va) (View y vb))",
           "(Matmul (View x vx) (Mul (View y vb) (View l vk)))",
           ("(= vk (kscale_copied_a vl vw va vb))", "(= vx (vcomp vw va))"),
           example=lambda twice=twice: _affine_into_matmul(False, True, copied=True, twice=twice))
      for tag, scaled, twice in _COPIED),
    *(Rule(f"matmul-scale-k-copied-b{tag}",
           f"(Matmul (View y va) (View (Contiguous (View {scaled} vw)) vb))",
           "(Matmul (Mul (View y va) (View l vk)) (View x vx))",
           ("(= vk (kscale_copied_b vl vw va vb))", "(= vx (vcomp vw vb))"),
           example=lambda twice=twice: _affine_into_matmul(False, False, copied=True, twice=twice))
      for tag, scaled, twice in _COPIED),
), explosive=True)
