"""Attention kernels (kernel.Attention): a softmax over keys contracted with values, in one pass
over the keys with an online softmax, the scores never written to memory.

For each position of the outer axes above the query rows (a head), the keys go by in blocks of
BJ: the block's keys are copied transposed into a scratch (d x BJ), then for each block of `rows`
query rows a register-blocked micro-kernel computes their scores, each row's scores go through
the score expression (scale, mask, bias, soft-capping: whatever x is), the row's running max,
rescaled sum and output (kept in the output buffer itself) are updated, and a second micro-kernel
adds the block's probabilities times its values. The rows are normalised once at the end.

The query rows are the kernel's last outer axis when neither keys nor values read it (prefill);
otherwise each outer position is one row of its own (decode: one query per head).

A decode whose schedule says so (`Schedule.depth`: keys a part; by default where its heads would
load the threads unevenly or leave one idle, 1 to 3 heads on 2 threads) splits its keys into parts
(flash-decoding, attention_plan.py): each part is a slice of the outer loop that writes its rows
unnormalised, with their max and sum, to a scratch buffer the caller zeroes (`split_keys` adds it
at layout); the part that finishes last for a head (a counter per head, incremented atomically)
combines the head's parts into the output.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import llvmlite.ir as ir
import numpy as np

from ...compiler.derived import derived
from ...compiler.group import ravel
from ...compiler.kernel import (
    Attention,
    Buffer,
    Const,
    Kernel,
    KExpr,
    Load,
    Op,
    axis_vars,
    free_vars,
    walk,
)
from ...ir.dtypes import DType
from ...ir.symbolic import Num, evaluate, upper
from . import host
from .attention_plan import DIRECT_BELOW, counters_at, key_parts, rows_axis
from .contraction import PACKED
from .emitter import KernelEmitter
from .mathlib import math_function
from .scalar import (
    F32,
    I8,
    I32,
    accumulate,
    float_array,
    i64,
    intrinsic,
    smin,
    splat,
    store_through,
    vector_ptr,
)

SCRATCH_FLOATS = 8192  # a block of keys, transposed: d x BJ floats (32 KB: L1)
STATE_FLOATS = 4096  # about this many query rows in flight, their running max and sum on the stack (32 KB)
MAX_TABLE = 1 << 22  # live-block table entries (one byte each) worth making
# the live-block table's entries: the mask hides the block throughout, or not, or is 0 throughout
# it (its scores need no mask: a causal mask below the diagonal; T=2048 causal, a Xeon: 32.4 -> 27.3 ms)
HIDDEN, LIVE, UNMASKED = 0, 1, 2
MASK_TABLE = 1 << 16  # entries of a run-time mask's table (on the stack)


def block_rows(registers: int) -> int:
    """Query rows per micro-kernel block: as many as the vector registers hold at 2 accumulators
    each beside 2 key (or value) vectors and a broadcast row value: 6 of 16 registers (AVX2), 14 of
    32 (AVX-512; T=2048 causal attention on a Xeon: 33.6 against 37.4 ms at 6 rows)."""
    return (registers - 3) // 2


def _addends(x: KExpr) -> list[KExpr]:
    """The terms x sums, through nested adds and an fma's addend: a mask added to an ALiBi bias,
    fma(scale, score, bias + mask) as the CPU's fma rule writes scaled scores plus the rest, is
    an addend of x (x is -inf wherever it is, for finite terms beside it)."""
    if isinstance(x, Op) and x.op == "add":
        return [t for s in x.srcs for t in _addends(s)]
    if isinstance(x, Op) and x.op == "fma":
        return [Op("mul", x.srcs[:2], x.dtype), *_addends(x.srcs[2])]
    return [x]


class AttentionEmitter(KernelEmitter):
    """Emits an Attention kernel (see the module's docstring)."""

    scoped = False  # its loads in the order written (KernelEmitter.scoped)

    def __init__(self, mod: ir.Module, kernel: Kernel, buffers: dict[str, Buffer],
                 packed: dict[str, np.ndarray], lanes: int, att: Attention, parts: tuple[Load, Load]):
        super().__init__(mod, kernel, buffers, packed, lanes)
        self.att, (self.q_row, self.k_row) = att, parts
        shape = kernel.shape
        self.vars_ = axis_vars(shape)
        self.rows_axis = rows_axis(kernel, self.k_row, att.v)
        self.heads = [a for a in range(len(shape) - 1) if a != self.rows_axis]
        self.n_rows = shape[self.rows_axis] if self.rows_axis is not None else 1
        # one query row per head (decode): each key is used once, so copying it into panels costs
        # what it saves; scores are dot products along the keys' rows, values read in place
        self.direct = upper(self.n_rows) < DIRECT_BELOW
        self.key_parts = key_parts(kernel) if kernel.scratch is not None else 1
        self.rows = block_rows(host.vector_registers())
        self.state_rows = max(1, STATE_FLOATS // self.rows) * self.rows  # whole blocks of rows
        self.parts = self._row_parts()
        chunk = 2 * lanes  # score columns per micro-kernel step
        self.bj = max(chunk, min(128, SCRATCH_FLOATS // max(att.score.size, 1)) // chunk * chunk)
        # value columns per micro-kernel step: 2 vectors where they divide the row; one query row
        # takes the whole value row at once (up to 8 vectors), so that each row is read in one pass
        whole = shape[-1] // lanes
        self.vchunk = (whole if self.direct and whole <= 8 else
                       next(n for n in (2, 1) if shape[-1] % (n * lanes) == 0)) * lanes
        fixed = isinstance(self.n_rows, int) and isinstance(att.size, int)  # a table needs the sizes
        self.live, self.constant_mask = self._live_blocks() if fixed else (None, None)
        if self.live is not None:
            self.arg_names.append(self.live)
        self.mask = self._run_time_mask() if self.live is None else None

    def _live_blocks(self) -> tuple[str | None, Load | None]:
        """A table, per head, block of `rows` query rows and block of keys, of whether any score in
        it can be above -inf, for scores x = y + mask with the mask a constant (a causal or sliding
        window mask, a bias with the causal mask in it): a block the mask hides throughout is
        skipped (HIDDEN), one where it is 0 throughout computes x without it (UNMASKED). (That
        assumes y finite: an infinite or NaN score under a -inf mask would make the row NaN, as it
        does in torch.) The table is a packed constant; None when there is no such mask, or it
        hides nothing and is nowhere 0 throughout a block; with it, the mask's load."""
        x, k = self.att.x, self.k
        masks = [a for a in _addends(x) if isinstance(a, Load) and a.valid == Num(1)
                 and self.buffers[a.buffer].role == "weight" and self.buffers[a.buffer].data is not None]
        if not masks:
            return None, None
        mask = masks[0]
        heads = [self.vars_[a] for a in self.heads]
        sizes = [k.shape[a] for a in self.heads]
        row = self.vars_[self.rows_axis].name if self.rows_axis is not None else None
        n_rb, n_jb = -(-self.n_rows // self.rows), -(-self.att.size // self.bj)
        if math.prod(sizes) * n_rb * n_jb > MAX_TABLE:
            return None, None
        data = np.asarray(self.buffers[mask.buffer].data).reshape(-1)

        def make() -> np.ndarray:
            table = np.zeros((math.prod(sizes), n_rb, n_jb), np.uint8)
            grid = {self.att.var.name: np.arange(self.att.size)[None, :]}
            if row is not None:
                grid[row] = np.arange(self.n_rows)[:, None]
            padded = np.full((n_rb * self.rows, n_jb * self.bj), -np.inf, np.float32)
            for h, at in enumerate(np.ndindex(*sizes)):
                env = {**grid, **{v.name: int(i) for v, i in zip(heads, at)}}
                padded[:self.n_rows, :self.att.size] = data[evaluate(mask.index, env)]
                blocks = padded.reshape(n_rb, self.rows, n_jb, self.bj)
                table[h] = np.where((blocks == 0).all(axis=(1, 3)), UNMASKED,
                                    (blocks > -np.inf).any(axis=(1, 3)) * LIVE)
            return table.reshape(-1)
        table = derived(data, ("live", str(mask.index), tuple(sizes), self.n_rows, self.att.size, self.rows,
                               self.bj), make)
        if (table == LIVE).all():
            return None, None
        name = f"{PACKED}live_{hashlib.sha256(table.tobytes()).hexdigest()[:16]}"
        self.packed[name] = table
        self.buffers[name] = Buffer(name, table.size, DType.uint8, "weight", table)
        self.used.add(name)
        return name, mask

    def _run_time_mask(self) -> KExpr | None:
        """The part of x that can hide a score when it is only known at run time (a causal mask
        built from the cache's positions): an addend of x that reads no score and holds a -inf
        constant, or, where x is where(c, -inf, the score's term) (or the other way round), -inf
        where it hides. It must not depend on the heads (the liveness table it fills is shared by
        them) and the table must be small (MASK_TABLE)."""
        x, score = self.att.x, self.att.score
        inf = Const(-math.inf, DType.float32)

        def scoreless(e: KExpr) -> bool:
            return score not in walk(e)
        candidates: list[KExpr] = []
        if isinstance(x, Op) and x.op in ("add", "fma"):
            candidates = [a for a in _addends(x) if scoreless(a)]
        elif isinstance(x, Op) and x.op == "where" and inf in x.srcs[1:] and scoreless(x.srcs[0]):
            zero = Const(0.0, DType.float32)
            candidates = [Op("where", (x.srcs[0], *((inf, zero) if x.srcs[1] == inf else (zero, inf))),
                             DType.float32)]
        heads = {self.vars_[a].name for a in self.heads if self.k.shape[a] != 1}
        blocks = -(-upper(self.n_rows) // self.rows) * -(-upper(self.att.size) // self.bj)
        for m in candidates:
            if inf in walk(m) and not free_vars(m) & heads and blocks <= MASK_TABLE:
                return m
        return None

    def _fill_mask_table(self) -> None:
        """live[row block, key block] = whether the run-time mask hides every score of the block
        (HIDDEN: -inf throughout; a NaN counts as live), is 0 throughout it (UNMASKED: the scores
        need no mask, as below a causal mask's diagonal), or neither (LIVE), before the heads run."""
        b, bj = self.b, self.bj
        rows, keys = self.sym(self.n_rows), self.sym(self.att.size)
        self.n_jb = -(-upper(self.att.size) // bj)
        self.table = b.alloca(I8, size=-(-upper(self.n_rows) // self.rows) * self.n_jb)
        for a in self.heads:  # axes of one position (a decode's single query)
            if self.k.shape[a] == 1:
                self.scope.bind(self.vars_[a].name, i64(0))
        inf = ir.Constant(F32, -math.inf)
        # a block's own rows and keys (the last ones partial: a few tokens' blocks are mostly empty)
        within = lambda first, n, limit: b.select(b.icmp_signed("<", b.add(first, i64(n)), limit),  # noqa: E731
                                                  i64(n), b.sub(limit, first))

        def row_block(rb: ir.Value, _a: list) -> list:
            r0 = b.mul(rb, i64(self.rows))

            def key_block(jb: ir.Value, _b: list) -> list:
                j0 = b.mul(jb, i64(bj))

                def row(r: ir.Value, acc: list) -> list:
                    self._bind_row(b.add(r0, r))

                    def key(jj: ir.Value, acc2: list) -> list:
                        self.scope.bind(self.att.var.name, b.add(j0, jj))
                        with self.scope.nested():
                            m = self.emit(self.mask)
                        seen = b.zext(b.fcmp_unordered("!=", m, inf), I8)
                        zero = b.zext(b.fcmp_ordered("==", m, ir.Constant(F32, 0.0)), I8)
                        return [b.or_(acc2[0], seen), b.and_(acc2[1], zero)]
                    return self.loop(i64(0), within(j0, bj, keys), acc, key)
                first = [ir.Constant(I8, 0), ir.Constant(I8, 1)]  # none seen, every one 0
                seen, zero = self.loop(i64(0), within(r0, self.rows, rows), first, row, hint=False)
                flag = b.select(b.icmp_signed("!=", zero, ir.Constant(I8, 0)), ir.Constant(I8, UNMASKED),
                                b.mul(seen, ir.Constant(I8, LIVE)))
                b.store(flag, b.gep(self.table, [b.add(b.mul(rb, i64(self.n_jb)), jb)], source_etype=I8))
                return []
            self.loop(i64(0), b.sdiv(b.add(keys, i64(bj - 1)), i64(bj)), [], key_block, hint=False)
            return []
        self.loop(i64(0), b.sdiv(b.add(rows, i64(self.rows - 1)), i64(self.rows)), [], row_block, hint=False)

    def key(self) -> str:
        # the table is an argument of the code; the rows in flight are a constant of it (tests change them)
        return f"{super().key()}|live:{self.live is not None}|rows:{self.rows},{self.state_rows}," \
            f"{self.parts}|keys:{self.key_parts}"

    def body(self) -> int:
        lanes, shape = self.lanes, self.k.shape
        if 0 in shape:
            return 0
        self.vt = ir.VectorType(F32, lanes)
        self.fma = intrinsic(self.mod, "llvm.fma", self.vt, 3)
        self.exp2 = math_function(self.mod, "exp2_nonpositive")
        b, heads = self.b, self.heads
        self.kt = float_array(b, self.att.score.size * self.bj)
        self.vp = float_array(b, self.k.shape[-1] * self.bj)
        self.s = float_array(b, self.rows * self.bj)
        self.alpha = b.alloca(F32, size=self.rows)
        self.m = b.alloca(F32, size=min(upper(self.n_rows), self.state_rows))
        self.l = b.alloca(F32, size=min(upper(self.n_rows), self.state_rows))
        self.first = i64(0)  # the first row of the rows in flight (the state's row 0)
        self.weights = b.alloca(F32, size=self.key_parts)  # a combine's weight of each part
        if self.mask is not None:
            with self.scope.nested():
                self._fill_mask_table()

        def level(d: int, i: ir.Value, leaf: Callable[[], None]) -> None:
            self.scope.bind(self.vars_[heads[d]].name, i)
            if d + 1 < len(heads):
                self.loop(i64(0), i64(shape[heads[d + 1]]), [], lambda i2, _a: level(d + 1, i2, leaf) or [])
            else:
                leaf()

        def each_head(i: ir.Value, leaf: Callable[[], None]) -> None:
            if heads:
                level(0, i, leaf)
            else:
                leaf()

        def slice_(t: ir.Value, _a: list) -> list:
            # slice t of the outer loop: a position of the first head axis, and a part of its rows or keys
            parts = self.parts * self.key_parts
            i, part = (t, None) if parts == 1 else (b.sdiv(t, i64(parts)), b.srem(t, i64(parts)))
            each_head(i, lambda: self._head(part))
            if self.key_parts > 1:
                self._combine_when_last(i, lambda: each_head(i, self._combine))
            return []

        self.loop(self.fn.args[1], self.fn.args[2], [], slice_, hint=False)
        return (shape[heads[0]] if heads else 1) * self.parts * self.key_parts

    def _row_parts(self) -> int:
        """Parts the query rows are cut into, each a slice of the outer loop of its own, where the
        first head axis alone would load the schedule's threads unevenly or leave one idle (3 heads
        on 2 threads ran 1.43x faster than on 1 at T=1024): prefill rows of a count known now, in
        parts of several row blocks, up to 4 per thread (a causal mask's later rows are the dearer)."""
        threads = self.k.schedule.threads if self.k.schedule is not None else 1
        first = upper(self.k.shape[self.heads[0]]) if self.heads else 1
        if threads <= 1 or self.direct or not isinstance(self.n_rows, int) or first % threads == 0 \
                or first >= 4 * threads:
            return 1
        return max(1, min(4 * threads, self.n_rows // (4 * self.rows)))

    # --- one head: every query row against every key ---------------------------------------------
    def _head(self, part: ir.Value | None = None) -> None:
        """Every query row of the head (of its part: `_row_parts`) against every key, `state_rows`
        rows at a time."""
        b = self.b
        if self.key_parts > 1:  # every row (a few) against this part's keys
            self.part = part
            self._rows_in_flight(i64(0), self.n_rows)
            return
        if part is not None or not isinstance(self.n_rows, int):  # rows from lo, the last group shorter
            if part is None:
                lo, n = i64(0), self.sym(self.n_rows)
            else:
                share = -(-self.n_rows // self.parts)
                per = -(-share // self.rows) * self.rows  # whole row blocks
                lo = b.mul(part, i64(per))
                left = b.sub(i64(self.n_rows), lo)
                n = smin(b, left, i64(per))  # <= 0: no rows

            def group(g: ir.Value, _a: list) -> list:
                first = b.mul(g, i64(self.state_rows))
                left = b.sub(n, first)
                self._rows_in_flight(b.add(lo, first), smin(b, left, i64(self.state_rows)))
                return []
            groups = b.sdiv(b.add(n, i64(self.state_rows - 1)), i64(self.state_rows))
            self.loop(i64(0), groups, [], group, hint=False)
            return
        whole, rest = divmod(self.n_rows, self.state_rows)
        if whole:
            self.loop(i64(0), i64(whole), [], lambda g, _a: self._rows_in_flight(
                self.b.mul(g, i64(self.state_rows)), self.state_rows) or [], hint=False)
        if rest:
            self._rows_in_flight(i64(whole * self.state_rows), rest)

    def _rows_in_flight(self, first: ir.Value, count: int | ir.Value) -> None:
        """Rows first .. first + count (a number, or a value at run time) against every key: their
        state set, the key blocks in turn, the rows normalised."""
        b, att = self.b, self.att
        size, bj = att.size, self.bj
        self.first = first
        rows = i64(count) if isinstance(count, int) else count

        def init(r: ir.Value, _a: list) -> list:
            store_through(b, ir.Constant(F32, -math.inf), b.gep(self.m, [r], source_etype=F32))
            store_through(b, ir.Constant(F32, 0.0), b.gep(self.l, [r], source_etype=F32))
            row = b.add(first, r)
            self._scale_row(row, None)
            return []
        self.loop(i64(0), rows, [], init, hint=False)

        def block(jb: ir.Value, nb: ir.Value) -> None:
            """Keys jb * BJ .. + nb against every row in flight."""
            j0 = b.mul(jb, i64(bj))
            if not self.direct:
                self._pack(j0, nb)
            h = self.rows
            blocked = lambda ib, _b: self._live(b.add(first, b.mul(ib, i64(h))), jb, h, j0, nb) or []
            single = lambda r, _b: self._live(b.add(first, r), jb, 1, j0, nb) or []
            if not isinstance(count, int):
                whole = b.sdiv(rows, i64(self.rows))
                self.loop(i64(0), whole, [], blocked, hint=False)
                self.loop(b.mul(whole, i64(self.rows)), rows, [], single, hint=False)
                return
            whole = count // self.rows
            if whole:
                self.loop(i64(0), i64(whole), [], blocked, hint=False)
            if count % self.rows:
                self.loop(i64(whole * self.rows), i64(count), [], single, hint=False)

        # whole blocks, then the last part: loops of known length over a block's keys vectorise whole
        if self.key_parts > 1:
            self._keys_of_part(block)
        elif isinstance(size, int):
            self.loop(i64(0), i64(size // bj), [], lambda jb, _a: block(jb, i64(bj)) or [], hint=False)
            if size % bj:
                block(i64(size // bj), i64(size % bj))
        else:  # a run-time number of keys
            keys = self.sym(size)
            whole = b.sdiv(keys, i64(bj))
            self.loop(i64(0), whole, [], lambda jb, _a: block(jb, i64(bj)) or [], hint=False)
            left = b.srem(keys, i64(bj))
            with b.if_then(b.icmp_signed(">", left, i64(0))), self.scope.nested():
                block(whole, left)

        def finish(r: ir.Value, _a: list) -> list:
            m = b.load(b.gep(self.m, [r], source_etype=F32), typ=F32)
            if self.key_parts > 1:  # the part's max and sum beside its row, for the combine
                with self.scope.nested():
                    self._bind_row(b.add(first, r))
                    total = b.load(b.gep(self.l, [r], source_etype=F32), typ=F32)
                    for column, value in ((0, m), (1, total)):
                        at = self._partial(self.part, i64(self.k.shape[-1] + column))
                        b.store(value, b.gep(self.out_ptr, [at], source_etype=F32))
                return []
            inv = b.fdiv(ir.Constant(F32, 1.0), b.load(b.gep(self.l, [r], source_etype=F32), typ=F32))
            if att.safe:  # a row of -inf throughout gives 0
                dead = b.fcmp_ordered("==", m, ir.Constant(F32, -math.inf))
                inv = b.select(dead, ir.Constant(F32, 0.0), inv)
            row = b.add(first, r)
            self._scale_row(row, inv)
            return []
        self.loop(i64(0), rows, [], finish, hint=False)

    def _live(self, r0: ir.Value, jb: ir.Value, nr: int, j0: ir.Value, nb: ir.Value) -> None:
        """_rows, unless the live-block table (a constant mask's, or the run-time mask's filled per
        call) says the mask hides the block throughout; without the mask where it is 0 throughout
        the block."""
        b = self.b
        if self.mask is not None:
            at = b.add(b.mul(b.sdiv(r0, i64(self.rows)), i64(self.n_jb)), jb)
            table, mask = self.table, self.mask
        elif self.live is not None:
            n_rb, n_jb = -(-self.n_rows // self.rows), -(-self.att.size // self.bj)
            head = self.sym(ravel([self.vars_[a] for a in self.heads], [self.k.shape[a] for a in self.heads]))
            at = b.add(b.mul(b.add(b.mul(head, i64(n_rb)), b.sdiv(r0, i64(self.rows))), i64(n_jb)), jb)
            table, mask = self.ptr[self.live], self.constant_mask
        else:
            self._rows(r0, nr, j0, nb)
            return
        flag = b.load(b.gep(table, [at], source_etype=I8), typ=I8)
        with b.if_else(b.icmp_signed("==", flag, ir.Constant(I8, UNMASKED))) as (unmasked, other):
            with unmasked, self.scope.nested():
                self.scope.remember(mask, ir.Constant(F32, 0.0))  # an addend of the scores
                self._rows(r0, nr, j0, nb)
            with other, self.scope.nested(), b.if_then(b.icmp_signed("!=", flag, ir.Constant(I8, HIDDEN))):
                self._rows(r0, nr, j0, nb)

    # --- a decode's keys in parts (flash-decoding) ----------------------------------------------
    @property
    def out_ptr(self) -> ir.Value:
        """Where the rows accumulate: the output, or the scratch of a part of split keys."""
        return self.ptr[self.k.scratch] if self.key_parts > 1 else self.ptr[self.k.out]

    def _out_index(self) -> ir.Value:
        """The place in out_ptr of the current row's element (its row and column bound)."""
        if self.key_parts > 1:
            return self._partial(self.part, self.sym(self.vars_[-1]))
        return self.sym(ravel(self.vars_, self.k.shape))

    def _partial(self, part: ir.Value, column: ir.Value) -> ir.Value:
        """The scratch's index of element `column` of the current head's and row's row in part:
        columns 0 .. dv-1 its unnormalised output, dv its max, dv+1 its sum (split_keys)."""
        b = self.b
        head = self.sym(ravel([self.vars_[a] for a in self.heads], [self.k.shape[a] for a in self.heads]))
        row = self.sym(self.vars_[self.rows_axis]) if self.rows_axis is not None else i64(0)
        at = b.add(b.mul(b.add(b.mul(head, i64(self.key_parts)), part), i64(self.n_rows)), row)
        return b.add(b.mul(at, i64(self.k.shape[-1] + 2)), column)

    def _keys_of_part(self, block: Callable[[ir.Value, ir.Value], None]) -> None:
        """block(jb, n) for the key blocks of this slice's part: as many whole blocks each (the
        last parts fewer, or none), the partial last block in the part that holds it."""
        b, bj, parts = self.b, self.bj, self.key_parts
        keys = self.sym(self.att.size)
        whole = b.sdiv(keys, i64(bj))
        n_blocks = b.sdiv(b.add(keys, i64(bj - 1)), i64(bj))
        per = b.sdiv(b.add(n_blocks, i64(parts - 1)), i64(parts))
        first = b.mul(self.part, per)
        last = smin(b, b.add(first, per), n_blocks)
        self.loop(first, smin(b, last, whole), [], lambda jb, _a: block(jb, i64(bj)) or [], hint=False)
        left = b.srem(keys, i64(bj))
        holds = b.and_(b.icmp_signed("<=", first, whole), b.icmp_signed("<", whole, last))
        with b.if_then(b.and_(holds, b.icmp_signed(">", left, i64(0)))), self.scope.nested():
            block(whole, left)

    def _combine_when_last(self, i: ir.Value, combine: Callable[[], None]) -> None:
        """combine() in the slice that finishes last among the parts of position i of the first
        head axis: its counter (zeroed by the caller) counts the parts done. The increment releases
        this part's rows and acquires the others'."""
        b = self.b
        at = b.gep(self.ptr[self.k.scratch], [b.add(i64(counters_at(self.k, self.key_parts)), i)],
                   source_etype=F32)
        done = b.atomic_rmw("add", at, ir.Constant(I32, 1), "acq_rel")
        with b.if_then(b.icmp_signed("==", done, ir.Constant(I32, self.key_parts - 1))), self.scope.nested():
            combine()

    def _combine(self) -> None:
        """The current head's rows from its parts (`_combine_row`)."""
        for r in range(self.n_rows):
            with self.scope.nested():
                self._bind_row(i64(r))
                self._combine_row()

    def _combine_row(self) -> None:
        """out = sum_p w_p o_p / sum_p w_p l_p, w_p = exp2((m_p - max_p m_p) * scale), for the
        current row; a row of -inf throughout as one pass over the keys leaves it (0 when safe,
        else NaN)."""
        b, parts, dv = self.b, self.key_parts, self.k.shape[-1]
        maxnum = intrinsic(self.mod, "llvm.maxnum", F32, 2)
        inf, zero = ir.Constant(F32, -math.inf), ir.Constant(F32, 0.0)
        scratch = self.ptr[self.k.scratch]
        part_at = lambda p, column: b.gep(scratch, [self._partial(p, column)], source_etype=F32)  # noqa: E731
        weight_at = lambda p: b.gep(self.weights, [p], source_etype=F32)  # noqa: E731
        (top,) = self.loop(i64(0), i64(parts), [inf], lambda p, a: [b.call(
            maxnum, [a[0], b.load(part_at(p, i64(dv)), typ=F32)], fastmath=("nnan", "nsz"))], hint=False)
        shift = b.select(b.fcmp_ordered("==", top, inf), zero, top)

        def weigh(p: ir.Value, acc: list) -> list:
            m = b.load(part_at(p, i64(dv)), typ=F32)
            w = b.call(self.exp2, [b.fmul(b.fsub(m, shift), ir.Constant(F32, self.att.scale))])
            b.store(w, weight_at(p))
            return [b.fadd(acc[0], b.fmul(w, b.load(part_at(p, i64(dv + 1)), typ=F32)))]
        (total,) = self.loop(i64(0), i64(parts), [zero], weigh, hint=False)
        inv = b.fdiv(ir.Constant(F32, 1.0), total)
        if self.att.safe:
            inv = b.select(b.fcmp_ordered("==", top, inf), zero, inv)

        def column(e: ir.Value, _a: list) -> list:
            (value,) = self.loop(i64(0), i64(parts), [zero], lambda p, a: [b.fadd(a[0], b.fmul(
                b.load(weight_at(p), typ=F32), b.load(part_at(p, e), typ=F32)))], hint=False)
            self.scope.bind(self.vars_[-1].name, e)
            at = b.gep(self.ptr[self.k.out], [self.sym(ravel(self.vars_, self.k.shape))], source_etype=F32)
            b.store(b.fmul(value, inv), at)
            return []
        self.loop(i64(0), i64(dv), [], column, hint=False)

    def _scale_row(self, row: ir.Value, scale: ir.Value | None) -> None:
        """out[row, :] = 0 (scale None) or out[row, :] * scale."""
        b = self.b

        def column(e: ir.Value, _a: list) -> list:
            self.scope.bind(self.vars_[-1].name, e)
            at = b.gep(self.out_ptr, [self._out_index()], source_etype=F32)
            b.store(ir.Constant(F32, 0.0) if scale is None else b.fmul(b.load(at, typ=F32), scale), at)
            return []
        with self.scope.nested():
            self._bind_row(row)
            self.loop(i64(0), i64(self.k.shape[-1]), [], column)

    def _pack(self, j0: ir.Value, nb: ir.Value) -> None:
        """The block's keys and values as panels that the micro-kernels read in order: kt[(c * depth
        + d) * chunk + w] = key(j0 + c * chunk + w, d), chunk = 2 vectors of keys; vp[(c * BJ + jj) *
        vchunk + w] = value(j0 + jj, c * vchunk + w), vchunk = the values' columns per step."""
        b, d_var, lanes = self.b, self.att.score.var, self.lanes
        chunk, depth = 2 * lanes, self.att.score.size

        def key(jj: ir.Value, _a: list, zero: bool = False) -> list:
            panel = b.mul(b.sdiv(jj, i64(chunk)), i64(depth * chunk))
            column = b.srem(jj, i64(chunk))

            def along(d: ir.Value, _b: list) -> list:
                self.scope.bind(d_var.name, d)
                at = b.add(panel, b.add(b.mul(d, i64(chunk)), column))
                value = ir.Constant(F32, 0.0) if zero else self.emit(self.k_row)
                store_through(b, value, b.gep(self.kt, [at], source_etype=F32))
                return []
            self.scope.bind(self.att.var.name, b.add(j0, jj))
            self.loop(i64(0), i64(depth), [], along, hint=False)
            return []
        self.loop(i64(0), nb, [], key, hint=False)
        # the last chunk's columns past the keys are multiplied too (their scores unread): zeros, not
        # what the scratch held, whose denormals took the FMAs' slow path (33 keys: 20x slower)
        padded = b.mul(b.sdiv(b.add(nb, i64(chunk - 1)), i64(chunk)), i64(chunk))
        self.loop(nb, padded, [], lambda jj, _a: key(jj, _a, zero=True), hint=False)
        vchunk = self.vchunk
        e_var = self.vars_[-1].name

        def value(jj: ir.Value, _a: list) -> list:
            for c in range(self.k.shape[-1] // vchunk):
                with self.scope.nested():
                    self.scope.bind(self.att.var.name, b.add(j0, jj))
                    self.scope.bind(e_var, i64(c * vchunk))
                    start = self.sym(self.att.v.index)
                to = b.mul(b.add(i64(c * self.bj), jj), i64(vchunk))
                for v in range(vchunk // lanes):
                    self._vstore(self._vload(self.ptr[self.att.v.buffer], b.add(start, i64(v * lanes))),
                                 self.vp, b.add(to, i64(v * lanes)))
            return []
        self.loop(i64(0), nb, [], value, hint=False)

    def _vload(self, base: ir.Value, at: ir.Value) -> ir.Value:
        return self.b.load(vector_ptr(self.b, base, at), typ=self.vt, align=4)

    def _vstore(self, v: ir.Value, base: ir.Value, at: ir.Value) -> None:
        store_through(self.b, v, vector_ptr(self.b, base, at))

    # --- a block of query rows against a block of keys -----------------------------------------
    def _rows(self, r0: ir.Value, nr: int, j0: ir.Value, nb: ir.Value) -> None:
        b, att, lanes, bj = self.b, self.att, self.lanes, self.bj
        chunk = 2 * lanes
        rows = [b.add(r0, i64(r)) for r in range(nr)]

        def scores(c: ir.Value, _a: list) -> list:
            col = b.mul(c, i64(chunk))

            def step(d: ir.Value, accs: list) -> list:
                self.scope.bind(att.score.var.name, d)
                at = b.mul(b.add(b.mul(c, i64(att.score.size)), d), i64(chunk))
                kv = [self._vload(self.kt, b.add(at, i64(v * lanes))) for v in range(2)]
                out = list(accs)
                for r in range(nr):
                    with self.scope.nested():
                        self._bind_row(rows[r])
                        qv = splat(b, self.emit(self.q_row), lanes)
                    for v in range(2):
                        out[2 * r + v] = b.call(self.fma, [qv, kv[v], out[2 * r + v]])
                return out
            zeros = [ir.Constant(self.vt, [0.0] * lanes)] * (2 * nr)
            accs = self.loop(i64(0), i64(att.score.size), zeros, step, hint=False)
            for r in range(nr):
                for v in range(2):
                    self._vstore(accs[2 * r + v], self.s, b.add(i64(r * bj), b.add(col, i64(v * lanes))))
            return []
        if not self.direct:
            self.loop(i64(0), b.sdiv(b.add(nb, i64(chunk - 1)), i64(chunk)), [], scores, hint=False)
        for r in range(nr):
            self._online(rows[r], r, j0, nb)
        self._weighted(rows, j0, nb)

    def _bind_row(self, row: ir.Value) -> None:
        if self.rows_axis is not None:
            self.scope.bind(self.vars_[self.rows_axis].name, row)

    def _online(self, row: ir.Value, r: int, j0: ir.Value, nb: ir.Value) -> None:
        """Row r's scores through x, then its running max and sum updated, its probabilities left in
        the scratch and the rescaling of its output so far in alpha[r]."""
        b, att = self.b, self.att
        maxnum = intrinsic(self.mod, "llvm.maxnum", F32, 2)
        at = lambda jj: b.gep(self.s, [b.add(i64(r * self.bj), jj)], source_etype=F32)

        def score(jj: ir.Value, accs: list) -> list:
            self._bind_row(row)
            self.scope.bind(att.var.name, b.add(j0, jj))
            if not self.direct:  # else x computes its score: a dot product along the key's row
                self.scope.remember(att.score, b.load(at(jj), typ=F32))
            x = self.emit(att.x)
            store_through(b, x, at(jj))
            return [b.call(maxnum, [accs[0], x], fastmath=("nnan", "nsz"))]
        (top,) = self.loop(i64(0), nb, [ir.Constant(F32, -math.inf)], score)
        state = b.sub(row, self.first)
        m_at = b.gep(self.m, [state], source_etype=F32)
        l_at = b.gep(self.l, [state], source_etype=F32)
        m_old = b.load(m_at, typ=F32)
        m_new = b.call(maxnum, [m_old, top], fastmath=("nnan", "nsz"))
        inf = ir.Constant(F32, -math.inf)
        # a row of -inf so far shifts by 0: its terms are exp2(-inf) = 0, not exp2(NaN)
        shift = b.select(b.fcmp_ordered("==", m_new, inf), ir.Constant(F32, 0.0), m_new)
        log2e = ir.Constant(F32, att.scale)

        def prob(jj: ir.Value, accs: list) -> list:
            p = b.call(self.exp2, [b.fmul(b.fsub(b.load(at(jj), typ=F32), shift), log2e)])
            store_through(b, p, at(jj))
            return [accumulate(b, "add", accs[0], p, DType.float32)]
        (total,) = self.loop(i64(0), nb, [ir.Constant(F32, 0.0)], prob, unroll=2)  # 4 would spill
        alpha = b.call(self.exp2, [b.fmul(b.fsub(m_old, shift), log2e)])
        b.store(b.fadd(b.fmul(b.load(l_at, typ=F32), alpha), total), l_at)
        b.store(m_new, m_at)
        b.store(alpha, b.gep(self.alpha, [i64(r)], source_etype=F32))  # _weighted rescales the row
    def _weighted(self, rows: list[ir.Value], j0: ir.Value, nb: ir.Value) -> None:
        """out[row, :] = out[row, :] * alpha[row] + sum over the block's keys of p[row, j] * v[j, :],
        for each of rows (alpha: the rescaling of the row's sum so far to its new maximum)."""
        b, att, lanes, bj = self.b, self.att, self.lanes, self.bj
        dv = self.k.shape[-1]
        nv = self.vchunk // lanes
        e_var = self.vars_[-1].name

        def cols(c: ir.Value, _a: list) -> list:
            e0 = b.mul(c, i64(nv * lanes))
            places = []
            for row in rows:
                with self.scope.nested():
                    self._bind_row(row)
                    self.scope.bind(e_var, e0)
                    places.append(self._out_index())

            def step(jj: ir.Value, accs: list) -> list:
                if self.direct:  # the value row itself
                    with self.scope.nested():
                        self.scope.bind(att.var.name, b.add(j0, jj))
                        self.scope.bind(e_var, e0)
                        start = self.sym(att.v.index)
                    source = self.ptr[att.v.buffer]
                    vv = [self._vload(source, b.add(start, i64(v * lanes))) for v in range(nv)]
                else:
                    start = b.mul(b.add(b.mul(c, i64(bj)), jj), i64(nv * lanes))
                    vv = [self._vload(self.vp, b.add(start, i64(v * lanes))) for v in range(nv)]
                new = list(accs)
                for r in range(len(rows)):
                    p_at = b.gep(self.s, [b.add(i64(r * bj), jj)], source_etype=F32)
                    p = splat(b, b.load(p_at, typ=F32), lanes)
                    for v in range(nv):
                        new[r * nv + v] = b.call(self.fma, [p, vv[v], new[r * nv + v]])
                return new
            alphas = [splat(b, b.load(b.gep(self.alpha, [i64(r)], source_etype=F32), typ=F32), lanes)
                      for r in range(len(rows))]
            accs = [b.fmul(self._vload(self.out_ptr, b.add(place, i64(v * lanes))), alphas[r])
                    for r, place in enumerate(places) for v in range(nv)]
            accs = self.loop(i64(0), nb, accs, step, hint=False)
            for r, place in enumerate(places):
                for v in range(nv):
                    self._vstore(accs[r * nv + v], self.out_ptr, b.add(place, i64(v * lanes)))
            return []
        self.loop(i64(0), i64(dv // (nv * lanes)), [], cols, hint=False)
