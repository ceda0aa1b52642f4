"""Where eclat keeps what it measured (device peaks, the tuning database, chosen programs) and
which eclat measured it."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from pathlib import Path

ENV_VAR = "ECLAT_CACHE_DIR"
_compiling_with: ContextVar[str | os.PathLike | None] = ContextVar("eclat_cache_dir", default=None)


@contextmanager
def caching_in(folder: str | os.PathLike | None) -> Iterator[None]:
    """Inside the block, cache_dir() is folder where one is given (a compile's cache_dir= option,
    for what its backend keeps, such as compiled kernels)."""
    token = _compiling_with.set(folder if folder is not None else _compiling_with.get())
    try:
        yield
    finally:
        _compiling_with.reset(token)


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache folder: override if given, else the enclosing compile's (caching_in), else
    $ECLAT_CACHE_DIR, else ~/.cache/eclat (not created here)."""
    override = _compiling_with.get() if override is None else override
    if override is not None:
        return Path(override).expanduser()
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "eclat"


@cache
def source_version() -> str:
    """A hash of eclat's own source files, to the edit: what a cached choice was made by. A
    schedule tuned for one version's code generation says little about another's."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.parent.rglob("*.py")):
        h.update(f.relative_to(Path(__file__).parent.parent).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def versioned(backend: str) -> str:
    """The backend field of a tuning database key: the backend and the eclat that tuned for it."""
    return f"{backend}@{source_version()}"
