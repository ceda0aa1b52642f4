"""Metal target: the shared GPU renderer's Metal dialect (MSL), run through PyObjC on macOS.

Off macOS the source is still rendered, and `shim/metal_stdlib` lets a C++ compiler check its
syntax and types (see `runtime.check_syntax`)."""

from __future__ import annotations

from ...errors import EclatError
from ..gpu.dialects import METAL
from ..gpu.target import GpuTarget


def missing() -> str | None:
    """Why Metal programs cannot run here (not macOS, no PyObjC, no device); None when they can."""
    from .runtime import _metal

    try:
        metal = _metal()
    except EclatError as e:
        return str(e)
    return None if metal.MTLCreateSystemDefaultDevice() is not None else "no Metal device found"


TARGET = GpuTarget(name="metal", dialect=METAL, runtime="eclat.backends.metal.runtime:MetalExecutable",
                   probe="eclat.backends.metal.probe:MetalProbe",
                   missing="eclat.backends.metal:missing", source_member="kernels.metal")
