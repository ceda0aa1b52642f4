"""Metal runtime through PyObjC (macOS only; imported lazily), and a C++ syntax check of the
Metal source against `shim/metal_stdlib` for machines without Metal."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ...compiler.kernel import Program
from ...errors import EclatError
from ..gpu import METAL, Dialect, GpuSchedule, RenderedProgram, render_program
from ..gpu.packing import device_dtype, from_device, resident, to_device

SHIM = Path(__file__).parent / "shim"
_CXX_FLAGS = ["-std=c++17", "-fsyntax-only", "-Wall", "-Werror", "-Wno-attributes",
              "-Wno-unused-variable", "-Wno-unknown-pragmas", "-x", "c++"]


def check_syntax(source: str, compiler: str = "g++") -> None:
    """Compile Metal source as C++ against the shim; raise EclatError with the diagnostics."""
    cxx = shutil.which(compiler)
    if cxx is None:
        raise EclatError(f"no C++ compiler {compiler!r} to check Metal source with")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernels.metal"
        src.write_text(source)
        proc = subprocess.run([cxx, *_CXX_FLAGS, "-I", str(SHIM), str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EclatError(f"Metal source does not compile as C++:\n{proc.stderr[-4000:]}")


def _metal() -> Any:
    if sys.platform != "darwin":
        raise EclatError("the Metal backend runs only on macOS")
    try:
        import Metal
    except ImportError as e:
        raise EclatError("the Metal backend needs PyObjC's Metal: "
                         "`pip install pyobjc-framework-Metal`") from e
    return Metal


class MetalExecutable:
    def __init__(self, program: Program, schedules: dict[str, GpuSchedule] | None = None,
                 dialect: Dialect = METAL):
        Metal = _metal()
        self.program = program
        self.rendered: RenderedProgram = render_program(program, dialect, schedules)
        self.device = Metal.MTLCreateSystemDefaultDevice()
        if self.device is None:
            raise EclatError("no Metal device found")
        options = Metal.MTLCompileOptions.new()
        options.setFastMathEnabled_(False)  # numpy-level accuracy for exp2/sin
        library, err = self.device.newLibraryWithSource_options_error_(self.rendered.source, options, None)
        if library is None:
            raise EclatError(f"Metal compile failed: {err}")
        shared = Metal.MTLResourceStorageModeShared
        self.buffers: dict[str, Any] = {}
        for name, b in resident(program).items():
            if b.role == "weight" and b.nbytes:
                data = to_device(b.dtype, b.data).tobytes()
                self.buffers[name] = self.device.newBufferWithBytes_length_options_(data, len(data), shared)
            else:
                self.buffers[name] = self.device.newBufferWithLength_options_(max(b.nbytes, 4), shared)
        self.pipelines = []
        for rk in self.rendered.kernels:
            if rk.groups == 0:
                continue
            fn = library.newFunctionWithName_(rk.name)
            state, err = self.device.newComputePipelineStateWithFunction_error_(fn, None)
            if state is None:
                raise EclatError(f"Metal pipeline for {rk.name} failed: {err}")
            self.pipelines.append((state, rk))
        self.queue = self.device.newCommandQueue()
        self._metal = Metal

    def _view(self, name: str) -> np.ndarray:
        b = self.program.buffers[name]
        raw = self.buffers[name].contents().as_buffer(max(b.nbytes, 4))
        return np.frombuffer(raw, dtype=device_dtype(b.dtype), count=b.numel)

    def _dispatch(self, pipelines: list) -> None:
        Metal = self._metal
        cmd = self.queue.commandBuffer()
        enc = cmd.computeCommandEncoder()
        for state, rk in pipelines:
            enc.setComputePipelineState_(state)
            for n, arg in enumerate(rk.args):
                enc.setBuffer_offset_atIndex_(self.buffers[arg], 0, n)
            enc.dispatchThreadgroups_threadsPerThreadgroup_(Metal.MTLSizeMake(rk.groups, 1, 1),
                                                            Metal.MTLSizeMake(rk.threads, 1, 1))
        enc.endEncoding()
        cmd.commit()
        cmd.waitUntilCompleted()

    def time_kernel(self, name: str, repeats: int = 10) -> float:
        """Median seconds of one dispatch of kernel `name` (with its command buffer)."""
        chosen = [(s, rk) for s, rk in self.pipelines if rk.name == name]
        times = []
        for _ in range(repeats + 1):
            t = time.perf_counter()
            self._dispatch(chosen)
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        p = self.program
        for name, a in zip(p.inputs, inputs):
            self._view(name)[:] = to_device(p.buffers[name].dtype, a)
        self._dispatch(self.pipelines)
        return [from_device(p.buffers[name].dtype, self._view(name).copy()).reshape(shape)
                for name, shape in zip(p.outputs, p.output_shapes)]
