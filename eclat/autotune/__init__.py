"""Autotuning: device model (measured peaks), roofline pruning, timing, isolation, tuning DB, search.

Submodules are imported on use; the names most callers need are re-exported here lazily.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "cache_dir": "cache",
    "Device": "device", "DeviceError": "device", "get_device": "device", "describe_devices": "device",
    "estimate_us": "roofline", "roofline_share": "roofline", "arithmetic_intensity": "roofline",
    "should_prune": "roofline", "DEFAULT_MARGIN": "roofline",
    "Timing": "measure", "measure": "measure", "run_isolated": "measure", "Outcome": "measure",
    "CandidateFailed": "measure",
    "TuningDB": "db", "TuningKey": "db", "TuningDBError": "db", "merge": "db", "schedule_json": "db",
    "Candidate": "search", "SearchResult": "search", "SearchStats": "search", "TuningError": "search",
    "search": "search", "isolated": "search",
    "progress": "progress",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
