"""Recognition: high-level forms hidden in primitives. A broadcast multiply summed over
one axis, where each operand is broadcast along a different axis, is a (batched) matmul.

Which axes play batch / M / N / K is View arithmetic, so Python plans it (`plan_matmul`)
for every Sum(Mul(View, View)) of the graph, both operand orders, and the egglog rule
reads the plan from the oracle tables mm_a / mm_b / mm_o.

Then softmax, RMS and layer norm; softmax as torch's scaled_dot_product_attention decomposes it (q
and k^T scaled before the product, a safe softmax that gives 0 on a row of -inf), and a product
normalised after it, (e @ v) / sum(e), as e's softmax contracted with v (whether the rows line up is
View arithmetic again: `plan_late`, oracles late_o / late_row). What a softmax contracted with
values becomes is online.py's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..ir import graph as g
from ..ir.dtypes import DType
from ..ir.graph import Graph, Node
from ..ir.symbolic import as_int, sym_eq
from ..ir.view import View, compose
from .algebra import FRESH
from .composites import LOG2E, center, layernorm, matmul, rmsnorm, softmax
from .lang import Rule, RuleSet
from .onehot import RULES as ONEHOT


def plan_matmul(va: View, vb: View, r: int) -> tuple[View, View, View] | None:
    """Views (a2, b2, out) with sum(mul(view(x, va), view(y, vb)), r) ==
    view(matmul(view(x, a2), view(y, b2)), out), or None when it is no matmul."""
    if va.mask is not None or vb.mask is not None:
        return None
    shape = va.shape

    def bcast(v: View, i: int) -> bool:
        return as_int(v.strides[i]) == 0 and as_int(shape[i]) != 1

    others = [i for i in range(len(shape)) if i != r]
    m_axes = [i for i in others if bcast(vb, i) and not bcast(va, i)]
    n_axes = [i for i in others if bcast(va, i) and not bcast(vb, i)]
    if bcast(va, r) or bcast(vb, r) or len(m_axes) != 1 or len(n_axes) != 1:
        return None
    m, n = m_axes[0], n_axes[0]
    batch = [i for i in others if i not in (m, n)]
    bshape = [shape[i] for i in batch]

    def operand(v: View, order: list[int], unit: int, out_shape: list) -> View | None:
        p = v.permute(order)
        return p.shrink([(0, 1) if k == unit else (0, s) for k, s in enumerate(p.shape)]).reshape(out_shape)

    nb = len(batch)
    a2 = operand(va, [*batch, m, n, r], nb + 1, [*bshape, shape[m], shape[r]])
    b2 = operand(vb, [*batch, m, r, n], nb, [*bshape, shape[r], shape[n]])
    if a2 is None or b2 is None:
        return None
    produced = [*batch, m, n]
    out = View.contiguous([*bshape, shape[m], shape[n]]).permute([produced.index(i) for i in others])
    return a2, b2, out


def fill_matmul(enc) -> list[tuple[str, tuple[int, ...], int]]:
    out = []
    terms = enc.terms
    for t in terms:
        if t[0] != "Sum" or terms[t[1]][0] != "Mul":
            continue
        _, i, j = terms[t[1]]
        if terms[i][0] != "View" or terms[j][0] != "View":
            continue
        for (va, vb) in ((terms[i][2], terms[j][2]), (terms[j][2], terms[i][2])):
            plan = plan_matmul(enc.attrs[va], enc.attrs[vb], t[2])
            if plan is not None:
                key = (va, vb, t[2])
                out += [(name, key, enc.view_id(v)) for name, v in zip(("mm_a", "mm_b", "mm_o"), plan)]
    return out


def fill_broadcasts(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """keep(v, r): v is the keepdim view of a reduction over r; spread(v, r): v broadcasts such a
    keepdim tensor back along r. Both as torch's keepdim reductions produce them."""
    out = []
    for i, v in enumerate(list(enc.attrs)):
        if not isinstance(v, View) or v.mask is not None:
            continue
        for r in range(v.ndim):
            kept = (*v.shape[:r], 1, *v.shape[r + 1:])
            if as_int(v.shape[r]) == 1 and v.is_contiguous:
                out.append(("keep", (i, r), 1))
            elif as_int(v.shape[r]) != 1 and v == View.contiguous(kept).expand(v.shape):
                out.append(("spread", (i, r), 1))
        if v.is_contiguous:
            out.append(("contig", (i,), 1))
    return out


def _composite_example(make) -> Callable[[], Graph]:
    def example() -> Graph:
        x = g.input_("x", (2, 3, 5))
        return g.decompose_composites(Graph([x], [make(x)], {}))
    return example


def _layernorm_example() -> Graph:
    x = g.input_("x", (2, 3, 5))
    return Graph([x], [rmsnorm(center(x, 2, 0.2), 2, 0.2, 1e-5)], {})


def _affine_example(scale: bool) -> Callable[[], Graph]:
    def example() -> Graph:
        x, w = g.input_("x", (2, 3, 5)), g.input_("w", (5,))
        c = lambda v: g.expand_to(g.const(v), x.shape)
        wide = g.expand_to(w, x.shape)
        y = layernorm(x, c(1.0) if scale else wide, c(0.0), 2, 0.2, 1e-5)
        return Graph([x, w], [g.binary("mul" if scale else "add", y, wide)], {})
    return example


def _example() -> Graph:
    """x [2, 3, 4] @ transpose(W [2, 5, 4]) written as expand, multiply, sum."""
    x = g.input_("x", (2, 3, 4))
    w = g.input_("w", (2, 5, 4))
    wt = g.movement(w, lambda v: v.permute([0, 2, 1]))
    return g.decompose_composites(Graph([x, w], [matmul(x, wt)], {}))


# Softmax however it is spelled: the row maximum subtracted through a keepdim view then a broadcast
# (torch.softmax's decomposition, amax(keepdim=True)), through one broadcast view of the reduced row
# (amax without keepdim, then unsqueeze), or not at all (exp(x) / sum(exp(x)): equal in exact
# arithmetic; the composite's subtraction only keeps exp from overflowing); the sum divided the same
# two ways. Each form: (lhs text with s, r and e, facts it needs, how to build it for the check).
_SOFTMAX_MAX = {
    "keep": ("(View (Neg (View (MaxReduce s r) vk1)) ve1)",
             ("(= 1 (keep vk1 r))", "(= 1 (spread ve1 r))")),
    "bcast": ("(Neg (View (MaxReduce s r) ve1))", ("(= 1 (spread ve1 r))",)),
    "none": (None, ()),
}
_SOFTMAX_SUM = {
    "keep": ("(Mul e (View (Recip (View (Sum e r) vk2)) ve2))",
             ("(= 1 (keep vk2 r))", "(= 1 (spread ve2 r))")),
    "bcast": ("(Mul e (Recip (View (Sum e r) ve2)))", ("(= 1 (spread ve2 r))",)),
}


def _broadcast(t: Node, axis: int, full: tuple, keepdim: bool) -> Node:
    """A reduction's result broadcast back along axis: through a keepdim view, or in one view."""
    kept = (*full[:axis], 1, *full[axis + 1:])
    if keepdim:
        return g.movement(g.movement(t, lambda v: v.reshape(kept)), lambda v: v.expand(full))
    return g.movement(t, lambda v: v.reshape(kept).expand(full))


def _softmax_example(max_form: str, sum_form: str, scale: float = 1.0) -> Callable[[], Graph]:
    def example() -> Graph:
        x, r = g.input_("x", (2, 3, 5)), 2
        full = tuple(x.shape)
        if max_form == "none":
            shifted = x
        elif max_form == "keep":
            kept = g.movement(g.reduce("max_reduce", x, r), lambda v: v.reshape((2, 3, 1)))
            shifted = g.binary("add", x, g.movement(g.unary("neg", kept), lambda v: v.expand(full)))
        else:
            m = _broadcast(g.reduce("max_reduce", x, r), r, full, False)
            shifted = g.binary("add", x, g.unary("neg", m))
        e = g.unary("exp2", g.binary("mul", shifted, g.expand_to(g.const(scale * LOG2E), full)))
        total = g.reduce("sum", e, r)
        if sum_form == "keep":
            kept = g.movement(total, lambda v: v.reshape((2, 3, 1)))
            inv = g.movement(g.unary("recip", kept), lambda v: v.expand(full))
        else:
            inv = g.unary("recip", _broadcast(total, r, full, False))
        return Graph([x], [g.binary("mul", e, inv)], {})
    return example


def _softmax_rules() -> list[Rule]:
    out = []
    for mname, (shift, mfacts) in _SOFTMAX_MAX.items():
        body = f"(Add s {shift})" if shift else "s"
        e = f"(= e (Exp2 (Mul {body} (Fill c d sh))))"
        for sname, (lhs, sfacts) in _SOFTMAX_SUM.items():
            name = "softmax" if (mname, sname) == ("keep", "keep") else f"softmax-{mname}-max-{sname}-sum"
            facts = (e, "(> c 1.44269)", "(< c 1.4427)", *mfacts, *sfacts)
            out.append(Rule(name, lhs, "(Softmax s r 0)", facts, example=_softmax_example(mname, sname)))
    # exp(x * a) / sum(exp(x * a)) with no maximum subtracted: the frontend's log2(e) factor folds into
    # a (algebra's mul-const-const), so the constant is not log2(e) but a * log2(e): softmax(x * a)
    for sname, (lhs, sfacts) in _SOFTMAX_SUM.items():
        facts = ("(= e (Exp2 (Mul s (Fill c d sh))))", "(FloatDT d)", f"(> (abs (- c {LOG2E})) 0.0001)",
                 FRESH, *sfacts)
        rhs = f"(Softmax (Mul s (Fill (/ c {LOG2E}) d sh)) r 0)"
        out.append(Rule(f"softmax-scaled-{sname}-sum", lhs, rhs, facts,
                        example=_softmax_example("none", sname, 0.125)))
    return out


SOFTMAX = _softmax_rules()

# --- scaled_dot_product_attention: its operand scales and its safe softmax -------------------------

# torch's decomposition scales q and k^T each by sqrt(scale) before the product: (x a) @ (y b) is
# (x @ y) * ab, one product of the scores scaled once (read through the frontend's reshape or not)
_SCALED_PRODUCT = "(Sum (Mul (View (Mul x (Fill a d s1)) va) (View (Mul y (Fill b d s2)) vb)) k)"
_PRODUCT = "(Sum (Mul (View x va) (View y vb)) k)"


def _scaled_product_example(viewed: bool) -> Callable[[], Graph]:
    def example() -> Graph:
        q, k = g.input_("q", (2, 3, 4)), g.input_("k", (2, 5, 4))
        scaled = lambda t, c: g.binary("mul", t, g.expand_to(g.const(c), t.shape))
        kt = scaled(g.movement(k, lambda w: w.permute([0, 2, 1])), 0.25)
        s = g.decompose_composites(Graph([q, k], [matmul(scaled(q, 0.5), kt)], {})).outputs[0]
        return Graph([q, k], [g.movement(s, lambda w: w.reshape((1, 2, 3, 5))) if viewed else s], {})
    return example


# (the mm plan only confines the rule to products; s3 from the types analysis: egglog 13.2 mis-joins
# this rule given both (mm_a va vb k) and (drop (vshape va) k), binding the second scale to the first's)
_SCALES_WHEN = ("(= a2 (mm_a va vb k))", "(FloatDT d)", "(= s3 (shp __e))", FRESH)
PRODUCT_SCALES = [
    Rule(name, lhs, f"(Mul {rhs} (Fill (* a b) d s3))", _SCALES_WHEN, example=_scaled_product_example(viewed))
    for name, lhs, rhs, viewed in (
        ("product-scales", f"(View {_SCALED_PRODUCT} vs)", f"(View {_PRODUCT} vs)", True),
        ("product-scales-direct", _SCALED_PRODUCT, _PRODUCT, False))
]


# torch's safe softmax: where(not any(s != -inf, r, keepdim), 0, softmax(s)), a row of -inf giving 0
# where softmax gives NaN, spelled as the frontend lowers it: every comparison with its NaN checks
# (isnan(x) = not (x < inf or -inf < x)), the -inf operand's own (a scalar, broadcast), and `any`
# as max_reduce(cast(x, int64) != 0). b, i and d: the bool, index and float dtypes; sh, sk and z:
# the scores', the kept row's and a scalar's shapes.
def _not(x: str, sh: str) -> str:
    return f"(Where {x} (Fill 0.0 b {sh}) (Fill 1.0 b {sh}))"


def _or(x: str, y: str, sh: str) -> str:
    return f"(Where {x} (Fill 1.0 b {sh}) {y})"


def _ne(x: str, y: str, sh: str, nans: tuple[str, ...]) -> str:
    """x != y as the frontend writes it: not eq, where eq = not (x < y or y < x), then False where
    x or y is NaN (nans: their isnan, for float operands)."""
    eq = _not(_or(f"(Lt {x} {y})", f"(Lt {y} {x})", sh), sh)
    for nan in nans:
        eq = f"(Where {nan} (Fill 0.0 b {sh}) {eq})"
    return _not(eq, sh)


def _isnan(x: str, sh: str) -> str:
    return _not(_or(f"(Lt {x} (Fill inf d {sh}))", f"(Lt (Fill -inf d {sh}) {x})", sh), sh)


def _safe_guard() -> str:
    """not any(s != -inf, r, keepdim), broadcast back along r."""
    nans = (_isnan("s", "sh"), f"(View {_isnan('(Fill -inf d z)', 'z')} vn)")
    unmasked = _ne("s", "(Fill -inf d sh)", "sh", nans)
    live = f"(View (MaxReduce {_ne(f'(Cast {unmasked} i)', '(Fill 0.0 i sh)', 'sh', ())} r) vk)"
    return f"(View {_not(live, 'sk')} ve)"


def _safe_softmax_example() -> Graph:
    """The guard built as the frontend builds it, on scores x + mask whose second row is -inf
    throughout (there the guard gives 0, and softmax NaN)."""
    x, full, r = g.input_("x", (2, 3, 5)), (2, 3, 5), 2
    mask = np.zeros((3, 5), np.float32)
    mask[1] = -np.inf
    s = g.binary("add", x, g.expand_to(g.weight("mask", mask, DType.float32), full))
    c = lambda v, dtype, shape: g.expand_to(g.const(v, dtype), shape)
    lt = lambda a, b: g.binary("lt", a, b)
    n = lambda t: g.where(t, c(False, DType.bool, t.shape), c(True, DType.bool, t.shape))
    o = lambda t, u: g.where(t, c(True, DType.bool, t.shape), u)
    isnan = lambda t: n(o(lt(t, c(math.inf, t.dtype, t.shape)), lt(c(-math.inf, t.dtype, t.shape), t)))

    def ne(a: Node, b: Node, nans: tuple[Node, ...]) -> Node:
        eq = n(o(lt(a, b), lt(b, a)))
        for nan in nans:
            eq = g.where(nan, c(False, DType.bool, full), eq)
        return n(eq)

    ninf = c(-math.inf, DType.float32, full)
    unmasked = ne(s, ninf, (isnan(s), g.expand_to(isnan(g.const(-math.inf)), full)))
    live = ne(g.cast(unmasked, DType.int64), c(0, DType.int64, full), ())
    kept = g.movement(g.reduce("max_reduce", live, r), lambda v: v.reshape((2, 3, 1)))
    guard = g.movement(n(kept), lambda v: v.expand(full))
    out = g.where(guard, c(0.0, DType.float32, full), softmax(s, r))
    return Graph([x], [out], {"mask": mask})


SAFE_SOFTMAX = Rule("safe-softmax", f"(Where {_safe_guard()} (Fill 0.0 d sh) (Softmax s r 0))",
                    "(Softmax s r 1)", ("(= 1 (keep vk r))", "(= 1 (spread ve r))"),
                    example=_safe_softmax_example)


# --- a product normalised after it: (e @ v) / sum(e, -1, keepdim) = (e / sum(e, -1, keepdim)) @ v -----

def plan_late(va: View, vb: View, k: int, vo: View | None, shape: tuple) -> tuple[View, View] | None:
    """(w, row) with view(sum_k(view(e, va) * view(v, vb)), vo) divided by e's row sums (over its last
    axis, broadcast along the output's last axis) == view(matmul(view(e / view(rowsum(e), row), a2),
    view(v, b2)), w), (a2, b2, o) the product's matmul plan and e of `shape`; vo None: the product
    read as it is. None unless the rows line up: a2 reads e's rows whole and in order, and the output
    reads the product's rows in order, its last axis last."""
    plan = plan_matmul(va, vb, k)
    if plan is None or not shape:
        return None
    a2, b2, o = plan
    w = o if vo is None else compose(o, vo)
    if w is None or not a2.is_contiguous or not sym_eq(a2.shape[-1], shape[-1]) or not w.is_contiguous:
        return None
    if len(w.shape) != len(shape) or not sym_eq(w.shape[-1], b2.shape[-1]):
        return None
    return w, View.contiguous((*shape[:-1], 1)).expand(shape)


def fill_late(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """late_o / late_row(va, vb, k, vo, r, shape of e) = plan_late's views, for every product of
    the graph (both operand orders), read directly (vo = -1) or through each view of it; r is e's
    last axis. (From the graph's nodes: the terms do not carry e's shape.)"""
    nodes = enc.graph.nodes()
    reads: dict[int, list[View]] = {}
    for n in nodes:
        if n.op == "view":
            reads.setdefault(id(n.srcs[0]), []).append(n.arg)
    out = []
    for n in nodes:
        if n.op != "sum" or n.srcs[0].op != "mul" or any(x.op != "view" for x in n.srcs[0].srcs):
            continue
        x, y = n.srcs[0].srcs
        for ev, vv in ((x, y), (y, x)):
            shape = tuple(ev.srcs[0].shape)
            for vo in (None, *reads.get(id(n), ())):
                plan = plan_late(ev.arg, vv.arg, n.arg, vo, shape)
                if plan is not None:
                    read = -1 if vo is None else enc.view_id(vo)
                    key = (enc.view_id(ev.arg), enc.view_id(vv.arg), n.arg, read, len(shape) - 1,
                           enc.shape_id(shape))
                    out += [(name, key, enc.view_id(v)) for name, v in zip(("late_o", "late_row"), plan)]
    return out


def _late_example(viewed: bool, keepdim: bool) -> Callable[[], Graph]:
    def example() -> Graph:
        """(e @ v) / e.sum(-1, keepdim=True): e [2, 3, 5] and the product as they are, or e [1, 2, 3, 5]
        and the product reshaped to 3-D and back, as the frontend's 4-D matmul does."""
        e, v = g.input_("e", (1, 2, 3, 5) if viewed else (2, 3, 5)), g.input_("v", (2, 5, 6))
        e3 = g.movement(e, lambda w: w.reshape((2, 3, 5)))
        num = g.decompose_composites(Graph([e, v], [matmul(e3, v)], {})).outputs[0]
        if viewed:
            num = g.movement(num, lambda w: w.reshape((1, 2, 3, 6)))
        r, full = len(e.shape) - 1, tuple(num.shape)
        total = g.reduce("sum", e, r)
        if keepdim:  # 1 / total, then broadcast (torch's e / e.sum(-1, keepdim=True) may come either way)
            kept = g.movement(total, lambda w: w.reshape((*full[:-1], 1)))
            inv = g.movement(g.unary("recip", kept), lambda w: w.expand(full))
        else:
            inv = g.unary("recip", _broadcast(total, r, full, False))
        return Graph([e, v], [g.binary("mul", num, inv)], {})
    return example


def _late_rules() -> list[Rule]:
    dens = {"bcast": ("(Recip (View (Sum e r) ve))", ("(= 1 (spread ve r))",)),
            "keep": ("(View (Recip (View (Sum e r) vk)) ve)", ("(= 1 (keep vk r))", "(= 1 (spread ve r))"))}
    prod = "(Sum (Mul (View e va) (View v vb)) k)"
    # e normalised first, in softmax's bcast-sum form
    rhs = "(View (Matmul (View (Mul e (Recip (View (Sum e r) row))) a2) (View v b2)) w)"
    out = []
    for viewed in (True, False):
        num, vo = (f"(View {prod} vo)", "vo") if viewed else (prod, "-1")
        for dname, (den, facts) in dens.items():
            key = f"va vb k {vo} r se"
            when = ("(= se (shp e))", f"(= w (late_o {key}))", f"(= row (late_row {key}))",
                    "(= a2 (mm_a va vb k))", "(= b2 (mm_b va vb k))", *facts)
            name = f"late-normalised{'' if viewed else '-direct'}-{dname}"
            out.append(Rule(name, f"(Mul {num} {den})", rhs, when,
                            example=_late_example(viewed, dname == "keep")))
    return out


LATE = _late_rules()

RULES = RuleSet("recognition", (
    Rule("matmul", "(Sum (Mul (View x va) (View y vb)) r)", "(View (Matmul (View x a2) (View y b2)) o)",
         ("(= a2 (mm_a va vb r))", "(= b2 (mm_b va vb r))", "(= o (mm_o va vb r))"), example=_example),
    *SOFTMAX,
    Rule("rmsnorm", "(Mul x (View (Recip (Sqrt (Add (Mul (View (Sum (Mul x x) r) vk) (Fill a d s1)) "
         "(Fill b d s2)))) ve))", "(RmsNorm x r a b)", ("(= 1 (keep vk r))", "(= 1 (spread ve r))"),
         example=_composite_example(lambda x: rmsnorm(x, 1, 1 / 3, 1e-5))),
    # layer norm: the RMS norm of x minus its mean (the same scale 1/n in both), then w and b. The
    # deviations are y - mean(y) for y = x - p, p a pivot of the kept shape (the frontend's: the row's
    # first element, as the composite's own decomposition has it; the same for any p)
    Rule("layernorm", "(RmsNorm (Add (Add x (View (Neg p) vp)) (View (Neg (Mul (View (Sum (Add x "
         "(View (Neg p) vp)) r) vk) (Fill a d s1))) ve)) r a e)",
         "(LayerNorm x (Fill 1.0 d sx) (Fill 0.0 d sx) r a e)",
         ("(= 1 (keep vk r))", "(= 1 (spread ve r))", "(= 1 (spread vp r))", "(= sx (vshape ve))"),
         example=_layernorm_example),
    Rule("layernorm-scale", "(Mul (LayerNorm x (Fill 1.0 d s) (Fill 0.0 d s) r a e) w)",
         "(LayerNorm x w (Fill 0.0 d s) r a e)", example=_affine_example(True)),
    Rule("layernorm-shift", "(Add (LayerNorm x w (Fill 0.0 d s) r a e) b)", "(LayerNorm x w b r a e)",
         example=_affine_example(False)),
    *PRODUCT_SCALES,
    SAFE_SOFTMAX,
    *LATE,
    *ONEHOT,
))
