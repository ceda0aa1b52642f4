"""CUDA backend: the shared GPU renderer's CUDA dialect, compiled by nvcc, launched with pycuda.

Compiling needs neither a GPU nor pycuda: `compile` renders the program (and builds PTX where
nvcc exists); only `run` needs a device and raises "no CUDA device found" without one."""

from __future__ import annotations

from ...compiler.kernel import Program
from ..gpu_c import CUDA, GpuSchedule, render_program

Schedules = dict[str, GpuSchedule] | None  # kernel name -> schedule; None: defaults


class CudaBackend:
    name = "cuda"

    def render(self, program: Program, threads: int = 1, schedules: Schedules = None) -> str:
        return render_program(program, CUDA, schedules).source

    def compile(self, program: Program, threads: int = 1, schedules: Schedules = None):
        from .runtime import CudaExecutable

        return CudaExecutable(program, schedules)
