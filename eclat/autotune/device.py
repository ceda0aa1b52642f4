"""Device model: measured peak FLOP/s, memory bandwidth and launch overhead of a target.

Peaks are measured once by micro-benchmarks (an FMA-throughput kernel, a streaming triad
over buffers larger than the last-level cache, an empty call) and cached as JSON under
<cache_dir>/devices/ keyed by a fingerprint of the hardware, so a later compile reads them.

    dev = get_device("cpu", threads=2)        # or "opencl", "opencl:1", "cuda", "cuda:0"
    dev.peak_gflops["float32"], dev.peak_gbps, dev.launch_overhead_us

Each target's probe (its `Target.probe()`, in its backend package) lists, identifies and
measures its devices; this module keeps what they share: the Device record, the cache, the
calibration of a benchmark's length.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import EclatError
from .cache import cache_dir as _cache_dir

CACHE_SCHEMA = 1
FMA_ACCUMULATORS = 12  # independent FMA chains: enough to cover latency x issue width on x86 and GPUs
FMA_SECONDS = 0.05  # target duration of one FMA run after calibration
STREAM_BYTES = 32 << 20  # per array (96 MB in all, 3x this VM's L3): one thread's triad measured the same
# from 64 MB to 1.9 GB per array on a server with 480 MB of shared L3 (within 4%), and on a KVM VM with
# 32 MB of L3 the same at 32 and 64 MB (within its noise), where touching the larger arrays made a
# first compile's device probe take 1.3 s, not 0.35
REPEATS = 3  # best of REPEATS for each benchmark: other processes only ever make a run slower


class DeviceError(EclatError):
    """A target device is missing, unknown, or could not be measured."""


@dataclass(frozen=True)
class Device:
    """One target device with its measured roofline parameters."""

    name: str
    kind: str  # the target kind ("cpu", "opencl", ...)
    fingerprint: str  # stable hash of what decides performance (model, features, threads, driver)
    peak_gflops: dict[str, float]  # by dtype name ("float32"); measured, not the data-sheet figure
    peak_gbps: float  # streaming triad bandwidth, GB/s (1e9 bytes)
    launch_overhead_us: float  # cost of one call/launch that does nothing
    threads: int  # CPU threads used; GPU compute units / SMs
    info: dict[str, Any] = field(default_factory=dict)  # kind-specific details (features, vector width...)

    def gflops(self, dtype: str = "float32") -> float:
        """Peak GFLOP/s for dtype; dtypes not measured fall back to float32 (an estimate, not a bound)."""
        return self.peak_gflops.get(dtype, self.peak_gflops["float32"])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# targets and cache


def parse_target(target: str) -> tuple[str, int]:
    """'opencl:1' -> ('opencl', 1); 'cpu' -> ('cpu', 0). Raises DeviceError for an unknown kind."""
    from ..backends import target_names

    kind, _, index = target.partition(":")
    if kind not in target_names():
        raise DeviceError(f"unknown target {target!r}: expected one of {', '.join(target_names())} "
                          f"(optionally ':N')")
    if index and not index.isdigit():
        raise DeviceError(f"bad device index in target {target!r}: expected e.g. '{kind}:0'")
    return kind, int(index or 0)


def get_device(target: str = "cpu", threads: int | None = None, cache_dir: str | os.PathLike | None = None,
               remeasure: bool = False) -> Device:
    """The device for target, measured once and then read from the cache.

    threads only applies to the CPU (default: the CPUs this process may run on).
    """
    kind, index = parse_target(target)
    probe = _probe(kind)
    ident = probe.identify(index, threads)
    path = _cache_dir(cache_dir) / "devices" / f"{kind}-{ident['fingerprint']}.json"
    if not remeasure:
        cached = _read_cached(path)
        if cached is not None and not _measured_busy(cached):
            return cached
    device = probe.measure(index, ident)
    _write_cached(path, device)
    return device


def describe_devices(cache_dir: str | os.PathLike | None = None,
                     measure: bool = True) -> list[dict[str, Any]]:
    """One dict per device this machine offers (for `eclat devices`); measured peaks when measure=True.

    A device that fails to measure is listed with an "error" entry instead of stopping the listing.
    """
    from ..backends import target_names

    rows: list[dict[str, Any]] = []
    for kind in target_names():
        try:
            names = _probe(kind).names()
        except Exception:  # noqa: BLE001 - a target without a probe (or a driver) lists nothing
            names = []
        for index, name in enumerate(names):
            target = f"{kind}:{index}" if kind != "cpu" else "cpu"
            row: dict[str, Any] = {"target": target, "kind": kind, "name": name}
            if measure:
                try:
                    row.update(get_device(target, cache_dir=cache_dir).to_dict())
                except Exception as e:  # noqa: BLE001 - one broken device must not hide the others
                    row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
    return rows


def _probe(kind: str) -> Any:
    from ..backends import get_target

    return get_target(kind).probe()


def load_average() -> float:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _measured_busy(dev: Device) -> bool:
    """A CPU measured while other work held half its cores or more (beyond this process),
    and the machine is quieter now: its cached peaks are too low, so measure again."""
    then = dev.info.get("load_during_measurement")
    if dev.kind != "cpu" or not isinstance(then, (int, float)):
        return False
    others = then - 1.0  # this process's own load
    return others >= 0.5 * cpu_count() and load_average() < others


def _read_cached(path: Path) -> Device | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        if data.get("schema") != CACHE_SCHEMA:
            return None
        dev = Device(**data["device"])
        if not (dev.peak_gflops.get("float32", 0) > 0 and dev.peak_gbps > 0 and dev.launch_overhead_us >= 0):
            raise ValueError("non-positive peaks")
        return dev
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as e:  # too deep a JSON
        warnings.warn(f"ignoring unreadable device cache {path} ({e}); measuring again", stacklevel=3)
        return None


def _write_cached(path: Path, device: Device) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"schema": CACHE_SCHEMA, "device": device.to_dict()}, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one
    except OSError as e:
        warnings.warn(f"could not cache device measurements at {path}: {e}", stacklevel=3)


def fingerprint_of(*parts: Any) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:16]


def calibrated(run: Callable[[int], float], n: int, seconds: float) -> int:
    """Grow n until run(n) takes a measurable time, then scale it to last about `seconds`."""
    while True:
        t = run(n)
        if t > seconds / 8 or n > 1 << 40:
            return max(1, int(n * seconds / max(t, 1e-9)))
        n *= 4
