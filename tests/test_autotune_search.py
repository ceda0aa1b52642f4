"""Search driver with fake candidates whose times and correctness the test controls."""

import ctypes
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eclat.autotune.db import TuningDB, TuningKey
from eclat.autotune.measure import Timing
from eclat.autotune.progress import is_quiet, progress
from eclat.autotune.search import Candidate, SearchStats, TuningError, isolated, search

KEY = TuningKey.make("kern", ((4, 4),), "float32", "cpu", "fp")


def cands(estimates, times, wrong=()):
    """Candidate i: schedule {"i": i}; payload (true time in us, whether its output is right)."""
    return [Candidate({"i": i}, e, (t, i not in wrong)) for i, (e, t) in enumerate(zip(estimates, times))]


class Bench:
    """time_fn / check_fn pair recording what was asked."""

    def __init__(self):
        self.timed, self.checked = [], []

    def time(self, c):
        self.timed.append(c.schedule["i"])
        if c.payload[0] is None:
            raise RuntimeError("kernel failed to build")
        return Timing(c.payload[0], c.payload[0], (c.payload[0],))

    def check(self, c):
        self.checked.append(c.schedule["i"])
        return c.payload[1]


def test_fast_mode_prunes_by_roofline_and_limit():
    b = Bench()
    r = search(cands([1, 2, 3, 50, 60], [10, 8, 12, 100, 120]), time_fn=b.time, check_fn=b.check, mode="fast",
               quiet=True)
    # by estimate: 0 (10us), 1 (8us, new best), 2 (12us); 3's estimate 50 > 8 * 2: pruned;
    # 4 is past the limit of 4
    assert b.timed == [0, 1, 2]
    assert r.winner.schedule == {"i": 1} and r.measured_us == 8 and r.source == "search"
    assert (r.stats.extracted, r.stats.pruned, r.stats.timed, r.stats.failures) == (5, 2, 3, 0)


def test_full_mode_times_everything():
    b = Bench()
    r = search(cands([1, 2, 3, 50, 60], [10, 8, 12, 100, 5]), time_fn=b.time, mode="full", quiet=True)
    assert sorted(b.timed) == [0, 1, 2, 3, 4]
    assert r.winner.schedule == {"i": 4} and r.stats.pruned == 0 and r.stats.timed == 5


def test_wrong_fast_candidate_is_never_kept():
    b = Bench()
    r = search(cands([1, 2, 3], [1, 9, 8], wrong={0}), time_fn=b.time, check_fn=b.check, mode="full",
               quiet=True)
    assert r.winner.schedule == {"i": 2} and r.measured_us == 8
    assert [(f.schedule, f.stage) for f in r.failures] == [({"i": 0}, "check")] and r.stats.failures == 1


def test_wrong_candidate_does_not_prune_the_right_ones():
    # the wrong candidate is 1 us; were it kept as best, everything else would be pruned
    b = Bench()
    r = search(cands([1, 10, 20], [1, 15, 30], wrong={0}), time_fn=b.time, check_fn=b.check, mode="fast",
               quiet=True)
    assert r.winner.schedule == {"i": 1}


def test_failing_candidate_is_skipped_with_reason():
    b = Bench()
    r = search(cands([1, 2], [None, 7]), time_fn=b.time, mode="full", quiet=True)
    assert r.winner.schedule == {"i": 1}
    assert r.failures[0].stage == "time" and "RuntimeError: kernel failed to build" in r.failures[0].reason


def test_nonsense_time_is_a_failure():
    r = search(cands([1, 2], [float("nan"), 7]), time_fn=lambda c: c.payload[0], mode="full", quiet=True)
    assert r.winner.schedule == {"i": 1} and "gave nan us, not a time" in r.failures[0].reason


def test_check_that_raises_rejects():
    def check(c):
        if c.schedule["i"] == 0:
            raise AssertionError("max abs error 0.5")

    r = search(cands([1, 2], [1, 7]), time_fn=Bench().time, check_fn=check, mode="full", quiet=True)
    assert r.winner.schedule == {"i": 1} and "max abs error 0.5" in r.failures[0].reason


def test_all_failing_raises_tuning_error():
    with pytest.raises(TuningError, match="no candidate of 'kern' ran correctly.*wrong result"):
        search(cands([1, 2], [1, 2], wrong={0, 1}), time_fn=Bench().time, check_fn=Bench().check, mode="full",
               quiet=True, desc="kern")


def test_mode_none_takes_the_default_without_timing():
    b = Bench()
    r = search(cands([5, 1], [1, 1]), time_fn=b.time, mode="none")
    assert r.winner.schedule == {"i": 0} and r.measured_us is None and r.source == "default"
    assert b.timed == [] and (r.stats.timed, r.stats.pruned) == (0, 2)


def test_database_is_consulted_first_and_written(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        cs = cands([1, 2, 3], [9, 4, 6])
        first = search(cs, time_fn=Bench().time, mode="full", db=db, key=KEY, quiet=True)
        assert first.source == "search" and first.stats.misses == 1
        assert db.get(KEY).schedule == {"i": 1} and db.get(KEY).measured_us == 4
        b = Bench()
        again = search(cs, time_fn=b.time, check_fn=b.check, mode="fast", db=db, key=KEY)
        assert again.source == "db" and again.winner.schedule == {"i": 1} and again.measured_us == 4
        assert b.timed == [] and b.checked == [1]  # verified, not timed
        assert (again.stats.hits, again.stats.misses, again.stats.timed) == (1, 0, 0)
        # mode "none" uses the database too
        assert search(cs, time_fn=b.time, mode="none", db=db, key=KEY).winner.schedule == {"i": 1}


def test_wrong_or_stale_database_entry_is_replaced(tmp_path):
    with TuningDB(tmp_path / "t.db") as db:
        db.put(KEY, {"i": 1}, 0.5)  # a schedule that now gives a wrong answer
        r = search(cands([1, 2, 3], [9, 4, 6], wrong={1}), time_fn=Bench().time, check_fn=Bench().check,
                   mode="full", db=db, key=KEY, quiet=True)
        assert r.source == "search" and r.winner.schedule == {"i": 2} and r.stats.misses == 1
        assert db.get(KEY).schedule == {"i": 2}
        db.put(KEY, {"i": 99}, 0.5)  # not among the candidates any more
        r = search(cands([1, 2], [3, 2]), time_fn=Bench().time, mode="full", db=db, key=KEY, quiet=True)
        assert r.source == "search" and r.winner.schedule == {"i": 1}


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown tuning mode 'fastest'"):
        search(cands([1], [1]), time_fn=Bench().time, mode="fastest")
    with pytest.raises(ValueError, match="at least one candidate"):
        search([], time_fn=Bench().time)


def test_stats_add_up():
    total = SearchStats()
    total += SearchStats(5, 2, 3, 0, 1, 0)
    total += SearchStats(4, 0, 4, 1, 0, 2)
    assert total == SearchStats(9, 2, 7, 1, 1, 2)
    assert str(total) == "9 extracted, 2 pruned, 7 timed, 1 hits, 1 misses, 2 failures"


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(1, 1000), st.floats(0.5, 1.0)), min_size=1, max_size=12))
def test_pruning_never_loses_the_winner_when_estimates_are_within_the_margin(cases):
    # estimates optimistic by at most 2x (the default margin): fast without a count limit == full
    cs = [Candidate({"i": i}, t * f, (t, True)) for i, (t, f) in enumerate(cases)]
    full = search(cs, time_fn=Bench().time, mode="full", quiet=True)
    fast = search(cs, time_fn=Bench().time, mode="fast", limit=len(cs), quiet=True)
    assert fast.measured_us == full.measured_us
    assert fast.stats.timed + fast.stats.pruned == len(cs)


# isolation (fork here: forkserver and spawn are covered in test_autotune_measure.py)
def _time_in_child(c):
    if c.payload == "segfault":
        ctypes.string_at(0)
    return float(c.payload)


def test_isolated_search_survives_a_segfaulting_candidate():
    cs = [Candidate({"i": 0}, 1.0, "segfault"), Candidate({"i": 1}, 2.0, 5.0), Candidate({"i": 2}, 3.0, 7.0)]
    time_fn = isolated(_time_in_child, timeout_s=20, start_method="fork")
    r = search(cs, time_fn=time_fn, mode="full", quiet=True)
    assert r.winner.schedule == {"i": 1} and r.measured_us == 5.0
    assert r.failures[0].reason == "CandidateFailed: crashed with signal 11 (SIGSEGV)"


def test_progress_quiet_rules():
    assert progress(range(3), quiet=True).disable
    assert not progress(range(3), quiet=False).disable
    assert is_quiet(None)  # under pytest stderr is captured, not a terminal


@dataclass(frozen=True)
class Sched:  # like compiler.kernel.Schedule: a frozen dataclass with tuples
    tile: tuple[int, int] = (1, 1)
    threads: int = 1


def test_dataclass_schedules_round_trip_through_the_database(tmp_path):
    cs = [Candidate(Sched((6, 16)), 1.0, (9, True)), Candidate(Sched((8, 8)), 2.0, (4, True))]
    with TuningDB(tmp_path / "t.db") as db:
        search(cs, time_fn=lambda c: c.payload[0], mode="full", db=db, key=KEY, quiet=True)
        assert db.get(KEY).schedule == {"tile": [8, 8], "threads": 1}  # JSON: lists
        again = search(cs, time_fn=Bench().time, mode="fast", db=db, key=KEY)
        assert again.source == "db" and again.winner.schedule == Sched((8, 8))  # the candidate's own object


def test_schedules_are_timed_in_turns_so_a_fast_spell_favours_none():
    """The machine runs fast (x0.7) for its first three timings. Timed back to back, the first
    schedule would get all three and win at 7 against 8; timed in turns, each gets one and the
    truly fastest (s1) wins, at the median of its rounds. A schedule that fails to build or to run
    is left out; when all fail, the kernel keeps its default."""
    from types import SimpleNamespace

    from eclat.compiler import tune as tune_module
    from eclat.compiler.kernel import Schedule

    cost = {"s0": 10.0, "s1": 8.0, "s2": 9.0, "broken": 1.0, "crashes": 1.0}
    calls = []

    def trial(kernel, name):
        if name == "broken":
            raise RuntimeError("no code for this schedule")

        def timer():
            if name == "crashes":
                raise RuntimeError("it ran off the end of a buffer")
            calls.append(name)
            return cost[name] * (0.7 if len(calls) <= 3 else 1.0)
        return timer

    def target(space):
        return SimpleNamespace(name="fake", tunes=lambda k, mode: True,
                               schedule_space=lambda k, t, w=None: space, schedule_json=lambda s: {"s": s},
                               schedule_trials=lambda p, t, i: trial)

    kernel = SimpleNamespace(name="k0", schedule=Schedule())
    program = SimpleNamespace(kernels=[kernel], weights={})
    space = ["s0", "broken", "s1", "crashes", "s2"]
    counts = tune_module.tune(program, target(space), None, None, "full", 1, [])
    assert kernel.schedule == "s1" and counts == {"tuned": 1}
    assert calls[:3] == ["s0", "s1", "s2"] and calls[3:6] == ["s0", "s1", "s2"]
    found = search([Candidate(s, 0.0) for s in ("s0", "s1", "s2")], time_fn=lambda c: cost[c.schedule],
                   mode="full", rounds=3, quiet=True)
    assert (found.winner.schedule, found.measured_us) == ("s1", 8.0)
    kernel.schedule = "default"
    assert tune_module.tune(program, target(["broken", "crashes"]), None, None, "full", 1, []) == {"tuned": 0}
    assert kernel.schedule == "default"


def test_a_penalty_weighs_a_candidate_only_against_its_peers():
    """penalty_fn multiplies a timed candidate's time when choosing: 90 us that costs twice loses to
    100 us that costs nothing; a penalty all candidates pay changes nothing."""
    got = search(cands([1, 1], [100.0, 90.0]), time_fn=Bench().time, mode="full", quiet=True,
                 penalty_fn=lambda c: 2.0 if c.schedule["i"] == 1 else 1.0)
    assert got.winner.schedule == {"i": 0} and got.measured_us == 100.0
    got = search(cands([1, 1], [100.0, 90.0]), time_fn=Bench().time, mode="full", quiet=True,
                 penalty_fn=lambda c: 2.0)
    assert got.winner.schedule == {"i": 1}
