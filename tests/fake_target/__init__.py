"""A target that exists only in this folder: a new GPU dialect, registered by the test that uses it
(eclat.backends.register), with nothing else in eclat changed. It is OpenCL C under another name
whose kernels read global memory through one macro, run by the OpenCL runtime (PoCL here), so that
a test can run it through compile(), the search, artifacts and the CLI's target list."""

from __future__ import annotations

from dataclasses import replace

from eclat.backends.gpu.dialects import OPENCL
from eclat.backends.gpu.target import GpuTarget

DIALECT = replace(OPENCL, name="fakecl", prelude="#define FAKE_GLOBAL __global\n", global_="FAKE_GLOBAL")

TARGET = GpuTarget(name="fakecl", dialect=DIALECT, runtime="eclat.backends.opencl.runtime:OpenCLExecutable",
                   probe="eclat.backends.opencl.probe:OpenCLProbe", source_member="kernels.fakecl")
