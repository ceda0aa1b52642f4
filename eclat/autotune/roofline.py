"""Roofline model: how fast a kernel could be on a device, and whether a candidate is worth timing.

A kernel doing `flops` floating-point operations and moving `bytes_` bytes to and from main
memory cannot run faster than max(flops / peak FLOP/s, bytes / bandwidth); each call also pays
the launch overhead. The peaks are measured (see device.py), so the estimate is what is
attainable, not a data-sheet promise.

Pruning: a candidate whose estimate exceeds the best time measured so far times a margin is
not timed. The estimate is not a strict lower bound -- data that stays in cache moves faster
than the measured DRAM bandwidth -- so the margin is a safety factor above 1.
"""

from __future__ import annotations

from .device import Device

# Prune when estimate > best_measured * DEFAULT_MARGIN. 2.0: a kernel whose working set fits in
# cache can beat the DRAM roofline by about that much on the machines measured, and timing a
# hopeless candidate costs far less than discarding the winner.
DEFAULT_MARGIN = 2.0


def estimate_us(flops: float, bytes_: float, device: Device, dtype: str = "float32") -> float:
    """Roofline time in microseconds: max(compute time, memory time) + launch overhead."""
    if flops < 0 or bytes_ < 0:
        raise ValueError(f"flops and bytes must be >= 0, got flops={flops}, bytes={bytes_}")
    compute_us = flops / (device.gflops(dtype) * 1e3)  # GFLOP/s = 1e3 flops per microsecond
    memory_us = bytes_ / (device.peak_gbps * 1e3)
    return max(compute_us, memory_us) + device.launch_overhead_us


def arithmetic_intensity(flops: float, bytes_: float) -> float:
    """FLOPs per byte moved; inf for a kernel that moves nothing."""
    return flops / bytes_ if bytes_ else float("inf")


def ridge_point(device: Device, dtype: str = "float32") -> float:
    """The intensity (FLOP/byte) above which a kernel is compute-bound on device."""
    return device.gflops(dtype) / device.peak_gbps


def bound(flops: float, bytes_: float, device: Device, dtype: str = "float32") -> str:
    """'compute' or 'memory': which roof limits this kernel on device."""
    return "compute" if arithmetic_intensity(flops, bytes_) >= ridge_point(device, dtype) else "memory"


def roofline_share(flops: float, bytes_: float, measured_us: float, device: Device,
                   dtype: str = "float32") -> float:
    """Fraction of the roofline achieved by a measured time: estimate / measured (1.0 = at the roof)."""
    if measured_us <= 0:
        raise ValueError(f"measured time must be positive, got {measured_us} us")
    return estimate_us(flops, bytes_, device, dtype) / measured_us


def should_prune(estimate: float, best_measured_us: float | None, margin: float = DEFAULT_MARGIN) -> bool:
    """True when a candidate estimated at `estimate` us cannot plausibly beat best_measured_us."""
    if margin < 1.0:
        raise ValueError(f"a pruning margin below 1 ({margin}) would discard candidates that can win")
    return best_measured_us is not None and estimate > best_measured_us * margin

