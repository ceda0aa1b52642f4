"""Programs per size bucket: one compile with run-time sizes, a program searched for each range.

A program with run-time sizes is searched at the example's sizes. Far from them other schedules
or another candidate can be faster: an encoder searched at 16 tokens ran 512 tokens 1.33x slower
than with the schedules a search at 256 picks. So the compile also searches at the sizes' ends
(`representatives`), and keeps a bucket's program only where it beat the example's at those sizes,
raced by the search. A call runs the program searched nearest its sizes (`SizeBuckets`, by the
ratio of sizes). The least sizes (one token, one row: a common call) may also get a program of
their own with every size a constant (`exact`): the same encoder's ran one token in 16 us against
22 for its program for every size."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir.symbolic import Var, bind_sizes, dims, evaluate, var_list

SPAN = 16  # a representative is at most this many times the example's size, or this many times less
FAR = 4  # ... and at least this many times: nearer, the example's program serves it


@dataclass
class Bucket:
    sizes: dict[str, int]  # the sizes its program was searched at
    executable: Any
    exact: bool = False  # its program runs these sizes alone (each a constant in its code)


class SizeBuckets:
    """An executable of several programs of one model, each searched at other sizes; a call runs the
    one searched nearest its sizes. The first is the example's: its program is the one reported."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = buckets
        main = buckets[0].executable
        self.program, self.plan = main.program, getattr(main, "plan", None)
        self.loaded_from = getattr(main, "loaded_from", None)  # an artifact's: object code or source
        self.reentrant = all(getattr(b.executable, "reentrant", False) for b in buckets)
        # where each size is read off a call's inputs: (input, axis, name), the first of each name
        seen: dict[str, tuple[int, int]] = {}
        for k, shape in enumerate(self.program.input_shapes):
            for axis, d in enumerate(dims(shape)):
                if isinstance(d, Var):
                    seen.setdefault(d.name, (k, axis))
        self._where = [(k, axis, name) for name, (k, axis) in seen.items()]
        # a program for exact sizes runs where every size is read off an input as itself
        self._exact = {tuple(b.sizes.get(name) for _, _, name in self._where): b.executable
                       for b in buckets if b.exact and set(b.sizes) == set(seen)}
        ranged = [b for b in buckets if not b.exact]
        self._logs = [({name: math.log(max(n, 1)) for name, n in b.sizes.items()}, b.executable)
                      for b in ranged]

    def pick(self, inputs: Sequence[Any]) -> Any:
        """The executable for the sizes of inputs: the one for exactly them, else the one searched
        nearest them (by the sum of the sizes' log ratios)."""
        if self._exact:
            exe = self._exact.get(tuple(inputs[k].shape[axis] for k, axis, _ in self._where))
            if exe is not None:
                return exe
        best, nearest = None, math.inf
        for logs, exe in self._logs:
            far = sum(abs(math.log(max(inputs[k].shape[axis], 1)) - logs.get(name, 0.0))
                      for k, axis, name in self._where)
            if far < nearest:
                best, nearest = exe, far
        return best

    def run(self, inputs: list[np.ndarray], wanted: Sequence[int] | None = None) -> list[Any]:
        exe = self.pick(inputs)
        return exe.run(inputs) if wanted is None else exe.run(inputs, wanted)

    def profile(self, inputs: list[np.ndarray], repeats: int = 5) -> list[float]:
        """Each kernel's time alone, of the example's program (what the report describes)."""
        return self.buckets[0].executable.profile(inputs, repeats)


def representatives(input_shapes: list[tuple],
                    arrays: list[np.ndarray]) -> list[tuple[list[np.ndarray], bool]]:
    """Inputs like arrays at the sizes' ends: every run-time size moved down, then up, by up to SPAN
    times (within its bounds), where that is at least FAR times; each with whether it is the least
    sizes a call may have (every size at its lower bound, or 1)."""
    specs = [dims(s) for s in input_shapes]
    env = bind_sizes(specs, [a.shape for a in arrays])
    bounds = {v.name: v for shape in specs for d in shape for v in var_list(d)}
    least = {name: max(v.lo, 1) for name, v in bounds.items()}
    ends = [{name: max(least[name], env[name] // SPAN) for name in bounds},
            {name: min(v.hi, env[name] * SPAN) for name, v in bounds.items()}]
    far = [moved for moved in ends
           if any(max(n, env[name]) >= FAR * max(min(n, env[name]), 1) for name, n in moved.items())]
    out = []
    for moved in far:
        at = inputs_at(specs, arrays, moved)
        if at is not None:
            out.append((at, moved == least))
    return out


def inputs_at(specs: list[tuple], arrays: list[np.ndarray], sizes: dict[str, int]) -> list[np.ndarray] | None:
    """Inputs like arrays (of shapes specs) at sizes, made by cycling their values along the axes
    that change; None when sizes tied by expressions do not fit the move."""
    out = []
    for shape, a in zip(specs, arrays):
        for axis, d in enumerate(shape):
            n = int(evaluate(d, sizes))
            if n != a.shape[axis]:
                a = np.take(a, np.arange(n) % max(a.shape[axis], 1), axis=axis)
        out.append(np.ascontiguousarray(a))
    try:
        bind_sizes(specs, [a.shape for a in out])
    except ValueError:
        return None
    return out


def sizes_of(input_shapes: list[tuple], arrays: list[np.ndarray]) -> dict[str, int]:
    """The run-time sizes of a call with arrays."""
    return bind_sizes([dims(s) for s in input_shapes], [a.shape for a in arrays])


def merge_weights(weights: dict[str, np.ndarray], mine: dict[str, np.ndarray]) -> bool:
    """Add a bucket's weights to those stored (once by name) for every bucket; False, adding none,
    where a name is held with other contents (candidates name what they fold by its contents, so
    never expected: that bucket is then not stored)."""
    if any(name in weights and not (weights[name] is a or np.array_equal(weights[name], a))
           for name, a in mine.items()):
        return False
    weights.update(mine)
    return True
