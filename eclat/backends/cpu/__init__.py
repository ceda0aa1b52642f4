"""CPU target: kernel IR -> LLVM IR (llvmlite) -> host machine code, one native entry point."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...compiler.kernel import Buffer, Kernel, Program, as_attention, as_contraction
from ..target import Section, Target


class CpuTarget(Target):
    name = "cpu"
    source_member = "kernels.ll"
    # attention.py: one pass over the keys, online softmax; contraction.py: a product's windowed
    # operand read in place, each panel copied as it runs (an implicit GEMM, no im2col)
    fused = frozenset({"attention", "windows"})
    # feature maps of 14x14 and 7x7 positions channels-last, and (a "full" search) of 28x28 too:
    # mobile networks gained most from the first, densenet121 at 64x64 from the second (1.11x)
    channels_last = (196, 784)
    runtime_sizes = True  # a SIZES argument every kernel that needs one reads (emitter.py)

    def rules(self) -> tuple[Any, ...]:
        from ...rewrites import winograd
        from .rules import RULES

        return (RULES, winograd.RULES)

    def runs_fused(self, kernel: Kernel) -> bool:
        from . import host
        from .attention_plan import attention_parts

        att = as_attention(kernel)
        return att is None or attention_parts(att, kernel, host.vector_lanes()) is not None

    def probe(self) -> Any:
        from .probe import CpuProbe

        return CpuProbe()

    def default_schedule(self, kernel: Kernel, threads: int = 1, weights: Mapping[str, Buffer] | None = None
                         ) -> Any:
        from .schedules import default_schedule

        return default_schedule(kernel, threads, weights=weights or {}, held_width=_held_width(weights or {}))

    def schedule_space(self, kernel: Kernel, threads: int = 1, weights: Mapping[str, Buffer] | None = None
                       ) -> list[Any]:
        from .schedules import schedule_space

        return schedule_space(kernel, threads, weights=weights or {}, held_width=_held_width(weights or {}))

    def tunes(self, kernel: Kernel, mode: str) -> bool:
        return mode == "full" or as_contraction(kernel) is not None  # "fast": the GEMMs, where tiles matter

    def schedule_trials(self, program: Program, threads: int, inputs: list[np.ndarray]) -> Any:
        from .trials import Trials

        return Trials(program, threads, inputs)

    def render(self, program: Program, threads: int = 1) -> str:
        from .codegen import build_module
        from .runtime import layout, scheduled

        code, plan = layout(scheduled(program, threads))
        return build_module(code, plan, threads).text()

    def compile(self, program: Program, threads: int = 1) -> Any:
        from .runtime import CpuExecutable

        return CpuExecutable(program, threads)

    def save(self, exe: Any) -> Section:
        from .artifact import save

        return save(exe)

    def load(self, program: Program, native: dict[str, Any], art: Any) -> Any:
        from .artifact import load

        return load(program, native, art)

    def optional_weights(self, program: Program) -> set[str]:
        from .codegen import packed_copies

        return packed_copies(program)


def _held_width(weights: Mapping[str, Buffer]) -> Any:
    """schedules.HeldWidth over the program's weights: the packed forms another program holds."""
    from .contraction import held_panel_width

    return functools.partial(held_panel_width, weights)


TARGET = CpuTarget()
__all__ = ["TARGET", "CpuTarget"]
