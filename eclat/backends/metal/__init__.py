"""Metal backend: the shared GPU renderer's Metal dialect (MSL), run through PyObjC on macOS.

Off macOS the source is still rendered, and `shim/metal_stdlib` lets a C++ compiler check its
syntax and types (see `check_syntax`)."""

from __future__ import annotations

from ...compiler.kernel import Program
from ..gpu_c import METAL, GpuSchedule, render_program, tune_schedules

Schedules = dict[str, GpuSchedule] | None  # kernel name -> schedule; None: defaults


class MetalBackend:
    name = "metal"

    def render(self, program: Program, threads: int = 1, schedules: Schedules = None) -> str:
        return render_program(program, METAL, schedules).source

    def compile(self, program: Program, threads: int = 1, schedules: Schedules = None):
        from .runtime import MetalExecutable

        return MetalExecutable(program, schedules)

    def tune(self, program: Program, inputs: list, mode: str = "fast", db=None, device: str = ""
             ) -> dict[str, GpuSchedule]:
        """The fastest verified GPU schedule of every kernel (gpu_c.tune_schedules)."""
        from .runtime import MetalExecutable

        return tune_schedules(program, inputs, MetalExecutable, backend=self.name, mode=mode, db=db,
                              device=device)
