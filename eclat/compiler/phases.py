"""Where a compile's time went: `with phase("egraph"): ...` adds the block's seconds to the phase of
that name in the compile that is recording (`recording()`), less the time of the phases nested in
it, so the phases add up to the time they cover. Outside a recording a phase costs a clock read.

Leaving a phase that made and dropped many temporaries (RELEASING) gives their pages back to the
system: glibc keeps freed blocks under its mmap threshold (which grows to 32 MB as large blocks are
freed) on its free lists, so a torch.export or a model's reference run left 0.5-0.9 GB resident that
nothing used, and the next phase's peak stacked on it."""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

_totals: ContextVar[dict[str, float] | None] = ContextVar("eclat_phase_totals", default=None)
_nested: ContextVar[list[float] | None] = ContextVar("eclat_phase_nested", default=None)

RELEASING = frozenset({"lower", "e-graph", "reference", "build"})


def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator returns pages itself
        return None


_trim = _malloc_trim()


def release_free_memory() -> None:
    """Return the allocator's free pages to the system (a few ms; nothing where it is not glibc)."""
    if _trim is not None:
        _trim(0)


@contextmanager
def recording() -> Iterator[dict[str, float]]:
    """The table of seconds per phase for the phases entered inside the block: a fresh one, or the
    enclosing recording's (a compile inside a compile reports into the outer one)."""
    outer = _totals.get()
    if outer is not None:
        yield outer
        return
    totals: dict[str, float] = {}
    token, nested = _totals.set(totals), _nested.set([])
    try:
        yield totals
    finally:
        _totals.reset(token)
        _nested.reset(nested)


@contextmanager
def phase(name: str) -> Iterator[None]:
    totals, stack = _totals.get(), _nested.get()
    if totals is None or stack is None:
        yield
        return
    stack.append(0.0)  # the seconds of phases nested in this one
    start = time.perf_counter()
    try:
        yield
    finally:
        if name in RELEASING:
            release_free_memory()
        spent = time.perf_counter() - start
        inner = stack.pop()
        totals[name] = totals.get(name, 0.0) + spent - inner
        if stack:
            stack[-1] += spent
