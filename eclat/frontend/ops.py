"""The lowering table: core ATen op -> function building IR primitives.

Each function takes the lowering context (see lower.Ctx: the op's output shape and
dtype as torch computed them) and the op's arguments with FX nodes replaced by IR nodes
(or Python numbers / symbolic sizes), and returns a node, or a tuple for multi-output ops.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from eclat.ir import graph as g
from eclat.ir.dtypes import DType
from eclat.ir.graph import Node
from eclat.ir.symbolic import BinOp, Expr, Num, as_int, at_most, bounds, prod, sint, sym_eq, to_expr
from eclat.ir.view import View, compose

from . import prims as P
from .context import Ctx, Unavailable, ir_dtype

aten = torch.ops.aten
Value = P.Value


def _axis(d: int, nd: int) -> int:
    if not -max(nd, 1) <= d < max(nd, 1):
        raise ValueError(f"dimension {d} out of range for a {nd}-d tensor")
    return d % max(nd, 1)


def _dims(dims: int | Sequence[int] | None, nd: int) -> list[int]:
    """A dim argument as a list of axes; None or [] means all axes."""
    if dims is None or (not isinstance(dims, int) and len(dims) == 0):
        return list(range(nd))
    return [_axis(d, nd) for d in ([dims] if isinstance(dims, int) else dims)]


def _out(ctx: Ctx, x: Value) -> Node:
    """x as torch's result dtype and shape (scalars and 0-dim nodes broadcast)."""
    return P.lift(x, ctx.out_dtype, ctx.out_shape)


# --- elementwise ---------------------------------------------------------------------------

def _scaled(b: Value, alpha: Value) -> Value:
    return b if alpha == 1 else P.mul(b, alpha)


def _add(ctx: Ctx, a: Value, b: Value, alpha: Value = 1) -> Node:
    return _out(ctx, P.add(a, _scaled(b, alpha)))


def _sub(ctx: Ctx, a: Value, b: Value, alpha: Value = 1) -> Node:
    return _out(ctx, P.sub(a, _scaled(b, alpha)))


def _rsub(ctx: Ctx, a: Value, b: Value, alpha: Value = 1) -> Node:
    return _out(ctx, P.sub(b, _scaled(a, alpha)))


def _div(ctx: Ctx, a: Value, b: Value, rounding_mode: str | None = None) -> Node:
    if rounding_mode is None:
        return _out(ctx, P.div(a, b))
    dtype = ctx.out_dtype
    if dtype.is_float:
        q = P.trunc(P.div(a, b)) if rounding_mode == "trunc" else P.floor_div(a, b)
        return _out(ctx, q)
    shape = ctx.out_shape
    ctx.divisor(b)
    return P.int_div(P.lift(a, dtype, shape), P.lift(b, dtype, shape), rounding_mode)


def _fmod(ctx: Ctx, a: Value, b: Value) -> Node:
    if not ctx.out_dtype.is_float:
        ctx.divisor(b)
    return P.elementwise("mod", a, b, dtype=ctx.out_dtype)


def _remainder(ctx: Ctx, a: Value, b: Value) -> Node:
    if not ctx.out_dtype.is_float:
        ctx.divisor(b)
    return P.remainder(P.lift(a, ctx.out_dtype), P.lift(b, ctx.out_dtype))


def _float_unary(fn: Callable[[Node], Node]) -> Callable[..., Node]:
    return lambda ctx, x: _out(ctx, fn(P.to_float(x)))


def _pow_scalar_exponent(ctx: Ctx, x: Node, e: float) -> Node:
    x = P.lift(x, ctx.out_dtype)
    special = {0.5: P.sqrt, -0.5: P.rsqrt, -1: P.recip}
    if e in special and x.dtype.is_float:
        return special[e](x)
    if float(e).is_integer() and abs(e) <= 64 and (e >= 0 or x.dtype.is_float):
        out, base, n = None, x, int(abs(e))
        while n:  # square and multiply
            if n & 1:
                out = base if out is None else P.mul(out, base)
            n >>= 1
            if n:
                base = P.mul(base, base)
        out = _out(ctx, 1) if out is None else out
        return P.recip(out) if e < 0 else out
    if not x.dtype.is_float:
        raise NotImplementedError(f"integer tensor to the power {e}")
    if float(e).is_integer():  # a large whole power: |x| ** e, negated for odd e and negative x
        size = g.unary("exp2", P.mul(g.unary("log2", P.abs_(x)), float(e)))
        return P.where(P.lt(x, 0.0), P.neg(size), size) if int(e) % 2 else size
    return g.unary("exp2", P.mul(g.unary("log2", x), float(e)))


def _pow(ctx: Ctx, x: Value, e: Value) -> Node:
    if not isinstance(e, Node):
        return _pow_scalar_exponent(ctx, P.lift(x, ctx.out_dtype), e)
    if not ctx.out_dtype.is_float:
        raise NotImplementedError("integer tensor to an integer tensor power")
    return _power(_out(ctx, x), _out(ctx, e))


def _power(x: Node, e: Node) -> Node:
    """x ** e for float tensors, as C's pow: |x| ** e through exp2 and log2, negated for a negative
    base and an odd integral exponent, NaN for a finite negative base and a fractional one; x ** 0
    and 1 ** e are 1 (1 ** inf and 1 ** nan too), (-1) ** +-inf is 1."""
    size = P.abs_(x)
    magnitude = g.unary("exp2", P.mul(g.unary("log2", size), e))
    whole = P.eq(e, P.floor(e))  # +-inf count as even integers, as in C
    odd = P.logical_and(P.logical_and(whole, P.lt(P.abs_(e), 2.0**24)),
                        P.ne(P.elementwise("mod", e, 2.0), 0.0))
    negative = P.lt(x, 0.0)
    out = P.where(P.logical_and(negative, odd), P.neg(magnitude), magnitude)
    fractional = P.logical_and(P.logical_and(negative, P.logical_not(whole)), P.lt(size, math.inf))
    out = P.where(fractional, math.nan, out)
    one = P.logical_or(P.eq(e, 0.0), P.eq(x, 1.0))
    return P.where(P.logical_or(one, P.logical_and(P.eq(size, 1.0), P.eq(P.abs_(e), math.inf))), 1.0, out)


def _clamp(ctx: Ctx, x: Value, min: Value | None = None, max: Value | None = None) -> Node:
    out = _out(ctx, x)
    if min is not None:
        out = P.maximum(out, P.lift(min, ctx.out_dtype))
    if max is not None:
        out = P.minimum(out, P.lift(max, ctx.out_dtype))
    return out


def _atan(x: Node) -> Node:
    """arctan by Cephes' reduction: |x| past tan(3 pi / 8) as pi/2 - atan(1/|x|), past tan(pi / 8)
    as pi/4 + atan((|x| - 1) / (|x| + 1)), then an odd polynomial on [0, tan(pi / 8)]."""
    a = P.abs_(x)
    far, mid = P.lt(2.414213562373095, a), P.lt(0.4142135623730950, a)
    t = P.where(far, P.neg(P.recip(a)), P.where(mid, P.div(P.sub(a, 1.0), P.add(a, 1.0)), a))
    base = P.where(far, math.pi / 2, P.where(mid, math.pi / 4, 0.0))
    z = P.mul(t, t)
    poly = 8.05374449538e-2
    for c in (-1.38776856032e-1, 1.99777106478e-1, -3.33329491539e-1):  # Horner, highest power first
        poly = P.add(P.mul(z, poly), c)
    y = P.add(base, P.add(P.mul(P.mul(poly, z), t), t))
    return P.where(P.lt(x, 0.0), P.neg(y), y)


def _asinh(x: Node) -> Node:
    """sign(x) log1p(|x| + x^2 / (1 + sqrt(1 + x^2))): exact near 0; log(2|x|) where x^2 overflows."""
    a = P.abs_(x)
    near = P.log1p(P.add(a, P.div(P.mul(a, a), P.add(P.sqrt(P.add(P.mul(a, a), 1.0)), 1.0))))
    r = P.where(P.lt(a, 1e10), near, P.add(P.log(a), math.log(2.0)))
    return P.where(P.lt(x, 0.0), P.neg(r), r)


def _acosh(x: Node) -> Node:
    """log1p(t + sqrt(t (x + 1))) with t = x - 1, exact near 1; log(2x) where x^2 would overflow."""
    t = P.sub(x, 1.0)
    near = P.log1p(P.add(t, P.sqrt(P.mul(t, P.add(x, 1.0)))))
    out = P.where(P.lt(x, 1e10), near, P.add(P.log(x), math.log(2.0)))
    return P.where(P.lt(x, 1.0), math.nan, out)  # (t (x + 1) is positive again below -1)


def _asin(x: Node) -> Node:
    """arcsin x = atan(x / sqrt(1 - x^2)) (+-1: atan(+-inf), +-pi/2)."""
    return _atan(P.div(x, P.sqrt(P.sub(1.0, P.mul(x, x)))))


def _atan2(ctx: Ctx, y: Node, x: Node) -> Node:
    """The angle of (x, y): atan(y / x), moved by pi where x < 0; +-pi/2 on the y axis."""
    y, x = P.to_float(y), P.to_float(x)
    r = _atan(P.div(y, x))
    half = P.where(P.lt(y, 0.0), -math.pi / 2, P.where(P.lt(0.0, y), math.pi / 2, 0.0))
    turned = P.where(P.lt(y, 0.0), P.sub(r, math.pi), P.add(r, math.pi))
    return _out(ctx, P.where(P.eq(x, 0.0), half, P.where(P.lt(x, 0.0), turned, r)))


def _hypot(ctx: Ctx, a: Node, b: Node) -> Node:
    """sqrt(a^2 + b^2) without overflow: the larger magnitude times sqrt(1 + (smaller / larger)^2)."""
    a, b = P.abs_(P.to_float(a)), P.abs_(P.to_float(b))
    big, small = P.maximum(a, b), P.minimum(a, b)
    ratio = P.where(P.eq(big, 0.0), 0.0, P.div(small, big))
    out = P.mul(big, P.sqrt(P.add(P.mul(ratio, ratio), 1.0)))
    return _out(ctx, P.where(P.eq(big, math.inf), math.inf, out))


def _rrelu(ctx: Ctx, x: Node, noise: Node, lower: float = 0.125, upper: float = 1 / 3,
           training: bool = False, generator: Any = None) -> tuple[Node, Node]:
    """RReLU at inference: a leaky ReLU of slope (lower + upper) / 2 (training draws slopes)."""
    if training:
        raise NotImplementedError("rrelu in training mode (call model.eval() first)")
    slope = (lower + upper) / 2
    return P.where(P.lt(0.0, x), x, P.mul(x, slope)), noise


def _copysign(ctx: Ctx, x: Node, y: Node) -> Node:
    size = P.abs_(P.to_float(x))
    return _out(ctx, P.where(_signbit(ctx, P.to_float(y)), P.neg(size), size))


def _signbit(ctx: Ctx, x: Node) -> Node:
    """x < 0, and True for -0.0 (1 / -0.0 is -inf)."""
    if not x.dtype.is_float:
        return P.lt(x, 0) if x.dtype is not DType.bool else _out(ctx, False)
    return P.where(P.eq(x, 0.0), P.lt(P.recip(x), 0.0), P.lt(x, 0.0))


def _sign(ctx: Ctx, x: Node) -> Node:
    if x.dtype is DType.bool:
        return x
    return P.where(P.lt(0, x), _out(ctx, 1), P.where(P.lt(x, 0), _out(ctx, -1), _out(ctx, 0)))


def _round(ctx: Ctx, x: Node, decimals: int = 0) -> Node:
    if not x.dtype.is_float:
        return x
    if decimals:  # as torch: x scaled by 10^decimals, rounded, scaled back (by a true division)
        scale = 10.0 ** abs(decimals)
        up = decimals > 0
        scaled = _round(ctx, P.mul(x, scale) if up else P.div(x, scale))
        return P.div(scaled, scale) if up else P.mul(scaled, scale)
    # half way rounds to even; every step exact (x + 0.5 is not: 0.49999997 + 0.5 is 1)
    t = P.trunc(x)
    part = P.abs_(P.sub(x, t))
    odd = P.ne(g.binary("mod", t, P.lift(2.0, x.dtype, x.shape)), 0.0)
    away = P.logical_or(P.lt(0.5, part), P.logical_and(P.eq(part, 0.5), odd))
    return P.where(away, P.add(t, P.where(P.lt(x, 0.0), -1.0, 1.0)), t)


def _ceil(ctx: Ctx, x: Node) -> Node:
    return x if not x.dtype.is_float else P.neg(P.floor(P.neg(x)))


def _elu(ctx: Ctx, x: Node, alpha: float = 1.0, scale: float = 1.0, input_scale: float = 1.0) -> Node:
    neg_part = P.mul(P.expm1(P.mul(x, input_scale)), alpha * scale)
    return P.where(P.lt(0.0, x), P.mul(x, scale), neg_part)


def _nan_to_num(ctx: Ctx, x: Node, nan: float | None = None, posinf: float | None = None,
                neginf: float | None = None) -> Node:
    if not x.dtype.is_float:
        return x
    big = float(np.finfo(x.dtype.np).max)
    out = P.where(P.isnan(x), 0.0 if nan is None else nan, x)
    out = P.where(P.eq(x, math.inf), big if posinf is None else posinf, out)
    return P.where(P.eq(x, -math.inf), -big if neginf is None else neginf, out)


def _bool_op(fn: Callable[[Value, Value], Node]) -> Callable[..., Node]:
    def lower(ctx: Ctx, a: Value, b: Value) -> Node:
        if ctx.out_dtype is not DType.bool:
            raise NotImplementedError("bitwise operations on integers (only bool tensors)")
        return fn(a, b)
    return lower


def _bitwise_not(ctx: Ctx, x: Node) -> Node:
    if x.dtype is not DType.bool:
        raise NotImplementedError("bitwise_not on integers (only bool tensors)")
    return P.logical_not(x)


def _where(ctx: Ctx, cond: Value, a: Value, b: Value) -> Node:
    return P.where(cond, P.lift(a, ctx.out_dtype), P.lift(b, ctx.out_dtype))


def _masked_fill(ctx: Ctx, x: Node, mask: Node, value: Value) -> Node:
    return P.where(mask, P.lift(value, ctx.out_dtype), x)


def _cmp(fn: Callable[[Value, Value], Node]) -> Callable[..., Node]:
    def lower(ctx: Ctx, a: Value, b: Value) -> Node:
        dtype = P.promote(a, b)  # compare in the promoted type, as torch does
        return fn(P.lift(a, dtype), P.lift(b, dtype))
    return lower


# --- reductions -----------------------------------------------------------------------------

def _sum(ctx: Ctx, x: Node, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Node:
    return P.reduce("sum", g.cast(x, ctx.out_dtype), _dims(dim, len(x.shape)), keepdim)


def _mean(ctx: Ctx, x: Node, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> Node:
    return _out(ctx, P.mean(g.cast(x, ctx.out_dtype), _dims(dim, len(x.shape)), keepdim))


def _min_reduce(x: Node, dims: list[int], keepdim: bool) -> Node:
    if x.dtype is DType.bool:
        return P.logical_not(P.reduce("max_reduce", P.logical_not(x), dims, keepdim))
    return P.neg(P.reduce("max_reduce", P.neg(x), dims, keepdim))


def _amax(ctx: Ctx, x: Node, dim: Any = (), keepdim: bool = False) -> Node:
    return P.reduce("max_reduce", x, _dims(dim, len(x.shape)), keepdim)


def _amin(ctx: Ctx, x: Node, dim: Any = (), keepdim: bool = False) -> Node:
    return _min_reduce(x, _dims(dim, len(x.shape)), keepdim)


def _any(ctx: Ctx, x: Node, dim: Any = None, keepdim: bool = False) -> Node:
    return P.reduce("max_reduce", P.ne(x, 0), _dims(dim, len(x.shape)), keepdim)


def _all(ctx: Ctx, x: Node, dim: Any = None, keepdim: bool = False) -> Node:
    return _min_reduce(P.ne(x, 0), _dims(dim, len(x.shape)), keepdim)


def _arg_extreme(x: Node, dim: int | None, keepdim: bool, largest: bool) -> Node:
    """Index of the first maximum (or minimum) along dim, as int64."""
    if dim is None:
        flat = P.reshape(x, (prod(x.shape),))
        out = _arg_extreme(flat, 0, False, largest)
        return P.reshape(out, (1,) * len(x.shape)) if keepdim else out
    axis = _axis(dim, len(x.shape))
    best = (P.reduce("max_reduce", x, [axis], True) if largest else _min_reduce(x, [axis], True))
    n = x.shape[axis]
    idx = g.expand_to(P.reshape(g.iota(n, DType.int64), (n,) + (1,) * (len(x.shape) - axis - 1)), x.shape)
    # a row with a NaN has NaN for its max and min, and torch answers that NaN's index
    cand = P.where(P.same(x, best), idx, P.lift(P.size_node(n), DType.int64))
    return _min_reduce(cand, [axis], keepdim)


def _argmax(ctx: Ctx, x: Node, dim: int | None = None, keepdim: bool = False) -> Node:
    return _arg_extreme(x, dim, keepdim, True)


def _argmin(ctx: Ctx, x: Node, dim: int | None = None, keepdim: bool = False) -> Node:
    return _arg_extreme(x, dim, keepdim, False)


def _max_dim(ctx: Ctx, x: Node, dim: int, keepdim: bool = False) -> tuple[Node, Node]:
    return _amax(ctx, x, [dim], keepdim), _arg_extreme(x, dim, keepdim, True)


def _min_dim(ctx: Ctx, x: Node, dim: int, keepdim: bool = False) -> tuple[Node, Node]:
    return _amin(ctx, x, [dim], keepdim), _arg_extreme(x, dim, keepdim, False)


def _centred(x: Node, axes: list[int]) -> tuple[Node, Node]:
    """(x - mean, mean) over axes, kept dims, from the deviations y = x - p of each row's first
    element p: (y - mean(y), p + mean(y)). A constant row's deviations are exactly 0, as torch's
    (through sum(x) / n the mean rounded: LayerNorm of a row of 3.7s gave 7e-4, not 0), and a row
    far from 0 keeps its accuracy (x - (p + mean(y)) lost mean(y)'s low bits: var of 1e6 + randn
    was 1e-3 off)."""
    if any(bounds(to_expr(x.shape[a]))[0] < 1 for a in axes):  # a row that may be empty has no first element
        mean = P.mean(x, axes, keepdim=True)
        return P.sub(x, mean), mean
    first = [(0, 1) if k in axes else (0, n) for k, n in enumerate(x.shape)]
    pivot = g.movement(x, lambda v: v.shrink(first))
    y = P.sub(x, pivot)
    shift = P.mean(y, axes, keepdim=True)
    return P.sub(y, shift), P.add(pivot, shift)


def _var(ctx: Ctx, x: Node, dim: Any = None, *, correction: float | None = None,
         keepdim: bool = False) -> Node:
    axes = _dims(dim, len(x.shape))
    x = P.to_float(x)
    d, _ = _centred(x, axes)
    n = prod([x.shape[a] for a in axes])
    squares = P.reduce("sum", P.mul(d, d), axes, keepdim)
    less = 1 if correction is None else correction
    if as_int(n) is None:  # a run-time count: divided by at run time (0 / 0 where none is left)
        dof = P.maximum(P.sub(g.cast(P.size_node(n), squares.dtype), float(less)), 0.0)
        return P.div(squares, dof)
    dof = max(0, as_int(n) - less)
    return P.mul(squares, 1 / dof if dof else math.nan)


def _var_mean(ctx: Ctx, x: Node, dim: Any = None, *, correction: float | None = None,
              keepdim: bool = False) -> tuple[Node, Node]:
    axes = _dims(dim, len(x.shape))
    return _var(ctx, x, dim, correction=correction, keepdim=keepdim), P.mean(P.to_float(x), axes, keepdim)


def _vector_norm(ctx: Ctx, x: Node, ord: float = 2, dim: Any = None, keepdim: bool = False, *,
                 dtype: Any = None) -> Node:
    axes = _dims(dim, len(x.shape))
    a = P.abs_(g.cast(x, ctx.out_dtype))
    if ord in (math.inf, -math.inf):
        return P.reduce("max_reduce", a, axes, keepdim) if ord > 0 else _min_reduce(a, axes, keepdim)
    if ord == 0:
        return P.reduce("sum", g.cast(P.ne(a, 0.0), a.dtype), axes, keepdim)
    if ord == 1:
        return P.reduce("sum", a, axes, keepdim)
    if ord == 2:
        return P.sqrt(P.reduce("sum", P.mul(a, a), axes, keepdim))
    powered = g.unary("exp2", P.mul(g.unary("log2", a), float(ord)))
    return g.unary("exp2", P.mul(g.unary("log2", P.reduce("sum", powered, axes, keepdim)), 1 / ord))


def _prod(ctx: Ctx, x: Node, dim: int | None = None, keepdim: bool = False, *, dtype: Any = None) -> Node:
    """Product along dim by halving: multiply the two halves until one element is left."""
    x = g.cast(x, ctx.out_dtype)
    if dim is None:
        out = _prod(ctx, P.reshape(x, (prod(x.shape),)), 0)
        return P.reshape(out, (1,) * len(x.shape)) if keepdim else out
    axis = _axis(dim, len(x.shape))
    order = [k for k in range(len(x.shape)) if k != axis] + [axis]
    last = P.permute(x, order) if x.shape else P.reshape(x, (1,))
    n = as_int(last.shape[-1])
    if n is None:
        raise NotImplementedError("product over a symbolic size")
    if n == 0:
        return _out(ctx, 1)
    while n > 1:
        if n % 2:  # one more factor of 1
            last = _constant_pad(ctx, last, [0, 1], 1)
            n += 1
        half = n // 2
        last = P.mul(g.movement(last, lambda v, h=half: v.slice(-1, 0, h)),
                     g.movement(last, lambda v, h=half: v.slice(-1, h, 2 * h)))
        n = half
    out = P.reshape(last, last.shape[:-1])
    if keepdim:
        out = P.reshape(out, tuple(1 if k == axis else d for k, d in enumerate(x.shape)))
    return out


def _softmax(ctx: Ctx, x: Node, dim: int, half_to_float: bool = False) -> Node:
    return _out(ctx, P.softmax(x, _axis(dim, len(x.shape))))


def _log_softmax(ctx: Ctx, x: Node, dim: int, half_to_float: bool = False) -> Node:
    return _out(ctx, P.softmax(x, _axis(dim, len(x.shape)), log_=True))


def _scan(x: Node, dim: int, rows: Callable[[Node, Node, Node], Node], y: Node | None = None) -> Node:
    """A prefix operation along dim, as rows(xj, yi, later) over squares [..., i, j] (xj holds
    x[..., j], yi holds y[..., i] (y: x unless given), later is j > i) reducing the last axis."""
    nd = len(x.shape)
    axis = _axis(dim, nd) if nd else 0
    order = [k for k in range(nd) if k != axis] + [axis]
    lx, ly = (P.permute(t, order) if nd else P.reshape(t, (1,)) for t in (x, x if y is None else y))
    n = lx.shape[-1]
    square = (*lx.shape[:-1], n, n)
    xj = g.expand_to(P.reshape(lx, (*lx.shape[:-1], 1, n)), square)
    yi = g.expand_to(P.reshape(ly, (*ly.shape[:-1], n, 1)), square)
    i = g.expand_to(P.reshape(g.iota(n, DType.int64), (n, 1)), square)
    j = g.expand_to(g.iota(n, DType.int64), square)
    out = rows(xj, yi, P.lt(i, j))
    if not nd:
        return P.reshape(out, ())
    inverse = list(range(nd - 1))
    inverse.insert(axis, nd - 1)
    return P.permute(out, inverse)


def _cumsum(ctx: Ctx, x: Node, dim: int, *, dtype: Any = None) -> Node:
    # out[..., i] = sum_j [j <= i] x[..., j]
    zero = P.lift(0, ctx.out_dtype)
    return _scan(g.cast(x, ctx.out_dtype), dim,
                 lambda xj, _, later: g.reduce("sum", P.where(later, zero, xj), len(xj.shape) - 1))


def _running_extreme(largest: bool) -> Callable[..., tuple[Node, Node]]:
    def lower(ctx: Ctx, x: Node, dim: int) -> tuple[Node, Node]:
        """cummax or cummin: the extreme of x[..., :i + 1] and the last index holding it, NaN the
        extreme wherever it is (torch's running comparison moves to a tie and to a NaN)."""
        if not x.shape:
            return x, P.lift(0, DType.int64, ())

        def extreme(xj: Node, xi: Node, later: Node) -> Node:
            kept = P.where(later, xi, xj)  # x[i] stands in for what lies past i: it is among them
            axis = len(xj.shape) - 1
            return P.reduce("max_reduce", kept, [axis]) if largest else _min_reduce(kept, [axis], False)

        def last_holder(xj: Node, best: Node, later: Node) -> Node:
            j = g.expand_to(g.iota(xj.shape[-1], DType.int64), xj.shape)
            hit = P.logical_and(P.logical_not(later), P.same(xj, best))
            return P.reduce("max_reduce", P.where(hit, j, P.lift(-1, DType.int64)), [len(xj.shape) - 1])

        index = _scan(x, dim, last_holder, _scan(x, dim, extreme))
        return _gather_dim(ctx, x, dim, index), index  # x's own element: -0.0 where it holds the tie
    return lower


def _logcumsumexp(ctx: Ctx, x: Node, dim: int) -> Node:
    """log of the running sum of exp(x), each prefix shifted by its own maximum; a prefix whose
    maximum is infinite is that infinity (torch's), a NaN stays NaN."""
    x = g.cast(x, ctx.out_dtype)
    if not x.shape:
        return x
    top = _running_extreme(True)(ctx, x, dim)[0]

    def shifted_sum(xj: Node, mi: Node, later: Node) -> Node:
        terms = P.where(later, P.lift(0.0, x.dtype), P.exp(P.sub(xj, mi)))
        return g.reduce("sum", terms, len(xj.shape) - 1)

    out = P.add(top, P.log(_scan(x, dim, shifted_sum, top)))
    infinite = P.logical_not(P.logical_or(P.isnan(top), P.lt(P.abs_(top), math.inf)))
    return P.where(infinite, top, out)


def _cumprod(ctx: Ctx, x: Node, dim: int, *, dtype: Any = None) -> Node:
    """Running product by doubling: step k multiplies each element by the one 2^k before it
    (1 before the start), each step a kernel of its own (inlined, a step would recompute all
    the steps before it twice)."""
    x = g.cast(x, ctx.out_dtype)
    if not x.shape:
        return x
    axis = _axis(dim, len(x.shape))
    n = as_int(x.shape[axis])
    if n is None:
        raise NotImplementedError("cumprod over a symbolic size")
    out, step = x, 1
    while step < n:
        before = g.movement(out, lambda v, s=step: v.slice(axis, 0, n - s))
        pads = [0, 0] * (len(x.shape) - 1 - axis) + [step, 0]
        out = g.contiguous(P.mul(out, _constant_pad(ctx, before, pads, 1)))
        step *= 2
    return out


def _histc(ctx: Ctx, x: Node, bins: int = 100, min: float = 0, max: float = 0) -> Node:  # noqa: A002
    """torch.histc: counts of x's elements in `bins` equal bins over [min, max] (the data's own
    range when both are 0; widened by 1 each way when that range is one value), the last bin
    closed; elements outside it and NaN are not counted. One compare per element and bin."""
    flat = P.to_float(P.reshape(x, (prod(x.shape),)))
    if min == max == 0:
        lo, hi = _min_reduce(flat, [0], False), P.reduce("max_reduce", flat, [0])
        same = P.eq(lo, hi)
        lo, hi = P.where(same, P.sub(lo, 1.0), lo), P.where(same, P.add(hi, 1.0), hi)
    else:
        lo, hi = (P.lift(float(v), flat.dtype, ()) for v in (min, max))
    inside = P.logical_and(P.ge(flat, lo), P.le(flat, hi))
    at = P.floor(P.mul(P.sub(flat, lo), P.div(float(bins), P.sub(hi, lo))))
    at = P.where(P.lt(at, float(bins)), at, float(bins - 1))  # x == max: the last bin
    n = flat.shape[0]
    square = (bins, n)
    edge = g.expand_to(P.reshape(g.cast(g.iota(bins, DType.int64), flat.dtype), (bins, 1)), square)
    hit = P.logical_and(g.expand_to(P.reshape(inside, (1, n)), square),
                        P.eq(g.expand_to(P.reshape(at, (1, n)), square), edge))
    return g.cast(g.reduce("sum", P.where(hit, P.lift(1.0, flat.dtype), 0.0), 1), ctx.out_dtype)


def _ranked(x: Node, dim: int, count: sint | None, descending: bool) -> tuple[Node, Node]:
    """The first `count` (all when None) elements of x along dim in sorted order, and their
    indices: each element's rank is how many others come before it (ties keep index order),
    and output k picks the element of rank k. NaN ranks above +inf and ties with NaN, as in torch."""
    nd = len(x.shape)
    axis = _axis(dim, nd)
    order = [k for k in range(nd) if k != axis] + [axis]
    last = P.permute(x, order) if nd else P.reshape(x, (1,))
    n = last.shape[-1]
    lead = last.shape[:-1]
    square = (*lead, n, n)  # [..., i, j]
    xi = g.expand_to(P.reshape(last, (*lead, n, 1)), square)
    xj = g.expand_to(P.reshape(last, (*lead, 1, n)), square)
    i = g.expand_to(P.reshape(g.iota(n, DType.int64), (n, 1)), square)
    j = g.expand_to(g.iota(n, DType.int64), square)
    ahead = P.before(xi, xj) if descending else P.before(xj, xi)
    before = P.logical_or(ahead, P.logical_and(P.same(xj, xi), P.lt(j, i)))
    rank = g.reduce("sum", g.cast(before, DType.int64), len(square) - 1)  # [..., i]
    k = n if count is None else count
    pick = (*lead, k, n)  # [..., k, i]
    hit = P.eq(g.expand_to(P.reshape(g.iota(k, DType.int64), (k, 1)), pick),
               g.expand_to(P.reshape(rank, (*lead, 1, n)), pick))
    src = g.expand_to(P.reshape(last, (*lead, 1, n)), pick)
    values = g.reduce("sum", P.where(hit, src, P.lift(0, x.dtype)), len(pick) - 1)
    index = g.expand_to(g.iota(n, DType.int64), pick)
    indices = g.reduce("sum", P.where(hit, index, P.lift(0, DType.int64)), len(pick) - 1)
    if not nd:
        return P.reshape(values, ()), P.reshape(indices, ())
    back = _inverse(order)
    return P.permute(values, back), P.permute(indices, back)


def _sort(ctx: Ctx, x: Node, dim: int = -1, descending: bool = False) -> tuple[Node, Node]:
    return _ranked(x, dim, None, descending)


def _sort_stable(ctx: Ctx, x: Node, *, stable: bool | None = None, dim: int = -1,
                 descending: bool = False) -> tuple[Node, Node]:
    return _ranked(x, dim, None, descending)


def _topk(ctx: Ctx, x: Node, k: sint, dim: int = -1, largest: bool = True, sorted: bool = True
          ) -> tuple[Node, Node]:
    return _ranked(x, dim, k, largest)


def _kth_smallest(x: Node, dim: int, k: sint, keepdim: bool) -> tuple[Node, Node]:
    """The k-th smallest (from 1) of x along dim and its index, NaN ranking last (as torch.sort)."""
    axis = _axis(dim, len(x.shape))
    values, indices = _ranked(x, axis, k, False)
    pick = lambda t: g.movement(t, lambda v: v.slice(axis, k - 1, k))  # noqa: E731
    values, indices = pick(values), pick(indices)
    if not keepdim:
        dropped = [n for a, n in enumerate(values.shape) if a != axis]
        values, indices = P.reshape(values, dropped), P.reshape(indices, dropped)
    return values, indices


def _kthvalue(ctx: Ctx, x: Node, k: int, dim: int = -1, keepdim: bool = False) -> tuple[Node, Node]:
    return _kth_smallest(x, dim, k, keepdim)


def _median_dim(ctx: Ctx, x: Node, dim: int = 0, keepdim: bool = False) -> tuple[Node, Node]:
    """The lower median along dim and its index; a row holding NaN has median NaN at its first
    NaN's index, as in torch."""
    axis = _axis(dim, len(x.shape))
    n = x.shape[axis]
    values, indices = _kth_smallest(x, axis, (n - 1) // 2 + 1, keepdim)
    if not x.dtype.is_float:
        return values, indices
    nan = P.isnan(x)
    where = g.expand_to(P.reshape(g.iota(n, DType.int64), (n,) + (1,) * (len(x.shape) - axis - 1)), x.shape)
    first = _min_reduce(P.where(nan, where, P.lift(P.size_node(n), DType.int64)), [axis], keepdim)
    found = P.lt(first, P.lift(P.size_node(n), DType.int64))
    return P.where(found, P.lift(math.nan, x.dtype), values), P.where(found, first, indices)


def _nanmedian_dim(ctx: Ctx, x: Node, dim: int = 0, keepdim: bool = False) -> tuple[Node, Node]:
    """The lower median of each row's numbers, NaN left out, and its index: the element of rank
    (count - 1) // 2 in the row sorted with NaN last; a row of NaN only gives NaN at index 0."""
    if not x.dtype.is_float:
        return _median_dim(ctx, x, dim, keepdim)
    axis = _axis(dim, len(x.shape))
    n = x.shape[axis]
    values, indices = _ranked(x, axis, None, False)
    count = P.reduce("sum", g.cast(P.logical_not(P.isnan(x)), DType.float32), [axis], keepdim=True)
    target = g.cast(P.floor(P.mul(P.maximum(P.sub(count, 1.0), 0.0), 0.5)), DType.int64)  # exact below 2^24
    rank = g.expand_to(P.reshape(g.iota(n, DType.int64), (n,) + (1,) * (len(x.shape) - axis - 1)), x.shape)
    hit = P.eq(rank, g.expand_to(target, x.shape))
    pick = lambda t: P.reduce("sum", P.where(hit, t, P.lift(0, t.dtype)), [axis], keepdim)  # noqa: E731
    return pick(values), pick(indices)


def _median(ctx: Ctx, x: Node) -> Node:
    values, _ = _median_dim(ctx, P.reshape(x, (prod(x.shape),)), 0)
    return values


def _diagonal(ctx: Ctx, x: Node, offset: int = 0, dim1: int = 0, dim2: int = 1) -> Node:
    """torch.diagonal: a view stepping both axes at once, the diagonal last."""
    nd = len(x.shape)
    a, b = _axis(dim1, nd), _axis(dim2, nd)
    strides = View.contiguous(x.shape).strides
    rest = [k for k in range(nd) if k not in (a, b)]
    first = max(-offset, 0) * strides[a] + max(offset, 0) * strides[b]
    outer = View.make([*(x.shape[k] for k in rest), ctx.out_shape[-1]],
                      [*(strides[k] for k in rest), strides[a] + strides[b]], first)
    return g.movement(x, lambda v: outer if v.is_contiguous else compose(v, outer))


def _cdist(ctx: Ctx, x1: Node, x2: Node, p: float, compute_mode: int | None = None) -> Node:
    """torch.cdist: the p-norm distance of every row of x1 [.., P, M] to every row of x2 [.., R, M],
    from the differences themselves (torch's matrix-product form for p = 2 on large inputs rounds
    |a|^2 + |b|^2 - 2ab, which gives equal rows a distance above 0)."""
    *lead, rows, m = x1.shape
    cols = x2.shape[-2]
    full = (*lead, rows, cols, m)
    d = P.abs_(P.sub(g.expand_to(P.reshape(x1, (*lead, rows, 1, m)), full),
                     g.expand_to(P.reshape(x2, (*lead, 1, cols, m)), full)))
    axis = len(full) - 1
    if p == 0:
        return g.reduce("sum", g.cast(P.ne(d, 0.0), d.dtype), axis)
    if math.isinf(p):
        return g.reduce("max_reduce", d, axis)
    if p == 1:
        return g.reduce("sum", d, axis)
    if p == 2:
        return P.sqrt(g.reduce("sum", P.mul(d, d), axis))
    power = lambda t, e: _pow_scalar_exponent(ctx, t, e)  # noqa: E731  (d >= 0: exp2 of log2 is defined)
    return power(g.reduce("sum", power(d, p), axis), 1 / p)


def _counted_below(values: Node, boundaries: Node, right: bool, out_int32: bool) -> Node:
    """For each value, how many boundaries lie below it (at or below when right): its bucket,
    as torch.bucketize and torch.searchsorted count. boundaries is 1-D, or rows matching
    values' leading dims. NaN counts as above every boundary."""
    n = boundaries.shape[-1]
    full = (*values.shape, n)
    rows = boundaries if len(boundaries.shape) == 1 else P.reshape(boundaries, (*boundaries.shape[:-1], 1, n))
    b = g.expand_to(rows, full)
    v = g.expand_to(P.reshape(values, (*values.shape, 1)), full)
    below = P.le(b, v) if right else P.lt(b, v)
    dtype = DType.int32 if out_int32 else DType.int64
    count = g.reduce("sum", g.cast(below, dtype), len(full) - 1)
    if values.dtype.is_float:
        count = P.where(P.isnan(values), P.lift(P.size_node(n), dtype), count)
    return count


def _bucketize(ctx: Ctx, x: Node, boundaries: Node, *, out_int32: bool = False, right: bool = False) -> Node:
    if len(boundaries.shape) != 1:
        raise ValueError(f"bucketize needs 1-D boundaries, got shape {list(boundaries.shape)}")
    return _counted_below(x, boundaries, right, out_int32)


def _searchsorted(ctx: Ctx, sorted_sequence: Node, x: Node, *, out_int32: bool = False, right: bool = False,
                  side: str | None = None, sorter: Node | None = None) -> Node:
    if sorter is not None:
        raise NotImplementedError("searchsorted with a sorter")
    return _counted_below(x, sorted_sequence, right or side == "right", out_int32)


def _triangle_indices(upper: bool) -> Callable[..., Node]:
    def lower(ctx: Ctx, row: int, col: int, offset: int = 0, **_: Any) -> Node:
        rows, cols = (np.triu_indices if upper else np.tril_indices)(row, offset, col)
        return ctx.constant(np.stack([rows, cols]).astype(np.int64))
    return lower


# --- linear algebra ---------------------------------------------------------------------------

def _product(a: Node, b: Node) -> Node:
    """a @ b of one dtype, as torch requires (export's fake tensors let Long @ Float through)."""
    if a.dtype is not b.dtype:
        raise ValueError(f"mat1 and mat2 must have the same dtype, but got {a.dtype.name} and {b.dtype.name}")
    return P.matmul(a, b)


def _mm(ctx: Ctx, a: Node, b: Node) -> Node:
    return _product(a, b)


def _addmm(ctx: Ctx, bias: Value, a: Node, b: Node, *, beta: Value = 1, alpha: Value = 1) -> Node:
    prod_ = _scaled(_product(a, b), alpha)
    return _out(ctx, P.add(_scaled(bias, beta) if beta != 0 else 0, prod_))


def _convolution(ctx: Ctx, x: Node, w: Node, bias: Node | None, stride: Sequence[int],
                 padding: Sequence[int], dilation: Sequence[int], transposed: bool,
                 output_padding: Sequence[int], groups: int) -> Node:
    """Convolution as im2col + one GEMM per group: the strided window view of the (padded)
    input is materialised once as patches [G, Cg*K.., N*O..], and each group's filters
    [Og, Cg*K..] meet them in a single sum over the merged Cg*K.. axis (the Sum(Mul) form the
    e-graph recognises as a matmul; batch and spatial share one axis so it has one M and one N).
    Positions innermost: the copy reads rows of the input and the GEMM reads unit-stride columns."""
    if transposed:
        return _conv_transpose(ctx, x, w, bias, stride, padding, dilation, output_padding, groups)
    return _conv(x, w, bias, stride, padding, dilation, groups, ctx.out_shape[2:])


def _conv(x: Node, w: Node, bias: Node | None, stride: Sequence[int], padding: Sequence[int],
          dilation: Sequence[int], groups: int, outs: Sequence[sint]) -> Node:
    x, w, padding = _live_taps(x, w, stride, padding, dilation, outs)
    runs = _tap_runs(x, w, stride, padding, dilation, outs)
    if runs is not None:
        return _conv_by_regions(x, w, bias, stride, padding, dilation, groups, runs)
    nd = len(x.shape) - 2
    n = x.shape[0]
    o, cg, *ks = w.shape
    og = as_int(o) // groups
    if as_int(cg) == 1 and og == 1:
        return _depthwise(x, w, bias, ks, stride, padding, dilation, outs)
    red = prod([cg, *ks])
    rows = prod([n, *outs])
    # windows [N, C, O.., K..] -> patches [G, Cg, K.., N, O..] -> [G, Cg*K.., N*O..]
    win = _windows(x, ks, stride, padding, dilation, outs, 0.0)
    win = P.permute(P.reshape(win, (n, groups, cg, *outs, *ks)),
                    [1, 2, *range(3 + nd, 3 + 2 * nd), 0, *range(3, 3 + nd)])
    patches = P.permute(P.reshape(g.contiguous(win), (groups, red, rows)), [0, 2, 1])
    shape = (groups, og, rows, red)
    pe = g.expand_to(P.reshape(patches, (groups, 1, rows, red)), shape)
    we = g.expand_to(P.reshape(w, (groups, og, 1, red)), shape)
    out = g.reduce("sum", g.binary("mul", we, pe), 3)  # [G, Og, N*O..]
    out = P.permute(P.reshape(out, (groups, og, n, *outs)), [2, 0, 1, *range(3, 3 + nd)])
    out = P.reshape(out, (n, o, *outs))
    if bias is not None:
        out = P.add(out, P.reshape(bias, (o,) + (1,) * nd))
    return out


def _live_taps(x: Node, w: Node, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
               outs: Sequence[sint]) -> tuple[Node, Node, list[int]]:
    """(x, w, padding) without the filter taps that read only the zero padding at every output
    position: a dilated convolution whose dilation passes the input's size (DeepLab's atrous
    pyramid at 36 over 16x16 positions is a 1x1 convolution there). The taps kept are a run on each
    axis; where the run starts past the padding, x is cropped to where it reads."""
    pads = list(padding)
    for axis, (size, o, s, d) in enumerate(zip(x.shape[2:], outs, stride, dilation)):
        k, n, o = w.shape[2 + axis], as_int(size), as_int(o)
        if n is None or o is None:
            continue
        live = [t for t in range(k) if any(0 <= j * s + t * d - pads[axis] < n for j in range(o))]
        if not live or live == list(range(k)):
            continue
        first, last, at = live[0], live[-1], 2 + axis
        w = g.movement(w, lambda v, at=at, first=first, last=last: v.slice(at, first, last + 1))
        pads[axis] -= first * d
        if pads[axis] < 0:  # the first tap kept starts inside x: read from there
            x = g.movement(x, lambda v, at=at, skip=-pads[axis], n=n: v.slice(at, skip, n))
            pads[axis] = 0
    return x, w, pads


# a convolution whose windows read mostly padding (a dilated one over a small map: DeepLab's atrous
# rate 12 over 16x16 positions multiplies zeros in 3/4 of its products) runs as one convolution per
# region of outputs that read the same taps, each without padding, when that does at most this share
# of the work, in at most this many regions
REGION_WORK = 0.5
REGION_MAX = 9


def _tap_runs(x: Node, w: Node, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
              outs: Sequence[sint]) -> list[list[tuple[int, int, int, int]]] | None:
    """Per spatial axis, (first output, last output, first tap, last tap) of each run of outputs
    whose windows read the input at the same taps; None unless regions pay (REGION_WORK, REGION_MAX)."""
    runs, work = [], 1.0
    for axis, (size, o, s, d, p) in enumerate(zip(x.shape[2:], outs, stride, dilation, padding)):
        k, n, o = as_int(w.shape[2 + axis]), as_int(size), as_int(o)
        if n is None or o is None:
            return None
        axis_runs: list[tuple[int, int, int, int]] = []
        for j in range(o):
            live = [t for t in range(k) if 0 <= j * s + t * d - p < n]
            if not live:
                return None  # an output of bias alone on this axis
            if axis_runs and axis_runs[-1][2:] == (live[0], live[-1]):
                axis_runs[-1] = (axis_runs[-1][0], j, live[0], live[-1])
            else:
                axis_runs.append((j, j, live[0], live[-1]))
        runs.append(axis_runs)
        work *= sum((b - a + 1) * (t1 - t0 + 1) for a, b, t0, t1 in axis_runs) / (o * k)
    if work > REGION_WORK or math.prod(map(len, runs)) > REGION_MAX:
        return None
    return runs


def _conv_by_regions(x: Node, w: Node, bias: Node | None, stride: Sequence[int], padding: Sequence[int],
                     dilation: Sequence[int], groups: int, runs: list[list[tuple[int, int, int, int]]]
                     ) -> Node:
    """The convolution as one per region of outputs (a run on each axis), each reading the input it
    covers at the taps it covers, with no padding; the regions concatenated axis by axis."""
    def region(axis: int, x: Node, w: Node, outs: tuple[int, ...]) -> Node:
        if axis == len(runs):
            return _conv(x, w, bias, stride, [0] * len(runs), dilation, groups, outs)
        parts = []
        for a, b, t0, t1 in runs[axis]:
            s, d, p, at = stride[axis], dilation[axis], padding[axis], 2 + axis
            lo, hi = a * s + t0 * d - p, b * s + t1 * d - p + 1
            xs = g.movement(x, lambda v, at=at, lo=lo, hi=hi: v.slice(at, lo, hi))
            ws = g.movement(w, lambda v, at=at, t0=t0, t1=t1: v.slice(at, t0, t1 + 1))
            parts.append(region(axis + 1, xs, ws, (*outs, b - a + 1)))
        return _concatenated(parts, 2 + axis)

    return region(0, x, w, ())


def _depthwise(x: Node, w: Node, bias: Node | None, ks: Sequence[int], stride: Sequence[int],
               padding: Sequence[int], dilation: Sequence[int], outs: Sequence[sint]) -> Node:
    """A depthwise convolution (one filter per channel) read straight from its windows, the filter
    broadcast over batch and positions: an im2col would copy every input element once per tap
    for GEMMs of one row. At stride 1 the windows are laid on the padded rows' full width, so
    that the positions of a channel are one flat axis (rows of 7 pixels do not fill a vector):
    each output row computes its padding columns too (dropped by a view), and the input gets
    spare padded rows below that the last of them reads."""
    nd = len(ks)
    o = w.shape[0]
    spatial = [as_int(d) for d in x.shape[2:]]
    static = nd == 2 and None not in spatial and all(as_int(d) is not None for d in outs)
    if static and any(s > 1 for s in stride) and all(d == 1 for d in dilation):
        return _depthwise_phases(x, w, bias, ks, stride, padding, [as_int(d) for d in outs])
    flat = static and all(s == 1 for s in stride)
    if not flat:
        win = _windows(x, ks, stride, padding, dilation, outs, 0.0)
    else:
        width = spatial[-1] + 2 * padding[-1]
        over = dilation[-1] * (ks[-1] - 1)  # elements the last window reads past its plane
        pads = [(p, p) for p in padding[:-2]] + [(padding[-2], padding[-2] + -(-over // width)),
                                                 (padding[-1], padding[-1])]
        xp = _padded_contiguous(x, pads, 0.0)
        cs = View.contiguous(xp.shape).strides
        rows = math.prod(as_int(d) for d in outs[:-1])
        win = g.view(xp, View.make((x.shape[0], o, rows * width, *ks),
                                   (*cs[:2], 1, *(d * st for d, st in zip(dilation, cs[2:])))))
    taps = g.expand_to(P.reshape(w, (1, o, *[1] * (len(win.shape) - 2 - nd), *ks)), win.shape)
    out = g.binary("mul", taps, win)
    for _ in range(nd):
        out = g.reduce("sum", out, len(out.shape) - 1)
    if bias is not None:
        out = P.add(out, P.reshape(bias, (o,) + (1,) * (len(out.shape) - 2)))
    return _full_width_rows(out, (x.shape[0], o, *outs), width) if flat else out


def _full_width_rows(out: Node, shape: Sequence[sint], width: int) -> Node:
    """out [N, C, rows * width], computed on rows of the padded width, as `shape` (its last axis
    the first columns of each row): a kernel of its own, since a reader of the slice inlining it
    would run rows short again."""
    out = P.reshape(g.contiguous(out), (*shape[:-1], width))
    return g.movement(out, lambda v: v.slice(len(v.shape) - 1, 0, shape[-1]))


def _depthwise_phases(x: Node, w: Node, bias: Node | None, ks: Sequence[int], stride: Sequence[int],
                      padding: Sequence[int], outs: Sequence[int]) -> Node:
    """A strided 2-d depthwise convolution as a sum of stride-1 ones over the input's phase planes:
    one copy splits x into its stride x stride planes (rows p, p+s, ..; columns q, q+s, ..), each
    padded with zeros as far as its taps read, and the filter's taps that fall on plane (p, q) read
    it at consecutive offsets. Every tap then reads unit-stride runs where strided windows read
    every s-th element; the windows are laid on the planes' full width as the stride-1 form lays
    them (positions one flat axis, the columns past the output's computed and dropped)."""
    (n, o), (sh, sw) = x.shape[:2], stride
    if x.op not in ("input", "weight", "contiguous"):  # computed once, not inlined into each plane
        x = g.contiguous(x)
    front = [-(-pad // s) for pad, s in zip(padding, stride)]  # rows of padding a plane starts with
    # per axis, per phase with taps: (phase, plane offset of its first tap, that tap, number of taps)
    taps = [[(p, (t0 - pad - p) // s + f, t0, len(range(t0, k, s)))
             for p in range(s) for t0 in [(p + pad) % s] if t0 < k]
            for k, s, pad, f in zip(ks, stride, padding, front)]
    reach = [max(at + t - 1 for _, at, _, t in axis) for axis in taps]  # the farthest tap's offset
    sizes = [as_int(d) for d in x.shape[2:]]
    lengths = (max(front[0] + -(-sizes[0] // sh), outs[0] + reach[0] + 1),  # + a row read past
               max(front[1] + -(-sizes[1] // sw), outs[1] + reach[1]))
    width = lengths[1]
    planes = None  # [N, C, sh, sw, rows, width]: the planes as a concatenation, one copy
    for p, q in itertools.product(range(sh), range(sw)):
        plane = g.movement(x, lambda v, p=p, q=q: v.slice(2, p, sizes[0], sh).slice(3, q, sizes[1], sw))
        plane = _padded(plane, [(f, m - f - d) for f, m, d in zip(front, lengths, plane.shape[2:])], 0.0)
        at = [(0, 0), (0, 0), (p, sh - 1 - p), (q, sw - 1 - q), (0, 0), (0, 0)]  # its place among them
        plane = g.movement(P.reshape(plane, (n, o, 1, 1, *lengths)), lambda v, at=at: v.pad(at))
        planes = plane if planes is None else P.add(planes, plane)  # zeros outside each part
    planes = g.contiguous(planes)
    cs = View.contiguous(planes.shape).strides
    out = None
    for (p, ra, ta, a), (q, rb, tb, b) in itertools.product(*taps):
        win = g.view(planes, View.make((n, o, outs[0] * width, a, b), (cs[0], cs[1], 1, width, 1),
                                       offset=p * cs[2] + q * cs[3] + ra * width + rb))
        filt = g.movement(w, lambda v, ta=ta, tb=tb, a=a, b=b: v.slice(2, ta, ta + sh * (a - 1) + 1, sh)
                          .slice(3, tb, tb + sw * (b - 1) + 1, sw))
        part = g.binary("mul", g.expand_to(P.reshape(filt, (1, o, 1, a, b)), win.shape), win)
        part = g.reduce("sum", g.reduce("sum", part, 4), 3)
        out = part if out is None else P.add(out, part)
    if bias is not None:
        out = P.add(out, P.reshape(bias, (o, 1)))
    return _full_width_rows(out, (n, o, *outs), width)


def _conv_transpose(ctx: Ctx, x: Node, w: Node, bias: Node | None, stride: Sequence[int],
                    padding: Sequence[int], dilation: Sequence[int], output_padding: Sequence[int],
                    groups: int) -> Node:
    """A transposed convolution is a stride-1 convolution of the input spread out by the
    stride (zeros between elements) and padded by d*(k-1)-p, with each group's weights
    transposed (in <-> out channels) and flipped in space."""
    nd = len(x.shape) - 2
    cin, cout_g, *ks = w.shape
    cin_g = as_int(cin) // groups
    for k, s in enumerate(stride):
        if s > 1:
            x = _place_every(x, 2 + k, s)
    pads: list[int] = []
    for k, d, p, op in reversed(list(zip(ks, dilation, padding, output_padding))):
        pads += [d * (k - 1) - p, d * (k - 1) - p + op]  # constant_pad_nd order: last axis first
    x = _constant_pad(ctx, x, pads)
    wt = P.permute(P.reshape(w, (groups, cin_g, cout_g, *ks)), [0, 2, 1, *range(3, 3 + nd)])
    wt = g.movement(wt, lambda v: v.flip(list(range(3, 3 + nd))))
    wt = P.reshape(wt, (groups * cout_g, cin_g, *ks))
    return _convolution(ctx, x, wt, bias, [1] * nd, [0] * nd, dilation, False, [0] * nd, groups)


def _fold_sizes(size: Sequence[sint], kernel: Sequence[int], dilation: Sequence[int],
                padding: Sequence[int], stride: Sequence[int]) -> list[int]:
    """The number of blocks along each axis of F.unfold / F.fold over an input of `size`."""
    out = []
    for n, k, d, p, s in zip(size, kernel, dilation, padding, stride):
        if as_int(n) is None:
            raise NotImplementedError("fold/unfold over a symbolic size")
        out.append((as_int(n) + 2 * p - d * (k - 1) - 1) // s + 1)
    return out


def _im2col(ctx: Ctx, x: Node, kernel_size: Sequence[int], dilation: Sequence[int], padding: Sequence[int],
            stride: Sequence[int]) -> Node:
    """F.unfold: [N, C*kh*kw, L], the windows of the padded input copied as columns."""
    lead = x.shape[:-3]
    blocks = _fold_sizes(x.shape[-2:], kernel_size, dilation, padding, stride)
    win = _windows(x, kernel_size, stride, padding, dilation, blocks, 0.0)  # [.., C, LH, LW, kh, kw]
    c = len(lead)
    cols = g.contiguous(P.permute(win, [*range(c), c, c + 3, c + 4, c + 1, c + 2]))
    return P.reshape(cols, ctx.out_shape)


def _col2im(ctx: Ctx, x: Node, output_size: Sequence[int], kernel_size: Sequence[int],
            dilation: Sequence[int], padding: Sequence[int], stride: Sequence[int]) -> Node:
    """F.fold (the inverse of an im2col, summing overlaps): for each filter tap, its blocks placed on
    the padded output where they were read from (a view: strided, zeros between), the taps'
    placements added, the padding cropped. No scatter: each output sums kh*kw placed reads."""
    (kh, kw), (dh, dw), (ph, pw), (sh, sw) = kernel_size, dilation, padding, stride
    lead, (h, w) = x.shape[:-2], (as_int(output_size[0]), as_int(output_size[1]))
    lh, lw = _fold_sizes((h, w), kernel_size, dilation, padding, stride)
    c = as_int(x.shape[-2]) // (kh * kw)
    taps = P.reshape(x, (*lead, c, kh, kw, lh, lw))
    at = len(lead)
    out = None
    for i, j in itertools.product(range(kh), range(kw)):
        tap = g.movement(taps, lambda v, i=i, j=j: v.slice(at + 1, i, i + 1).slice(at + 2, j, j + 1))
        tap = P.reshape(tap, (*lead, c, lh, lw))
        placed = _place(_place(tap, at + 1, i * dh, sh, h + 2 * ph), at + 2, j * dw, sw, w + 2 * pw)
        out = placed if out is None else P.add(out, placed)
    return g.movement(out, lambda v: v.slice(at + 1, ph, ph + h).slice(at + 2, pw, pw + w))


def _place_every(x: Node, axis: int, step: int) -> Node:
    """x with step - 1 zeros between neighbours along axis: length (n - 1) * step + 1."""
    n = as_int(x.shape[axis])
    if n is None:
        raise NotImplementedError("strided transposed convolution over a symbolic size")
    return _place(x, axis, 0, step, (n - 1) * step + 1)


def _padded_contiguous(x: Node, pads: Sequence[tuple[int, int]], fill: float) -> Node:
    """x with pads on its trailing axes filled with `fill`, as a fresh (non-view) node,
    so that strided window views can be laid directly on it. A computed x is a copy too: the
    convolutions that read it share it, computed once in its producer's kernel (each reader's
    copy of its windows computed it again: regnet's stem, its BatchNorm and ReLU twice)."""
    if any(b or a for b, a in pads):
        return g.contiguous(_padded(x, pads, fill))
    return x if x.op in ("input", "weight", "contiguous") else g.contiguous(x)


def _padded(x: Node, pads: Sequence[tuple[int, int]], fill: float) -> Node:
    """x with pads on its trailing axes filled with `fill` (a view where the fill is zero)."""
    full = [(0, 0)] * (len(x.shape) - len(pads)) + list(pads)
    padded = g.movement(x, lambda v: v.pad(full))
    if fill != 0:
        ones = g.expand_to(g.const(True, DType.bool), x.shape)
        inside = g.movement(ones, lambda v: v.pad(full))
        padded = P.where(inside, padded, P.lift(fill, x.dtype))
    return padded


def _windows(x: Node, kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
             dilation: Sequence[int], outs: Sequence[sint], fill: float, ceil_mode: bool = False) -> Node:
    """[*lead, O_1..O_nd, K_1..K_nd] sliding windows over the trailing nd axes of x."""
    nd = len(kernel)
    spatial = x.shape[-nd:]
    after: list[sint] = []
    for n, k, s, p, d, o in zip(spatial, kernel, stride, padding, dilation, outs):
        if as_int(n) is None or as_int(o) is None:
            if ceil_mode:
                raise NotImplementedError("ceil_mode pooling over symbolic spatial sizes")
            after.append(p)  # without ceil_mode the windows never read past the padding
            continue
        need = (as_int(o) - 1) * s + d * (k - 1) + 1  # padded length the windows read
        after.append(max(0, need - as_int(n) - p))
    xp = _padded_contiguous(x, list(zip(padding, after)), fill)
    cs = View.contiguous(xp.shape).strides
    lead = len(x.shape) - nd
    shape = (*x.shape[:lead], *outs, *kernel)
    strides = (*cs[:lead], *(s * st for s, st in zip(stride, cs[lead:])),
               *(d * st for d, st in zip(dilation, cs[lead:])))
    return g.view(xp, View.make(shape, strides))


def _pool_args(kernel, stride, padding, dilation=1) -> tuple[list[int], ...]:
    nd = len(kernel)
    as_list = lambda v, default: ([v] * nd if isinstance(v, int) else list(v) or default)
    return (list(kernel), as_list(stride, list(kernel)), as_list(padding, [0] * nd),
            as_list(dilation, [1] * nd))


def _max_pool(ctx: Ctx, x: Node, kernel, stride=(), padding=0, dilation=1, ceil_mode=False
              ) -> tuple[Node, Unavailable]:
    k, s, p, d = _pool_args(kernel, stride, padding, dilation)
    outs = ctx.out_shape[-len(k):]
    # separable: the maxima down columns kept, then maxima of those along rows; a k x k window reads
    # k + k values, not k * k. Each pass is a maximum of k shifted views (-inf masked at the edges),
    # no padded copy of its input; columns first, since their taps read whole rows with unit stride
    # and leave the strided taps half the rows (shufflenet_v2's stem pool, 24 x 112 x 112, alone on
    # znver3: 155 -> 67 us; shufflenet_v2 1.057x, resnet18 1.010x)
    sizes = [as_int(n) for n in [*x.shape[-2:], *outs]]
    if len(k) == 2 and min(k) > 1 and None not in sizes:
        if x.op not in ("input", "weight", "contiguous"):  # computed once (a convolution's epilogue)
            x = g.contiguous(x)
        down = g.contiguous(_shifted_max(x, -2, k[0], s[0], p[0], d[0], sizes[2]))
        out = _shifted_max(down, -1, k[1], s[1], p[1], d[1], sizes[3])
    else:
        win = _windows(x, k, s, p, d, outs, -math.inf, ceil_mode)
        out = P.reduce("max_reduce", win, list(range(-len(k), 0)))
    return out, Unavailable("max-pooling indices")


def _shifted_max(x: Node, axis: int, k: int, s: int, p: int, d: int, outs: int) -> Node:
    """out[.., o, ..] = the maximum over taps t < k of x[.., s * o - p + d * t, ..] along axis, taps
    outside x skipped: each tap a strided view of x, -inf where it falls outside (a mask at the
    edges, not a padded copy)."""
    n, out = as_int(x.shape[axis]), None
    for t in range(k):
        first = d * t - p  # the position the first output's tap reads
        lo = max(0, -(first // s))  # outputs before the first inside x (ceil of -first / s)
        hi = min(outs, (n - 1 - first) // s + 1)  # outputs up to the last inside x
        if hi <= lo:
            continue
        start = first + s * lo
        tap = g.movement(x, lambda v, a=start, b=start + s * (hi - lo - 1) + 1: v.slice(axis, a, b, s))
        tap = _padded(tap, [(lo, outs - hi)] + [(0, 0)] * (-1 - axis), -math.inf)
        out = tap if out is None else P.maximum(out, tap)
    return out


def _avg_pool(ctx: Ctx, x: Node, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None) -> Node:
    k, s, p, _ = _pool_args(kernel, stride, padding)
    outs = ctx.out_shape[-len(k):]
    total = P.reduce("sum", _windows(x, k, s, p, [1] * len(k), outs, 0.0, ceil_mode), list(range(-len(k), 0)))
    if divisor_override:
        return P.mul(total, 1.0 / divisor_override)
    if not ceil_mode and (count_include_pad or not any(p)):  # every window counts all k elements
        return P.mul(total, 1.0 / math.prod(k))
    sizes = [as_int(n) for n in x.shape[-len(k):]]
    if None in sizes:
        raise NotImplementedError("average pooling over symbolic spatial sizes")
    # how many elements each window averages: padding counts, the ceil_mode overhang never does
    counts = np.ones(())
    for n, kk, ss, pp, o in zip(sizes, k, s, p, outs):
        start = np.arange(as_int(o)) * ss - pp
        lo, hi = (-pp, n + pp) if count_include_pad else (0, n)
        counts = np.multiply.outer(counts, np.minimum(start + kk, hi) - np.maximum(start, lo))
    if np.all(counts == counts.flat[0]):
        return P.mul(total, 1.0 / float(counts.flat[0]))
    return P.mul(total, ctx.constant((1.0 / counts).astype(np.float32)))


def _adaptive_axis(ctx: Ctx, x: Node, axis: int, o: int, reduce_op: str) -> Node:
    """Adaptive pooling along one axis: output i covers [floor(i*n/o), ceil((i+1)*n/o))."""
    n = as_int(x.shape[axis])
    if n == o:
        return x
    nd = len(x.shape)
    last = P.permute(x, [a for a in range(nd) if a != axis] + [axis])
    if n is None:  # a run-time size: which elements each output covers is computed at run time
        out, counts = _adaptive_run_time(last, o, reduce_op)
    elif n % o == 0:
        out = P.reshape(last, (*last.shape[:-1], o, n // o))
        out = P.reduce(reduce_op, out, [-1])
        counts = np.full(o, n // o)
    else:
        starts = np.arange(o) * n // o
        ends = -(-(np.arange(1, o + 1) * n) // o)
        mask = (np.arange(n) >= starts[:, None]) & (np.arange(n) < ends[:, None])
        counts = mask.sum(1)
        big = (*last.shape[:-1], o, n)
        xe = g.expand_to(P.reshape(last, (*last.shape[:-1], 1, n)), big)
        m = g.expand_to(ctx.constant(mask), big)
        fill = -math.inf if reduce_op == "max_reduce" else 0.0
        out = g.reduce(reduce_op, P.where(m, xe, fill), len(big) - 1)
    if reduce_op == "sum" and n is None:
        out = P.div(out, g.expand_to(counts, out.shape))
    elif reduce_op == "sum":
        out = P.mul(out, float(1 / counts[0]) if np.all(counts == counts[0])
                    else g.expand_to(ctx.constant((1 / counts).astype(np.float32)), out.shape))
    inverse = list(range(nd - 1))
    inverse.insert(axis, nd - 1)
    return P.permute(out, inverse)


def _adaptive_run_time(last: Node, o: int, reduce_op: str) -> tuple[Node, Node]:
    """Adaptive pooling of last's last axis, of run-time length n, to o outputs, and each output's
    count as a float [o]. Element j is in output i's span [floor(i*n/o), ceil((i+1)*n/o)) exactly
    when (j + 1) * o > i * n and j * o < (i + 1) * n: integer products, no division."""
    n = last.shape[-1]
    size = P.size_node(n)
    i = P.reshape(g.iota(o, DType.int64), (o, 1))
    j = P.reshape(g.iota(n, DType.int64), (1, n))
    inside = P.logical_and(P.lt(P.mul(i, size), P.mul(P.add(j, 1), o)),
                           P.lt(P.mul(j, o), P.mul(P.add(i, 1), size)))  # [o, n]
    big = (*last.shape[:-1], o, n)
    xe = g.expand_to(P.reshape(last, (*last.shape[:-1], 1, n)), big)
    fill = -math.inf if reduce_op == "max_reduce" else 0.0
    out = g.reduce(reduce_op, P.where(g.expand_to(inside, big), xe, fill), len(big) - 1)
    return out, P.reduce("sum", g.cast(inside, last.dtype), [1])


def _adaptive(reduce_op: str) -> Callable[..., Any]:
    def lower(ctx: Ctx, x: Node, output_size: Sequence[int | None]) -> Any:
        nd, out = len(output_size), x
        for k, o in enumerate(output_size):
            axis = len(x.shape) - nd + k
            out = _adaptive_axis(ctx, out, axis, as_int(x.shape[axis]) if o is None else o, reduce_op)
        return out if reduce_op == "sum" else (out, Unavailable("adaptive max-pooling indices"))
    return lower


# --- normalisation ------------------------------------------------------------------------------

def _affine(x: Node, w: Node | None, b: Node | None, shape: Sequence[sint]) -> Node:
    if w is not None:
        x = P.mul(x, P.reshape(w, shape))
    if b is not None:
        x = P.add(x, P.reshape(b, shape))
    return x


def _standardised(x: Node, axes: list[int], eps: float) -> tuple[Node, Node, Node]:
    """(x - mean) * rstd over axes, the mean and rstd = 1 / sqrt(biased variance + eps), kept dims."""
    d, mean = _centred(x, [a % len(x.shape) for a in axes])
    rstd = P.rsqrt(P.add(P.mean(P.mul(d, d), axes, keepdim=True), eps))
    return P.mul(d, rstd), mean, rstd


def _layer_norm(ctx: Ctx, x: Node, normalized_shape: Sequence[int], w: Node | None, b: Node | None,
                eps: float) -> tuple[Node, Node, Node]:
    axes = list(range(len(x.shape) - len(normalized_shape), len(x.shape)))
    out, mean, rstd = _standardised(x, axes, eps)
    return _affine(out, w, b, x.shape[axes[0]:]), mean, rstd


def _batch_norm_eval(ctx: Ctx, x: Node, w: Node | None, b: Node | None, mean: Node, var: Node,
                     momentum: float, eps: float) -> tuple[Node, Unavailable, Unavailable]:
    # x * scale + shift, both per channel and weight-only: folded at compile time, and the
    # scale free to move into a convolution before it (eclat.rewrites.affine)
    shape = (x.shape[1],) + (1,) * (len(x.shape) - 2)
    scale = P.rsqrt(P.add(var, eps))
    scale = scale if w is None else P.mul(scale, w)
    shift = P.neg(P.mul(mean, scale))
    shift = shift if b is None else P.add(shift, b)
    saved = Unavailable("batch-norm saved statistics")
    return P.add(P.mul(x, P.reshape(scale, shape)), P.reshape(shift, shape)), saved, saved


def _native_batch_norm(ctx: Ctx, x, w, b, mean, var, training: bool, momentum: float, eps: float):
    if training or mean is None:
        raise NotImplementedError("batch norm in training mode (call model.eval() first)")
    return _batch_norm_eval(ctx, x, w, b, mean, var, momentum, eps)


def _batch_norm_own_stats(ctx: Ctx, x: Node, w: Node | None, b: Node | None, training: bool,
                          momentum: float, eps: float) -> tuple[Node, Node, Node]:
    """Batch norm over the input's own statistics (no running ones kept): per channel (axis 1), the
    mean and the biased variance over every other axis. A BatchNorm built without running
    statistics does this at inference; NF-ResNet's and BiT's standardised convolutions do it to
    their weights (then it is weight-only, and folded at compile time)."""
    out, mean, rstd = _standardised(x, [0, *range(2, len(x.shape))], eps)
    c = (x.shape[1],)
    return _affine(out, w, b, c + (1,) * (len(x.shape) - 2)), P.reshape(mean, c), P.reshape(rstd, c)


def _group_norm(ctx: Ctx, x: Node, w: Node | None, b: Node | None, n: sint, c: sint, hw: sint,
                groups: int, eps: float) -> tuple[Node, Node, Node]:
    out, mean, rstd = _standardised(P.reshape(x, (n, groups, prod(x.shape[1:]) // groups)), [2], eps)
    out = _affine(P.reshape(out, x.shape), w, b, (c,) + (1,) * (len(x.shape) - 2))
    return out, P.reshape(mean, (n, groups)), P.reshape(rstd, (n, groups))


# --- movement ------------------------------------------------------------------------------------

def _view(ctx: Ctx, x: Node, *_: Any) -> Node:
    return P.reshape(x, ctx.out_shape)


def _permute(ctx: Ctx, x: Node, dims: Sequence[int]) -> Node:
    return P.permute(x, [_axis(d, len(x.shape)) for d in dims])


def _transpose(ctx: Ctx, x: Node, a: int = 0, b: int = 1) -> Node:
    order = list(range(len(x.shape)))
    if order:
        a, b = _axis(a, len(order)), _axis(b, len(order))
        order[a], order[b] = order[b], order[a]
    return P.permute(x, order)


def _expand(ctx: Ctx, x: Node, *_: Any, **__: Any) -> Node:
    return g.expand_to(x, ctx.out_shape)


def _slice(ctx: Ctx, x: Node, dim: int = 0, start: sint | None = None, end: sint | None = None,
           step: int = 1) -> Node:
    axis = _axis(dim, len(x.shape))
    n, length = x.shape[axis], ctx.out_shape[axis]
    start = 0 if start is None else start
    if isinstance(start, int) and as_int(n) is not None:
        start = min(max(start + as_int(n) if start < 0 else start, 0), as_int(n))
    elif isinstance(start, int) and start < 0:  # counted from a run-time end
        start = n + start
    if as_int(length) == 0:
        stop = start
    else:
        stop = start + (length - 1) * step + 1
    least = bounds(to_expr(n))[0]
    if as_int(n) is None and not (at_most(0, start) and at_most(stop, n)):
        # torch.export took the slice's bounds at the example's size (x[:2] is 2 long whatever
        # the run-time size): the program holds only for sizes that contain them
        raise NotImplementedError(
            f"a slice [{start}:{stop}] of the run-time size {n} (at least {least}) that torch.export "
            f"sized at the example, {length} long: it holds only where {n} contains it; raise the "
            "dimension's minimum (torch.export.Dim(min=...)) so that it does")
    # the length as torch states it (n - (n - 3) is 3, which the view's arithmetic leaves unsaid)
    shape = [*x.shape[:axis], length, *x.shape[axis + 1:]]
    return g.movement(x, lambda v: _with_shape(v.slice(axis, start, stop, step), shape))


def _select(ctx: Ctx, x: Node, dim: int, index: sint) -> Node:
    axis = _axis(dim, len(x.shape))
    n = x.shape[axis]
    if isinstance(index, int) and index < 0:
        index = index + n
    if as_int(index) is not None and as_int(n) is not None and not 0 <= as_int(index) < as_int(n):
        raise ValueError(f"index {index} out of range for size {n}")
    picked = g.movement(x, lambda v: v.slice(axis, index, index + 1))
    return P.reshape(picked, ctx.out_shape)


def _cat(ctx: Ctx, tensors: Sequence[Node], dim: int = 0) -> Node:
    parts = [g.cast(t, ctx.out_dtype) for t in tensors if not (len(t.shape) == 1 and as_int(t.shape[0]) == 0)]
    axis = _axis(dim, len(ctx.out_shape))
    return _concatenated(parts, axis, ctx.out_shape) if parts else _out(ctx, 0)


def _concatenated(parts: Sequence[Node], axis: int, shape: Sequence[sint] | None = None) -> Node:
    """parts joined along axis (shape: the result's, stated where symbolic sums may not simplify to
    it): each padded with zeros to the whole length, and the pieces added up."""
    if shape is None:
        shape = list(parts[0].shape)
        shape[axis] = sum(as_int(t.shape[axis]) for t in parts)
    shape = tuple(shape)
    total = shape[axis]
    out: Node | None = None
    offset: sint = 0
    for t in parts:
        pads = [(0, 0)] * len(t.shape)
        pads[axis] = (offset, total - offset - t.shape[axis])
        offset = offset + t.shape[axis]
        piece = g.movement(t, lambda v, pads=pads: _with_shape(v.pad(pads), shape))
        out = piece if out is None else P.add(out, piece)
    assert out is not None
    return out


def _with_shape(v: View, shape: Sequence[sint]) -> View:
    return View.make(shape, v.strides, v.offset, v.mask)


def _upsample_nearest(ctx: Ctx, x: Node, output_size: Sequence[int] | None = None,
                      scale_factors: Sequence[float] | None = None) -> Node:
    """Nearest-neighbour upsampling: output i reads input floor(i * scale), a Gather per axis."""
    nd = len(ctx.out_shape) - 2
    out = x
    for k in range(nd):
        axis = 2 + k
        n, o = as_int(x.shape[axis]), as_int(ctx.out_shape[axis])
        if n is None or o is None:
            whole = _whole_scale(x, ctx.out_shape, axis, scale_factors)
            out = _repeated(out, axis, whole, ctx.out_shape[axis])
            continue
        scale = 1 / scale_factors[k] if scale_factors else n / o
        src = np.minimum(np.floor(np.arange(o) * np.float32(scale)), n - 1).astype(np.int64)
        out = _index(ctx, out, [None] * axis + [ctx.constant(src)])
    return out


def _upsample_bilinear(ctx: Ctx, x: Node, output_size: Sequence[int] | None, align_corners: bool,
                       scale_factors: Sequence[float] | None = None) -> Node:
    """Bilinear upsampling, one axis at a time: output i blends the two inputs around its
    source coordinate (torch's half-pixel rule, or corner to corner with align_corners)."""
    out = x
    for k in range(len(ctx.out_shape) - 2):
        axis = 2 + k
        n, o = as_int(x.shape[axis]), as_int(ctx.out_shape[axis])
        if n is None or o is None:
            if align_corners:
                raise NotImplementedError("bilinear upsampling with align_corners over symbolic sizes")
            whole = _whole_scale(x, ctx.out_shape, axis, scale_factors)
            out = _blend_periodic(out, axis, whole, ctx.out_shape[axis])
            continue
        dst = np.arange(o, dtype=np.float32)
        if align_corners:
            src = dst * np.float32((n - 1) / (o - 1) if o > 1 else 0.0)
        else:
            scale = np.float32(1 / scale_factors[k] if scale_factors else n / o)
            src = np.maximum((dst + np.float32(0.5)) * scale - np.float32(0.5), 0)
        lo = np.minimum(np.floor(src), n - 1).astype(np.int64)
        hi = np.minimum(lo + 1, n - 1)
        frac = (src - lo).astype(np.float32)
        if axis == len(x.shape) - 1 and n <= BLEND_AS_PRODUCT:
            out = _blend_rows(ctx, out, lo, hi, frac)
            continue
        frac = frac.reshape((o,) + (1,) * (len(x.shape) - axis - 1))
        near, far = (_index(ctx, out, [None] * axis + [ctx.constant(i)]) for i in (lo, hi))
        w = g.expand_to(ctx.constant(frac), near.shape)
        out = P.add(P.mul(near, P.sub(1.0, w)), P.mul(far, w))
    return out


def _whole_scale(x: Node, out_shape: Sequence[sint], axis: int, scale_factors: Sequence[float] | None) -> int:
    """The whole number s with out = s * x along axis, which upsampling over a size known only at
    run time needs (its source index is then a function of the output's position modulo s)."""
    if scale_factors:
        factor = scale_factors[axis - 2]
        whole = int(factor) if float(factor).is_integer() and factor >= 1 else None
    else:
        whole = next((s for s in range(1, 65) if sym_eq(out_shape[axis], x.shape[axis] * s)), None)
    if whole is None:
        raise NotImplementedError(f"upsampling over a symbolic size by a scale that is not a whole number "
                                  f"({x.shape[axis]} to {out_shape[axis]})")
    return whole


def _interleaved(parts: Sequence[Node], axis: int, size: sint) -> Node:
    """parts (one shape) interleaved along axis: element i of part r at position i * len(parts) + r."""
    head, tail = parts[0].shape[:axis + 1], parts[0].shape[axis + 1:]
    phases = [P.reshape(p, (*head, 1, *tail)) for p in parts]
    joined = _concatenated(phases, axis + 1, (*head, len(parts), *tail))
    return P.reshape(joined, (*head[:-1], size, *tail))


def _repeated(x: Node, axis: int, s: int, size: sint) -> Node:
    """Each element of x along axis s times in a row (nearest upsampling by the whole number s)."""
    if s == 1:
        return x
    head, tail = x.shape[:axis + 1], x.shape[axis + 1:]
    wide = g.expand_to(P.reshape(x, (*head, 1, *tail)), (*head, s, *tail))
    return P.reshape(wide, (*head[:-1], size, *tail))


def _shifted(x: Node, axis: int, d: int) -> Node:
    """x[clamp(i + d, 0, n - 1)] along axis for d in (-1, 0, 1): the edge element repeated."""
    n = x.shape[axis]
    if d == 0:
        return x
    cut = lambda a, b: g.movement(x, lambda v: v.slice(axis, a, b))  # noqa: E731
    parts = [cut(1, n), cut(n - 1, n)] if d > 0 else [cut(0, 1), cut(0, n - 1)]
    return _concatenated(parts, axis, x.shape)


def _blend_periodic(x: Node, axis: int, s: int, size: sint) -> Node:
    """Bilinear upsampling (half-pixel centres) by the whole number s along axis: output s*q + r
    reads source q + (r + 0.5) / s - 0.5, so each phase r blends x with x shifted by one at a
    weight of its own, and the phases are interleaved. The source clamps to the edges as torch's."""
    parts = []
    for r in range(s):
        f = float((np.float32(r) + np.float32(0.5)) * np.float32(1 / s) - np.float32(0.5))
        near, far, w = (x, _shifted(x, axis, 1), f) if f >= 0 else (_shifted(x, axis, -1), x, 1 + f)
        parts.append(near if w == 0 else P.add(P.mul(near, 1 - w), P.mul(far, w)))
    return _interleaved(parts, axis, size)


# inputs along the last axis up to which linear interpolation along it is a product with the blend
# matrix: a gather along a last axis loads its elements one by one (DeepLab's 8x upsampling of 32
# columns: 1840 us as gathers read in place, 1610 through a transposed table, 1050 as a product)
BLEND_AS_PRODUCT = 32


def _blend_rows(ctx: Ctx, x: Node, lo: np.ndarray, hi: np.ndarray, frac: np.ndarray) -> Node:
    """x's last axis (n long) interpolated to len(lo) points: x @ B with B [n, len(lo)] holding
    1 - frac at (lo, j) and frac at (hi, j) (summed where they meet)."""
    n, o = as_int(x.shape[-1]), len(lo)
    blend = np.zeros((n, o), np.float32)
    np.add.at(blend, (lo, np.arange(o)), 1 - frac)
    np.add.at(blend, (hi, np.arange(o)), frac)
    rows = P.reshape(x, (prod(x.shape[:-1]), n))
    return P.reshape(_product(rows, g.cast(ctx.constant(blend), x.dtype)), (*x.shape[:-1], o))


def _place(x: Node, axis: int, start: int, step: int, n: int) -> Node:
    """A view of length n along axis holding x's elements at start, start + step, ...
    and zeros elsewhere (the inverse of a strided slice)."""
    length = as_int(x.shape[axis])
    if length is None:
        raise NotImplementedError("scatter into a symbolic size")
    if step > 1:  # interleave step - 1 zeros after every element
        split = (*x.shape[:axis], length, 1, *x.shape[axis + 1:])
        pads = [(0, 0)] * len(split)
        pads[axis + 1] = (0, step - 1)
        spread = g.movement(P.reshape(x, split), lambda v: v.pad(pads))
        x = P.reshape(spread, (*x.shape[:axis], length * step, *x.shape[axis + 1:]))
        length = min(length * step, n - start)
        x = g.movement(x, lambda v: v.slice(axis, 0, length))
    pads = [(0, 0)] * len(x.shape)
    pads[axis] = (start, n - start - length)
    return g.movement(x, lambda v: v.pad(pads))


def _slice_scatter(ctx: Ctx, x: Node, src: Node, dim: int = 0, start: int | None = None,
                   end: int | None = None, step: int = 1) -> Node:
    """x with x[start:end:step] (along dim) replaced by src."""
    axis = _axis(dim, len(x.shape))
    n = as_int(x.shape[axis])
    if n is None:
        raise NotImplementedError("slice_scatter on a symbolic size")
    start = slice(start, end, step).indices(n)[0]
    inside = g.expand_to(g.const(True, DType.bool), src.shape)
    placed = _place(g.cast(src, x.dtype), axis, start, step, n)
    return P.where(_place(inside, axis, start, step, n), placed, x)


def _select_scatter(ctx: Ctx, x: Node, src: Node, dim: int, index: int) -> Node:
    axis = _axis(dim, len(x.shape))
    index = index + as_int(x.shape[axis]) if index < 0 else index
    src = P.reshape(src, (*src.shape[:axis], 1, *src.shape[axis:]))
    return _slice_scatter(ctx, x, src, axis, index, index + 1)


def _split_sizes(ctx: Ctx, x: Node, sizes: Sequence[sint], dim: int = 0) -> tuple[Node, ...]:
    axis = _axis(dim, len(x.shape))
    out, start = [], 0
    for s in sizes:
        out.append(g.movement(x, lambda v, a=start, b=start + s: v.slice(axis, a, b)))
        start = start + s
    return tuple(out)


def _split(ctx: Ctx, x: Node, size: int, dim: int = 0) -> tuple[Node, ...]:
    n = as_int(x.shape[_axis(dim, len(x.shape))])
    if n is None:
        raise NotImplementedError("split of a symbolic size")
    return _split_sizes(ctx, x, [min(size, n - k) for k in range(0, n, size)] or [0], dim)


def _unbind(ctx: Ctx, x: Node, dim: int = 0) -> tuple[Node, ...]:
    axis = _axis(dim, len(x.shape))
    shape = x.shape[:axis] + x.shape[axis + 1:]
    return tuple(P.reshape(t, shape) for t in _split(ctx, x, 1, dim))


def _torch_storage(ctx: Ctx, x: Node) -> tuple[Node, sint]:
    """x's storage as torch lays it out, as a value whose row-major elements are that storage from
    the storage offset it returns on. Unknown layouts are taken as contiguous (what export gives in
    practice); a permuted dense layout is x permuted to storage order; broadcast axes (stride 0)
    store only their first element. Anything else stores elements that are not x's: an error."""
    layout = ctx.torch_layout(0)
    if layout is None:
        return x, 0
    strides, offset = layout
    kept = [k for k, n in enumerate(x.shape) if as_int(n) != 1 and as_int(strides[k]) != 0]
    if len(kept) < len(x.shape):  # drop size-1 and broadcast axes: each stores one element
        x = g.movement(x, lambda v: v.shrink([(0, n if k in kept else 1) for k, n in enumerate(v.shape)]))
        x = P.reshape(x, [x.shape[k] for k in kept])
        strides = tuple(strides[k] for k in kept)
    # storage order, innermost first: a dense layout has an axis of stride 1, then one whose stride
    # is that axis's size, and so on (a chain that needs no ordering of symbolic strides)
    inner: list[int] = []
    step: sint = 1
    while len(inner) < len(strides):
        k = next((k for k in range(len(strides)) if k not in inner
                  and as_int(_expanded(to_expr(strides[k]) - step)) == 0), None)
        if k is None:
            raise NotImplementedError(
                f"as_strided of a tensor torch stores with strides {list(strides)} for shape "
                f"{list(x.shape)}: not densely (as far as eclat can tell), so the storage it reads "
                "holds elements that are not the tensor's own (e.g. the rest of a sliced tensor)")
        inner.append(k)
        step = step * x.shape[k]
    order = inner[::-1]
    return P.permute(x, order), offset


def _as_strided(ctx: Ctx, x: Node, size: Sequence[sint], stride: Sequence[sint],
                storage_offset: sint | None = None) -> Node:
    """A view that reads x's storage (see _torch_storage) at offset + sum(i_k * stride_k): one View
    of x's source, overlapping windows included; copied first only where x's own view cannot
    compose with it (a masked or permuted source)."""
    if len(size) != len(stride):
        raise ValueError(f"as_strided: {len(size)} sizes but {len(stride)} strides")
    if any(as_int(s) is not None and as_int(s) < 0 for s in stride):
        raise ValueError(f"as_strided: negative strides {list(stride)} (torch does not support them)")
    if any(to_expr(s).vmin < 0 for s in stride):
        raise NotImplementedError(f"as_strided: cannot show that strides {list(stride)} are not negative")
    storage, base = _torch_storage(ctx, x)
    # torch's offset counts from the start of the storage, ours from where x's elements begin in it
    offset = 0 if storage_offset is None else storage_offset - base
    # the first and last storage element read (strides are not negative); torch checks only the
    # last, against its storage's size at run time, but the storage before x is not x's either
    last = offset + sum(((n - 1) * s for n, s in zip(size, stride)), 0)
    numel = prod(storage.shape)
    slack = [_expanded(offset), _expanded(numel - 1 - to_expr(last))]  # both >= 0 when inside
    if as_int(prod(size)) != 0 and any(to_expr(e).vmin < 0 for e in slack):
        where = f"elements {offset} to {last} of the input's {numel}"
        if all(as_int(e) is None or as_int(e) >= 0 for e in slack):
            raise NotImplementedError(f"as_strided: cannot show that {where} stay inside it for every "
                                      f"size (sizes {list(size)}, strides {list(stride)})")
        raise ValueError(f"as_strided with sizes {list(size)}, strides {list(stride)} and offset "
                         f"{offset} reads {where}: outside the input")
    outer = View.make(size, stride, offset)
    return g.movement(storage, lambda v: outer if v.is_contiguous else compose(v, outer))


def _expanded(e: sint) -> sint:
    """e as a sum of products with like terms collected, so that a difference such as
    n*8 - 1 - (8*(n - 1) + 7) cancels to 0 (Expr's constructors do not collect terms);
    // and % are kept whole."""
    def terms(x: Expr) -> dict[tuple[Expr, ...], int]:
        if isinstance(x, BinOp) and x.op in ("+", "*"):
            a, b = terms(x.a), terms(x.b)
            out: dict[tuple[Expr, ...], int] = {}
            if x.op == "+":
                pairs = [*a.items(), *b.items()]
            else:
                pairs = [(tuple(sorted(ma + mb, key=repr)), ca * cb)
                         for ma, ca in a.items() for mb, cb in b.items()]
            for m, c in pairs:
                out[m] = out.get(m, 0) + c
            return out
        return {(): x.v} if isinstance(x, Num) else {(x,): 1}
    out: sint = 0
    for monomial, c in terms(to_expr(e)).items():
        if c:
            out = out + c * prod(monomial)
    return out


def _unsqueeze(ctx: Ctx, x: Node, dim: int) -> Node:
    return P.reshape(x, ctx.out_shape)


def _flip(ctx: Ctx, x: Node, dims: Sequence[int]) -> Node:
    axes = [_axis(d, len(x.shape)) for d in dims]
    return g.movement(x, lambda v: v.flip(axes)) if axes else x


def _repeat(ctx: Ctx, x: Node, repeats: Sequence[int]) -> Node:
    lead = len(repeats) - len(x.shape)
    shape = (1,) * lead + x.shape
    inter = [d for n in shape for d in (1, n)]
    big = [d for r, n in zip(repeats, shape) for d in (r, n)]
    xe = g.expand_to(P.reshape(x, inter), big)
    return P.reshape(xe, ctx.out_shape)


def _constant_pad(ctx: Ctx, x: Node, pad: Sequence[int], value: Value = 0) -> Node:
    nd = len(x.shape)
    pairs = [(0, 0)] * nd
    for k in range(len(pad) // 2):
        pairs[nd - 1 - k] = (pad[2 * k], pad[2 * k + 1])
    bounds = [(max(0, -b), n - max(0, -a)) for (b, a), n in zip(pairs, x.shape)]
    x = g.movement(x, lambda v: v.shrink(bounds)) if any(b < 0 or a < 0 for b, a in pairs) else x
    grow = [(max(0, b), max(0, a)) for b, a in pairs]
    padded = g.movement(x, lambda v: v.pad(grow))
    if value == 0:
        return padded
    inside = g.movement(g.expand_to(g.const(True, DType.bool), x.shape), lambda v: v.pad(grow))
    return P.where(inside, padded, P.lift(value, x.dtype))


def _tri(lower_: bool) -> Callable[..., Node]:
    def lower(ctx: Ctx, x: Node, diagonal: int = 0) -> Node:
        r, c = x.shape[-2:]
        rows = g.expand_to(P.reshape(g.iota(r, DType.int64), (r, 1)), x.shape)
        cols = g.expand_to(g.iota(c, DType.int64), x.shape)
        # tril keeps c <= r + k; triu keeps c >= r + k
        below = P.lt(cols, P.add(rows, diagonal + 1))
        keep = below if lower_ else P.logical_not(P.lt(cols, P.add(rows, diagonal)))
        return P.where(keep, x, P.lift(0, x.dtype))
    return lower


# --- indexing ---------------------------------------------------------------------------------------

def _normalise_index(idx: Node, n: sint) -> Node:
    if idx.dtype not in (DType.int32, DType.int64):
        raise NotImplementedError(f"indexing with a {idx.dtype.short} tensor (only integer indices)")
    return P.where(P.lt(idx, 0), P.add(idx, P.lift(P.size_node(n), idx.dtype)), idx)


def _flatten_indexed(x: Node, indices: Sequence[Node | None]) -> tuple[Node, Node, list[int], Any]:
    """x[indices] as (table, lin, pos, order): the indexed axes `pos` of x moved to the front
    and flattened into one (table [P, *rest]), the flat position of every indexed element
    (lin, in the indices' broadcast shape), and the permutation that takes table[lin]
    (index dims first) to torch's layout of x[indices], or None when it is already that."""
    nd = len(x.shape)
    pos = [k for k, i in enumerate(indices) if i is not None]
    rest = [k for k in range(nd) if k not in pos]
    idx = [_normalise_index(indices[k], x.shape[k]) for k in pos]
    bshape = P.broadcast_shape(*(i.shape for i in idx))
    lin: Node | None = None
    for k, i in zip(pos, idx):
        i = g.expand_to(g.cast(i, DType.int64), bshape)
        lin = i if lin is None else P.add(P.mul(lin, P.lift(P.size_node(x.shape[k]), DType.int64)), i)
    front = P.permute(x, pos + rest)
    table = P.reshape(front, (prod([x.shape[k] for k in pos]), *(x.shape[k] for k in rest)))
    order = None
    if pos == list(range(pos[0], pos[-1] + 1)) and pos[0] > 0:  # adjacent index dims stay in place
        b, lead = len(bshape), pos[0]
        order = list(range(b, b + lead)) + list(range(b)) + list(range(b + lead, b + len(rest)))
    return table, lin, pos, order


def _index(ctx: Ctx, x: Node, indices: Sequence[Node | None]) -> Node:
    """x[..., i, j, ...] with integer index tensors: one Gather from the flattened table."""
    for i, n in zip(indices, x.shape):
        if i is not None:
            ctx.index_range(i, -n, n)  # negative indices count from the end
    pos = [k for k, i in enumerate(indices) if i is not None]
    if pos == list(range(pos[0], pos[-1] + 1)) and pos[0] > 0:
        return _index_in_place(x, indices, pos)
    table, lin, _, order = _flatten_indexed(x, indices)
    out = g.gather(table, lin)
    return out if order is None else P.permute(out, order)


def _index_in_place(x: Node, indices: Sequence[Node | None], pos: list[int]) -> Node:
    """x[:, .., i, j, ..] with the index tensors on adjacent axes after the first: the leading axes
    join the gathered ones (the table is x itself, rows of its trailing axes), so x is not copied
    with the indexed axes moved to the front, nor is the gather's result permuted back (as a
    transposed table, a gather along the last axis made one strided load per output). An index
    past its axis is clamped to it, as the gather clamps one past the table."""
    lead, tail = list(x.shape[:pos[0]]), list(x.shape[pos[-1] + 1:])
    idx = [_normalise_index(indices[k], x.shape[k]) for k in pos]
    bshape = P.broadcast_shape(*(i.shape for i in idx))
    out_idx = (*lead, *bshape)
    lin: Node | None = None
    for axis in range(pos[-1] + 1):
        size = P.lift(P.size_node(x.shape[axis]), DType.int64)
        if axis < pos[0]:  # a leading axis: its position along the result
            shape = [1] * len(out_idx)
            shape[axis] = lead[axis]
            i = P.reshape(g.iota(lead[axis], DType.int64), tuple(shape))
        else:
            i = g.cast(idx[axis - pos[0]], DType.int64)
            i = P.reshape(i, (*(1,) * len(lead), *(1,) * (len(bshape) - len(i.shape)), *i.shape))
            i = P.maximum(P.minimum(i, P.sub(size, P.lift(1, DType.int64))), P.lift(0, DType.int64))
        i = g.expand_to(i, out_idx)
        lin = i if lin is None else P.add(P.mul(lin, size), i)
    table = P.reshape(x, (prod(x.shape[:pos[-1] + 1]), *tail))
    return g.gather(table, lin)


def _put_rows(table: Node, lin: Node, vals: Node, accumulate: bool) -> Node:
    """table [P, *R] with row lin[b] replaced by (or, accumulating, increased by) vals[b]
    for every b (lin [B], vals [B, *R]). Without accumulation the last update of a row wins, as
    on torch's CPU, read by a gather; accumulating, a one-hot match of rows and updates, summed."""
    rows, b, r = table.shape[0], lin.shape[0], table.shape[1:]
    hits = P.eq(g.expand_to(P.reshape(g.iota(rows, DType.int64), (rows, 1)), (rows, b)),
                g.expand_to(lin, (rows, b)))
    if not accumulate:  # each row reads the last update that lands on it: rows x B index work only
        order = g.expand_to(g.iota(b, DType.int64), (rows, b))
        last = g.reduce("max_reduce", P.where(hits, order, P.lift(-1, DType.int64)), 1)
        hit = g.expand_to(P.reshape(P.ge(last, 0), (rows, *(1,) * len(r))), table.shape)
        return P.where(hit, g.gather(vals, last), table)  # (a row no update lands on: -1, clamped)
    full = (rows, *r, b)
    h = g.expand_to(P.reshape(hits, (rows, *(1,) * len(r), b)), full)
    v = g.expand_to(P.reshape(P.permute(vals, [*range(1, len(r) + 1), 0]), (1, *r, b)), full)
    return P.add(table, g.reduce("sum", P.where(h, v, P.lift(0, table.dtype)), len(full) - 1))


def _inverse(order: Sequence[int]) -> list[int]:
    return [order.index(k) for k in range(len(order))]


def _index_put(ctx: Ctx, x: Node, indices: Sequence[Node | None], values: Node, accumulate: bool = False
               ) -> Node:
    """x[indices] = values (or += with accumulate). Duplicate indices without accumulate
    take the last update, as torch on the CPU (which leaves it undefined)."""
    given = [i for i in indices if i is not None]
    if any(i.dtype is DType.bool for i in given):
        if len(given) != 1 or prod(values.shape) != 1:
            raise NotImplementedError("boolean-mask assignment of anything but a single value")
        k = next(k for k, i in enumerate(indices) if i is not None)
        mask = g.expand_to(P.reshape(given[0], (*(1,) * k, *given[0].shape,
                                               *(1,) * (len(x.shape) - k - len(given[0].shape)))), x.shape)
        v = P.lift(P.reshape(values, ()), x.dtype)
        return P.where(mask, P.add(x, v) if accumulate else v, x)
    for i, n in zip(indices, x.shape):
        if i is not None:
            ctx.index_range(i, -n, n)
    table, lin, pos, order = _flatten_indexed(x, indices)
    gathered = (*lin.shape, *table.shape[1:])  # table[lin] has the index dims first
    torch_shape = gathered if order is None else tuple(gathered[k] for k in order)
    vals = g.expand_to(g.cast(values, x.dtype), torch_shape)
    vals = vals if order is None else P.permute(vals, _inverse(order))
    b = prod(lin.shape)
    updated = _put_rows(table, P.reshape(lin, (b,)), P.reshape(vals, (b, *table.shape[1:])), accumulate)
    rest = [k for k in range(len(x.shape)) if k not in pos]
    front = P.reshape(updated, [x.shape[k] for k in pos + rest])
    return P.permute(front, _inverse(pos + rest))


def _index_select(ctx: Ctx, x: Node, dim: int, index: Node) -> Node:
    axis = _axis(dim, len(x.shape))
    ctx.index_range(index, 0, x.shape[axis])  # torch's index_select takes no negative index
    return _index(ctx, x, [None] * axis + [P.reshape(index, (prod(index.shape),))])


def _flat_positions(x: Node, axis: int, index: Node) -> Node:
    """For torch.gather / scatter: the flat position in x of every element of index,
    i.e. index on `axis` and the element's own coordinate on every other axis."""
    idx = _normalise_index(index, x.shape[axis]) if x.shape else index
    strides = View.contiguous(x.shape).strides
    lin: Node | None = None
    for k, (n, s) in enumerate(zip(idx.shape, strides)):
        if as_int(s) is None:
            raise NotImplementedError("gather or scatter on a tensor with symbolic sizes")
        if k == axis:
            term = g.cast(idx, DType.int64)
        else:
            term = g.expand_to(P.reshape(g.iota(n, DType.int64), (n,) + (1,) * (len(idx.shape) - k - 1)),
                               idx.shape)
        term = term if as_int(s) == 1 else P.mul(term, as_int(s))
        lin = term if lin is None else P.add(lin, term)
    return lin if lin is not None else g.cast(idx, DType.int64)


def _gather_dim(ctx: Ctx, x: Node, dim: int, index: Node, *, sparse_grad: bool = False) -> Node:
    """torch.gather: out[i][j] = x[i][index[i][j]] (for dim 1) through the flat table."""
    axis = _axis(dim, len(x.shape))
    ctx.index_range(index, 0, x.shape[axis] if x.shape else 1)
    return g.gather(P.reshape(x, (prod(x.shape),)), _flat_positions(x, axis, index))


def _scatter(accumulate: bool) -> Callable[..., Node]:
    def lower(ctx: Ctx, x: Node, dim: int, index: Node, src: Value, **_: Any) -> Node:
        """x with x[i][index[i][j]] = src[i][j] (for dim 1), or += when accumulating."""
        axis = _axis(dim, len(x.shape))
        ctx.index_range(index, 0, x.shape[axis] if x.shape else 1)
        lin = _flat_positions(x, axis, index)
        if isinstance(src, Node):  # only src's leading index.shape block takes part
            src = g.movement(src, lambda v: v.shrink([(0, n) for n in index.shape]))
        vals = P.lift(src, x.dtype, index.shape)
        b = prod(index.shape)
        flat = P.reshape(x, (prod(x.shape),))
        return P.reshape(_put_rows(flat, P.reshape(lin, (b,)), P.reshape(vals, (b,)), accumulate), x.shape)
    return lower


def _reflected(c: Node, low2: Node, high2: Node) -> Node:
    """c reflected into [low2 / 2, high2 / 2] as torch's grid sampler reflects (span 0: 0)."""
    low, span = P.mul(low2, 0.5), P.mul(P.sub(high2, low2), 0.5)
    c = P.abs_(P.sub(c, low))
    extra = P.elementwise("mod", c, span)
    flips = P.floor(P.div(c, span))
    even = P.eq(P.elementwise("mod", flips, 2.0), 0.0)
    out = P.where(even, P.add(extra, low), P.add(P.sub(span, extra), low))
    return P.where(P.eq(span, 0.0), 0.0, out)


def _grid_source(coord: Node, size: sint, padding_mode: int, align_corners: bool) -> Node:
    """A normalised grid coordinate in [-1, 1] as a position along an input axis of `size`, padded
    as torch's grid sampler pads (0 zeros, 1 border, 2 reflection), in its order of operations."""
    n = g.cast(P.size_node(size), coord.dtype)
    one = P.lift(1.0, coord.dtype)
    if align_corners:
        c = P.mul(P.div(P.add(coord, 1.0), 2.0), P.sub(n, one))
    else:
        c = P.div(P.sub(P.mul(P.add(coord, 1.0), n), one), 2.0)
    clip = lambda t: P.minimum(P.maximum(t, 0.0), P.sub(n, one))  # noqa: E731
    if padding_mode == 1:
        c = clip(c)
    elif padding_mode == 2:
        two = P.lift(2.0, coord.dtype)
        low2, high2 = (P.lift(0.0, coord.dtype), P.mul(two, P.sub(n, one))) if align_corners else \
            (P.lift(-1.0, coord.dtype), P.sub(P.mul(two, n), one))
        c = clip(_reflected(c, low2, high2))
    return c


def _grid_sampler_2d(ctx: Ctx, x: Node, grid: Node, interpolation_mode: int, padding_mode: int,
                     align_corners: bool) -> Node:
    """F.grid_sample on 4-D input (bilinear or nearest): each output reads its taps through one
    gather of the input's channel rows, a tap outside the input reading 0."""
    if interpolation_mode not in (0, 1):
        raise NotImplementedError("grid_sample with bicubic interpolation")
    n, c, h, w = x.shape
    _, ho, wo, _ = grid.shape
    grid = P.to_float(grid)
    coord = lambda k: P.reshape(g.movement(grid, lambda v: v.slice(3, k, k + 1)), (n, ho, wo))  # noqa: E731
    ix = _grid_source(coord(0), w, padding_mode, align_corners)
    iy = _grid_source(coord(1), h, padding_mode, align_corners)
    table = P.reshape(P.permute(x, [0, 2, 3, 1]), (n * h * w, c))  # channel rows of each pixel
    batch = g.expand_to(P.reshape(g.iota(n, DType.int64), (n, 1, 1)), (n, ho, wo))
    hi_x, hi_y = (P.sub(g.cast(P.size_node(d), ix.dtype), 1.0) for d in (w, h))

    def tap(ty: Node, tx: Node) -> Node:
        """The input at integral float positions (ty, tx) [n, ho, wo] -> [n, ho, wo, c], 0 outside."""
        inside = P.logical_and(P.logical_and(P.ge(tx, 0.0), P.le(tx, hi_x)),
                               P.logical_and(P.ge(ty, 0.0), P.le(ty, hi_y)))
        at = lambda t: g.cast(P.where(inside, t, 0.0), DType.int64)  # noqa: E731  (outside: row 0, zeroed)
        lin = P.add(P.mul(P.add(P.mul(batch, P.size_node(h)), at(ty)), P.size_node(w)), at(tx))
        rows = g.gather(table, lin)
        return P.where(g.expand_to(P.reshape(inside, (n, ho, wo, 1)), rows.shape), rows, P.lift(0, x.dtype))

    weighted = lambda t, wt: P.mul(t, g.expand_to(P.reshape(wt, (n, ho, wo, 1)), t.shape))  # noqa: E731
    if interpolation_mode == 1:
        out = tap(_round(ctx, iy), _round(ctx, ix))
    else:
        x0, y0 = P.floor(ix), P.floor(iy)
        x1, y1 = P.add(x0, 1.0), P.add(y0, 1.0)
        out = weighted(tap(y0, x0), P.mul(P.sub(x1, ix), P.sub(y1, iy)))
        out = P.add(out, weighted(tap(y0, x1), P.mul(P.sub(ix, x0), P.sub(y1, iy))))
        out = P.add(out, weighted(tap(y1, x0), P.mul(P.sub(x1, ix), P.sub(iy, y0))))
        out = P.add(out, weighted(tap(y1, x1), P.mul(P.sub(ix, x0), P.sub(iy, y0))))
    return _out(ctx, P.permute(out, [0, 3, 1, 2]))


# scatter_reduce's reduce -> (the reduction over the updates, its identity, its pairwise form)
_SCATTER_REDUCE = {"sum": ("sum", 0.0, P.add), "mean": ("sum", 0.0, P.add),
                   "amax": ("max_reduce", -math.inf, P.maximum), "amin": ("min", math.inf, P.minimum),
                   "prod": ("prod", 1.0, P.mul)}


def _reduce_last(ctx: Ctx, x: Node, how: str) -> Node:
    axis = len(x.shape) - 1
    if how == "min":
        return _min_reduce(x, [axis], False)
    return _prod(ctx, x, axis) if how == "prod" else g.reduce(how, x, axis)


def _scatter_reduce(ctx: Ctx, x: Node, dim: int, index: Node, src: Node, reduce: str,
                    *, include_self: bool = True) -> Node:
    """x.scatter_reduce(dim, index, src, reduce): each target element combined with every src
    element scattered to it (sum, prod, mean, amax, amin), by a one-hot match of targets and
    updates; a target nothing lands on keeps its value. NaN propagates through amax and amin as
    in torch (max_reduce propagates it)."""
    if reduce not in _SCATTER_REDUCE:
        raise NotImplementedError(f"scatter_reduce with reduce={reduce!r}")
    if reduce == "mean" and not x.dtype.is_float:
        raise NotImplementedError("scatter_reduce mean of an integer tensor (torch floors it)")
    how, identity, pair = _SCATTER_REDUCE[reduce]
    axis = _axis(dim, len(x.shape))
    ctx.index_range(index, 0, x.shape[axis] if x.shape else 1)
    lin = P.reshape(_flat_positions(x, axis, index), (prod(index.shape),))
    src = g.movement(src, lambda v: v.shrink([(0, n) for n in index.shape]))
    vals = P.reshape(g.cast(src, x.dtype), (prod(index.shape),))
    flat = P.reshape(x, (prod(x.shape),))
    rows, b = flat.shape[0], lin.shape[0]
    target = g.expand_to(P.reshape(g.iota(rows, DType.int64), (rows, 1)), (rows, b))
    hits = P.eq(target, g.expand_to(lin, (rows, b)))
    picked = P.where(hits, g.expand_to(P.reshape(vals, (1, b)), (rows, b)), P.lift(identity, x.dtype))
    combined = _reduce_last(ctx, picked, how)  # [rows]
    count = g.reduce("sum", g.cast(hits, DType.int64), 1)
    if include_self:
        combined = pair(flat, combined)
        count = P.add(count, 1)
    if reduce == "mean":
        combined = P.div(combined, g.cast(P.maximum(count, 1), x.dtype))
    out = P.where(P.lt(P.lift(0, DType.int64), count), combined, flat)
    return P.reshape(out, x.shape)


def _embedding_bag(ctx: Ctx, weight: Node, indices: Node, offsets: Node, scale_grad_by_freq: bool = False,
                   mode: int = 0, sparse: bool = False, per_sample_weights: Node | None = None,
                   include_last_offset: bool = False, padding_idx: int | None = -1) -> tuple:
    """nn.EmbeddingBag: the rows of `indices` gathered, and bag b (from offsets[b] to the next
    offset) summed (mode 0, weighted by per_sample_weights if given), averaged (1) or maxed (2);
    an empty bag gives 0, rows at padding_idx take no part. Bag membership is computed at the call
    from the offsets: one compare per bag and index."""
    ctx.index_range(indices, 0, weight.shape[0])
    n, bags = indices.shape[0], offsets.shape[0] - (1 if include_last_offset else 0)
    rows = g.gather(weight, g.cast(indices, DType.int64))  # [n, d]
    d = weight.shape[1]
    j = P.reshape(g.iota(n, DType.int64), (1, n))
    column = lambda lo, hi: g.cast(P.reshape(g.movement(offsets, lambda v: v.slice(0, lo, hi)),  # noqa: E731
                                             (hi - lo, 1)), DType.int64)
    starts = column(0, bags)
    if include_last_offset:
        ends = column(1, bags + 1)
    else:  # the next bag's start, the last bag's end the number of indices
        ends = _concatenated([column(1, bags), P.lift(n, DType.int64, (1, 1))], 0, (bags, 1))
    member = P.logical_and(P.le(starts, j), P.lt(j, ends))  # [bags, n]
    if padding_idx is not None and padding_idx >= 0:
        member = P.logical_and(member, P.ne(P.reshape(indices, (1, n)), padding_idx))
    if per_sample_weights is not None:
        rows = P.mul(rows, P.reshape(g.cast(per_sample_weights, rows.dtype), (n, 1)))
    full = (bags, d, n)
    inside = g.expand_to(P.reshape(member, (bags, 1, n)), full)
    spread = g.expand_to(P.reshape(P.permute(rows, [1, 0]), (1, d, n)), full)
    count = g.reduce("sum", g.cast(member, rows.dtype), 1)  # [bags]
    if mode == 2:
        out = g.reduce("max_reduce", P.where(inside, spread, P.lift(-math.inf, rows.dtype)), 2)
        out = P.where(g.expand_to(P.reshape(P.lt(0.0, count), (bags, 1)), (bags, d)), out, 0.0)
    else:
        out = g.reduce("sum", P.where(inside, spread, P.lift(0.0, rows.dtype)), 2)
        if mode == 1:
            out = P.div(out, g.expand_to(P.reshape(P.maximum(count, 1.0), (bags, 1)), (bags, d)))
    gone = Unavailable("embedding_bag's offset2bag, bag sizes and max indices")
    return out, gone, gone, gone


def _embedding(ctx: Ctx, weight: Node, idx: Node, *_: Any) -> Node:
    ctx.index_range(idx, 0, weight.shape[0])
    return g.gather(weight, idx)


# --- creation and casts --------------------------------------------------------------------------

def _full(ctx: Ctx, size_or_like: Any, value: Value, **_: Any) -> Node:
    return _out(ctx, value)


def _fill(value: Value) -> Callable[..., Node]:
    return lambda ctx, *_, **__: _out(ctx, value)


def _arange(ctx: Ctx, *args: Value, **_: Any) -> Node:
    start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
    n = ctx.out_shape[0]
    dtype = ctx.out_dtype
    ramp = g.cast(g.iota(n, DType.int64), dtype)
    if step != 1:
        ramp = P.mul(ramp, P.lift(step, dtype))
    return ramp if start == 0 else P.add(ramp, P.lift(start, dtype))


def _to_copy(ctx: Ctx, x: Node, **_: Any) -> Node:
    return g.cast(x, ctx.out_dtype)


def _identity(ctx: Ctx, x: Node, *_: Any, **__: Any) -> Node:
    return x


def _nothing(ctx: Ctx, *_: Any, **__: Any) -> None:
    return None


def convert_output(ctx: Ctx, v: Any) -> Node:
    """A graph output as a node: Python numbers and sizes become 0-dim constants."""
    if isinstance(v, Node):
        return v
    if isinstance(v, Unavailable):
        raise NotImplementedError(f"the model returns {v.what}, which eclat does not compute")
    if isinstance(v, Expr):
        return P.size_node(v)
    if isinstance(v, (bool, int, float)):
        return P.lift(v, P.promote(v))
    if isinstance(v, torch.dtype):
        raise TypeError(f"cannot return a {type(v).__name__} from a compiled model")
    return P.lift(v, ir_dtype(torch.tensor(v).dtype))


def _sym_size(ctx: Ctx, x: Node, dim: int) -> sint:
    return x.shape[_axis(dim, len(x.shape))]


def _sym_binary(fn: Callable[[Any, Any], Any]) -> Callable[..., Any]:
    return lambda ctx, a, b: fn(a, b)


def _sym_compare(python: Callable[[int, int], bool], tensor: Callable[[Value, Value], Node]
                 ) -> Callable[..., Any]:
    """A comparison of sizes: a Python bool when both are known, else a 0-dim bool tensor
    (runtime shape assertions consume it; eclat does not check them)."""
    def lower(ctx: Ctx, a: sint, b: sint) -> bool | Node:
        if as_int(a) is not None and as_int(b) is not None:
            return python(as_int(a), as_int(b))
        return tensor(P.size_node(a), P.size_node(b))
    return lower


def _grouped_mm(ctx: Ctx, x: Node, weight: Node, ends: Node) -> Node:
    """transformers' grouped_mm_fallback (its mixture-of-experts layers): x's rows sorted by
    expert, ends[e] the row where expert e's group ends; row s times weight[e] for the group e
    holding it (0 past the last group). Each row reads its expert's matrix through a gather: one
    read of each matrix a row uses, the least a decode step's few rows can read."""
    rows, depth = x.shape
    experts, _, width = weight.shape
    s = g.expand_to(P.reshape(g.iota(rows, DType.int64), (rows, 1)), (rows, experts))
    group = g.reduce("sum", g.cast(P.le(g.expand_to(P.reshape(ends, (1, experts)), (rows, experts)), s),
                                   DType.int64), 1)
    inside = P.lt(group, P.lift(P.size_node(experts), DType.int64))
    table = P.reshape(weight, (experts, prod((depth, width))))
    mats = P.reshape(g.gather(table, P.where(inside, group, P.lift(0, DType.int64))), (rows, depth, width))
    xs = g.expand_to(P.reshape(x, (rows, depth, 1)), (rows, depth, width))
    out = g.reduce("sum", P.mul(xs, mats), 1)
    return P.where(g.expand_to(P.reshape(inside, (rows, 1)), (rows, width)), out, P.lift(0, x.dtype))


# ops torch.export traces on a bool tensor but torch runs on none (no bool kernel: "Boolean inputs
# not supported for relu"), so a compile must refuse them too, not answer where torch raises
NO_BOOL_INPUTS = frozenset({aten.relu, aten.abs, aten.floor, aten.ceil, aten.round, aten.trunc, aten.argmax,
                            aten.gelu, aten.silu, aten.mish, aten.hardswish, aten.hardsigmoid, aten.celu,
                            aten.elu, aten.softplus})

# ops of other libraries' torch.library namespaces, by name: their OpOverloads exist only once the
# library is imported
LOWERINGS_BY_NAME: dict[str, Callable[..., Any]] = {
    "transformers.grouped_mm_fallback.default": _grouped_mm,
}

LOWERINGS: dict[Any, Callable[..., Any]] = {
    # arithmetic
    aten.add.Tensor: _add, aten.add.Scalar: _add,
    aten.sub.Tensor: _sub, aten.sub.Scalar: _sub,
    aten.rsub.Scalar: _rsub, aten.rsub.Tensor: _rsub,
    aten.mul.Tensor: lambda ctx, a, b: _out(ctx, P.mul(a, b)),
    aten.mul.Scalar: lambda ctx, a, b: _out(ctx, P.mul(a, b)),
    aten.div.Tensor: _div, aten.div.Scalar: _div, aten.div.Tensor_mode: _div, aten.div.Scalar_mode: _div,
    aten.fmod.Tensor: _fmod, aten.fmod.Scalar: _fmod,
    aten.remainder.Tensor: _remainder, aten.remainder.Scalar: _remainder,
    aten.neg.default: lambda ctx, x: P.neg(x),
    aten.pow.Tensor_Scalar: _pow, aten.pow.Tensor_Tensor: _pow, aten.pow.Scalar: _pow,
    aten.abs.default: lambda ctx, x: P.abs_(x),
    aten.sign.default: _sign,
    aten.floor.default: lambda ctx, x: P.floor(x),
    aten.ceil.default: _ceil,
    aten.trunc.default: lambda ctx, x: P.trunc(x),
    aten.round.default: _round, aten.round.decimals: _round,
    aten.maximum.default: lambda ctx, a, b: _out(ctx, P.maximum(a, b)),
    aten.minimum.default: lambda ctx, a, b: _out(ctx, P.minimum(a, b)),
    aten.clamp.default: _clamp, aten.clamp.Tensor: _clamp,
    aten.clamp_min.default: lambda ctx, x, lo: _clamp(ctx, x, lo),
    aten.clamp_max.default: lambda ctx, x, hi: _clamp(ctx, x, None, hi),
    # transcendental (float results)
    aten.exp.default: _float_unary(P.exp),
    aten.exp2.default: _float_unary(lambda x: g.unary("exp2", x)),
    aten.expm1.default: _float_unary(P.expm1),
    aten.log.default: _float_unary(P.log),
    aten.log2.default: _float_unary(lambda x: g.unary("log2", x)),
    aten.log1p.default: _float_unary(P.log1p),
    aten.sqrt.default: _float_unary(P.sqrt),
    aten.rsqrt.default: _float_unary(P.rsqrt),
    aten.reciprocal.default: _float_unary(P.recip),
    aten.sin.default: _float_unary(P.sin),
    aten.cos.default: _float_unary(P.cos),
    aten.tan.default: _float_unary(lambda x: P.div(P.sin(x), P.cos(x))),
    aten.sinh.default: _float_unary(lambda x: P.mul(P.sub(P.expm1(x), P.expm1(P.neg(x))), 0.5)),
    aten.asinh.default: _float_unary(_asinh), aten.acosh.default: _float_unary(_acosh),
    aten.atanh.default: _float_unary(lambda x: P.mul(P.log1p(P.div(P.mul(x, 2.0), P.sub(1.0, x))), 0.5)),
    aten.log10.default: _float_unary(lambda x: P.mul(g.unary("log2", x), math.log10(2.0))),
    aten.cosh.default: _float_unary(lambda x: P.mul(P.add(P.exp(x), P.exp(P.neg(x))), 0.5)),
    aten.hypot.default: _hypot,
    aten.atan.default: _float_unary(_atan),
    aten.asin.default: _float_unary(_asin),
    aten.acos.default: _float_unary(lambda x: P.sub(math.pi / 2, _asin(x))),
    aten.atan2.default: _atan2,
    aten.signbit.default: _signbit,
    aten.tanh.default: _float_unary(P.tanh),
    aten.sigmoid.default: _float_unary(P.sigmoid),
    aten.erf.default: _float_unary(P.erf), aten.erfc.default: _float_unary(P.erfc),
    aten.erfinv.default: _float_unary(P.erfinv), aten.lgamma.default: _float_unary(P.lgamma),
    aten.digamma.default: _float_unary(P.digamma),
    aten.isnan.default: lambda ctx, x: P.isnan(x) if x.dtype.is_float else _out(ctx, False),
    aten.isinf.default: lambda ctx, x: (P.logical_or(P.eq(x, math.inf), P.eq(x, -math.inf))
                                        if x.dtype.is_float else _out(ctx, False)),
    aten.nan_to_num.default: _nan_to_num,
    # activations
    aten.relu.default: lambda ctx, x: P.maximum(x, P.lift(0, x.dtype)),
    aten.gelu.default: lambda ctx, x, approximate="none": _out(ctx, P.gelu(x, approximate)),
    aten.silu.default: _float_unary(lambda x: P.mul(x, P.sigmoid(x))),
    aten.hardtanh.default: lambda ctx, x, lo=-1.0, hi=1.0: _clamp(ctx, x, lo, hi),
    aten.leaky_relu.default: lambda ctx, x, slope=0.01: P.where(P.lt(0.0, x), x, P.mul(x, slope)),
    aten.elu.default: _elu,
    # comparisons and logic
    aten.lt.Tensor: _cmp(P.lt), aten.lt.Scalar: _cmp(P.lt),
    aten.gt.Tensor: _cmp(P.gt), aten.gt.Scalar: _cmp(P.gt),
    aten.le.Tensor: _cmp(P.le), aten.le.Scalar: _cmp(P.le),
    aten.ge.Tensor: _cmp(P.ge), aten.ge.Scalar: _cmp(P.ge),
    aten.eq.Tensor: _cmp(P.eq), aten.eq.Scalar: _cmp(P.eq),
    aten.ne.Tensor: _cmp(P.ne), aten.ne.Scalar: _cmp(P.ne),
    aten.where.self: _where,
    aten.masked_fill.Scalar: _masked_fill, aten.masked_fill.Tensor: _masked_fill,
    aten.logical_not.default: lambda ctx, x: P.logical_not(x),
    aten.logical_and.default: lambda ctx, a, b: P.logical_and(a, b),
    aten.logical_or.default: lambda ctx, a, b: P.logical_or(a, b),
    aten.logical_xor.default: lambda ctx, a, b: P.logical_xor(a, b),
    aten.bitwise_not.default: _bitwise_not,
    aten.bitwise_and.Tensor: _bool_op(P.logical_and), aten.bitwise_and.Scalar: _bool_op(P.logical_and),
    aten.bitwise_or.Tensor: _bool_op(P.logical_or), aten.bitwise_or.Scalar: _bool_op(P.logical_or),
    aten.bitwise_xor.Tensor: _bool_op(P.logical_xor), aten.bitwise_xor.Scalar: _bool_op(P.logical_xor),
    # reductions
    aten.sum.dim_IntList: _sum, aten.sum.default: _sum,
    aten.mean.dim: _mean, aten.mean.default: _mean,
    aten.amax.default: _amax, aten.amin.default: _amin,
    aten.max.default: lambda ctx, x: _amax(ctx, x), aten.min.default: lambda ctx, x: _amin(ctx, x),
    aten.max.dim: _max_dim, aten.min.dim: _min_dim,
    aten.argmax.default: _argmax, aten.argmin.default: _argmin,
    aten.any.default: _any, aten.any.dim: _any, aten.any.dims: _any,
    aten.all.default: _all, aten.all.dim: _all, aten.all.dims: _all,
    aten.var.correction: _var, aten.var_mean.correction: _var_mean,
    aten.linalg_vector_norm.default: _vector_norm,
    aten.prod.default: _prod, aten.prod.dim_int: _prod,
    aten._softmax.default: _softmax, aten._log_softmax.default: _log_softmax,
    aten.histc.default: _histc, aten.cumsum.default: _cumsum, aten.cumprod.default: _cumprod,
    aten.logcumsumexp.default: _logcumsumexp,
    aten.cummax.default: _running_extreme(True), aten.cummin.default: _running_extreme(False),
    aten.sort.default: _sort, aten.sort.stable: _sort_stable, aten.topk.default: _topk,
    aten.kthvalue.default: _kthvalue, aten.median.dim: _median_dim, aten.median.default: _median,
    aten.nanmedian.dim: _nanmedian_dim,
    aten.nanmedian.default: lambda ctx, x: _nanmedian_dim(ctx, P.reshape(x, (prod(x.shape),)), 0)[0],
    aten.diagonal.default: _diagonal, aten._cdist_forward.default: _cdist,
    aten.grid_sampler_2d.default: _grid_sampler_2d,
    aten.bucketize.Tensor: _bucketize, aten.searchsorted.Tensor: _searchsorted,
    aten.triu_indices.default: _triangle_indices(True), aten.tril_indices.default: _triangle_indices(False),
    aten.copysign.Tensor: _copysign,
    aten.ldexp.Tensor: lambda ctx, x, e: _out(ctx, P.mul(P.to_float(x), g.unary("exp2", P.to_float(e)))),
    aten.rrelu_with_noise_functional.default: _rrelu,
    # linear algebra, convolution, pooling, normalisation
    aten.mm.default: _mm, aten.bmm.default: _mm,
    aten.addmm.default: _addmm, aten.baddbmm.default: _addmm,
    aten.convolution.default: _convolution,
    aten.max_pool2d_with_indices.default: _max_pool, aten.max_pool3d_with_indices.default: _max_pool,
    aten.avg_pool2d.default: _avg_pool, aten.avg_pool3d.default: _avg_pool,
    aten._adaptive_avg_pool2d.default: _adaptive("sum"), aten._adaptive_avg_pool3d.default: _adaptive("sum"),
    aten.adaptive_max_pool2d.default: _adaptive("max_reduce"),
    aten.native_layer_norm.default: _layer_norm,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_eval,
    aten.native_batch_norm.default: _native_batch_norm,
    aten._native_batch_norm_legit.no_stats: _batch_norm_own_stats,
    aten.im2col.default: _im2col,
    aten.col2im.default: _col2im,
    aten.native_group_norm.default: _group_norm,
    # movement
    aten.view.default: _view, aten._unsafe_view.default: _view, aten.reshape.default: _view,
    aten.squeeze.dim: _view, aten.squeeze.dims: _view, aten.squeeze.default: _view,
    aten.unsqueeze.default: _unsqueeze,
    aten.permute.default: _permute,
    aten.transpose.int: _transpose, aten.t.default: _transpose,
    aten.expand.default: _expand,
    aten.as_strided.default: _as_strided,
    aten.slice.Tensor: _slice,
    aten.select.int: _select,
    aten.cat.default: _cat,
    aten.split_with_sizes.default: _split_sizes, aten.split.Tensor: _split,
    aten.unbind.int: _unbind,
    aten.flip.default: _flip,
    aten.repeat.default: _repeat,
    aten.constant_pad_nd.default: _constant_pad,
    aten.slice_scatter.default: _slice_scatter, aten.select_scatter.default: _select_scatter,
    aten.copy.default: lambda ctx, x, src, non_blocking=False: _out(ctx, src),
    aten.upsample_nearest2d.vec: _upsample_nearest, aten.upsample_bilinear2d.vec: _upsample_bilinear,
    aten.upsample_nearest2d.default: lambda ctx, x, size, sh=None, sw=None: _upsample_nearest(
        ctx, x, size, [sh, sw] if sh and sw else None),
    aten.triu.default: _tri(False), aten.tril.default: _tri(True),
    # indexing
    aten.index.Tensor: _index,
    aten.index_select.default: _index_select,
    aten.gather.default: _gather_dim,
    aten.index_put.default: _index_put,
    aten.scatter.src: _scatter(False), aten.scatter.value: _scatter(False),
    aten.scatter_add.default: _scatter(True), aten.scatter_reduce.two: _scatter_reduce,
    aten._embedding_bag.default: _embedding_bag,
    aten.embedding.default: _embedding,
    # creation, casts, no-ops
    aten.full.default: _full, aten.full_like.default: _full,
    aten.zeros.default: _fill(0), aten.ones.default: _fill(1),
    aten.zeros_like.default: _fill(0), aten.ones_like.default: _fill(1),
    aten.empty.memory_format: _fill(0), aten.empty_like.default: _fill(0),  # contents undefined: zeros
    aten.empty_permuted.default: _fill(0),
    aten.scalar_tensor.default: lambda ctx, value, **_: _out(ctx, value),
    aten.arange.default: _arange, aten.arange.start: _arange, aten.arange.start_step: _arange,
    aten._to_copy.default: _to_copy,
    aten.clone.default: _identity, aten.alias.default: _identity, aten.detach.default: _identity,
    aten.lift_fresh_copy.default: _identity, aten.contiguous.default: _identity,
    aten._assert_tensor_metadata.default: _nothing, aten._assert_scalar.default: _nothing,
    aten._assert_async.default: _nothing, aten._assert_async.msg: _nothing,
    aten.sym_constrain_range_for_size.default: _nothing,
    # Python-level nodes: tuple items and size arithmetic
    operator.getitem: lambda ctx, xs, k: xs[k],
    aten.sym_size.int: _sym_size,
    operator.add: _sym_binary(operator.add), operator.sub: _sym_binary(operator.sub),
    operator.mul: _sym_binary(operator.mul), operator.floordiv: _sym_binary(operator.floordiv),
    operator.mod: _sym_binary(operator.mod), operator.neg: lambda ctx, a: -a,
    operator.lt: _sym_compare(operator.lt, P.lt), operator.le: _sym_compare(operator.le, P.le),
    operator.gt: _sym_compare(operator.gt, P.gt), operator.ge: _sym_compare(operator.ge, P.ge),
    operator.eq: _sym_compare(operator.eq, P.eq), operator.ne: _sym_compare(operator.ne, P.ne),
}
