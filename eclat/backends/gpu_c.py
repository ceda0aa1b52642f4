"""One C-style renderer for GPU kernels, three dialects (CUDA, OpenCL, Metal).

Every difference between the dialects is data in a `Dialect` (qualifiers, address spaces,
thread indices, barrier, math names, type names, parameter syntax, warp shuffles); the
renderer below is written once. A kernel of eclat.compiler.kernel is lowered with a
`GpuSchedule` to one of three strategies, all launched as a 1-D grid of work-groups:

  flat  one thread per output element; reductions run as serial loops in the thread.
  row   one work-group per row (the leading output axes that the kernel's reductions depend
        on): each reduction is split across the group's threads and combined by a tree in
        shared memory (warp/simdgroup shuffles first where the dialect has them); then the
        threads share the row's output elements. A softmax or layer-norm row is one group.
  tile  contractions (epilogue(sum_k a*b), see `as_contraction`): each group computes a
        TM x TN output tile, staging TK-deep slices of a and b in shared memory, each thread
        a RM x RN register block; the epilogue runs on the accumulators. Ragged edges are
        clamped on load and masked on store.

Loads of the flat strategy are vectorised (float4) when the schedule asks and the index is
provably aligned and unit-stride in the last axis.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, field, replace
from importlib import import_module

import numpy as np

from ..compiler.group import ravel, terms
from ..compiler.kernel import (
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
    axis_vars,
    free_vars,
    loads,
    reduces,
)
from ..errors import EclatError
from ..ir.dtypes import DType
from ..ir.symbolic import BinOp, Expr, Num, Var, bounds, render
from .scope import Scope

# --- dialects -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dialect:
    name: str
    prelude: str
    kernel: str  # written before `void name(...)`; {threads} is the work-group size
    global_: str  # address space of buffer pointers
    shared: str  # declaration prefix of work-group memory
    restrict: str
    barrier: str
    group_id: str  # expression for the work-group index (or a parameter name)
    local_id: str
    param: str  # one buffer parameter: {space} {const} {type} {restrict} {name} {n}
    thread_params: tuple[str, ...]  # extra parameters (Metal's position attributes)
    math: dict[str, str]  # function names: exp2 log2 sin sqrt rsqrt fma fmod isnan
    types: dict[DType, str]  # register types
    mem_types: dict[DType, str]  # buffer element types where they differ
    inf: str
    nan: str
    long_suffix: str
    bits: tuple[str, str]  # float -> uint and uint -> float bit casts, each with {}
    shuffle_down: str | None  # {v} {off}: value from lane + off, None if the dialect has none
    warp: int = 32


_COMMON_TYPES = {DType.float32: "float", DType.bfloat16: "float", DType.int32: "int", DType.bool: "bool"}

CUDA = Dialect(
    name="cuda",
    prelude="",
    kernel='extern "C" __global__ void __launch_bounds__({threads})',
    global_="", shared="__shared__", restrict="__restrict__", barrier="__syncthreads();",
    group_id="(int)blockIdx.x", local_id="(int)threadIdx.x",
    param="{const}{type}* {restrict} {name}", thread_params=(),
    math={"exp2": "exp2f", "log2": "log2f", "sin": "sinf", "sqrt": "sqrtf", "rsqrt": "rsqrtf",
          "fma": "fmaf", "fmod": "fmodf", "isnan": "isnan"},
    types={**_COMMON_TYPES, DType.int64: "long long"}, mem_types={DType.bool: "unsigned char"},
    inf="__int_as_float(0x7f800000)", nan="__int_as_float(0x7fffffff)", long_suffix="LL",
    bits=("__float_as_uint({})", "__uint_as_float({})"),
    shuffle_down="__shfl_down_sync(0xffffffffu, {v}, {off})",
)

OPENCL = Dialect(
    name="opencl",
    prelude="",
    kernel="__kernel __attribute__((reqd_work_group_size({threads}, 1, 1))) void",
    global_="__global", shared="__local", restrict="restrict", barrier="barrier(CLK_LOCAL_MEM_FENCE);",
    group_id="(int)get_group_id(0)", local_id="(int)get_local_id(0)",
    param="{space} {const}{type}* {restrict} {name}", thread_params=(),
    math={"exp2": "exp2", "log2": "log2", "sin": "sin", "sqrt": "sqrt", "rsqrt": "rsqrt",
          "fma": "fma", "fmod": "fmod", "isnan": "isnan"},
    types={**_COMMON_TYPES, DType.int64: "long"}, mem_types={DType.bool: "uchar"},
    inf="INFINITY", nan="NAN", long_suffix="L",
    bits=("as_uint({})", "as_float({})"),
    shuffle_down=None,  # sub-groups are an optional extension (PoCL's CPU device lacks them)
)

METAL = Dialect(
    name="metal",
    prelude="#include <metal_stdlib>\nusing namespace metal;\n",
    kernel="kernel void",
    global_="device", shared="threadgroup", restrict="",
    barrier="threadgroup_barrier(mem_flags::mem_threadgroup);",
    group_id="(int)gid_", local_id="(int)lid_",
    param="{space} {const}{type}* {name} [[buffer({n})]]",
    thread_params=("uint gid_ [[threadgroup_position_in_grid]]",
                   "uint lid_ [[thread_position_in_threadgroup]]"),
    math={"exp2": "metal::exp2", "log2": "metal::log2", "sin": "metal::sin", "sqrt": "metal::sqrt",
          "rsqrt": "metal::rsqrt", "fma": "metal::fma", "fmod": "metal::fmod", "isnan": "metal::isnan"},
    types={**_COMMON_TYPES, DType.int64: "long"}, mem_types={DType.bool: "uchar"},
    inf="INFINITY", nan="NAN", long_suffix="L",
    bits=("as_type<uint>({})", "as_type<float>({})"),
    shuffle_down="simd_shuffle_down({v}, (ushort)({off}))",
)

DIALECTS: dict[str, Dialect] = {d.name: d for d in (CUDA, OPENCL, METAL)}

# --- schedules ------------------------------------------------------------------------------------

STRATEGIES = ("flat", "row", "tile")
_SHUFFLED = (DType.float32, DType.bfloat16, DType.int32)  # 32-bit values: every dialect's shuffles take them
ROW_MIN_REDUCE = 32  # a reduction at least this long gets a work-group of its own
MATVEC_ROWS = 4  # a contraction with fewer rows (a decode step) and a long k: a work-group per output
MAX_THREADS = 256


@dataclass(frozen=True)
class GpuSchedule:
    """How one kernel maps onto a GPU. `threads` is the work-group size of flat and row;
    tile: (TM, TN, TK) shared-memory tile and micro: (RM, RN) per-thread register block
    (threads = TM/RM * TN/RN). vector: 4 for float4 loads in flat kernels, else 1."""

    strategy: str = "flat"
    threads: int = 256
    tile: tuple[int, int, int] = (64, 64, 16)
    micro: tuple[int, int] = (4, 4)
    vector: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"GPU strategy {self.strategy!r} is not one of {STRATEGIES}")
        tm, tn, _ = self.tile
        rm, rn = self.micro
        if tm % rm or tn % rn:
            raise ValueError(f"tile {self.tile} is not a multiple of the register block {self.micro}")
        if self.vector not in (1, 2, 4):
            raise ValueError(f"vector width {self.vector} is not 1, 2 or 4")

    @property
    def group_size(self) -> int:
        if self.strategy == "tile":
            return (self.tile[0] // self.micro[0]) * (self.tile[1] // self.micro[1])
        return self.threads


def _pow2(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


def row_axes(kernel: Kernel) -> int:
    """How many leading output axes the kernel's outermost reductions depend on."""
    memo: dict = {}
    p = 0
    for r in reduces(kernel.body):
        fv = free_vars(r, memo)
        if all(v.startswith("i") for v in fv):
            p = max([p] + [int(v[1:]) + 1 for v in fv])
    return p


def _long_reduce(kernel: Kernel) -> int:
    memo: dict = {}
    return max((r.size for r in reduces(kernel.body) if all(v.startswith("i") for v in free_vars(r, memo))),
               default=0)


def _contraction(kernel: Kernel) -> Contraction | None:
    c = as_contraction(kernel)
    return c if c is not None and c.reduce.dtype is DType.float32 and kernel.numel > 1 else None


def _tile_for(kernel: Kernel, c: Contraction, tm: int, tn: int, tk: int, rm: int, rn: int) -> GpuSchedule:
    m = kernel.shape[c.m_axis] if c.m_axis is not None else 1
    n = kernel.shape[c.n_axis]
    tm, tn = min(tm, _pow2(m)), min(tn, _pow2(n))
    rm, rn = min(rm, tm), min(rn, tn)
    return GpuSchedule("tile", tile=(tm, tn, min(tk, _pow2(c.reduce.size))), micro=(rm, rn))


def default_gpu_schedule(kernel: Kernel) -> GpuSchedule:
    c = _contraction(kernel)
    m = kernel.shape[c.m_axis] if c is not None and c.m_axis is not None else 1
    if c is not None and (m >= MATVEC_ROWS or c.reduce.size < ROW_MIN_REDUCE * 4):
        return _tile_for(kernel, c, 64, 64, 16, 4, 4)
    size = _long_reduce(kernel)
    if size >= ROW_MIN_REDUCE:
        inner = math.prod(kernel.shape[row_axes(kernel):])
        return GpuSchedule("row", threads=min(MAX_THREADS, max(32, _pow2(max(size, inner)))))
    return GpuSchedule("flat", threads=MAX_THREADS, vector=4 if _vector_ok(kernel, 4) else 1)


def gpu_schedule_space(kernel: Kernel) -> list[GpuSchedule]:
    """The schedules worth timing for kernel, the default first."""
    out = [default_gpu_schedule(kernel)]
    c = _contraction(kernel)
    if c is not None:
        tiles = ((32, 32, 16, 2, 2), (64, 64, 16, 4, 4), (128, 64, 8, 8, 4), (64, 128, 8, 4, 8),
                 (128, 128, 8, 8, 8), (16, 64, 16, 1, 4))  # (TM, TN, TK, RM, RN)
        out += [_tile_for(kernel, c, *t) for t in tiles]
    if reduces(kernel.body):
        out += [GpuSchedule("row", threads=t) for t in (64, 128, 256)]
    out += [GpuSchedule("flat", threads=t) for t in (64, 128, 256)]
    if _vector_ok(kernel, 4):
        out.append(GpuSchedule("flat", threads=128, vector=4))
    unique: list[GpuSchedule] = []
    for s in out:
        if s not in unique:
            unique.append(s)
    return unique


# --- vectorisation --------------------------------------------------------------------------------

def _unit_aligned(e: Expr, var: str, width: int) -> bool:
    """e is var + (terms that are multiples of width)."""
    ts = terms(e)
    mine = [c for c, a in ts if isinstance(a, Var) and a.name == var]
    others = [c for c, a in ts if not (isinstance(a, Var) and a.name == var)]
    return mine == [1] and all(c % width == 0 for c in others) and \
        all(isinstance(a, Var) or a is None for c, a in ts)


def _vector_loads(kernel: Kernel, width: int) -> list[Load]:
    if not kernel.shape:
        return []
    last = f"i{len(kernel.shape) - 1}"
    return [x for x in loads(kernel.body) if isinstance(x, Load) and x.dtype is DType.float32
            and x.valid == Num(1) and _unit_aligned(x.index, last, width)]


def _vector_ok(kernel: Kernel, width: int) -> bool:
    return (bool(kernel.shape) and kernel.shape[-1] % width == 0 and not reduces(kernel.body)
            and bool(_vector_loads(kernel, width)))


def _unit_stride(e: KExpr, var: str) -> bool:
    """e is a load whose index steps by one element as var does."""
    if not isinstance(e, Load):
        return False
    return [c for c, a in terms(e.index) if isinstance(a, Var) and a.name == var] == [1]


# --- rendering ------------------------------------------------------------------------------------

_C_OPS = {"+": "+", "*": "*", "//": "/", "%": "%", "<": "<", "and": "&&"}


def c_index(e: Expr | int) -> str:
    """A symbolic index expression in C. `//` and `%` keep their floor meaning where the
    dividend may be negative (a padded view's index), where C would truncate toward zero."""
    if not isinstance(e, BinOp):
        return render(e)
    a, b = c_index(e.a), c_index(e.b)
    if e.op in ("//", "%") and bounds(e.a)[0] < 0:
        rem = f"(({a} % {b} + {b}) % {b})"
        return rem if e.op == "%" else f"(({a} - {rem}) / {b})"
    return f"({a} {_C_OPS[e.op]} {b})"



@dataclass
class RenderedKernel:
    name: str
    source: str
    args: list[str]  # buffer names, in parameter order
    groups: int  # work-groups in the 1-D grid
    threads: int  # work-items per group
    schedule: GpuSchedule = field(default_factory=GpuSchedule)


@dataclass
class RenderedProgram:
    dialect: str
    source: str  # prelude and every kernel: one compilation unit
    kernels: list[RenderedKernel]


def render_program(program: Program, dialect: Dialect | str,
                   schedules: dict[str, GpuSchedule] | None = None) -> RenderedProgram:
    """Every kernel of program in one source, with its launch geometry."""
    d = DIALECTS[dialect] if isinstance(dialect, str) else dialect
    schedules = schedules or {}
    ks = [render_kernel(k, program.buffers, d, schedules.get(k.name)) for k in program.kernels]
    return RenderedProgram(d.name, d.prelude + "\n" + "\n".join(k.source for k in ks), ks)


def render_kernel(kernel: Kernel, buffers: dict[str, Buffer], dialect: Dialect | str,
                  schedule: GpuSchedule | None = None) -> RenderedKernel:
    d = DIALECTS[dialect] if isinstance(dialect, str) else dialect
    sched = schedule or default_gpu_schedule(kernel)
    if sched.strategy == "tile" and _contraction(kernel) is None:
        raise EclatError(f"kernel {kernel.name} is not a contraction: it cannot use the tile strategy")
    if sched.vector > 1 and not _vector_ok(kernel, sched.vector):
        sched = replace(sched, vector=1)
    for b in {x.buffer for x in loads(kernel.body)} | {kernel.out}:
        if buffers[b].dtype is DType.float16:
            raise EclatError(f"kernel {kernel.name}: float16 buffer {b} is not supported by the GPU "
                             f"backends yet (use float32 or bfloat16)")
        if buffers[b].numel >= 2**31:
            raise EclatError(f"kernel {kernel.name}: buffer {b} has {buffers[b].numel} elements; "
                             f"GPU kernels index with 32-bit integers")
    return _Emitter(kernel, buffers, d, sched).rendered()


class _Emitter:
    def __init__(self, kernel: Kernel, buffers: dict[str, Buffer], d: Dialect, sched: GpuSchedule):
        self.k, self.buffers, self.d, self.s = kernel, buffers, d, sched
        self.lines: list[str] = []
        self.depth = 1
        self.scope: Scope[str] = Scope()  # bound index variables and computed expressions
        self.count = 0
        self.fv: dict = {}
        self.cands = reduces(kernel.body)
        self.shared: dict[str, str] = {}  # array name -> declaration
        self.args = sorted({x.buffer for x in loads(kernel.body)} | {kernel.out})
        self.cname: dict[str, str] = {}  # buffer -> a C identifier (buffer names may hold dots)
        for name in self.args:
            c = "b_" + re.sub(r"\W", "_", name)
            self.cname[name] = c if c not in self.cname.values() else f"{c}_{len(self.cname)}"
        self.groups = 0
        self.vectors: dict[Load, str] = {}  # vector strategy: a load -> the vector holding its lanes
        self.lane = 0
        if kernel.numel:
            getattr(self, f"_{sched.strategy}")()

    # --- output ----------------------------------------------------------------------------------
    def rendered(self) -> RenderedKernel:
        d, k = self.d, self.k
        params = []
        for n, name in enumerate(self.args):
            dt = self.buffers[name].dtype
            const = "" if name == k.out else "const "
            params.append(d.param.format(space=d.global_, const=const, type=self.mem_type(dt),
                                         restrict=d.restrict, name=self.cname[name], n=n))
        params += d.thread_params
        head = f"{d.kernel.format(threads=self.s.group_size)} {k.name}({', '.join(params)}) {{"
        body = [f"  {decl}" for decl in self.shared.values()] + self.lines
        note = f"// {k.name}: {self.s.strategy} {list(k.shape)} ops={','.join(k.ops)}"
        src = "\n".join([note, head, *body, "}", ""])
        return RenderedKernel(k.name, src, self.args, self.groups, self.s.group_size, self.s)

    # --- scopes ----------------------------------------------------------------------------------
    def line(self, s: str) -> None:
        self.lines.append("  " * self.depth + s)

    def fresh(self, prefix: str = "v") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def open(self, header: str, binds: tuple[str, ...] = ()) -> None:
        """Open a C block; binds are index variables its header declares (a loop's counter)."""
        self.line(f"{header} {{" if header else "{")
        self.depth += 1
        self.scope.push()
        for var in binds:
            self.scope.bind(var, var)

    def close(self) -> None:
        self.scope.pop()
        self.depth -= 1
        self.line("}")

    def bind(self, var: str, value: str) -> None:
        """Declare the index variable var = value in the current block."""
        self.line(f"const int {var} = {value};")
        self.scope.bind(var, var)

    def declare(self, dt: DType, value: str, prefix: str = "v") -> str:
        name = self.fresh(prefix)
        self.line(f"const {self.reg_type(dt)} {name} = {value};")
        return name

    def hoist(self, within: Reduce | None = None) -> None:
        """Run every reduction (of `within`'s body, or of the kernel) whose variables are all
        bound now, serially in this thread."""
        bound = self.scope.bound()
        for r in reduces(within.body) if within is not None else self.cands:
            if self.scope.cached(r) is None and free_vars(r, self.fv) <= bound:
                self.scope.remember(r, self.serial_reduce(r))

    def unravel(self, flat: str, axes: list[int]) -> None:
        """Bind the axis variables `axes` (row-major over their sizes) from a flat index."""
        shape = [self.k.shape[a] for a in axes]
        stride = math.prod(shape)
        for a, n in zip(axes, shape):
            stride //= n
            if n == 1:
                self.bind(f"i{a}", "0")
            else:
                q = flat if stride == 1 else f"({flat} / {stride})"
                self.bind(f"i{a}", q if a == axes[0] else f"({q} % {n})")

    # --- types and literals ----------------------------------------------------------------------
    def reg_type(self, dt: DType) -> str:
        return self.d.types[dt]

    def mem_type(self, dt: DType) -> str:
        return self.d.mem_types.get(dt, self.d.types[dt])

    def literal(self, value, dt: DType) -> str:
        if dt is DType.bool:
            return "true" if value else "false"
        if dt.is_float:
            v = float(np.float32(value))
            if math.isnan(v):
                return self.d.nan
            if math.isinf(v):
                return self.d.inf if v > 0 else f"(-{self.d.inf})"
            return f"{v!r}f"
        v = int(value)
        if dt is DType.int64:
            if v == -(2**63):
                return f"(-9223372036854775807{self.d.long_suffix} - 1)"
            return f"{v}{self.d.long_suffix}"
        return "(-2147483647 - 1)" if v == -(2**31) else str(v)

    def identity(self, op: str, dt: DType) -> str:
        if op == "sum":
            return self.literal(0, dt)
        if dt.is_float:
            return self.literal(-math.inf, dt)
        return self.literal(False if dt is DType.bool else np.iinfo(dt.np).min, dt)

    def sym(self, e: Expr | int) -> str:
        return c_index(e)

    # --- expressions -----------------------------------------------------------------------------
    def emit(self, e: KExpr) -> str:
        hit = self.scope.cached(e)
        if hit is not None:
            return hit
        if isinstance(e, Const):
            return self.literal(e.value, e.dtype)
        if isinstance(e, Index):
            v = self.sym(e.expr)
            return f"({v} != 0)" if e.dtype is DType.bool else f"(({self.reg_type(e.dtype)}){v})"
        if isinstance(e, Load):
            out = self.declare(e.dtype, self.load(e))
        elif isinstance(e, Gather):
            out = self.gather(e)
        elif isinstance(e, Op):
            out = self.declare(e.dtype, self.op(e))
        elif isinstance(e, Reduce):
            out = self.serial_reduce(e)
        else:  # pragma: no cover
            raise TypeError(f"not a kernel expression: {e!r}")
        return self.scope.remember(e, out)

    def read(self, buf: str, index: str, dt: DType) -> str:
        buf = self.cname[buf]
        return f"({buf}[{index}] != 0)" if dt is DType.bool else f"{buf}[{index}]"

    def load(self, e: Load) -> str:
        if self.buffers[e.buffer].numel == 0 or e.valid == Num(0):
            return self.literal(0, e.dtype)
        vec = self.vector_lane(e)
        if vec is not None:
            return vec
        value = self.read(e.buffer, self.sym(e.index), e.dtype)
        if e.valid == Num(1):
            return value
        return f"({self.sym(e.valid)}) ? {value} : {self.literal(0, e.dtype)}"

    def gather(self, e: Gather) -> str:
        long_ = self.d.types[DType.int64]
        g = self.fresh("g")
        self.line(f"{long_} {g} = ({long_}){self.emit(e.idx)};")
        self.line(f"{g} = {g} < 0 ? 0 : ({g} > {e.rows - 1} ? {e.rows - 1} : {g});")
        index = f"(int){g} * {e.row_size} + {self.sym(e.inner)}"
        return self.declare(e.dtype, self.read(e.buffer, index, e.dtype))

    def op(self, e: Op) -> str:
        a = [self.emit(s) for s in e.srcs]
        op, dt = e.op, e.dtype
        m = self.d.math
        if op == "cast":
            return self.cast(a[0], e.srcs[0].dtype, dt)
        if op == "where":
            return f"({a[0]} ? {a[1]} : {a[2]})"
        if op == "lt":
            return f"({a[0]} < {a[1]})"
        if op == "fma" and not dt.is_float:
            return f"({a[0]} * {a[1]} + {a[2]})"
        if op in ("exp2", "log2", "sin", "sqrt", "rsqrt", "fma"):
            return f"{m[op]}({', '.join(a)})"
        if op == "recip":
            return f"(1.0f / {a[0]})"
        if op == "neg":
            return f"(!{a[0]})" if dt is DType.bool else f"(-{a[0]})"
        if op == "mod":
            if dt.is_float:
                return f"{m['fmod']}({a[0]}, {a[1]})"
            if dt is DType.bool:
                return "false"
            # 0 where the divisor is 0, as the interpreter; INT_MIN % -1 is undefined in C (a trap)
            return f"((({a[1]} == 0) | ({a[1]} == -1)) ? ({self.reg_type(dt)})0 : {a[0]} % {a[1]})"
        if op in ("add", "mul", "max"):
            return self.combine(op, a[0], a[1], dt)
        raise EclatError(f"kernel {self.k.name}: the GPU renderer has no lowering for op {op!r}")

    def combine(self, op: str, x: str, y: str, dt: DType) -> str:
        """x op y for add/mul/max and the reduce ops sum/max_reduce (NaN-propagating max)."""
        op = {"sum": "add", "max_reduce": "max"}.get(op, op)
        if dt is DType.bool:
            return f"({x} && {y})" if op == "mul" else f"({x} || {y})"
        if op == "add":
            return f"({x} + {y})"
        if op == "mul":
            return f"({x} * {y})"
        if dt.is_float:
            return f"(({self.d.math['isnan']}({x}) || {x} > {y}) ? {x} : {y})"
        return f"({x} > {y} ? {x} : {y})"

    def cast(self, x: str, src: DType, dst: DType) -> str:
        if dst is DType.bool:
            return f"({x} != 0)"
        if dst is DType.bfloat16:  # round to nearest even on the upper 16 bits, kept in a float
            to_u, to_f = self.d.bits
            u = self.fresh("u")
            self.line(f"const unsigned int {u} = {to_u.format(f'(float)({x})')};")
            return to_f.format(f"(({u} + 0x7FFFu + (({u} >> 16) & 1u)) & 0xFFFF0000u)")
        return f"(({self.reg_type(dst)})({x}))"

    # --- reductions --------------------------------------------------------------------------------
    def serial_reduce(self, r: Reduce) -> str:
        acc = self.fresh("acc")
        self.line(f"{self.reg_type(r.dtype)} {acc} = {self.identity(r.op, r.dtype)};")
        v = r.var.name
        self.open(f"for (int {v} = 0; {v} < {r.size}; {v}++)", (v,))
        self.hoist(r)
        self.line(f"{acc} = {self.combine(r.op, acc, self.emit(r.body), r.dtype)};")
        self.close()
        return acc

    def group_reduce(self, r: Reduce) -> str:
        """Each thread reduces a strided share of r; the group combines the partials."""
        t = self.s.threads
        acc = self.fresh("acc")
        dt = r.dtype
        self.line(f"{self.reg_type(dt)} {acc} = {self.identity(r.op, dt)};")
        v = r.var.name
        self.open(f"for (int {v} = lid; {v} < {r.size}; {v} += {t})", (v,))
        self.hoist(r)
        self.line(f"{acc} = {self.combine(r.op, acc, self.emit(r.body), dt)};")
        self.close()
        red = self.shared_array(dt, t)
        d = self.d
        shuffle = d.shuffle_down is not None and dt in _SHUFFLED and d.warp <= t <= d.warp ** 2
        if shuffle:
            self.warp_reduce(acc, r.op, dt)
            self.line(f"if (lid % {d.warp} == 0) {red}[lid / {d.warp}] = {acc};")
            self.line(d.barrier)
            self.line(f"{acc} = lid < {t // d.warp} ? {red}[lid] : {self.identity(r.op, dt)};")
            self.warp_reduce(acc, r.op, dt)
            self.line(f"if (lid == 0) {red}[0] = {acc};")
        else:
            self.line(f"{red}[lid] = {acc};")
            self.line(d.barrier)
            self.open(f"for (int s = {t // 2}; s > 0; s >>= 1)")
            both = self.combine(r.op, f"{red}[lid]", f"{red}[lid + s]", dt)
            self.line(f"if (lid < s) {red}[lid] = {both};")
            self.line(d.barrier)
            self.close()
        self.line(d.barrier)
        self.line(f"{acc} = {red}[0];")
        self.line(d.barrier)  # the array is reused by the next reduction
        return acc

    def warp_reduce(self, acc: str, op: str, dt: DType) -> None:
        self.open(f"for (int off = {self.d.warp // 2}; off > 0; off >>= 1)")
        other = self.declare(dt, self.d.shuffle_down.format(v=acc, off="off"), "sh")
        self.line(f"{acc} = {self.combine(op, acc, other, dt)};")
        self.close()

    def shared_array(self, dt: DType, size: int, name: str | None = None) -> str:
        name = name or f"red_{dt.short}"
        self.shared.setdefault(name, f"{self.d.shared} {self.reg_type(dt)} {name}[{size}];")
        return name

    def store(self, value: str) -> None:
        k = self.k
        dt = k.body.dtype
        v = f"({value} ? 1 : 0)" if dt is DType.bool else value
        self.line(f"{self.cname[k.out]}[{self.sym(ravel(axis_vars(k.shape), k.shape))}] = {v};")

    def ids(self) -> None:
        self.line(f"const int gid = {self.d.group_id};")
        self.line(f"const int lid = {self.d.local_id};")

    # --- strategies ---------------------------------------------------------------------------------
    def _flat(self) -> None:
        k, t, w = self.k, self.s.threads, self.s.vector
        n = k.numel // w
        self.groups = -(-n // t)
        self.ids()
        self.line(f"const int e = gid * {t} + lid;")
        self.open(f"if (e < {n})")
        self.unravel(f"e * {w}" if w > 1 else "e", list(range(len(k.shape))))
        if w == 1:
            self.hoist()
            self.store(self.emit(k.body))
        else:
            self.vector_body(w)
        self.close()

    def vector_body(self, w: int) -> None:
        """w consecutive outputs per thread; aligned unit-stride loads read as one vector."""
        k = self.k
        last = f"i{len(k.shape) - 1}"
        base = self.fresh("base")
        self.line(f"const int {base} = {last};")
        space = f"{self.d.global_} " if self.d.global_ else ""
        for x in _vector_loads(k, w):
            name = self.fresh("vec")
            self.line(f"const float{w} {name} = *({space}const float{w}*)"
                      f"({self.cname[x.buffer]} + {self.sym(x.index)});")
            self.vectors[x] = name
        for lane in range(w):
            self.open("")
            self.lane = lane
            self.line(f"const int {last} = {base} + {lane};")
            self.scope.bind(last, last)
            self.store(self.emit(k.body))
            self.close()
        self.vectors = {}

    def vector_lane(self, e: Load) -> str | None:
        return f"{self.vectors[e]}.{'xyzw'[self.lane]}" if e in self.vectors else None

    def _row(self) -> None:
        k, t = self.k, self.s.threads
        p = row_axes(k)
        self.groups = math.prod(k.shape[:p])
        inner = math.prod(k.shape[p:])
        self.ids()
        self.unravel("gid", list(range(p)))
        bound = self.scope.bound()
        for r in self.cands:  # children first: a reduction's inputs are ready before it
            if self.scope.cached(r) is None and free_vars(r, self.fv) <= bound:
                self.scope.remember(r, self.group_reduce(r))
        self.open(f"for (int e = lid; e < {inner}; e += {t})", ("e",))
        self.unravel("e", list(range(p, len(k.shape))))
        self.hoist()
        self.store(self.emit(k.body))
        self.close()

    def _tile(self) -> None:
        k, d = self.k, self.d
        c = _contraction(k)
        (tm, tn, tk), (rm, rn) = self.s.tile, self.s.micro
        ty, tx, t = tm // rm, tn // rn, self.s.group_size
        m = k.shape[c.m_axis] if c.m_axis is not None else 1
        n, kk = k.shape[c.n_axis], c.reduce.size
        mt, nt = -(-m // tm), -(-n // tn)
        batch = [a for a in range(len(k.shape)) if a not in (c.m_axis, c.n_axis)]
        self.groups = math.prod(k.shape[a] for a in batch) * mt * nt
        self.cands = []
        self.ids()
        self.line(f"const int tn_ = gid % {nt};")
        self.line(f"const int tm_ = (gid / {nt}) % {mt};")
        self.unravel(f"(gid / {nt * mt})", batch)
        self.line(f"const int tx = lid % {tx};")
        self.line(f"const int ty = lid / {tx};")
        a_s = self.shared_array(DType.float32, tk * tm, "As")
        b_s = self.shared_array(DType.float32, tk * tn, "Bs")
        accs = [[f"c{i}_{j}" for j in range(rn)] for i in range(rm)]
        for row in accs:
            self.line("float " + ", ".join(f"{x} = 0.0f" for x in row) + ";")
        rv, m_var, n_var = c.reduce.var.name, f"i{c.m_axis}", f"i{c.n_axis}"
        self.open(f"for (int k0 = 0; k0 < {kk}; k0 += {tk})")
        for (operand, width, size, var, tile_id, dst) in ((c.a, tm, m, m_var, "tm_", a_s),
                                                           (c.b, tn, n, n_var, "tn_", b_s)):
            # consecutive threads read consecutive addresses: along k where the operand is
            # unit-stride in k (a row-major a, a transposed weight b), else along m or n
            self.open(f"for (int q = lid; q < {tk * width}; q += {t})")
            if _unit_stride(operand, rv):
                self.line(f"const int kk = q % {tk}, mm = q / {tk};")
            else:
                self.line(f"const int kk = q / {width}, mm = q % {width};")
            self.line(f"const int row = {tile_id} * {width} + mm, kv = k0 + kk;")
            if c.m_axis is not None or dst == b_s:
                self.bind(var, f"row < {size} ? row : {size - 1}")
            self.bind(rv, f"kv < {kk} ? kv : {kk - 1}")
            v = self.emit(operand)
            self.line(f"{dst}[kk * {width} + mm] = (row < {size} && kv < {kk}) ? {v} : 0.0f;")
            self.close()
        self.line(d.barrier)
        self.open(f"for (int kk = 0; kk < {tk}; kk++)")
        for i in range(rm):
            self.line(f"const float a{i} = {a_s}[kk * {tm} + ty + {i * ty}];")
        for j in range(rn):
            self.line(f"const float b{j} = {b_s}[kk * {tn} + tx + {j * tx}];")
        for i in range(rm):
            for j in range(rn):
                self.line(f"{accs[i][j]} = {d.math['fma']}(a{i}, b{j}, {accs[i][j]});")
        self.close()
        self.line(d.barrier)
        self.close()
        for i in range(rm):
            for j in range(rn):
                self.open("")
                self.line(f"const int row = tm_ * {tm} + ty + {i * ty}, col = tn_ * {tn} + tx + {j * tx};")
                self.open(f"if (row < {m} && col < {n})")
                if c.m_axis is not None:
                    self.bind(m_var, "row")
                self.bind(n_var, "col")
                self.scope.remember(c.reduce, accs[i][j])
                self.store(self.emit(k.body))
                self.close()
                self.close()


# --- tuning ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    kernel: str  # the original kernel
    name: str  # its copy
    out: str  # the copy's output buffer
    schedule: GpuSchedule


def with_variants(program: Program, spaces: dict[str, list[GpuSchedule]]
                  ) -> tuple[Program, dict[str, GpuSchedule], list[Variant]]:
    """program plus one copy of each kernel per schedule in spaces[kernel], each copy writing an
    output of its own after the original kernels ran: one build compiles every candidate, one
    run checks them all."""
    buffers, kernels = dict(program.buffers), list(program.kernels)
    outputs, shapes = list(program.outputs), list(program.output_shapes)
    chosen: dict[str, GpuSchedule] = {}
    variants: list[Variant] = []
    for k in program.kernels:
        for j, s in enumerate(spaces.get(k.name, ())):
            v = Variant(k.name, f"{k.name}_v{j}", f"{k.out}_v{j}", s)
            buffers[v.out] = Buffer(v.out, k.numel, program.buffers[k.out].dtype, "output")
            kernels.append(replace(k, name=v.name, out=v.out))
            chosen[v.name] = s
            outputs.append(v.out)
            shapes.append(k.shape)
            variants.append(v)
    program = replace(program, buffers=buffers, kernels=kernels, outputs=outputs, output_shapes=shapes)
    return program, chosen, variants


def kernel_key(kernel: Kernel) -> str:
    """A hash of what the kernel computes (its shape and expression), for the tuning database."""
    return hashlib.sha256(repr((kernel.shape, kernel.body)).encode()).hexdigest()[:24]


def tune_schedules(program: Program, inputs: list[np.ndarray], make, *, backend: str, mode: str = "fast",
                   db=None, device: str = "", quiet: bool | None = True) -> dict[str, GpuSchedule]:
    """The fastest verified schedule of every kernel, by eclat.autotune.search over
    gpu_schedule_space. make(program, schedules) returns an executable with run(inputs) and
    time_kernel(name) -> seconds. A candidate counts as correct when its output equals (to
    1e-4) that of the default schedule, which the caller verifies against the reference."""
    from ..autotune.cache import versioned
    from ..autotune.db import TuningKey
    from ..autotune.search import Candidate, search

    spaces = {k.name: gpu_schedule_space(k) for k in program.kernels if k.numel}
    prog, chosen, variants = with_variants(program, spaces)
    exe = make(prog, chosen)
    outs = dict(zip(prog.outputs, exe.run(inputs)))
    result: dict[str, GpuSchedule] = {}
    for k in program.kernels:
        mine = [v for v in variants if v.kernel == k.name]
        if not mine:
            continue
        default = outs[mine[0].out]
        cands = [Candidate(v.schedule, 0.0, v) for v in mine]  # one roofline for all: default first
        key = None if db is None else TuningKey.make(kernel_key(k), k.shape, k.body.dtype, versioned(backend),
                                                     device)
        found = search(cands, time_fn=lambda c: exe.time_kernel(c.payload.name) * 1e6,
                       check_fn=lambda c, d=default: bool(np.allclose(outs[c.payload.out], d, rtol=1e-4,
                                                                      atol=1e-5, equal_nan=True)),
                       mode=mode, db=db, key=key, quiet=quiet, desc=k.name)
        result[k.name] = found.winner.schedule
    return result


__all__ = ["CUDA", "DIALECTS", "METAL", "OPENCL", "Dialect", "GpuSchedule", "RenderedKernel",
           "RenderedProgram", "Variant", "default_gpu_schedule", "gpu_schedule_space", "kernel_key",
           "render_kernel", "render_program", "row_axes", "tune_schedules", "with_variants"]


class GpuBackend:
    """A GPU target is data: its dialect and the runtime class that launches its kernels
    ("module:Class", imported on first use: pyopencl, pycuda and PyObjC are optional)."""

    name: str
    dialect: Dialect
    runtime: str

    def executable(self) -> type:
        module, _, cls = self.runtime.partition(":")
        return getattr(import_module(module), cls)

    def render(self, program: Program, threads: int = 1,
               schedules: dict[str, GpuSchedule] | None = None) -> str:
        return render_program(program, self.dialect, schedules).source

    def compile(self, program: Program, threads: int = 1, schedules: dict[str, GpuSchedule] | None = None):
        return self.executable()(program, schedules)

    def tune(self, program: Program, inputs: list, mode: str = "fast", db=None, device: str = ""
             ) -> dict[str, GpuSchedule]:
        """The fastest verified GPU schedule of every kernel (tune_schedules)."""
        return tune_schedules(program, inputs, self.executable(), backend=self.name, mode=mode, db=db,
                              device=device)
