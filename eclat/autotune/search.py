"""The search: choose the fastest correct candidate among opaque ones. It is the one loop the
compiler chooses with, at both levels: among the e-graph's candidate programs (and between a
program's default and tuned schedules), and among each kernel's schedules.

The caller knows how to build and time a candidate and how to check its output; this module only
decides which candidates to time, how often, and which one to keep:

    result = search(candidates, time_fn=time_it, check_fn=verify, mode="fast", db=db, key=key,
                    rounds=3)
    result.winner.schedule, result.measured_us, result.stats   # extracted/pruned/timed/...

Modes:
  none  the first candidate (by convention the default schedule), or the database's choice;
        nothing is timed or written.
  fast  candidates in order of roofline estimate, at most FAST_LIMIT of them; a candidate whose
        estimate exceeds best measured x margin is pruned without timing.
  full  exhaustive: every candidate is timed (the reference that fast is compared against).

Times within TIE (2%) of the fastest are a tie, won by the smaller roofline estimate.
With rounds > 1 the candidates that ran are timed again, in turns, rounds - 1 more times, and a
candidate's time is the median of its rounds: a shared machine's slow (or fast) spell then falls
on all of them alike, where timing each back to back would hand it to whichever ran then.
time_fn is called once per timing, so a caller that builds on the first call keeps what it built.

In every mode the database is consulted first and its schedule used when it is among the
candidates and passes check_fn ("full" trusts only an entry that a "full" search wrote). A
candidate only becomes the best after check_fn accepts it, so a fast wrong answer is never kept,
and pruning compares only against verified times. A candidate whose timing or check raises is
skipped and its reason recorded.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import EclatError
from .db import TuningDB, TuningKey, schedule_json
from .measure import CandidateFailed, Timing, run_isolated
from .progress import progress
from .roofline import DEFAULT_MARGIN, should_prune

FAST_LIMIT = 4  # candidates timed at most per kernel in "fast" mode
# times this close are a tie, won by the smaller roofline estimate: timing noise alone then never
# decides (two programs of a few microseconds, one with half the FLOPs, were chosen by it)
TIE = 0.02


@dataclass(frozen=True)
class Mode:
    time: bool  # time candidates at all
    limit: int | None  # at most this many candidates, best estimates first (None: all)
    margin: float | None  # roofline pruning margin (None: no pruning)


MODES = {
    "none": Mode(time=False, limit=0, margin=None),
    "fast": Mode(time=True, limit=FAST_LIMIT, margin=DEFAULT_MARGIN),
    "full": Mode(time=True, limit=None, margin=None),
}


class TuningError(EclatError):
    """No candidate of a kernel could be built, timed and verified."""


@dataclass(frozen=True)
class Candidate:
    """One way to run a kernel. schedule (a dict or a dataclass) is what the database stores as JSON;
    payload is the caller's (e.g. the kernel to build)."""

    schedule: Any
    estimate_us: float
    payload: Any = field(default=None, compare=False)


@dataclass(frozen=True)
class Failure:
    schedule: Any
    stage: str  # "time" or "check"
    reason: str


@dataclass
class SearchStats:
    """Counts for one kernel, or summed over many with +=."""

    extracted: int = 0  # candidates offered
    pruned: int = 0  # not timed: beyond the mode's limit, or the roofline says they cannot win
    timed: int = 0  # timing attempted (including those that then failed)
    hits: int = 0  # the database's schedule was used
    misses: int = 0  # the database had no usable schedule
    failures: int = 0  # candidates skipped because timing or checking failed

    def __iadd__(self, other: SearchStats) -> SearchStats:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self

    def __str__(self) -> str:
        return ", ".join(f"{getattr(self, n)} {n}" for n in self.__dataclass_fields__)


@dataclass
class SearchResult:
    winner: Candidate
    measured_us: float | None  # None when nothing was timed (mode "none" without a database entry)
    source: str  # "default", "db" or "search"
    stats: SearchStats
    failures: list[Failure] = field(default_factory=list)


TimeFn = Callable[[Candidate], "Timing | float"]
CheckFn = Callable[[Candidate], "bool | None"]


def search(candidates: Sequence[Candidate], *, time_fn: TimeFn, check_fn: CheckFn | None = None,
           mode: str = "fast", db: TuningDB | None = None, key: TuningKey | None = None,
           margin: float | None = None, limit: int | None = None, rounds: int = 1,
           quiet: bool | None = None, desc: str = "tuning",
           penalty_fn: Callable[[Candidate], float] | None = None) -> SearchResult:
    """Choose the fastest verified candidate (see the module docstring for the modes and rounds).

    time_fn returns a Timing (its median is used) or microseconds; check_fn returns False or
    raises for a wrong result. margin and limit override the mode's defaults. penalty_fn: a factor
    (at least 1) on a timed candidate's time when choosing, for what it costs besides time (asked
    after its timing). Raises TuningError when every timed candidate failed.
    """
    if mode not in MODES:
        raise ValueError(f"unknown tuning mode {mode!r}: expected one of {', '.join(MODES)}")
    if not candidates:
        raise ValueError("search needs at least one candidate")
    spec = MODES[mode]
    margin = spec.margin if margin is None else margin
    limit = spec.limit if limit is None else limit
    stats = SearchStats(extracted=len(candidates))
    failures: list[Failure] = []
    verdicts: dict[int, bool] = {}  # id(candidate) -> whether check_fn accepted it

    def accepted(c: Candidate) -> bool:
        if id(c) not in verdicts:
            reason = _check(check_fn, c)
            if reason:
                failures.append(Failure(c.schedule, "check", reason))
            verdicts[id(c)] = not reason
        return verdicts[id(c)]

    if db is not None and key is not None:
        entry = db.get(key)
        if entry is not None and mode == "full" and entry.meta.get("mode") != "full":
            entry = None  # a fast search's choice: the full one may find better
        text = schedule_json(entry.schedule) if entry else None
        known = next((c for c in candidates if schedule_json(c.schedule) == text), None)
        if known is not None and accepted(known):
            stats.hits, stats.pruned = 1, len(candidates)
            return SearchResult(known, entry.measured_us, "db", stats, failures)
        stats.misses = 1  # absent, stale (not among the candidates) or wrong
    if not spec.time:
        stats.pruned, stats.failures = len(candidates), len(failures)
        return SearchResult(candidates[0], None, "default", stats, failures)

    def timed(c: Candidate) -> float | None:
        """c's time in microseconds, or None (its failure recorded)."""
        try:
            t = time_fn(c)
            us = t.median_us if isinstance(t, Timing) else float(t)
            if not math.isfinite(us) or us < 0:
                raise CandidateFailed(f"time_fn gave {us} us, not a time")
            return us
        except Exception as e:  # noqa: BLE001 - any failure of a candidate only skips it
            failures.append(Failure(c.schedule, "time", f"{type(e).__name__}: {e}"))
            return None

    ordered = sorted(candidates, key=lambda c: c.estimate_us)
    if limit is not None:
        stats.pruned += len(ordered) - min(limit, len(ordered))
        ordered = ordered[:limit]
    times: dict[int, list[float]] = {}  # position in ordered -> its times, one per round
    best_us: float | None = None  # the best verified time: what pruning compares against
    for i, c in enumerate(progress(ordered, desc=desc, quiet=quiet, unit="candidate")):
        if margin is not None and should_prune(c.estimate_us, best_us, margin):
            stats.pruned += 1
            continue
        stats.timed += 1
        us = timed(c)
        if us is None:
            continue
        if best_us is None or us < best_us:
            if not accepted(c):
                continue
            best_us = us
        times[i] = [us]
    for _ in range(rounds - 1):  # in turns: each round times every survivor once
        if len(times) < 2:
            break
        for i in list(times):
            us = timed(ordered[i])
            if us is None:
                del times[i]
            else:
                times[i].append(us)
    median = {i: statistics.median(ts) for i, ts in times.items()}
    weighed = {i: us * (penalty_fn(ordered[i]) if penalty_fn else 1.0) for i, us in median.items()}
    fair = [i for i in weighed if accepted(ordered[i])]
    winner = None
    if fair:  # within TIE of the fastest is a tie, which the roofline's estimate breaks
        fastest = min(weighed[i] for i in fair)
        winner = min((i for i in fair if weighed[i] <= fastest * (1 + TIE)),
                     key=lambda i: (ordered[i].estimate_us, weighed[i]))
    stats.failures = len(failures)
    if winner is None:
        shown = "; ".join(f"{f.schedule}: {f.stage} failed: {f.reason}" for f in failures[:5])
        raise TuningError(f"no candidate of {desc!r} ran correctly ({stats}): {shown}")
    best, best_us = ordered[winner], median[winner]
    if db is not None and key is not None:
        db.put(key, best.schedule, best_us, {"mode": mode, "estimate_us": best.estimate_us,
                                             "extracted": stats.extracted, "timed": stats.timed})
    return SearchResult(best, best_us, "search", stats, failures)


def _check(check_fn: CheckFn | None, c: Candidate) -> str:
    """'' when c is correct (or there is no check), else the reason it is not."""
    if check_fn is None:
        return ""
    try:
        ok = check_fn(c)
    except Exception as e:  # noqa: BLE001 - a crashing check rejects the candidate
        return f"{type(e).__name__}: {e}"
    return "wrong result" if ok is False else ""


def isolated(time_fn: Callable[[Candidate], Timing | float], timeout_s: float = 60.0,
             start_method: str | None = None) -> TimeFn:
    """Wrap a module-level time_fn so each call runs in a child process (see measure.run_isolated).

    A crash or hang of the candidate then raises CandidateFailed in the parent, which search
    records as that candidate's failure. Candidate (with its payload) must be picklable.
    """
    return lambda c: run_isolated(time_fn, (c,), timeout_s=timeout_s, start_method=start_method).unwrap()
