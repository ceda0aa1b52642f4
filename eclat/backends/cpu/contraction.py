"""Contraction kernels (GEMM, GEMV, convolutions as GEMMs) as an explicit register-blocked
micro-kernel: MR x NR accumulators, NR a whole number of vectors of the vector unit's lanes, held
in vector registers and updated by fma, with constant right-hand operands packed into NR-wide
panels at compile time (and other right-hand operands copied into a dense panel per call when
several row blocks read it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping

import llvmlite.ir as ir
import numpy as np

from ...compiler.derived import derived, viewed, was_held
from ...compiler.group import ravel
from ...compiler.kernel import (
    Buffer,
    Contraction,
    Gather,
    Kernel,
    KExpr,
    Load,
    Op,
    as_contraction,
    axis_vars,
    free_vars,
    loads,
    oriented,
    walk,
)
from ...compiler.quantize import FORMATS, storage
from ...errors import EclatError
from ...ir.dtypes import DType, from_numpy
from ...ir.symbolic import Expr, Num, Var, evaluate, map_vars, prod, sint, terms, to_expr, upper, var_list
from ...ir.view import contiguous_strides
from . import host
from .emitter import KernelEmitter, steps_by_one
from .scalar import (
    F32,
    I8,
    I16,
    I32,
    I64,
    PTR,
    float_array,
    i64,
    intrinsic,
    smin,
    splat,
    store_through,
    vector_ptr,
)
from .schedules import ACCUMULATOR_CHAINS

PACKED = "pack:"  # name prefix of weights packed at compile time
SCALES = "s"  # name suffix of a packed weight's scales (quantize.storage)
RUNTIME_PACK_BYTES = 1 << 20  # largest K x NR panel of a non-constant operand copied per kernel call
PARTIAL_BYTES = 1 << 19  # largest M x NR panel of sums kept between chunks of a reduction (Schedule.depth)
STEP_TABLE_STEPS = 1 << 16  # longest reduction whose left operand's offsets per step are tabled
PREFETCH_BYTES = 640  # how far ahead a matrix-vector kernel reads its weight stream (measured: 512-768 best)
CACHE_LINE = 64  # bytes a prefetch brings in


COLUMN_OPS = {"add": "fadd", "sub": "fsub", "mul": "fmul"}  # float ops a right operand runs as vectors


def columnwise(e: KExpr, n_var: str) -> bool:
    """Whether e's NR values along the columns are vector arithmetic (`_columns`): contiguous
    reads, values the columns do not change, float add, sub and mul, and selects between
    columns by a value the columns do not change (a KV cache read through the row a step
    writes: one vector select per step of k, not NR scalar ones)."""
    if n_var not in free_vars(e):
        return True
    if isinstance(e, Load):
        return e.valid == Num(1) and e.dtype is DType.float32 and steps_by_one(e.index, n_var)
    if isinstance(e, Gather):
        return e.dtype is DType.float32 and n_var not in free_vars(e.idx) and \
            steps_by_one(e.inner, n_var)
    if not isinstance(e, Op) or e.dtype is not DType.float32:
        return False
    if e.op == "where":
        return n_var not in free_vars(e.srcs[0]) and all(columnwise(x, n_var) for x in e.srcs[1:])
    return e.op in COLUMN_OPS and all(columnwise(x, n_var) for x in e.srcs)


def _separable(e: KExpr, n_var: str) -> tuple[Expr, Expr] | None:
    """(rest, column) where e is a float32 load of every element it reads whose index is rest +
    column, column the terms that read n_var and nothing else, rest the terms that do not read it;
    None for anything else."""
    if not (isinstance(e, Load) and e.valid == Num(1) and e.dtype is DType.float32):
        return None
    rest: Expr = Num(0)
    column: Expr = Num(0)
    for coef, atom in terms(e.index):
        names = set() if atom is None else {v.name for v in var_list(atom)}
        if n_var not in names:
            rest = rest + (coef if atom is None else atom * coef)
        elif names == {n_var}:
            column = column + atom * coef
        else:
            return None
    return rest, column


def step_offsets(e: KExpr, k_var: str, steps: sint) -> tuple[Expr, np.ndarray] | None:
    """(rest, offsets) where e is a float32 load whose index is rest + f(k), f a function of the
    reduction's variable alone that is not a multiple of it (a convolution's windows read in place:
    k is (channel, kernel row, kernel column) flattened, f holds a division and two remainders):
    f's value at each step. Read from a table, the micro-kernel's step needs one load for it, not
    some twenty integer instructions beside its fmas (a 3x3 convolution 16 -> 64 over 55 x 55
    pixels, transposed at (4, 16): 1855 -> 882 us, znver3); None where f is k times a constant."""
    split = _separable(e, k_var)
    if split is None or not isinstance(steps, int) or not 0 < steps <= STEP_TABLE_STEPS:
        return None
    rest, f = split
    if all(atom is None or isinstance(atom, Var) for _c, atom in terms(f)):
        return None  # k times a constant: LLVM steps the address itself
    return rest, np.asarray(evaluate(f, {k_var: np.arange(steps, dtype=np.int64)}), np.int64)


def contraction_of(kernel: Kernel, buffers: dict[str, Buffer]) -> Contraction | None:
    """The contraction the micro-kernel computes for kernel: float32 only, and not one row whose
    right operand neither is packed (a weight) nor steps by one along the columns: the micro-kernel
    would gather it element by element, where the plain loops run the reduction as a vectorised
    dot product (the scores of decode attention: a query against the cache's rows)."""
    c = oriented(kernel) if kernel.body.dtype is DType.float32 else None
    if c is None or c.m_axis is not None and upper(kernel.shape[c.m_axis]) > 1:
        return c
    b, n_var = c.b, f"i{c.n_axis}"
    if isinstance(b, Load) and b.valid == Num(1) and buffers[b.buffer].role == "weight" and \
            free_vars(b) <= {n_var, c.reduce.var.name}:
        return c  # packed at compile time

    def step(index: Expr) -> int:
        return sum(k for k, a in terms(index) if isinstance(a, Var) and a.name == n_var)
    reads = [x.index if isinstance(x, Load) else x.inner for x in walk(b) if isinstance(x, (Load, Gather))]
    return c if all(step(index) in (0, 1) for index in reads) else None


def packed_panels(data: np.ndarray, index: Expr, n_var: str, k_var: str, n: int, kk: int,
                  nr: int, fmt: str | None = None) -> list[np.ndarray]:
    """data[index(n, k)] as [panels, K, NR], zero past column n, flat: float32, or in fmt when fmt
    holds every value exactly (quantize.storage: the packed values, then their scales, if any).
    Remembered while data lives (compiler.derived)."""
    data, layout = _panels_source(data, index, n_var, k_var, n, kk)
    affine = not isinstance(layout, str)

    def pack() -> list[np.ndarray]:
        panels = -(-n // nr)
        out = np.zeros((panels, kk, nr), np.float32)
        flat = data.reshape(-1)
        if affine:  # the common case: a strided view, copied once, no index arrays of K x N
            start, sn, sk = layout
            item = flat.itemsize
            grid = np.lib.stride_tricks.as_strided(flat[start:], (kk, n), (sk * item, sn * item))
        else:
            grid = flat[evaluate(index, {n_var: np.arange(n)[None, :], k_var: np.arange(kk)[:, None]})]
        whole = n // nr
        out[:whole] = grid[:, :whole * nr].reshape(kk, whole, nr).transpose(1, 0, 2)
        if whole < panels:
            out[whole, :, :n - whole * nr] = grid[:, whole * nr:]
        stored = storage(out, FORMATS[fmt]) if fmt else None
        return [a.reshape(-1) for a in stored] if stored is not None else [out.reshape(-1)]
    return derived(data, ("panels", layout, n, kk, nr, fmt), pack)


def batch_panels(data: np.ndarray, index: Expr, batch: dict[str, int], n_var: str, k_var: str, n: int,
                 kk: int, nr: int) -> np.ndarray:
    """packed_panels of data[index] at each index of the batch axes (name -> size) in turn, row-major,
    as one float32 array (a Winograd product's 16 filters); made once while data is held."""
    def each() -> list[np.ndarray]:
        return [np.concatenate([packed_panels(data, _at_batch(index, dict(zip(batch, at))), n_var, k_var,
                                              n, kk, nr)[0] for at in np.ndindex(*batch.values())])]
    return derived(data, ("batched", str(index), n_var, k_var, n, kk, nr, tuple(batch.items())), each)[0]


def _held_data(source: Buffer) -> np.ndarray:
    """A weight's data to pack; an error where a built program no longer holds it (it keeps only
    the forms its own schedules read)."""
    if source.data is None:
        raise EclatError(f"weight {source.name!r} is held only packed for its program's schedules; "
                         f"build other schedules from the program as compiled, before it was built")
    return np.asarray(source.data)


def _panels_source(data: np.ndarray, index: Expr, n_var: str, k_var: str, n: int, kk: int
                   ) -> tuple[np.ndarray, tuple[int, int, int] | str]:
    """The array packed_panels reads data[index(n, k)] from and the layout its packed form is
    keyed by: (start, step along n, step along k) in the matrix's own array, whichever view of
    it data is (`_in_memory`), or the index's text where it is not affine."""
    parts = terms(index)
    linear = {None if a is None else a.name: c for c, a in parts if a is None or isinstance(a, Var)}
    if not (len(linear) == len(parts) and set(linear) - {None} <= {n_var, k_var}):
        return data, str(index)
    layout = (linear.get(None, 0), linear.get(n_var, 0), linear.get(k_var, 0))
    return _in_memory(data, *layout, n, kk) or (data, layout)


def held_panel_width(weights: Mapping[str, Buffer], kernel: Kernel, widths: Iterable[int]) -> int | None:
    """The first of widths at which kernel's right operand, a weight packed whole (not per batch
    index), was held packed when the compile began (compiler.derived.was_held: by another program
    of the model); None where there is none."""
    c = as_contraction(kernel)
    b = c.b if c is not None else None
    if not (isinstance(b, Load) and b.valid == Num(1) and b.buffer in weights):
        return None
    source = weights[b.buffer]
    n_var, k_var = f"i{c.n_axis}", c.reduce.var.name
    n, kk = kernel.shape[c.n_axis], c.reduce.size
    if source.data is None or not free_vars(b) <= {n_var, k_var} or not isinstance(n, int) \
            or not isinstance(kk, int):
        return None
    data, layout = _panels_source(np.asarray(source.data), b.index, n_var, k_var, n, kk)
    return next((w for w in widths if was_held(data, ("panels", layout, n, kk, w, source.format))), None)


def _in_memory(data: np.ndarray, start: int, sn: int, sk: int, n: int, kk: int
               ) -> tuple[np.ndarray, tuple[int, int, int]] | None:
    """The matrix of data's C-order elements start + n' * sn + k' * sk (n' < n, k' < kk) as the
    contiguous array data views and (start, sn, sk) in it, where n' and k' each walk one axis of
    data: so a weight and a transposed view of it (rewrites.layout) that read one matrix read one
    packed form. None where data views nothing, or a step crosses axes."""
    base, item = viewed(data), data.itemsize
    if base is data or not base.flags.c_contiguous or base.dtype != data.dtype \
            or any(t <= 0 or t % item for t in data.strides) or not 0 <= start < data.size:
        return None
    shape = data.shape
    at = np.unravel_index(start, shape)
    rows = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    axes: list[int | None] = []  # the axis n' walks, then k''s (None: a single row or column)
    for step, count in ((sn, n), (sk, kk)):
        axis = next((a for a, r in enumerate(rows) if r == step and shape[a] > 1), None)
        if count > 1 and (axis is None or axis in axes or at[axis] + count > shape[axis]):
            return None
        axes.append(axis if count > 1 else None)
    dn, dk = (0 if a is None else data.strides[a] // item for a in axes)
    first = (data.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // item
    first += sum(int(i) * t // item for i, t in zip(at, data.strides))
    return base, (first, dn, dk)


def _at_batch(index: Expr, at: dict[str, int]) -> Expr:
    """index with the batch variables `at` names fixed to their values."""
    return map_vars(index, lambda v: Num(at[v.name]) if v.name in at else v)


class ContractionEmitter(KernelEmitter):
    """Emits a contraction kernel: one outer loop over (panel, batch) pairs, the row blocks of a
    panel inside, the micro-kernel for each, then the kernel's epilogue per element of the tile."""

    scoped = False  # its loads in the order written (KernelEmitter.scoped)

    inner_loops = False  # the micro-kernel is interleaved by hand

    def __init__(self, mod: ir.Module, kernel: Kernel, buffers: dict[str, Buffer],
                 packed: dict[str, np.ndarray], lanes: int, contraction: Contraction):
        super().__init__(mod, kernel, buffers, packed, lanes)
        self.contraction = contraction
        self.packed_batch = False  # whether the packed weight holds one set of panels per batch index
        self.rows_batched = False  # likewise the packed left operand (_pack_rows)
        self.pack_name = self._pack()
        packs: list[str] = []
        if self.pack_name:
            packs = [n for n in (self.pack_name, self.pack_name + SCALES) if n in buffers]
            self.pack_format = self.buffers[self.pack_name].format
        self.rows_name = self._pack_rows()
        if self.rows_name:
            packs.append(self.rows_name)
        if packs:
            read_packed = {x for x, name in ((contraction.b, self.pack_name), (contraction.a, self.rows_name))
                           if name}
            self.arg_names += packs
            self.used = {x.buffer for x in loads(kernel.body) if x not in read_packed}
            self.used |= {kernel.out, *packs}

    def _pack(self) -> str | None:
        """Pack a constant right operand into [panels, K, NR] so that each step of the
        micro-kernel reads NR contiguous values, in the weight's low-precision format where it
        has one (its scales in the buffer named with SCALES after). Returns the packed buffer's
        name."""
        c, k = self.contraction, self.k
        b = c.b
        if not (isinstance(b, Load) and b.valid == Num(1) and self.buffers[b.buffer].role == "weight"):
            return None
        n_var, k_var = f"i{c.n_axis}", c.reduce.var.name
        n, kk = k.shape[c.n_axis], c.reduce.size
        source = self.buffers[b.buffer]
        # a weight per batch index (a Winograd product's 16 filters) packs each batch's panels in turn,
        # in float32 (the low-precision panels' scales are laid out per product)
        batch = self._batch_sizes()
        varying = free_vars(b) - {n_var, k_var}
        if not varying <= set(batch) or varying and source.format is not None or \
                not all(isinstance(x, int) for x in (n, kk, *batch.values())):
            return None
        self.packed_batch = bool(varying)
        nr = self.tile()[1]
        name = f"{PACKED}{b.buffer}_{nr}_{hashlib.sha256(str(b.index).encode()).hexdigest()[:12]}"
        if name not in self.packed:
            data = _held_data(source)
            if varying:  # each batch's panels in turn
                packs = [batch_panels(data, b.index, batch, n_var, k_var, n, kk, nr)]
            else:
                packs = packed_panels(data, b.index, n_var, k_var, n, kk, nr, source.format)
            fmt = source.format if len(packs) > 1 or packs[0].dtype != np.float32 else None
            for part, data in zip((name, name + SCALES), packs):
                self.packed[part] = data
                self.buffers[part] = Buffer(part, data.size, from_numpy(data.dtype), "weight", data, fmt)
        return name

    def key(self) -> str:
        """The kernel's code: what the base says, and whether the left operand is read packed (the
        same kernel over an input instead of a weight reads it in place)."""
        return f"{super().key()}|rows packed:{self.rows_name is not None}"

    def _pack_rows(self) -> str | None:
        """Pack a constant left operand (a convolution's weight, broadcast a row at a time) into
        [row blocks, K, MR], so that each step's MR values are one contiguous read: one stream of
        the weight, where its rows read in place were MR streams a row's length apart. Returns the
        packed buffer's name; None where the left operand is not a float32 weight read over the rows
        and the reduction alone (and the batch: a weight per batch index, each batch's blocks in
        turn), of sizes known here, in blocks of several rows. In a model (in turns, one process,
        znver3): efficientnet_b0's 1x1 convolutions over 196 pixels 1.05-1.09x, resnet18's Winograd
        products 1.03-1.09x."""
        c, k = self.contraction, self.k
        a, mr = c.a, self.tile()[0]
        if c.m_axis is None or mr < 2 or not (isinstance(a, Load) and a.valid == Num(1)):
            return None
        source = self.buffers[a.buffer]
        m_var, k_var = f"i{c.m_axis}", c.reduce.var.name
        m, kk = k.shape[c.m_axis], c.reduce.size
        batch = self._batch_sizes()  # a weight per batch index: each batch's blocks in turn
        if source.role != "weight" or source.format is not None or a.dtype is not DType.float32 or \
                not free_vars(a) - {m_var, k_var} <= set(batch) or \
                not all(isinstance(x, int) for x in (m, kk, *batch.values())):
            return None
        batched = bool(free_vars(a) - {m_var, k_var})
        name = f"{PACKED}{a.buffer}_a{mr}_{hashlib.sha256(str(a.index).encode()).hexdigest()[:12]}"
        if name not in self.packed:
            whole = _held_data(source)
            data = batch_panels(whole, a.index, batch, m_var, k_var, m, kk, mr) if batched \
                else packed_panels(whole, a.index, m_var, k_var, m, kk, mr)[0]
            self.packed[name] = data
            self.buffers[name] = Buffer(name, data.size, DType.float32, "weight", data)
        self.rows_batched = batched
        return name

    def _batch_sizes(self) -> dict[str, sint]:
        """The batch axes (the axes other than M and N): each one's variable name and size, in order."""
        c, shape = self.contraction, self.k.shape
        return {f"i{a}": shape[a] for a in range(len(shape)) if a not in (c.m_axis, c.n_axis)}

    def _batch_index(self) -> ir.Value:
        """The row-major number of the current batch index (the axes other than M and N)."""
        out = i64(0)
        for name, size in self._batch_sizes().items():
            out = self.b.add(self.b.mul(out, self.sym(size)), self.var(name))
        return out

    def tile(self) -> tuple[int, int]:
        """The schedule's register block, clamped to the rows and whole vectors."""
        c, k, lanes = self.contraction, self.k, self.lanes
        mr, nr = k.schedule.tile
        m_size = upper(k.shape[c.m_axis]) if c.m_axis is not None else 1
        return max(1, min(mr, m_size)), max(lanes, nr - nr % lanes)

    def body(self) -> sint:
        c: Contraction = self.contraction
        k, lanes = self.k, self.lanes
        shape = k.shape
        if 0 in shape:
            return 0
        mr, nr = self.tile()
        nv = nr // lanes
        # any size may be known only at run time: static choices take its bound
        m_size = shape[c.m_axis] if c.m_axis is not None else 1
        n_size, kk = shape[c.n_axis], c.reduce.size
        panels = (to_expr(n_size) + (nr - 1)) // nr
        most_blocks = -(-upper(m_size) // mr)
        self.streaming = most_blocks == 1  # each packed weight is read once per call
        self.blocks, self.block = most_blocks, None  # row blocks per panel; the current one's number
        self.chunk = None  # (first step, steps) of the reduction's chunk being computed (Schedule.depth)
        batch = [a for a in range(len(shape)) if a not in (c.m_axis, c.n_axis)]
        tile = float_array(self.b, mr * nr)
        vt = ir.VectorType(F32, lanes)
        a_steps = self._step_table(c) if c.m_axis is not None else None
        fma = intrinsic(self.mod, "llvm.fma", vt, 3)
        b_unit = columnwise(c.b, f"i{c.n_axis}")
        # a right operand that is not a constant, or a constant packed in low precision: copy (decode)
        # each K x NR panel into a dense float32 scratch once, and let every row block read it
        self.scratch = None
        copied = self.pack_name is None or self.pack_format is not None
        if copied and most_blocks > 1 and 0 < upper(kk) * nr * 4 <= RUNTIME_PACK_BYTES:
            self.scratch = float_array(self.b, upper(kk) * nr)
        depth = self._depth(most_blocks, upper(m_size) + mr, nr)
        # the sums so far of each row of the panel, between chunks of the reduction
        partial = float_array(self.b, (upper(m_size) + mr) * nr) if depth else None

        def micro(p: ir.Value, m0: ir.Value, mr: int, span: tuple[ir.Value, ...] | None = None) -> None:
            """The block of mr rows from row m0 (rows past the last clamped to it); span: the chunk
            of the reduction (first step, end, whether it is the first chunk, the last) where the
            reduction runs in chunks: the sums so far are kept in the output between them."""
            bb = self.b
            n0 = bb.mul(p, i64(nr))
            # the block's first value in the packed left operand (m0 is a multiple of mr: sizes known)
            rows_at = bb.mul(m0, i64(c.reduce.size)) if self.rows_name else None
            if self.rows_batched:  # past the blocks of the batches before this one
                tall = self.tile()[0]
                blocks = -(-k.shape[c.m_axis] // tall) * tall * c.reduce.size
                rows_at = bb.add(rows_at, bb.mul(self._batch_index(), i64(blocks)))
            # one row's accumulators each wait on the last fma into them: independent sets of them
            # interleaved over k keep ACCUMULATOR_CHAINS fmas in flight (hides the fma's latency)
            sets = 1
            if mr == 1:
                sets = max(1, min(ACCUMULATOR_CHAINS // nv, (host.vector_registers() - 1) // nv - 1))
            full = bb.icmp_signed("<=", bb.add(n0, i64(nr)), self.sym(n_size))
            if self.pack_name and not self.streaming and self.scratch is None:
                self.block = bb.sdiv(m0, i64(mr))
                self.chunk = None if span is None else (span[0], depth)
            start = i64(0) if span is None else span[0]  # the chunk's first step of k

            def kstep(kv: ir.Value, accs: list[ir.Value], steps=None, sums: bool = False) -> list[ir.Value]:
                """accs += a x b over the steps of k (its own, or `steps`), and the rows' sums of a
                after them with `sums`. accs may hold several sets: each step adds into the next."""
                out = list(accs)
                block = mr * nv + (mr if sums else 0)
                for t, (k_at, bvecs) in enumerate(steps or self._b_steps(c, p, n0, kv, nr, full, b_unit, vt)):
                    self.scope.bind(c.reduce.var.name, k_at)
                    base = t * block % len(out)
                    offset = None if a_steps is None else a_steps[1](k_at)
                    for r in range(mr):
                        with self.scope.nested():
                            if c.m_axis is not None:
                                row, last = bb.add(m0, i64(r)), self.sym(to_expr(m_size) - 1)
                                row = bb.select(bb.icmp_signed(">", row, last), last, row)
                                self.scope.bind(f"i{c.m_axis}", row)
                            if self.rows_name:  # the block's values at this step, one after the other
                                at = bb.add(rows_at, bb.add(bb.mul(k_at, i64(mr)), i64(r)))
                                av = self.load_at(self.rows_name, at, DType.float32)
                            elif offset is not None:
                                av = self.load_at(c.a.buffer, bb.add(self.sym(a_steps[0]), offset), c.a.dtype)
                            else:
                                av = self.emit(c.a)
                        if sums:
                            out[base + mr * nv + r] = bb.fadd(out[base + mr * nv + r], av)
                        row_a = splat(bb, av, lanes)
                        for v in range(nv):
                            j = base + r * nv + v
                            out[j] = bb.call(fma, [row_a, bvecs[v], out[j]])
                return out

            def merged(accs: list[ir.Value], block: int) -> list[ir.Value]:
                """The sets of accs (blocks of `block`) summed into one."""
                out = accs[:block]
                for at in range(block, len(accs), block):
                    out = [bb.fadd(x, y) for x, y in zip(out, accs[at:at + block])]
                return out

            def group(g: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
                """One group of int4 steps of k for a block of one row: sum a x (q - 8), then scale
                once. Where the nibbles decode as q (no table), the 8 comes off once per group:
                s * sum a (q - 8) = s * (sum a q - 8 sum a)."""
                pairs, centred = self.group // 2, self._nibble_table()
                def pair(kv: ir.Value, part: list[ir.Value]) -> list[ir.Value]:
                    at = bb.add(bb.mul(g, i64(pairs)), kv)
                    return kstep(kv, part, self._nibble_pair(p, at, nr, vt, scaled=False), sums=not centred)
                row_sums = [] if centred else [ir.Constant(F32, 0.0)] * mr
                sums = self.loop(i64(0), i64(pairs), zeros + row_sums, pair)
                row = bb.mul(bb.add(bb.mul(p, i64(kk // self.group)), g), i64(nr))
                scales = [self._vector(self.pack_name + SCALES, bb.add(row, i64(v * lanes)), F32, vt)
                          for v in range(nv)]
                if not centred:
                    shift = [splat(bb, bb.fmul(total, ir.Constant(F32, -8.0)), lanes)
                             for total in sums[mr * nv:]]
                    sums = [bb.fadd(total, shift[j // nv]) for j, total in enumerate(sums[:mr * nv])]
                return [bb.call(fma, [sums[j], scales[j % nv], acc]) for j, acc in enumerate(accs)]

            def unrolled(kv: ir.Value, accs: list[ir.Value]) -> list[ir.Value]:
                """`sets` steps of k, each into its own set of accumulators."""
                firsts = (bb.add(start, bb.add(bb.mul(kv, i64(sets)), i64(t))) for t in range(sets))
                return kstep(kv, accs, [step for k_at in firsts
                                        for step in self._b_steps(c, p, n0, k_at, nr, full, b_unit, vt)])

            zeros = [ir.Constant(vt, [0.0] * lanes)] * (mr * nv)
            nibbles = self._nibbles() and self.scratch is None
            if span is not None:  # a chunk: from the sums so far (zero before the first), then its steps
                first, stop, is_first = span[:3]
                kept = [vector_ptr(bb, partial, bb.add(bb.mul(bb.add(m0, i64(r)), i64(nr)), i64(v * lanes)))
                        for r in range(mr) for v in range(nv)]
                sums = [bb.select(is_first, zero, bb.load(at, typ=vt, align=4))
                        for zero, at in zip(zeros, kept)]
                whole = bb.sdiv(bb.sub(stop, first), i64(sets))
                accs = merged(self.loop(i64(0), whole, sums + zeros * (sets - 1), unrolled), len(zeros))
                accs = self.loop(bb.add(first, bb.mul(whole, i64(sets))), stop, accs, kstep)
            elif nibbles and mr == 1:  # the scales apply per group, not per step
                accs = self.loop(i64(0), i64(kk // self.group), zeros, group)
            elif nibbles:  # one byte holds two steps of k
                accs = self.loop(i64(0), i64(kk // 2), zeros, kstep)
            elif isinstance(kk, int):
                accs = zeros if not kk else merged(self.loop(i64(0), i64(kk // sets), zeros * sets, unrolled),
                                                   len(zeros))
                if kk % sets:
                    accs = self.loop(i64(kk - kk % sets), i64(kk), accs, kstep)
            else:  # a run-time length: the sets' steps, then the rest one by one
                whole = self.sym(to_expr(kk) // sets)
                accs = merged(self.loop(i64(0), whole, zeros * sets, unrolled), len(zeros))
                accs = self.loop(bb.mul(whole, i64(sets)), self.sym(kk), accs, kstep)
            if self.pack_format == "int8":  # one scale per column: applied once, after the sum
                scales = [self._vector(self.pack_name + SCALES, bb.add(n0, i64(v * lanes)), F32, vt)
                          for v in range(nv)]
                accs = [bb.fmul(acc, scales[j % nv]) for j, acc in enumerate(accs)]
            for j, acc in enumerate(accs):
                store_through(bb, acc, bb.gep(tile, [i64(j * lanes)], source_etype=F32))
            if span is None:
                self._epilogue(c, tile, m0, n0, mr, nr, m_size, n_size)
                return
            with bb.if_else(span[3]) as (then, otherwise):
                with then:
                    self._epilogue(c, tile, m0, n0, mr, nr, m_size, n_size)
                with otherwise:
                    for acc, at in zip(accs, kept):
                        store_through(bb, acc, at)

        # one outer loop over (batch, panel) pairs, batch-major: threads split it even when there
        # is a single panel (a convolution's GEMM over 16 output columns per image row), and a
        # batch's output is written panel after panel (panel-major, each panel's rows of every
        # batch in turn: rows that end mid-line had each line fetched twice, from memory, and a
        # Winograd product over 55 x 55 tiles ran 6x slower than over 3072 columns)
        sizes = [shape[a] for a in batch]
        per_panel = prod(sizes)

        def step(j: ir.Value) -> list:
            bb = self.b
            p = bb.srem(j, self.sym(panels))
            rest = bb.sdiv(j, self.sym(panels))
            for a, stride, size in zip(batch, contiguous_strides(sizes), sizes):
                # an axis of one element has stride 0 (a view's convention): a division by it is
                # undefined, and LLVM then computed NaN for a whole product
                self.scope.bind(f"i{a}", i64(0) if size == 1 else
                                bb.srem(bb.sdiv(rest, self.sym(stride)), self.sym(size)))
            if self.scratch is not None:
                self._pack_panel(c, p, nr, kk, n_size)
            if not depth:
                self._row_blocks(m_size, mr, lambda m0, h: micro(p, m0, h))
                return []

            def chunk(ci: ir.Value, _a: list) -> list:  # every row block over this chunk of the panel
                bb = self.b
                first = bb.mul(ci, i64(depth))
                stop = bb.add(first, i64(depth))
                stop = smin(bb, stop, i64(kk))
                span = (first, stop, bb.icmp_signed("==", ci, i64(0)),
                        bb.icmp_signed("==", ci, i64(-(-kk // depth) - 1)))
                self._row_blocks(m_size, mr, lambda m0, h: micro(p, m0, h, span))
                return []
            self.loop(i64(0), i64(-(-kk // depth)), [], chunk)
            return []

        self.loop(self.fn.args[1], self.fn.args[2], [], lambda j, _a: step(j))
        outer = panels * per_panel
        return outer.v if isinstance(outer, Num) else outer

    def _step_table(self, c: Contraction) -> tuple[Expr, Callable[[ir.Value], ir.Value]] | None:
        """(rest, offset at step k) where the left operand's index is rest + a tabled function of k
        (`step_offsets`): the table a constant array of the kernel's module."""
        found = step_offsets(c.a, c.reduce.var.name, c.reduce.size)
        if found is None:
            return None
        rest, offsets = found
        item = I32 if offsets.min() >= -2**31 and offsets.max() < 2**31 else I64
        kind = ir.ArrayType(item, len(offsets))
        table = ir.GlobalVariable(self.mod, kind, name=f"{self.fn.name}.steps")
        table.global_constant, table.linkage = True, "internal"
        table.initializer = ir.Constant(kind, [int(v) for v in offsets])

        def offset(k_at: ir.Value) -> ir.Value:
            at = self.b.load(self.b.gep(table, [ir.Constant(I32, 0), k_at], inbounds=True), typ=item)
            return at if item is I64 else self.b.sext(at, I64)
        return rest, offset

    def _row_blocks(self, m_size: sint, mr: int, micro: Callable[[ir.Value, int], None]) -> None:
        """micro(first row, height) over the rows: blocks of mr, the last clamped to the last row. A
        run-time number of rows ends in one block exactly as tall as the rows left (a micro-kernel
        per height, chosen at run time), so that a few rows read the panel once, as a program for
        that number of rows does: 7 rows in blocks of 4 read it twice and took twice as long."""
        bb = self.b
        if isinstance(m_size, int):
            self.loop(i64(0), i64(-(-m_size // mr)), [], lambda mb, _c: micro(bb.mul(mb, i64(mr)), mr) or [])
            return
        rows = self.sym(m_size)
        whole = bb.sdiv(rows, i64(mr))
        self.loop(i64(0), whole, [], lambda mb, _c: micro(bb.mul(mb, i64(mr)), mr) or [])
        start, left = bb.mul(whole, i64(mr)), bb.srem(rows, i64(mr))
        for h in range(1, mr):
            with bb.if_then(bb.icmp_signed("==", left, i64(h))):
                micro(start, h)

    def _depth(self, most_blocks: int, rows: int, nr: int) -> int:
        """The schedule's chunk of the reduction where it applies (0: none): several row blocks read
        each chunk, the reduction's length is known, the sums of the panel's rows between chunks fit
        PARTIAL_BYTES, and the right operand is float32 (a low-precision one's scales and groups span
        the reduction)."""
        depth, kk = self.k.schedule.depth, self.contraction.reduce.size
        whole = isinstance(kk, int) and 0 < depth < kk and most_blocks > 1
        return depth if whole and self.pack_format is None and rows * nr * 4 <= PARTIAL_BYTES else 0

    def _pack_panel(self, c: Contraction, p: ir.Value, nr: int, kk: sint, n_size: sint) -> None:
        """scratch[k * NR + col] = b at (panel p's column col clamped, k), for the current batch; a
        low-precision panel decoded (int8 unscaled: its scales apply after the sum)."""
        n0 = self.b.mul(p, i64(nr))
        if self.pack_format:
            vt = ir.VectorType(F32, self.lanes)

            def decode(kv: ir.Value, _a: list) -> list:
                for k_at, vecs in self._b_steps(c, p, n0, kv, nr, None, True, vt, into_scratch=True):
                    for v, vec in enumerate(vecs):
                        at = self.b.add(self.b.mul(k_at, i64(nr)), i64(v * self.lanes))
                        store_through(self.b, vec, vector_ptr(self.b, self.scratch, at))
                return []
            self.loop(i64(0), self.sym(to_expr(kk) // (2 if self._nibbles() else 1)), [], decode)
            return

        vt = ir.VectorType(F32, self.lanes)
        unit = columnwise(c.b, f"i{c.n_axis}")
        full = self.b.icmp_signed("<=", self.b.add(n0, i64(nr)), self.sym(n_size))

        def step(kv: ir.Value, _a: list) -> list:
            self.scope.bind(c.reduce.var.name, kv)
            # a whole panel of a row-contiguous operand: vector copies (an im2col's patches)
            for v, vec in enumerate(self._b_vectors(c, p, n0, kv, nr, full, unit, vt, into_scratch=True)):
                at = self.b.add(self.b.mul(kv, i64(nr)), i64(v * self.lanes))
                store_through(self.b, vec, vector_ptr(self.b, self.scratch, at))
            return []
        self.loop(i64(0), self.sym(kk), [], step)

    def _columns(self, e: KExpr, n_var: str, vt: ir.VectorType, v: int) -> ir.Value:
        """The v-th vector of e's values at columns n0, n0 + 1, ... (n_var bound to n0), where
        `columnwise` holds for e."""
        bb, lanes = self.b, self.lanes
        if n_var not in free_vars(e):
            return splat(bb, self.emit(e), lanes)
        if isinstance(e, (Load, Gather)):
            at = self.sym(e.index) if isinstance(e, Load) else self.gathered_at(e)
            ptr = bb.gep(self.ptr[e.buffer], [bb.add(at, i64(v * lanes))], source_etype=F32)
            return bb.load(ptr, typ=vt, align=4)
        xs = [self._columns(x, n_var, vt, v) for x in (e.srcs[1:] if e.op == "where" else e.srcs)]
        if e.op == "where":
            return bb.select(self.emit(e.srcs[0]), *xs)
        return getattr(bb, COLUMN_OPS[e.op])(*xs)

    def _b_vectors(self, c: Contraction, p: ir.Value, n0: ir.Value, kv: ir.Value, nr: int,
                   full: ir.Value, unit: bool, vt: ir.VectorType, into_scratch: bool = False
                   ) -> list[ir.Value]:
        """The NR values of the right operand at step k, as NR/lanes vectors (from the scratch copy
        of the panel, unless into_scratch)."""
        bb, lanes = self.b, self.lanes
        nv = nr // lanes
        if self.scratch is not None and not into_scratch:
            base = bb.mul(kv, i64(nr))
            return [bb.load(vector_ptr(bb, self.scratch, bb.add(base, i64(v * lanes))), typ=vt, align=4)
                    for v in range(nv)]
        if self.pack_name:
            if self.packed_batch:  # the batch's own panels first
                p = bb.add(p, bb.mul(self._batch_index(), i64(-(-self.k.shape[c.n_axis] // nr))))
            base = bb.mul(bb.add(bb.mul(p, i64(c.reduce.size)), kv), i64(nr))
            item = np.dtype(self.packed[self.pack_name].dtype).itemsize
            if self.streaming:
                self._prefetch(self.ptr[self.pack_name], bb.add(bb.mul(base, i64(item)), i64(PREFETCH_BYTES)),
                               nr * item)
            elif self.block is not None and not into_scratch:
                self._prefetch_next_panel(base, kv, nr, item)
            return [self._decoded(bb.add(base, i64(v * lanes)), vt) for v in range(nv)]
        if not unit:
            split = _separable(c.b, f"i{c.n_axis}")
            return self._b_scalar(c, n0, nr, vt) if split is None else self._b_offsets(c, n0, nr, vt, *split)
        def whole() -> list[ir.Value]:
            with self.scope.nested():
                self.scope.bind(f"i{c.n_axis}", n0)
                return [self._columns(c.b, f"i{c.n_axis}", vt, v) for v in range(nv)]
        # full panels: vector loads; the last partial panel: clamped scalar loads
        return self._either(full, vt, whole, lambda: self._b_scalar(c, n0, nr, vt))

    def _either(self, cond: ir.Value, vt: ir.VectorType, then: Callable[[], list[ir.Value]],
                otherwise: Callable[[], list[ir.Value]]) -> list[ir.Value]:
        """The vectors then() makes where cond holds, else those otherwise() makes."""
        bb = self.b
        with bb.if_else(cond) as (yes, no):
            with yes:
                fast, fast_block = then(), bb.block
            with no:
                slow, slow_block = otherwise(), bb.block
        out = []
        for fv, sv in zip(fast, slow):
            phi = bb.phi(vt)
            phi.add_incoming(fv, fast_block)
            phi.add_incoming(sv, slow_block)
            out.append(phi)
        return out

    def _b_steps(self, c: Contraction, p: ir.Value, n0: ir.Value, kv: ir.Value, nr: int, full: ir.Value,
                 unit: bool, vt: ir.VectorType, into_scratch: bool = False
                 ) -> list[tuple[ir.Value, list[ir.Value]]]:
        """(k, the right operand's NR values at k as NR/lanes vectors) for each step of k that one
        iteration of the k loop (number kv) makes: two for int4 panels, else one. into_scratch:
        read the packed panel even where a scratch copy of it exists (to fill that copy)."""
        if not self._nibbles() or (self.scratch is not None and not into_scratch):
            self.scope.bind(c.reduce.var.name, kv)
            return [(kv, self._b_vectors(c, p, n0, kv, nr, full, unit, vt, into_scratch))]
        return self._nibble_pair(p, kv, nr, vt, scaled=True)

    def _nibble_pair(self, p: ir.Value, kv: ir.Value, nr: int, vt: ir.VectorType, scaled: bool
                     ) -> list[tuple[ir.Value, list[ir.Value]]]:
        """The int4 panel's steps 2 kv and 2 kv + 1: (q - 8) * s, or q alone when not scaled."""
        bb, lanes, kk = self.b, self.lanes, self.contraction.reduce.size
        k0 = bb.mul(kv, i64(2))
        base = bb.mul(bb.add(bb.mul(p, i64(kk // 2)), kv), i64(nr))  # bytes: k0 low nibbles, k0 + 1 high
        if self.streaming:
            self._prefetch(self.ptr[self.pack_name], self.b.add(base, i64(PREFETCH_BYTES)), nr)
        row = bb.mul(bb.add(bb.mul(p, i64(kk // self.group)), bb.sdiv(k0, i64(self.group))), i64(nr))
        iv = ir.VectorType(I32, lanes)
        low, high = (ir.Constant(iv, [m] * lanes) for m in (15, 4))
        offset = ir.Constant(vt, [8.0] * lanes)
        table = self._nibble_table()
        steps: list[list[ir.Value]] = [[], []]
        for v in range(nr // lanes):
            at = bb.add(base, i64(v * lanes))
            packed = bb.zext(self._vector(self.pack_name, at, I8, ir.VectorType(I8, lanes)), iv)
            scale = self._vector(self.pack_name + SCALES, bb.add(row, i64(v * lanes)), F32, vt) if scaled \
                else None
            if table:  # q - 8 looked up: the permute reads an index's low 4 bits, so no mask
                centred = ir.Constant(vt, [float(q - 8) for q in range(16)])
                pair = [bb.call(table, [centred, q]) for q in (packed, bb.lshr(packed, high))]
            else:
                pair = [bb.sitofp(q, vt) for q in (bb.and_(packed, low), bb.lshr(packed, high))]
            for step, q in zip(steps, pair):
                if scaled:  # (q - 8) * s, exact
                    q = bb.fmul(q if table else bb.fsub(q, offset), scale)
                step.append(q)
        return [(k0, steps[0]), (bb.add(k0, i64(1)), steps[1])]

    def _nibble_table(self) -> ir.Function | None:
        """AVX-512's permute of 16 floats by the low 4 bits of each index (vpermps), where the host
        has it: an int4 nibble becomes q - 8 in one instruction, not a mask, a conversion and a
        subtraction (int4 decode is bound by these operations, not by bytes)."""
        if self.lanes != 16 or "avx512f" not in host.features():
            return None
        name, vt = "llvm.x86.avx512.permvar.sf.512", ir.VectorType(F32, 16)
        return self.mod.globals.get(name) or ir.Function(
            self.mod, ir.FunctionType(vt, [vt, ir.VectorType(I32, 16)]), name)

    def _nibbles(self) -> bool:
        return self.pack_format is not None and FORMATS[self.pack_format].bits == 4

    @property
    def group(self) -> int:
        """Steps of k per scale of an int4 panel."""
        return FORMATS[self.pack_format].group

    def _vector(self, buf: str, at: ir.Value, elem: ir.Type, vt: ir.VectorType) -> ir.Value:
        """The vector vt at element `at` of buffer buf (elements of type elem)."""
        return self.b.load(self.b.gep(self.ptr[buf], [at], source_etype=elem), typ=vt, align=1)

    def _decoded(self, at: ir.Value, vt: ir.VectorType) -> ir.Value:
        """lanes packed values from element `at` as float32: float32 read as is, bf16 widened (its
        bits are a float's high half), int8 converted (its scales apply after the sum)."""
        bb, lanes = self.b, self.lanes
        if self.pack_format is None:
            return self._vector(self.pack_name, at, F32, vt)
        if self.pack_format == "bf16":
            iv = ir.VectorType(I32, lanes)
            half = self._vector(self.pack_name, at, I16, ir.VectorType(I16, lanes))
            return bb.bitcast(bb.shl(bb.zext(half, iv), ir.Constant(iv, [16] * lanes)), vt)
        return bb.sitofp(self._vector(self.pack_name, at, I8, ir.VectorType(I8, lanes)), vt)

    def _prefetch(self, ptr: ir.Value, at: ir.Value, size: int, locality: int = 3) -> None:
        """Touch the cache lines of `size` bytes from byte `at` (locality 3: into L1, 2: into L2).
        A kernel that reads each weight once (few rows) reads its packed stream PREFETCH_BYTES
        ahead: it waits on DRAM, and the hardware prefetcher alone keeps too few lines in flight."""
        bb = self.b
        fn = self.mod.globals.get("llvm.prefetch.p0") or ir.Function(
            self.mod, ir.FunctionType(ir.VoidType(), [PTR, I32, I32, I32]), "llvm.prefetch.p0")
        for line in range(0, size, CACHE_LINE):
            where = bb.gep(ptr, [bb.add(at, i64(line))], source_etype=I8)
            bb.call(fn, [where, ir.Constant(I32, 0), ir.Constant(I32, locality), ir.Constant(I32, 1)])

    def _prefetch_next_panel(self, base: ir.Value, kv: ir.Value, nr: int, item: int) -> None:
        """Bring the packed weight's next stretch into L2 while this one is computed: the next panel,
        or where the reduction runs in chunks the next chunk (the panels lie one after the other,
        each in order of k, so either starts where this one ends). Each of the row blocks touches
        its own share of it, spread over its steps of k. Without this, the first row block of every
        panel waits on DRAM: over 64 rows, a GEMM whose weight is not in cache ran at 0.70x of its
        in-cache speed (AVX-512 Xeon), 0.95-1x with it."""
        bb, blocks = self.b, self.blocks
        first, span = (i64(0), self.sym(self.contraction.reduce.size)) if self.chunk is None else \
            (self.chunk[0], i64(self.chunk[1]))
        step, row = bb.sub(kv, first), nr * item
        start = bb.mul(bb.add(bb.sub(base, bb.mul(step, i64(nr))), bb.mul(span, i64(nr))), i64(item))
        share = bb.sdiv(bb.mul(bb.add(bb.mul(self.block, span), step), i64(row)), i64(blocks))
        self._prefetch(self.ptr[self.pack_name], bb.add(start, share), -(-row // blocks), locality=2)

    def _b_columns(self, c: Contraction, n0: ir.Value, nr: int, n_size: sint) -> list[ir.Value]:
        """The right operand at columns n0 .. n0+NR-1 (clamped to the last column)."""
        bb = self.b
        out = []
        for col in range(nr):
            with self.scope.nested():
                n = bb.add(n0, i64(col))
                last = self.sym(to_expr(n_size) - 1)
                self.scope.bind(f"i{c.n_axis}", bb.select(bb.icmp_signed(">", n, last), last, n))
                out.append(self.emit(c.b))
        return out

    def _b_offsets(self, c: Contraction, n0: ir.Value, nr: int, vt: ir.VectorType, rest: Expr,
                   column: Expr) -> list[ir.Value]:
        """The right operand's NR values at this step of k where its index is rest + column, rest
        free of the columns and column a function of them alone (the windows of a convolution's
        input read in place: the column is the output position): column's value at each of the
        panel's columns (clamped to the last), which does not change with k, and one vector load
        where they are consecutive, two and a shuffle where they step by two, else each vector as
        `_b_vector` reads it."""
        bb, lanes = self.b, self.lanes
        load: Load = c.b
        n_var, last = f"i{c.n_axis}", self.sym(to_expr(self.k.shape[c.n_axis]) - 1)
        offsets = []
        for col in range(nr):
            with self.scope.nested():
                n = bb.add(n0, i64(col))
                self.scope.bind(n_var, bb.select(bb.icmp_signed(">", n, last), last, n))
                offsets.append(self.sym(column))
        def spaced(step: int) -> ir.Value:  # whether the offsets step by `step` across the panel
            out = ir.Constant(ir.IntType(1), 1)
            for col, at in enumerate(offsets[1:], 1):
                out = bb.and_(out, bb.icmp_signed("==", at, bb.add(offsets[0], i64(step * col))))
            return out
        base = bb.gep(self.ptr[load.buffer], [self.sym(rest)], source_etype=F32)

        def run(start: ir.Value, step: int) -> ir.Value:
            """The vector of every step-th value from offset `start` (a stride-2 convolution's row:
            two loads and a shuffle, not a gather)."""
            wide = ir.VectorType(F32, lanes * step)
            got = bb.load(bb.gep(base, [start], source_etype=F32), typ=wide, align=4)
            return got if step == 1 else bb.shuffle_vector(
                got, ir.Constant(wide, ir.Undefined), ir.Constant(ir.VectorType(I32, lanes),
                                                                 [step * j for j in range(lanes)]))

        def loads(step: int = 1) -> list[ir.Value]:
            return [run(bb.add(offsets[0], i64(v * lanes * step)), step) for v in range(nr // lanes)]

        def each() -> list[ir.Value]:
            return [self._b_vector(base, offsets[v * lanes:(v + 1) * lanes], vt, run)
                    for v in range(nr // lanes)]
        return self._either(spaced(1), vt, loads,
                            lambda: self._either(spaced(2), vt, lambda: loads(2), each))

    def _b_vector(self, base: ir.Value, offsets: list[ir.Value], vt: ir.VectorType,
                  run: Callable[[ir.Value, int], ir.Value]) -> ir.Value:
        """One vector of the right operand at offsets from base: where they make two runs of step 1
        or 2 (the panel crosses the end of an output row, and the next row's windows start further on
        in the input), the two runs' vectors blended; else a gather. Both runs' loads stay between the
        first offset and the last, where offsets increase by at least the step (windows in order)."""
        bb, lanes = self.b, len(offsets)
        iv, iota = ir.VectorType(I64, lanes), list(range(lanes))
        at = ir.Constant(iv, ir.Undefined)
        for lane, o in enumerate(offsets):
            at = bb.insert_element(at, o, i64(lane))
        first, final = splat(bb, offsets[0], lanes), splat(bb, offsets[-1], lanes)

        def runs(step: int) -> tuple[ir.Value, ir.Value]:
            """(whether every lane lies on one of the two runs, the lanes on the first)."""
            ahead = ir.Constant(iv, [step * j for j in iota])
            behind = ir.Constant(iv, [step * (lanes - 1 - j) for j in iota])
            on_first = bb.icmp_signed("==", at, bb.add(first, ahead))
            on_last = bb.icmp_signed("==", at, bb.sub(final, behind))
            every = bb.bitcast(bb.or_(on_first, on_last), ir.IntType(lanes))
            return bb.icmp_signed("==", every, ir.Constant(ir.IntType(lanes), -1)), on_first

        def blended(step: int, on_first: ir.Value) -> list[ir.Value]:
            back = bb.sub(offsets[-1], i64(step * (lanes - 1)))
            return [bb.select(on_first, run(offsets[0], step), run(back, step))]

        def gather() -> list[ir.Value]:  # the addresses as integers: base + 4 offset
            start = splat(bb, bb.ptrtoint(base, I64), lanes)
            ptrs = bb.inttoptr(bb.add(start, bb.mul(at, splat(bb, i64(4), lanes))), ir.VectorType(PTR, lanes))
            every = ir.Constant(ir.VectorType(ir.IntType(1), lanes), [1] * lanes)
            return [bb.call(self._gather(vt), [ptrs, ir.Constant(I32, 4), every,
                                               ir.Constant(vt, ir.Undefined)])]
        (one, first_one), (two, first_two) = runs(1), runs(2)
        return self._either(one, vt, lambda: blended(1, first_one),
                            lambda: self._either(two, vt, lambda: blended(2, first_two), gather))[0]

    def _gather(self, vt: ir.VectorType) -> ir.Function:
        """LLVM's masked gather of vt's floats from a vector of pointers."""
        lanes = vt.count
        name = f"llvm.masked.gather.v{lanes}f32.v{lanes}p0"
        return self.mod.globals.get(name) or ir.Function(self.mod, ir.FunctionType(
            vt, [ir.VectorType(PTR, lanes), I32, ir.VectorType(ir.IntType(1), lanes), vt]), name)

    def _b_scalar(self, c: Contraction, n0: ir.Value, nr: int, vt: ir.VectorType) -> list:
        lanes = self.lanes
        vecs = [ir.Constant(vt, ir.Undefined) for _ in range(nr // lanes)]
        for col, val in enumerate(self._b_columns(c, n0, nr, self.k.shape[c.n_axis])):
            vecs[col // lanes] = self.b.insert_element(vecs[col // lanes], val, i64(col % lanes))
        return vecs

    def _epilogue(self, c: Contraction, tile: ir.Value, m0: ir.Value, n0: ir.Value, mr: int, nr: int,
                  m_size: sint, n_size: sint) -> None:
        """The kernel's body per element of the tile, its sum taken from the accumulators."""
        k, bb = self.k, self.b
        where = ravel(axis_vars(k.shape), k.shape)

        def final(r: ir.Value, cc: ir.Value) -> None:
            acc = bb.load(bb.gep(tile, [bb.add(bb.mul(r, i64(nr)), cc)], source_etype=F32), typ=F32)
            self.scope.remember(c.reduce, acc)
            self.store(k.out, where, self.emit(k.body), k.body.dtype)
        self._tile_elements(c, m0, n0, mr, nr, m_size, n_size, final)

    def _tile_elements(self, c: Contraction, m0: ir.Value, n0: ir.Value, mr: int, nr: int, m_size: sint,
                       n_size: sint, each: Callable[[ir.Value, ir.Value], None]) -> None:
        """each(row, column in the tile) for every element of the tile inside the output, with the
        output's axes bound there: over a whole tile in loops of known length that vectorise, over an
        edge tile element by element; in the output's order, so that its stores are contiguous (the
        columns inside, or with the tile transposed, the rows)."""
        bb = self.b
        rows = bb.sub(self.sym(m_size), m0)
        cols = bb.sub(self.sym(n_size), n0)
        whole = bb.and_(bb.icmp_signed(">=", rows, i64(mr)), bb.icmp_signed(">=", cols, i64(nr)))

        def elements(rows: ir.Value, cols: ir.Value, hint: bool) -> None:
            def at(r: ir.Value, cc: ir.Value) -> None:
                with self.scope.nested():  # values made here stay here
                    if c.m_axis is not None:
                        self.scope.bind(f"i{c.m_axis}", bb.add(m0, r))
                    self.scope.bind(f"i{c.n_axis}", bb.add(n0, cc))
                    each(r, cc)

            rows_inside = c.m_axis is not None and c.m_axis > c.n_axis

            def outer_step(o: ir.Value, _a: list) -> list:
                def inner_step(i: ir.Value, _b: list) -> list:
                    at(*((i, o) if rows_inside else (o, i)))
                    return []
                self.loop(i64(0), rows if rows_inside else cols, [], inner_step, hint=hint)
                return []
            self.loop(i64(0), cols if rows_inside else rows, [], outer_step)

        with bb.if_else(whole) as (then, otherwise):
            with then:
                elements(i64(mr), i64(nr), hint=True)
            with otherwise:
                rows = smin(bb, rows, i64(mr))
                cols = smin(bb, cols, i64(nr))
                elements(rows, cols, hint=False)
