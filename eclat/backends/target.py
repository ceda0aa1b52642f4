"""What a target is: one object holding everything specific to one kind of hardware.

    class MyTarget(Target):
        name = "mine"
        def probe(self) -> DeviceProbe: ...          # names, identify, measure peaks (autotune/device.py)
        def render(self, program, threads) -> str     # the kernel source, for reading
        def compile(self, program, threads) -> Executable
        def save(self, exe) -> Section                  # its part of an artifact
        def load(self, program, native, art) -> Executable

and one line in eclat/backends/__init__.py's TARGETS. The defaults below fit a target that needs no
rewrite rules of its own, one schedule per kernel and a device that is always present.

An Executable has `program` (what it runs) and `run(inputs) -> outputs`: contiguous arrays of the
program's input shapes and dtypes in (the caller validates), fresh arrays out. It may also have
`profile(inputs, repeats) -> [us per kernel]` or `time_kernel(name) -> seconds` (the report's
per-kernel times), `plan` (its memory plan) and `reentrant = True` when calls may overlap; a
reentrant executable's `run(inputs, wanted)` computes only the outputs numbered in `wanted` (the
others None), which `CompiledModel.update_states` asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from ..compiler.kernel import Buffer, Kernel, Program, Schedule

# One trial of a schedule: () -> microseconds of one timed run; raises when the schedule fails to
# build, run or give the right answer.
Timer = Callable[[], float]


class Executable(Protocol):
    program: Program

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]: ...


class DeviceProbe(Protocol):
    """How the autotuner lists, identifies and measures a target's devices (see autotune/device.py)."""

    def names(self) -> list[str]: ...

    def identify(self, index: int, threads: int | None) -> dict[str, Any]: ...

    def measure(self, index: int, ident: dict[str, Any]) -> Any: ...


@dataclass
class Section:
    """A target's part of an artifact: what the manifest records under "native" (JSON), the members
    it adds (name -> bytes, its kernel source among them) and the weights its code reads."""

    native: dict[str, Any]
    files: dict[str, bytes]
    reads: set[str] = field(default_factory=set)


class Target:
    name: str = ""
    source_member: str = ""  # the artifact member holding the kernel source
    # composites it runs as one kernel of their own (compiler.group): "attention", a softmax
    # contracted with values without writing the scores
    fused: frozenset[str] = frozenset()
    # the channels-last programs the search is offered besides each channels-first one: feature maps
    # of at most this many positions computed channels-last (compiler/layout.py); a search short of
    # "full" is offered the first only
    channels_last: tuple[int, ...] = ()
    runtime_sizes: bool = False  # whether its kernels read sizes at run time (dynamic_shapes)

    def rules(self) -> tuple[Any, ...]:
        """Rewrite rule sets (eclat.rewrites.lang.RuleSet) that join the e-graph for this target only."""
        return ()

    def runs_fused(self, kernel: Any) -> bool:
        """Whether a fused kernel (an attention, compiler.group) runs as this target's own code for
        it, not as plain loops: a program with one it would not is not offered to the search, whose
        estimate of it assumes the fused code."""
        return True

    def probe(self) -> DeviceProbe:
        raise NotImplementedError(f"target {self.name!r} has no device probe")

    def missing(self) -> str | None:
        """Why this target's device cannot run programs here; None when it can (or may)."""
        return None

    # --- schedules: how each kernel's loops map onto the hardware ---------------------------------

    def default_schedule(self, kernel: Kernel, threads: int = 1, weights: Mapping[str, Buffer] | None = None
                         ) -> Any:
        """kernel's schedule without tuning; weights: the program's weight buffers by name."""
        return Schedule(threads=threads)

    def schedule_space(self, kernel: Kernel, threads: int = 1, weights: Mapping[str, Buffer] | None = None
                       ) -> list[Any]:
        """The schedules worth timing for kernel, the default first."""
        return [self.default_schedule(kernel, threads, weights)]

    def schedule_from(self, data: dict[str, Any]) -> Any:
        """A schedule back from its JSON form (dataclasses.asdict)."""
        return Schedule.from_json(data)

    def schedule_json(self, schedule: Any) -> dict[str, Any]:
        return asdict(schedule)

    def tunes(self, kernel: Kernel, mode: str) -> bool:
        """Whether kernel's schedules are worth timing in mode ("fast" or "full")."""
        return True

    def schedule_trials(self, program: Program, threads: int, inputs: list[np.ndarray]
                        ) -> Callable[[Kernel, Any], Timer]:
        """(kernel, schedule) -> a Timer of kernel run with schedule (see Timer)."""
        raise NotImplementedError(f"target {self.name!r} cannot time schedules")

    # --- code ----------------------------------------------------------------------------------------

    def render(self, program: Program, threads: int = 1) -> str:
        raise NotImplementedError

    def compile(self, program: Program, threads: int = 1) -> Executable:
        raise NotImplementedError

    def deferred(self, program: Program, reason: str) -> Executable:
        """An executable for a device absent here: saveable, and running it raises reason."""
        raise NotImplementedError(f"target {self.name!r} has no deferred executable")

    # --- artifacts -----------------------------------------------------------------------------------

    def save(self, exe: Any) -> Section:
        raise NotImplementedError(f"saving artifacts for target {self.name!r} is not supported")

    def load(self, program: Program, native: dict[str, Any], art: Any) -> Executable:
        """The executable of an artifact's program (weights attached): art is the open Artifact,
        whose members this target reads with art.read(name, limit)."""
        raise NotImplementedError

    def optional_weights(self, program: Program) -> set[str]:
        """Weights the code never reads directly (e.g. read through a packed copy): an artifact may
        leave out their data."""
        return set()
