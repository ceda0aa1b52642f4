"""Tensor math spelled in IR primitives, with torch's broadcasting and type promotion.

Every helper takes IR nodes or Python scalars and returns a node. High-level functions
(exp, tanh, erf, softmax, matmul, ...) are compositions the rewrites rediscover later.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

from eclat.ir import graph as g
from eclat.ir.dtypes import DType
from eclat.ir.graph import LOG2E, Node
from eclat.ir.symbolic import BinOp, Expr, Num, Var, as_int, prod, sint, sym_eq

Scalar = bool | int | float
Value = Node | Scalar | Expr  # an Expr is a symbolic integer (a size used as a number)

LN2 = math.log(2)

# torch's promotion order within the IR's dtypes (float16 + bfloat16 -> float32 is handled below)
_RANK = {DType.bool: 0, DType.int32: 1, DType.int64: 2, DType.float16: 3, DType.bfloat16: 3,
         DType.float32: 4}


def _category(d: DType) -> int:
    return 0 if d is DType.bool else 2 if d.is_float else 1


def _scalar_dtype(x: Scalar | Expr) -> DType:
    return (DType.bool if isinstance(x, bool) else DType.int64 if isinstance(x, (int, Expr))
            else DType.float32)


def _widest(ds: list[DType]) -> DType:
    if DType.float16 in ds and DType.bfloat16 in ds:
        return DType.float32
    return max(ds, key=lambda d: _RANK[d])


def promote(*xs: Value) -> DType:
    """torch.result_type: dimensioned tensors beat 0-dim tensors beat Python scalars,
    unless a lower tier brings a higher category (bool < integer < float)."""
    tiers: list[list[DType]] = [[], [], []]
    for x in xs:
        if isinstance(x, Node):
            tiers[0 if x.shape else 1].append(x.dtype)
        else:
            tiers[2].append(_scalar_dtype(x))
    top = max(_category(d) for tier in tiers for d in tier)
    for k, tier in enumerate(tiers):
        best = [d for d in tier if _category(d) == top]
        if best:
            return _widest(best) if k < 2 else (DType.float32 if top == 2 else _widest(best))
    raise AssertionError("unreachable")


def broadcast_shape(*shapes: Sequence[sint]) -> tuple[sint, ...]:
    n = max((len(s) for s in shapes), default=0)
    out: list[sint] = []
    for k in range(n):
        dims = [s[len(s) - n + k] for s in shapes if len(s) - n + k >= 0]
        big = [d for d in dims if as_int(d) != 1]
        for d in big[1:]:
            if not sym_eq(d, big[0]):
                raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(big[0] if big else 1)
    return tuple(out)


def lift(x: Value, dtype: DType, shape: Sequence[sint] | None = None) -> Node:
    """x as a node of dtype, broadcast to shape if given (a Python scalar becomes a Const)."""
    if isinstance(x, Expr):
        x = sym_node(x) if as_int(x) is None else as_int(x)
    node = g.cast(x, dtype) if isinstance(x, Node) else _const(repr(x), dtype.np.type(x).item(), dtype)
    return node if shape is None else g.expand_to(node, shape)


@functools.lru_cache(maxsize=4096)
def _const(key: str, value: Scalar, dtype: DType) -> Node:
    """One shared Const node per value and dtype (keyed by repr, so -0.0 and nan are distinct)."""
    return g.const(value, dtype)


def shape_of(x: Value) -> tuple[sint, ...]:
    return x.shape if isinstance(x, Node) else ()


def elementwise(op: str, *xs: Value, dtype: DType | None = None) -> Node:
    """A binary or ternary primitive after broadcasting and promoting its operands."""
    dtype = dtype or promote(*xs)
    shape = broadcast_shape(*(shape_of(x) for x in xs))
    nodes = [lift(x, dtype, shape) for x in xs]
    return g.binary(op, *nodes)


def add(a: Value, b: Value) -> Node: return elementwise("add", a, b)
def mul(a: Value, b: Value) -> Node: return elementwise("mul", a, b)
def maximum(a: Value, b: Value) -> Node: return elementwise("max", a, b)


def neg(a: Value) -> Node:
    a = lift(a, promote(a))
    if a.dtype is DType.bool:
        raise TypeError("negation of a bool tensor")
    return g.unary("neg", a)


def sub(a: Value, b: Value) -> Node:
    dtype = promote(a, b)
    return add(lift(a, dtype), neg(lift(b, dtype)))


def minimum(a: Value, b: Value) -> Node:
    dtype = promote(a, b)
    if dtype is DType.bool:  # min of bools is "and"
        return logical_and(a, b)
    return neg(maximum(neg(lift(a, dtype)), neg(lift(b, dtype))))


def to_float(x: Value) -> Node:
    """x as a floating tensor (integers and bools promote to float32, as torch's float ops do)."""
    x = lift(x, promote(x))
    return x if x.dtype.is_float else g.cast(x, DType.float32)


def float_pair(a: Value, b: Value) -> tuple[Node, Node]:
    dtype = promote(a, b)
    dtype = dtype if dtype.is_float else DType.float32
    shape = broadcast_shape(shape_of(a), shape_of(b))
    return lift(a, dtype, shape), lift(b, dtype, shape)


def unary(op: str, x: Value) -> Node:
    return g.unary(op, to_float(x))


def recip(x: Value) -> Node: return unary("recip", x)
def sqrt(x: Value) -> Node: return unary("sqrt", x)
def rsqrt(x: Value) -> Node: return recip(sqrt(x))
def sin(x: Value) -> Node: return unary("sin", x)


def div(a: Value, b: Value) -> Node:
    """a / b correctly rounded, as torch's: a * (1 / b) is not (0.77 / 0.77 was 0.99999994, whose
    floor is 0). The e-graph also knows it as that product, for the patterns that divide by a sum."""
    if isinstance(b, (int, float)) and b and abs(math.frexp(b)[0]) == 0.5:
        return mul(to_float(a), 1.0 / b)  # by a power of two: the product is the same, exactly
    a, b = float_pair(a, b)
    return elementwise("div", a, b)


def exp(x: Value) -> Node: return unary("exp2", mul(to_float(x), LOG2E))
def log(x: Value) -> Node: return mul(unary("log2", x), LN2)
def sigmoid(x: Value) -> Node: return recip(add(exp(neg(to_float(x))), 1.0))

# Near 0 the forms through exp and log lose their relative accuracy (tanh(1e-8), log1p(1e-8) and
# expm1(1e-8) all came out 0): there, series of the exact functions, truncated where the next term
# is below float32's resolution. (Kahan's rounding tricks would not survive the e-graph's algebra:
# it folds log(exp(u)) and (1 + x) - 1.)
NEAR_ZERO = 0.5
TANH_NEAR = 0.25  # past it, 2 sigmoid(2x) - 1 is within 5e-7 relative
_TANH = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925)  # Taylor in x^2: 1e-9 at 0.25
_EXPM1 = tuple(1 / math.factorial(k + 1) for k in range(10))  # (e^x - 1) / x, 1e-11 at 0.5
_ATANH = tuple(1 / (2 * k + 1) for k in range(10))  # atanh(s) / s in s^2, |s| <= 1/3


def tanh(x: Value) -> Node:
    x = to_float(x)
    near = mul(x, polynomial(mul(x, x), _TANH))
    return where(lt(abs_(x), TANH_NEAR), near, sub(mul(sigmoid(mul(x, 2.0)), 2.0), 1.0))


def expm1(x: Value) -> Node:
    x = to_float(x)
    return where(lt(abs_(x), NEAR_ZERO), mul(x, polynomial(x, _EXPM1)), sub(exp(x), 1.0))


def log1p(x: Value) -> Node:
    """log(1 + x) = 2 atanh(x / (2 + x)), a series while |x| < NEAR_ZERO."""
    x = to_float(x)
    s = div(x, add(x, 2.0))
    near = mul(mul(s, 2.0), polynomial(mul(s, s), _ATANH))
    return where(lt(abs_(x), NEAR_ZERO), near, log(add(x, 1.0)))


def cos(x: Value) -> Node:
    # 1 - 2 sin^2(x/2): exact argument halving, so no rounding of x + pi/2 for large x
    s = sin(mul(to_float(x), 0.5))
    return sub(1.0, mul(mul(s, s), 2.0))


def polynomial(x: Node, coefs: Sequence[float]) -> Node:
    """sum(coefs[k] * x**k) by Horner's rule."""
    acc: Value = coefs[-1]
    for c in coefs[-2::-1]:
        acc = add(mul(acc, x), c)
    assert isinstance(acc, Node)
    return acc


# erf, fitted here (Chebyshev least squares against math.erf, in float64) and checked in
# float32 to < 1e-7 absolute error. |x| < 1: erf(x) = x * P(2x^2 - 1).
# 1 <= |x| < 4: erf(|x|) = 1 - exp(-x^2) * Q((2|x| - 5) / 3). |x| >= 4: erf = +-1 in float32.
_ERF_P = (0.9654687386, -0.1405360973, 0.01985249772, -0.002285419519, 0.0002175119891,
          -1.766909025e-05, 1.231640691e-06)
_ERF_Q = (0.2108063575, -0.1115214015, 0.05611095852, -0.02699778989, 0.01248403471,
          -0.005611769039, 0.002425888219, -0.0009155542474, 0.0003678646643, -0.0002455073563,
          9.640629662e-05)


def erf(x: Value) -> Node:
    x = to_float(x)
    x2 = mul(x, x)
    small = mul(x, polynomial(sub(mul(x2, 2.0), 1.0), _ERF_P))
    u = minimum(abs_(x), 4.0)
    large = sub(1.0, mul(exp(neg(mul(u, u))), polynomial(mul(sub(mul(u, 2.0), 5.0), 1 / 3), _ERF_Q)))
    signed = where(lt(x, 0.0), neg(large), large)
    return where(lt(abs_(x), 1.0), small, signed)


def erfc(x: Value) -> Node:
    """1 - erf(x) with relative accuracy in the tail: 1 - erf below 1, exp(-x^2) * Q from 1 to 4
    (erf's own fit: 2.2e-7 relative there), the asymptotic series beyond (6.4e-7 at 4, less
    further out; 0 where exp(-x^2) underflows); 2 - erfc(-x) for x < 0."""
    x = to_float(x)
    u = abs_(x)
    small = sub(1.0, erf(x))
    q = minimum(maximum(u, 1.0), 4.0)
    mid = mul(exp(neg(mul(q, q))), polynomial(mul(sub(mul(q, 2.0), 5.0), 1 / 3), _ERF_Q))
    a = maximum(u, 4.0)
    series = polynomial(recip(mul(mul(a, a), 2.0)), _ERFC_SERIES)
    far = mul(div(exp(neg(mul(a, a))), mul(a, math.sqrt(math.pi))), series)
    tail = where(lt(u, 4.0), mid, far)
    return where(lt(u, 1.0), small, where(lt(x, 0.0), sub(2.0, tail), tail))


_ERFC_SERIES = (1.0, -1.0, 3.0, -15.0, 105.0, -945.0, 10395.0, -135135.0, 2027025.0)  # (-1)^k (2k-1)!!


# erfinv: M. Giles' single-precision approximation ("Approximating the erfinv function", GPU
# Computing Gems, 2011): 1.2e-7 relative error against float64 on (-1, 1)
_ERFINV_CENTRAL = (1.50140941, 0.246640727, -0.00417768164, -0.00125372503, 0.00021858087,
                   -4.39150654e-06, -3.5233877e-06, 3.43273939e-07, 2.81022636e-08)
_ERFINV_TAIL = (2.83297682, 1.00167406, 0.00943887047, -0.0076224613, 0.00573950773, -0.00367342844,
                0.00134934322, 0.000100950558, -0.000200214257)


def erfinv(x: Value) -> Node:
    x = to_float(x)
    w = neg(log(mul(sub(1.0, x), add(x, 1.0))))
    central = polynomial(sub(w, 2.5), _ERFINV_CENTRAL)
    tail = polynomial(sub(sqrt(minimum(w, 1e30)), 3.0), _ERFINV_TAIL)
    out = mul(where(lt(w, 5.0), central, tail), x)
    return where(eq(abs_(x), 1.0), mul(x, math.inf), out)  # +-1: +-inf (|x| > 1: NaN from the log)


def _near_integer(x: Node) -> Node:
    """x minus its nearest integer, in [-0.5, 0.5]: sin(pi x) and tan(pi x) from it keep their
    accuracy for large x and near the integers."""
    return sub(x, floor(add(x, 0.5)))


_SHIFTS = 8  # lgamma and digamma: the argument raised to at least 8 by the recurrence


def _raised(x: Node, start: float, step: Callable[[Value, Node], Node]) -> tuple[Node, Node, Value]:
    """(whether x is reflected, z: x or 1 - x below 1/2, raised by ones to at least _SHIFTS, and
    the steps taken folded from start by step(folded, z before the step)): the recurrences of
    lgamma (a product) and digamma (a sum of reciprocals)."""
    reflect = lt(x, 0.5)
    z = where(reflect, sub(1.0, x), x)
    steps: Value = start
    for _ in range(_SHIFTS):
        low = lt(z, float(_SHIFTS))
        steps, z = where(low, step(steps, z), steps), where(low, add(z, 1.0), z)
    return reflect, z, steps


def lgamma(x: Value) -> Node:
    """log|Gamma(x)|: Stirling's series at z >= 8 after the recurrence Gamma(z + 1) = z Gamma(z)
    (the product of the steps divided out as one log), reflected below 1/2; +inf at the poles
    (0, -1, -2, ...) and at +-inf, as torch. Absolute error ~1e-6 near its zeros at 1 and 2."""
    x = to_float(x)
    reflect, z, steps = _raised(x, 1.0, mul)
    r = recip(z)
    r2 = mul(r, r)
    series = mul(r, polynomial(r2, (1 / 12, -1 / 360, 1 / 1260, -1 / 1680)))
    stirling = add(sub(mul(sub(z, 0.5), log(z)), z), add(series, 0.5 * math.log(2 * math.pi)))
    value = sub(stirling, log(steps))
    sine = abs_(sin(mul(_near_integer(x), math.pi)))
    reflected = sub(log(div(math.pi, sine)), value)
    pole = logical_or(eq(abs_(x), math.inf), logical_and(reflect, eq(x, floor(x))))
    return where(pole, math.inf, where(reflect, reflected, value))


def digamma(x: Value) -> Node:
    """Gamma'(x) / Gamma(x): its asymptotic series at z >= 8 after psi(z + 1) = psi(z) + 1/z,
    reflected below 1/2; -inf at 0 and NaN at the negative integers and -inf, as torch."""
    x = to_float(x)
    reflect, z, steps = _raised(x, 0.0, lambda total, z: add(total, recip(z)))
    r = recip(z)
    r2 = mul(r, r)
    series = mul(r2, polynomial(r2, (-1 / 12, 1 / 120, -1 / 252, 1 / 240)))
    value = sub(add(sub(log(z), mul(r, 0.5)), series), steps)
    t = mul(_near_integer(x), math.pi)
    reflected = sub(value, div(mul(cos(t), math.pi), sin(t)))
    pole = logical_and(reflect, eq(x, floor(x)))
    return where(eq(x, 0.0), -math.inf, where(pole, math.nan, where(reflect, reflected, value)))


# The normal CDF as a rational function: Phi(x) = 1/2 + x * P(x^2) / Q(x^2) on |x| <= 5.45, P of
# degree 6 and Q of degree 4 (Q(0) = 1), fitted here (Sanathanan-Koerner iteration with Lawson
# weights, float64, on Phi's absolute error): 2e-8 in float64. Beyond 5.45 Phi is 1 (the fit
# rounds to 1 there, with or without fma); below -5.45 it is 0 (so GELU(-inf) is NaN, as in
# torch). GELU in float32: 2.1e-7 relative error for x > 0 (torch's own is 4.8e-7) and 7.2e-7
# absolute for x < 0, where 1/2 + x*P/Q cancels as torch's 1 + erf does (its own: 2.6e-7).
# Ten multiply-adds and a division, no exp: a GELU kernel takes 0.65x the time of the
# logistic-of-a-fitted-logit form this replaces (fourteen multiplies, an exp and a division).
_PHI_P = (0.3989421725, 0.03534729779, 0.004471580964, 0.0001645831362, 3.185602964e-06,
          -2.215776718e-08, 1.138467376e-10)
_PHI_Q = (1.0, 0.2552672923, 0.02875677682, 0.001796658151, 6.04676934e-05)
_PHI_RANGE = 5.45


def normal_cdf(x: Value) -> Node:
    x = to_float(x)
    xc = minimum(maximum(x, -_PHI_RANGE), _PHI_RANGE)
    t = mul(xc, xc)
    phi = add(div(mul(xc, polynomial(t, _PHI_P)), polynomial(t, _PHI_Q)), 0.5)
    return where(lt(x, -_PHI_RANGE), 0.0, phi)


def gelu(x: Value, approximate: str = "none") -> Node:
    x = to_float(x)
    if approximate == "tanh":
        inner = mul(add(x, mul(mul(mul(x, x), x), 0.044715)), math.sqrt(2 / math.pi))
        return mul(mul(x, 0.5), add(tanh(inner), 1.0))
    if approximate != "none":
        raise ValueError(f"gelu: unknown approximation {approximate!r}")
    return mul(x, normal_cdf(x))


def abs_(x: Value) -> Node:
    x = lift(x, promote(x))
    return x if x.dtype is DType.bool else maximum(x, neg(x))


# --- comparisons and logic (only `lt` and `where` are primitive) ---------------------------

def lt(a: Value, b: Value) -> Node:
    return elementwise("lt", a, b)


def where(cond: Value, a: Value, b: Value) -> Node:
    dtype = promote(a, b)
    shape = broadcast_shape(shape_of(cond), shape_of(a), shape_of(b))
    return g.where(lift(cond, DType.bool, shape), lift(a, dtype, shape), lift(b, dtype, shape))


def logical_not(x: Value) -> Node: return where(x, False, True)
def logical_and(a: Value, b: Value) -> Node: return where(a, lift(b, DType.bool), False)
def logical_or(a: Value, b: Value) -> Node: return where(a, True, lift(b, DType.bool))
def logical_xor(a: Value, b: Value) -> Node: return where(a, logical_not(b), lift(b, DType.bool))


def isnan(x: Node) -> Node:
    """NaN is the one value neither below +inf nor above -inf."""
    return logical_not(logical_or(lt(x, math.inf), lt(-math.inf, x)))


def _ordered(raw: Node, a: Value, b: Value) -> Node:
    """raw, except False where a or b is NaN (as every comparison but != is)."""
    nans = [isnan(x) for x in (a, b) if isinstance(x, Node) and x.dtype.is_float]
    if any(isinstance(x, float) and math.isnan(x) for x in (a, b)):
        return where(raw, False, False)
    for nan in nans:
        raw = where(nan, False, raw)
    return raw


def gt(a: Value, b: Value) -> Node: return lt(b, a)
def ge(a: Value, b: Value) -> Node: return _ordered(logical_not(lt(a, b)), a, b)
def le(a: Value, b: Value) -> Node: return _ordered(logical_not(lt(b, a)), a, b)
def eq(a: Value, b: Value) -> Node: return _ordered(logical_not(logical_or(lt(a, b), lt(b, a))), a, b)
def ne(a: Value, b: Value) -> Node: return logical_not(eq(a, b))


def same(a: Value, b: Value) -> Node:
    """a == b with NaN equal to NaN: the ties when torch ranks values (argmax, sort, topk)."""
    a, b = _promoted(a, b)
    raw = logical_not(logical_or(lt(a, b), lt(b, a)))  # True where either is NaN
    if not a.dtype.is_float:
        return raw
    na, nb = isnan(a), isnan(b)
    return where(na, nb, where(nb, False, raw))


def before(a: Value, b: Value) -> Node:
    """a < b in torch's ranking order, where NaN comes after every number (+inf included)."""
    a, b = _promoted(a, b)
    if not a.dtype.is_float:
        return lt(a, b)
    return where(isnan(b), logical_not(isnan(a)), lt(a, b))


def _promoted(a: Value, b: Value) -> tuple[Node, Node]:
    dtype = promote(a, b)
    return lift(a, dtype), lift(b, dtype)


# --- rounding ------------------------------------------------------------------------------

def trunc(x: Node) -> Node:
    """x rounded toward zero through an integer: a cast is exact and opaque to the e-graph's
    algebra (x - fmod(x, 1), reassociated, gave non-integers). From 2**23 on every float32 is an
    integer, and NaN and infinities are themselves; -0.5 truncates to -0.0, as in torch."""
    if not x.dtype.is_float:
        return x
    size = abs_(x)
    small = lt(size, 2.0**23)
    whole = g.cast(g.cast(where(small, size, 0.0), DType.int32), x.dtype)
    return where(small, where(lt(x, 0.0), neg(whole), whole), x)


def floor(x: Node) -> Node:
    t = trunc(x)
    return t if not x.dtype.is_float else where(lt(x, t), sub(t, 1.0), t)


def int_div(a: Node, b: Node, mode: str) -> Node:
    """Integer a / b rounded toward zero ("trunc") or down ("floor"), exactly; 0 where b is 0
    (torch raises ZeroDivisionError, which a kernel cannot). The IR has no integer division,
    so the quotient of the exact multiple a - a % b is estimated in float32 and refined: the
    leftover m - q * b is exact in integers, and each division of it gains ~20 bits."""
    zero = eq(b, 0)
    b = where(zero, lift(1, b.dtype), b)
    r = elementwise("mod", a, b)  # C remainder: m is an exact multiple of b
    m = sub(a, r)
    inv = recip(to_float(b))
    q = _nearest_int(mul(to_float(m), inv), a.dtype)
    for _ in range(1 if a.dtype is DType.int32 else 3):  # int32 needs 31 bits, int64 63
        q = add(q, _nearest_int(mul(to_float(sub(m, mul(q, b))), inv), a.dtype))
    if mode == "floor":
        # C truncation rounds up for negative non-exact quotients
        fix = logical_and(ne(r, 0), ne(lt(r, 0), lt(b, 0)))
        q = where(fix, sub(q, 1), q)
    return where(zero, lift(0, q.dtype), q)


def _nearest_int(x: Node, dtype: DType) -> Node:
    """The integer nearest float x as dtype, through int64, where 2**63 wraps to -2**63 as
    integer arithmetic does (INT64_MIN // -1); int32 wraps in the narrowing cast."""
    x = add(x, where(lt(x, 0.0), -0.5, 0.5))
    x = where(lt(x, 2.0**63), x, -(2.0**63))
    return g.cast(g.cast(x, DType.int64), dtype)


def floor_div(a: Value, b: Value) -> Node:
    """Float a // b as torch computes it: (a - fmod(a, b)) / b, stepped down where fmod has
    the wrong sign and rounded to the integer it approximates, so 1.0 // 0.1 is 9 (fmod is
    0.09999999), not floor(10.0); a / b where b is 0. (torch also gives a zero quotient the
    sign of a / b; eclat keeps no sign of zero, its CPU code compiles with nsz.)"""
    a, b = float_pair(a, b)
    mod = g.binary("mod", a, b)
    q = div(sub(a, mod), b)
    q = where(logical_and(ne(mod, 0.0), ne(lt(b, 0.0), lt(mod, 0.0))), sub(q, 1.0), q)
    f = floor(q)
    f = where(lt(0.5, sub(q, f)), add(f, 1.0), f)
    return where(eq(b, 0.0), div(a, b), f)


def remainder(a: Value, b: Value) -> Node:
    """Python's a % b: the result takes the divisor's sign."""
    r = elementwise("mod", a, b)
    fix = logical_and(ne(r, 0), ne(lt(r, 0), lt(b, 0)))
    return where(fix, add(r, lift(b, r.dtype)), r)


# --- reductions and movement ---------------------------------------------------------------

def reduce(op: str, x: Node, axes: Sequence[int], keepdim: bool = False) -> Node:
    nd = len(x.shape)
    axes = sorted({a % nd for a in axes} if nd else set(), reverse=True)
    out = x
    for a in axes:
        out = g.reduce(op, out, a)
    if keepdim:
        shape = tuple(1 if k in axes else n for k, n in enumerate(x.shape))
        out = reshape(out, shape)
    return out


def mean(x: Node, axes: Sequence[int], keepdim: bool = False) -> Node:
    nd = len(x.shape)
    axes = list(range(nd)) if not axes else [a % nd for a in axes]
    n = prod([x.shape[a] for a in axes])
    s = reduce("sum", to_float(x), axes, keepdim)
    if as_int(n) is not None:
        return mul(s, 1.0 / n if n else math.nan)
    return div(s, g.cast(size_node(n), s.dtype))


def size_node(n: sint) -> Node:
    """A size as a 0-dim int64 tensor."""
    return sym_node(n) if isinstance(n, Expr) else g.const(int(n), DType.int64)


_SYM_OPS = {"+": lambda a, b: add(a, b), "*": lambda a, b: mul(a, b),
            "//": lambda a, b: int_div(a, b, "floor"), "%": lambda a, b: remainder(a, b)}


def sym_node(e: Expr) -> Node:
    """A symbolic integer as a 0-dim int64 tensor: a dimension is the sum of that many
    ones, and arithmetic on dimensions is integer arithmetic on those sums."""
    if isinstance(e, Num):
        return g.const(e.v, DType.int64)
    if isinstance(e, Var):
        return g.reduce("sum", g.expand_to(g.const(1, DType.int64), (e,)), 0)
    if isinstance(e, BinOp) and e.op in _SYM_OPS:
        return _SYM_OPS[e.op](sym_node(e.a), sym_node(e.b))
    raise NotImplementedError(f"symbolic value {e} as a tensor")


def reshape(x: Node, shape: Sequence[sint]) -> Node:
    shape = tuple(shape)
    if len(shape) == len(x.shape) and all(sym_eq(a, b) for a, b in zip(shape, x.shape)):
        return x
    return g.movement(x, lambda v: v.reshape(shape))


def permute(x: Node, order: Sequence[int]) -> Node:
    order = [o % len(x.shape) for o in order] if x.shape else []
    if order == sorted(order):
        return x
    return g.movement(x, lambda v: v.permute(order))


def softmax(x: Node, axis: int, log_: bool = False) -> Node:
    x = to_float(x)
    shifted = sub(x, reduce("max_reduce", x, [axis], keepdim=True))
    e = exp(shifted)
    total = reduce("sum", e, [axis], keepdim=True)
    return sub(shifted, log(total)) if log_ else mul(e, recip(total))


def matmul(a: Node, b: Node) -> Node:
    """a @ b with broadcast batch dims, as SumReduce(Mul(expand a, expand b)) over a last
    K axis: a[..., M, K] -> [..., M, N, K], b[..., K, N] -> [..., M, N, K]."""
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise ValueError("matmul helper needs matrices; vectors are unsqueezed by the caller")
    dtype = promote(a, b)
    a, b = lift(a, dtype), lift(b, dtype)
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    if not sym_eq(k, k2):
        raise ValueError(f"matmul: inner sizes differ: {list(a.shape)} @ {list(b.shape)}")
    batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
    full = (*batch, m, n, k)
    ae = g.expand_to(reshape(a, (*a.shape[:-1], 1, k)), full)
    bt = permute(b, [*range(len(b.shape) - 2), len(b.shape) - 1, len(b.shape) - 2])
    be = g.expand_to(reshape(bt, (*bt.shape[:-2], 1, n, k)), full)
    return g.reduce("sum", g.binary("mul", ae, be), len(full) - 1)
