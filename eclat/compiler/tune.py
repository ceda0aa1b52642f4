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
# A schedule that derives NEW_COPY_BYTES more of a weight's packed forms than another candidate
# does, forms that nothing held when the compile began (another program of one model holds its own:
# a language model's prefill for its decode), must be this much faster to be chosen. GPT-2's decode
# ran level whichever panel widths its one-row products took (33.1 tok/s at the prefill's widths,
# 33.4 at its own; an AVX-512 Xeon), but timed alone a fresh copy (just written, in cache) beat the
# prefill's (cold) by over 15%, and its own widths held a second copy of most of the weights (0.6 GB).
NEW_COPY_PENALTY = 2.0
NEW_COPY_BYTES = 1 << 20
# A schedule whose build derived at least this many bytes anew is timed its ROUNDS at once and its
# build let go, rather than kept for rounds in turns: a kernel's candidates held one copy each of a
# large weight (GPT-2's output head: 154 MB at each of five panel widths, the compile's peak).
RELEASE_BYTES = 32 << 20


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
    quiet: no progress bar (None: a bar on a terminal). The derived forms held when the compile
    began (compiler.derived.held_before) a schedule reuses at no cost."""
    from ..autotune.search import Candidate, TuningError, search
    from .derived import asked_for, held_before, nbytes

    trials = None  # built on first need: a GPU builds every kernel's schedules at once
    held, weights = held_before(), program.weights
    tuned = 0
    for kernel in progress(program.kernels, desc="tuning", quiet=quiet, unit="kernel"):
        if not target.tunes(kernel, mode):
            continue
        space = target.schedule_space(kernel, threads, weights)
        if len(space) < 2:
            continue
        key = tuning_key(kernel_key(kernel, program), kernel.shape, kernel.body.dtype, target.name, device) \
            if db is not None and device is not None else None
        timers: dict[int, Any] = {}
        new_bytes: dict[int, int] = {}  # id(candidate) -> bytes of the forms its build derived anew

        def time_fn(c: Candidate, kernel: Kernel = kernel, timers: dict = timers,
                    new_bytes: dict = new_bytes) -> float:
            nonlocal trials
            if id(c) not in timers:  # built once, timed in every round
                trials = trials or target.schedule_trials(program, threads, inputs)
                with asked_for() as keys:
                    timer = trials(kernel, c.payload)
                new_bytes[id(c)] = sum(nbytes(k) for k in keys - held)
                if new_bytes[id(c)] >= RELEASE_BYTES:
                    us = sorted(timer() for _ in range(ROUNDS))[ROUNDS // 2]
                    timer = lambda us=us: us  # noqa: E731 - the build and its copies go
                timers[id(c)] = timer
            return timers[id(c)]()

        def penalty(c: Candidate, new_bytes: dict = new_bytes) -> float:
            """NEW_COPY_PENALTY for a candidate that derives NEW_COPY_BYTES more than the one that
            derives least (what every candidate's build makes anew costs none of them more)."""
            extra = new_bytes.get(id(c), 0) - min(new_bytes.values(), default=0)
            return NEW_COPY_PENALTY if extra >= NEW_COPY_BYTES else 1.0

        cands = [Candidate(target.schedule_json(s), 0.0, s) for s in space]
        try:
            found = search(cands, time_fn=time_fn, mode=mode, db=db, key=key, rounds=ROUNDS, quiet=True,
                           limit=FAST_SCHEDULES if mode == "fast" else None, desc=kernel.name,
                           penalty_fn=penalty)
        except TuningError:  # no schedule ran: the default stays
            continue
        kernel.schedule = found.winner.payload
        tuned += found.source == "search"
    return {"tuned": tuned}
