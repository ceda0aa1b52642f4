"""CUDA runtime on a real NVIDIA GPU (marked gpu: `pytest -m gpu`, run by benchmarks/gpu_check.sh):
every kernel case and schedule against the interpreter, and zoo models against torch."""

from __future__ import annotations

import os

import pytest

from eclat.compiler.group import group
from eclat.ir.interpreter import run
from tests.gpu_cases import CASES, assert_zoo_model_matches_torch, check_schedule_space, compare, lowered

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda_device() -> None:
    if not os.environ.get("ECLAT_REQUIRE_GPU"):  # benchmarks/gpu_check.sh sets it: fail, never skip
        pytest.importorskip("pycuda")
    from eclat.backends.cuda.runtime import driver

    driver()  # raises "no CUDA device found" where there is none: a gpu-marked test must not pass


def _exe(program, schedules=None):
    from eclat.backends.cuda.runtime import CudaExecutable

    return CudaExecutable(program, schedules)


@pytest.mark.parametrize("case", sorted(CASES))
def test_case_matches_interpreter(case: str) -> None:
    graph, inputs = CASES[case]()
    compare(_exe(lowered(graph)).run(inputs), run(graph, inputs))


@pytest.mark.parametrize("case", ["matmuls", "reductions", "elementwise"])
def test_whole_schedule_space(case: str) -> None:
    check_schedule_space(_exe, case, full=True)


@pytest.mark.parametrize("name", ["mlp", "cnn", "llama", "hf_gpt2"])
def test_zoo_model_matches_torch(name: str) -> None:
    assert_zoo_model_matches_torch(name, "cuda")


def test_kernel_timing_is_positive() -> None:
    graph, inputs = CASES["matmuls"]()
    exe = _exe(group(graph))
    exe.run(inputs)
    assert 0 < exe.time_kernels(repeats=5) < 1.0


def test_tuned_compile_saves_and_loads(tmp_path) -> None:
    """autotune="fast" on the device, a second compile from the tuning DB, and an artifact that
    loads and runs on its own: all three give torch's answer."""
    import torch

    import eclat

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).eval()
    inputs = (torch.randn(16, 64),)
    first, second = (eclat.compile(model, inputs, target="cuda", autotune="fast", k=2, cache_dir=tmp_path,
                                   quiet=True) for _ in range(2))
    assert first.report()["candidates"]["timed"] >= 1
    assert second.report()["tuning_cache"]["misses"] == 0
    path = tmp_path / "mlp.cuda.eclat"
    second.save(str(path))
    with torch.no_grad():
        want = model(*inputs)
    for compiled in (first, second, eclat.load(str(path))):
        torch.testing.assert_close(compiled(*inputs), want, rtol=1e-3, atol=1e-4)


def _compiled_mlp():
    import torch

    import eclat

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)).eval()
    inputs = (torch.randn(16, 64),)
    return model, eclat.compile(model, inputs, target="cuda", autotune="none", k=1, quiet=True)


def test_cuda_tensors_in_and_out_with_no_host_copy() -> None:
    """torch CUDA tensors in give CUDA tensors out, torch's values; each graph replay reads the
    call's own inputs; a host call between device calls gives the same values."""
    import torch

    model, compiled = _compiled_mlp()
    for seed in range(3):
        torch.manual_seed(seed)
        x = torch.randn(16, 64)
        with torch.no_grad():
            want = model(x)
        got = compiled(x.cuda())
        assert got.is_cuda and got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(compiled(x), got.cpu(), rtol=0, atol=0)
    strided = torch.randn(64, 16, device="cuda").t()  # not contiguous: made so, not refused
    with torch.no_grad():
        torch.testing.assert_close(compiled(strided).cpu(), model(strided.cpu()), rtol=1e-3, atol=1e-4)


def test_cuda_array_interface_in_gives_gpuarrays_out() -> None:
    import numpy as np
    import torch
    from pycuda import gpuarray

    model, compiled = _compiled_mlp()
    x = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    got = compiled(gpuarray.to_gpu(x))
    assert hasattr(got, "__cuda_array_interface__")
    with torch.no_grad():
        np.testing.assert_allclose(got.get(), model(torch.from_numpy(x)).numpy(), rtol=1e-3, atol=1e-4)


def test_bad_cuda_calls_name_the_problem() -> None:
    import torch

    _, compiled = _compiled_mlp()
    with pytest.raises(ValueError, match=r"expected shape \[16, 64\], given \[8, 64\]"):
        compiled(torch.randn(8, 64, device="cuda"))
    with pytest.raises(ValueError, match="expected dtype float32, given float16"):
        compiled(torch.randn(16, 64, device="cuda", dtype=torch.float16))


def test_graph_replays_read_each_calls_inputs() -> None:
    """The kernels are captured once as a graph; every replay computes from that call's inputs."""
    graph, inputs = CASES["matmuls"]()
    exe = _exe(group(graph))
    for scale in (1.0, -2.0, 0.5):
        scaled = [x * scale if x.dtype.kind == "f" else x for x in inputs]
        compare(exe.run(scaled), run(graph, scaled))
    assert exe._graph is not None and len(exe._launches) > 1
