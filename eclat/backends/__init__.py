"""Backends plug in as data: a target name maps to a class with render/compile.

    class Backend(Protocol):
        name: str
        def render(self, program: Program, threads: int = 1) -> str       # source text
        def compile(self, program: Program, threads: int = 1) -> Executable

    class Executable(Protocol):
        def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]

`run` receives contiguous arrays of the program's input shapes and dtypes (the caller
validates) and returns fresh output arrays shaped like program.output_shapes.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Protocol

import numpy as np

from ..errors import EclatError


class Executable(Protocol):
    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]: ...


class Backend(Protocol):
    name: str

    def render(self, program: Any, threads: int = 1) -> str: ...

    def compile(self, program: Any, threads: int = 1) -> Executable: ...


# target kind -> "module:Class"; a GPU backend registers itself by adding a row
BACKENDS: dict[str, str] = {
    "cpu": "eclat.backends.cpu:CpuBackend",
    "opencl": "eclat.backends.opencl:OpenCLBackend",
    "cuda": "eclat.backends.cuda:CudaBackend",
    "metal": "eclat.backends.metal:MetalBackend",
}


def get_backend(target: str) -> Backend:
    kind = target.partition(":")[0]
    if kind not in BACKENDS:
        raise EclatError(f"no backend for target {target!r}: available {sorted(BACKENDS)}")
    module, _, cls = BACKENDS[kind].partition(":")
    return getattr(import_module(module), cls)()
