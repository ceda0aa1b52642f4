"""The CPU's schedules: the default one (no tuning needed) and the space an autotuner times.

A contraction's register block is MR rows x NR columns of the output, NR a whole number of
vectors: the micro-kernel keeps MR x NR/lanes accumulators in vector registers, and per step of
the reduction holds one broadcast left operand and at least one right-operand vector beside them
(the rest are read as memory operands of the fmas). The tiles below are written in vectors for a
16-register file (AVX2, SSE); a 32-register file (AVX-512, NEON) holds twice the rows. On an
8-lane AVX2 host that is GEMM tiles (6,16) (4,16) (8,8) (4,24) (3,32) (2,32) (6,8) (12,8),
matrix-vector tiles (1,16) (1,32) (1,64), default (6,16), and (m,32) for fewer than 4 rows.
"""

from __future__ import annotations

from dataclasses import replace

from ...compiler.kernel import Kernel, Schedule, as_contraction
from ...ir.symbolic import upper
from . import host

# (rows, vectors) for 16 vector registers; the first is the default
GEMM_VECTOR_TILES = [(6, 2), (4, 2), (8, 1), (4, 3), (3, 4), (2, 4), (6, 1), (12, 1)]
GEMV_VECTOR_TILES = [(1, 2), (1, 4), (1, 8)]  # rows fewer than 4: one row, wide
MATVEC_VECTORS = 4  # the default's width when there are fewer than 4 rows (each row its own)
MATVEC_ROWS = 4  # fewer output rows than this: a matrix-vector product
OPERAND_REGISTERS = 2  # the broadcast left value and one right-operand vector


def fits(tile: tuple[int, int], lanes: int, registers: int) -> bool:
    """Whether an MR x NR tile's accumulators and operands fit the vector register file."""
    mr, nr = tile
    return nr % lanes == 0 and mr * (nr // lanes) + OPERAND_REGISTERS <= registers


def _defaults(lanes: int | None, registers: int | None) -> tuple[int, int]:
    return (host.vector_lanes() if lanes is None else lanes,
            host.vector_registers() if registers is None else registers)


def gemm_tiles(lanes: int | None = None, registers: int | None = None) -> list[tuple[int, int]]:
    """The register blocks (MR, NR) of a matrix-matrix product, the default first."""
    lanes, registers = _defaults(lanes, registers)
    rows = max(1, registers // 16)
    tiles = [(mr * rows, v * lanes) for mr, v in GEMM_VECTOR_TILES]
    return [t for t in tiles if fits(t, lanes, registers)]


def gemv_tiles(lanes: int | None = None, registers: int | None = None) -> list[tuple[int, int]]:
    """The register blocks (1, NR) of a matrix-vector product."""
    lanes, registers = _defaults(lanes, registers)
    return [t for t in ((mr, v * lanes) for mr, v in GEMV_VECTOR_TILES) if fits(t, lanes, registers)]


def _rows(kernel: Kernel) -> int | None:
    """The output rows of a contraction kernel (a run-time number of rows at its bound), None for
    another kernel."""
    c = as_contraction(kernel)
    if c is None:
        return None
    return upper(kernel.shape[c.m_axis]) if c.m_axis is not None else 1


def default_schedule(kernel: Kernel, threads: int = 1, lanes: int | None = None,
                     registers: int | None = None) -> Schedule:
    """The schedule that needs no tuning. lanes and registers: the vector unit's float32 lanes and
    vector registers (None: the host's)."""
    lanes, registers = _defaults(lanes, registers)
    m = _rows(kernel)
    if m is None:
        return Schedule(threads=threads)
    if m < MATVEC_ROWS:  # matrix-vector: wide columns, each row its own accumulators
        return Schedule(tile=(max(m, 1), MATVEC_VECTORS * lanes), threads=threads)
    return Schedule(tile=gemm_tiles(lanes, registers)[0], threads=threads)


def schedule_space(kernel: Kernel, threads: int = 1, lanes: int | None = None,
                   registers: int | None = None) -> list[Schedule]:
    """The schedules worth timing for kernel, the default first, each once."""
    lanes, registers = _defaults(lanes, registers)
    base = default_schedule(kernel, threads, lanes, registers)
    m = _rows(kernel)
    out = [base]
    if m is not None:
        tiles = gemv_tiles(lanes, registers) if m < MATVEC_ROWS else gemm_tiles(lanes, registers)
        out += [replace(base, tile=t) for t in tiles]
    else:
        out += [replace(base, unroll=u) for u in (2, 8)]
    if threads > 1:
        out += [replace(s, threads=1) for s in list(out)]
    seen: list[Schedule] = []
    for s in out:
        if s not in seen:
            seen.append(s)
    return seen


__all__ = ["default_schedule", "fits", "gemm_tiles", "gemv_tiles", "schedule_space"]
