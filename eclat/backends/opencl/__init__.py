"""OpenCL target: the shared GPU renderer's OpenCL dialect, run through pyopencl."""

from __future__ import annotations

from ..gpu.dialects import OPENCL
from ..gpu.target import GpuTarget

TARGET = GpuTarget(name="opencl", dialect=OPENCL, runtime="eclat.backends.opencl.runtime:OpenCLExecutable",
                   probe="eclat.backends.opencl.probe:OpenCLProbe", source_member="kernels.cl")
