"""Where a compile's time went: `with phase("egraph"): ...` adds the block's seconds to the phase of
that name in the compile that is recording (`recording()`), less the time of the phases nested in
it, so the phases add up to the time they cover. Outside a recording a phase costs a clock read."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_totals: ContextVar[dict[str, float] | None] = ContextVar("eclat_phase_totals", default=None)
_nested: ContextVar[list[float] | None] = ContextVar("eclat_phase_nested", default=None)


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
        spent = time.perf_counter() - start
        inner = stack.pop()
        totals[name] = totals.get(name, 0.0) + spent - inner
        if stack:
            stack[-1] += spent
