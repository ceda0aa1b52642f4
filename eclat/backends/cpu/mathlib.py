"""exp2, log2 and sin as branch-free LLVM IR on float32.

libm calls would stop the loop vectoriser (LLVM scalarises llvm.exp2 into eight calls
to exp2f), so each function is emitted inline from selects and polynomials, which
vectorise like any arithmetic. Accuracy is a few ulp on the ranges models use
(relative error below 1e-6 for exp2 and log2; sin after Cody-Waite reduction).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import llvmlite.ir as ir

F32 = ir.FloatType()
I32 = ir.IntType(32)
FAST = ("contract",)


def _f(v: float) -> ir.Constant:
    return ir.Constant(F32, v)


def _i(v: int) -> ir.Constant:
    return ir.Constant(I32, v)


def _intrinsic(module: ir.Module, name: str) -> ir.Function:
    fn = module.globals.get(name)
    if fn is None:
        fn = ir.Function(module, ir.FunctionType(F32, [F32]), name)
    return fn


def _poly(b: ir.IRBuilder, x: ir.Value, coefs: list[float]) -> ir.Value:
    """Horner's rule, highest coefficient first."""
    acc = _f(coefs[0])
    for c in coefs[1:]:
        prod = b.fmul(acc, x)
        prod.flags.extend(FAST)
        acc = b.fadd(prod, _f(c))
        acc.flags.extend(FAST)
    return acc


# 2^f on |f| <= 1/2, degree 5, fitted here (Lawson-weighted least squares on the relative error,
# float64): 8e-8 relative, 2.4e-7 evaluated in float32; one term fewer than Taylor for the same error.
_ROUND = 1.5 * 2.0 ** 23
_EXP2_P = [0.0013276357203722, 0.009675503708422184, 0.05550713092088699, 0.24022120237350464,
           0.6931469440460205, 1.0]


def _exp2(b: ir.IRBuilder, x: ir.Value, module: ir.Module, overflows: bool = True) -> ir.Value:
    c = b.select(b.fcmp_ordered("<", x, _f(-127.0)), _f(-127.0), x)
    if overflows:  # (the caller knows when x cannot exceed 128: softmax's x - max(x))
        c = b.select(b.fcmp_ordered(">", c, _f(128.0)), _f(128.0), c)
    # adding 1.5 * 2^23 + 127 rounds to an integer that lands in the low mantissa bits, the
    # exponent bias already added: rint, float->int and the bias in one add, and defined for
    # NaN (fptosi of NaN would be poison). The shift keeps the low 9 bits: round(c) + 127.
    t = b.fadd(c, _f(_ROUND + 127))
    f = b.fsub(c, b.fsub(t, _f(_ROUND + 127)))
    p = _poly(b, f, _EXP2_P)
    bits = b.shl(b.bitcast(t, I32), _i(23))
    return b.fmul(p, b.bitcast(bits, F32))  # NaN passes the clamps (each select keeps x) and p


def _log2(b: ir.IRBuilder, x: ir.Value, module: ir.Module) -> ir.Value:
    tiny = b.fcmp_ordered("<", x, _f(2.0 ** -126))
    y = b.select(tiny, b.fmul(x, _f(2.0 ** 23)), x)
    bits = b.bitcast(y, I32)
    e = b.sub(b.and_(b.lshr(bits, _i(23)), _i(255)), b.select(tiny, _i(150), _i(127)))
    m = b.bitcast(b.or_(b.and_(bits, _i(0x7FFFFF)), _i(0x3F800000)), F32)
    big = b.fcmp_ordered(">", m, _f(math.sqrt(2.0)))
    m = b.select(big, b.fmul(m, _f(0.5)), m)
    e = b.add(e, b.select(big, _i(1), _i(0)))
    t = b.fdiv(b.fsub(m, _f(1.0)), b.fadd(m, _f(1.0)))
    t2 = b.fmul(t, t)
    ln = b.fmul(b.fmul(t, _f(2.0)), _poly(b, t2, [1 / 11, 1 / 9, 1 / 7, 1 / 5, 1 / 3, 1.0]))
    r = b.fadd(b.sitofp(e, F32), b.fmul(ln, _f(1 / math.log(2))))
    r = b.select(b.fcmp_ordered("==", x, _f(math.inf)), x, r)
    r = b.select(b.fcmp_ordered("==", x, _f(0.0)), _f(-math.inf), r)
    r = b.select(b.fcmp_ordered("<", x, _f(0.0)), _f(math.nan), r)
    return b.select(b.fcmp_unordered("uno", x, x), x, r)


_PI = (3.140625, 0.0009670257568359375, 6.2771141529083251953e-07, 1.2154201256553420762e-10)


def _sin(b: ir.IRBuilder, x: ir.Value, module: ir.Module) -> ir.Value:
    k = b.call(_intrinsic(module, "llvm.rint.f32"), [b.fmul(x, _f(1 / math.pi))])
    r = x
    for part in _PI:
        r = b.fsub(r, b.fmul(k, _f(part)))
    r2 = b.fmul(r, r)
    coefs = [(-1) ** j / math.factorial(2 * j + 1) for j in range(5, -1, -1)]
    s = b.fmul(r, _poly(b, r2, coefs))
    kint = b.fptosi(b.select(b.fcmp_unordered("uno", b.fsub(x, x), _f(0.0)), _f(0.0), k), I32)
    sign = b.shl(b.and_(kint, _i(1)), _i(31))
    s = b.bitcast(b.xor(b.bitcast(s, I32), sign), F32)
    bad = b.fsub(x, x)  # NaN for inf and NaN
    return b.select(b.fcmp_unordered("uno", bad, _f(0.0)), bad, s)


_EMITTERS: dict[str, Callable[[ir.IRBuilder, ir.Value, ir.Module], ir.Value]] = {
    "exp2": _exp2, "log2": _log2, "sin": _sin,
    "exp2_nonpositive": lambda b, x, module: _exp2(b, x, module, overflows=False),  # x <= 0 or NaN
}


def math_function(module: ir.Module, op: str) -> ir.Function:
    """The always-inline float32 function for op ("exp2" | "exp2_nonpositive" | "log2" | "sin")
    in module."""
    name = f"eclat_{op}f"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    fn = ir.Function(module, ir.FunctionType(F32, [F32]), name)
    fn.linkage = "internal"
    fn.attributes.add("alwaysinline")
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(_EMITTERS[op](b, fn.args[0], module))
    return fn
