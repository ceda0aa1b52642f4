"""OpenCL backend: the shared GPU renderer's OpenCL dialect, run through pyopencl."""

from __future__ import annotations

from ...compiler.kernel import Program
from ..gpu_c import OPENCL, GpuSchedule, render_program

Schedules = dict[str, GpuSchedule] | None  # kernel name -> schedule; None: defaults


class OpenCLBackend:
    name = "opencl"

    def render(self, program: Program, threads: int = 1, schedules: Schedules = None) -> str:
        return render_program(program, OPENCL, schedules).source

    def compile(self, program: Program, threads: int = 1, schedules: Schedules = None):
        from .runtime import OpenCLExecutable

        return OpenCLExecutable(program, schedules)
