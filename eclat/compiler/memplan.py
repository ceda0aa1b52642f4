"""Memory planning: temporaries share one arena when their lifetimes do not overlap.

A temporary lives from the kernel that writes it to the last kernel that reads it
(inclusive at both ends, so a kernel never writes over its own inputs). Placement is
greedy first-fit, largest buffers first, each offset aligned to 64 bytes. Views never
copy, so they never appear here: only buffers do.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernel import Program, loads

ALIGN = 64


@dataclass
class MemoryPlan:
    offsets: dict[str, int]  # temp buffer -> byte offset in the arena
    arena_bytes: int
    naive_bytes: int  # what one buffer per temporary would need


def plan_memory(program: Program) -> MemoryPlan:
    live: dict[str, list[int]] = {}
    for t, k in enumerate(program.kernels):
        for name in {x.buffer for x in loads(k.body)} | {k.out} | {s.out for s in k.sides}:
            if program.buffers[name].role == "temp":
                span = live.setdefault(name, [t, t])
                span[0], span[1] = min(span[0], t), max(span[1], t)
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
    offsets: dict[str, int] = {}
    for name in sorted(live, key=lambda n: -program.buffers[n].nbytes):
        start, end = live[name]
        size = _align(max(program.buffers[name].nbytes, 1))
        conflicts = [(o, z) for s, e, o, z in placed if not (e < start or end < s)]
        offset = min(c for c in {0} | {_align(o + z) for o, z in conflicts}
                     if all(c + size <= o or o + z <= c for o, z in conflicts))
        placed.append((start, end, offset, size))
        offsets[name] = offset
    arena = max((o + z for _, _, o, z in placed), default=0)
    naive = sum(_align(max(program.buffers[n].nbytes, 1)) for n in live)
    return MemoryPlan(offsets, arena, naive)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
