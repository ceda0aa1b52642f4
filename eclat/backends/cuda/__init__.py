"""CUDA backend: the shared GPU renderer's CUDA dialect, compiled by nvcc, launched with pycuda.

Compiling needs neither a GPU nor pycuda: `compile` renders the program (and builds PTX where
nvcc exists); only `run` needs a device and raises "no CUDA device found" without one."""

from __future__ import annotations

from ...compiler.kernel import Program
from ..gpu_c import CUDA, GpuSchedule, render_program, tune_schedules

Schedules = dict[str, GpuSchedule] | None  # kernel name -> schedule; None: defaults


class CudaBackend:
    name = "cuda"

    def render(self, program: Program, threads: int = 1, schedules: Schedules = None) -> str:
        return render_program(program, CUDA, schedules).source

    def compile(self, program: Program, threads: int = 1, schedules: Schedules = None):
        from .runtime import CudaExecutable

        return CudaExecutable(program, schedules)

    def tune(self, program: Program, inputs: list, mode: str = "fast", db=None, device: str = ""
             ) -> dict[str, GpuSchedule]:
        """The fastest verified GPU schedule of every kernel (gpu_c.tune_schedules)."""
        from .runtime import CudaExecutable

        return tune_schedules(program, inputs, CudaExecutable, backend=self.name, mode=mode, db=db,
                              device=device)
