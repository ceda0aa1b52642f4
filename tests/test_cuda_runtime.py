"""CUDA runtime on a real NVIDIA GPU (marked gpu: `pytest -m gpu`, run by benchmarks/gpu_check.sh):
every kernel case and schedule against the interpreter, and zoo models against torch."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from eclat.compiler.group import group
from eclat.ir.interpreter import run
from tests.gpu_cases import CASES, check_schedule_space, compare
from tests.zoo import ZOO

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
    compare(_exe(group(graph)).run(inputs), run(graph, inputs))


@pytest.mark.parametrize("case", ["matmuls", "reductions", "elementwise"])
def test_whole_schedule_space(case: str) -> None:
    check_schedule_space(_exe, case, full=True)


@pytest.mark.parametrize("name", ["mlp", "llama", "hf_gpt2"])
def test_zoo_model_matches_torch(name: str) -> None:
    import eclat

    model, inputs = ZOO[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast = eclat.compile(model, inputs, target="cuda", autotune="none", k=1, quiet=True)
        with torch.no_grad():
            want = torch.utils._pytree.tree_leaves(model(*inputs))
    got = torch.utils._pytree.tree_leaves(fast(*inputs))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-3, atol=1e-4)


def test_kernel_timing_is_positive() -> None:
    graph, inputs = CASES["matmuls"]()
    exe = _exe(group(graph))
    exe.run(inputs)
    assert 0 < exe.time_kernels(repeats=5) < 1.0
