"""The mma strategy: a contraction (compiler.kernel.as_contraction, epilogue(sum_k a*b)) on tensor
cores through CUDA's warp matrix functions (nvcuda::wmma), for dialects whose `matrix_unit` is
"wmma" (CUDA only: OpenCL has no matrix API).

Layout. A work-group computes one TM x TN tile of the output (of one batch index), with W = WY x WX
warps (`GpuSchedule.warps`, 32 * W threads); warp (wy, wx) owns the WM x WN block at (wy * WM,
wx * WN), WM = TM / WY and WN = TN / WX, as FM x FN accumulator fragments of 16 x 16 floats.
The k axis is walked in TK-deep slices; each slice of a (TM x TK) and b (TK x TN) is staged in
shared memory in the fragments' element type, each value converted as it is read:

  operands   fragments              element in shared memory   conversion
  float16    16x16x16, __half        __half                    __float2half_rn (exact)
  bfloat16   16x16x16, __nv_bfloat16 __nv_bfloat16             __float2bfloat16_rn (exact)
  float32    16x16x8, precision::tf32 float                    wmma::__float_to_tf32 (rounds
                                                               to 10 mantissa bits; only where
                                                               the user allows TF32)

The operands are read as the tile strategy reads them: any expression, emitted by the generic
emitter with the reduce variable and the row (column) variable bound, clamped into range, and the
value masked to 0 outside the problem (ragged M, N and K). An operand whose index steps by one along
k (a row-major a, a transposed weight b) is stored k-contiguous: a as a row-major TM x TK array (a
`row_major` matrix_a fragment), b as TN rows of TK (a `col_major` matrix_b fragment); any other is
stored m- or n-contiguous: a as TK rows of TM (`col_major` matrix_a), b as a row-major TK x TN
array (`row_major` matrix_b). Either way consecutive threads read consecutive global addresses and
write consecutive shared ones. Every row is padded by 16 bytes (8 halves, 4 floats): WMMA wants a
leading dimension that is a multiple of 16 bytes, and 16 bytes of skew put the 8 rows a fragment
load reads at once in distinct banks; fragment pointers stay 32-byte aligned (arrays __align__(32),
row offsets multiples of 16 rows or of 8 columns of 16 bytes).

Register double buffering: in step ks each thread reads its elements of slice ks from global memory
into registers, then the warps run slice ks - 1 from shared memory on the tensor cores (so the reads
are in flight during the products), then, after a barrier, the registers are stored to shared memory.

Epilogue: each warp stores one accumulator fragment at a time to its own 16 x 20 float staging
tile (wmma::store_matrix_sync, mem_row_major, ldm 20: 16 columns plus 4 floats of padding); its 32
lanes then take the 256 values in turn and run the kernel's epilogue on each as the tile strategy
does (the sum remembered as the value, bias, activation, residual and the rounding to a 16-bit
output included), masked at the ragged edges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...compiler.kernel import as_contraction
from .schedules import FRAGMENT, TileOperand, mma_operands, unit_stride

if TYPE_CHECKING:
    from .emit import _Emitter

# fragment kind -> (element type in shared memory, the fragments' k, the float -> element conversion)
_TYPES = {
    "half": ("__half", 16, "__float2half_rn({})"),
    "bfloat16": ("__nv_bfloat16", 16, "__float2bfloat16_rn({})"),
    "tf32": ("float", 8, "wmma::__float_to_tf32({})"),
}
_STAGE_LD = FRAGMENT + 4  # a warp's staging tile: 16 rows of 16 floats, padded to a multiple of 4


@dataclass(frozen=True)
class _Operand(TileOperand):
    """A factor as the tile strategy stages it (schedules.TileOperand), and which fragment it feeds;
    stored k-contiguous where along_k (see the module docstring)."""

    use: str = "matrix_a"  # or "matrix_b"

    def inner(self, tk: int) -> int:
        """The contiguous extent of the slice in shared memory (TK if k-contiguous, else TM or TN)."""
        return tk if self.along_k else self.width

    def outer(self, tk: int) -> int:
        return self.width if self.along_k else tk

    @property
    def layout(self) -> str:
        row_major = self.along_k == (self.use == "matrix_a")  # a's rows run along k, b's along n
        return "wmma::row_major" if row_major else "wmma::col_major"

    def at(self, mn: str, kk: str, ld: int) -> str:
        """A pointer to the fragment whose first row (column) is mn of the tile, at depth kk."""
        row, col = (mn, kk) if self.along_k else (kk, mn)
        return f"{self.smem} + ({row}) * {ld} + {col}"


def render_mma(em: _Emitter) -> None:
    """Emit em's kernel (a contraction, em.s an mma schedule) as described in the module docstring."""
    k, d, s = em.k, em.d, em.s
    c = as_contraction(k)
    kind = mma_operands(k)
    elem, kf, convert = _TYPES[kind]
    frag_type = "wmma::precision::tf32" if kind == "tf32" else elem
    pad = 16 // (4 if kind == "tf32" else 2)
    (tm, tn, tk), (wy, wx), threads = s.tile, s.warps, s.group_size
    wm, wn = tm // wy, tn // wx
    fm, fn = wm // FRAGMENT, wn // FRAGMENT
    em.line("namespace wmma = nvcuda::wmma;")
    m, n, depth, slices = em._tile_grid(c, tm, tn, tk)
    rv, m_var, n_var = c.reduce.var.name, f"i{c.m_axis}", f"i{c.n_axis}"
    ops = [_Operand(c.a, tm, m, m_var if c.m_axis is not None else None, "tm_", "As", "pa",
                    unit_stride(c.a, rv), use="matrix_a"),
           _Operand(c.b, tn, n, n_var, "tn_", "Bs", "pb", unit_stride(c.b, rv), use="matrix_b")]
    ld = {op.smem: op.inner(tk) + pad for op in ops}

    em.line("const int warp = lid / 32, lane = lid % 32;")
    em.line(f"const int wy = warp / {wx}, wx = warp % {wx};")
    for op in ops:
        em.shared[op.smem] = f"{d.shared} __align__(32) {elem} {op.smem}[{op.outer(tk) * ld[op.smem]}];"
        em.line(f"{elem} {op.regs}[{-(-tk * op.width // threads)}];")
    em.shared["Cs"] = f"{d.shared} __align__(32) float Cs[{wy * wx * FRAGMENT * _STAGE_LD}];"
    em.line(f"wmma::fragment<wmma::accumulator, 16, 16, {kf}, float> acc[{fm}][{fn}];")
    _loop(em, "i", fm)
    _loop(em, "j", fn)
    em.line("wmma::fill_fragment(acc[i][j], 0.0f);")
    em.close()
    em.close()

    em.open(f"for (int ks = 0; ks <= {slices}; ks++)")
    em._tile_prefetch(ops, rv, tk, depth, slices, convert)  # slice ks into registers
    em.open("if (ks > 0)")  # slice ks - 1 on the tensor cores, while slice ks's reads are in flight
    em.line("#pragma unroll")
    em.open(f"for (int kk = 0; kk < {tk}; kk += {kf})")
    a, b = ops
    em.line(f"wmma::fragment<wmma::matrix_a, 16, 16, {kf}, {frag_type}, {a.layout}> fa[{fm}];")
    em.line(f"wmma::fragment<wmma::matrix_b, 16, 16, {kf}, {frag_type}, {b.layout}> fb[{fn}];")
    _loop(em, "i", fm)
    em.line(f"wmma::load_matrix_sync(fa[i], {a.at(f'wy * {wm} + i * 16', 'kk', ld['As'])}, {ld['As']});")
    em.close()
    _loop(em, "j", fn)
    em.line(f"wmma::load_matrix_sync(fb[j], {b.at(f'wx * {wn} + j * 16', 'kk', ld['Bs'])}, {ld['Bs']});")
    em.close()
    _loop(em, "i", fm)
    _loop(em, "j", fn)
    em.line("wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);")
    em.close()
    em.close()
    em.close()
    em.close()
    em.line(d.barrier)
    em._tile_store(ops, tk, slices, lambda op: f"mm * {ld[op.smem]} + kk" if op.along_k
                   else f"kk * {ld[op.smem]} + mm")
    em.line(d.barrier)
    em.close()

    # the epilogue, one fragment at a time through the warp's staging tile
    em.line(f"float* cw = Cs + warp * {FRAGMENT * _STAGE_LD};")
    _loop(em, "i", fm)
    _loop(em, "j", fn)
    em.line(f"wmma::store_matrix_sync(cw, acc[i][j], {_STAGE_LD}, wmma::mem_row_major);")
    em.line("__syncwarp();")
    em.open(f"for (int e = lane; e < {FRAGMENT * FRAGMENT}; e += 32)")
    em.line(f"const int row = tm_ * {tm} + wy * {wm} + i * 16 + e / 16, "
            f"col = tn_ * {tn} + wx * {wn} + j * 16 + e % 16;")
    em.open(f"if (row < {m} && col < {n})")
    if c.m_axis is not None:
        em.bind(m_var, "row")
    em.bind(n_var, "col")
    em.line(f"const float sum = cw[(e / 16) * {_STAGE_LD} + e % 16];")
    em.scope.remember(c.reduce, "sum")
    em.store(em.emit(k.body))
    em.close()
    em.close()
    em.line("__syncwarp();")  # the tile is read before the next fragment overwrites it
    em.close()
    em.close()


def _loop(em: _Emitter, var: str, n: int) -> None:
    """Open an unrolled loop of var over 0..n-1 (fragment indices: the arrays stay in registers)."""
    em.line("#pragma unroll")
    em.open(f"for (int {var} = 0; {var} < {n}; {var}++)")


__all__ = ["render_mma"]
