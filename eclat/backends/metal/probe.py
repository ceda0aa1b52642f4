"""Metal devices: not measured yet (the peaks would come from the same kernels in MSL)."""

from __future__ import annotations

import sys
from typing import Any

from ...autotune.device import Device, DeviceError


class MetalProbe:
    def names(self) -> list[str]:
        return []  # measured by the Metal backend on macOS; nothing to list elsewhere

    def identify(self, index: int, threads: int | None) -> dict[str, Any]:
        where = "this is not macOS" if sys.platform != "darwin" else "Metal peaks are not measured yet"
        raise DeviceError(f"cannot model a Metal device: {where}")

    def measure(self, index: int, ident: dict[str, Any]) -> Device:  # pragma: no cover - identify raises
        raise DeviceError("Metal peaks are not measured yet")
