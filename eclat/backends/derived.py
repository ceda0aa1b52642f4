"""Arrays a backend derives from a weight (its packed forms), remembered while the weight lives:
the candidates of one compile, its tuning builds and its schedule variants share their weights,
and packing a large one (a language model's output head) costs seconds."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

_DERIVED: dict[tuple, Any] = {}


def derived(data: np.ndarray, key: Hashable, make: Callable[[], Any]) -> Any:
    """make(), computed once per (the array data views, key) while that array lives."""
    base = data
    while isinstance(base.base, np.ndarray):  # a view made afresh per candidate: key on what it views
        base = base.base
    full = (id(base), data.__array_interface__["data"][0], data.shape, data.dtype.str, key)
    if full not in _DERIVED:
        _DERIVED[full] = make()
        weakref.finalize(base, _DERIVED.pop, full, None)  # forgotten with the weight
    return _DERIVED[full]


__all__ = ["derived"]
