"""CPU backend: kernel IR -> LLVM IR (llvmlite) -> host machine code, one native entry point."""

from __future__ import annotations

from ...compiler.kernel import Program
from ...compiler.memplan import plan_memory


class CpuBackend:
    name = "cpu"

    def render(self, program: Program, threads: int = 1) -> str:
        from .codegen import build_module

        return str(build_module(program, plan_memory(program), threads).ir)

    def compile(self, program: Program, threads: int = 1):
        from .runtime import CpuExecutable

        return CpuExecutable(program, threads)


__all__ = ["CpuBackend"]
