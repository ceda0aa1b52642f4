"""Fixtures shared by test modules."""

from __future__ import annotations

import pytest

from eclat.compiler import pipeline

_PROGRAMS = pipeline._programs


@pytest.fixture
def one_grouping(monkeypatch):
    """Compiles group each candidate only with the target's fused kernels (attention in one kernel):
    the search no longer also times the separate-kernel grouping, so a compile with k=1 has one
    program to choose, for tests that need the same program every time."""
    monkeypatch.setattr(pipeline, "_programs",
                        lambda *args, **kw: _PROGRAMS(*args[:5], fused=True, shapes=kw.get("shapes")))
