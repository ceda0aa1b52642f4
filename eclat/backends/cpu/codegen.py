"""Kernel IR -> one LLVM module: a function per kernel and one entry point.

    void eclat_run(ptr slots)   slots[j] = pointer to buffer `slot_names[j]`, the arena last

The entry calls every kernel in order with its buffers (temporaries are offsets into
the arena chosen by the memory planner), so a model call is one native call.

A kernel function is `void k(ptr args, i64 lo, i64 hi)`: it runs the slice [lo, hi)
of its outermost loop, which is how the thread pool splits it. Generic kernels are
loop nests with reductions hoisted to the loop level where their inputs are known;
LLVM's loop and SLP vectorisers widen the inner loops. Contractions get an explicit
register-blocked micro-kernel (MR x NR accumulators in vector registers, fma), with
constant right-hand operands packed into NR-wide panels at compile time.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import llvmlite.ir as ir
import numpy as np

from ...compiler.group import ravel, terms
from ...compiler.kernel import (
    Buffer,
    Const,
    Contraction,
    Gather,
    Index,
    Kernel,
    KExpr,
    Load,
    Op,
    Program,
    Reduce,
    as_contraction,
    assume_in,
    axis_vars,
    bytes_moved,
    flops,
    free_vars,
    loads,
    reduces,
    rewrite,
)
from ...compiler.memplan import MemoryPlan
from ...ir.dtypes import DType
from ...ir.symbolic import (
    BinOp,
    Expr,
    Num,
    Var,
    conjuncts,
    evaluate,
    is_range,
    logical_and,
    ranges,
    rename,
    variables,
)
from ...ir.view import contiguous_strides
from .mathlib import math_function

I1, I8, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(32), ir.IntType(64)
F32, F16 = ir.FloatType(), ir.HalfType()
PTR = ir.PointerType()
FAST = ("reassoc", "nsz", "contract")
KERNEL_TYPE = ir.FunctionType(ir.VoidType(), [PTR, I64, I64])
# below both, handing a kernel to the pool costs more than it saves; a copy above the bytes
# threshold is split too, so that each core reads what it wrote (the neighbour's L2 is far)
PARALLEL_MIN_FLOPS = 200_000
PARALLEL_MIN_BYTES = 256 * 1024
VECTOR = 8  # float32 lanes of an AVX2 register
INTERLEAVE = 4  # vectors in flight in vectorised inner loops
PACKED = "pack:"  # name prefix of weights packed at compile time
RUNTIME_PACK_BYTES = 1 << 20  # largest K x NR panel of a non-constant operand copied per kernel call
UNROLL_REDUCE = 4  # reductions this short are emitted unrolled
COMBINE = {"sum": "add", "max_reduce": "max"}  # the binary op that folds each reduction
PREFETCH_BYTES = 640  # how far ahead a matrix-vector kernel reads its weight stream (measured: 512-768 best)

_REG = {DType.float32: F32, DType.bfloat16: F32, DType.float16: F16,
        DType.int32: I32, DType.int64: I64, DType.bool: I1}


def reg_type(dt: DType) -> ir.Type:
    return _REG[dt]


def mem_type(dt: DType) -> ir.Type:
    return I8 if dt is DType.bool else _REG[dt]


def _i64(v: int) -> ir.Constant:
    return ir.Constant(I64, v)


def _fast(v: ir.Instruction) -> ir.Instruction:
    v.flags.extend(FAST)
    return v


@dataclass
class Module:
    """What codegen hands the JIT and the runtime."""

    ir: ir.Module
    slot_names: list[str]  # buffers passed to eclat_run, in order (arena last, as "<arena>")
    packed: dict[str, np.ndarray]  # constant buffers made at compile time (packed weights)
    parallel: list[str]  # kernels split across threads
    used: set[str]  # buffers some kernel reads or writes (a weight read only packed is not)


def slots_of(buffers: dict[str, Buffer]) -> list[str]:
    """The buffers passed to eclat_run, in order: every one but the temporaries, the arena last."""
    return [n for n, b in buffers.items() if b.role != "temp"] + ["<arena>"]


def build_module(program: Program, plan: MemoryPlan, threads: int = 1) -> Module:
    """Emit program. Packed weights join program.buffers (role weight, names starting with
    PACKED); a rebuild drops the previous build's. Kernels equal up to buffer names share
    one function (the layers of a model differ only in their weights)."""
    for name in [n for n in program.buffers if n.startswith(PACKED)]:
        del program.buffers[name]
    mod = ir.Module(name="eclat")
    packed: dict[str, np.ndarray] = {}
    calls: list[tuple[str, list[str], int]] = []
    used: set[str] = set()
    parallel: list[str] = []
    functions: dict[str, tuple[str, int]] = {}
    for k in program.kernels:
        em = _KernelEmitter(mod, k, program.buffers, packed)
        key = em.key()
        if key not in functions:
            functions[key] = (k.name, em.function())
        fn_name, outer = functions[key]
        calls.append((fn_name, em.arg_names, outer))
        used |= em.used
        big = flops(k) >= PARALLEL_MIN_FLOPS or bytes_moved(k, program.buffers) >= PARALLEL_MIN_BYTES
        if k.schedule.threads > 1 and threads > 1 and outer > 1 and big:
            parallel.append(k.name)
    slot_names = slots_of(program.buffers)
    _entry(mod, program, plan, slot_names, calls, set(parallel), threads)
    return Module(mod, slot_names, packed, parallel, used)


def _entry(mod: ir.Module, program: Program, plan: MemoryPlan, slot_names: list[str],
           calls: list[tuple[str, list[str], int]], parallel: set[str], threads: int) -> None:
    """eclat_run calls every kernel in order; eclat_kernel_<j> calls kernel j alone (profiling)."""
    steps = [(k, fn, names, n) for k, (fn, names, n) in zip(program.kernels, calls)]
    _caller(mod, "eclat_run", steps, plan, slot_names, parallel, threads)
    for j, step in enumerate(steps):
        _caller(mod, f"eclat_kernel_{j}", [step], plan, slot_names, parallel, threads)


def _caller(mod: ir.Module, name: str, steps: list[tuple[Kernel, str, list[str], int]], plan: MemoryPlan,
            slot_names: list[str], parallel: set[str], threads: int) -> None:
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [PTR]), name)
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    slot = {name: j for j, name in enumerate(slot_names)}
    pool = mod.globals.get("eclat_parallel")
    if parallel and pool is None:
        pool = ir.Function(mod, ir.FunctionType(ir.VoidType(), [PTR, PTR, I64, I32]), "eclat_parallel")
    ptrs: dict[str, ir.Value] = {}

    def pointer(name: str) -> ir.Value:
        if name not in ptrs:
            if name in slot:
                ptrs[name] = b.load(b.gep(fn.args[0], [_i64(slot[name])], source_etype=PTR), typ=PTR)
            else:
                arena = pointer("<arena>")
                ptrs[name] = b.gep(arena, [_i64(plan.offsets[name])], source_etype=I8)
        return ptrs[name]

    for k, fn_name, names, n in steps:
        if n == 0:
            continue
        args = b.alloca(PTR, size=max(len(names), 1))
        for j, name in enumerate(names):
            b.store(pointer(name), b.gep(args, [_i64(j)], source_etype=PTR))
        kfn = mod.globals[fn_name]
        if k.name in parallel:
            b.call(pool, [kfn, args, _i64(n), ir.Constant(I32, min(threads, k.schedule.threads))])
        else:
            b.call(kfn, [args, _i64(0), _i64(n)])
    b.ret_void()


class _KernelEmitter:
    """Emits one kernel as `void name(ptr args, i64 lo, i64 hi)`."""

    def __init__(self, mod: ir.Module, kernel: Kernel, buffers: dict[str, Buffer],
                 packed: dict[str, np.ndarray]):
        self.mod, self.k, self.buffers, self.packed = mod, kernel, buffers, packed
        self.contraction = as_contraction(kernel) if kernel.body.dtype is DType.float32 else None
        # arguments in order of first use, so that kernels equal up to names look equal
        names = list(dict.fromkeys([x.buffer for x in loads(kernel.body)] + [kernel.out] +
                                   [sd.out for sd in kernel.sides]))
        self.pack_name: str | None = None
        self.used = set(names)  # what the code dereferences: not a weight it reads packed
        if self.contraction is not None:
            self.pack_name = self._pack()
            if self.pack_name:
                names.append(self.pack_name)
                self.used = {x.buffer for x in loads(kernel.body) if x != self.contraction.b}
                self.used |= {kernel.out, self.pack_name}
        self.arg_names = names

    def key(self) -> str:
        """The kernel's code with its buffers named by argument position."""
        canon = {n: f"arg{j}:{self.buffers[n].numel}" for j, n in enumerate(self.arg_names)}
        text = str(self.k.body) + "".join(f"|sum:{sd.body}" for sd in self.k.sides)
        body = re.sub(r"buffer='([^']*)'", lambda m: f"buffer={canon[m.group(1)]}", text)
        rvars: dict[str, str] = {}  # reduce variables are named after graph positions
        body = re.sub(r"\br\d+\b", lambda m: rvars.setdefault(m.group(0), f"r#{len(rvars)}"), body)
        return f"{self.k.shape}|{self.k.schedule}|{canon[self.k.out]}|{self.pack_name is not None}|{body}"

    def function(self) -> int:
        """Emit the function; returns the length of its outermost (parallel) loop."""
        self.fn = ir.Function(self.mod, KERNEL_TYPE, self.k.name)
        self.fn.linkage = "internal"
        self.fn.attributes.add("noinline")  # shared by layers and the profiling entries: compile once
        self.b = ir.IRBuilder(self.fn.append_basic_block("entry"))
        self.layers: list[tuple[dict[str, ir.Value], dict]] = [({}, {})]
        self.ptr = {n: self.b.load(self.b.gep(self.fn.args[0], [_i64(j)], source_etype=PTR), typ=PTR)
                    for j, n in enumerate(self.arg_names)}
        self.fv_memo: dict = {}
        self._nested = False
        self.inner_loops = self.contraction is None  # the micro-kernel is interleaved by hand
        outer = self._contraction() if self.contraction is not None else self._generic()
        self.b.ret_void()
        return outer

    # --- scopes ---------------------------------------------------------------------------
    def push(self) -> None:
        self.layers.append(({}, {}))

    def pop(self) -> None:
        self.layers.pop()

    def bind(self, name: str, v: ir.Value) -> None:
        self.layers[-1][0][name] = v

    def var(self, name: str) -> ir.Value:
        for vars_, _ in reversed(self.layers):
            if name in vars_:
                return vars_[name]
        raise KeyError(f"index variable {name} is not bound in kernel {self.k.name}")

    def bound(self) -> set[str]:
        return set().union(*(v.keys() for v, _ in self.layers))

    def cached(self, key) -> ir.Value | None:
        for _, memo in reversed(self.layers):
            if key in memo:
                return memo[key]
        return None

    def remember(self, key, v: ir.Value) -> ir.Value:
        self.layers[-1][1][key] = v
        return v

    # --- loops ------------------------------------------------------------------------------
    def loop(self, start: ir.Value, stop: ir.Value, inits: Sequence[ir.Value],
             body: Callable[[ir.Value, list[ir.Value]], list[ir.Value]]) -> list[ir.Value]:
        """for i in [start, stop): accs = body(i, accs); returns the final accs."""
        b = self.b
        pre = b.block
        header = self.fn.append_basic_block("loop")
        exit_ = self.fn.append_basic_block("after")
        b.cbranch(b.icmp_signed("<", start, stop), header, exit_)
        b.position_at_end(header)
        i = b.phi(I64)
        i.add_incoming(start, pre)
        phis = []
        for v in inits:
            p = b.phi(v.type)
            p.add_incoming(v, pre)
            phis.append(p)
        self.push()
        self._nested = False
        new = body(i, list(phis))
        self.pop()
        latch = b.block
        nxt = b.add(i, _i64(1))
        nxt.flags.append("nsw")
        br = b.cbranch(b.icmp_signed("<", nxt, stop), header, exit_)
        if self.inner_loops and not self._nested:
            trip = stop.constant - start.constant if isinstance(start, ir.Constant) and \
                isinstance(stop, ir.Constant) else None
            br.set_metadata("llvm.loop", _loop_hint(self.mod, self.k.schedule.unroll, trip))
        self._nested = True
        i.add_incoming(nxt, latch)
        for p, v in zip(phis, new):
            p.add_incoming(v, latch)
        b.position_at_end(exit_)
        out = []
        for init, v in zip(inits, new):
            p = b.phi(v.type)
            p.add_incoming(init, pre)
            p.add_incoming(v, latch)
            out.append(p)
        return out

    def hoist(self, candidates: list[Reduce]) -> None:
        """Evaluate every candidate reduce whose variables are all bound now."""
        bound = self.bound()
        for r in candidates:
            if free_vars(r, self.fv_memo) <= bound and self.cached(r) is None:
                self.remember(r, self.reduce(r))

    # --- generic kernels ---------------------------------------------------------------------
    def _generic(self) -> int:
        k = self.k
        cands = reduces(k.body)
        shape = k.shape
        vars_ = axis_vars(shape)
        if 0 in shape:
            return 0
        # leading unit axes are constants, so the first real axis is the one threads split
        lead = next((d for d, n in enumerate(shape) if n > 1), max(len(shape) - 1, 0))
        for d in range(lead):
            self.bind(vars_[d].name, _i64(0))
        self.hoist(cands)
        if not shape:
            self.store(k.out, Num(0), self.emit(k.body), k.body.dtype)
            return 1

        pad = self._pad_split() if len(shape) - 1 > lead else None

        def level(d: int, i: ir.Value, _accs: list) -> list:
            self.bind(vars_[d].name, i)
            self.hoist(cands)
            if d + 2 == len(shape) and pad is not None:
                self._padded_row(vars_, *pad)
            elif d + 2 == len(shape) and k.sides:
                self._row_with_sides(vars_, cands)
            elif d + 1 < len(shape):
                self.loop(_i64(0), _i64(shape[d + 1]), [], lambda i2, a: level(d + 1, i2, a))
            else:
                self.store(k.out, ravel(vars_, shape), self.emit(k.body), k.body.dtype)
            return []

        self.loop(self.fn.args[1], self.fn.args[2], [], lambda i, a: level(lead, i, a))
        return shape[lead]

    def _row_with_sides(self, vars_: list[Var], cands: list[Reduce]) -> None:
        """The last axis: each value stored, and each side sum accumulated from it."""
        k = self.k
        where = ravel(vars_, k.shape)
        own = Load(k.out, where, Num(1), k.body.dtype)

        def element(i: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            self.bind(vars_[-1].name, i)
            self.hoist(cands)
            v = self.emit(k.body)
            self.store(k.out, where, v, k.body.dtype)
            self.remember(own, v)
            return [binary(self.b, "add", [acc, self.emit(sd.body)], DType.float32)
                    for acc, sd in zip(accs, k.sides)]

        sums = self.loop(_i64(0), _i64(k.shape[-1]), [zero(DType.float32)] * len(k.sides), element)
        row = ravel(vars_[:-1], k.shape[:-1])
        for sd, value in zip(k.sides, sums):
            self.store(sd.out, row, value, DType.float32)

    def _pad_split(self) -> tuple[Expr, int, int, KExpr] | None:
        """For a padding kernel, where(mask, x, 0) at the top with the innermost axis bounded
        by the mask: (the mask's other terms, the interior lo..hi, x simplified under the mask).
        Rows are then written as zeros | x unmasked | zeros, which vectorise; a per-element
        mask and clamped reads do not."""
        body, last = self.k.body, f"i{len(self.k.shape) - 1}"
        if not (isinstance(body, Op) and body.op == "where" and isinstance(body.srcs[0], Index)
                and isinstance(body.srcs[2], Const) and body.srcs[2].value == 0):
            return None
        cond = body.srcs[0].expr
        terms_ = conjuncts(cond)
        inner = [t for t in terms_ if last in variables(t)]
        if not inner or not all(is_range(t) for t in inner):
            return None
        lo, hi = ranges(cond)[last]
        outer: Expr = Num(1)
        for t in terms_:
            if t not in inner:
                outer = logical_and(outer, t)
        return outer, lo, hi, assume_in(body.srcs[1], cond)

    def _padded_row(self, vars_: list[Var], outer: Expr, lo: int, hi: int, x: KExpr) -> None:
        k, b = self.k, self.b
        n, dt = k.shape[-1], k.body.dtype
        where = ravel(vars_, k.shape)

        def zeros(start: int, stop: int) -> None:
            def body(i: ir.Value, _a: list) -> list:
                self.bind(vars_[-1].name, i)
                self.store(k.out, where, zero(dt), dt)
                return []
            self.loop(_i64(start), _i64(stop), [], body)

        def interior(i: ir.Value, _a: list) -> list:
            self.bind(vars_[-1].name, i)
            self.hoist(self.x_reduces)
            self.store(k.out, where, self.emit(x), dt)
            return []

        self.x_reduces = reduces(x)
        with b.if_else(b.icmp_signed("!=", self.sym(outer), _i64(0))) as (then, otherwise):
            with then:
                zeros(0, max(lo, 0))
                self.hoist(self.x_reduces)
                self.loop(_i64(max(lo, 0)), _i64(min(hi + 1, n)), [], interior)
                zeros(min(hi + 1, n), n)
            with otherwise:
                zeros(0, n)

    def store(self, buf: str, index: Expr, v: ir.Value, dt: DType) -> None:
        if dt is DType.bool:
            v = self.b.zext(v, I8)
        at = self.b.gep(self.ptr[buf], [self.sym(index)], inbounds=True, source_etype=mem_type(dt))
        self.b.store(v, at)

    # --- index arithmetic --------------------------------------------------------------------
    def sym(self, e: Expr) -> ir.Value:
        if isinstance(e, int):
            return _i64(e)
        if isinstance(e, Num):
            return _i64(e.v)
        if isinstance(e, Var):
            return self.var(e.name)
        key = ("sym", e)
        hit = self.cached(key)
        if hit is not None:
            return hit
        assert isinstance(e, BinOp)
        a, c = self.sym(e.a), self.sym(e.b)
        b = self.b
        if e.op == "+":
            v = b.add(a, c)
            v.flags.append("nsw")
        elif e.op == "*":
            v = b.mul(a, c)
            v.flags.append("nsw")
        elif e.op == "//":
            v = b.sdiv(a, c)
        elif e.op == "%":
            v = b.srem(a, c)
        elif e.op == "<":
            v = b.zext(b.icmp_signed("<", a, c), I64)
        else:  # and
            v = b.zext(b.and_(b.icmp_signed("!=", a, _i64(0)), b.icmp_signed("!=", c, _i64(0))), I64)
        return self.remember(key, v)

    # --- values ------------------------------------------------------------------------------
    def emit(self, e: KExpr) -> ir.Value:
        hit = self.cached(e)
        if hit is not None:
            return hit
        b = self.b
        if isinstance(e, Const):
            return constant(e.value, e.dtype)
        if isinstance(e, Index):
            v = self.sym(e.expr)
            out = b.icmp_signed("!=", v, _i64(0)) if e.dtype is DType.bool else cast_int(b, v, e.dtype)
        elif isinstance(e, Load):
            out = self.load(e.buffer, e.index, e.valid, e.dtype)
        elif isinstance(e, Gather):
            idx = self.emit(e.idx)
            idx = b.sext(idx, I64) if idx.type != I64 else idx
            idx = b.select(b.icmp_signed("<", idx, _i64(0)), _i64(0), idx)
            idx = b.select(b.icmp_signed(">", idx, _i64(e.rows - 1)), _i64(e.rows - 1), idx)
            flat = b.add(b.mul(idx, _i64(e.row_size)), self.sym(e.inner))
            out = self.load_at(e.buffer, flat, e.dtype)
        elif isinstance(e, Op):
            out = self.op(e)
        elif isinstance(e, Reduce):
            out = self.reduce(e)
        else:  # pragma: no cover
            raise TypeError(f"not a kernel expression: {e!r}")
        return self.remember(e, out)

    def load(self, buf: str, index: Expr, valid: Expr, dt: DType) -> ir.Value:
        if self.buffers[buf].numel == 0 or valid == Num(0):
            return zero(dt)
        if valid == Num(1):
            return self.load_at(buf, self.sym(index), dt)
        b = self.b
        ok = b.icmp_signed("!=", self.sym(valid), _i64(0))
        v = self.load_at(buf, b.select(ok, self.sym(index), _i64(0)), dt)
        return b.select(ok, v, zero(dt))

    def load_at(self, buf: str, flat: ir.Value, dt: DType) -> ir.Value:
        v = self.b.load(self.b.gep(self.ptr[buf], [flat], inbounds=True, source_etype=mem_type(dt)),
                        typ=mem_type(dt))
        return self.b.trunc(v, I1) if dt is DType.bool else v

    def op(self, e: Op) -> ir.Value:
        b = self.b
        if e.op == "cast":
            return cast(b, self.emit(e.srcs[0]), e.srcs[0].dtype, e.dtype)
        if e.op == "max" and e.dtype.is_float:
            clamp = _negated_max(e)
            if clamp is not None:  # max(-a, c) = -minimum(a, -c), exactly: one vminps, no sign flips
                a, c = clamp
                return b.fneg(b.call(_intrinsic(self.mod, "llvm.minimum", reg_type(e.dtype), 2),
                                     [self.emit(a), ir.Constant(reg_type(e.dtype), -c)]))
        args = [self.emit(s) for s in e.srcs]
        dt = e.srcs[0].dtype if e.op == "where" else e.dtype
        if e.op == "where":
            return b.select(args[0], args[1], args[2])
        if e.op == "lt":
            src = e.srcs[0].dtype
            if src.is_float:
                return b.fcmp_ordered("<", *args)
            return (b.icmp_unsigned if src is DType.bool else b.icmp_signed)("<", *args)
        if e.op in ("exp2", "log2", "sin"):
            x = args[0]
            fn = math_function(self.mod, "exp2_nonpositive" if e.op == "exp2" and
                               _below_own_max(e.srcs[0], axis_vars(self.k.shape))
                               else e.op)
            if x.type != F32:
                return b.fptrunc(b.call(fn, [b.fpext(x, F32)]), x.type)
            return b.call(fn, [x])
        if e.op == "sqrt":
            return b.call(_intrinsic(self.mod, "llvm.sqrt", args[0].type), args)
        if e.op == "neg":
            x = args[0]
            return b.fneg(x) if e.dtype.is_float else b.sub(ir.Constant(x.type, 0), x)
        if e.op == "recip":
            return b.fdiv(ir.Constant(args[0].type, 1.0), args[0])
        if e.op == "fma":
            if not e.dtype.is_float:
                return binary(b, "add", [binary(b, "mul", args[:2], e.dtype), args[2]], e.dtype)
            return b.call(_intrinsic(self.mod, "llvm.fmuladd", args[0].type, 3), args)
        return binary(b, e.op, args, dt)

    def _term(self, r: Reduce, cands: list[Reduce], i: ir.Value) -> ir.Value:
        """r's body at r.var = i, its own inner reduces hoisted where they can be."""
        self.bind(r.var.name, i)
        self.hoist(cands)
        return self.emit(r.body)

    def reduce(self, r: Reduce) -> ir.Value:
        cands = reduces(r.body)
        op = COMBINE[r.op]
        if r.size <= UNROLL_REDUCE:  # a pooling window: straight-line code keeps the outer loop vectorisable
            acc = identity(r.op, r.dtype)
            for j in range(r.size):
                self.push()
                acc = binary(self.b, op, [acc, self._term(r, cands, _i64(j))], r.dtype)
                self.pop()
            return acc
        if r.op == "max_reduce" and r.dtype.is_float:
            return self._float_max(r, cands)
        return self.loop(_i64(0), _i64(r.size), [identity(r.op, r.dtype)],
                         lambda i, accs: [binary(self.b, op, [accs[0], self._term(r, cands, i)], r.dtype)])[0]

    def _float_max(self, r: Reduce, cands: list[Reduce]) -> ir.Value:
        """A NaN-propagating max as a plain maxnum (declared NaN-free and sign-of-zero-free: one
        vmaxps; max(-0, +0) may give either) beside a running sum, which is NaN if a term is
        NaN (or infinities of both signs meet). Only then does a second pass look for a NaN: one
        vaddps per vector instead of the four that an `or` of NaN tests legalises to."""
        b = self.b
        maxnum = _intrinsic(self.mod, "llvm.maxnum", reg_type(r.dtype), 2)

        def body(i: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            x = self._term(r, cands, i)
            return [b.call(maxnum, [accs[0], x], fastmath=("nnan", "nsz")),
                    binary(b, "add", [accs[1], x], r.dtype)]

        best, total = self.loop(_i64(0), _i64(r.size), [identity(r.op, r.dtype), zero(r.dtype)], body)
        pre = b.block
        with b.if_then(b.fcmp_unordered("uno", total, total), likely=False):
            nan_seen = self.loop(_i64(0), _i64(r.size), [ir.Constant(I1, 0)], lambda i, accs: [
                b.or_(accs[0], b.fcmp_unordered("uno", *[self._term(r, cands, i)] * 2))])[0]
            checked = b.block
        nan = b.phi(I1)
        nan.add_incoming(ir.Constant(I1, 0), pre)
        nan.add_incoming(nan_seen, checked)
        return b.select(nan, ir.Constant(best.type, math.nan), best)

    # --- contractions --------------------------------------------------------------------------
    def _pack(self) -> str | None:
        """Pack a constant right operand into [panels, K, NR] so that each step of the
        micro-kernel reads NR contiguous values. Returns the packed buffer's name."""
        c, k = self.contraction, self.k
        b = c.b
        if not (isinstance(b, Load) and b.valid == Num(1) and self.buffers[b.buffer].role == "weight"):
            return None
        n_var, k_var = f"i{c.n_axis}", c.reduce.var.name
        if not free_vars(b) <= {n_var, k_var}:
            return None
        nr = self.tile()[1]
        n, kk = k.shape[c.n_axis], c.reduce.size
        name = f"{PACKED}{b.buffer}_{nr}_{hashlib.sha256(str(b.index).encode()).hexdigest()[:12]}"
        if name not in self.packed:
            panels = -(-n // nr)
            cols = np.arange(panels * nr)
            idx = evaluate(b.index, {n_var: np.minimum(cols, n - 1)[None, :], k_var: np.arange(kk)[:, None]})
            data = np.asarray(self.buffers[b.buffer].data)[np.broadcast_to(idx, (kk, panels * nr))]
            data = np.where(cols[None, :] < n, data, 0).astype(np.float32)
            self.packed[name] = np.ascontiguousarray(
                data.reshape(kk, panels, nr).transpose(1, 0, 2)).reshape(-1)
            self.buffers[name] = Buffer(name, self.packed[name].size, DType.float32, "weight",
                                        self.packed[name])
        return name

    def tile(self) -> tuple[int, int]:
        """The schedule's register block, clamped to the rows and whole vectors."""
        c, k = self.contraction, self.k
        mr, nr = k.schedule.tile
        m_size = k.shape[c.m_axis] if c.m_axis is not None else 1
        return max(1, min(mr, m_size)), max(VECTOR, nr - nr % VECTOR)

    def _contraction(self) -> int:
        c: Contraction = self.contraction
        k = self.k
        shape = k.shape
        if 0 in shape:
            return 0
        mr, nr = self.tile()
        m_size = shape[c.m_axis] if c.m_axis is not None else 1
        n_size, kk = shape[c.n_axis], c.reduce.size
        panels, blocks = -(-n_size // nr), -(-m_size // mr)
        self.streaming = blocks == 1  # each packed weight is read once per call
        batch = [a for a in range(len(shape)) if a not in (c.m_axis, c.n_axis)]
        tile = self.b.alloca(F32, size=mr * nr)
        vt = ir.VectorType(F32, VECTOR)
        fma = _intrinsic(self.mod, "llvm.fma", vt, 3)
        b_unit = self._unit_stride(c.b, f"i{c.n_axis}")
        # a right operand that is not a constant: copy each K x NR panel into a dense scratch
        # once, and let every row block read it with vector loads
        self.scratch = None
        if self.pack_name is None and blocks > 1 and 0 < kk * nr * 4 <= RUNTIME_PACK_BYTES:
            self.scratch = self.b.alloca(F32, size=kk * nr)

        def micro(p: ir.Value, mb: ir.Value) -> None:
            bb = self.b
            n0 = bb.mul(p, _i64(nr))
            m0 = bb.mul(mb, _i64(mr))
            full = bb.icmp_signed("<=", bb.add(n0, _i64(nr)), _i64(n_size))

            def kstep(kv: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
                self.bind(c.reduce.var.name, kv)
                bvecs = self._b_vectors(c, p, n0, kv, nr, full, b_unit, vt)
                out = list(accs)
                for r in range(mr):
                    self.push()
                    if c.m_axis is not None:
                        row = bb.add(m0, _i64(r))
                        last = _i64(m_size - 1)
                        self.bind(f"i{c.m_axis}", bb.select(bb.icmp_signed(">", row, last), last, row))
                    av = self.emit(c.a)
                    self.pop()
                    splat = bb.shuffle_vector(bb.insert_element(ir.Constant(vt, ir.Undefined), av, _i64(0)),
                                              ir.Constant(vt, ir.Undefined),
                                              ir.Constant(ir.VectorType(I32, VECTOR), [0] * VECTOR))
                    for v in range(nr // VECTOR):
                        j = r * (nr // VECTOR) + v
                        out[j] = bb.call(fma, [splat, bvecs[v], accs[j]])
                return out

            zeros = [ir.Constant(vt, [0.0] * VECTOR)] * (mr * nr // VECTOR)
            accs = self.loop(_i64(0), _i64(kk), zeros, kstep) if kk else zeros
            for j, acc in enumerate(accs):
                _store(bb, acc, bb.gep(tile, [_i64(j * VECTOR)], source_etype=F32))
            self._epilogue(c, tile, m0, n0, mr, nr, m_size, n_size)

        # one outer loop over (panel, batch) pairs, panel-major: threads split it even when
        # there is a single panel (a convolution's GEMM over 16 output columns per image row)
        sizes = [shape[a] for a in batch]
        per_panel = math.prod(sizes)

        def step(j: ir.Value, _a: list) -> list:
            bb = self.b
            p = bb.sdiv(j, _i64(per_panel))
            rest = bb.srem(j, _i64(per_panel))
            for a, stride, size in zip(batch, contiguous_strides(sizes), sizes):
                self.bind(f"i{a}", bb.srem(bb.sdiv(rest, _i64(stride)), _i64(size)))
            if self.scratch is not None:
                self._pack_panel(c, bb.mul(p, _i64(nr)), nr, kk, n_size)
            self.loop(_i64(0), _i64(blocks), [], lambda mb, _c: micro(p, mb) or [])
            return []

        self.loop(self.fn.args[1], self.fn.args[2], [], step)
        return panels * per_panel

    def _pack_panel(self, c: Contraction, n0: ir.Value, nr: int, kk: int, n_size: int) -> None:
        """scratch[k * NR + col] = b at (n0 + col clamped, k), for the current batch."""
        def step(kv: ir.Value, _a: list) -> list:
            self.bind(c.reduce.var.name, kv)
            for col, val in enumerate(self._b_columns(c, n0, nr, n_size)):
                at = self.b.add(self.b.mul(kv, _i64(nr)), _i64(col))
                self.b.store(val, self.b.gep(self.scratch, [at], source_etype=F32))
            return []
        self.loop(_i64(0), _i64(kk), [], step)

    def _unit_stride(self, e: KExpr, n_var: str) -> bool:
        if not (isinstance(e, Load) and e.valid == Num(1)):
            return False
        coefs = [c for c, a in terms(e.index) if isinstance(a, Var) and a.name == n_var]
        return coefs == [1]

    def _b_vectors(self, c: Contraction, p: ir.Value, n0: ir.Value, kv: ir.Value, nr: int,
                   full: ir.Value, unit: bool, vt: ir.VectorType) -> list[ir.Value]:
        """The NR values of the right operand at step k, as NR/8 vectors."""
        bb = self.b
        nv = nr // VECTOR
        if self.scratch is not None:
            base = bb.mul(kv, _i64(nr))
            return [bb.load(_vector_ptr(bb, self.scratch, bb.add(base, _i64(v * VECTOR))), typ=vt, align=4)
                    for v in range(nv)]
        if self.pack_name:
            base = bb.mul(bb.add(bb.mul(p, _i64(c.reduce.size)), kv), _i64(nr))
            ptr = self.ptr[self.pack_name]
            if self.streaming:
                self._prefetch(ptr, base, nr)
            return [bb.load(bb.gep(ptr, [bb.add(base, _i64(v * VECTOR))], source_etype=F32), typ=vt, align=4)
                    for v in range(nv)]
        if not unit:
            return self._b_scalar(c, n0, nr, vt)
        # full panels: vector loads; the last partial panel: clamped scalar loads
        with bb.if_else(full) as (then, otherwise):
            with then:
                self.push()
                self.bind(f"i{c.n_axis}", n0)
                start = self.sym(c.b.index)
                ptr = self.ptr[c.b.buffer]
                fast = [bb.load(bb.gep(ptr, [bb.add(start, _i64(v * VECTOR))], source_etype=F32),
                                typ=vt, align=4) for v in range(nv)]
                self.pop()
                then_block = bb.block
            with otherwise:
                slow = self._b_scalar(c, n0, nr, vt)
                else_block = bb.block
        out = []
        for fv, sv in zip(fast, slow):
            phi = bb.phi(vt)
            phi.add_incoming(fv, then_block)
            phi.add_incoming(sv, else_block)
            out.append(phi)
        return out

    def _prefetch(self, ptr: ir.Value, base: ir.Value, nr: int) -> None:
        """Touch the packed stream PREFETCH_BYTES ahead: a kernel that reads each weight once
        (few rows) waits on DRAM, and the hardware prefetcher alone keeps too few lines in flight."""
        bb = self.b
        fn = self.mod.globals.get("llvm.prefetch.p0") or ir.Function(
            self.mod, ir.FunctionType(ir.VoidType(), [PTR, I32, I32, I32]), "llvm.prefetch.p0")
        for line in range(0, nr * 4, 64):
            at = bb.gep(ptr, [bb.add(base, _i64((PREFETCH_BYTES + line) // 4))], source_etype=F32)
            bb.call(fn, [at, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])

    def _b_columns(self, c: Contraction, n0: ir.Value, nr: int, n_size: int) -> list[ir.Value]:
        """The right operand at columns n0 .. n0+NR-1 (clamped to the last column)."""
        bb = self.b
        out = []
        for col in range(nr):
            self.push()
            n = bb.add(n0, _i64(col))
            last = _i64(n_size - 1)
            self.bind(f"i{c.n_axis}", bb.select(bb.icmp_signed(">", n, last), last, n))
            out.append(self.emit(c.b))
            self.pop()
        return out

    def _b_scalar(self, c: Contraction, n0: ir.Value, nr: int, vt: ir.VectorType) -> list:
        vecs = [ir.Constant(vt, ir.Undefined) for _ in range(nr // VECTOR)]
        for col, val in enumerate(self._b_columns(c, n0, nr, self.k.shape[c.n_axis])):
            vecs[col // VECTOR] = self.b.insert_element(vecs[col // VECTOR], val, _i64(col % VECTOR))
        return vecs

    def _epilogue(self, c: Contraction, tile: ir.Value, m0: ir.Value, n0: ir.Value, mr: int, nr: int,
                  m_size: int, n_size: int) -> None:
        bb = self.b
        rows = bb.sub(_i64(m_size), m0)
        rows = bb.select(bb.icmp_signed("<", rows, _i64(mr)), rows, _i64(mr))
        cols = bb.sub(_i64(n_size), n0)
        cols = bb.select(bb.icmp_signed("<", cols, _i64(nr)), cols, _i64(nr))
        vars_ = axis_vars(self.k.shape)

        def row(r: ir.Value, _a: list) -> list:
            if c.m_axis is not None:
                self.bind(f"i{c.m_axis}", bb.add(m0, r))

            def col(cc: ir.Value, _b: list) -> list:
                self.bind(f"i{c.n_axis}", bb.add(n0, cc))
                at = bb.add(bb.mul(r, _i64(nr)), cc)
                acc = bb.load(bb.gep(tile, [at], source_etype=F32), typ=F32)
                self.remember(c.reduce, acc)
                self.store(self.k.out, ravel(vars_, self.k.shape), self.emit(self.k.body), self.k.body.dtype)
                return []
            self.loop(_i64(0), cols, [], col)
            return []
        self.loop(_i64(0), rows, [], row)


# --- value facts ------------------------------------------------------------------------------

def _negated_max(e: Op) -> tuple[KExpr, float] | None:
    """(a, c) when e is max(-a, c) or max(c, -a) for a constant c: a min in disguise, as the IR
    writes minimum(x, c) (a clamp's upper bound) without a min op."""
    for neg, c in (e.srcs, e.srcs[::-1]):
        if isinstance(neg, Op) and neg.op == "neg" and isinstance(c, Const):
            return neg.srcs[0], float(c.value)
    return None


def _below_own_max(e: KExpr, axes: list[Var]) -> bool:
    """Whether e is (x - max_r x) or (x - max_r x) * c with c >= 0, x taken at an axis the
    reduction spans: never above 0, or NaN. The reduction's terms are x itself, emitted by the
    same code, so they round the same way (softmax over scores * scale + mask included)."""
    if isinstance(e, Op) and e.op == "mul":
        scale = [s for s in e.srcs if isinstance(s, Const)]
        if len(scale) != 1 or not scale[0].value >= 0:
            return False
        e = next(s for s in e.srcs if s is not scale[0])
    if not (isinstance(e, Op) and e.op == "add"):
        return False
    shift = [s for s in e.srcs if isinstance(s, Op) and s.op == "neg" and isinstance(s.srcs[0], Reduce)
             and s.srcs[0].op == "max_reduce"]
    if not shift:
        return False
    r, x = shift[0].srcs[0], next(s for s in e.srcs if s is not shift[0])
    return any(v.hi < r.size and rewrite(r.body, index=partial(rename, old=r.var.name, new=v)) == x
               for v in axes)


# --- scalar helpers ----------------------------------------------------------------------------

LOOP_HINT = "eclat.loop.hint"  # Jitted turns this into a distinct self-referencing loop id


def _loop_hint(mod: ir.Module, unroll: int, trip: int | None = None) -> ir.Value:
    """Loop metadata asking the vectoriser to interleave several vectors (hides fma latency),
    but no more than a known trip count fills, and to vectorise rows shorter than its own
    threshold (16) that still hold a whole vector: a pooled 8-wide row would run all scalar."""
    count = unroll if unroll > 1 else INTERLEAVE
    force = trip is not None and VECTOR <= trip < 16
    if trip is not None:
        count = max(1, min(count, trip // VECTOR))
    key = f"{LOOP_HINT}.{count}.{force}"
    if key not in mod.namedmetadata:
        opts = [mod.add_metadata([ir.MetaDataString(mod, "llvm.loop.interleave.count"),
                                  ir.Constant(I32, count)])]
        if force:
            opts.append(mod.add_metadata([ir.MetaDataString(mod, "llvm.loop.vectorize.enable"),
                                          ir.Constant(I1, 1)]))
        mod.add_named_metadata(key, mod.add_metadata([ir.MetaDataString(mod, LOOP_HINT), *opts]))
    return mod.get_named_metadata(key).operands[0]


def _vector_ptr(b: ir.IRBuilder, base: ir.Value, index: ir.Value) -> ir.Value:
    """&base[index] as an untyped pointer, for vector loads from float storage."""
    return b.bitcast(b.gep(base, [index], source_etype=F32), PTR)


def _store(b: ir.IRBuilder, v: ir.Value, ptr: ir.Value) -> None:
    """A store through a pointer llvmlite types as float* (the IR's pointers are opaque)."""
    st = ir.instructions.StoreInstr(b.block, v, ptr)
    st.align = 4
    b._insert(st)


def _suffix(ty: ir.Type) -> str:
    return f"v{ty.count}f32" if isinstance(ty, ir.VectorType) else ("f16" if ty == F16 else "f32")


def _intrinsic(mod: ir.Module, base: str, ty: ir.Type, arity: int = 1) -> ir.Function:
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
    if op == "sum":
        return zero(dt)
    if dt.is_float:
        return constant(-math.inf, dt)
    if dt is DType.bool:
        return constant(False, dt)
    return constant(int(np.iinfo(dt.np).min), dt)


def binary(b: ir.IRBuilder, op: str, args: list[ir.Value], dt: DType) -> ir.Value:
    x, y = args
    if dt is DType.bool:
        return {"add": b.or_, "mul": b.and_, "max": b.or_}.get(op, b.xor)(x, y) if op != "mod" else \
            ir.Constant(I1, 0)
    if dt.is_float:
        if op == "add":
            return _fast(b.fadd(x, y))
        if op == "mul":
            return _fast(b.fmul(x, y))
        if op == "mod":
            return b.frem(x, y)
        if op == "max":  # NaN-propagating, like numpy; the intrinsic keeps reductions vectorisable
            return b.call(_intrinsic(b.module, "llvm.maximum", x.type, 2), [x, y])
    else:
        if op == "add":
            return b.add(x, y)
        if op == "mul":
            return b.mul(x, y)
        if op == "max":
            return b.select(b.icmp_signed(">", x, y), x, y)
        if op == "mod":  # C remainder; 0 where the divisor is 0, as the interpreter
            # x % 1 is that 0, and the x % -1 it stands for: srem traps (SIGFPE) on 0 and on
            # INT_MIN % -1; y in {-1, 0} is y + 1 <= 1 unsigned
            trap = b.icmp_unsigned("<=", b.add(y, ir.Constant(y.type, 1)), ir.Constant(y.type, 1))
            return b.srem(x, b.select(trap, ir.Constant(y.type, 1), y))
    raise NotImplementedError(f"binary op {op} on {dt.short}")


def cast_int(b: ir.IRBuilder, v: ir.Value, dt: DType) -> ir.Value:
    """An i64 index value as dtype dt."""
    if dt.is_float:
        return b.sitofp(v, reg_type(dt))
    t = reg_type(dt)
    return v if t == I64 else b.trunc(v, t)


def cast(b: ir.IRBuilder, v: ir.Value, src: DType, dst: DType) -> ir.Value:
    if src is dst or (reg_type(src) == reg_type(dst) and dst is not DType.bfloat16):
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
    if dst is DType.bfloat16:  # round to nearest even on the upper 16 bits, kept in a float
        bits = b.bitcast(out, I32)
        lsb = b.and_(b.lshr(bits, ir.Constant(I32, 16)), ir.Constant(I32, 1))
        r = b.and_(b.add(b.add(bits, ir.Constant(I32, 0x7FFF)), lsb), ir.Constant(I32, 0xFFFF0000 - 2**32))
        out = b.bitcast(r, F32)
    return out
