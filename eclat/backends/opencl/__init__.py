"""OpenCL backend: the shared GPU renderer's OpenCL dialect, run through pyopencl."""

from __future__ import annotations

from ...compiler.kernel import Program
from ..gpu_c import OPENCL, GpuSchedule, render_program, tune_schedules

Schedules = dict[str, GpuSchedule] | None  # kernel name -> schedule; None: defaults


class OpenCLBackend:
    name = "opencl"

    def render(self, program: Program, threads: int = 1, schedules: Schedules = None) -> str:
        return render_program(program, OPENCL, schedules).source

    def compile(self, program: Program, threads: int = 1, schedules: Schedules = None):
        from .runtime import OpenCLExecutable

        return OpenCLExecutable(program, schedules)

    def tune(self, program: Program, inputs: list, mode: str = "fast", db=None, device: str = ""
             ) -> dict[str, GpuSchedule]:
        """The fastest verified GPU schedule of every kernel (gpu_c.tune_schedules)."""
        from .runtime import OpenCLExecutable

        return tune_schedules(program, inputs, OpenCLExecutable, backend=self.name, mode=mode, db=db,
                              device=device)
