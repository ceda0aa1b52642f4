"""The CPU's schedules: the default one (no tuning needed) and the space an autotuner times.

A contraction's register block is MR rows x NR columns of the output, NR a whole number of
vectors: the micro-kernel keeps MR x NR/lanes accumulators in vector registers, and per step of
the reduction holds one broadcast left operand and at least one right-operand vector beside them
(the rest are read as memory operands of the fmas). The tiles below are written in vectors for a
16-register file (AVX2, SSE); a 32-register file (AVX-512, NEON) holds twice the rows. On an
8-lane AVX2 host that is GEMM tiles (6,16) (4,16) (8,8) (4,24) (3,32) (2,32) (6,8) (12,8),
matrix-vector tiles (1,16) (1,32) (1,64), default (6,16), and (m,16) for fewer than 4 rows. A
32-register file's default is the second tile doubled, (8,32) with 16 lanes: measured on znver4
in one process against (12,32), equal or up to 12% faster on seven GEMM shapes (convolutions'
and linear layers', 49 to 3136 columns, 256 to 4608 deep).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import replace

from ...compiler.kernel import (
    Kernel,
    KExpr,
    Load,
    Reduce,
    Schedule,
    as_contraction,
    axis_vars,
    loads,
    reduces,
    transposed,
)
from ...ir.symbolic import upper, variables
from . import host
from .attention_plan import default_key_depth

# (rows, vectors) for 16 vector registers; the first is the default
GEMM_VECTOR_TILES = [(6, 2), (4, 2), (8, 1), (4, 3), (3, 4), (2, 4), (6, 1), (12, 1)]
GEMV_VECTOR_TILES = [(1, 2), (1, 4), (1, 8)]  # rows fewer than 4: one row, wide
# the default's width when there are fewer than 4 rows (each row its own): the GEMM default's, so
# that a model's one-row and many-row programs (decode and prefill) read one packed copy of a weight;
# measured against 4 vectors on a Xeon (AVX-512), one process, 6 shapes 768x2304 to 768x50257: level
MATVEC_VECTORS = 2
MATVEC_ROWS = 4  # fewer output rows than this: a matrix-vector product
OPERAND_REGISTERS = 2  # the broadcast left value and one right-operand vector
ACCUMULATOR_CHAINS = 8  # independent fmas in flight that hide an fma's latency (2 ports x 4 cycles)
TRANSPOSE_GAIN = 1.25  # how much more of its tiles a transposed product must fill to be the default
HEIGHT_GAIN = 1.05  # how much more of its rows a lower register block must use to be the default
# A weight read as the left operand (a convolution's: out[channel, pixel]) is better packed as the
# right one, transposed, when the reduction is deep enough to hide the transposed block's stores
# (a scalar each, across the output's rows) and the pixels are few enough that the activation,
# then broadcast from memory, is read well. Measured on znver4 (one process, 11 shapes): 1.07-1.24x
# at 49-784 pixels and depth 576-4608; 0.5-0.8x at 3136 pixels or depth below 200. Transposed, every
# panel of the weight reads the whole activation again: on an AVX-512 Xeon (2 MiB L2) that pays
# only where it stays within PANEL_L2_SHARE of L2 (576 x 196: level; 2304 x 196 0.79x, 1152 x 784
# 0.75x, 768 x 784 0.65x, 768 x 1024 0.44x: a 4 KiB stride).
# The orientation that broadcasts a weight on the left, unpacked, is not timed where that weight is
# at least PANEL_L2_SHARE of L2 (unless it is the default's): timed alone, the weight stays in cache
# from run to run and the tile looks best; in a model it comes from memory, a row of it per register
# row: resnet18's tuned program ran 24.6 ms against the untuned's 22.2, its 512-channel convolutions
# 2462-3002 us at (12, 32) against 1501-1612 transposed, Winograd products at (6, 64) 1.3-1.6x slower
# (AVX-512 Xeon, one process).
# a kernel whose sums read a vector along the row that the row above reads too (a channels-last
# depthwise convolution's filter taps) computes this many rows together (Schedule.jam): the 7x7 x 576
# depthwise 5x5 of a mobile network's last stage, 97 -> 18 us on znver4; 4 and 7 measured alike in C
JAM = 4
# most terms of the rows jammed together: LLVM's vectoriser left 7 rows of a 7x7 filter's 49 taps scalar
JAM_TERMS = 200
WEIGHT_RIGHT_DEPTH = 512
WEIGHT_RIGHT_COLUMNS = 1024
# A reduction whose K x NR panel of the right operand is more than PANEL_L2_SHARE of the L2 cache runs
# in chunks whose slice of the panel fills at most L1_SHARE of the L1 data cache, each chunk over every
# row block before the next, so that the row blocks read the slice from L1 (`Schedule.depth`).
# Measured on an AVX-512 Xeon (48 KiB L1, 2 MiB L2; one process, eight GEMM shapes): 256x8640x256
# (a dilated convolution's) 51 -> 106 GFLOP/s, 49x4608x512 97 -> 106; panels under a quarter of L2
# (1024^3, 784x512x512, K 576 to 2304) level or up to 30% slower chunked (the sums kept between chunks).
PANEL_L2_SHARE = 0.25
L1_SHARE = 2 / 3
# Transposed, the left operand's rows are the product's columns, consecutive in memory: each row
# block reads a line of it per step that the next row blocks read again. Where the panel's and all
# the rows' slices outgrow L1, the reduction runs in chunks that hold both, at least SHARED_MIN_DEPTH
# deep (the sums kept between chunks cost the more, and a row block shares fewer of its lines, the
# more rows there are). Measured on znver3 (32 KiB L1, AVX2; 1x1 convolutions over 7x7 pixels, one
# process): 320 -> 1280 59 -> 80 GFLOP/s, 192 -> 1152 57 -> 81, 1152 -> 192 61 -> 84, 3x3 512 -> 512
# (depth 4608) 58 -> 80 against the L2 rule's chunks; chunks of 64 to 96 steps best (here: 80).
SHARED_MIN_DEPTH = 64
# A matrix-vector product reads each element of its weight once whatever its panel width (GPT-2's
# decode, AVX-512 Xeon: 33.1 tok/s at its prefill's widths, 33.4 at its own). Where another program
# holds the weight packed (a language model's prefill: compiler.derived.held_before), the product reads
# that copy at its width and is not timed at others, each of which would pack the weight again.
HeldWidth = Callable[[Kernel, Iterable[int]], "int | None"]  # the first of the widths held packed
# A product reading a weight of at least this many bytes is timed at its default's panel width and
# orientation only: every other width a trial times packs the weight anew (GPT-2's output head: 154 MB,
# seconds to pack, and the compile's peak memory while the untuned program holds its own copy), and
# for such a weight, read from memory once per call, the widths ran within noise of each other (the
# tuner chose 16, then 64, against the default's 32 in two compiles of the same model).
ONE_WIDTH_BYTES = 64 << 20


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
    if rows > 1:  # the wide register file's default: see the module docstring
        tiles.insert(0, tiles.pop(1))
    return [t for t in tiles if fits(t, lanes, registers)]


def gemv_tiles(lanes: int | None = None, registers: int | None = None) -> list[tuple[int, int]]:
    """The register blocks (1, NR) of a matrix-vector product: its own widths, then those of the
    matrix-matrix tiles, so that a one-row product can read the panels that a product of many rows
    packed of the same weight (a decode beside its prefill: compiler.tune's NEW_COPY_PENALTY)."""
    lanes, registers = _defaults(lanes, registers)
    own = [t for t in ((mr, v * lanes) for mr, v in GEMV_VECTOR_TILES) if fits(t, lanes, registers)]
    widths = dict.fromkeys([nr for _, nr in own] + [nr for _, nr in gemm_tiles(lanes, registers)])
    return [(1, nr) for nr in widths]


def _sizes(kernel: Kernel, flip: bool = False) -> tuple[int, int] | None:
    """A contraction kernel's (rows, columns), run-time sizes at their bounds, as the micro-kernel
    sees them (flip: transposed); None for another kernel, or a flip of one without rows."""
    c = as_contraction(kernel)
    if c is not None and flip:
        c = None if kernel.sides else transposed(c)
    if c is None:
        return None
    return (upper(kernel.shape[c.m_axis]) if c.m_axis is not None else 1), upper(kernel.shape[c.n_axis])


def _tile_for(rows: int, lanes: int, registers: int) -> tuple[int, int]:
    """The default tile for rows: matrix-vector below MATVEC_ROWS, else the default GEMM tile, its
    height lowered (while its accumulators still fill ACCUMULATOR_CHAINS) where that leaves clearly
    fewer rows idle in the last block (HEIGHT_GAIN): 49 rows run as 7 blocks of 7, not 7 of 8
    (measured 1.10-1.16x); a grouped convolution's 8 channels a group as 2 blocks of 4, not 5 and 3
    (AVX2: 1.58x)."""
    if rows < MATVEC_ROWS:  # matrix-vector: wide columns, each row its own accumulators
        return max(rows, 1), MATVEC_VECTORS * lanes
    mr, nr = gemm_tiles(lanes, registers)[0]

    def used(h: int) -> float:
        return rows / (-(-rows // h) * h)
    lowest = min(mr, -(-ACCUMULATOR_CHAINS // max(1, nr // lanes)))
    best = max(range(mr, lowest - 1, -1), key=lambda h: (used(h), h))
    return (best if used(best) > HEIGHT_GAIN * used(mr) else mr), nr


def _is_weight(e: KExpr, weights: Collection[str]) -> bool:
    return isinstance(e, Load) and e.buffer in weights


def _caches(caches: tuple[int, int] | None) -> tuple[int, int]:
    """The L1 data and L2 cache bytes: those given, else the host's."""
    return (host.cache_bytes(1), host.cache_bytes(2)) if caches is None else caches


def _weight_right_pays(kernel: Kernel, weights: Collection[str], size: tuple[int, int], panel: int,
                       l2: int) -> bool:
    """Whether the contraction (rows, columns: size) reads a weight on the left (and not on the
    right) deeply enough and over few enough columns that packing it on the right, transposed, in
    panels of `panel` columns pays (WEIGHT_RIGHT_*): the other operand, read again by every panel
    after the first, within PANEL_L2_SHARE of the L2 cache's l2 bytes."""
    c = as_contraction(kernel)
    depth = upper(c.reduce.size) if c is not None else 0
    return c is not None and _is_weight(c.a, weights) and not _is_weight(c.b, weights) \
        and depth >= WEIGHT_RIGHT_DEPTH \
        and size[1] <= WEIGHT_RIGHT_COLUMNS \
        and (size[0] <= panel or 4 * depth * size[1] <= PANEL_L2_SHARE * l2)


def _weight_left_bytes(kernel: Kernel, weights: Collection[str], flip: bool) -> int:
    """Bytes of the weight the micro-kernel broadcasts from its left operand, unpacked, in that
    orientation (flip: transposed); 0 where the left operand is not a weight."""
    c = as_contraction(kernel)
    if c is not None and flip:
        c = transposed(c)
    if c is None or not _is_weight(c.a, weights):
        return 0
    rows = upper(kernel.shape[c.m_axis]) if c.m_axis is not None else 1
    batch = math.prod(upper(n) for a, n in enumerate(kernel.shape) if a not in (c.m_axis, c.n_axis))
    return 4 * rows * upper(c.reduce.size) * batch


def filled(rows: int, cols: int, tile: tuple[int, int], lanes: int) -> float:
    """The part of a register block's fmas that do useful work: rows and columns past the last
    whole block are computed and dropped, and fewer accumulators than ACCUMULATOR_CHAINS leave
    the fma's latency showing (one row interleaves sets of its own: `ContractionEmitter`)."""
    mr, nr = min(tile[0], rows), tile[1]
    useful = rows * cols / (-(-rows // mr) * mr * -(-cols // nr) * nr)
    return useful * (1.0 if mr == 1 else min(1.0, mr * (nr // lanes) / ACCUMULATOR_CHAINS))


def _on_held_panels(kernel: Kernel, schedule: Schedule, lanes: int, registers: int,
                    held_width: HeldWidth | None) -> Schedule | None:
    """schedule at the panel width at which another program holds the weight of kernel, a
    matrix-vector product not transposed, packed; None where it is not one or none is held."""
    sizes = _sizes(kernel)
    if held_width is None or schedule.transposed or sizes is None or sizes[0] >= MATVEC_ROWS:
        return None
    width = held_width(kernel, [schedule.tile[1]] + [nr for _, nr in gemv_tiles(lanes, registers)])
    return None if width is None else replace(schedule, tile=(schedule.tile[0], width))


def chunked(kernel: Kernel, schedule: Schedule, caches: tuple[int, int] | None = None,
            any_panel: bool = False) -> Schedule:
    """schedule with its contraction's reduction in chunks (`Schedule.depth`) that keep a panel's
    slice within L1_SHARE of the L1 data cache, where the whole panel would fill more than
    PANEL_L2_SHARE of the L2 (any_panel: more than one chunk) and several row blocks read each
    slice; transposed, that hold the rows' slice of the left operand too (SHARED_MIN_DEPTH); else in
    one piece. caches: the bytes of the L1 data and L2 caches (None: the host's)."""
    c = as_contraction(kernel)
    sizes = _sizes(kernel, schedule.transposed)
    if c is None or sizes is None or sizes[0] <= schedule.tile[0] or not isinstance(c.reduce.size, int):
        return replace(schedule, depth=0)
    l1, l2 = _caches(caches)
    panel = schedule.tile[1] * 4  # bytes of the panel per step of the reduction
    if schedule.transposed and not any_panel:
        # every row block reads lines of the left operand that the next one reads again (its rows
        # are the product's columns, consecutive in memory): a chunk keeps all the rows' slice in L1
        step = panel + 4 * sizes[0]
        shared = int(L1_SHARE * l1) // step // 8 * 8
        if c.reduce.size * step > L1_SHARE * l1 and c.reduce.size > shared >= SHARED_MIN_DEPTH:
            return replace(schedule, depth=shared)
    depth = int(L1_SHARE * l1) // panel // 8 * 8
    deep = (any_panel or c.reduce.size * panel > PANEL_L2_SHARE * l2) and c.reduce.size > depth >= 8
    return replace(schedule, depth=depth if deep else 0)


def default_schedule(kernel: Kernel, threads: int = 1, lanes: int | None = None,
                     registers: int | None = None, weights: Collection[str] = (),
                     caches: tuple[int, int] | None = None, held_width: HeldWidth | None = None) -> Schedule:
    """The schedule that needs no tuning: the tile for the contraction's rows, transposed where
    that fills clearly more of the tiles (TRANSPOSE_GAIN) or packs a weight read on the left as the
    right operand (WEIGHT_RIGHT_*), a long reduction in chunks (`chunked`), a matrix-vector
    product at the width another program holds its weight packed (held_width: see HeldWidth).
    lanes and registers: the vector unit's float32 lanes and vector registers, caches: its L1 data
    and L2 cache bytes (None: the host's); weights: the names of the program's weight buffers."""
    lanes, registers = _defaults(lanes, registers)
    plain, flip = _sizes(kernel), _sizes(kernel, flip=True)
    if plain is None:
        return Schedule(threads=threads, depth=default_key_depth(kernel, threads), jam=jam_for(kernel))
    best = Schedule(tile=_tile_for(plain[0], lanes, registers), threads=threads)
    if flip is not None:
        turned = Schedule(tile=_tile_for(flip[0], lanes, registers), threads=threads, transposed=True)
        gain = filled(*flip, turned.tile, lanes) / filled(*plain, best.tile, lanes)
        l2 = _caches(caches)[1]
        pays = _weight_right_pays(kernel, weights, plain, turned.tile[1], l2)
        if gain > TRANSPOSE_GAIN or gain >= 1 and pays:
            best = turned
    best = chunked(kernel, best, caches)
    return _on_held_panels(kernel, best, lanes, registers, held_width) or best


def jam_for(kernel: Kernel) -> int:
    """Schedule.jam's default: rows computed together where they share what they read (shares_rows),
    at most JAM_TERMS of their sums' terms in all, as many as divide the rows evenly (7 of a 7x7 or
    14x14 map) or else the most."""
    if not shares_rows(kernel):
        return 1
    terms = max(math.prod(upper(r.size) for r in _nested(top)) for top in reduces(kernel.body))
    fits = list(range(min(2 * JAM, JAM_TERMS // terms), 1, -1))
    rows = upper(kernel.shape[-2])
    return next((j for j in fits if rows % j == 0), fits[0] if fits else 1)


def _nested(r: Reduce) -> list[Reduce]:
    """r and the reductions its terms are sums of (a filter's rows, then its taps along a row)."""
    inner = r.body if isinstance(r.body, Reduce) else None
    return [r, *(_nested(inner) if inner is not None else [])]


def shares_rows(kernel: Kernel) -> bool:
    """Whether kernel (no contraction) sums terms that read a vector along its row which every row
    reads alike: a channels-last depthwise convolution's filter taps, the same for every pixel."""
    shape = kernel.shape
    if len(shape) < 2 or upper(shape[-1]) < 2 or upper(shape[-2]) < JAM:
        return False
    row, above = (v.name for v in axis_vars(shape)[-2:][::-1])
    return any(row in variables(x.index) and above not in variables(x.index)
               for r in reduces(kernel.body) for x in loads(r.body) if isinstance(x, Load))


def schedule_space(kernel: Kernel, threads: int = 1, lanes: int | None = None,
                   registers: int | None = None, weights: Collection[str] = (),
                   caches: tuple[int, int] | None = None, held_width: HeldWidth | None = None
                   ) -> list[Schedule]:
    """The schedules worth timing for kernel, the default first, each once: a contraction's tiles
    in both orientations, each orientation's own default next (a "fast" search times the first few);
    only the default for a matrix-vector product that reads another program's packed weight."""
    lanes, registers = _defaults(lanes, registers)
    base = default_schedule(kernel, threads, lanes, registers, weights, caches)
    if base.depth and _sizes(kernel) is None:  # a decode attention's keys in parts, in one, on one thread
        return [base, replace(base, depth=0), replace(base, threads=1, depth=0)]
    held = _on_held_panels(kernel, base, lanes, registers, held_width)
    if held is not None:
        return [held]
    # in one piece, and in chunks wherever the panel is longer than one (measured: some panels
    # under the default's bound run faster chunked, 784x512x512 1.13x)
    out, rest = [base, replace(base, depth=0), chunked(kernel, base, caches, any_panel=True)], []
    l2 = _caches(caches)[1]
    for flip in (False, True):
        sizes = _sizes(kernel, flip)
        if flip != base.transposed and _weight_left_bytes(kernel, weights, flip) >= PANEL_L2_SHARE * l2:
            continue  # timed alone, its weight stays in cache; in a model it streams from memory
        if sizes is not None:
            tiles = gemv_tiles(lanes, registers) if sizes[0] < MATVEC_ROWS else gemm_tiles(lanes, registers)
            own = replace(base, tile=_tile_for(sizes[0], lanes, registers), transposed=flip)
            out.append(chunked(kernel, own, caches))
            rest += [chunked(kernel, replace(base, tile=t, transposed=flip), caches) for t in tiles]
    out += rest
    if _sizes(kernel) is None:
        out += [replace(base, unroll=u) for u in (2, 8)] + ([replace(base, jam=1)] if base.jam > 1 else [])
    if threads > 1:
        out += [replace(s, threads=1) for s in list(out)]
    if _largest_weight(kernel, weights) >= ONE_WIDTH_BYTES:
        out = [s for s in out if (s.tile[1], s.transposed) == (base.tile[1], base.transposed)]
    seen: list[Schedule] = []
    for s in out:
        if s not in seen:
            seen.append(s)
    return seen


def _largest_weight(kernel: Kernel, weights: Collection[str]) -> int:
    """Bytes of the largest weight kernel reads, where weights maps names to buffers (else 0)."""
    if not isinstance(weights, Mapping):
        return 0
    return max((weights[x.buffer].nbytes for x in loads(kernel.body) if x.buffer in weights), default=0)


__all__ = ["chunked", "default_schedule", "filled", "fits", "gemm_tiles", "gemv_tiles", "schedule_space"]
