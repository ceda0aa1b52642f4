"""Schedule tuning: each kernel's schedules, from its target's schedule space, chosen by the search
(eclat.autotune.search) and remembered in the tuning database under one key for every target
(kernel_key, with the target name, eclat's source version and the device fingerprint), so that a
second compile of the same model reads its schedules instead of timing them.

"fast" tunes the kernels the target says are worth it over the first FAST_SCHEDULES of their
space; "full" tunes every kernel over its whole space. How a schedule is timed is the target's
(`Target.schedule_trials`): the CPU times the kernel alone on random inputs, a GPU builds every
schedule at once and times each copy with the device's timer.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np

from ..autotune.progress import progress
from .kernel import Kernel, Program, loads

FAST_SCHEDULES = 6  # schedules timed at most per kernel in "fast" mode, the default first
ROUNDS = 3  # turns at timing each candidate, at both levels (kernels and programs)


def kernel_key(kernel: Kernel, program: Program) -> str:
    """A hash of the kernel's structure with its buffers named by order of use and role, and its
    reduction variables by order of appearance: the same layer repeated shares one entry."""
    names: dict[str, str] = {}
    for x in loads(kernel.body):
        buf = program.buffers[x.buffer]
        names.setdefault(x.buffer, f"b{len(names)}{'w' if buf.role == 'weight' else ''}{buf.format or ''}")
    text = re.sub(r"buffer='([^']*)'", lambda m: f"buffer={names.get(m.group(1), '?')}", str(kernel.body))
    variables: dict[str, str] = {}
    text = re.sub(r"\br\d+\b", lambda m: variables.setdefault(m.group(0), f"r{len(variables)}"), text)
    return hashlib.sha256(f"{kernel.shape}|{text}".encode()).hexdigest()[:24]


def tuning_key(what: str, shapes: Any, dtype: Any, target: str, device: Any) -> Any:
    """The database key of anything the search chooses: what (a kernel_key, a program's hash), its
    shapes and dtype, the target with eclat's source version, and the device's fingerprint."""
    from ..autotune.cache import versioned
    from ..autotune.db import TuningKey

    return TuningKey.make(what, shapes, dtype, versioned(target), device.fingerprint)


def tune(program: Program, target: Any, device: Any, db: Any, mode: str, threads: int,
         inputs: list[np.ndarray], quiet: bool | None = True) -> dict[str, int]:
    """Set each kernel's schedule from the database or by the search; returns counts.
    quiet: no progress bar (None: a bar on a terminal)."""
    from ..autotune.search import Candidate, TuningError, search

    trials = None  # built on first need: a GPU builds every kernel's schedules at once
    tuned = 0
    for kernel in progress(program.kernels, desc="tuning", quiet=quiet, unit="kernel"):
        if not target.tunes(kernel, mode):
            continue
        space = target.schedule_space(kernel, threads, program.weight_names)
        if len(space) < 2:
            continue
        key = tuning_key(kernel_key(kernel, program), kernel.shape, kernel.body.dtype, target.name, device) \
            if db is not None and device is not None else None
        timers: dict[int, Any] = {}

        def time_fn(c: Candidate, kernel: Kernel = kernel, timers: dict = timers) -> float:
            nonlocal trials
            if id(c) not in timers:  # built once, timed in every round
                trials = trials or target.schedule_trials(program, threads, inputs)
                timers[id(c)] = trials(kernel, c.payload)
            return timers[id(c)]()

        cands = [Candidate(target.schedule_json(s), 0.0, s) for s in space]
        try:
            found = search(cands, time_fn=time_fn, mode=mode, db=db, key=key, rounds=ROUNDS, quiet=True,
                           limit=FAST_SCHEDULES if mode == "fast" else None, desc=kernel.name)
        except TuningError:  # no schedule ran: the default stays
            continue
        kernel.schedule = found.winner.payload
        tuned += found.source == "search"
    return {"tuned": tuned}
