"""Progress bars for long work (saturation, tuning): tqdm on a terminal, silent otherwise."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm


def is_quiet(quiet: bool | None = None) -> bool:
    """quiet=None means: quiet unless stderr is a terminal (so logs and CI stay clean)."""
    if quiet is not None:
        return quiet
    return not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty())


def progress(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "",
             quiet: bool | None = None, unit: str = "it") -> tqdm:
    """A tqdm bar over iterable (or a manual one with total); disabled when quiet."""
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=is_quiet(quiet), leave=False,
                file=sys.stderr, dynamic_ncols=True)
