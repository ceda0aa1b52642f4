"""One kernel as an LLVM function `void k(ptr args, i64 lo, i64 hi)`: the slice [lo, hi) of its
outermost loop, which is how the thread pool splits it.

A generic kernel is a loop nest with its reductions hoisted to the loop level where their inputs
are known; LLVM's loop and SLP vectorisers widen the inner loops, which carry hints (vectors in
flight, and a forced vectorisation of rows shorter than the vectoriser's own threshold) computed
for the vector unit's lane count. Expressions are emitted once per scope (backends.scope.Scope)
and each op is emitted by the function `OPS` maps it to. Contractions are emitted by
contraction.ContractionEmitter, a subclass.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from functools import partial

import llvmlite.ir as ir
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
    Reduce,
    assume_in,
    axis_vars,
    children,
    free_vars,
    loads,
    mentioned_sizes,
    pruned,
    reduces,
    rewrite,
    walk,
)
from ...ir.dtypes import DType
from ...ir.symbolic import (
    BinOp,
    Expr,
    Num,
    Var,
    bounds,
    conjuncts,
    is_loop_var,
    is_range,
    logical_and,
    map_vars,
    ranges,
    rename,
    terms,
    upper,
    var_list,
    variables,
)
from ..scope import Scope
from .mathlib import math_function
from .scalar import (
    F32,
    I1,
    I8,
    I32,
    I64,
    PTR,
    REASSOC,
    accumulate,
    binary,
    cast,
    cast_int,
    constant,
    float_array,
    i64,
    identity,
    intrinsic,
    mem_type,
    reg_type,
    smin,
    store_through,
    vector_ptr,
    zero,
)

KERNEL_TYPE = ir.FunctionType(ir.VoidType(), [PTR, I64, I64])
SIZES = "<sizes>"  # the argument holding the run-time sizes (int64, in the program's order)
INTERLEAVE = 4  # vectors in flight in vectorised inner loops
VECTORIZER_MIN_TRIP = 16  # LLVM's loop vectoriser leaves loops shorter than this alone unless told
# rows this long are forced too where a vector is wider (AVX-512: an 8-wide row of an im2col copy
# runs in half vectors, not one float at a time)
HALF_VECTOR = 8
# rows at least SHORT_ROW long and shorter than VECTORIZER_MIN_TRIP that fill no whole vectors run
# masked, each row one iteration of as many vectors as it needs, its masks then constants: computed
# per vector, rows of 10 to 14 at 8 lanes ran 2-3x slower (relu, SiLU, hardswish over 128 to 672
# channels, znver3). Longer rows keep a scalar tail: masked, a row of 20 ran slower (relu 3x).
SHORT_ROW = 4
TINY_ROW = 4  # an innermost axis this short is unrolled into the loop around it, which vectorises
MAX_PIECES = 64  # most ranges a loop is split into where masks change along it (a concatenation's parts)
UNROLL_REDUCE = 4  # reductions this short are emitted unrolled
# and longer ones whose unrolled code stays this small (a depthwise convolution's 7x7 taps): the
# loop around them then vectorises; larger straight-line bodies cost LLVM seconds to optimise
UNROLL_OPS = 160
# a reduction along the innermost axis too long to unroll (a 9x9 depthwise convolution's taps, a
# 13x13 max pool) runs in passes over a row of this many accumulators, each pass unrolling a chunk
# of its terms, so that the loop along the row still vectorises: one 96-channel 9x9 depthwise
# convolution at 28x28 on znver4, 9.8 ms as a loop over taps per element -> 0.24 ms
PASS_ROW = 1024
# a read that steps by one along the rows and with a stride along the row or a reduction's terms (a
# channels-first value read channels-last: a transpose, a LayerNorm over channels) is staged for
# STAGE_ROWS rows at a time: a line of each is copied into a tile on the stack, which the rows then
# read. Read in place, each vector gathers from as many lines as lanes, and at strides of 4 KB they
# all fall in one L1 set: a 48x1024 transpose took 147 us, a LayerNorm over its channels 417 us.
STAGE_ROWS = 16
# the L1 data cache as far as strided reads are concerned: 64-byte lines in 64 sets (4 KB apart: Intel's
# 48 KB and AMD's 32 KB L1s alike), 8 ways at least
LINE_FLOATS, L1_SETS, L1_WAYS = 16, 64, 8
STAGE_MAX = 256  # most elements of a row and its reductions' terms one staged read may cover
STAGE_STEP = 4  # the largest step along the rows a staged read may take (its tile holds the gaps too)
ROW_OPS = 2 * UNROLL_OPS  # most unrolled ops of a row's reductions together before they run in passes
COMBINE = {"sum": "add", "max_reduce": "max"}  # the binary op that folds each reduction
LOOP_HINT = "eclat.loop.hint"  # Jitted turns this into a distinct self-referencing loop id


class KernelEmitter:
    """Emits one generic kernel (loops, hoisted reductions) for a vector unit of `lanes` float32
    lanes. arg_names: the buffers the function takes, in order; used: those its code dereferences."""

    inner_loops = True  # whether innermost loops get vectoriser hints
    # whether its stores are an alias scope its other loads are outside of (`function`); a
    # contraction's micro-kernel, its loads in the order written, ran 2-20% slower with them
    # (shufflenet's last 1x1 convolution and classifier)
    scoped = True

    def __init__(self, mod: ir.Module, kernel: Kernel, buffers: dict[str, Buffer],
                 packed: dict[str, np.ndarray], lanes: int):
        self.mod, self.k, self.buffers, self.packed, self.lanes = mod, kernel, buffers, packed, lanes
        # arguments in order of first use, so that kernels equal up to names look equal
        self.arg_names = list(dict.fromkeys([x.buffer for x in loads(kernel.body)] + [kernel.out] +
                                            [sd.out for sd in kernel.sides] +
                                            ([kernel.scratch] if kernel.scratch else [])))
        self.pack_name: str | None = None  # a weight packed at compile time, read instead of its source
        self.pack_format: str | None = None  # its low-precision format (compiler.quantize), None: float32
        self.used = set(self.arg_names)  # what the code dereferences: not a weight it reads packed
        self.size_slots: dict[Var, int] = {}  # run-time sizes it reads -> their place in SIZES
        shape = kernel.shape
        # an innermost axis of a few elements ([.., w, 2]: a Winograd tile's columns) is unrolled and
        # the axis before it runs as the row: its stores interleave, which the vectoriser handles
        self.tiny_last = len(shape) >= 2 and isinstance(shape[-1], int) and 1 < shape[-1] <= TINY_ROW \
            and upper(shape[-2]) > 1 and not kernel.sides
        last = f"i{len(shape) - 1 - self.tiny_last}"  # whether it reads along its row with a stride
        self.strided_rows = any(c not in (0, 1) for x in loads(kernel.body) if isinstance(x, Load)
                                for c, a in terms(x.index) if isinstance(a, Var) and a.name == last)

    def read_sizes(self, sizes: Sequence[Var]) -> None:
        """Take the program's run-time sizes that this kernel mentions from the SIZES argument."""
        named = mentioned_sizes(self.k)
        self.size_slots = {v: j for j, v in enumerate(sizes) if v.name in named}
        if self.size_slots:
            self.arg_names.append(SIZES)
            self.used.add(SIZES)

    def key(self) -> str:
        """The kernel's code with its buffers named by argument position."""
        canon = {n: f"arg{j}:{self.buffers[n].numel if n in self.buffers else n}"
                 for j, n in enumerate(self.arg_names)}
        text = str(self.k.body) + "".join(f"|sum:{sd.body}" for sd in self.k.sides)
        body = re.sub(r"buffer='([^']*)'", lambda m: f"buffer={canon[m.group(1)]}", text)
        rvars: dict[str, str] = {}  # reduce variables are named after graph positions
        body = re.sub(r"\br\d+\b", lambda m: rvars.setdefault(m.group(0), f"r#{len(rvars)}"), body)
        packed = self.pack_name is not None and (self.pack_format or "f32")
        sizes = {f"{v.name}[{v.lo},{v.hi}]": j for v, j in self.size_slots.items()}
        return f"{self.k.shape}|{self.k.schedule}|{canon[self.k.out]}|{packed}|{sizes}|{body}"

    def function(self, name: str) -> int:
        """Emit the function `name` (module-visible: codegen compiles it in a module of its own); returns
        the length of its outermost (parallel) loop."""
        self.fn = ir.Function(self.mod, KERNEL_TYPE, name)
        self.fn.attributes.add("noinline")  # called by eclat_run and a profiling entry: one copy
        self.b = ir.IRBuilder(self.fn.append_basic_block("entry"))
        self.scope: Scope[ir.Value] = Scope()
        self.ptr = {n: self.b.load(self.b.gep(self.fn.args[0], [i64(j)], source_etype=PTR), typ=PTR)
                    for j, n in enumerate(self.arg_names)}
        for v, j in self.size_slots.items():
            at = self.b.gep(self.ptr[SIZES], [i64(j)], source_etype=I64)
            self.scope.bind(v.name, self.b.load(at, typ=I64))
        self.fv_memo: dict = {}
        self._nested = False
        # what it writes is one alias scope its loads of other buffers are outside of: no buffer it
        # reads lies where it writes (the memory plan), which LLVM cannot see through the slots,
        # and so checked at run time before vectorising (or gave up on)
        domain = self.mod.add_metadata([ir.MetaDataString(self.mod, "eclat.buffers")])
        self.written_scope = self.mod.add_metadata([self.mod.add_metadata(
            [ir.MetaDataString(self.mod, "eclat.written"), domain])])
        self.written = {self.k.out, *(sd.out for sd in self.k.sides), self.k.scratch} - {None}
        outer = self.body()
        self.b.ret_void()
        return outer

    def var(self, name: str) -> ir.Value:
        try:
            return self.scope.var(name)
        except KeyError:
            raise KeyError(f"index variable {name} is not bound in kernel {self.k.name}") from None

    # --- loops ------------------------------------------------------------------------------
    def loop(self, start: ir.Value, stop: ir.Value, inits: Sequence[ir.Value],
             body: Callable[[ir.Value, list[ir.Value]], list[ir.Value]],
             hint: bool | None = None, unroll: int | None = None, row: bool = False) -> list[ir.Value]:
        """for i in [start, stop): accs = body(i, accs); returns the final accs. hint: whether an
        innermost loop gets vectoriser hints (default: the emitter's inner_loops); unroll: the
        vectors it keeps in flight (default: the schedule's); row: it runs along the output's
        innermost axis."""
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
        with self.scope.nested():
            self._nested = False
            new = body(i, list(phis))
        latch = b.block
        nxt = b.add(i, i64(1))
        nxt.flags.append("nsw")
        br = b.cbranch(b.icmp_signed("<", nxt, stop), header, exit_)
        if (self.inner_loops if hint is None else hint) and not self._nested:
            trip = stop.constant - start.constant if isinstance(start, ir.Constant) and \
                isinstance(stop, ir.Constant) else None
            count = unroll or (self.k.schedule.unroll if self.k.schedule.unroll > 1 else
                               max(1, INTERLEAVE // self.k.schedule.jam) if row else INTERLEAVE)
            br.set_metadata("llvm.loop", loop_hint(self.mod, count, self.lanes, trip, self.strided_rows,
                                                   row and self.strided_rows))
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

    def hoist(self, candidates: list[KExpr]) -> None:
        """Evaluate every candidate (a reduce, a gather's row) whose variables are all bound now."""
        bound = self.scope.bound()
        for r in candidates:
            if free_vars(r, self.fv_memo) <= bound and self.scope.cached(r) is None:
                self.emit(r)

    # --- generic kernels ---------------------------------------------------------------------
    def body(self) -> int:
        """The kernel's loops; returns the length of the outermost."""
        k = self.k
        cands = reduces(k.body)
        shape = k.shape
        vars_ = axis_vars(shape)
        if 0 in shape:
            return 0
        # leading unit axes are constants, so the first real axis is the one threads split
        lead = next((d for d, n in enumerate(shape) if upper(n) > 1), max(len(shape) - 1, 0))
        for d in range(lead):
            self.scope.bind(vars_[d].name, i64(0))
        self.hoist(cands)
        if not shape:
            self.store(k.out, Num(0), self.emit(k.body), k.body.dtype)
            return 1

        self._axis(k.body, lead, self.fn.args[1], self.fn.args[2])
        return shape[lead]

    def _axis(self, body: KExpr, d: int, start: ir.Value, stop: ir.Value) -> None:
        """The loop over axis d from start to stop, and the loops inside it, storing body. Where
        masks that depend on axis d alone change along it (the parts of a concatenation), it
        runs in pieces, each with its masks folded away: a mask per element is a branch per
        load, and keeps the inner loops from vectorising."""
        k, vars_ = self.k, axis_vars(self.k.shape)
        shape = k.shape
        for lo, hi, piece in self._pieces(body, d):
            # a gather's row is computed in the loop over the axes it depends on, not per element
            # (in the innermost loop its table loads keep the loop from vectorising)
            cands = [*reduces(piece), *(x.idx for x in walk(piece) if isinstance(x, Gather))]
            pad = self._pad_split(piece) if d + 1 < len(shape) else None
            inside = self._interior(piece) if pad is None and not k.sides and d + 1 < len(shape) else None

            def level(dd: int, i: ir.Value, _accs: list, piece=piece, cands=cands, pad=pad, inside=inside
                      ) -> list:
                self.scope.bind(vars_[dd].name, i)
                self.hoist(cands)
                if dd + 2 == len(shape) and self.tiny_last:
                    self._unrolled_row(vars_, piece)
                elif dd + 2 == len(shape) and pad is not None:
                    self._padded_row(vars_, *pad)
                elif dd + 2 == len(shape) and inside is not None:
                    self._split_row(vars_, piece, *inside)
                elif dd + 2 <= len(shape) and self._in_pieces(piece, dd + 1):
                    self._axis(piece, dd + 1, i64(0), self.sym(shape[dd + 1]))
                elif dd + 2 == len(shape) and k.sides:
                    self._row_with_sides(vars_, cands)
                elif dd + 2 == len(shape) and (long := self._long_reduces(piece)):
                    self._row_in_passes(vars_, piece, long)
                elif dd + 3 == len(shape) and self._transposed(piece, dd + 1):
                    self._axis(piece, dd + 1, i64(0), self.sym(shape[dd + 1]))
                elif dd + 1 < len(shape) and self._jams(piece, dd + 1):
                    self._jammed(dd + 1, i64(0), self.sym(shape[dd + 1]), piece,
                                 lambda i2, a: level(dd + 1, i2, a, piece, cands, pad, inside))
                elif dd + 1 < len(shape):
                    self.loop(i64(0), self.sym(shape[dd + 1]), [],
                              lambda i2, a: level(dd + 1, i2, a, piece, cands, pad, inside),
                              row=dd + 2 + self.tiny_last == len(shape))
                else:
                    self.store(k.out, ravel(vars_, shape), self.emit(piece), piece.dtype)
                return []

            first, last = start, stop
            if lo > 0:
                first = self.b.select(self.b.icmp_signed("<", start, i64(lo)), i64(lo), start)
            if hi + 1 < upper(shape[d]):
                last = self.b.select(self.b.icmp_signed(">", stop, i64(hi + 1)), i64(hi + 1), stop)
            staged = self._transposed(piece, d)
            one_row = d + 1 == len(shape) and not self.tiny_last and not k.sides
            if staged:
                self._staged_rows(d, first, last, piece, staged, level)
            elif one_row and (long := self._long_reduces(piece)):  # a kernel that is one row
                self._row_in_passes(vars_, piece, long, first, last)
            elif self._jams(piece, d):
                self._jammed(d, first, last, piece, lambda i, a, lv=level: lv(d, i, a))
            else:
                self.loop(first, last, [], lambda i, a, lv=level: lv(d, i, a),
                          row=d + 1 + self.tiny_last == len(shape))

    def _transposed(self, body: KExpr, d: int) -> list[tuple[Load, int, list[tuple[Var, int]]]]:
        """Where axis d holds the rows (the one before the innermost): body's float32 loads that step
        by a few elements along the rows (one to STAGE_STEP: a patch's pixels interleaved) and by a
        block's span or more along the row or a reduction's terms, each with its step along the rows,
        and those variables and their strides in the tile (`_staged_rows`), where together they take
        at most STAGE_MAX values; [] where there is none."""
        k, rows = self.k, f"i{d}"
        if d + 2 != len(k.shape) or self.tiny_last or k.sides or not isinstance(k.shape[-1], int) \
                or not isinstance(k.shape[d], int) or k.shape[d] < 2 * STAGE_ROWS:
            return []
        moving = {f"i{d + 1}": Var(f"i{d + 1}", 0, k.shape[-1] - 1)}
        moving |= {r.var.name: r.var for r in reduces(body)}
        out = []
        for x in dict.fromkeys(x for x in loads(body) if isinstance(x, Load)):
            coef: dict[str, int] = {}
            for c, a in terms(x.index):
                if a is not None:  # a term other than a variable times a number stages nothing ("")
                    name = a.name if isinstance(a, Var) else ""
                    coef[name] = coef.get(name, 0) + c
            along = [v for v in coef if v in moving and coef[v]]
            fixed = all(v in moving or v == rows or (is_loop_var(v) and v[0] == "i" and int(v[1:]) < d)
                        for v in coef)  # the outer axes are bound when the rows run
            extent = math.prod(moving[v].hi - moving[v].lo + 1 for v in along)
            step = coef.get(rows, 0)
            if x.valid != Num(1) or x.dtype is not DType.float32 or not 1 <= step <= STAGE_STEP or not fixed \
                    or not any(abs(coef[v]) >= STAGE_ROWS * step for v in along) or extent > STAGE_MAX:
                continue
            radix, tile = [], STAGE_ROWS * step
            for v in reversed(along):
                radix.append((moving[v], tile))
                tile *= moving[v].hi - moving[v].lo + 1
            out.append((x, step, radix[::-1]))
        return out

    def _staged_rows(self, d: int, first: ir.Value, last: ir.Value, body: KExpr,
                     staged: list[tuple[Load, int, list[tuple[Var, int]]]], level: Callable) -> None:
        """The rows first..last in blocks of STAGE_ROWS: each staged read's span for every value of
        the row and terms it moves along is copied into a tile on the stack (`step` vectors per
        value, from where the block's first row reads it), and the block's rows read the tile (the
        rest, fewer than a block, read in place)."""
        b, rows = self.b, f"i{d}"
        within = Var(f"i{len(self.k.shape)}", 0, STAGE_ROWS - 1)  # the row in its block: one axis more
        mapping: dict[KExpr, KExpr] = {}
        for j, (x, step, radix) in enumerate(staged):
            at: Expr = within * step
            for v, stride in radix:
                at = at + (v - v.lo) * stride
            mapping[x] = Load(f"stage{j}", at, Num(1), x.dtype)
        inner = rewrite(body, mapping)
        # reductions each row takes once (not along the row) of what the tiles hold: computed for the
        # block's rows together, a loop along them that vectorises (the tiles run along the rows)
        bound = {rows, within.name, *(f"i{a}" for a in range(d))}
        tiled = set(mapping.values())
        per_row = sorted((r for r in dict.fromkeys(reduces(inner)) if r.dtype is DType.float32
                          and r.op in COMBINE and isinstance(r.size, int)
                          and free_vars(r, self.fv_memo) <= bound and any(x in tiled for x in loads(r))),
                         key=lambda r: len(reduces(r.body)))
        here = b.block
        b.position_at_start(self.fn.entry_basic_block)  # one array each, not one per loop trip
        tiles = [float_array(b, radix[0][1] * (radix[0][0].hi - radix[0][0].lo + 1))
                 for _, _, radix in staged]
        sums = [float_array(b, STAGE_ROWS) for _ in per_row]
        b.position_at_end(here)
        self.ptr.update((f"stage{j}", tile) for j, tile in enumerate(tiles))
        cands = [*reduces(inner), *(x.idx for x in walk(inner) if isinstance(x, Gather))]
        pad = self._pad_split(inner)
        inside = self._interior(inner) if pad is None else None
        vec = ir.VectorType(F32, STAGE_ROWS)

        def fill(x: Load, step: int, radix: list[tuple[Var, int]], tile: ir.Value, start: ir.Value) -> None:
            def level_(u: int, offset: ir.Value) -> None:
                if u == len(radix):
                    for w in range(step):  # the last vector ends at the last row's element, not past it
                        shift = w * STAGE_ROWS - (step - 1 if w == step - 1 else 0)
                        line = b.load(vector_ptr(b, self.ptr[x.buffer], b.add(self.sym(x.index), i64(shift))),
                                      typ=vec, align=4)
                        store_through(b, line, vector_ptr(b, tile, b.add(offset, i64(shift))))
                    return
                v, stride = radix[u]

                def one(i: ir.Value, _a: list) -> list:
                    self.scope.bind(v.name, i)
                    level_(u + 1, b.add(offset, b.mul(b.sub(i, i64(v.lo)), i64(stride))))
                    return []
                self.loop(i64(v.lo), i64(v.hi + 1), [], one, hint=False)
            with self.scope.nested():
                self.scope.bind(rows, start)
                level_(0, i64(0))

        def block(n: ir.Value, _a: list) -> list:
            start = b.add(first, b.mul(n, i64(STAGE_ROWS)))
            for (x, step, radix), tile in zip(staged, tiles):
                fill(x, step, radix, tile, start)

            def taken(i: ir.Value, upto: int) -> None:
                self.scope.bind(within.name, i)
                for r, arr in zip(per_row[:upto], sums):
                    self.scope.remember(r, b.load(b.gep(arr, [i], source_etype=F32)))
            for j, (r, arr) in enumerate(zip(per_row, sums)):  # term by term, each along the rows
                def term(t: ir.Value, _a: list, j=j, r=r, arr=arr) -> list:
                    def each(i: ir.Value, _b: list) -> list:
                        taken(i, j)
                        self.scope.bind(rows, b.add(start, i))
                        at = b.gep(arr, [i], source_etype=F32)
                        acc = b.select(b.icmp_signed("==", t, i64(0)), identity(r.op, r.dtype), b.load(at))
                        b.store(self._accumulate(r, reduces(r.body), t, acc, loop=False), at)
                        return []
                    self.loop(i64(0), i64(STAGE_ROWS), [], each)
                    return []
                self.loop(i64(0), i64(r.size), [], term, hint=False)

            def row(i: ir.Value, accs: list) -> list:
                taken(i, len(per_row))
                return level(d, b.add(start, i), accs, piece=inner, cands=cands, pad=pad, inside=inside)
            self.loop(i64(0), i64(STAGE_ROWS), [], row, hint=False)
            return []
        blocks = b.sdiv(b.sub(last, first), i64(STAGE_ROWS))
        self.loop(i64(0), blocks, [], block, hint=False)
        self.loop(b.add(first, b.mul(blocks, i64(STAGE_ROWS))), last, [], lambda i, a: level(d, i, a))

    def _in_pieces(self, body: KExpr, d: int) -> bool:
        """Whether axis d's loop runs in pieces (`_pieces`): along the innermost axis only where the
        row is two vectors or longer (a short row's masks, its edges, run as masked vectors)."""
        return not self.k.sides and len(self._pieces(body, d)) > 1 and \
            (d + 1 < len(self.k.shape) or upper(self.k.shape[d]) >= 2 * self.lanes)

    def _pieces(self, body: KExpr, d: int) -> list[tuple[int, int, KExpr]]:
        """(lo, hi, body with axis d known to lie in lo..hi) for the ranges of axis d over which every
        mask that depends on it alone is constant; one piece where there is no such mask (or the
        ranges would be too many: code grows with them)."""
        var, n = f"i{d}", self.k.shape[d]
        whole = [(0, upper(n) - 1, body)]
        if not isinstance(n, int) or self.k.sides:
            return whole
        cuts = {0, n}
        for atom in {a for e in _masks(body) for a in conjuncts(e)}:
            if variables(atom) != {var}:
                continue
            span = _holds_for(atom, var, 0, n - 1)
            if span is None:
                return whole
            cuts |= {c for c in (span[0], span[1] + 1) if 0 < c < n}
        if len(cuts) == 2 or len(cuts) > MAX_PIECES + 1:
            return whole
        out = []
        for lo, stop in zip(sorted(cuts), sorted(cuts)[1:]):
            nv = Var(var, lo, stop - 1)
            narrowed = lambda v, nv=nv: nv if v.name == var else v  # noqa: E731
            piece = pruned(rewrite(body, index=lambda x, narrowed=narrowed: map_vars(x, narrowed)))
            if any(variables(a) == {var} for e in _masks(piece) for a in conjuncts(e)):
                return whole  # a mask the ranges did not fold
            out.append((lo, stop - 1, piece))
        return out

    def _unrolled_row(self, vars_: list[Var], body: KExpr) -> None:
        """The innermost axis's few elements, each stored with its index known (its masks folded)."""
        last = vars_[-1].name
        for j in range(self.k.shape[-1]):
            with self.scope.nested():
                fixed = lambda v, j=j: Num(j) if v.name == last else v  # noqa: E731
                at = pruned(rewrite(body, index=lambda x, fixed=fixed: map_vars(x, fixed)))
                self.scope.bind(last, i64(j))
                self.hoist(reduces(at))
                self.store(self.k.out, ravel(vars_, self.k.shape), self.emit(at), at.dtype)

    def _jams(self, body: KExpr, d: int) -> bool:
        """Whether the loop over axis d, the next to last, runs its indices `Schedule.jam` at a time
        (the plain row's cases only: no masks along the row, no sums beside it or in passes)."""
        shape = self.k.shape
        return self.k.schedule.jam > 1 and d == len(shape) - 2 and not self.tiny_last and not self.k.sides \
            and isinstance(shape[d], int) and shape[d] >= self.k.schedule.jam \
            and self._pad_split(body) is None and self._interior(body) is None \
            and not self._long_reduces(body) and not self._in_pieces(body, d + 1)

    def _jammed(self, d: int, first: ir.Value, last: ir.Value, body: KExpr,
                one: Callable[[ir.Value, list], list]) -> None:
        """Axis d from first to last in blocks of `jam` indices, each block one loop along the row
        computing every index's element before storing any (so that LLVM loads what they share,
        a filter's tap, once); the indices left over as one block where their number is known (a
        7-pixel row in blocks of 4: 4 and 3), else one at a time (`one`)."""
        jam, b = self.k.schedule.jam, self.b
        count = b.sdiv(b.sub(last, first), i64(jam))
        self.loop(i64(0), count, [], lambda j, _a: self._block(d, b.add(first, b.mul(j, i64(jam))), body,
                                                               jam))
        rest = b.add(first, b.mul(count, i64(jam)))
        if isinstance(first, ir.Constant) and isinstance(last, ir.Constant) and \
                (left := (last.constant - first.constant) % jam) > 1:
            self._block(d, rest, body, left)
        else:
            self.loop(rest, last, [], one)

    def _block(self, d: int, start: ir.Value, body: KExpr, rows: int) -> list:
        """Indices start .. start + rows - 1 of axis d (the next to last), one loop along the row."""
        shape = self.k.shape
        vars_ = axis_vars(shape)
        name, row = vars_[d].name, vars_[d + 1].name
        block = Var(f"{name}_jam", 0, upper(shape[d]) - 1)
        at = lambda u: lambda v: block + Num(u) if v.name == name else v  # noqa: E731
        copies = [(pruned(rewrite(body, index=lambda x, u=u: map_vars(x, at(u)))),
                   map_vars(ravel(vars_, shape), at(u))) for u in range(rows)]
        cands = [r for e, _ in copies for r in reduces(e)]

        def element(i: ir.Value, _a: list) -> list:
            self.scope.bind(row, i)
            self.hoist(cands)
            values = [self.emit(e) for e, _ in copies]
            for (e, where), v in zip(copies, values):
                self.store(self.k.out, where, v, e.dtype)
            return []

        with self.scope.nested():
            self.scope.bind(block.name, start)
            self.hoist(cands)
            self.loop(i64(0), self.sym(shape[d + 1]), [], element, row=True)
        return []

    def _row_with_sides(self, vars_: list[Var], cands: list[Reduce]) -> None:
        """The last axis: each value stored, and each side sum accumulated from it."""
        k = self.k
        where = ravel(vars_, k.shape)
        own = Load(k.out, where, Num(1), k.body.dtype)

        def element(i: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            self.scope.bind(vars_[-1].name, i)
            self.hoist(cands)
            v = self.emit(k.body)
            self.store(k.out, where, v, k.body.dtype)
            self.scope.remember(own, v)
            return [accumulate(self.b, "add", acc, self.emit(sd.body), DType.float32)
                    for acc, sd in zip(accs, k.sides)]

        sums = self.loop(i64(0), self.sym(k.shape[-1]), [zero(DType.float32)] * len(k.sides), element)
        row = ravel(vars_[:-1], k.shape[:-1])
        for sd, value in zip(k.sides, sums):
            self.store(sd.out, row, value, DType.float32)

    def _long_reduces(self, body: KExpr) -> list[tuple[Reduce, int]]:
        """The reductions of body that change along the innermost axis, each with how many of its
        terms a pass unrolls, where one of them is too long to unroll or together they are (a
        strided 11x11 depthwise convolution's four phases: 121 taps, 4.6 GFLOP/s as one body,
        which LLVM left mostly scalar), every one is a float sum or max of a body that unrolls
        and reads along the row contiguously or not at all, and the row is a vector or longer
        and of a size known now; [] otherwise."""
        last = f"i{len(self.k.shape) - 1}"
        if not isinstance(self.k.shape[-1], int) or self.k.shape[-1] < self.lanes:
            return []  # a row shorter than a vector gains nothing from running along it
        along = [r for r in reduces(body) if last in free_vars(r, self.fv_memo)]
        outer = [r for r in along if not any(o is not r and r in reduces(o.body) for o in along)]
        if all(_unrolls(r) for r in outer) and sum(_tree_ops(r, ROW_OPS) for r in outer) <= ROW_OPS \
                and not any(_aliased(r) for r in outer):
            return []
        long = []
        for r in outer:
            per = _tree_ops(r.body, UNROLL_OPS)
            reads = [x for x in walk(r.body) if isinstance(x, (Load, Gather)) and last in free_vars(x)]
            if r.op not in COMBINE or r.dtype is not DType.float32 or not isinstance(r.size, int) or \
                    per > UNROLL_OPS or not all(isinstance(x, Load) and steps_by_one(x.index, last)
                                                for x in reads):
                return []
            long.append((r, max(1, min(UNROLL_OPS // per, _aliased(r) or UNROLL_OPS))))
        return long

    def _row_in_passes(self, vars_: list[Var], body: KExpr, long: list[tuple[Reduce, int]],
                       first: ir.Value | None = None, end: ir.Value | None = None) -> None:
        """The innermost axis (from first to end: a thread's part of a kernel that is one row) in
        segments of PASS_ROW elements; in each, every long reduction (`_long_reduces`) accumulates
        in a row on the stack, a chunk of its terms per pass over the row (straight-line code in a
        loop along the row, which vectorises), then the body is stored reading the rows."""
        b, k = self.b, self.k
        n, last = k.shape[-1], vars_[-1].name
        first = i64(0) if first is None else first
        end = i64(n) if end is None else end
        seg = min(n, PASS_ROW)
        here = b.block
        b.position_at_start(self.fn.entry_basic_block)  # one row per reduction, not one per loop trip
        rows = [float_array(b, seg) for _ in long]
        b.position_at_end(here)
        where = ravel(vars_, k.shape)

        def segment(s: ir.Value, _a: list) -> list:
            start = b.add(first, b.mul(s, i64(seg)))
            left = b.sub(end, start)
            stop = smin(b, left, i64(seg))

            def along(fill: Callable[[ir.Value], None]) -> None:
                def element(p: ir.Value, _b: list) -> list:
                    self.scope.bind(last, b.add(start, p))
                    fill(p)
                    return []
                self.loop(i64(0), stop, [], element, row=True)

            for (r, chunk), row in zip(long, rows):
                cands = reduces(r.body)

                def terms_(first: ir.Value, count: int, into: bool, r=r, cands=cands, row=row) -> None:
                    def fill(p: ir.Value) -> None:
                        at = b.gep(row, [p], source_etype=F32)
                        acc = b.load(at) if into else identity(r.op, r.dtype)
                        for u in range(count):
                            with self.scope.nested():
                                acc = self._accumulate(r, cands, b.add(first, i64(u)), acc, loop=False)
                        b.store(acc, at)
                    along(fill)

                whole, rest = divmod(r.size, chunk)
                terms_(i64(0), min(chunk, r.size), into=False)
                if whole > 1:
                    self.loop(i64(1), i64(whole), [], lambda c, _c, t=terms_, n_=chunk: t(
                        b.mul(c, i64(n_)), n_, into=True) or [], hint=False)
                if rest and whole:
                    terms_(i64(whole * chunk), rest, into=True)

            def final(p: ir.Value) -> None:
                for (r, _), row in zip(long, rows):
                    self.scope.remember(r, b.load(b.gep(row, [p], source_etype=F32)))
                self.hoist(reduces(body))
                self.store(k.out, where, self.emit(body), body.dtype)
            along(final)
            return []
        self.loop(i64(0), b.sdiv(b.add(b.sub(end, first), i64(seg - 1)), i64(seg)), [], segment, hint=False)

    def _pad_split(self, body: KExpr) -> tuple[Expr, int, int, KExpr] | None:
        """For a padding kernel, where(mask, x, 0) or a load valid under mask at the top, with the
        innermost axis bounded by the mask: (the mask's other terms, the interior lo..hi, x
        simplified under the mask).
        Rows are then written as zeros | x unmasked | zeros, which vectorise; a per-element
        mask and clamped reads do not."""
        last = f"i{len(self.k.shape) - 1}"
        if not isinstance(self.k.shape[-1], int):
            return None
        if isinstance(body, Op) and body.op == "where" and isinstance(body.srcs[0], Index) \
                and isinstance(body.srcs[2], Const) and body.srcs[2].value == 0:
            cond, x = body.srcs[0].expr, body.srcs[1]
        elif isinstance(body, Load) and body.valid != Num(1):  # a padded copy
            cond, x = body.valid, dataclasses.replace(body, valid=Num(1))
        else:
            return None
        terms_ = conjuncts(cond)
        inner = [t for t in terms_ if last in variables(t)]
        if not inner or not all(is_range(t) for t in inner):
            return None
        lo, hi = ranges(cond)[last]
        outer: Expr = Num(1)
        for t in terms_:
            if t not in inner:
                outer = logical_and(outer, t)
        return outer, lo, hi, assume_in(x, cond)

    def _interior(self, body: KExpr) -> tuple[int, int, KExpr] | None:
        """For a kernel whose masks bound its innermost axis (a pooling window or a convolution's
        taps reading through padding): the interior lo..hi where every such mask holds whatever the
        reduction variables are, and the body there, its masks folded away. Rows then run masked
        at their edges only: a mask per element keeps the loop from vectorising."""
        k, last = self.k, f"i{len(self.k.shape) - 1}"
        if not isinstance(k.shape[-1], int):
            return None
        atoms = [a for e in _masks(body) for a in conjuncts(e) if last in variables(a)]
        if not atoms:
            return None
        lo, hi = 0, k.shape[-1] - 1
        for atom in atoms:
            span = _holds_for(atom, last, lo, hi)
            if span is None:
                return None
            lo, hi = span
        if hi - lo + 1 < self.lanes:
            return None
        narrowed = Var(last, lo, hi)
        inner = rewrite(body, index=lambda x: map_vars(x, lambda v: narrowed if v.name == last else v))
        if any(last in variables(e) for e in _masks(inner)):
            return None  # a mask the ranges did not fold
        return lo, hi, inner

    def _split_row(self, vars_: list[Var], body: KExpr, lo: int, hi: int, inner: KExpr) -> None:
        """The last axis as masked edges around an unmasked interior (`_interior`)."""
        k = self.k
        where = ravel(vars_, k.shape)

        def run(start: int, stop: int, body: KExpr) -> None:
            cands = reduces(body)

            def element(i: ir.Value, _a: list) -> list:
                self.scope.bind(vars_[-1].name, i)
                self.hoist(cands)
                self.store(k.out, where, self.emit(body), body.dtype)
                return []
            if start < stop:
                self.loop(i64(start), i64(stop), [], element)
        run(0, lo, body)
        run(lo, hi + 1, inner)
        run(hi + 1, k.shape[-1], body)

    def _padded_row(self, vars_: list[Var], outer: Expr, lo: int, hi: int, x: KExpr) -> None:
        k, b = self.k, self.b
        n, dt = k.shape[-1], k.body.dtype
        where = ravel(vars_, k.shape)

        def zeros(start: int, stop: int) -> None:
            def body(i: ir.Value, _a: list) -> list:
                self.scope.bind(vars_[-1].name, i)
                self.store(k.out, where, zero(dt), dt)
                return []
            self.loop(i64(start), i64(stop), [], body)

        def interior(i: ir.Value, _a: list) -> list:
            self.scope.bind(vars_[-1].name, i)
            self.hoist(self.x_reduces)
            self.store(k.out, where, self.emit(x), dt)
            return []

        self.x_reduces = reduces(x)
        with b.if_else(b.icmp_signed("!=", self.sym(outer), i64(0))) as (then, otherwise):
            with then:
                zeros(0, max(lo, 0))
                self.hoist(self.x_reduces)
                self.loop(i64(max(lo, 0)), i64(min(hi + 1, n)), [], interior)
                zeros(min(hi + 1, n), n)
            with otherwise:
                zeros(0, n)

    def store(self, buf: str, index: Expr, v: ir.Value, dt: DType) -> None:
        if dt is DType.bool:
            v = self.b.zext(v, I8)
        elif dt is DType.float16:
            v = self.b.fptrunc(v, mem_type(dt))
        at = self.b.gep(self.ptr[buf], [self.sym(index)], inbounds=True, source_etype=mem_type(dt))
        stored = self.b.store(v, at)
        if self.scoped:
            stored.set_metadata("alias.scope", self.written_scope)

    # --- index arithmetic --------------------------------------------------------------------
    def sym(self, e: Expr) -> ir.Value:
        if isinstance(e, int):
            return i64(e)
        if isinstance(e, Num):
            return i64(e.v)
        if isinstance(e, Var):
            return self.var(e.name)
        key = ("sym", e)
        hit = self.scope.cached(key)
        if hit is not None:
            return hit
        assert isinstance(e, BinOp)
        v = INDEX_OPS[e.op](self.b, self.sym(e.a), self.sym(e.b))
        return self.scope.remember(key, v)

    # --- values ------------------------------------------------------------------------------
    def emit(self, e: KExpr) -> ir.Value:
        hit = self.scope.cached(e)
        if hit is not None:
            return hit
        b = self.b
        if isinstance(e, Const):
            return constant(e.value, e.dtype)
        if isinstance(e, Index):
            v = self.sym(e.expr)
            out = b.icmp_signed("!=", v, i64(0)) if e.dtype is DType.bool else cast_int(b, v, e.dtype)
        elif isinstance(e, Load):
            out = self.load(e.buffer, e.index, e.valid, e.dtype)
        elif isinstance(e, Gather):
            out = self.load_at(e.buffer, self.gathered_at(e), e.dtype)
        elif isinstance(e, Op):
            out = self.op(e)
        elif isinstance(e, Reduce):
            out = self.reduce(e)
        else:  # pragma: no cover
            raise TypeError(f"not a kernel expression: {e!r}")
        return self.scope.remember(e, out)

    def gathered_at(self, e: Gather) -> ir.Value:
        """The flat element a Gather reads: its row index clamped to the table's rows."""
        b = self.b
        idx = self.emit(e.idx)
        idx = b.sext(idx, I64) if idx.type != I64 else idx
        idx = b.select(b.icmp_signed("<", idx, i64(0)), i64(0), idx)
        idx = b.select(b.icmp_signed(">", idx, i64(e.rows - 1)), i64(e.rows - 1), idx)
        return b.add(b.mul(idx, self.sym(e.row_size)), self.sym(e.inner))

    def load(self, buf: str, index: Expr, valid: Expr, dt: DType) -> ir.Value:
        if buf in self.buffers and self.buffers[buf].numel == 0 or valid == Num(0):
            return zero(dt)
        if valid == Num(1):
            return self.load_at(buf, self.sym(index), dt)
        b = self.b
        ok = b.icmp_signed("!=", self.sym(valid), i64(0))
        v = self.load_at(buf, b.select(ok, self.sym(index), i64(0)), dt)
        return b.select(ok, v, zero(dt))

    def load_at(self, buf: str, flat: ir.Value, dt: DType) -> ir.Value:
        v = self.b.load(self.b.gep(self.ptr[buf], [flat], inbounds=True, source_etype=mem_type(dt)),
                        typ=mem_type(dt))
        if self.scoped and buf not in self.written:
            v.set_metadata("noalias", self.written_scope)
        if dt is DType.float16:
            return self.b.fpext(v, reg_type(dt))
        return self.b.trunc(v, I1) if dt is DType.bool else v

    def op(self, e: Op) -> ir.Value:
        emit = OPS.get(e.op)
        if emit is None:
            raise NotImplementedError(f"op {e.op} on {e.dtype.short}")
        return emit(self, e)

    def args(self, e: Op) -> list[ir.Value]:
        """e's operands, emitted in order."""
        return [self.emit(s) for s in e.srcs]

    def _term(self, r: Reduce, cands: list[Reduce], i: ir.Value) -> ir.Value:
        """r's body at r.var = i, its own inner reduces hoisted where they can be."""
        self.scope.bind(r.var.name, i)
        self.hoist(cands)
        return self.emit(r.body)

    def _accumulate(self, r: Reduce, cands: list[Reduce], i: ir.Value, acc: ir.Value, loop: bool) -> ir.Value:
        """acc combined with r's body at r.var = i; reassociable in a loop (scalar.REASSOC). A
        float sum of products accumulates through fmuladd: the one place products contract."""
        body = r.body
        if r.op == "sum" and r.dtype.is_float and isinstance(body, Op) and body.op == "mul":
            self.scope.bind(r.var.name, i)
            self.hoist(cands)
            x, y = self.args(body)
            return self.b.call(intrinsic(self.mod, "llvm.fmuladd", x.type, 3), [x, y, acc],
                               fastmath=REASSOC if loop else ())
        return accumulate(self.b, COMBINE[r.op], acc, self._term(r, cands, i), r.dtype, loop)

    def reduce(self, r: Reduce) -> ir.Value:
        cands = reduces(r.body)
        if _unrolls(r):
            # a pooling window, a filter's taps: straight-line code keeps the outer loop vectorisable
            acc = identity(r.op, r.dtype)
            for j in range(r.size):
                with self.scope.nested():
                    acc = self._accumulate(r, cands, i64(j), acc, loop=False)
            return acc
        if r.op == "max_reduce" and r.dtype.is_float:
            return self._float_max(r, cands)
        return self.loop(i64(0), self.sym(r.size), [identity(r.op, r.dtype)],
                         lambda i, accs: [self._accumulate(r, cands, i, accs[0], loop=True)])[0]

    def _float_max(self, r: Reduce, cands: list[Reduce]) -> ir.Value:
        """A NaN-propagating max as a plain maxnum (declared NaN-free and sign-of-zero-free: one
        vmaxps; max(-0, +0) may give either) beside a running sum, which is NaN if a term is
        NaN (or infinities of both signs meet). Only then does a second pass look for a NaN: one
        vaddps per vector instead of the four that an `or` of NaN tests legalises to."""
        b = self.b
        maxnum = intrinsic(self.mod, "llvm.maxnum", reg_type(r.dtype), 2)

        def body(i: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
            x = self._term(r, cands, i)
            return [b.call(maxnum, [accs[0], x], fastmath=("nnan", "nsz")),
                    accumulate(b, "add", accs[1], x, r.dtype)]

        best, total = self.loop(i64(0), self.sym(r.size), [identity(r.op, r.dtype), zero(r.dtype)], body)
        pre = b.block
        with b.if_then(b.fcmp_unordered("uno", total, total), likely=False):
            nan_seen = self.loop(i64(0), self.sym(r.size), [ir.Constant(I1, 0)], lambda i, accs: [
                b.or_(accs[0], b.fcmp_unordered("uno", *[self._term(r, cands, i)] * 2))])[0]
            checked = b.block
        nan = b.phi(I1)
        nan.add_incoming(ir.Constant(I1, 0), pre)
        nan.add_incoming(nan_seen, checked)
        return b.select(nan, ir.Constant(best.type, math.nan), best)


# --- index arithmetic: i64, never wrapping -------------------------------------------------------

def _masks(e: KExpr) -> list[Expr]:
    """The conditions e's loads and selects depend on."""
    return [x.valid if isinstance(x, Load) else x.expr for x in walk(e)
            if isinstance(x, Load) or isinstance(x, Index) and x.dtype is DType.bool]


def _holds_for(atom: Expr, var: str, lo: int, hi: int) -> tuple[int, int] | None:
    """The part of lo..hi where `a < b` (atom) holds for every value of its other variables, as
    (lo, hi); None when atom is no comparison linear in var."""
    if not (isinstance(atom, BinOp) and atom.op == "<"):
        return None
    coef, rest = 0, []
    for c, x in terms(atom.b - atom.a):  # holds where coef * var + rest >= 1
        if isinstance(x, Var) and x.name == var:
            coef += c
        elif x is not None and var in variables(x):
            return None
        else:
            rest.append(Num(c) if x is None else x * c)
    least = bounds(sum(rest, Num(0)))[0]
    if coef > 0:
        return max(lo, -((least - 1) // coef)), hi  # var >= ceil((1 - least) / coef)
    if coef < 0:
        return lo, min(hi, (least - 1) // -coef)  # var <= floor((least - 1) / -coef)
    return None


def _aliased(r: Reduce) -> int | None:
    """How many of r's terms a pass may read at once where its loads step through memory by whole
    cache lines that map to few L1 sets (a sum over channels of a [C, 32x32] value: 4 KB apart, every
    term in one set), so that its terms together would evict each other (a 48-term sum over 1024
    positions 144 us unrolled): at most half the ways of each set they use; None where they do not."""
    strides = [c for x in walk(r.body) if isinstance(x, Load)
               for c, a in terms(x.index) if isinstance(a, Var) and a.name == r.var.name]
    lines = [abs(c) // LINE_FLOATS for c in strides if c and abs(c) % LINE_FLOATS == 0]
    if not lines or not isinstance(r.size, int):
        return None
    sets = min(L1_SETS // math.gcd(n, L1_SETS) for n in lines)
    return max(1, L1_WAYS // 2 * sets // len(strides)) if r.size > L1_WAYS * sets else None


def steps_by_one(index: Expr, n_var: str) -> bool:
    """Whether index steps by exactly one per column: n_var appears only as a term of its own."""
    parts = terms(index)
    own = [c for c, a in parts if isinstance(a, Var) and a.name == n_var]
    nested = any(a is not None and not (isinstance(a, Var) and a.name == n_var) and
                 n_var in {v.name for v in var_list(a)} for _c, a in parts)
    return own == [1] and not nested


def _unrolls(r: Reduce) -> bool:
    """Whether r is emitted as straight-line code: few terms, or a small body unrolled."""
    return isinstance(r.size, int) and (
        r.size <= UNROLL_REDUCE or r.size * _tree_ops(r.body, UNROLL_OPS // r.size) <= UNROLL_OPS)


def _tree_ops(e: KExpr, limit: int) -> int:
    """Nodes of e as a tree, a reduce's body counted once per term (its size unrolled), counted no
    further than limit + 1: a deep fused DAG is exponentially large as a tree."""
    if isinstance(e, Reduce):
        size = upper(e.size)
        return min(limit + 1, size * _tree_ops(e.body, limit // max(size, 1)))
    total = 1
    for c in children(e):
        if total > limit:
            break
        total += _tree_ops(c, limit - total)
    return min(total, limit + 1)


def _nsw(v: ir.Instruction) -> ir.Instruction:
    v.flags.append("nsw")
    return v


def _both(b: ir.IRBuilder, x: ir.Value, y: ir.Value) -> ir.Value:
    return b.zext(b.and_(b.icmp_signed("!=", x, i64(0)), b.icmp_signed("!=", y, i64(0))), I64)


INDEX_OPS: dict[str, Callable[[ir.IRBuilder, ir.Value, ir.Value], ir.Value]] = {
    "+": lambda b, x, y: _nsw(b.add(x, y)),
    "*": lambda b, x, y: _nsw(b.mul(x, y)),
    "//": lambda b, x, y: b.sdiv(x, y),
    "%": lambda b, x, y: b.srem(x, y),
    "<": lambda b, x, y: b.zext(b.icmp_signed("<", x, y), I64),
    "and": _both,
}


# --- ops: name -> the function emitting it ---------------------------------------------------------

OpEmitter = Callable[[KernelEmitter, Op], ir.Value]


def _binary(em: KernelEmitter, e: Op) -> ir.Value:
    return binary(em.b, e.op, em.args(e), e.dtype)


def _cast(em: KernelEmitter, e: Op) -> ir.Value:
    return cast(em.b, em.emit(e.srcs[0]), e.srcs[0].dtype, e.dtype)


def _max(em: KernelEmitter, e: Op) -> ir.Value:
    clamp = _negated_max(e) if e.dtype.is_float else None
    if clamp is not None:  # max(-a, c) = -minimum(a, -c), exactly: one vminps, no sign flips
        a, c = clamp
        return em.b.fneg(em.b.call(intrinsic(em.mod, "llvm.minimum", reg_type(e.dtype), 2),
                                   [em.emit(a), ir.Constant(reg_type(e.dtype), -c)]))
    return _binary(em, e)


def _where(em: KernelEmitter, e: Op) -> ir.Value:
    return em.b.select(*em.args(e))


def _lt(em: KernelEmitter, e: Op) -> ir.Value:
    x, y = em.args(e)
    src = e.srcs[0].dtype
    if src.is_float:
        return em.b.fcmp_ordered("<", x, y)
    return (em.b.icmp_unsigned if src is DType.bool else em.b.icmp_signed)("<", x, y)


def _math(em: KernelEmitter, e: Op) -> ir.Value:
    """exp2, log2 and sin from mathlib, in float32 (exp2 of a softmax's x - max(x) skips the
    overflow clamp)."""
    (x,) = em.args(e)
    b = em.b
    nonpositive = e.op == "exp2" and _below_own_max(e.srcs[0], axis_vars(em.k.shape))
    fn = math_function(em.mod, "exp2_nonpositive" if nonpositive else e.op)
    if x.type != F32:
        return b.fptrunc(b.call(fn, [b.fpext(x, F32)]), x.type)
    return b.call(fn, [x])


def _sqrt(em: KernelEmitter, e: Op) -> ir.Value:
    args = em.args(e)
    return em.b.call(intrinsic(em.mod, "llvm.sqrt", args[0].type), args)


def _neg(em: KernelEmitter, e: Op) -> ir.Value:
    (x,) = em.args(e)
    return em.b.fneg(x) if e.dtype.is_float else em.b.sub(ir.Constant(x.type, 0), x)


def _recip(em: KernelEmitter, e: Op) -> ir.Value:
    (x,) = em.args(e)
    return em.b.fdiv(ir.Constant(x.type, 1.0), x)


def _fma(em: KernelEmitter, e: Op) -> ir.Value:
    args = em.args(e)
    if not e.dtype.is_float:
        b = em.b
        return binary(b, "add", [binary(b, "mul", args[:2], e.dtype), args[2]], e.dtype)
    return em.b.call(intrinsic(em.mod, "llvm.fmuladd", args[0].type, 3), args)


OPS: dict[str, OpEmitter] = {
    "add": _binary,
    "mul": _binary,
    "div": _binary,
    "mod": _binary,
    "max": _max,
    "lt": _lt,
    "where": _where,
    "cast": _cast,
    "neg": _neg,
    "recip": _recip,
    "sqrt": _sqrt,
    "exp2": _math,
    "log2": _math,
    "sin": _math,
    "fma": _fma,
}


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
    return isinstance(r.size, int) and any(
        v.hi < r.size and rewrite(r.body, index=partial(rename, old=r.var.name, new=v)) == x for v in axes)


# --- loop hints --------------------------------------------------------------------------------

def _row_width(lanes: int, trip: int) -> int:
    """The vector width for a row of trip elements read with a stride, 0 for the vectoriser's own:
    the width (lanes, half or a quarter of them, at least 4) leaving the fewest vector and scalar
    iterations, the widest on a tie. A stride-2 depthwise convolution's rows of 28 run as 3
    vectors of 8 and 4 scalars, not one of 16 and 12 scalars (measured 134 -> 94 us in mnasnet0_5,
    136 -> 112 us in mobilenet_v2)."""
    if trip >= 4 * lanes:
        return 0
    widths = [w for w in (lanes, lanes // 2, lanes // 4) if w >= 4]
    best = min(widths, key=lambda w: (trip // w + trip % w, -w))
    return 0 if best == lanes else best


def loop_hint(mod: ir.Module, unroll: int, lanes: int, trip: int | None = None, strided: bool = False,
              strided_row: bool = False) -> ir.Value:
    """Loop metadata asking the vectoriser to interleave several vectors (hides fma latency),
    but no more than a known trip count fills, and to vectorise rows shorter than its own
    threshold that still hold a whole vector (of `lanes` lanes, or HALF_VECTOR of a wider one): a
    pooled 8-wide row would run all scalar. Rows that fill no whole vector run masked, unless
    they read with a stride (strided: masked interleaved loads cost more than a scalar tail); such
    a row of the output (strided_row) runs the vectors that leave it the fewest iterations
    (`_row_width`)."""
    count = unroll
    whole = min(lanes, HALF_VECTOR)
    short = trip is not None and SHORT_ROW <= trip < VECTORIZER_MIN_TRIP
    masked = short and trip % whole != 0 and not strided
    force = trip is not None and whole <= trip < VECTORIZER_MIN_TRIP and not masked
    if trip is not None:
        count = max(1, min(count, trip // lanes))
    # masked: vectors of the next power of two (at most lanes), lanes past the row masked off, the
    # whole row in one iteration (SHORT_ROW)
    vector = min(lanes, 1 << (trip - 1).bit_length()) if masked else 0
    if masked:
        count = -(-trip // vector)
    narrow = _row_width(lanes, trip) if strided_row and trip is not None else 0
    if narrow:
        count = max(1, min(count, trip // narrow))
    key = f"{LOOP_HINT}.{count}.{force}.{masked}.{narrow}"
    if key not in mod.namedmetadata:
        opts = [mod.add_metadata([ir.MetaDataString(mod, "llvm.loop.interleave.count"),
                                  ir.Constant(I32, count)])]
        if force or masked or narrow:
            opts.append(mod.add_metadata([ir.MetaDataString(mod, "llvm.loop.vectorize.enable"),
                                          ir.Constant(I1, 1)]))
        width = narrow or vector
        if width:
            opts.append(mod.add_metadata([ir.MetaDataString(mod, "llvm.loop.vectorize.width"),
                                          ir.Constant(I32, width)]))
        if masked:
            opts.append(mod.add_metadata([ir.MetaDataString(mod, "llvm.loop.vectorize.predicate.enable"),
                                          ir.Constant(I1, 1)]))
        mod.add_named_metadata(key, mod.add_metadata([ir.MetaDataString(mod, LOOP_HINT), *opts]))
    return mod.get_named_metadata(key).operands[0]
