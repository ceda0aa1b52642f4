"""Fixtures shared by test modules."""

from __future__ import annotations

import os
import tempfile

import pytest

from eclat.compiler import pipeline

_PROGRAMS = pipeline._programs


@pytest.fixture(autouse=True, scope="session")
def own_program_cache():
    """The suite never reads programs a user's earlier compiles left in ~/.cache/eclat: a test that
    checks what a compile emits would pass or fail by what happened to be cached."""
    before = os.environ.get("ECLAT_CACHE_DIR")
    with tempfile.TemporaryDirectory() as folder:
        os.environ["ECLAT_CACHE_DIR"] = folder
        yield
    if before is None:
        del os.environ["ECLAT_CACHE_DIR"]
    else:
        os.environ["ECLAT_CACHE_DIR"] = before


@pytest.fixture
def one_grouping(monkeypatch):
    """Compiles group each candidate only with the target's fused kernels (attention in one kernel),
    channels-first: the search no longer also times the separate-kernel grouping or a channels-last
    one, so a compile with k=1 has one program to choose, for tests that need the same program
    every time."""
    monkeypatch.setattr(pipeline, "_programs", lambda *args, **kw: _PROGRAMS(
        *args[:5], fused=True, shapes=kw.get("shapes"), layout=0))
