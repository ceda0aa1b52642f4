"""CUDA backend: the shared GPU renderer's CUDA dialect, compiled by nvcc, launched with pycuda.

Compiling needs neither a GPU nor pycuda: `compile` renders the program (and builds PTX where
nvcc exists); only `run` needs a device and raises "no CUDA device found" without one."""

from __future__ import annotations

from ..gpu_c import CUDA, GpuBackend


class CudaBackend(GpuBackend):
    name, dialect, runtime = "cuda", CUDA, "eclat.backends.cuda.runtime:CudaExecutable"
