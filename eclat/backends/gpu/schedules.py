"""How a kernel maps onto a GPU: a `GpuSchedule` picks one of five strategies, all launched
as a 1-D grid of work-groups (see eclat.backends.gpu), the default schedule of a kernel and the
schedules worth timing on a dialect (tensor cores where it has them: `mma_contraction`, TF32 only
where the user allows it: `tf32_allowed`), and the checks that decide where loads may be vectorised."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

from ...compiler.kernel import (
    Contraction,
    Kernel,
    KExpr,
    Load,
    as_attention,
    as_contraction,
    free_vars,
    loads,
    reduces,
)
from ...ir.dtypes import DType
from ...ir.symbolic import Expr, Num, Var, terms
from .dialects import Dialect

STRATEGIES = ("flat", "row", "tile", "attention", "decode", "mma")
ROW_MIN_REDUCE = 32  # a reduction at least this long gets a work-group of its own
MATVEC_ROWS = 4  # a contraction with fewer rows (a decode step) and a long k: a work-group per output
# an attention with fewer query rows (a decode step's heads) splits each row's keys among a work-group
# by default: a thread per row would make under 8 groups of 64 (not yet timed on a GPU)
DECODE_ROWS = 512
MAX_THREADS = 256
FRAGMENT = 16  # the m and n of a WMMA fragment (16x16x16 for 16-bit operands, 16x16x8 for tf32)
MMA_SHARED_BYTES = 48 * 1024  # a block's static shared memory (cuda/nvcc.py): larger mma tiles are left out
# the threshold of the tolerance of a TF32 schedule: see tf32_tolerance
_TF32_RTOL = 1e-3


@dataclass(frozen=True)
class GpuSchedule:
    """How one kernel maps onto a GPU. `threads` is the work-group size of flat and row;
    tile: (TM, TN, TK) shared-memory tile and micro: (RM, RN) per-thread register block
    (threads = TM/RM * TN/RN). vector: 4 for float4 loads in flat kernels, else 1.
    mma: (TM, TN, TK) as tile, and warps: (WY, WX) warps each computing a TM/WY x TN/WX block
    of 16x16 tensor-core fragments (threads = 32 * WY * WX)."""

    strategy: str = "flat"
    threads: int = 256
    tile: tuple[int, int, int] = (64, 64, 16)
    micro: tuple[int, int] = (4, 4)
    vector: int = 1
    warps: tuple[int, int] = (2, 2)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"GPU strategy {self.strategy!r} is not one of {STRATEGIES}")
        tm, tn, tk = self.tile
        rm, rn = self.micro
        if tm % rm or tn % rn:
            raise ValueError(f"tile {self.tile} is not a multiple of the register block {self.micro}")
        if self.vector not in (1, 2, 4):
            raise ValueError(f"vector width {self.vector} is not 1, 2 or 4")
        if self.strategy == "mma":
            wy, wx = self.warps
            if wy < 1 or wx < 1 or wy * wx > 1024 // 32:
                raise ValueError(f"warp layout {self.warps} is not 1 to 32 warps")
            if tm % (FRAGMENT * wy) or tn % (FRAGMENT * wx) or tk % FRAGMENT or tk < FRAGMENT:
                raise ValueError(f"mma tile {self.tile} is not {self.warps} warps of 16x16 fragments "
                                 f"over a multiple of 16 in k")

    @property
    def group_size(self) -> int:
        if self.strategy == "tile":
            return (self.tile[0] // self.micro[0]) * (self.tile[1] // self.micro[1])
        if self.strategy == "mma":
            return 32 * self.warps[0] * self.warps[1]
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


def tile_contraction(kernel: Kernel) -> Contraction | None:
    """kernel as a contraction the tile strategy can run (more than one output; float32, or float16
    or bfloat16, whose values every dialect reads into float registers: the tile stages and
    accumulates them in float, and the result is rounded where it is stored), or None."""
    c = as_contraction(kernel)
    return c if c is not None and c.reduce.dtype in _FLOATS and kernel.numel > 1 else None


_FLOATS = (DType.float32, DType.float16, DType.bfloat16)
# the operand types of a contraction on tensor cores -> the WMMA element type of its fragments
MMA_TYPES = {DType.float16: "half", DType.bfloat16: "bfloat16", DType.float32: "tf32"}


def tf32_allowed() -> bool:
    """Whether float32 contractions may run on tensor cores in TF32 (10-bit mantissas): the user said
    so with ECLAT_ALLOW_TF32=1, or in torch (torch.backends.cuda.matmul.allow_tf32, or its newer
    fp32_precision = "tf32"), read only where torch is already imported; False otherwise."""
    if os.environ.get("ECLAT_ALLOW_TF32") == "1":
        return True
    torch = sys.modules.get("torch")
    matmul = getattr(getattr(getattr(torch, "backends", None), "cuda", None), "matmul", None)
    if matmul is None:
        return False
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:  # torch >= 2.9 refuses the legacy flag once the new API set the precision
        return getattr(matmul, "fp32_precision", None) == "tf32"


def mma_operands(kernel: Kernel) -> str | None:
    """The fragment type ("half", "bfloat16", "tf32") the mma strategy would run kernel's contraction
    in, its operands and sum all of one float type; None if it is no such contraction."""
    c = as_contraction(kernel)
    if c is None or kernel.numel <= 1 or not (c.a.dtype is c.b.dtype is c.reduce.dtype):
        return None
    return MMA_TYPES.get(c.reduce.dtype)


def mma_contraction(kernel: Kernel, dialect: Dialect | None, tf32: bool | None = None) -> Contraction | None:
    """kernel as a contraction the mma strategy may run on dialect's matrix unit: 16-bit operands,
    or float32 ones where TF32 is allowed (tf32; None: `tf32_allowed()`); None where it may not."""
    kind = mma_operands(kernel) if dialect is not None and dialect.matrix_unit == "wmma" else None
    if kind is None or (kind == "tf32" and not (tf32_allowed() if tf32 is None else tf32)):
        return None
    return as_contraction(kernel)


def uses_tf32(kernel: Kernel, schedule: GpuSchedule) -> bool:
    """schedule runs kernel's float32 products in TF32 (an mma schedule of a float32 contraction)."""
    return schedule.strategy == "mma" and mma_operands(kernel) == "tf32"


def tf32_tolerance(kernel: Kernel) -> dict[str, float]:
    """How far a TF32 schedule of kernel may be from its float32 default. TF32 rounds each operand to
    10 mantissa bits (relative error up to 2^-11, ~4.9e-4), so a product is off by up to ~1e-3 and
    a sum of K of them by ~1e-3 * sqrt(K) times a typical product where the rounding errors are
    independent, which, relative to the largest output (agrees' atol scale), is ~1e-3 for K near 64
    and grows as sqrt(K): rtol = atol = 1e-3 * sqrt(K / 64), at least 1e-3. The float32 default's
    own error (2^-24 per operation) is negligible beside it."""
    c = as_contraction(kernel)
    k = c.reduce.size if c is not None else 1
    tol = _TF32_RTOL * max(1.0, math.sqrt(k / 64))
    return {"rtol": tol, "atol": tol}


def _mma_for(kernel: Kernel, c: Contraction, tm: int, tn: int, tk: int, wy: int, wx: int) -> GpuSchedule:
    """An mma schedule no larger than the problem: TM, TN and TK clamped to the next power of two of
    M, N and K, at least one fragment; the warps that no longer fit along one axis go to the other
    where it has fragments to spare, and where fewer threads are left, TK is halved until each
    prefetches at most 32 values again (see MMA_TILES)."""
    m = kernel.shape[c.m_axis] if c.m_axis is not None else 1
    n = kernel.shape[c.n_axis]
    tm, tn = min(tm, max(FRAGMENT, _pow2(m))), min(tn, max(FRAGMENT, _pow2(n)))
    warps = wy * wx
    wy = min(wy, tm // FRAGMENT)
    wx = min(max(wx, warps // wy), tn // FRAGMENT)
    wy = min(max(wy, warps // wx), tm // FRAGMENT)
    tk = min(tk, max(FRAGMENT, _pow2(c.reduce.size)))
    while tk > FRAGMENT and tk * (tm + tn) > 32 * 32 * wy * wx:
        tk //= 2
    return GpuSchedule("mma", tile=(tm, tn, tk), warps=(wy, wx))


def mma_shared_bytes(schedule: GpuSchedule, kind: str) -> int:
    """Shared memory of an mma schedule (see gpu/mma.py): a and b's TK-deep slices in the fragment
    type, each row padded by 16 bytes, whichever way they are laid out (the larger), and a 16 x 20
    float staging tile per warp."""
    (tm, tn, tk), (wy, wx) = schedule.tile, schedule.warps
    size = 4 if kind == "tf32" else 2
    pad = 16 // size
    slices = sum(max(w * (tk + pad), tk * (w + pad)) for w in (tm, tn)) * size
    return slices + wy * wx * FRAGMENT * (FRAGMENT + 4) * 4


def _tile_for(kernel: Kernel, c: Contraction, tm: int, tn: int, tk: int, rm: int, rn: int) -> GpuSchedule:
    m = kernel.shape[c.m_axis] if c.m_axis is not None else 1
    n = kernel.shape[c.n_axis]
    tm, tn = min(tm, _pow2(m)), min(tn, _pow2(n))
    rm, rn = min(rm, tm), min(rn, tn)
    return GpuSchedule("tile", tile=(tm, tn, min(tk, _pow2(c.reduce.size))), micro=(rm, rn))


def attention_kernel(kernel: Kernel) -> bool:
    """kernel is an Attention (compiler.kernel) the attention strategy runs: float32."""
    return kernel.body.dtype is DType.float32 and as_attention(kernel) is not None


def _attention_schedules(kernel: Kernel) -> list[GpuSchedule]:
    """A thread per query row, or, where the rows are too few to fill a GPU with threads of their
    own (decode: a query a head), first a work-group per row splitting its keys (the decode strategy)."""
    per_row = [GpuSchedule("attention", threads=t) for t in (64, 32, 128, 256)]
    split = [GpuSchedule("decode", threads=t) for t in (128, 64, 256)]
    return split + per_row if math.prod(kernel.shape[:-1]) < DECODE_ROWS else per_row + split


# (TM, TN, TK, WY, WX) of the mma strategy: the default's three sizes (see default_gpu_schedule),
# then rectangular tiles, a deeper k, and few rows (a batch of 16). Each thread prefetches at most
# TK * (TM + TN) / threads <= 32 operand values into registers: with more, ptxas (sm_80, sm_90) ran
# out of its 255 registers and spilled (a warp holds WM/16 * WN/16 accumulators of 8 floats, and
# fragments of a and b of 8 (4 for tf32) registers each besides)
MMA_TILES = ((128, 128, 32, 4, 2), (64, 64, 32, 2, 2), (32, 64, 32, 2, 2), (128, 64, 32, 4, 2),
             (64, 128, 32, 2, 4), (64, 64, 64, 4, 2), (16, 64, 32, 1, 4))


def default_gpu_schedule(kernel: Kernel, dialect: Dialect | None = None) -> GpuSchedule:
    """The schedule kernel runs with untuned, on dialect (None: one without a matrix unit): a
    16-bit contraction runs on tensor cores where the dialect has them, float32 never by default."""
    if attention_kernel(kernel):
        return _attention_schedules(kernel)[0]
    c = tile_contraction(kernel)
    m = kernel.shape[c.m_axis] if c is not None and c.m_axis is not None else 1
    if c is not None and (m >= MATVEC_ROWS or c.reduce.size < ROW_MIN_REDUCE * 4):
        if mma_contraction(kernel, dialect, tf32=False) is not None:
            # 128x128 where that makes 256 groups or more, else 64x64, else 32x64 (not measured yet:
            # the sizes of the tile strategy's choice, a fragment's 16 x 16 x 16 per warp step)
            big, mid = kernel.numel >= 256 * 128 * 128, kernel.numel >= 256 * 64 * 64
            return _mma_for(kernel, c, *MMA_TILES[0 if big else 1 if mid else 2])
        # 64x64 tiles where they make 256 groups or more (two per multiprocessor of a large GPU),
        # else 32x64: twice the groups (measured on an H200: 1024^3 and a batch-64 MLP's layers)
        big = kernel.numel >= 256 * 64 * 64
        return _tile_for(kernel, c, *((64, 64, 16, 8, 4) if big else (32, 64, 16, 4, 4)))
    size = _long_reduce(kernel)
    if size >= ROW_MIN_REDUCE:
        inner = math.prod(kernel.shape[row_axes(kernel):])
        return GpuSchedule("row", threads=min(MAX_THREADS, max(32, _pow2(max(size, inner)))))
    return GpuSchedule("flat", threads=MAX_THREADS, vector=4 if vector_ok(kernel, 4) else 1)


def gpu_schedule_space(kernel: Kernel, dialect: Dialect | None = None,
                       tf32: bool | None = None) -> list[GpuSchedule]:
    """The schedules worth timing for kernel on dialect (None: one without a matrix unit), the
    default first. mma schedules where dialect has a matrix unit and the operands are 16-bit, or
    float32 where TF32 is allowed (tf32; None: `tf32_allowed()`), those that fit shared memory."""
    if attention_kernel(kernel):  # as plain loops, each score would be computed per output column
        return _attention_schedules(kernel)
    out = [default_gpu_schedule(kernel, dialect)]
    mc = mma_contraction(kernel, dialect, tf32)
    if mc is not None:
        kind = mma_operands(kernel)
        out += [s for s in (_mma_for(kernel, mc, *t) for t in MMA_TILES)
                if mma_shared_bytes(s, kind) <= MMA_SHARED_BYTES]
    c = tile_contraction(kernel)
    if c is not None:
        # (TM, TN, TK, RM, RN): large products, then mid-sized, then few rows (a batch of 16 to 64)
        # and a long k, where the smallest tiles make enough groups to fill the GPU
        tiles = ((64, 64, 16, 8, 4), (64, 64, 16, 8, 8), (128, 128, 16, 8, 8), (32, 64, 16, 4, 4),
                 (64, 32, 32, 4, 4), (16, 64, 32, 2, 4), (32, 32, 32, 2, 2), (16, 32, 32, 2, 2))
        out += [_tile_for(kernel, c, *t) for t in tiles]
    if reduces(kernel.body):
        out += [GpuSchedule("row", threads=t) for t in (64, 128, 256)]
    out += [GpuSchedule("flat", threads=t) for t in (64, 128, 256)]
    if vector_ok(kernel, 4):
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


def vector_loads(kernel: Kernel, width: int) -> list[Load]:
    """The float32 loads of kernel that read `width` consecutive, aligned elements as its last
    output axis steps (and are never masked): those a vectorised flat kernel reads as one vector."""
    if not kernel.shape:
        return []
    last = f"i{len(kernel.shape) - 1}"
    return [x for x in loads(kernel.body) if isinstance(x, Load) and x.dtype is DType.float32
            and x.valid == Num(1) and _unit_aligned(x.index, last, width)]


def vector_ok(kernel: Kernel, width: int) -> bool:
    """kernel can run flat with `width` outputs per thread and vector loads."""
    return (bool(kernel.shape) and kernel.shape[-1] % width == 0 and not reduces(kernel.body)
            and bool(vector_loads(kernel, width)))


def unit_stride(e: KExpr, var: str) -> bool:
    """e is a load whose index steps by one element as var does."""
    if not isinstance(e, Load):
        return False
    return [c for c, a in terms(e.index) if isinstance(a, Var) and a.name == var] == [1]


@dataclass(frozen=True)
class TileOperand:
    """One factor of a tile contraction: its expression, tile width (TM or TN), the size and
    variable of its axis (None: a has no row axis), tile index, shared array and registers."""

    expr: KExpr
    width: int
    size: int
    var: str | None
    tile: str
    smem: str
    regs: str
    along_k: bool  # unit-stride in k: read along k, stored down a column of the slice

    @property
    def ld(self) -> int:
        """The slice's row length: a column's stores of consecutive threads would share banks
        TM (TN) apart, padded by 4 floats they fall in distinct ones, rows still 16-byte aligned."""
        return self.width + 4 if self.along_k else self.width


__all__ = ["FRAGMENT", "MATVEC_ROWS", "MAX_THREADS", "MMA_TILES", "MMA_TYPES", "ROW_MIN_REDUCE",
           "STRATEGIES", "GpuSchedule", "TileOperand", "default_gpu_schedule", "gpu_schedule_space",
           "mma_contraction", "mma_operands", "mma_shared_bytes", "row_axes", "tf32_allowed",
           "tf32_tolerance", "tile_contraction", "unit_stride", "uses_tf32", "vector_loads", "vector_ok"]
