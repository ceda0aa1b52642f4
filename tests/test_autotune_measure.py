"""Timing with warm-up, repeats and a budget; isolation of candidates that crash or hang."""

import ctypes
import os
import time

import pytest

from eclat.autotune.measure import CandidateFailed, measure, run_isolated


# module-level so that a spawned or forkserver child can import them
def _double(x):
    return 2 * x


def _segfault():
    ctypes.string_at(0)


def _hang():
    time.sleep(60)


def _raise(msg):
    raise ValueError(msg)


def _exit3():
    os._exit(3)


def _unpicklable_result():
    return lambda: None


def test_measure_counts_warmup_and_repeats():
    calls = []
    t = measure(lambda: calls.append(1), warmup=2, repeats=5, max_seconds=10)
    assert len(calls) == 7 and t.repeats == 5
    assert 0 <= t.min_us <= t.median_us


def test_measure_times_real_work():
    t = measure(lambda: time.sleep(0.002), warmup=1, repeats=5, max_seconds=10)
    assert 1900 <= t.min_us <= t.median_us < 50_000


def test_measure_respects_budget():
    calls = []
    t = measure(lambda: (calls.append(1), time.sleep(0.05)), warmup=3, repeats=100, max_seconds=0.12)
    assert 1 <= t.repeats <= 2 and len(calls) <= 5  # stopped by the budget, not the 100 repeats
    assert t.median_us >= 45_000


def test_measure_makes_at_least_the_runs_asked_past_its_budget():
    t = measure(lambda: time.sleep(0.02), warmup=0, repeats=100, max_seconds=0.01, at_least=3)
    assert t.repeats == 3 and t.min_us >= 19_000


def test_measure_calls_sync_inside_timing():
    synced = []
    t = measure(lambda: None, warmup=0, repeats=3, sync=lambda: (synced.append(1), time.sleep(0.001)))
    assert len(synced) == 3 and t.min_us >= 900


def test_measure_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats >= 1"):
        measure(lambda: None, repeats=0)


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_isolated_value_and_segfault(method):
    assert run_isolated(_double, (21,), start_method=method).value == 42
    out = run_isolated(_segfault, timeout_s=20, start_method=method)
    assert not out.ok and out.error == "crashed with signal 11 (SIGSEGV)"


def test_isolated_timeout_kills_the_child():
    out = run_isolated(_hang, timeout_s=0.5)
    assert not out.ok and out.error == "timed out after 0.5 s"
    with pytest.raises(CandidateFailed, match="timed out after 0.5 s"):
        out.unwrap()


@pytest.mark.parametrize("fn, args, match", [
    (_raise, ("no luck",), "raised ValueError: no luck"),
    (_exit3, (), "exited with status 3 without a result"),
    (_unpicklable_result, (), "result could not be sent back"),
    (lambda: 1, (), "could not start the isolated run"),  # a lambda cannot be pickled for forkserver
])
def test_isolated_failures_are_reasons(fn, args, match):
    out = run_isolated(fn, args, timeout_s=20)
    assert not out.ok and match in out.error
