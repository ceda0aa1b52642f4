"""Types and scalar helpers of the CPU emitters: how each dtype is held in a register and in
memory, constants, casts, and the binary ops (from a table per kind of dtype)."""

from __future__ import annotations

import math
from collections.abc import Callable

import llvmlite.ir as ir
import numpy as np

from ...ir.dtypes import DType

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32, F16 = ir.FloatType(), ir.HalfType()
PTR = ir.PointerType()
# on a loop's running sum only (accumulate): lets the vectoriser keep a partial sum per lane.
# Nowhere else, and no "contract": two evaluations of one expression (a value recomputed in two
# kernels, or compared with itself through a transpose) must round alike.
REASSOC = ("reassoc", "nsz")

# the half types compute in float32 registers, as torch does on the CPU; float16 is stored as half
_REG = {DType.float32: F32, DType.bfloat16: F32, DType.float16: F32,
        DType.int32: I32, DType.int64: I64, DType.bool: I1}


def reg_type(dt: DType) -> ir.Type:
    return _REG[dt]


def mem_type(dt: DType) -> ir.Type:
    return {DType.bool: I8, DType.float16: F16}.get(dt) or _REG[dt]


def i64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def vector_ptr(b: ir.IRBuilder, base: ir.Value, index: ir.Value) -> ir.Value:
    """&base[index] as an untyped pointer, for vector loads from float storage."""
    return b.bitcast(b.gep(base, [index], source_etype=F32), PTR)


VECTOR_ALIGN = 64  # bytes: a cache line, and the widest vector


def float_array(b: ir.IRBuilder, size: int) -> ir.Value:
    """A stack array of size float32s that vectors are read from, starting on a cache line: the
    stack is only 16-byte aligned, and a 64-byte vector that straddles two lines costs two loads
    (a GEMM's panel copied there ran 7-12% slower, at whatever offset the caller's stack left it;
    one process, AVX-512 Xeon, four convolution-shaped products)."""
    array = b.alloca(F32, size=size)
    array.align = VECTOR_ALIGN
    return array


def smin(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """The smaller of two signed integers (a row's or a block's length, clamped to what is left)."""
    return b.select(b.icmp_signed("<", x, y), x, y)


def splat(b: ir.IRBuilder, x: ir.Value, lanes: int) -> ir.Value:
    """A vector of `lanes` copies of the scalar x."""
    undef = ir.Constant(ir.VectorType(x.type, lanes), ir.Undefined)
    return b.shuffle_vector(b.insert_element(undef, x, i64(0)), undef,
                            ir.Constant(ir.VectorType(I32, lanes), [0] * lanes))


def store_through(b: ir.IRBuilder, v: ir.Value, ptr: ir.Value) -> None:
    """A store through a pointer llvmlite types as float* (the IR's pointers are opaque)."""
    st = ir.instructions.StoreInstr(b.block, v, ptr)
    st.align = 4
    b._insert(st)


def _suffix(ty: ir.Type) -> str:
    return f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else ("f16" if ty == F16 else "f32")


def intrinsic(mod: ir.Module, base: str, ty: ir.Type, arity: int = 1) -> ir.Function:
    """The LLVM intrinsic base (e.g. "llvm.fma") on type ty, declared in mod once."""
    name = f"{base}.{_suffix(ty)}"
    fn = mod.globals.get(name)
    if fn is None:
        fn = ir.Function(mod, ir.FunctionType(ty, [ty] * arity), name)
    return fn


def constant(value, dt: DType) -> ir.Constant:
    if dt is DType.bool:
        return ir.Constant(I1, int(bool(value)))
    if dt.is_float:
        return ir.Constant(reg_type(dt), float(value))
    return ir.Constant(reg_type(dt), int(value))


def zero(dt: DType) -> ir.Constant:
    return constant(0, dt)


def identity(op: str, dt: DType) -> ir.Constant:
    """The value a reduction (sum or max_reduce) starts from."""
    if op == "sum":
        return zero(dt)
    if dt.is_float:
        return constant(-math.inf, dt)
    if dt is DType.bool:
        return constant(False, dt)
    return constant(int(np.iinfo(dt.np).min), dt)


# --- binary ops: one table per kind of dtype ---------------------------------------------------

Binary = Callable[[ir.IRBuilder, ir.Value, ir.Value], ir.Value]


def _int_mod(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    """C remainder; 0 where the divisor is 0, as the interpreter. x % 1 is that 0, and the x % -1
    it stands for: srem traps (SIGFPE) on 0 and on INT_MIN % -1; y in {-1, 0} is y + 1 <= 1 unsigned."""
    trap = b.icmp_unsigned("<=", b.add(y, ir.Constant(y.type, 1)), ir.Constant(y.type, 1))
    return b.srem(x, b.select(trap, ir.Constant(y.type, 1), y))


FLOAT_BINARY: dict[str, Binary] = {
    "add": lambda b, x, y: b.fadd(x, y),
    "mul": lambda b, x, y: b.fmul(x, y),
    "div": lambda b, x, y: b.fdiv(x, y),
    "mod": lambda b, x, y: b.frem(x, y),
    # NaN-propagating, like numpy; the intrinsic keeps reductions vectorisable
    "max": lambda b, x, y: b.call(intrinsic(b.module, "llvm.maximum", x.type, 2), [x, y]),
}
INT_BINARY: dict[str, Binary] = {
    "add": lambda b, x, y: b.add(x, y),
    "mul": lambda b, x, y: b.mul(x, y),
    "max": lambda b, x, y: b.select(b.icmp_signed(">", x, y), x, y),
    "mod": _int_mod,
}
BOOL_BINARY: dict[str, Binary] = {  # bool arithmetic as torch's: add is or, mul is and
    "add": lambda b, x, y: b.or_(x, y),
    "mul": lambda b, x, y: b.and_(x, y),
    "max": lambda b, x, y: b.or_(x, y),
    "mod": lambda b, x, y: ir.Constant(I1, 0),
}


def binary(b: ir.IRBuilder, op: str, args: list[ir.Value], dt: DType) -> ir.Value:
    table = BOOL_BINARY if dt is DType.bool else FLOAT_BINARY if dt.is_float else INT_BINARY
    emit = table.get(op)
    if emit is None:
        raise NotImplementedError(f"binary op {op} on {dt.short}")
    x, y = args
    return emit(b, x, y)


def accumulate(b: ir.IRBuilder, op: str, acc: ir.Value, x: ir.Value, dt: DType,
               loop: bool = True) -> ir.Value:
    """acc op x as a running reduction; in a loop, reassociable where it is a float sum."""
    v = binary(b, op, [acc, x], dt)
    if loop and dt.is_float and op == "add":
        v.flags.extend(REASSOC)
    return v


# --- casts -------------------------------------------------------------------------------------

def cast_int(b: ir.IRBuilder, v: ir.Value, dt: DType) -> ir.Value:
    """An i64 index value as dtype dt."""
    if dt.is_float:
        return b.sitofp(v, reg_type(dt))
    t = reg_type(dt)
    return v if t == I64 else b.trunc(v, t)


def cast(b: ir.IRBuilder, v: ir.Value, src: DType, dst: DType) -> ir.Value:
    if src is dst or (reg_type(src) == reg_type(dst) and dst not in (DType.bfloat16, DType.float16)):
        return v
    if dst is DType.bool:
        return b.fcmp_unordered("!=", v, ir.Constant(v.type, 0.0)) if src.is_float else \
            b.icmp_signed("!=", v, ir.Constant(v.type, 0))
    t = reg_type(dst)
    if src is DType.bool:
        out = b.uitofp(v, t) if dst.is_float else b.zext(v, t)
    elif src.is_float and dst.is_float:
        out = v if v.type == t else (b.fpext(v, t) if t == F32 else b.fptrunc(v, t))
    elif src.is_float:
        out = b.fptosi(v, t)
    elif dst.is_float:
        out = b.sitofp(v, t)
    else:
        out = b.sext(v, t) if t.width > v.type.width else b.trunc(v, t)
    if dst is DType.float16:  # rounded to half, kept in a float
        out = b.fpext(b.fptrunc(out, F16), F32)
    if dst is DType.bfloat16:  # round to nearest even on the upper 16 bits, kept in a float
        bits = b.bitcast(out, I32)
        lsb = b.and_(b.lshr(bits, ir.Constant(I32, 16)), ir.Constant(I32, 1))
        r = b.and_(b.add(b.add(bits, ir.Constant(I32, 0x7FFF)), lsb), ir.Constant(I32, 0xFFFF0000 - 2**32))
        out = b.bitcast(r, F32)
    return out
