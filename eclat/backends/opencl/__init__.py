"""OpenCL backend: the shared GPU renderer's OpenCL dialect, run through pyopencl."""

from __future__ import annotations

from ..gpu_c import OPENCL, GpuBackend


class OpenCLBackend(GpuBackend):
    name, dialect, runtime = "opencl", OPENCL, "eclat.backends.opencl.runtime:OpenCLExecutable"
