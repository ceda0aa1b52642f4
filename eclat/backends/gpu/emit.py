"""The C-like kernel emitter: one renderer for every dialect, lowering a kernel of
eclat.compiler.kernel with its `GpuSchedule` (flat, row, tile, attention or mma: gpu/mma.py) to the dialect's
source."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ...compiler.group import ravel
from ...compiler.kernel import (
    Buffer,
    Const,
    Gather,
    Index,
    Kernel,
    KExpr,
    Load,
    Op,
    Program,
    Reduce,
    as_attention,
    axis_vars,
    free_vars,
    loads,
    reduces,
)
from ...errors import EclatError
from ...ir.dtypes import DType
from ...ir.symbolic import BinOp, Expr, Num, bounds, render
from ..scope import Scope
from .dialects import DIALECTS, Dialect
from .mma import render_mma
from .packing import PARTS, decode
from .schedules import (
    GpuSchedule,
    TileOperand,
    default_gpu_schedule,
    mma_operands,
    row_axes,
    tile_contraction,
    unit_stride,
    vector_loads,
    vector_ok,
)

# values in 32-bit registers: every dialect's shuffles take them
_SHUFFLED = (DType.float32, DType.bfloat16, DType.float16, DType.int32)

_COMBINE = {"sum": "add", "max_reduce": "max"}  # a reduce op -> the op combining two partials

_INDEX_OPS = {"+": "+", "*": "*", "//": "/", "%": "%", "<": "<", "and": "&&"}

ATTENTION_TILE = 64  # keys a group stages in shared memory at a time (attention strategy), at most
SHARED_FLOATS = 4096  # ... in at most this many floats (16 KB: under every dialect's limit)
ROW_FLOATS = 128  # a query's row read once into registers (attention strategy), at most this long


def c_index(e: Expr | int) -> str:
    """A symbolic index expression in C. `//` and `%` keep their floor meaning where the
    dividend may be negative (a padded view's index), where C would truncate toward zero."""
    if not isinstance(e, BinOp):
        return render(e)
    a, b = c_index(e.a), c_index(e.b)
    if e.op in ("//", "%") and bounds(e.a)[0] < 0:
        rem = f"(({a} % {b} + {b}) % {b})"
        return rem if e.op == "%" else f"(({a} - {rem}) / {b})"
    return f"({a} {_INDEX_OPS[e.op]} {b})"


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
    sched = schedule or default_gpu_schedule(kernel, d)
    if sched.strategy == "tile" and tile_contraction(kernel) is None:
        raise EclatError(f"kernel {kernel.name} is not a contraction: it cannot use the tile strategy")
    if sched.strategy == "mma" and (d.matrix_unit != "wmma" or mma_operands(kernel) is None):
        raise EclatError(f"kernel {kernel.name} cannot use the mma strategy in {d.name}: it needs a "
                         f"contraction of float16, bfloat16 or float32 operands and a dialect with WMMA")
    if sched.strategy in ("attention", "decode") and as_attention(kernel) is None:
        raise EclatError(f"kernel {kernel.name} is not an attention: it cannot use the {sched.strategy} "
                         f"strategy")
    if sched.vector > 1 and not vector_ok(kernel, sched.vector):
        sched = replace(sched, vector=1)
    for b in {x.buffer for x in loads(kernel.body)} | {kernel.out}:
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
        # a weight with a packed copy (eclat.backends.gpu.packing) is read from the copy
        self.packed = {x.buffer for x in loads(kernel.body) if x.buffer + PARTS[0] in buffers}
        reads = {x.buffer for x in loads(kernel.body)} - self.packed
        reads |= {b + part for b in self.packed for part in PARTS if b + part in buffers}
        self.args = sorted(reads | {kernel.out})
        self.cname: dict[str, str] = {}  # buffer -> a C identifier (buffer names may hold dots)
        for name in self.args:
            c = "b_" + re.sub(r"\W", "_", name)
            self.cname[name] = c if c not in self.cname.values() else f"{c}_{len(self.cname)}"
        self.groups = 0
        self.vectors: dict[Load, str] = {}  # vector strategy: a load -> the vector holding its lanes
        self.staged: dict[Load, str] = {}  # attention strategy: a load -> where the group staged it
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
        return self.d.mem_types[dt] if dt in self.d.mem_types else self.d.types[dt]

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
        if buf in self.packed:
            b = self.buffers[buf]
            i = self.fresh("p")
            self.line(f"const int {i} = {index};")
            q, s = (self.cname.get(buf + part, "") for part in PARTS)
            return decode(b.format, b.along, q, s, i, self.d.bits[1])
        c = self.cname[buf]
        if self.buffers[buf].dtype is DType.float16:
            return self.d.half_load.format(p=c, i=index)
        if self.buffers[buf].dtype is DType.bfloat16:  # its 16 bits are a float's high half
            return self.d.bits[1].format(f"((unsigned int){c}[{index}] << 16)")
        return f"({c}[{index}] != 0)" if dt is DType.bool else f"{c}[{index}]"

    def load(self, e: Load) -> str:
        if e in self.staged:  # a key's row the group staged in shared memory (_attention)
            return self.staged[e]
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
        """e as a C expression over its operands (emitted first), written from the dialect's op table."""
        a = [self.emit(s) for s in e.srcs]
        if e.op == "cast":
            return self.cast(a[0], e.srcs[0].dtype, e.dtype)
        out = self.d.op(e.op, e.dtype, *a)
        if out is None:
            raise EclatError(f"kernel {self.k.name}: the GPU renderer has no lowering for op {e.op!r}")
        return out

    def combine(self, op: str, x: str, y: str, dt: DType) -> str:
        """x op y for add/mul/max and the reduce ops sum/max_reduce (NaN-propagating max)."""
        return self.d.op(_COMBINE.get(op, op), dt, x, y)

    def cast(self, x: str, src: DType, dst: DType) -> str:
        if dst is DType.bool:
            return f"({x} != 0)"
        if dst is DType.float16:
            return self.d.round_half.format(f"(float)({x})")
        if dst is DType.bfloat16:  # rounded, kept in a float
            return self.d.bits[1].format(self.bfloat16_bits(x))
        return f"(({self.reg_type(dst)})({x}))"

    def bfloat16_bits(self, x: str) -> str:
        """The float x rounded to bfloat16 (nearest, ties to even), as a float's bits."""
        u = self.fresh("u")
        self.line(f"const unsigned int {u} = {self.d.bits[0].format(f'(float)({x})')};")
        return f"(({u} + 0x7FFFu + (({u} >> 16) & 1u)) & 0xFFFF0000u)"

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
        out, index = self.cname[k.out], self.sym(ravel(axis_vars(k.shape), k.shape))
        if dt is DType.float16:
            self.line(self.d.half_store.format(p=out, i=index, v=v))
        elif dt is DType.bfloat16:
            self.line(f"{out}[{index}] = (unsigned short)({self.bfloat16_bits(v)} >> 16);")
        else:
            self.line(f"{out}[{index}] = {v};")

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
        for x in vector_loads(k, w):
            if x.buffer in self.packed:
                continue
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

    def _mma(self) -> None:
        render_mma(self)  # tensor cores: gpu/mma.py

    def _attention(self) -> None:
        """One thread per query row (every axis but the last): the keys in turn, an online softmax
        (running max m, rescaled sum l) and the row's output in registers, never the scores. Where
        the group's rows share what the keys read (one head's queries: `_staged_loads`), the keys go
        in tiles of `bj` that the group stages in shared memory together, each key's row read from
        global memory once per group rather than once per query."""
        k, t, d = self.k, self.s.threads, self.d
        att = as_attention(k)
        rows, dv = math.prod(k.shape[:-1]), k.shape[-1]
        last = f"i{len(k.shape) - 1}"
        staged = self._staged_loads(att, rows, t, {last: dv})
        self.groups = -(-rows // t)
        self.ids()
        self.line(f"const int e = gid * {t} + lid;")
        self.open("" if staged else f"if (e < {rows})")  # staged: rows fill every group (barriers)
        self.unravel("e", list(range(len(k.shape) - 1)))
        self._row_state(att)
        j = att.var.name
        if staged:
            bj = max(1, min(ATTENTION_TILE, att.size,
                            SHARED_FLOATS // sum(width for _, width, _ in staged.values())))
            for smem, width, _ in staged.values():
                self.shared[smem] = f"{d.shared}{d.shared_align} float {smem}[{bj * width}];"
            self.open(f"for (int jt = 0; jt < {att.size}; jt += {bj})")
            for load, (smem, width, w) in staged.items():
                self.open(f"for (int q = lid; q < {bj * width}; q += {t})")
                self.bind(j, f"jt + q / {width}")
                self.bind(w, f"q % {width}")
                self.line(f"{smem}[q] = {j} < {att.size} ? {self.load(load)} : 0.0f;")
                self.close()
            self.line(d.barrier)
            self.open(f"for (int jj = 0; jj < {bj} && jt + jj < {att.size}; jj++)")
            self.bind(j, "jt + jj")
            self.staged |= {load: f"{smem}[jj * {width} + {w}]" for load, (smem, width, w) in staged.items()}
        else:
            self.open(f"for (int {j} = 0; {j} < {att.size}; {j}++)", (j,))
        self._online_step(att)
        self.close()
        self.staged = {}
        if staged:
            self.line(d.barrier)  # the tile is read by all before the next is staged
            self.close()
        dead = f"m == -{d.inf} ? 0.0f : " if att.safe else ""
        self.line(f"const float inv = {dead}1.0f / l;")
        self.open(f"for (int {last} = 0; {last} < {dv}; {last}++)", (last,))
        self.store(f"o[{last}] * inv")
        self.close()
        self.close()

    def _decode(self) -> None:
        """A work-group per query row (decode: one query a head), its threads taking the keys in
        turn (thread lid the keys lid, lid + t, ...), each with an online softmax and an output row
        of its own; the group then combines them (flash-decoding within a group): the threads' max
        M, each thread's sum and row weighted by exp2((m - M) * scale), added in shared memory."""
        k, t, d = self.k, self.s.threads, self.d
        att = as_attention(k)
        dv, last, j = k.shape[-1], f"i{len(k.shape) - 1}", att.var.name
        self.groups = math.prod(k.shape[:-1])
        self.ids()
        self.unravel("gid", list(range(len(k.shape) - 1)))
        self._row_state(att)
        self.open(f"for (int {j} = lid; {j} < {att.size}; {j} += {t})", (j,))
        self._online_step(att)
        self.close()
        part = self.shared_array(DType.float32, t, "part")
        self.line(f"{part}[lid] = m;")
        self.line(d.barrier)
        self.line("float top = m;")
        self.line(f"for (int s = 0; s < {t}; s++) top = {part}[s] > top ? {part}[s] : top;")
        self.line(d.barrier)
        self.line(f"const float w = {d.math['exp2']}((m - (top == -{d.inf} ? 0.0f : top)) * "
                  f"{self.literal(att.scale, DType.float32)});")
        self.line(f"{part}[lid] = w * l;")
        self.line(d.barrier)
        self.line("float total = 0.0f;")
        self.line(f"for (int s = 0; s < {t}; s++) total += {part}[s];")
        dead = f"top == -{d.inf} ? 0.0f : " if att.safe else ""
        self.line(f"const float inv = {dead}1.0f / total;")
        # the rows weighted, a chunk of columns at a time, then each column summed by one thread
        width = max(1, min(dv, SHARED_FLOATS // t))
        rows = self.shared_array(DType.float32, t * width, "rows")
        self.open(f"for (int c0 = 0; c0 < {dv}; c0 += {width})")
        self.open(f"for (int c = 0; c < {width} && c0 + c < {dv}; c++)")
        self.line(f"{rows}[lid * {width} + c] = w * o[c0 + c];")
        self.close()
        self.line(d.barrier)
        self.open(f"for (int c = lid; c < {width} && c0 + c < {dv}; c += {t})")
        self.bind(last, "c0 + c")
        self.line("float sum = 0.0f;")
        self.line(f"for (int s = 0; s < {t}; s++) sum += {rows}[s * {width} + c];")
        self.store("sum * inv")
        self.close()
        self.line(d.barrier)  # the chunk is read by all before the next is written
        self.close()

    def _row_state(self, att: Any) -> None:
        """A query row's running max m, sum l and output o, and its own loads read once
        (`_row_loads`), in registers."""
        self.line(f"float m = -{self.d.inf}, l = 0.0f, o[{self.k.shape[-1]}];")
        self.line(f"for (int c = 0; c < {self.k.shape[-1]}; c++) o[c] = 0.0f;")
        for load, (name, width, w) in self._row_loads(att).items():  # the query's row, read once
            self.line(f"float {name}[{width}];")
            self.open(f"for (int {w} = 0; {w} < {width}; {w}++)", (w,))
            self.line(f"{name}[{w}] = {self.load(load)};")
            self.close()
            self.staged[load] = f"{name}[{w}]"

    def _online_step(self, att: Any) -> None:
        """The key bound to att.var into the row's state: max, rescaled sum, rescaled output."""
        d, dv, last = self.d, self.k.shape[-1], f"i{len(self.k.shape) - 1}"
        x = self.emit(att.x)
        exp2, log2e = d.math["exp2"], self.literal(att.scale, DType.float32)
        # a NaN score leaves the max alone and makes its term NaN; a row of -inf so far shifts by 0
        self.line(f"const float mn = {x} > m ? {x} : m;")
        self.line(f"const float sh = mn == -{d.inf} ? 0.0f : mn;")
        self.line(f"const float al = {exp2}((m - sh) * {log2e}), p = {exp2}(({x} - sh) * {log2e});")
        self.line("l = l * al + p;")
        self.line("m = mn;")
        self.open(f"for (int {last} = 0; {last} < {dv}; {last}++)", (last,))
        self.line(f"o[{last}] = o[{last}] * al + p * {self.emit(att.v)};")
        self.close()

    def _row_loads(self, att: Any) -> dict[Load, tuple[str, int, str]]:
        """The loads of the scores that read the row's own values along a reduction, not the key (the
        query's row): load -> (a private array, its width, the reduction's variable), read once per
        row rather than once per key, where the row is at most ROW_FLOATS long."""
        sizes = {r.var.name: r.size for r in reduces(att.x)}
        out = {}
        for load in dict.fromkeys(loads(att.x)):
            reads = free_vars(load, self.fv)
            along = [v for v in reads if v in sizes]
            if att.var.name not in reads and len(along) == 1 and sizes[along[0]] <= ROW_FLOATS \
                    and load.buffer not in self.packed and load.dtype is DType.float32:
                out[load] = (f"row{len(out)}", sizes[along[0]], along[0])
        return out

    def _staged_loads(self, att: Any, rows: int, t: int, extents: dict[str, int]) -> dict[Load, tuple]:
        """The loads of the scores and values that every row of a group reads alike, for a key j:
        load -> (shared array, its width, the other variable it reads along). Such a load reads
        along j and one other variable (a score's reduction, or the output's column) besides the
        row axes that are the same throughout a group (those whose inner axes hold a multiple of t
        rows). None where the rows do not fill whole groups, or a load is packed."""
        shape = self.k.shape[:-1]
        uniform = {f"i{a}" for a in range(len(shape)) if math.prod(shape[a + 1:]) % t == 0}
        if rows % t or not uniform:
            return {}
        extents = {**extents, **{r.var.name: r.size for r in reduces(att.x)}}
        out = {}
        for load in dict.fromkeys([*loads(att.x), *loads(att.v)]):
            along = free_vars(load, self.fv) - uniform - {att.var.name}
            if att.var.name in free_vars(load, self.fv) and len(along) == 1 and next(iter(along)) in extents \
                    and load.buffer not in self.packed and load.dtype is DType.float32:
                w = next(iter(along))
                out[load] = (f"kv{len(out)}", extents[w], w)
        return out

    def _tile(self) -> None:
        """Each group a TM x TN tile over TK-deep slices staged in shared memory, each thread a
        RM x RN register block: slice s + 1 is read into registers while slice s is computed on,
        then stored to shared memory (register double buffering hides the global reads)."""
        k, d = self.k, self.d
        c = tile_contraction(k)
        (tm, tn, tk), (rm, rn) = self.s.tile, self.s.micro
        ty, tx = tm // rm, tn // rn
        m, n, depth, slices = self._tile_grid(c, tm, tn, tk)
        self.line(f"const int tx = lid % {tx};")
        self.line(f"const int ty = lid / {tx};")
        rv, m_var, n_var = c.reduce.var.name, f"i{c.m_axis}", f"i{c.n_axis}"
        ops = [TileOperand(c.a, tm, m, m_var if c.m_axis is not None else None, "tm_", "As", "pa",
                            unit_stride(c.a, rv)),
               TileOperand(c.b, tn, n, n_var, "tn_", "Bs", "pb", unit_stride(c.b, rv))]
        for op in ops:
            self.shared[op.smem] = f"{d.shared}{d.shared_align} float {op.smem}[{tk * op.ld}];"
            self.line(f"float {op.regs}[{-(-tk * op.width // self.s.group_size)}];")
        accs = [[f"c{i}_{j}" for j in range(rn)] for i in range(rm)]
        for row in accs:
            self.line("float " + ", ".join(f"{x} = 0.0f" for x in row) + ";")
        self.open(f"for (int ks = 0; ks <= {slices}; ks++)")
        self._tile_prefetch(ops, rv, tk, depth, slices)
        self.open("if (ks > 0)")  # slice ks - 1, while slice ks's reads are in flight
        self.line("#pragma unroll")
        self.open(f"for (int kk = 0; kk < {tk}; kk++)")
        rows, cols = _lanes(rm, ty, "ty"), _lanes(rn, tx, "tx")
        for i, lane in enumerate(rows):
            self.line(f"const float a{i} = As[kk * {ops[0].ld} + {lane}];")
        for j, lane in enumerate(cols):
            self.line(f"const float b{j} = Bs[kk * {ops[1].ld} + {lane}];")
        for i in range(rm):
            for j in range(rn):
                self.line(f"{accs[i][j]} = {d.math['fma']}(a{i}, b{j}, {accs[i][j]});")
        self.close()
        self.close()
        self.line(d.barrier)
        self._tile_store(ops, tk, slices, lambda op: f"kk * {op.ld} + mm")
        self.line(d.barrier)
        self.close()
        for i, row in enumerate(rows):
            for j, col in enumerate(cols):
                self.open("")
                self.line(f"const int row = tm_ * {tm} + {row}, col = tn_ * {tn} + {col};")
                self.open(f"if (row < {m} && col < {n})")
                if c.m_axis is not None:
                    self.bind(m_var, "row")
                self.bind(n_var, "col")
                self.scope.remember(c.reduce, accs[i][j])
                self.store(self.emit(k.body))
                self.close()
                self.close()

    def _tile_grid(self, c: Any, tm: int, tn: int, tk: int) -> tuple[int, int, int, int]:
        """The launch of a contraction c in TM x TN tiles (a group per tile and batch index), its
        tile indices tm_ and tn_ and batch variables bound; returns (M, N, K, TK-deep slices)."""
        k = self.k
        m = k.shape[c.m_axis] if c.m_axis is not None else 1
        n, depth = k.shape[c.n_axis], c.reduce.size
        mt, nt = -(-m // tm), -(-n // tn)
        batch = [a for a in range(len(k.shape)) if a not in (c.m_axis, c.n_axis)]
        self.groups = math.prod(k.shape[a] for a in batch) * mt * nt
        self.cands = []
        self.ids()
        self.line(f"const int tn_ = gid % {nt};")
        self.line(f"const int tm_ = (gid / {nt}) % {mt};")
        self.unravel(f"(gid / {nt * mt})", batch)
        return m, n, depth, -(-depth // tk)

    def _tile_prefetch(self, ops: list[Any], rv: str, tk: int, depth: int, slices: int,
                       convert: str = "{}") -> None:
        """Read slice ks of each operand into its registers (op.regs), clamped into range and 0
        outside it, each value through convert (a template over the value)."""
        self.open(f"if (ks < {slices})")
        for op in ops:
            opened = self._tile_share(op, tk)
            self.line(f"const int row = {op.tile} * {op.width} + mm, kv = ks * {tk} + kk;")
            if op.var is not None:
                self.bind(op.var, f"row < {op.size} ? row : {op.size - 1}")
            self.bind(rv, f"kv < {depth} ? kv : {depth - 1}")
            v = self.emit(op.expr)
            self.line(f"{op.regs}[p] = {convert.format(f'(row < {op.size} && kv < {depth}) ? {v} : 0.0f')};")
            for _ in range(opened):
                self.close()
        self.close()

    def _tile_store(self, ops: list[Any], tk: int, slices: int, index: Callable[[Any], str]) -> None:
        """Store each operand's registers of slice ks to its shared array at index(op) (a C index
        over kk and mm): the operands of the next step."""
        self.open(f"if (ks < {slices})")
        for op in ops:
            opened = self._tile_share(op, tk)
            self.line(f"{op.smem}[{index(op)}] = {op.regs}[p];")
            for _ in range(opened):
                self.close()
        self.close()

    def _tile_share(self, op: Any, tk: int) -> int:
        """Open the loop over this thread's elements p of op's TK x width slice and bind q (the
        element), kk (its depth) and mm (its row of the tile); returns the blocks opened. op: an
        operand of the tile or the mma strategy (its `width` and `along_k`).
        Consecutive threads take consecutive addresses: along k where op is unit-stride in k (a
        row-major a, a transposed weight b), else along m or n."""
        t, size = self.s.group_size, tk * op.width
        self.line("#pragma unroll")
        self.open(f"for (int p = 0; p < {-(-size // t)}; p++)")
        self.line(f"const int q = lid + p * {t};")
        if size % t:
            self.open(f"if (q < {size})")
        if op.along_k:
            self.line(f"const int kk = q % {tk}, mm = q / {tk};")
        else:
            self.line(f"const int kk = q / {op.width}, mm = q % {op.width};")
        return 2 if size % t else 1


def _lanes(r: int, threads: int, var: str) -> list[str]:
    """A thread's r rows (or columns) of a tile, as offsets: groups of 4 consecutive ones, 4 *
    threads apart, that read from shared memory as 128-bit words free of bank conflicts across a
    warp; where r is not a multiple of 4, one every `threads`."""
    if r % 4:
        return [f"{var} + {i * threads}" for i in range(r)]
    return [f"{var} * 4 + {i // 4 * threads * 4 + i % 4}" for i in range(r)]


__all__ = ["RenderedKernel", "RenderedProgram", "c_index", "render_kernel", "render_program"]
