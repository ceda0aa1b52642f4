"""Where eclat keeps what it measured: device peaks and the tuning database."""

from __future__ import annotations

import os
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
