"""The GPU dialects: every difference between CUDA, OpenCL and Metal source is data in a
`Dialect` (qualifiers, address spaces, thread indices, barrier, math names, type names, parameter
syntax, warp shuffles, how ops are written), so the emitter (eclat.backends.gpu.emit) is written
once."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...ir.dtypes import DType

OpKey = str | tuple[str, str]  # an op, or (op, kind) with kind "float", "int" or "bool"

# How each elementwise op is written in C: a str.format template over the operands ({0} {1} {2}),
# the dialect's math function names ({exp2} {fmod} {isnan} ...) and the register type of the
# result ({type}). An entry for (op, kind) wins over the op's own; a bool is also an int (C
# converts it), so an int entry serves bools that have none of their own. add, mul and max also
# combine the partial results of reductions (sum, max_reduce). `cast` is the emitter's.
C_OPS: dict[OpKey, str] = {
    "add": "({0} + {1})",
    ("add", "bool"): "({0} || {1})",
    "mul": "({0} * {1})",
    ("mul", "bool"): "({0} && {1})",
    "max": "({0} > {1} ? {0} : {1})",
    ("max", "float"): "(({isnan}({0}) || {0} > {1}) ? {0} : {1})",  # NaN-propagating, as torch
    ("max", "bool"): "({0} || {1})",
    "lt": "({0} < {1})",
    "where": "({0} ? {1} : {2})",
    "neg": "(-{0})",
    ("neg", "bool"): "(!{0})",
    "recip": "(1.0f / {0})",
    "div": "({0} / {1})",
    "exp2": "{exp2}({0})",
    "log2": "{log2}({0})",
    "sin": "{sin}({0})",
    "sqrt": "{sqrt}({0})",
    "rsqrt": "{rsqrt}({0})",
    "fma": "{fma}({0}, {1}, {2})",
    ("fma", "int"): "({0} * {1} + {2})",
    ("mod", "float"): "{fmod}({0}, {1})",
    # 0 where the divisor is 0, as the interpreter; INT_MIN % -1 is undefined in C (a trap)
    ("mod", "int"): "((({1} == 0) | ({1} == -1)) ? ({type})0 : {0} % {1})",
    ("mod", "bool"): "false",
}


def _kinds(dt: DType) -> tuple[str, ...]:
    """The kinds of dt whose entries apply, the most specific first."""
    if dt.is_float:
        return ("float",)
    return ("bool", "int") if dt is DType.bool else ("int",)


@dataclass(frozen=True)
class Dialect:
    name: str
    prelude: str
    kernel: str  # written before `void name(...)`; {threads} is the work-group size
    global_: str  # address space of buffer pointers
    shared: str  # declaration prefix of work-group memory
    restrict: str
    barrier: str
    group_id: str  # expression for the work-group index (or a parameter name)
    local_id: str
    param: str  # one buffer parameter: {space} {const} {type} {restrict} {name} {n}
    thread_params: tuple[str, ...]  # extra parameters (Metal's position attributes)
    math: dict[str, str]  # function names: exp2 log2 sin sqrt rsqrt fma fmod isnan
    types: dict[DType, str]  # register types
    mem_types: dict[DType, str]  # buffer element types where they differ
    inf: str
    nan: str
    long_suffix: str
    bits: tuple[str, str]  # float -> uint and uint -> float bit casts, each with {}
    shuffle_down: str | None  # {v} {off}: value from lane + off, None if the dialect has none
    # float16 is stored as half and computed in float registers: element {i} of half array {p} as a
    # float, the statement storing float {v} there (rounded to nearest even), and a float rounded to
    # the nearest half, kept in a float ({})
    half_load: str
    half_store: str
    round_half: str
    warp: int = 32
    ops: dict[OpKey, str] = field(default_factory=dict)  # this dialect's entries of C_OPS, where they differ
    shared_align: str = ""  # after `shared`: a 16-byte aligned array (for 128-bit shared loads)
    # the matrix unit API the mma strategy (gpu/mma.py) writes: "wmma" (CUDA's nvcuda::wmma), None
    # where the dialect has none (OpenCL has no matrix API; Metal's simdgroup_matrix is not used)
    matrix_unit: str | None = None

    def op_template(self, op: str, dt: DType) -> str | None:
        """How this dialect writes op with a dt result: its own entry, else C_OPS's (see there);
        None if neither has one."""
        keys = [(op, kind) for kind in _kinds(dt)] + [op]
        for table in (self.ops, C_OPS):
            for key in keys:
                if key in table:
                    return table[key]
        return None

    def op(self, op: str, dt: DType, *args: str) -> str | None:
        """op applied to the C expressions args, with a dt result; None if there is no template."""
        template = self.op_template(op, dt)
        if template is None:
            return None
        return template.format(*args, **self.math, type=self.types.get(dt, ""))


_COMMON_TYPES = {DType.float32: "float", DType.bfloat16: "float", DType.float16: "float", DType.int32: "int",
                 DType.bool: "bool"}
# storage types of packed values (eclat.backends.gpu.packing): a weight in a low-precision format,
# a bfloat16 buffer's 16 bits
_PACKED_TYPES = {DType.int8: "char", DType.uint8: "uchar", DType.int16: "short", DType.bfloat16: "ushort"}

# OpenCL C 1.2 has no half arithmetic without cl_khr_fp16, so a float is rounded to half by its bits:
# an overflow to infinity, a subnormal half by scaling, else the mantissa rounded at bit 13
_OPENCL_ROUND_HALF = """
static float eclat_round_half(float x) {
  const float a = fabs(x);
  if (x != x) return x;  // NaN
  if (a >= 65520.0f) return copysign(INFINITY, x);
  if (a < 6.103515625e-05f) return rint(x * 16777216.0f) * 5.9604644775390625e-08f;
  const uint u = as_uint(x);
  return as_float((u + 0xFFFu + ((u >> 13) & 1u)) & 0xFFFFE000u);
}
"""

CUDA = Dialect(
    name="cuda",
    prelude="#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <mma.h>\n",
    kernel='extern "C" __global__ void __launch_bounds__({threads})',
    global_="", shared="__shared__", shared_align=" __align__(16)", restrict="__restrict__",
    barrier="__syncthreads();",
    group_id="(int)blockIdx.x", local_id="(int)threadIdx.x",
    param="{const}{type}* {restrict} {name}", thread_params=(),
    math={"exp2": "exp2f", "log2": "log2f", "sin": "sinf", "sqrt": "sqrtf", "rsqrt": "rsqrtf",
          "fma": "fmaf", "fmod": "fmodf", "isnan": "isnan"},
    types={**_COMMON_TYPES, DType.int64: "long long"},
    mem_types={DType.bool: "unsigned char", DType.float16: "__half", DType.bfloat16: "unsigned short",
               DType.int8: "signed char", DType.uint8: "unsigned char", DType.int16: "short"},
    inf="__int_as_float(0x7f800000)", nan="__int_as_float(0x7fffffff)", long_suffix="LL",
    bits=("__float_as_uint({})", "__uint_as_float({})"),
    shuffle_down="__shfl_down_sync(0xffffffffu, {v}, {off})",
    half_load="__half2float({p}[{i}])", half_store="{p}[{i}] = __float2half_rn({v});",
    round_half="__half2float(__float2half_rn({}))",
    matrix_unit="wmma",
)

OPENCL = Dialect(
    name="opencl",
    prelude=_OPENCL_ROUND_HALF,
    kernel="__kernel __attribute__((reqd_work_group_size({threads}, 1, 1))) void",
    global_="__global", shared="__local", shared_align=" __attribute__((aligned(16)))", restrict="restrict",
    barrier="barrier(CLK_LOCAL_MEM_FENCE);",
    group_id="(int)get_group_id(0)", local_id="(int)get_local_id(0)",
    param="{space} {const}{type}* {restrict} {name}", thread_params=(),
    math={"exp2": "exp2", "log2": "log2", "sin": "sin", "sqrt": "sqrt", "rsqrt": "rsqrt",
          "fma": "fma", "fmod": "fmod", "isnan": "isnan"},
    types={**_COMMON_TYPES, DType.int64: "long"},
    mem_types={DType.bool: "uchar", DType.float16: "half", **_PACKED_TYPES},
    inf="INFINITY", nan="NAN", long_suffix="L",
    bits=("as_uint({})", "as_float({})"),
    shuffle_down=None,  # sub-groups are an optional extension (PoCL's CPU device lacks them)
    # vload_half/vstore_half are core OpenCL: they need no half arithmetic
    half_load="vload_half({i}, {p})", half_store="vstore_half_rte({v}, {i}, {p});",
    round_half="eclat_round_half({})",
)

METAL = Dialect(
    name="metal",
    prelude="#include <metal_stdlib>\nusing namespace metal;\n",
    kernel="kernel void",
    global_="device", shared="threadgroup", restrict="",
    barrier="threadgroup_barrier(mem_flags::mem_threadgroup);",
    group_id="(int)gid_", local_id="(int)lid_",
    param="{space} {const}{type}* {name} [[buffer({n})]]",
    thread_params=("uint gid_ [[threadgroup_position_in_grid]]",
                   "uint lid_ [[thread_position_in_threadgroup]]"),
    math={"exp2": "metal::exp2", "log2": "metal::log2", "sin": "metal::sin", "sqrt": "metal::sqrt",
          "rsqrt": "metal::rsqrt", "fma": "metal::fma", "fmod": "metal::fmod", "isnan": "metal::isnan"},
    types={**_COMMON_TYPES, DType.int64: "long"},
    mem_types={DType.bool: "uchar", DType.float16: "half", **_PACKED_TYPES},
    inf="INFINITY", nan="NAN", long_suffix="L",
    bits=("as_type<uint>({})", "as_type<float>({})"),
    shuffle_down="simd_shuffle_down({v}, (ushort)({off}))",
    half_load="(float){p}[{i}]", half_store="{p}[{i}] = (half)({v});", round_half="(float)(half)({})",
)

DIALECTS: dict[str, Dialect] = {d.name: d for d in (CUDA, OPENCL, METAL)}

__all__ = ["CUDA", "C_OPS", "DIALECTS", "METAL", "OPENCL", "Dialect"]
