"""A GPU target is data: a dialect of the shared C-like renderer, the runtime class that launches
its kernels, its device probe, the reason its device is missing and the check of which kernels
cannot launch (each "module:name", imported on first use: pyopencl, pycuda and PyObjC are optional)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from importlib import import_module
from typing import Any

import numpy as np

from ...compiler.kernel import Buffer, Kernel, Program
from ...compiler.verify import agrees
from ...errors import EclatError
from ..target import Section, Target, Timer
from .dialects import Dialect
from .emit import render_program
from .packing import pack_weights, packed_reads
from .schedules import GpuSchedule, default_gpu_schedule, gpu_schedule_space, tf32_tolerance, uses_tf32

TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # a schedule computes what the default one does, to this
# (a TF32 schedule, allowed by the user, to schedules.tf32_tolerance: its operands keep 10 mantissa bits)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(import_module(module), name)


def schedules_of(program: Program) -> dict[str, GpuSchedule]:
    """The GPU schedules the program's kernels carry (others run with the default)."""
    return {k.name: k.schedule for k in program.kernels if isinstance(k.schedule, GpuSchedule)}


class GpuTarget(Target):
    fused = frozenset({"attention"})  # the attention strategy (gpu/emit.py)

    def __init__(self, name: str, dialect: Dialect, runtime: str, probe: str, source_member: str,
                 missing: str | None = None, launch_check: str | None = None):
        """runtime: "module:Class" of the executable, Class(program, schedules); probe: "module:Class"
        of the device probe; missing: "module:function" saying why the device cannot run here (None:
        it always may); launch_check: "module:function" (source, {kernel: block size}) -> {kernel:
        why it cannot launch}, from the device compiler's resource report (None: no such check)."""
        self.name, self.dialect, self.source_member = name, dialect, source_member
        self.runtime, self.probe_class, self.missing_reason = runtime, probe, missing
        self.launch_check = launch_check

    def rules(self) -> tuple[Any, ...]:
        from .rules import RULES

        return (RULES,)

    def probe(self) -> Any:
        return _load(self.probe_class)()

    def missing(self) -> str | None:
        return _load(self.missing_reason)() if self.missing_reason else None

    def default_schedule(self, kernel: Kernel, threads: int = 1,
                         weights: Mapping[str, Buffer] | None = None) -> GpuSchedule:
        return default_gpu_schedule(kernel, self.dialect)

    def schedule_space(self, kernel: Kernel, threads: int = 1,
                       weights: Mapping[str, Buffer] | None = None) -> list[GpuSchedule]:
        return gpu_schedule_space(kernel, self.dialect) if kernel.numel else []

    def schedule_from(self, data: dict[str, Any]) -> GpuSchedule:
        return GpuSchedule(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

    def schedule_trials(self, program: Program, threads: int, inputs: list[np.ndarray]) -> Any:
        return _Variants(self, program, inputs)

    def render(self, program: Program, threads: int = 1) -> str:
        return render_program(pack_weights(program), self.dialect, schedules_of(program)).source

    def compile(self, program: Program, threads: int = 1) -> Any:
        return _load(self.runtime)(pack_weights(program), schedules_of(program), self.dialect)

    def deferred(self, program: Program, reason: str) -> Any:
        return DeferredExecutable(pack_weights(program), self.dialect.name, reason, schedules_of(program))

    def launchable(self, program: Program, spaces: dict[str, list[GpuSchedule]]
                   ) -> tuple[dict[str, list[GpuSchedule]], dict[tuple[str, GpuSchedule], str]]:
        """spaces without the schedules whose kernel the device cannot launch (registers, shared
        memory), checked by compiling them all once; and those pruned, each with why."""
        if self.launch_check is None:
            return spaces, {}
        variants, chosen, copies = with_variants(program, spaces)
        rendered = render_program(pack_weights(variants), self.dialect, chosen)
        refused = _load(self.launch_check)(rendered.source, {k.name: k.threads for k in rendered.kernels})
        pruned = {(v.kernel, v.schedule): refused[v.name] for v in copies if v.name in refused}
        kept = {name: [s for s in space if (name, s) not in pruned] for name, space in spaces.items()}
        return kept, pruned

    def optional_weights(self, program: Program) -> set[str]:
        return packed_reads(program)

    def save(self, exe: Any) -> Section:
        from .artifact import save

        return save(self, exe)

    def load(self, program: Program, native: dict[str, Any], art: Any) -> Any:
        from .artifact import load

        return load(self, program, native, art)


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
    run checks them all. Also returns each copy's schedule by name."""
    buffers, kernels = dict(program.buffers), list(program.kernels)
    outputs, shapes = list(program.outputs), list(program.output_shapes)
    chosen: dict[str, GpuSchedule] = {}
    variants: list[Variant] = []
    for k in program.kernels:
        for j, s in enumerate(spaces.get(k.name, ())):
            v = Variant(k.name, f"{k.name}_v{j}", f"{k.out}_v{j}", s)
            buffers[v.out] = Buffer(v.out, k.numel, program.buffers[k.out].dtype, "output")
            kernels.append(replace(k, name=v.name, out=v.out, schedule=s))
            chosen[v.name] = s
            outputs.append(v.out)
            shapes.append(k.shape)
            variants.append(v)
    program = replace(program, buffers=buffers, kernels=kernels, outputs=outputs, output_shapes=shapes)
    return program, chosen, variants


class _Variants:
    """(kernel, schedule) -> a timer of that schedule's copy: every schedule of every kernel built
    in one program (with_variants) and run once, each copy checked against the kernel's default
    schedule, then timed alone by the device's timer."""

    def __init__(self, target: GpuTarget, program: Program, inputs: list[np.ndarray]):
        spaces = {k.name: target.schedule_space(k) for k in program.kernels}
        spaces, self.pruned = target.launchable(program, spaces)
        variants, _, copies = with_variants(program, spaces)
        self.exe = target.compile(variants)
        outs = dict(zip(variants.outputs, self.exe.run(inputs)))
        self.copies = {(v.kernel, v.schedule): (v.name, outs[v.out]) for v in copies}
        self.defaults = {v.kernel: outs[v.out] for v in reversed(copies)}  # each kernel's first: its default
        self.dtypes = {k.name: program.buffers[k.out].dtype for k in program.kernels}

    def __call__(self, kernel: Kernel, schedule: GpuSchedule) -> Timer:
        if (kernel.name, schedule) not in self.copies:
            raise EclatError(f"schedule {schedule} is not in the space of kernel {kernel.name}")
        name, out = self.copies[(kernel.name, schedule)]
        tolerance = tf32_tolerance(kernel) if uses_tf32(kernel, schedule) else TOLERANCE
        if not agrees(out, self.defaults[kernel.name], self.dtypes[kernel.name], **tolerance):
            raise EclatError(f"schedule {schedule} of kernel {kernel.name} computes another result")
        return lambda: self.exe.time_kernel(name) * 1e6


class DeferredExecutable:
    """A GPU program rendered for a device absent here: it can be saved as an artifact (source,
    schedules, launch sizes); running it raises why it cannot run."""

    def __init__(self, program: Program, dialect: str, reason: str, schedules: dict | None = None):
        self.program, self.reason = program, reason
        self.rendered = render_program(program, dialect, schedules)
        self.loaded_from = "source"

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        raise EclatError(f"cannot run this {self.rendered.dialect} program here: {self.reason}")
