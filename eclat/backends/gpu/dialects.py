"""The GPU dialects: every difference between CUDA, OpenCL and Metal source is data in a
`Dialect` (qualifiers, address spaces, thread indices, barrier, math names, type names, parameter
syntax, warp shuffles), so the emitter (eclat.backends.gpu.emit) is written once."""

from __future__ import annotations

from dataclasses import dataclass

from ...ir.dtypes import DType


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
    warp: int = 32


_COMMON_TYPES = {DType.float32: "float", DType.bfloat16: "float", DType.int32: "int", DType.bool: "bool"}

CUDA = Dialect(
    name="cuda",
    prelude="",
    kernel='extern "C" __global__ void __launch_bounds__({threads})',
    global_="", shared="__shared__", restrict="__restrict__", barrier="__syncthreads();",
    group_id="(int)blockIdx.x", local_id="(int)threadIdx.x",
    param="{const}{type}* {restrict} {name}", thread_params=(),
    math={"exp2": "exp2f", "log2": "log2f", "sin": "sinf", "sqrt": "sqrtf", "rsqrt": "rsqrtf",
          "fma": "fmaf", "fmod": "fmodf", "isnan": "isnan"},
    types={**_COMMON_TYPES, DType.int64: "long long"}, mem_types={DType.bool: "unsigned char"},
    inf="__int_as_float(0x7f800000)", nan="__int_as_float(0x7fffffff)", long_suffix="LL",
    bits=("__float_as_uint({})", "__uint_as_float({})"),
    shuffle_down="__shfl_down_sync(0xffffffffu, {v}, {off})",
)

OPENCL = Dialect(
    name="opencl",
    prelude="",
    kernel="__kernel __attribute__((reqd_work_group_size({threads}, 1, 1))) void",
    global_="__global", shared="__local", restrict="restrict", barrier="barrier(CLK_LOCAL_MEM_FENCE);",
    group_id="(int)get_group_id(0)", local_id="(int)get_local_id(0)",
    param="{space} {const}{type}* {restrict} {name}", thread_params=(),
    math={"exp2": "exp2", "log2": "log2", "sin": "sin", "sqrt": "sqrt", "rsqrt": "rsqrt",
          "fma": "fma", "fmod": "fmod", "isnan": "isnan"},
    types={**_COMMON_TYPES, DType.int64: "long"}, mem_types={DType.bool: "uchar"},
    inf="INFINITY", nan="NAN", long_suffix="L",
    bits=("as_uint({})", "as_float({})"),
    shuffle_down=None,  # sub-groups are an optional extension (PoCL's CPU device lacks them)
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
    types={**_COMMON_TYPES, DType.int64: "long"}, mem_types={DType.bool: "uchar"},
    inf="INFINITY", nan="NAN", long_suffix="L",
    bits=("as_type<uint>({})", "as_type<float>({})"),
    shuffle_down="simd_shuffle_down({v}, (ushort)({off}))",
)

DIALECTS: dict[str, Dialect] = {d.name: d for d in (CUDA, OPENCL, METAL)}

__all__ = ["CUDA", "DIALECTS", "METAL", "OPENCL", "Dialect"]
