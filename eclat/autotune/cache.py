"""Where eclat keeps what it measured (device peaks, the tuning database, chosen programs) and
which eclat measured it."""

from __future__ import annotations

import hashlib
import os
from functools import cache
from pathlib import Path

ENV_VAR = "ECLAT_CACHE_DIR"


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The cache folder: override if given, else $ECLAT_CACHE_DIR, else ~/.cache/eclat (not created here)."""
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
