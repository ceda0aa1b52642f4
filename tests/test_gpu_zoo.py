"""Every zoo model on the GPU backends: OpenCL runs through eclat.compile and matches torch;
CUDA C of every kernel compiles with nvcc to PTX for sm_80 and sm_90; Metal source of every
kernel compiles as C++ against the shim. All of it runs in CI (about two minutes)."""

from __future__ import annotations

import os
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest

from eclat.backends.gpu import render_program
from eclat.compiler.group import group
from eclat.compiler.kernel import Program
from tests.gpu_cases import assert_zoo_model_matches_torch, opencl_or_skip
from tests.zoo import ZOO

MODELS = list(ZOO)
_PROGRAMS: dict[str, Program] = {}


def program(name: str) -> Program:
    """The kernels a GPU target builds for the model: lowered, optimised for the GPU target
    (first candidate), grouped. Cached: lowering the larger models takes tens of seconds."""
    if name not in _PROGRAMS:
        from eclat.frontend import lower
        from eclat.rewrites import optimize

        model, inputs = ZOO[name]()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = lower(model, inputs)
        _PROGRAMS[name] = group(optimize(graph, "cuda", 1).candidates[0])
    return _PROGRAMS[name]


@pytest.mark.parametrize("name", MODELS)
def test_opencl_matches_torch(name: str) -> None:
    opencl_or_skip()
    assert_zoo_model_matches_torch(name, "opencl")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (the CUDA toolkit) is not on PATH")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_compiles_to_ptx(name: str, tmp_path, monkeypatch) -> None:
    from eclat.backends.cuda.nvcc import compile_ptx

    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path))  # compile for real, not from the cache
    rendered = render_program(program(name), "cuda")
    with ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1)) as pool:
        ptx = list(pool.map(lambda arch: compile_ptx(rendered.source, arch), ["sm_80", "sm_90"]))
    for arch, text in zip(["sm_80", "sm_90"], ptx):
        assert f".target {arch}" in text
        for k in rendered.kernels:
            assert f".entry {k.name}(" in text, f"{k.name} missing from the {arch} PTX"


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to check Metal source as C++")
@pytest.mark.parametrize("name", MODELS)
def test_metal_source_compiles_as_cpp(name: str) -> None:
    from eclat.backends.metal.runtime import check_syntax

    rendered = render_program(program(name), "metal")
    assert all(f"kernel void {k.name}(" in rendered.source for k in rendered.kernels)
    check_syntax(rendered.source)
