"""Autotuning through compile_model: a second compile of the same model reads the tuning database
and the program cache instead of searching, and is still verified."""

from __future__ import annotations

import time

import pytest
import torch

import eclat
from eclat.compiler import pipeline, program_cache
from eclat.frontend import lower
from tests.zoo import make_llama


def _compile(model, inputs, cache, k=2):
    return eclat.compile(model, inputs, autotune="fast", k=k, cache_dir=cache, quiet=True)


def test_second_compile_reads_the_cache_instead_of_searching(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "_faster_first", lambda *a: True)  # tuned schedules kept: read back below
    model, inputs = make_llama(layers=1, d=32, heads=2, ffn=64, vocab=64, seq=4)
    first = _compile(model, inputs, tmp_path)
    monkeypatch.setattr(pipeline, "_candidates", lambda *a: pytest.fail("searched again"))
    second = _compile(model, inputs, tmp_path)
    one, two = first.report(), second.report()
    assert one["tuning_cache"]["misses"] >= 2 and two["tuning_cache"]["misses"] == 0
    assert two["tuning_cache"]["hits"] == one["tuning_cache"]["hits"] + one["tuning_cache"]["misses"]
    assert two["candidates"]["cached"] and two["candidates"]["chosen"] == one["candidates"]["chosen"]
    assert two["egraph"] == one["egraph"] and two["candidates"]["extracted"] == one["candidates"]["extracted"]
    with torch.no_grad():
        want = model(*inputs)
    torch.testing.assert_close(second(*inputs), want, rtol=1e-3, atol=1e-4)
    # the kernels' times as the first compile measured them, not profiled again
    assert [r["measured_us"] for r in two["kernels"]] == [r["measured_us"] for r in one["kernels"]]
    for row in two["kernels"]:  # per kernel: the roofline's estimate, the measurement, the share achieved
        assert row["flops"] >= 0 and row["bytes"] > 0 and row["estimated_us"] > 0 and row["measured_us"] >= 0
        if row["measured_us"] > 0:
            assert row["roofline_share"] == pytest.approx(row["estimated_us"] / row["measured_us"], rel=1e-2)
    assert set(one["candidates"]) >= {"extracted", "pruned", "timed"}
    assert one["candidates"]["timed"] <= pipeline.RACED["fast"]


def test_a_short_search_groups_only_the_candidates_it_may_time(monkeypatch):
    """Grouping a language model's candidate takes seconds: a "fast" or "none" search groups the e-graph's
    candidates cheapest first until it has twice the programs it times (a candidate with attention
    makes two: fused and not), and reports the rest as pruned. Only the candidates grouped have their
    weight-only values computed (folding all eight took 1.2 of resnet18's 9.9 s with "none")."""
    from eclat.rewrites import fold

    grouped, folded = [], []
    real, real_fold = pipeline.group, fold.fold_weights
    monkeypatch.setattr(pipeline, "group", lambda graph, *rest: grouped.append(graph) or real(graph, *rest))
    monkeypatch.setattr(fold, "fold_weights", lambda graph, shared=None: folded.append(graph) or
                        real_fold(graph, shared))
    model, inputs = make_llama(layers=1, d=32, heads=2, ffn=64, vocab=64, seq=4)
    compiled = eclat.compile(model, inputs, autotune="none", k=8, quiet=True)
    fast = compiled.report()["candidates"]
    raced = pipeline.RACED["none"]
    assert len(grouped) == 2 * raced < 2 * fast["extracted"]  # some were left
    assert len(folded) < fast["extracted"]  # the rest were not folded
    assert fast["timed"] <= raced
    assert fast["pruned"] >= fast["extracted"] - raced  # the ungrouped among them
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-3, atol=1e-4)
    grouped.clear()
    few = eclat.compile(model, inputs, autotune="none", k=2, quiet=True).report()["candidates"]
    assert len(grouped) == 2 * few["extracted"]  # under the cap: every candidate, both ways


def test_grouping_that_takes_its_time_stops_after_the_first_candidate(monkeypatch):
    """A long recurrence's candidates take tens of seconds each to group: once grouping has taken
    GROUPING_SECONDS, no candidate past the first is grouped, and the rest are reported pruned."""
    grouped = []
    real = pipeline.group
    monkeypatch.setattr(pipeline, "group", lambda graph, *rest: grouped.append(graph) or real(graph, *rest))
    monkeypatch.setattr(pipeline, "GROUPING_SECONDS", 0.0)
    model, inputs = make_llama(layers=1, d=32, heads=2, ffn=64, vocab=64, seq=4)
    compiled = eclat.compile(model, inputs, autotune="none", k=8, quiet=True)
    stats = compiled.report()["candidates"]
    assert stats["extracted"] > 2 and len({id(g) for g in grouped}) == 1
    assert stats["pruned"] >= stats["extracted"] - 1
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-3, atol=1e-4)


def test_a_compile_whose_every_candidate_fails_to_group_says_why(monkeypatch):
    """Where grouping fails for every candidate, the error names what failed (it was a ValueError
    from an empty max() in the pipeline's own bookkeeping)."""
    def broken(graph, *rest):
        raise RuntimeError("grouping broke here")

    monkeypatch.setattr(pipeline, "group", broken)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    with pytest.raises(eclat.EclatError, match="grouping broke here"):
        eclat.compile(model, (torch.randn(2, 4),), autotune="none", quiet=True)


def test_no_autotuning_still_ranks_candidates_on_the_measured_device(tmp_path, monkeypatch):
    """autotune="none" tunes no schedule and keeps no choice, but the e-graph ranks its candidates
    by this machine's roofline, not a default one: on a host whose peak is twice the default's, a
    3x3 convolution of 16 channels had been Winograd by the default's figures and ran 1.5x slower."""
    seen = []
    real = pipeline._candidates
    monkeypatch.setattr(pipeline, "_candidates", lambda *a: seen.append(a[3]) or real(*a))
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.ReLU()).eval()
    x = torch.randn(1, 4, 8, 8)
    compiled = eclat.compile(model, (x,), autotune="none", k=2, cache_dir=tmp_path, quiet=True)
    assert seen[0] is not None and seen[0].gflops("float32") > 0
    assert compiled.report()["device"]["peak_gflops"] == seen[0].gflops("float32")
    assert not (tmp_path / "tuning.db").exists()
    torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_a_fast_search_times_each_grouping_at_least_once():
    """The estimates choose what a fast search times, but each grouping's best estimate is timed
    even when the other grouping holds every cheaper one: an estimate's blind spot in one grouping
    must not leave the search only that grouping's programs to choose from."""
    from eclat.autotune.search import Candidate

    def cands(estimates: list[tuple[float, bool]]) -> list:
        return [Candidate({"candidate": n, "fused": fused}, us, None)
                for n, (us, fused) in enumerate(estimates)]

    def chosen(estimates: list[tuple[float, bool]], n: int = 4) -> list[int]:
        return [c.schedule["candidate"] for c in pipeline._spread(cands(estimates), n)]
    assert chosen([(5, True), (1, True), (3, True), (4, True), (2, True), (100, False)]) == [1, 4, 2, 5]
    assert chosen([(1, True), (2, False), (3, True), (4, False), (5, True)]) == [0, 1, 2, 3]
    assert chosen([(5, False), (1, False)]) == [1, 0]
    # asked for attention in one kernel, only candidate 3 has one: it is timed too
    found = [Candidate({"candidate": n, "fused": True, "attention": n == 3}, us, None)
             for n, us in enumerate([1, 2, 3, 9, 4])]
    assert [c.schedule["candidate"] for c in pipeline._spread(found, 2)] == [0, 3]


class Affine(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) + 1.0


def test_a_wrong_cached_program_is_caught_and_replaced(tmp_path):
    """The program cache is checked against the model run by torch: another model's program
    placed under this model's key is rejected and compiled afresh."""
    x = (torch.randn(2, 8),)
    a, b = Affine(0).eval(), Affine(1).eval()
    eclat.compile(a, x, autotune="fast", k=1, cache_dir=tmp_path, quiet=True)
    key_a = program_cache.cache_path(lower(a, x), "cpu", "fast", 1, 1, tmp_path)
    key_b = program_cache.cache_path(lower(b, x), "cpu", "fast", 1, 1, tmp_path)
    assert key_a.exists() and key_a != key_b
    key_b.write_bytes(key_a.read_bytes())  # b's entry now holds a's weights
    compiled = eclat.compile(b, x, autotune="fast", k=1, cache_dir=tmp_path, quiet=True)
    assert not compiled.report()["candidates"].get("cached")
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), b(*x), rtol=1e-3, atol=1e-4)
    key_b.write_bytes(b"not a zip")  # a damaged entry: compiled afresh as well
    again = eclat.compile(b, x, autotune="fast", k=1, cache_dir=tmp_path, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(again(*x), b(*x), rtol=1e-3, atol=1e-4)


def test_a_foreign_database_warns_and_still_compiles(tmp_path):
    bad = tmp_path / "tuning.db"
    bad.write_text("not sqlite")
    x = (torch.randn(2, 8),)
    model = Affine(0).eval()
    with pytest.warns(UserWarning, match="not a usable tuning database"):
        compiled = eclat.compile(model, x, autotune="fast", k=1, db=bad, cache_dir=tmp_path, quiet=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(*x), model(*x), rtol=1e-3, atol=1e-4)
    with pytest.raises(TypeError, match="db must be a path or a TuningDB"):
        eclat.compile(model, x, autotune="fast", k=1, db=42, cache_dir=tmp_path / "other", quiet=True)


def test_tuning_entries_are_kept_per_eclat_version(tmp_path, monkeypatch, one_grouping):
    """A schedule tuned by one version's code generation is not read by another's: the database's
    backend field carries eclat's source version, so a changed eclat tunes afresh."""
    from eclat.autotune import TuningDB, cache

    model, inputs = make_llama(layers=1, d=32, heads=2, ffn=64, vocab=64, seq=4)
    first = _compile(model, inputs, tmp_path, k=1)  # one candidate: the same program both times
    with TuningDB(tmp_path / "tuning.db") as db:
        backends = {e.key.backend for e in db.entries()}
    assert backends == {f"cpu@{cache.source_version()}"}
    monkeypatch.setattr(cache, "source_version", lambda: "another-eclat")
    second = _compile(model, inputs, tmp_path, k=1)
    one, two = first.report(), second.report()
    assert two["tuning_cache"] == one["tuning_cache"] and one["tuning_cache"]["misses"] > 0  # tuned afresh
    assert not two["candidates"].get("cached")
    torch.testing.assert_close(second(*inputs), first(*inputs))


def test_tuned_schedules_are_kept_only_when_the_whole_program_runs_faster(tmp_path, monkeypatch):
    """Kernels are tuned one at a time; when their tuned schedules together lose to the defaults
    the defaults run, the program says so, and later compiles (the choice in the database, the
    program cache) build the defaults without tuning again."""
    from dataclasses import replace

    from eclat.compiler import tune as tune_module

    class Sleeper:
        def __init__(self, seconds):
            self.seconds = seconds

        def run(self, inputs):
            time.sleep(self.seconds)
    assert pipeline._faster_first(Sleeper(0.0), Sleeper(0.002), [])
    assert not pipeline._faster_first(Sleeper(0.002), Sleeper(0.0), [])

    def unroll_everything(program, *args, **kwargs):  # a "tuned" schedule that differs from the default
        for k in program.kernels:
            k.schedule = replace(k.schedule, unroll=3)
        return {"tuned": len(program.kernels)}
    monkeypatch.setattr(tune_module, "tune", unroll_everything)
    monkeypatch.setattr(pipeline, "_faster_first", lambda a, b, arrays: False)  # the defaults win
    model, inputs = Affine(0), (torch.randn(4, 8),)
    first = eclat.compile(model, inputs, autotune="fast", cache_dir=tmp_path, quiet=True)
    assert all(k.schedule.unroll != 3 for k in first.executable.program.kernels)
    calls = []
    monkeypatch.setattr(tune_module, "tune", lambda *a, **k: calls.append(1) or {"tuned": 0})
    for _ in range(2):  # the program cache, then (without it) the database's choice
        again = eclat.compile(model, inputs, autotune="fast", cache_dir=tmp_path, quiet=True)
        assert calls == [] and all(k.schedule.unroll != 3 for k in again.executable.program.kernels)
        torch.testing.assert_close(again(*inputs), first(*inputs))
        for f in (tmp_path / "programs").glob("*.zip"):
            f.unlink()


@pytest.mark.parametrize("tuned_faster", [True, False])
def test_the_untuned_build_goes_before_a_tuned_build_that_packs_weights_anew(tmp_path, monkeypatch,
                                                                             tuned_faster):
    """Where the tuned schedules read HOLD_BOTH_BYTES of weights in other ways, the untuned build is
    timed and let go before the tuned one is built (the two held a packed copy each: GPT-2's compile
    peaked there); the tuned program is kept when it runs faster, else the defaults are built again."""
    import weakref
    from dataclasses import replace

    from eclat.compiler import tune as tune_module

    def unroll_everything(program, *args, **kwargs):  # a "tuned" schedule that differs from the default
        for k in program.kernels:
            k.schedule = replace(k.schedule, unroll=3)
        return {"tuned": len(program.kernels)}
    monkeypatch.setattr(tune_module, "tune", unroll_everything)
    monkeypatch.setattr(pipeline, "HOLD_BOTH_BYTES", 0)
    monkeypatch.setattr(pipeline, "_faster_first", lambda *a: pytest.fail("both builds were held"))
    times = iter([2.0, 1.0] if tuned_faster else [1.0, 2.0])  # the untuned build's, then the tuned's
    monkeypatch.setattr(pipeline, "_median_us", lambda exe, arrays: next(times))
    untuned, alive = [], []
    real_tuned, real_build = pipeline._tuned, pipeline.verified_build

    def tuned(program, target, device, mode, threads, db, arrays, reference, before, bars):
        untuned.append(weakref.ref(before[0]))
        return real_tuned(program, target, device, mode, threads, db, arrays, reference, before, bars)

    def build(*args, **kwargs):
        alive.extend(ref() is not None for ref in untuned)
        return real_build(*args, **kwargs)
    monkeypatch.setattr(pipeline, "_tuned", tuned)
    monkeypatch.setattr(pipeline, "verified_build", build)
    model, inputs = Affine(0), (torch.randn(4, 8),)
    compiled = eclat.compile(model, inputs, autotune="fast", cache_dir=tmp_path, quiet=True)
    assert len(alive) == (1 if tuned_faster else 2) and not any(alive)
    assert all((k.schedule.unroll == 3) == tuned_faster for k in compiled.executable.program.kernels)
    torch.testing.assert_close(compiled(*inputs), model(*inputs))


def test_the_program_cache_keeps_the_most_recently_used_within_its_size(tmp_path):
    import os

    folder = tmp_path / "programs"
    folder.mkdir()
    for i, size in enumerate([300, 300, 300, 300]):  # written in this order, one second apart
        f = folder / f"p{i}.zip"
        f.write_bytes(b"x" * size)
        os.utime(f, (1000 + i, 1000 + i))
    os.utime(folder / "p0.zip", (2000, 2000))  # read since: the most recent
    program_cache.trim(folder, limit=700)
    assert sorted(f.name for f in folder.iterdir()) == ["p0.zip", "p3.zip"]
    model, inputs = Affine(0), (torch.randn(4, 8),)
    eclat.compile(model, inputs, autotune="fast", cache_dir=tmp_path, quiet=True)  # one more, under 2 GiB
    assert len(list(folder.glob("*.zip"))) == 3


def test_candidates_race_in_turns_so_a_fast_spell_favours_none(monkeypatch):
    """The machine runs fast (x0.7) for the first timing only. The first timings alone would pick
    candidate 0 (7 against 8 and 9); the survivors timed again in turns pick the truly fastest,
    candidate 1. A candidate that fails to run in the race is left out of it."""
    from types import SimpleNamespace

    cost = {"p0": 10.0, "p1": 8.0, "p2": 9.0, "p3": 1.0}
    calls = []

    def fake_time(exe, arrays):
        if exe.name == "p3" and calls.count("p3"):
            raise RuntimeError("it ran off the end of a buffer")
        calls.append(exe.name)
        return (cost[exe.name] * (0.7 if len(calls) == 1 else 1.0) + 5.0 * (exe.name == "p3")) * 1e6

    def programs(candidates, device, threads, target, errors, shapes=None, enough=None):
        return [(0.0, n, True, SimpleNamespace(name=f"p{n}", kernels=[]), 0) for n in range(4)]
    monkeypatch.setattr(pipeline, "_programs", programs)
    monkeypatch.setattr(pipeline, "verified_build", lambda program, *args: program)
    monkeypatch.setattr(pipeline, "_sample_us", fake_time)
    seconds, exe, program, stats = pipeline._pick([None] * 4, None, None, "full", 1, [], lambda n: None, True)
    assert (stats.chosen, seconds, stats.timed) == (1, 8.0, 4)
    assert calls[:4] == ["p0", "p1", "p2", "p3"] and calls[4:7] == ["p0", "p1", "p2"]


def test_a_search_keeps_the_packed_weights_another_program_holds(tmp_path, monkeypatch):
    """A one-row product tuned beside a program that holds its weight packed keeps that packing
    unless another is clearly faster (compiler.tune.NEW_COPY_PENALTY): timed alone, a fresh copy (in
    cache) beat the held one, where a decode beside its prefill ran level at either (GPT-2)."""
    from eclat.backends.cpu.trials import Trials
    from eclat.compiler import derived, tune

    torch.manual_seed(0)
    linear = torch.nn.Linear(768, 1024, bias=False).eval()  # 3 MB of weight
    rows = eclat.compile(linear, (torch.randn(64, 768),), autotune="none", cache_dir=tmp_path / "rows")
    width = {k.schedule.tile[1] for k in rows.executable.program.kernels if k.schedule.tile}
    real = Trials.__call__

    def fresh_copies_faster(self, kernel, schedule):
        timer = real(self, kernel, schedule)  # held, as the real timer holds its build
        return lambda: (timer, 1.3 if schedule.tile and schedule.tile[1] in width else 1.0)[1]
    monkeypatch.setattr(Trials, "__call__", fresh_copies_faster)
    monkeypatch.setattr(pipeline, "_faster_first", lambda tuned, untuned, arrays: True)  # kernels decide
    held = derived.held()
    x = torch.randn(1, 768)
    one = eclat.compile(linear, (x,), autotune="fast", cache_dir=tmp_path / "one")
    new = [k for k in derived.held() - held
           if k[3][0] == "panels" and derived.nbytes(k) >= tune.NEW_COPY_BYTES]
    widths = {k.schedule.tile[1] for k in one.executable.program.kernels if k.schedule.tile}
    assert not new and widths == width
    torch.testing.assert_close(one(x), linear(x), rtol=1e-4, atol=1e-4)
    assert rows(torch.randn(64, 768)).shape == (64, 1024)  # still held


def test_a_one_row_product_reads_the_packed_weight_another_program_holds_untimed(tmp_path, monkeypatch):
    """A matrix-vector product whose weight another program holds packed (a decode beside its
    prefill) reads that copy at its panel width, whichever width that is, and is not timed at
    others (each would pack the weight again): no new packed form, the same answers."""
    from eclat.backends.cpu import host, schedules
    from eclat.backends.cpu.trials import Trials
    from eclat.compiler import derived, tune

    wide = 3 * host.vector_lanes()  # a width the one-row default is not, held by the other program
    default_tile = schedules._tile_for
    monkeypatch.setattr(schedules, "_tile_for", lambda rows, lanes, registers: (4, wide) if rows >= 4
                        else default_tile(rows, lanes, registers))
    torch.manual_seed(0)
    linear = torch.nn.Linear(768, 1024, bias=False).eval()
    rows = eclat.compile(linear, (torch.randn(64, 768),), autotune="none", cache_dir=tmp_path / "rows")
    assert {k.schedule.tile[1] for k in rows.executable.program.kernels if k.schedule.tile} == {wide}
    monkeypatch.setattr(schedules, "_tile_for", default_tile)
    timed = []
    real = Trials.__call__
    monkeypatch.setattr(Trials, "__call__", lambda self, kernel, schedule: timed.append(schedule.tile)
                        or real(self, kernel, schedule))
    held = derived.held()
    x = torch.randn(1, 768)
    one = eclat.compile(linear, (x,), autotune="fast", cache_dir=tmp_path / "one")
    new = [k for k in derived.held() - held
           if k[3][0] == "panels" and derived.nbytes(k) >= tune.NEW_COPY_BYTES]
    tiles = [k.schedule.tile for k in one.executable.program.kernels if k.schedule.tile]
    assert tiles == [(1, wide)] and not new and not timed
    torch.testing.assert_close(one(x), linear(x), rtol=1e-4, atol=1e-4)
    alone = eclat.compile(torch.nn.Linear(768, 1024, bias=False).eval(), (x,), autotune="fast",
                          cache_dir=tmp_path / "alone")
    assert timed and alone.executable.program.kernels  # held by nothing else: timed as before


def test_a_schedule_that_copies_a_large_weight_is_timed_and_let_go(tmp_path, monkeypatch):
    """Candidates whose builds pack RELEASE_BYTES anew are timed at once and dropped, so a kernel's
    search holds one new copy of a large weight at a time, not one per panel width."""
    from eclat.backends.cpu.trials import Trials
    from eclat.compiler import derived, tune

    monkeypatch.setattr(tune, "RELEASE_BYTES", 1 << 20)  # the 3 MB weight below counts as large
    real, alive = Trials.__call__, []

    def counted(self, kernel, schedule):
        timer = real(self, kernel, schedule)
        alive.append(sum(k[3][0] == "panels" and derived.nbytes(k) >= 1 << 20 for k in derived.held()))
        return timer
    monkeypatch.setattr(Trials, "__call__", counted)
    linear = torch.nn.Linear(768, 1024, bias=False).eval()
    x = torch.randn(1, 768)
    one = eclat.compile(linear, (x,), autotune="fast", cache_dir=tmp_path)
    assert len(alive) >= 3 and max(alive) <= 2  # the untuned program's copy and the candidate's own
    torch.testing.assert_close(one(x), linear(x), rtol=1e-4, atol=1e-4)
