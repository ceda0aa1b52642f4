"""Tuning the GPU schedules: every candidate schedule of every kernel as a copy of the kernel
in one program (one build, one run), timed and checked by eclat.autotune.search; and
`GpuBackend`, a GPU target as data (its dialect and runtime class)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from importlib import import_module

import numpy as np

from ...compiler.kernel import Buffer, Kernel, Program
from .dialects import Dialect
from .emit import render_program
from .schedules import GpuSchedule, gpu_schedule_space


@dataclass(frozen=True)
class Variant:
    kernel: str  # the original kernel
    name: str  # its copy
    out: str  # the copy's output buffer
    schedule: GpuSchedule


def with_variants(program: Program, spaces: dict[str, list[GpuSchedule]]
                  ) -> tuple[Program, dict[str, GpuSchedule], list[Variant]]:
    """program plus one copy of each kernel per schedule in spaces[kernel], each copy writing an
    output of its own after the original kernels ran: one build compiles every candidate, one
    run checks them all."""
    buffers, kernels = dict(program.buffers), list(program.kernels)
    outputs, shapes = list(program.outputs), list(program.output_shapes)
    chosen: dict[str, GpuSchedule] = {}
    variants: list[Variant] = []
    for k in program.kernels:
        for j, s in enumerate(spaces.get(k.name, ())):
            v = Variant(k.name, f"{k.name}_v{j}", f"{k.out}_v{j}", s)
            buffers[v.out] = Buffer(v.out, k.numel, program.buffers[k.out].dtype, "output")
            kernels.append(replace(k, name=v.name, out=v.out))
            chosen[v.name] = s
            outputs.append(v.out)
            shapes.append(k.shape)
            variants.append(v)
    program = replace(program, buffers=buffers, kernels=kernels, outputs=outputs, output_shapes=shapes)
    return program, chosen, variants


def kernel_key(kernel: Kernel) -> str:
    """A hash of what the kernel computes (its shape and expression), for the tuning database."""
    return hashlib.sha256(repr((kernel.shape, kernel.body)).encode()).hexdigest()[:24]


def tune_schedules(program: Program, inputs: list[np.ndarray], make, *, backend: str, mode: str = "fast",
                   db=None, device: str = "", quiet: bool | None = True) -> dict[str, GpuSchedule]:
    """The fastest verified schedule of every kernel, by eclat.autotune.search over
    gpu_schedule_space. make(program, schedules) returns an executable with run(inputs) and
    time_kernel(name) -> seconds. A candidate counts as correct when its output equals (to
    1e-4) that of the default schedule, which the caller verifies against the reference."""
    from ...autotune.cache import versioned
    from ...autotune.db import TuningKey
    from ...autotune.search import Candidate, search

    spaces = {k.name: gpu_schedule_space(k) for k in program.kernels if k.numel}
    prog, chosen, variants = with_variants(program, spaces)
    exe = make(prog, chosen)
    outs = dict(zip(prog.outputs, exe.run(inputs)))
    result: dict[str, GpuSchedule] = {}
    for k in program.kernels:
        mine = [v for v in variants if v.kernel == k.name]
        if not mine:
            continue
        default = outs[mine[0].out]
        cands = [Candidate(v.schedule, 0.0, v) for v in mine]  # one roofline for all: default first
        key = None if db is None else TuningKey.make(kernel_key(k), k.shape, k.body.dtype, versioned(backend),
                                                     device)
        found = search(cands, time_fn=lambda c: exe.time_kernel(c.payload.name) * 1e6,
                       check_fn=lambda c, d=default: bool(np.allclose(outs[c.payload.out], d, rtol=1e-4,
                                                                      atol=1e-5, equal_nan=True)),
                       mode=mode, db=db, key=key, quiet=quiet, desc=k.name)
        result[k.name] = found.winner.schedule
    return result


class GpuBackend:
    """A GPU target is data: its dialect and the runtime class that launches its kernels
    ("module:Class", imported on first use: pyopencl, pycuda and PyObjC are optional)."""

    name: str
    dialect: Dialect
    runtime: str

    def executable(self) -> type:
        module, _, cls = self.runtime.partition(":")
        return getattr(import_module(module), cls)

    def render(self, program: Program, threads: int = 1,
               schedules: dict[str, GpuSchedule] | None = None) -> str:
        return render_program(program, self.dialect, schedules).source

    def compile(self, program: Program, threads: int = 1, schedules: dict[str, GpuSchedule] | None = None):
        return self.executable()(program, schedules)

    def tune(self, program: Program, inputs: list, mode: str = "fast", db=None, device: str = ""
             ) -> dict[str, GpuSchedule]:
        """The fastest verified GPU schedule of every kernel (tune_schedules)."""
        return tune_schedules(program, inputs, self.executable(), backend=self.name, mode=mode, db=db,
                              device=device)


__all__ = ["GpuBackend", "Variant", "kernel_key", "tune_schedules", "with_variants"]
