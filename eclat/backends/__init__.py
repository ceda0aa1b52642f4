"""The target registry: one line per kind of hardware, naming the `Target` object in its package.

Everything specific to a target (its rewrite rules, device probe, schedules, renderer, runtime and
artifact section) lives in that object's package; the driver, the rewrites, the autotuner, the
artifact format and the CLI only ever look a target up here. See docs/ARCHITECTURE.md for the
recipe to add one.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

from ..errors import EclatError

if TYPE_CHECKING:
    from .target import Target

# target kind -> "module:attribute" of its Target, imported on first use (pyopencl, pycuda, PyObjC
# and llvmlite are only needed by the target that uses them)
TARGETS: dict[str, str] = {
    "cpu": "eclat.backends.cpu:TARGET",
    "opencl": "eclat.backends.opencl:TARGET",
    "cuda": "eclat.backends.cuda:TARGET",
    "metal": "eclat.backends.metal:TARGET",
}
_loaded: dict[str, Target] = {}


def register(kind: str, target: str | Target) -> None:
    """Add (or replace) a target: its "module:attribute" path, or the Target itself."""
    _loaded.pop(kind, None)
    if isinstance(target, str):
        TARGETS[kind] = target
    else:
        TARGETS[kind] = f"{type(target).__module__}:<registered>"
        _loaded[kind] = target


def unregister(kind: str) -> None:
    TARGETS.pop(kind, None)
    _loaded.pop(kind, None)


def target_names() -> tuple[str, ...]:
    return tuple(TARGETS)


def get_target(target: str) -> Target:
    """The Target of "kind" or "kind:N" (N: a device index, read by the device probe)."""
    kind = target.partition(":")[0]
    if kind not in TARGETS:
        raise EclatError(f"no backend for target {target!r}: available {', '.join(TARGETS)}")
    if kind not in _loaded:
        module, _, name = TARGETS[kind].partition(":")
        _loaded[kind] = getattr(import_module(module), name)
    return _loaded[kind]
