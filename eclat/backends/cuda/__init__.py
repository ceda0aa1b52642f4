"""CUDA target: the shared GPU renderer's CUDA dialect, compiled by nvcc, launched with pycuda.

Compiling needs neither a GPU nor pycuda: without a device the program is rendered (and built to
PTX where nvcc exists) and kept for an artifact; only running it needs the device."""

from __future__ import annotations

from ...errors import EclatError
from ..gpu.dialects import CUDA
from ..gpu.target import GpuTarget


def unlaunchable_here(source: str, threads: dict[str, int]) -> dict[str, str]:
    """The kernels of source (name -> block size) this machine's device cannot launch, with why."""
    from .nvcc import unlaunchable
    from .runtime import device_arch

    return unlaunchable(source, threads, device_arch())


def missing() -> str | None:
    """Why CUDA programs cannot run here (no pycuda, no driver, no device); None when they can."""
    from .runtime import driver

    try:
        driver()
    except EclatError as e:
        return str(e)
    return None


TARGET = GpuTarget(name="cuda", dialect=CUDA, runtime="eclat.backends.cuda.runtime:CudaExecutable",
                   probe="eclat.backends.cuda.probe:CudaProbe",
                   missing="eclat.backends.cuda:missing", source_member="kernels.cu",
                   launch_check="eclat.backends.cuda:unlaunchable_here")
