"""Roofline numbers on a device with round peaks, and the pruning rule."""

import math

import pytest

from eclat.autotune.device import Device
from eclat.autotune.roofline import (
    DEFAULT_MARGIN,
    arithmetic_intensity,
    bound,
    estimate_us,
    ridge_point,
    roofline_share,
    should_prune,
)

DEV = Device(name="test", kind="cpu", fingerprint="0" * 16, peak_gflops={"float32": 100.0, "float16": 400.0},
             peak_gbps=10.0, launch_overhead_us=5.0, threads=1)


def test_compute_bound_estimate():
    # 1e6 flops at 100 GFLOP/s = 10 us (bytes take 1 us), plus 5 us launch
    assert estimate_us(1e6, 1e4, DEV) == pytest.approx(15.0)
    assert bound(1e6, 1e4, DEV) == "compute"


def test_memory_bound_estimate():
    # 1e6 bytes at 10 GB/s = 100 us
    assert estimate_us(1e3, 1e6, DEV) == pytest.approx(105.0)
    assert bound(1e3, 1e6, DEV) == "memory"


def test_dtype_peaks():
    assert estimate_us(4e6, 0, DEV, "float16") == pytest.approx(15.0)
    assert estimate_us(1e6, 0, DEV, "bfloat16") == pytest.approx(15.0)  # not measured: float32's peak


def test_intensity_and_ridge():
    assert arithmetic_intensity(100, 50) == 2.0
    assert math.isinf(arithmetic_intensity(1, 0))
    assert ridge_point(DEV) == 10.0


def test_roofline_share():
    assert roofline_share(1e6, 1e4, 30.0, DEV) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        roofline_share(1e6, 1e4, 0.0, DEV)


def test_negative_work_is_an_error():
    with pytest.raises(ValueError, match="flops and bytes"):
        estimate_us(-1, 0, DEV)


def test_pruning_rule():
    assert not should_prune(1e9, None)  # nothing measured yet: time it
    assert should_prune(20.1, 10.0, margin=2.0)
    assert not should_prune(20.0, 10.0, margin=2.0)
    assert should_prune(10.5, 10.0, margin=1.0)
    assert not should_prune(10.0 * DEFAULT_MARGIN, 10.0)
    with pytest.raises(ValueError, match="below 1"):
        should_prune(1.0, 1.0, margin=0.9)

