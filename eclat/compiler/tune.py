"""Schedule tuning: time a kernel's schedule space on the device, keep the fastest in the
tuning database (keyed by kernel structure, shape, dtype, backend with eclat's source version,
and device fingerprint), so that a second compile of the same model reads its schedules
instead of searching.

"fast" tunes contraction kernels over the first FAST_SCHEDULES of their space; "full"
tunes every kernel over its whole space. Each kernel is timed alone, in a program of
its own whose inputs are random, so a schedule is judged on the kernel and nothing else;
its schedules are timed in turns, so that drift in a shared machine's speed does not pick one.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import numpy as np

from .kernel import Buffer, Kernel, Program, Schedule, as_contraction, loads, schedule_space

FAST_SCHEDULES = 6
TUNE_ROUNDS = 3  # turns at timing each schedule of a kernel


def kernel_key(kernel: Kernel, program: Program) -> str:
    """A hash of the kernel's structure with its buffers named by order of use and role, and its
    reduction variables by order of appearance: the same layer repeated shares one entry."""
    names: dict[str, str] = {}
    for x in loads(kernel.body):
        buf = program.buffers[x.buffer]
        names.setdefault(x.buffer, f"b{len(names)}{'w' if buf.role == 'weight' else ''}")
    text = re.sub(r"buffer='([^']*)'", lambda m: f"buffer={names.get(m.group(1), '?')}", str(kernel.body))
    variables: dict[str, str] = {}
    text = re.sub(r"\br\d+\b", lambda m: variables.setdefault(m.group(0), f"r{len(variables)}"), text)
    return hashlib.sha256(f"{kernel.shape}|{text}".encode()).hexdigest()[:24]


def isolate(program: Program, kernel: Kernel) -> Program:
    """A program running only kernel: what it reads becomes inputs (weights stay weights)."""
    read = sorted({x.buffer for x in loads(kernel.body)} - {kernel.out})
    buffers: dict[str, Buffer] = {}
    for name in read:
        b = program.buffers[name]
        buffers[name] = b if b.role == "weight" else replace(b, role="input", data=None)
    out = program.buffers[kernel.out]
    buffers[kernel.out] = replace(out, role="output", data=None)
    ins = [n for n in read if buffers[n].role == "input"]
    return Program(buffers, [kernel], ins, [kernel.out], [(buffers[n].numel,) for n in ins],
                   [(out.numel,)])


def _schedule_from(d: dict[str, Any]) -> Schedule:
    names = {f.name for f in fields(Schedule)}
    return Schedule(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


def _random(buf: Buffer, rng: np.random.Generator) -> np.ndarray:
    if buf.dtype.is_float:
        return rng.standard_normal(buf.numel).astype(buf.dtype.np)
    return np.zeros(buf.numel, buf.dtype.np)  # indices: row 0 is always in range


def tune(program: Program, backend: Any, device: Any, db: Any, mode: str, threads: int,
         quiet: bool | None = True) -> dict[str, int]:
    """Set each kernel's schedule from the database or by timing; returns counts.
    quiet: no progress bar (None: a bar on a terminal)."""
    from ..autotune.progress import progress

    rng = np.random.default_rng(0)
    tuned = 0
    for kernel in progress(program.kernels, desc="tuning", quiet=quiet, unit="kernel"):
        if mode == "fast" and as_contraction(kernel) is None:
            continue
        space = schedule_space(kernel, threads)
        space = space[:FAST_SCHEDULES] if mode == "fast" else space
        if len(space) < 2:
            continue
        key = None
        if db is not None and device is not None:
            from ..autotune import TuningKey
            from ..autotune.cache import versioned

            key = TuningKey.make(kernel_key(kernel, program), kernel.shape, kernel.body.dtype,
                                 versioned(backend.name), device.fingerprint)
            entry = db.get(key)
            if entry is not None and (mode != "full" or entry.meta.get("mode") == "full"):
                kernel.schedule = _schedule_from(entry.schedule)
                continue
        sub = isolate(program, kernel)
        inputs = [_random(sub.buffers[n], rng) for n in sub.inputs]
        best = _fastest(sub, kernel, space, backend, threads, inputs)
        if best is None:
            kernel.schedule = space[0]
            continue
        kernel.schedule = best[1]
        tuned += 1
        if key is not None:
            db.put(key, best[1], best[0], {"mode": mode}, keep_faster=True)
    return {"tuned": tuned}


def _fastest(sub: Program, kernel: Kernel, space: list[Schedule], backend: Any, threads: int,
             inputs: list[np.ndarray]) -> tuple[float, Schedule] | None:
    """(us, schedule) of the fastest schedule in space for kernel, alone in sub: the builds timed
    in turns, each keeping its best."""
    built = []
    for s in space:
        kernel.schedule = s
        try:
            built.append((s, backend.compile(sub, threads)))
        except Exception:  # a schedule that fails to build is simply not a candidate
            continue
    times = in_turns([lambda exe=exe: min(exe.profile(inputs, 1)) for _, exe in built], combine=min)
    ran = [(us, s) for us, (s, _) in zip(times, built) if us is not None]  # nor is one that fails to run
    return min(ran, key=lambda r: r[0]) if ran else None


def in_turns(timers: list[Callable[[], float]], rounds: int = TUNE_ROUNDS,
             combine: Callable[[list[float]], float] = min) -> list[float | None]:
    """Each timer's samples taken in turns over rounds, so that a shared machine's slow spell
    falls on all of them alike, combined into one time (None for a timer that raised)."""
    samples: list[list[float] | None] = [[] for _ in timers]
    for _ in range(rounds):
        for j, timer in enumerate(timers):
            if samples[j] is None:
                continue
            try:
                samples[j].append(timer())
            except Exception:
                samples[j] = None
    return [combine(s) if s else None for s in samples]
