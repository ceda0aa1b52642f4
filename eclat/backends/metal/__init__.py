"""Metal backend: the shared GPU renderer's Metal dialect (MSL), run through PyObjC on macOS.

Off macOS the source is still rendered, and `shim/metal_stdlib` lets a C++ compiler check its
syntax and types (see `check_syntax`)."""

from __future__ import annotations

from ..gpu_c import METAL, GpuBackend


class MetalBackend(GpuBackend):
    name, dialect, runtime = "metal", METAL, "eclat.backends.metal.runtime:MetalExecutable"
