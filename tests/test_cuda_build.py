"""The CUDA target without a GPU: every schedule of every case's space builds to machine code for
sm_80 and sm_90 and passes the launch check (registers, shared memory from ptxas); the check prunes
what cannot launch; and calls with tensors in GPU memory are checked before they run."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from eclat.backends import get_target
from eclat.backends.cuda.nvcc import Resources, parse_resources, unlaunchable
from eclat.backends.gpu import CUDA, render_program, with_variants
from eclat.backends.gpu.target import GpuTarget
from eclat.compiler.model import CompiledModel
from eclat.compiler.specs import InputSpec
from eclat.ir.dtypes import DType
from tests.gpu_cases import CASES, lowered

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not on PATH")


def _whole_space(case: str):
    program = lowered(CASES[case]()[0])
    target = get_target("cuda")
    spaces = {k.name: target.schedule_space(k) for k in program.kernels}
    return program, spaces


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_schedule_builds_and_can_launch(arch: str, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path))
    for case in ("matmuls", "reductions", "elementwise", "halves", "attention"):
        program, spaces = _whole_space(case)
        variants, chosen, copies = with_variants(program, spaces)
        rendered = render_program(variants, CUDA, chosen)
        threads = {k.name: k.threads for k in rendered.kernels}
        assert len(threads) > len(program.kernels)
        assert unlaunchable(rendered.source, threads, arch) == {}, case


@needs_nvcc
def test_a_kernel_that_cannot_launch_is_named_with_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path))
    source = """
extern "C" __global__ void fits(float* x) { __shared__ float s[256]; s[threadIdx.x] = x[threadIdx.x];
  __syncthreads(); x[threadIdx.x] = s[255 - threadIdx.x]; }
extern "C" __global__ void too_big(float* x) { __shared__ float s[16384]; s[threadIdx.x] = x[threadIdx.x];
  __syncthreads(); x[threadIdx.x] = s[16383 - threadIdx.x]; }
"""
    refused = unlaunchable(source, {"fits": 256, "too_big": 256}, "sm_90")
    assert list(refused) == ["too_big"] and "shared memory" in refused["too_big"]


def test_resources_are_read_from_ptxas_and_limit_the_block() -> None:
    report = """ptxas info    : Compiling entry function 'k0' for 'sm_90'
ptxas info    : Function properties for k0
    8 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 8192 bytes smem, 400 bytes cmem[0]
ptxas info    : Compiling entry function 'k1' for 'sm_90'
ptxas info    : Used 32 registers, 400 bytes cmem[0]
"""
    got = parse_resources(report)
    assert got == {"k0": Resources(128, 8192, 8), "k1": Resources(32, 0, 0)}
    assert got["k0"].unlaunchable(512) is None  # 128 x 512 = 65536: exactly a multiprocessor's
    assert "registers" in got["k0"].unlaunchable(1024)
    assert "shared memory" in Resources(16, 49 * 1024, 0).unlaunchable(32)


def refuse_second_schedules(source: str, threads: dict[str, int]) -> dict[str, str]:
    """A launch check refusing each kernel's second schedule (its copy named ..._v1)."""
    return {name: "refused by the test" for name in threads if name.endswith("_v1")}


def test_schedules_that_cannot_launch_are_pruned_before_timing() -> None:
    program, spaces = _whole_space("matmuls")
    base = get_target("cuda")
    target = GpuTarget(base.name, base.dialect, base.runtime, base.probe_class, base.source_member,
                       launch_check="tests.test_cuda_build:refuse_second_schedules")
    kept, pruned = target.launchable(program, spaces)
    second = {(name, space[1]) for name, space in spaces.items() if len(space) > 1}
    assert pruned == dict.fromkeys(second, "refused by the test")
    assert kept == {name: [s for j, s in enumerate(space) if j != 1] for name, space in spaces.items()}


class _DeviceArray:
    """Something in GPU memory by the CUDA array interface (never dereferenced here)."""

    def __init__(self, shape, dtype, strides=None):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": np.dtype(dtype).str, "data": (0, False),
                                         "strides": strides, "version": 3}


class _FakeGpuExecutable:
    program = None

    def __init__(self):
        self.calls = []

    def run(self, arrays):
        raise AssertionError("a call with GPU tensors must not take the host path")

    def run_device(self, arrays):
        self.calls.append(arrays)
        return [_DeviceArray((2, 3), np.float32)]


def _device_model() -> tuple[CompiledModel, _FakeGpuExecutable]:
    exe = _FakeGpuExecutable()
    specs = [InputSpec("x", (2, 3), DType.float32), InputSpec("y", (3,), DType.float32)]
    return CompiledModel(exe, specs, None, {}), exe


def test_gpu_tensors_go_to_the_device_path_with_no_host_copy() -> None:
    model, exe = _device_model()
    x, y = _DeviceArray((2, 3), np.float32), _DeviceArray((3,), np.float32)
    out = model(x, y)
    assert exe.calls == [[x, y]] and hasattr(out, "__cuda_array_interface__")


_F32, _Y = np.float32, _DeviceArray((3,), np.float32)


@pytest.mark.parametrize("args, message", [
    ((_DeviceArray((2, 3), np.float64), _Y), "expected dtype float32, given float64"),
    ((_DeviceArray((3, 2), _F32), _Y), "expected shape [2, 3], given [3, 2]"),
    ((_DeviceArray((2, 3), _F32, (4, 8)), _Y), "expected a contiguous array"),
    ((_DeviceArray((2, 3), _F32), np.zeros(3, _F32)), "input 1 (y): expected a tensor in GPU memory"),
])
def test_bad_gpu_calls_name_the_problem(args, message) -> None:
    model, exe = _device_model()
    with pytest.raises(ValueError) as e:
        model(*args)
    assert message in str(e.value) and not exe.calls
