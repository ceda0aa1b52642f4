"""The shared GPU renderer without a GPU: dialect differences are data, every case renders in
all three dialects, CUDA compiles with nvcc, Metal compiles as C++ against the shim, and bad
schedules or unsupported dtypes fail with clear errors."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest

from eclat.backends.gpu import (
    CUDA,
    DIALECTS,
    METAL,
    OPENCL,
    GpuSchedule,
    default_gpu_schedule,
    gpu_schedule_space,
    render_kernel,
    render_program,
)
from eclat.compiler.group import group
from eclat.errors import EclatError
from eclat.ir import graph as g
from eclat.ir.dtypes import DType
from eclat.ir.graph import Graph
from tests.gpu_cases import CASES, lowered, softmax


def _softmax_program():
    x = g.input_("x", (4, 512))
    return group(Graph([x], [softmax(x)], {}))


def test_dialect_tokens_come_from_the_tables() -> None:
    program = _softmax_program()
    k = program.kernels[-1]  # the row sum and the normalised output
    assert default_gpu_schedule(k).strategy == "row"
    src = {name: render_program(program, d).source for name, d in DIALECTS.items()}
    want = {
        "cuda": ['extern "C" __global__', "__shared__ float", "__syncthreads();", "__shfl_down_sync",
                 "exp2f("],
        "opencl": ["__kernel", "__local float", "barrier(CLK_LOCAL_MEM_FENCE);", "__global const float*"],
        "metal": ["kernel void", "threadgroup float", "threadgroup_barrier(mem_flags::mem_threadgroup);",
                  "[[buffer(0)]]", "[[threadgroup_position_in_grid]]", "simd_shuffle_down", "metal::exp2("],
    }
    for name, tokens in want.items():
        for t in tokens:
            assert t in src[name], f"{name} source lacks {t!r}"
    assert "shfl" not in src["opencl"] and "simd_shuffle" not in src["opencl"]  # no shuffles in OpenCL 1.2


def test_ops_come_from_the_op_table_and_a_dialect_overrides_its_entries() -> None:
    program = _softmax_program()  # recip of the row sum; max_reduce combines with a NaN-propagating max
    base = render_program(program, OPENCL).source
    assert "(1.0f / " in base and "isnan(" in base
    native = replace(OPENCL, ops={"recip": "native_recip({0})", ("max", "float"): "fmax({0}, {1})"})
    src = render_program(program, native).source
    assert "native_recip(" in src and "(1.0f / " not in src
    assert "fmax(" in src and "isnan(" not in src
    assert native.op("max", DType.int32, "a", "b") == "(a > b ? a : b)"  # the float entry only
    assert OPENCL.op("mod", DType.bool, "a", "b") == "false"
    assert OPENCL.op("fma", DType.bool, "a", "b", "c") == "(a * b + c)"  # a bool takes the int entry
    assert CUDA.op("fma", DType.float32, "a", "b", "c") == "fmaf(a, b, c)"
    assert OPENCL.op("popcount", DType.int32, "a") is None


@pytest.mark.parametrize("dialect", [CUDA, OPENCL, METAL], ids=lambda d: d.name)
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_case_renders(case: str, dialect) -> None:
    graph, _ = CASES[case]()
    program = lowered(graph)
    rendered = render_program(program, dialect)
    assert [k.name for k in rendered.kernels] == [k.name for k in program.kernels]
    for rk in rendered.kernels:
        assert rk.groups >= 1 and 1 <= rk.threads <= 1024
        assert set(rk.args) <= set(program.buffers)
        assert f"{rk.name}(" in rendered.source


def test_elementwise_default_uses_vector_loads() -> None:
    graph, _ = CASES["elementwise"]()
    program = group(graph)
    k = program.kernels[0]
    assert default_gpu_schedule(k).vector == 4
    for d in DIALECTS.values():
        assert "float4" in render_kernel(k, program.buffers, d).source


def test_schedule_space_is_valid_and_starts_with_the_default() -> None:
    for case in ("matmuls", "reductions", "elementwise"):
        graph, _ = CASES[case]()
        program = group(graph)
        for k in program.kernels:
            space = gpu_schedule_space(k)
            assert space[0] == default_gpu_schedule(k) and len(set(space)) == len(space)
            for s in space:
                assert s.group_size <= 1024
                rk = render_kernel(k, program.buffers, OPENCL, s)
                assert rk.threads == s.group_size


def test_bad_schedules_and_dtypes_fail_clearly() -> None:
    with pytest.raises(ValueError, match="strategy"):
        GpuSchedule("warp")
    with pytest.raises(ValueError, match="multiple"):
        GpuSchedule("tile", tile=(64, 64, 16), micro=(3, 4))
    program = _softmax_program()
    with pytest.raises(EclatError, match="not a contraction"):
        render_kernel(program.kernels[0], program.buffers, CUDA, GpuSchedule("tile"))


def _all_cases_source(dialect) -> str:
    """Every case's kernels in one source (renamed apart), so one compiler call checks them all."""
    parts = [dialect.prelude]
    for case in sorted(CASES):
        graph, _ = CASES[case]()
        program = lowered(graph)
        for k in program.kernels:
            named = replace(k, name=f"{case}_{k.name}")
            for j, s in enumerate(gpu_schedule_space(k)[:3]):
                parts.append(render_kernel(replace(named, name=f"{named.name}_s{j}"), program.buffers,
                                           dialect, s).source)
    return "\n".join(parts)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to check Metal source as C++")
def test_metal_cases_compile_as_cpp() -> None:
    from eclat.backends.metal.runtime import check_syntax

    check_syntax(_all_cases_source(METAL))
    with pytest.raises(EclatError, match="does not compile"):
        check_syntax(METAL.prelude + "kernel void broken(device float* x [[buffer(0)]]) { x[0] = y; }")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not on PATH")
def test_cuda_cases_compile_with_nvcc(tmp_path, monkeypatch) -> None:
    from eclat.backends.cuda.nvcc import compile_ptx

    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path))
    ptx = compile_ptx(_all_cases_source(CUDA), "sm_80")
    assert ".entry matmuls_k0_" in ptx and "shfl.sync.down" in ptx
    assert list((tmp_path / "ptx").glob("*.ptx"))  # cached for the next compile


def test_cuda_backend_without_a_device() -> None:
    from eclat.backends import get_target
    from eclat.backends.cuda.runtime import available, driver

    if available():
        pytest.skip("a CUDA device is present: the gpu-marked tests run instead")
    with pytest.raises(EclatError, match="no CUDA device found"):
        driver()
    graph, inputs = CASES["gather"]()
    backend = get_target("cuda")
    exe = backend.compile(group(graph))  # the program exists without a device (for artifacts)
    assert "__global__" in exe.source and "__global__" in backend.render(group(graph))
    with pytest.raises(EclatError, match="no CUDA device found"):
        exe.run(inputs)


def test_packed_weights_are_packed_once_per_weight() -> None:
    """Every GPU build of a quantized compile (each candidate, the schedule variants) packs its
    weights: the packed arrays are remembered while the weight lives (compiler.derived)."""
    from eclat.backends.gpu.packing import PARTS, pack_weights

    graph, _ = CASES["packed"]()
    first, again = pack_weights(group(graph)), pack_weights(group(graph))
    parts = [n for n in first.buffers if n.endswith(PARTS)]
    assert len(parts) == 7  # w8, w4, table: values and scales; wb (bf16): values only
    assert all(np.shares_memory(first.buffers[n].data, again.buffers[n].data) for n in parts)


def test_literals_of_every_dtype() -> None:
    x = g.input_("x", (3,))
    big = g.expand_to(g.const(np.iinfo(np.int64).min, DType.int64), (3,))
    low = g.expand_to(g.const(-(2**31), DType.int32), (3,))
    inf = g.expand_to(g.const(float("-inf")), (3,))
    program = group(Graph([x], [g.binary("max", x, inf), g.binary("add", big, big), g.unary("neg", low)], {}))
    for d in DIALECTS.values():
        src = render_program(program, d).source
        assert f"-9223372036854775807{d.long_suffix} - 1" in src and "(-2147483647 - 1)" in src
        assert f"(-{d.inf})" in src


def test_matrix_vector_products_split_k_across_a_work_group() -> None:
    from tests.gpu_cases import matmul

    v, w = g.input_("v", (1, 512)), g.input_("w", (512, 64))
    a, b = g.input_("a", (64, 512)), g.input_("b", (512, 64))
    program = group(Graph([v, w, a, b], [matmul(v, w), matmul(a, b)], {}))
    strategies = [default_gpu_schedule(k).strategy for k in program.kernels]
    assert strategies == ["row", "tile"]
