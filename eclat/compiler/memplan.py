"""Memory planning: temporaries share one arena when their lifetimes do not overlap.

A temporary lives from the kernel that writes it to the last kernel that reads it
(inclusive at both ends, so a kernel never writes over its own inputs). Placement is
greedy first-fit, largest buffers first, each offset aligned to 64 bytes. Views never
copy, so they never appear here: only buffers do. A buffer may lie inside another (`aliases`:
the parts of a concatenation its writers write in place, `elided_concatenations`): it is not
placed, and the buffer holding it lives from the first write of any of its parts. A part of an
output lies in the caller's array (`MemoryPlan.within`), not in the arena.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace

from ..ir.symbolic import evaluate, ranges, variables
from ..ir.view import contiguous_strides
from .kernel import Kernel, Load, Op, Program, axis_vars, loads

ALIGN = 64


@dataclass
class MemoryPlan:
    offsets: dict[str, int]  # temp buffer -> byte offset in the arena
    arena_bytes: int
    naive_bytes: int  # what one buffer per temporary would need
    within: dict[str, tuple[str, int]] = field(default_factory=dict)  # part -> (output, byte offset)


def plan_memory(program: Program, aliases: dict[str, tuple[str, int]] | None = None) -> MemoryPlan:
    """aliases: buffer -> (the buffer it lies in, byte offset there)."""
    aliases = aliases or {}
    within = {name: at for name, at in aliases.items() if program.buffers[at[0]].role != "temp"}
    live: dict[str, list[int]] = {}
    for t, k in enumerate(program.kernels):
        for name in {x.buffer for x in loads(k.body)} | {k.out} | {s.out for s in k.sides} | \
                {k.scratch} - {None}:
            if program.buffers[name].role == "temp" and name not in within:
                span = live.setdefault(aliases.get(name, (name,))[0], [t, t])
                span[0], span[1] = min(span[0], t), max(span[1], t)
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
    offsets: dict[str, int] = {}
    for name in sorted(live, key=lambda n: -program.buffers[n].nbytes):
        start, end = live[name]
        size = _align(max(program.buffers[name].nbytes, 1))
        offset = _lowest_gap(sorted((o, z) for s, e, o, z in placed if not (e < start or end < s)), size)
        placed.append((start, end, offset, size))
        offsets[name] = offset
    offsets.update({name: offsets[into] + at for name, (into, at) in aliases.items() if into in offsets})
    arena = max((o + z for _, _, o, z in placed), default=0)
    naive = sum(_align(max(program.buffers[n].nbytes, 1)) for n in live)
    return MemoryPlan(offsets, arena, naive, within)


def _lowest_gap(taken: list[tuple[int, int]], size: int) -> int:
    """The lowest offset, 0 or the aligned end of a taken range, where size bytes overlap none of
    taken ((offset, size), sorted by offset): one sweep, not every end tried against every range
    (a 100-step recurrence's thousand buffers took seconds)."""
    at = 0
    for o, z in taken:
        if at + size <= o:
            break
        at = max(at, _align(o + z))
    return at


def elided_concatenations(program: Program) -> tuple[Program, dict[str, tuple[str, int]]]:
    """program with each kernel that only concatenates buffers along its first axis emptied, and
    where each of those buffers lies in the concatenation's (name -> (buffer, byte offset)): their
    writers write the concatenation in place (squeezenet's fire modules: a copy of 128 x 3025
    values each, 90 us; an LSTM's outputs, the steps' h stacked: 156 of 1463 us over 100 steps). A
    part must be a temporary that one kernel writes and only the concatenation reads; the
    concatenation, a temporary or an output."""
    writers = Counter([k.out for k in program.kernels] + [s.out for k in program.kernels for s in k.sides])
    readers: dict[str, set[int]] = {}
    for j, k in enumerate(program.kernels):
        for x in loads(k.body):
            readers.setdefault(x.buffer, set()).add(j)
    kernels, aliases = list(program.kernels), {}
    for j, k in enumerate(kernels):
        parts = _concatenated_parts(k, program.buffers) if program.buffers[k.out].role in ("temp", "output") \
            else None
        if not parts or k.out in aliases:
            continue
        if any(program.buffers[b].role != "temp" or writers[b] != 1 or readers.get(b) != {j} or b in aliases
               for _, b in parts):
            continue
        size = program.buffers[k.out].dtype.itemsize
        aliases.update({b: (k.out, start * size) for start, b in parts})
        kernels[j] = replace(k, shape=(0,) + tuple(k.shape[1:]))
    return replace(program, kernels=kernels), aliases


def _concatenated_parts(k: Kernel, buffers: dict) -> list[tuple[int, str]] | None:
    """(first flat element, buffer) of each part when k's body is a sum of loads, each reading a
    whole buffer of its dtype as a run of k's rows (its first axis), the runs covering every row."""
    shape = k.shape
    if not shape or any(not isinstance(n, int) for n in shape) or k.sides:
        return None
    terms, stack = [], [k.body]
    while stack:
        x = stack.pop()
        if isinstance(x, Op) and x.op == "add":
            stack.extend(x.srcs)
        elif isinstance(x, Load) and x.dtype is k.body.dtype:
            terms.append(x)
        else:
            return None
    inner = math.prod(shape[1:])
    names = [v.name for v in axis_vars(shape)]
    flat = lambda at: sum(a * s for a, s in zip(at, contiguous_strides(shape)))  # noqa: E731
    parts, covered = [], 0
    # in the order of their rows, as their masks bound them (a part of one row: its index names none)
    for t in sorted(terms, key=lambda t: ranges(t.valid).get(names[0], (0,))[0]):
        b = buffers[t.buffer]
        if b.dtype is not k.body.dtype or b.numel % inner or variables(t.valid) - {names[0]} \
                or variables(t.index) - set(names):
            return None
        first, rows = covered, b.numel // inner
        probes = [[first] + [0] * (len(shape) - 1), [first + rows - 1, *(n - 1 for n in shape[1:])]]
        probes += [[first + (d == 0)] + [int(e == d) for e in range(1, len(shape))]
                   for d, n in enumerate((rows, *shape[1:])) if n > 1]  # a step along each axis
        if any(evaluate(t.index, dict(zip(names, at))) != flat(at) - first * inner for at in probes):
            return None
        inside = lambda r, valid=t.valid: bool(evaluate(valid, {names[0]: r}))  # noqa: E731
        if not (inside(first) and inside(first + rows - 1)) or (first and inside(first - 1)) \
                or (first + rows < shape[0] and inside(first + rows)):
            return None
        parts.append((first * inner, t.buffer))
        covered += rows
    return parts if covered == shape[0] and len(parts) > 1 else None


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
