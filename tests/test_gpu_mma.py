"""The mma strategy (tensor cores through nvcuda::wmma, eclat/backends/gpu/mma.py): which kernels and
dialects get it and when TF32 is allowed (no GPU needed); every mma schedule of the space rendered
and compiled by nvcc for sm_80 and sm_90 with the tensor-core instructions in each kernel's PTX
(needs nvcc); and, marked gpu, every mma schedule run on an NVIDIA GPU against the interpreter and
an exact float64 reference. Also 16-bit contractions on the tile strategy under OpenCL (PoCL)."""

from __future__ import annotations

import math
import os
import re
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from eclat.backends.gpu import (
    CUDA,
    METAL,
    OPENCL,
    GpuSchedule,
    default_gpu_schedule,
    gpu_schedule_space,
    render_kernel,
    render_program,
    with_variants,
)
from eclat.backends.gpu.schedules import mma_shared_bytes, tf32_allowed, tf32_tolerance, uses_tf32
from eclat.compiler.kernel import Program
from eclat.errors import EclatError
from eclat.ir import graph as g
from eclat.ir.dtypes import DType, round_bfloat16
from eclat.ir.graph import Graph
from eclat.ir.interpreter import run
from tests.gpu_cases import lowered, matmul

DTYPES = {"float16": DType.float16, "bfloat16": DType.bfloat16, "float32": DType.float32}
# M x K @ K x N products whose m, n and k are no multiples of any tile; "at" is read transposed (a
# neither way unit-stride in k), "w" too (b unit-stride in k: a transposed weight)
SHAPES = {"a": (70, 45), "b": (45, 75), "bias": (75,), "ba": (3, 19, 40), "bb": (3, 40, 33),
          "x": (21, 50), "w": (35, 50), "at": (37, 130), "c": (37, 9)}


def _t(x: g.Node) -> g.Node:
    return g.movement(x, lambda v: v.permute((1, 0)))


def _products(tag: str, dt: DType) -> tuple[list[g.Node], list[g.Node]]:
    """(inputs, outputs) of dt: relu(a @ b + bias), a batched product, x @ w^T and at^T @ c."""
    n = {name: g.input_(f"{tag}_{name}", s, dt) for name, s in SHAPES.items()}
    mm = matmul(n["a"], n["b"])
    relu = g.binary("max", g.binary("add", mm, g.expand_to(n["bias"], mm.shape)),
                    g.expand_to(g.const(0.0, dt), mm.shape))
    return list(n.values()), [relu, matmul(n["ba"], n["bb"]), matmul(n["x"], _t(n["w"])),
                              matmul(_t(n["at"]), n["c"])]


def _exact(x: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The four products in float64 from the (exactly representable) inputs: what a kernel that
    multiplies exactly and accumulates in float32 computes, before it rounds to its output type."""
    return [np.maximum(x["a"] @ x["b"] + x["bias"], 0.0), x["ba"] @ x["bb"], x["x"] @ x["w"].T,
            x["at"].T @ x["c"]]


def _exact_outputs(program: Program, inputs: list[np.ndarray]) -> dict[str, np.ndarray]:
    """Each output buffer of program (the products of _all_products or a prefix of its types, in
    order) -> its exact float64 value."""
    out: dict[str, np.ndarray] = {}
    for d in range(len(program.outputs) // 4):
        xs = dict(zip(SHAPES, (x.astype(np.float64) for x in inputs[d * len(SHAPES):(d + 1) * len(SHAPES)])))
        out.update({program.outputs[4 * d + j]: r for j, r in enumerate(_exact(xs))})
    return out


def _inputs(dt: DType, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]
    if dt is DType.float16:
        return [x.astype(np.float16) for x in xs]
    return [round_bfloat16(x) for x in xs] if dt is DType.bfloat16 else xs


def _all_products() -> tuple[Graph, list[np.ndarray]]:
    """One graph with the four products in each of float16, bfloat16 and float32."""
    ins, outs, values = [], [], []
    for seed, (tag, dt) in enumerate(DTYPES.items()):
        i, o = _products(tag, dt)
        ins += i
        outs += o
        values += _inputs(dt, seed)
    return Graph(ins, outs, {}), values


def _mma_spaces(program: Program) -> dict[str, list[GpuSchedule]]:
    """Every mma schedule of each kernel's CUDA space, TF32 allowed."""
    return {k.name: [s for s in gpu_schedule_space(k, CUDA, tf32=True) if s.strategy == "mma"]
            for k in program.kernels}


# --- which kernels, dialects and schedules --------------------------------------------------------

def test_mma_only_on_cuda_and_tf32_only_when_allowed() -> None:
    graph, _ = _all_products()
    program = lowered(graph)
    assert len(program.kernels) == 12
    for k in program.kernels:
        dt = k.body.dtype
        for d in (OPENCL, METAL, None):
            space = gpu_schedule_space(k, d, tf32=True)
            assert all(s.strategy != "mma" for s in space), (k.name, d)
            # a 16-bit product is a real GEMM (the tile strategy, in float registers) everywhere
            assert space[0].strategy == "tile" and default_gpu_schedule(k, d).strategy == "tile"
        cuda = gpu_schedule_space(k, CUDA, tf32=False)
        mma = [s for s in cuda if s.strategy == "mma"]
        if dt is DType.float32:
            assert not mma and cuda[0].strategy == "tile"  # no tensor cores without TF32
            tf32 = gpu_schedule_space(k, CUDA, tf32=True)
            assert tf32[0].strategy == "tile"  # the default stays exact: TF32 only as an alternative
            assert len([s for s in tf32 if s.strategy == "mma"]) >= 4
            assert all(uses_tf32(k, s) == (s.strategy == "mma") for s in tf32)
        else:
            assert cuda[0].strategy == "mma" and default_gpu_schedule(k, CUDA).strategy == "mma"
            assert len(mma) >= 4 and "tile" in {s.strategy for s in cuda}
            assert not any(uses_tf32(k, s) for s in cuda)
        for s in mma:
            (tm, tn, tk), (wy, wx) = s.tile, s.warps
            assert tm % (16 * wy) == 0 and tn % (16 * wx) == 0 and tk % 16 == 0
            assert s.group_size == 32 * wy * wx <= 1024 and mma_shared_bytes(s, "tf32") <= 48 * 1024
        assert len(set(cuda)) == len(cuda)


def test_the_tf32_switches(monkeypatch) -> None:
    monkeypatch.delenv("ECLAT_ALLOW_TF32", raising=False)
    torch_off = SimpleNamespace(backends=SimpleNamespace(cuda=SimpleNamespace(matmul=SimpleNamespace(
        allow_tf32=False))))
    torch_on = SimpleNamespace(backends=SimpleNamespace(cuda=SimpleNamespace(matmul=SimpleNamespace(
        allow_tf32=True))))
    ins, outs = _products("f", DType.float32)
    k = lowered(Graph(ins, outs[:1], {})).kernels[0]
    monkeypatch.setitem(sys.modules, "torch", None)  # torch not imported (an import would raise)
    assert not tf32_allowed()
    monkeypatch.setitem(sys.modules, "torch", torch_off)
    assert not tf32_allowed()
    assert all(s.strategy != "mma" for s in gpu_schedule_space(k, CUDA))
    monkeypatch.setitem(sys.modules, "torch", torch_on)
    assert tf32_allowed() and any(s.strategy == "mma" for s in gpu_schedule_space(k, CUDA))
    monkeypatch.setitem(sys.modules, "torch", torch_off)
    monkeypatch.setenv("ECLAT_ALLOW_TF32", "1")
    assert tf32_allowed() and any(s.strategy == "mma" for s in gpu_schedule_space(k, CUDA))


def test_the_tf32_tolerance_grows_with_k() -> None:
    x, w = g.input_("x", (32, 64)), g.input_("w", (64, 4096))
    y, v = g.input_("y", (32, 4096)), g.input_("v", (4096, 64))
    short, long_ = lowered(Graph([x, w, y, v], [matmul(x, w), matmul(y, v)], {})).kernels
    assert tf32_tolerance(short) == {"rtol": 1e-3, "atol": 1e-3}
    assert tf32_tolerance(long_)["rtol"] == pytest.approx(8e-3)


def test_bad_mma_schedules_and_dialects_are_refused() -> None:
    with pytest.raises(ValueError):
        GpuSchedule("mma", tile=(64, 48, 32), warps=(2, 2))  # 48 is not 2 warps of 16-column fragments
    with pytest.raises(ValueError):
        GpuSchedule("mma", tile=(64, 64, 8), warps=(2, 2))  # k not a multiple of 16
    assert GpuSchedule("mma", tile=(128, 128, 32), warps=(4, 2)).group_size == 256
    graph, _ = _all_products()
    program = lowered(graph)
    k = program.kernels[0]
    s = GpuSchedule("mma", tile=(64, 64, 32), warps=(2, 2))
    for d in (OPENCL, METAL):
        with pytest.raises(EclatError, match="mma"):
            render_kernel(k, program.buffers, d, s)
    x = g.input_("x", (40, 50), DType.int32)  # not a float contraction
    (ik,) = lowered(Graph([x], [g.reduce("sum", g.binary("mul", x, x), 1)], {})).kernels
    with pytest.raises(EclatError, match="mma"):
        render_kernel(ik, {}, CUDA, s)


# --- nvcc: every mma schedule compiles to tensor-core instructions --------------------------------

def _entries(ptx: str) -> dict[str, str]:
    """Each kernel's PTX body by name."""
    parts = re.split(r"\.entry\s+(\w+)\s*\(", ptx)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_mma_schedule_compiles_to_tensor_core_instructions(arch: str) -> None:
    from eclat.backends.cuda.nvcc import compile_ptx, nvcc_path

    if nvcc_path() is None:
        pytest.skip("nvcc (the CUDA toolkit) is not installed")
    graph, _ = _all_products()
    program = lowered(graph)
    spaces = _mma_spaces(program)
    prog, chosen, variants = with_variants(program, spaces)
    assert len(variants) >= 4 * len(program.kernels)
    src = render_program(prog, CUDA, chosen).source
    assert "#include <mma.h>" in src and "#include <cuda_bf16.h>" in src
    for frag in ("__half, wmma::row_major", "__nv_bfloat16, wmma::col_major", "wmma::precision::tf32",
                 "wmma::__float_to_tf32("):
        assert frag in src, frag
    entries = _entries(compile_ptx(src, arch))
    kind = {k.name: k.body.dtype for k in program.kernels}
    for v in variants:
        body = entries[v.name]
        assert "wmma.mma.sync" in body or "mma.sync" in body, f"{v.name} ({v.schedule}) has no mma"
        # the fragments' type is in the loads' names (wmma.load.a.sync.aligned.row.m16n16k16.f16),
        # the shape in the products' (wmma.mma.sync.aligned.row.row.m16n16k8.f32.tf32.tf32.f32)
        want, shape = {DType.float16: (".f16", "m16n16k16"), DType.bfloat16: (".bf16", "m16n16k16"),
                       DType.float32: (".tf32", "m16n16k8")}[kind[v.kernel]]
        lines = body.splitlines()
        loads = [line for line in lines if "wmma.load.a" in line or "wmma.load.b" in line]
        assert loads and all(line.split()[0].endswith(want) for line in loads), (v.name, loads[:1])
        assert all(shape in line for line in lines if "mma.sync" in line), v.name
    for k in program.kernels:  # the originals: 16-bit ones on tensor cores by default, float32 never
        assert ("mma.sync" in entries[k.name]) == (k.body.dtype is not DType.float32), k.name


# --- on an NVIDIA GPU --------------------------------------------------------------------------------

# how far an mma result may be from the exact float64 product, by the kernel's type: one unit in the
# last place of a 16-bit output (its operands are exact in the fragments, the products exact and the
# float32 sums off by ~1e-7: only the final rounding differs), TF32's tolerance for float32
ULP = {DType.float16: 2.0**-10, DType.bfloat16: 2.0**-7}
# from the interpreter, which rounds each op's result (the products too) to the 16-bit type: its own
# error, measured at 6e-4 (float16) and 2.4e-3 (bfloat16) of the largest output on these products
INTERPRETER = {DType.float16: 2e-3, DType.bfloat16: 1e-2}


@pytest.mark.gpu
def test_every_mma_schedule_on_the_device() -> None:
    if not os.environ.get("ECLAT_REQUIRE_GPU"):  # benchmarks/gpu_check.sh sets it: fail, never skip
        pytest.importorskip("pycuda")
    from eclat.backends.cuda.runtime import CudaExecutable, driver

    driver()  # raises "no CUDA device found" where there is none: a gpu-marked test must not pass
    graph, inputs = _all_products()
    program = lowered(graph)
    prog, chosen, variants = with_variants(program, _mma_spaces(program))
    outs = dict(zip(prog.outputs, CudaExecutable(prog, chosen).run(inputs)))
    want = dict(zip(program.outputs, run(graph, inputs)))
    exact = _exact_outputs(program, inputs)
    kernels = {k.name: k for k in program.kernels}
    checks = [(k.name, k.out, None) for k in program.kernels] + [(v.kernel, v.out, v) for v in variants]
    for name, out, v in checks:
        k = kernels[name]
        got, ref, ref64 = outs[out].astype(np.float64), want[k.out].astype(np.float64), exact[k.out]
        scale = float(np.max(np.abs(ref64)))
        what = f"{name} with {v.schedule if v else 'its default'}"
        dt = k.body.dtype
        if dt is DType.float32:  # TF32 for the variants (mma), exact float32 for the default (tile)
            tol = tf32_tolerance(k) if v is not None else {"rtol": 1e-4, "atol": 1e-5}
            np.testing.assert_allclose(got, ref64, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=what)
            np.testing.assert_allclose(got, ref, rtol=tol["rtol"], atol=tol["atol"] * scale, err_msg=what)
        else:
            np.testing.assert_allclose(got, ref64, rtol=ULP[dt], atol=1e-5 * scale, err_msg=what)
            np.testing.assert_allclose(got, ref, rtol=INTERPRETER[dt], atol=INTERPRETER[dt] * scale,
                                       err_msg=what)
        assert math.isfinite(scale) and scale > 1.0


# --- 16-bit products on the tile strategy (OpenCL, PoCL) ------------------------------------------

def test_16_bit_products_on_the_tile_strategy_under_opencl() -> None:
    """OpenCL has no matrix unit: a 16-bit product runs the tile strategy, its values read into float
    registers and accumulated in float; every tile schedule against the exact float64 product."""
    from tests.gpu_cases import opencl_or_skip

    opencl_or_skip()
    from eclat.backends.opencl.runtime import OpenCLExecutable

    ins, outs, values = [], [], []
    for seed, tag in enumerate(("float16", "bfloat16")):
        i, o = _products(tag, DTYPES[tag])
        ins, outs, values = ins + i, outs + o, values + _inputs(DTYPES[tag], seed)
    graph = Graph(ins, outs, {})
    program = lowered(graph)
    spaces = {k.name: [s for s in gpu_schedule_space(k, OPENCL) if s.strategy == "tile"][:3]
              for k in program.kernels}
    prog, chosen, variants = with_variants(program, spaces)
    got = dict(zip(prog.outputs, OpenCLExecutable(prog, chosen).run(values)))
    exact = _exact_outputs(program, values)
    out_of = {k.name: (k.out, k.body.dtype) for k in program.kernels}
    for v in variants:
        out, dt = out_of[v.kernel]
        ref = exact[out]
        np.testing.assert_allclose(got[v.out].astype(np.float64), ref, rtol=ULP[dt],
                                   atol=1e-5 * np.max(np.abs(ref)), err_msg=f"{v.kernel} with {v.schedule}")
