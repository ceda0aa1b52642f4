"""One C-style renderer for GPU kernels, three dialects (CUDA, OpenCL, Metal).

Every difference between the dialects is data in a `Dialect` (dialects.py); the renderer
(emit.py) is written once. A kernel of eclat.compiler.kernel is lowered with a `GpuSchedule`
(schedules.py) to one of three strategies, all launched as a 1-D grid of work-groups:

  flat  one thread per output element; reductions run as serial loops in the thread.
  row   one work-group per row (the leading output axes that the kernel's reductions depend
        on): each reduction is split across the group's threads and combined by a tree in
        shared memory (warp/simdgroup shuffles first where the dialect has them); then the
        threads share the row's output elements. A softmax or layer-norm row is one group.
  tile  contractions (epilogue(sum_k a*b), see `as_contraction`): each group computes a
        TM x TN output tile, staging TK-deep slices of a and b in shared memory, each thread
        a RM x RN register block; the epilogue runs on the accumulators. Ragged edges are
        clamped on load and masked on store. float16 and bfloat16 operands are read into float
        registers and accumulated in float (a real GEMM for half inputs on every dialect).
  mma   contractions on tensor cores (mma.py), only where the dialect has a matrix unit
        (`Dialect.matrix_unit`: "wmma", CUDA's nvcuda::wmma; none in OpenCL and Metal): each
        group a TM x TN tile computed by WY x WX warps (`GpuSchedule.warps`), each warp a block of
        16x16 fragments; TK-deep slices of a and b are staged in shared memory in the fragment
        type (__half, __nv_bfloat16, or TF32 floats for float32 operands, only where the user
        allows TF32: `schedules.tf32_allowed`), prefetched into registers while the previous
        slice is multiplied, accumulated in float; the accumulators pass through a per-warp
        shared tile to the same per-element epilogue as tile's. The default of a 16-bit
        contraction on CUDA; float32 ones are never on tensor cores by default, and a TF32
        schedule is checked against the default with a tolerance that grows with k.

A weight rounded to a low-precision format (`weights=`) is stored packed (packing.py) and
decoded where a kernel reads it; float16 is stored as half and computed in float registers.

Loads of the flat strategy are vectorised (float4) when the schedule asks and the index is
provably aligned and unit-stride in the last axis. A GPU target (target.py) builds every schedule
of every kernel's space (`gpu_schedule_space`) in one program for the search to time, and the
search keeps the fastest that gives the default's values.
"""

from __future__ import annotations

from .dialects import CUDA, DIALECTS, METAL, OPENCL, Dialect
from .emit import RenderedKernel, RenderedProgram, c_index, render_kernel, render_program
from .schedules import (
    MATVEC_ROWS,
    MAX_THREADS,
    ROW_MIN_REDUCE,
    STRATEGIES,
    GpuSchedule,
    default_gpu_schedule,
    gpu_schedule_space,
    row_axes,
)
from .target import DeferredExecutable, GpuTarget, Variant, with_variants

__all__ = ["CUDA", "DIALECTS", "MATVEC_ROWS", "MAX_THREADS", "METAL", "OPENCL", "ROW_MIN_REDUCE",
           "STRATEGIES", "DeferredExecutable", "Dialect", "GpuSchedule", "GpuTarget", "RenderedKernel",
           "RenderedProgram", "Variant", "c_index", "default_gpu_schedule", "gpu_schedule_space",
           "render_kernel", "render_program", "row_axes", "with_variants"]
