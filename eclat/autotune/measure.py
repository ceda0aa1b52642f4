"""Timing candidates, and running them where a crash or a hang cannot take the compile down.

    t = measure(lambda: kernel(*bufs), warmup=2, repeats=20, max_seconds=0.5)
    t.median_us, t.min_us

    out = run_isolated(build_and_time, (plain_spec,), timeout_s=10)   # in a child process
    if out.ok: use(out.value) else: log(out.error)  # "crashed with signal 11 (SIGSEGV)" ...

run_isolated needs a picklable callable (a module-level function) and picklable arguments
and result, except with the "fork" start method, which inherits them.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import signal
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import EclatError


class CandidateFailed(EclatError):
    """A candidate could not be built, run, timed or verified; the message says why."""


@dataclass(frozen=True)
class Timing:
    """Wall-clock times of repeated runs, in microseconds."""

    median_us: float
    min_us: float
    times_us: tuple[float, ...]

    @property
    def repeats(self) -> int:
        return len(self.times_us)


def measure(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 10, max_seconds: float = 1.0,
            sync: Callable[[], Any] | None = None, at_least: int = 1) -> Timing:
    """Time fn(): `warmup` untimed runs, then up to `repeats` timed runs.

    Runs stop early once max_seconds have passed in total, but at least `at_least` timed runs are
    always made, so a slow candidate costs about that many runs past its budget, not `repeats`.
    sync (e.g. a GPU queue's finish) is called after each run, inside the timed region.
    """
    if repeats < 1 or warmup < 0 or max_seconds <= 0:
        raise ValueError("need repeats >= 1, warmup >= 0, max_seconds > 0; "
                         f"got {repeats}, {warmup}, {max_seconds}")
    sync = sync or (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
        sync()
        if time.perf_counter() - start > max_seconds:
            break
    times: list[float] = []
    while len(times) < repeats and (len(times) < at_least or time.perf_counter() - start < max_seconds):
        t0 = time.perf_counter_ns()
        fn()
        sync()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return Timing(median_us=statistics.median(times), min_us=min(times), times_us=tuple(times))


@dataclass(frozen=True)
class Outcome:
    """Result of run_isolated: a value, or why there is none."""

    ok: bool
    value: Any = None
    error: str = ""
    seconds: float = 0.0

    def unwrap(self) -> Any:
        """The value, or CandidateFailed carrying the reason."""
        if not self.ok:
            raise CandidateFailed(self.error)
        return self.value


def default_start_method() -> str:
    # forkserver: children are forked from a clean single-threaded server, so a parent holding
    # threads (torch, BLAS) cannot deadlock them the way plain fork can; cheap after the first call.
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _child(conn: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
    faulthandler.disable()  # a crash is reported to the parent as a reason, not as a dump on stderr
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:  # noqa: BLE001 - everything is reported to the parent
        where = traceback.extract_tb(e.__traceback__)[-1]
        conn.send(("error", f"raised {type(e).__name__}: {e} (at {where.filename}:{where.lineno})"))
        return
    try:
        conn.send(("ok", result))
    except Exception as e:  # noqa: BLE001 - an unpicklable result
        conn.send(("error", f"its result could not be sent back: {type(e).__name__}: {e}"))


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return "unknown"


def run_isolated(fn: Callable[..., Any], args: tuple = (), kwargs: dict | None = None, *,
                 timeout_s: float = 60.0, start_method: str | None = None) -> Outcome:
    """Call fn(*args, **kwargs) in a child process; never raises for what the child does.

    A segfault, abort, hang past timeout_s, or exception in the child gives Outcome(ok=False)
    with a clear reason; the child is killed on timeout.
    """
    ctx = multiprocessing.get_context(start_method or default_start_method())
    receiver, sender = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(sender, fn, args, kwargs or {}), daemon=True)
    start = time.perf_counter()
    try:
        proc.start()
    except Exception as e:  # noqa: BLE001 - e.g. an unpicklable fn or argument under spawn
        return Outcome(False, error=f"could not start the isolated run: {type(e).__name__}: {e}")
    finally:
        sender.close()  # the child holds its own copy; ours must go so a dead child reads as EOF
    message = None
    try:
        if receiver.poll(timeout_s):
            message = receiver.recv()
    except (EOFError, OSError):
        pass  # the child died before sending
    except Exception as e:  # noqa: BLE001 - the result could not be unpickled here
        message = ("error", f"its result could not be read: {type(e).__name__}: {e}")
    finally:
        receiver.close()
    seconds = time.perf_counter() - start
    if message is None and proc.is_alive():
        proc.join(0.05)
    if message is None and proc.is_alive():
        proc.kill()
        proc.join()
        return Outcome(False, error=f"timed out after {timeout_s:g} s", seconds=seconds)
    proc.join()
    if message is not None:
        status, payload = message
        return Outcome(True, payload, seconds=seconds) if status == "ok" else \
            Outcome(False, error=payload, seconds=seconds)
    code = proc.exitcode
    if code is not None and code < 0:
        return Outcome(False, error=f"crashed with signal {-code} ({_signal_name(-code)})", seconds=seconds)
    return Outcome(False, error=f"exited with status {code} without a result", seconds=seconds)
