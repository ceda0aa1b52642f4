"""How a kernel maps onto a GPU: a `GpuSchedule` picks one of four strategies, all launched
as a 1-D grid of work-groups (see eclat.backends.gpu), the default schedule of a kernel and the
schedules worth timing, and the checks that decide where loads may be vectorised."""

from __future__ import annotations

import math
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

STRATEGIES = ("flat", "row", "tile", "attention")
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


def tile_contraction(kernel: Kernel) -> Contraction | None:
    """kernel as a contraction the tile strategy can run (float32, more than one output), or None."""
    c = as_contraction(kernel)
    return c if c is not None and c.reduce.dtype is DType.float32 and kernel.numel > 1 else None


def _tile_for(kernel: Kernel, c: Contraction, tm: int, tn: int, tk: int, rm: int, rn: int) -> GpuSchedule:
    m = kernel.shape[c.m_axis] if c.m_axis is not None else 1
    n = kernel.shape[c.n_axis]
    tm, tn = min(tm, _pow2(m)), min(tn, _pow2(n))
    rm, rn = min(rm, tm), min(rn, tn)
    return GpuSchedule("tile", tile=(tm, tn, min(tk, _pow2(c.reduce.size))), micro=(rm, rn))


def attention_kernel(kernel: Kernel) -> bool:
    """kernel is an Attention (compiler.kernel) the attention strategy runs: float32."""
    return kernel.body.dtype is DType.float32 and as_attention(kernel) is not None


def default_gpu_schedule(kernel: Kernel) -> GpuSchedule:
    if attention_kernel(kernel):
        return GpuSchedule("attention", threads=64)
    c = tile_contraction(kernel)
    m = kernel.shape[c.m_axis] if c is not None and c.m_axis is not None else 1
    if c is not None and (m >= MATVEC_ROWS or c.reduce.size < ROW_MIN_REDUCE * 4):
        return _tile_for(kernel, c, 64, 64, 16, 4, 4)
    size = _long_reduce(kernel)
    if size >= ROW_MIN_REDUCE:
        inner = math.prod(kernel.shape[row_axes(kernel):])
        return GpuSchedule("row", threads=min(MAX_THREADS, max(32, _pow2(max(size, inner)))))
    return GpuSchedule("flat", threads=MAX_THREADS, vector=4 if vector_ok(kernel, 4) else 1)


def gpu_schedule_space(kernel: Kernel) -> list[GpuSchedule]:
    """The schedules worth timing for kernel, the default first."""
    if attention_kernel(kernel):  # as plain loops, each score would be computed per output column
        return [GpuSchedule("attention", threads=t) for t in (64, 32, 128, 256)]
    out = [default_gpu_schedule(kernel)]
    c = tile_contraction(kernel)
    if c is not None:
        tiles = ((32, 32, 16, 2, 2), (64, 64, 16, 4, 4), (128, 64, 8, 8, 4), (64, 128, 8, 4, 8),
                 (128, 128, 8, 8, 8), (16, 64, 16, 1, 4))  # (TM, TN, TK, RM, RN)
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


__all__ = ["MATVEC_ROWS", "MAX_THREADS", "ROW_MIN_REDUCE", "STRATEGIES", "GpuSchedule",
           "default_gpu_schedule", "gpu_schedule_space", "row_axes", "tile_contraction", "unit_stride",
           "vector_loads", "vector_ok"]
