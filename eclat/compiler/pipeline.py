"""compile_model: frontend -> e-graph candidates -> kernels -> backend -> time -> verify -> tune.

The e-graph's candidates are grouped into kernels and chosen by the search (autotune/search.py)
in the order of their roofline estimate on the measured device model: "full" compiles, verifies
and times every candidate; "fast" and "none" at most RACED[mode] of them, skipping any whose estimate
cannot beat the best time so far (roofline pruning). The fastest verified one is kept, then its
kernel schedules are tuned by the same search (tune.py), and the tuned program is kept only if it
beats the untuned one, raced by the same search again. A candidate that fails to compile or to
verify is skipped (and reported), never kept; if none survives, the errors are raised.

Nothing here is specific to a target: each is looked up in eclat.backends by name.

The tuning database remembers, per graph and device, which candidate won and each kernel's
schedule, so a second compile of the same model builds only that candidate and reads its
schedules: the final program is still verified against the reference.

A GPU target whose device is absent here (CUDA without a CUDA device, Metal off macOS) keeps
the first candidate with default schedules, unverified and untimed, so that an artifact can
be written now and run (or tuned) on the hardware later.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..autotune.cache import caching_in
from ..autotune.measure import measure
from ..autotune.progress import progress
from ..autotune.roofline import estimate_us
from ..autotune.search import Candidate, TuningError, search
from ..backends import get_target
from ..errors import EclatError
from ..ir.graph import Graph
from ..ir.interpreter import run as interpret
from ..ir.symbolic import bind_sizes, dims, var_list
from . import derived, program_cache
from . import tune as tuning
from .buckets import Bucket, SizeBuckets, inputs_at, representatives, sizes_of
from .group import copies_windows, group
from .kernel import Program, as_attention, at_sizes, bytes_moved, flops, loads
from .layout import feature_maps
from .model import CompiledModel
from .phases import phase, recording
from .quantize import accuracy, check_mode, quantize
from .report import CandidateStats, CompileReport, DeviceSummary, EgraphStats
from .specs import InputSpec, input_structure, leaves
from .verify import reference_graph, to_numpy, verified_build, verify

AUTOTUNE_MODES = ("none", "fast", "full")
# programs timed at most, best roofline estimates first ("none", which tunes no schedule, races two:
# resnet18's compile took 10.5 s, 4 of them building and timing its four candidates)
RACED = {"fast": 4, "none": 2}
# seconds grouping may take before no more candidates are grouped (one at least; "full" groups all):
# a long recurrence's candidates take tens of seconds each (benchmarks/recurrent.py's LSTM over 100
# steps: 32 s), and a second one the same again for a program that timed alike
GROUPING_SECONDS = 30.0
# Timing the tuned build against the untuned one in turns holds both. Where the tuned schedules read
# at least this many bytes of weights in other ways (packed at other panel widths), the untuned build
# is timed first and let go before the tuned one is built: GPT-2's prefill held its output head's
# panels at two widths and half its blocks' twice, the compile's peak (1.76 GB, 3.5x its weights).
HOLD_BOTH_BYTES = 64 << 20
# one timing of a whole program: the least of up to SAMPLE_RUNS runs within SAMPLE_SECONDS, of
# SAMPLE_LEAST at least (noise only adds time). One run of inception_v3 (85 ms) per timing, on a
# shared 2-core VM, kept the untuned program where the tuned one ran 4% faster
SAMPLE_SECONDS = 0.05
SAMPLE_RUNS = 10
SAMPLE_LEAST = 3
MAX_DYNAMIC_SIZE = 1 << 24  # the largest bound a run-time size may have


def compile_model(model: Any, example_inputs: Any, target: str = "cpu", *, threads: int | None = None,
                  autotune: str = "fast", cache_dir: str | os.PathLike | None = None,
                  db: Any = None, k: int = 8, verify: bool = True, quiet: bool = False,
                  weights: str = "fp32", max_error: float | None = None,
                  dynamic_shapes: Any = None, program_cache_used: bool = True) -> CompiledModel:
    """Compile model for target. threads: CPU threads per kernel (default 1: predictable, and
    no oversubscription when the caller runs several models); autotune: "none" keeps the
    default schedules and neither reads nor writes the tuning database (the device is still measured,
    once per machine, for the roofline that ranks candidates, and candidates are still timed: the
    e-graph's first can be several times slower than another); db: the tuning database (a path or a
    TuningDB; default <cache_dir>/tuning.db) to read and record choices in; weights: "fp32", or a
    low-precision format for the weights of products (compiler.quantize: "bf16", "int8", "int4",
    "int4-128"), whose error on the example inputs is in the report; max_error: the largest
    relative error of an output that a quantization may cause (larger: EclatError); dynamic_shapes:
    torch.export's (a torch.export.Dim with a max for each size that varies): one program serves
    every size within the bounds, its buffers sized for the largest; program_cache_used: whether
    a search's choice is kept for the next compile of the same model, and looked for (compile_lm
    keeps its programs itself, so writing them twice is time and disk for nothing)."""
    start = time.perf_counter()
    if autotune not in AUTOTUNE_MODES:
        raise ValueError(f"autotune must be one of {AUTOTUNE_MODES}, given {autotune!r}")
    threads = 1 if threads is None else int(threads)
    check_mode(weights)
    if threads < 1:
        raise ValueError(f"threads must be at least 1, given {threads}")
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    from ..frontend import lower

    structure = input_structure(example_inputs)
    arrays = [to_numpy(x) for x in leaves(example_inputs, structure, "example_inputs")]
    # what the backend keeps goes to cache_dir too; packed forms held now are another program's
    with recording() as spent, caching_in(cache_dir), derived.compiling():
        with phase("lower"):
            graph = lower(model, example_inputs, dynamic_shapes=dynamic_shapes)
        _check_bounded(graph)
        arrays += [s.initial for s in graph.states]
        remember = None
        if program_cache_used and autotune != "none" and verify and weights == "fp32":  # checked, when read
            remember = program_cache.cache_path(graph, target, autotune, k, threads, cache_dir)
            cached = _from_program_cache(remember, graph, structure, model, example_inputs, arrays, target,
                                         threads, autotune, cache_dir, db, quiet, start)
            if cached is not None:
                return _spent(cached, spent)
        return _spent(compile_graph(graph, arrays, target, threads=threads, autotune=autotune,
                                    cache_dir=cache_dir, db=db, k=k, verify=verify, quiet=quiet, start=start,
                                    remember=remember, in_structure=structure, weights=weights,
                                    max_error=max_error), spent)


def _spent(compiled: CompiledModel, spent: dict[str, float]) -> CompiledModel:
    """compiled with the seconds each phase of its compile took in its report."""
    compiled.compile_report.phases = {name: round(s, 3) for name, s in spent.items()}
    return compiled


def compile_graph(graph: Graph, arrays: list[np.ndarray], target: str = "cpu", *, threads: int = 1,
                  autotune: str = "fast", cache_dir: str | os.PathLike | None = None, db: Any = None,
                  k: int = 8, verify: bool = True, quiet: bool = False, start: float | None = None,
                  remember: Path | None = None, in_structure: Any = None, weights: str = "fp32",
                  max_error: float | None = None) -> CompiledModel:
    """The pipeline from a primitive graph and example input arrays. remember: where to keep the
    chosen candidate for the next compile of the same model (see program_cache); in_structure: how
    a call's inputs nest (specs.input_structure; default flat); weights, max_error: as for
    compile_model."""
    start = time.perf_counter() if start is None else start
    backend = get_target(target)
    if not backend.runtime_sizes and any(var_list(d) for n in graph.inputs for d in dims(n.shape)):
        raise EclatError(f"dynamic_shapes: the {target} target compiles fixed sizes only; compile for "
                         f"target='cpu', or once per size")
    bars = True if quiet else None  # progress bars: on a terminal, unless quiet
    missing = backend.missing()
    with phase("device"):
        device = _device(target, threads, cache_dir) if not missing else None  # its roofline ranks programs
    with progress(total=1, desc="e-graph", quiet=bars) as bar:
        candidates, egraph = _candidates(graph, target, k, device)
        bar.update()
    exact = candidates
    if weights != "fp32":
        made: dict = {}  # one rounded array per weight, whichever candidates hold it
        candidates, keep = _rounded_most(candidates, weights, made)
        exact = [exact[j] for j in keep]
        if len(egraph.get("differs", ())) > max(keep):  # what each kept candidate differs in
            egraph = {**egraph, "differs": [egraph["differs"][j] for j in keep]}
    if missing:
        return _deferred(graph, candidates, backend, target, threads, egraph, missing, start, in_structure)
    tdb, owned = _open_db(db, cache_dir) if device is not None and autotune != "none" else (None, False)
    try:
        with phase("reference"):
            # (rounded candidates are a list: reading their formats folds nothing more)
            rounded = weights != "fp32" and any(c.formats for c in candidates)
            reference = _references(graph, candidates, arrays, rounded) if verify else lambda n: None
        hits, misses = (tdb.hits, tdb.misses) if tdb is not None else (0, 0)

        def key_of(sizes: str) -> Any:
            return _choice_key(graph, f"{autotune}|{weights}{sizes}", k, backend.name, device)

        def choose(at: list[np.ndarray], reference: Callable[[int], list[np.ndarray] | None],
                   sizes: str = "") -> tuple[Any, Program, CandidateStats, bool]:
            """The search's (executable, program, stats, tuned) at inputs `at`: the database's
            winner where it remembers one that still builds and verifies, else searched afresh."""
            key = key_of(sizes) if tdb is not None else None
            known, fused, pixels, tuned = _known_choice(tdb, key, len(candidates))
            grouped = _programs([candidates[known]], device, threads, backend, [], fused, layout=pixels) \
                if known is not None else []
            built = _build_remembered(grouped[0][3], backend, device, autotune, threads, tdb, at,
                                      reference(known), tuned, bars) if grouped else None
            if built is not None:  # the database's winner, built with its schedules, verified
                return (*built, CandidateStats(len(candidates), pruned=len(candidates) - 1, chosen=known,
                                               fused=fused, channels_last=pixels), tuned)
            seconds, exe, program, stats = _pick(candidates, backend, device, autotune, threads, at,
                                                 reference, bars)
            tuned = False
            if tdb is not None:
                untuned, exe = [exe], None  # _tuned may let it go (its packed weights) before building
                exe, tuned = _tuned(program, backend, device, autotune, threads, tdb, at,
                                    reference(stats.chosen), untuned, bars)
                tdb.put(key, {"candidate": stats.chosen, "fused": stats.fused, "layout": stats.channels_last,
                              "tuned": tuned}, seconds * 1e6)
            return exe, program, stats, tuned

        exe, program, stats, tuned = choose(arrays, reference)
        buckets = _size_buckets(graph, candidates, arrays, exe, stats, choose, tdb, key_of, verify,
                                rounded, backend, threads) \
            if program.sizes and tdb is not None else []
        for line in stats.failed if not quiet else ():
            print(f"eclat: skipped {line}")
        counts = {"hits": tdb.hits - hits, "misses": tdb.misses - misses} if tdb is not None else {
            "hits": 0, "misses": 0}
    finally:
        if owned:
            tdb.close()
    if verify:
        _verify_other_sizes(exe, program, candidates[stats.chosen] if weights != "fp32" else
                            reference_graph(graph, candidates), arrays)
    if any(b.kept for b in buckets):
        exe = SizeBuckets([Bucket(sizes_of(program.input_shapes, arrays), exe)] +
                          [Bucket(b.sizes, b.executable, b.exact) for b in buckets if b.kept])
    report = _report(target, threads, device, program, exe, start)
    report.buckets = [b.row() for b in buckets]
    if weights != "fp32":
        report.quantization = accuracy(exact[stats.chosen], candidates[stats.chosen], arrays)
        _refuse_error(report.quantization, max_error)
    stats.differences = list(egraph.get("differs", []))
    report.egraph, report.candidates, report.tuning_cache = _egraph_stats(egraph), stats, counts
    if autotune != "none":
        with phase("timing"):
            report.add_measured(_kernel_times_us(exe, program, arrays))
    if remember is not None:  # with its kernels' times, which the next compile reports again
        program_cache.write(remember, program, tuned, report.to_dict(),
                            [(b.sizes, b.program, b.tuned, b.exact) for b in buckets if b.kept])
    return CompiledModel(exe, _specs(graph), graph.out_spec, report, in_structure, graph.states)


@dataclasses.dataclass
class _Searched:
    """The search at another bucket's sizes: what it chose, and whether it beat the example's program."""

    sizes: dict[str, int]
    candidate: int | None
    kept: bool
    us: float | None = None  # its time at sizes
    example_us: float | None = None  # the example's program's time at sizes
    seconds: float = 0.0  # what searching and racing at sizes took
    executable: Any = None
    program: Program | None = None  # what executable was built from (its weights' data whole)
    tuned: bool = False  # its executable runs the schedules tuned at sizes
    exact: bool = False  # its executable runs these sizes alone (buckets.Bucket.exact)

    def row(self) -> dict[str, Any]:
        return {"sizes": self.sizes, "candidate": self.candidate, "kept": self.kept, "exact": self.exact,
                "us": self.us and round(self.us, 3), "seconds": round(self.seconds, 3),
                "example_us": self.example_us and round(self.example_us, 3)}


def _size_buckets(graph: Graph, candidates: list[Graph], arrays: list[np.ndarray], exe: Any,
                  stats: CandidateStats, choose: Callable, db: Any, key_of: Callable[[str], Any],
                  verify: bool, rounded: bool, target: Any, threads: int) -> list[_Searched]:
    """The search again at each representative's sizes (buckets.representatives), each winner raced
    against the example's program there and kept only when faster (the verdict remembered in db, so
    that the next compile neither searches nor races a bucket that lost). At the least sizes, the
    winner with every size a constant is raced too, and kept for exactly them where it wins."""
    out = []
    shapes = [n.shape for n in graph.inputs]
    for at, least in representatives(shapes, arrays):
        begun, sizes = time.perf_counter(), sizes_of(shapes, at)
        note = "|at=" + ",".join(f"{name}={n}" for name, n in sorted(sizes.items()))
        verdict = db.get(key_of(note + "|kept"))
        if verdict is not None and not verdict.schedule.get("kept"):
            out.append(_Searched(sizes, None, False))
            continue
        try:
            reference = _references(graph, candidates, at, rounded) if verify else lambda n: None
            other, program, chose, tuned = choose(at, reference, note)
            if verify:
                _verify_other_sizes(other, program, candidates[chose.chosen] if rounded else
                                    reference_graph(graph, candidates), at)
        except EclatError:  # nothing verified at these sizes: the example's program serves them
            out.append(_Searched(sizes, None, False))
            continue
        exact = False
        if least and (verdict is None or verdict.schedule.get("exact")):
            try:
                alone = at_sizes(program, sizes)
                built = verified_build(alone, target, threads, at, reference(chose.chosen))
                exact = verdict is not None or _faster_first(built, other, at)
            except Exception:  # a program for these sizes alone that fails: the one for every size serves
                pass
            other, program = (built, alone) if exact else (other, program)
        kept = verdict is not None or _bucket_wins(other, chose, exe, stats, at)
        db.put(key_of(note + "|kept"), {"kept": kept, "exact": exact}, 0.0)
        out.append(_Searched(sizes, chose.chosen, kept, _sample_us(other, at), _sample_us(exe, at),
                             time.perf_counter() - begun, other if kept else None, program, tuned,
                             exact and kept))
    return out


def _bucket_wins(other: Any, chose: CandidateStats, exe: Any, stats: CandidateStats,
                 at: list[np.ndarray]) -> bool:
    """Whether other, chosen at the sizes of at, is another program than exe and runs at faster."""
    same = chose.chosen == stats.chosen and [(k.shape, k.schedule) for k in other.program.kernels] == \
        [(k.shape, k.schedule) for k in exe.program.kernels]
    return not same and _faster_first(other, exe, at)


def _specs(graph: Graph) -> list[InputSpec]:
    return [InputSpec(str(n.arg), dims(n.shape), n.dtype, graph.index_ranges.get(n.arg),
                      n.arg in graph.divisors) for n in graph.inputs]


def _check_bounded(graph: Graph) -> None:
    """Refuse a size that varies without a maximum: buffers are sized for the largest call."""
    for n in graph.inputs:
        for axis, d in enumerate(dims(n.shape)):
            for v in var_list(d):
                if v.hi > MAX_DYNAMIC_SIZE or v.lo < 0:
                    raise EclatError(f"input {n.arg!r}, dimension {axis}: its size {v.name} ranges over "
                                     f"{v.lo}..{v.hi}; give it a maximum of at most {MAX_DYNAMIC_SIZE} "
                                     f"(torch.export.Dim(name, min=..., max=...)): buffers are sized for it")


def _verify_other_sizes(exe: Any, program: Program, reference: Graph, arrays: list[np.ndarray]) -> None:
    """Check a program with run-time sizes at sizes other than the example's, against reference."""
    other = _other_sizes(reference, arrays) if program.sizes else None
    if other is None:
        return
    with phase("verify"):
        try:
            verify(exe.run(other), interpret(reference, other),
                   [program.buffers[name].dtype for name in program.outputs])
        except EclatError as e:
            sizes = bind_sizes([dims(n.shape) for n in reference.inputs], [a.shape for a in other])
            raise EclatError(f"the compiled program is wrong at sizes {sizes}: {e}") from None


def _other_sizes(graph: Graph, arrays: list[np.ndarray]) -> list[np.ndarray] | None:
    """Inputs like arrays but with each run-time size moved (to its least value, or one past the
    example's when that is it), made by cycling the example's values along the axes that change;
    None when no size can move. A program checked at two sizes reads its sizes at run time."""
    specs = [dims(n.shape) for n in graph.inputs]
    env = bind_sizes(specs, [a.shape for a in arrays])
    bounds = {v.name: v for shape in specs for d in shape for v in var_list(d)}
    moved = {name: (v.lo if v.lo != env[name] else min(v.hi, env[name] + 1)) for name, v in bounds.items()}
    return None if moved == env else inputs_at(specs, arrays, moved)


def _egraph_stats(egraph: dict) -> EgraphStats:
    return EgraphStats(*(egraph.get(key) for key in ("enodes", "eclasses", "iterations", "seconds", "rules",
                                                      "stopped", "merged", "segments", "blocks")))


def _candidates(graph: Graph, target: str, k: int, device: Any = None) -> tuple[Sequence[Graph], dict]:
    """The e-graph's candidates, ranked by their estimated time on device (its measured roofline;
    the rewrites' default without one), each with its weight-only values computed when first read
    (rewrites.fold)."""
    try:
        rewrites = _rewrites()
    except ImportError:
        return [graph], {}
    from ..rewrites.extract import CPU, Roofline
    from ..rewrites.fold import Shared, fold_weights

    roof = CPU if device is None else Roofline(device.gflops("float32") * 1e9, device.peak_gbps * 1e9,
                                               device.launch_overhead_us * 1e-6)
    roof = dataclasses.replace(roof, windows_in_place="windows" in get_target(target).fused)
    with phase("e-graph"):
        opt = rewrites.optimize(graph, target, k, roof=roof)
    return _Folded(opt.candidates or [graph], fold_weights, Shared()), dict(opt.stats)


class _Folded(Sequence):
    """The candidates, each with its weight-only values computed when it is first read: a search
    that groups only the first few folds only those (resnet18 with `autotune="none"`: 8 folded,
    1.2 of its 9.9 s, where 2 to 4 are grouped)."""

    def __init__(self, raw: list[Graph], fold: Callable, shared: Any):
        self._raw, self._fold, self._shared, self._done = raw, fold, shared, {}

    def __len__(self) -> int:
        return len(self._raw)

    def __getitem__(self, n: int) -> Graph:
        n = range(len(self))[n]  # IndexError past the end, which ends an iteration
        if n not in self._done:
            with phase("fold"):  # one array per folded value, whichever candidates hold it (shared)
                self._done[n] = self._fold(self._raw[n], self._shared)
        return self._done[n]


def _rewrites() -> Any:
    """eclat.rewrites, imported on a thread of its own the first time: egglog keeps the frame that
    defines each of its classes, and a frame keeps its callers' frames alive; imported from inside a
    compile, those would be the caller's, and the first compiled model would never be freed."""
    name = __package__.rpartition(".")[0] + ".rewrites"
    if name not in sys.modules:
        loader = threading.Thread(target=importlib.import_module, args=(name,), daemon=True)
        loader.start()
        loader.join()
    return importlib.import_module(name)  # raises here if the thread's import failed


def _programs(candidates: list[Graph], device: Any, threads: int, target: Any, errors: list[str],
              fused: bool | None = None, shapes: list[tuple[int, ...]] | None = None,
              enough: int | None = None, layout: int | None = None
              ) -> list[tuple[float, int, bool, Program, int]]:
    """(roofline estimate, candidate number, whether the target's fused kernels are used, program with
    the target's default schedules, the positions of the largest feature map it computes channels-last
    or 0), most promising first. Each candidate is grouped with the target's fused kernels (attention
    in one kernel), channels-first and in each channels-last layout the target offers
    (`Target.channels_last`: the first only unless every candidate is grouped, "full") where it has
    such feature maps, and, where the fused kernels made any, without them too (channels-first):
    the search times each grouping. fused, layout: only that grouping (a remembered choice);
    shapes: the example inputs' (a program with run-time sizes is estimated at theirs, as it is
    timed); enough: no candidate is grouped once this many programs are, or past the first once
    grouping has taken GROUPING_SECONDS (the e-graph's cheapest first: grouping a language model's
    candidate takes seconds, and a "fast" search times only the best few)."""
    programs = []
    start = time.perf_counter()
    offered = target.channels_last if enough is None else target.channels_last[:1]  # "full": all
    for n, cand in enumerate(candidates):
        late = n >= 1 and time.perf_counter() - start > GROUPING_SECONDS
        if enough is not None and (len(programs) >= enough or late):
            break
        layouts = [0, *(p for p in offered if feature_maps(cand, p))] if layout is None else [layout]
        for with_fused in (True, False) if fused is None else (fused,):
            plain = None  # its channels-first program
            for pixels in layouts if with_fused or fused is not None else [0]:
                try:
                    with phase("group"):
                        program = group(cand, target.fused if with_fused else frozenset(), pixels)
                        weights = program.weights
                        for kern in program.kernels:
                            kern.schedule = target.default_schedule(kern, threads, weights)
                except Exception as e:  # a broken candidate must not take the compile down
                    errors.append(f"candidate {n}{f' (channels-last {pixels})' if pixels else ''}: "
                                  f"{type(e).__name__}: {e}")
                    continue
                if fused is None and with_fused and not all(map(target.runs_fused, program.kernels)):
                    break  # the target would run an attention as plain loops: only the other grouping
                sizes = bind_sizes(program.input_shapes, shapes) if shapes and program.sizes else {}
                estimate = _estimate_us(at_sizes(program, sizes), device)
                programs.append((estimate, n, with_fused, program, pixels))
                plain = plain or (program if not pixels else None)
            if fused is None and plain is not None and not any("attend" in k.ops for k in plain.kernels) and \
                    not ("windows" in target.fused and any(map(copies_windows, cand.nodes()))):
                break  # nothing fused: the other grouping is the same program
    return sorted(programs, key=lambda p: (p[0], p[1], not p[2], p[4]))  # then the e-graph's own order


def _pick(candidates: list[Graph], target: Any, device: Any, mode: str, threads: int,
          arrays: list[np.ndarray], reference: Callable[[int], list[np.ndarray] | None],
          bars: bool | None) -> tuple[float, Any, Program, CandidateStats]:
    """The fastest verified candidate, by the search: (seconds, executable, program, stats).
    reference(n): what candidate n is checked against."""
    errors: list[str] = []
    enough = None if mode == "full" else 2 * RACED[mode]
    programs = _programs(candidates, device, threads, target, errors, shapes=[a.shape for a in arrays],
                         enough=enough)
    gc.collect()  # grouping leaves cycles by the thousand: GPT-2's builds stacked on 0.1 GB of them
    # the e-graph's costliest were not grouped (enough of them, or grouping took its time)
    ungrouped = len(candidates) - 1 - max((p[1] for p in programs), default=len(candidates) - 1) \
        if enough is not None else 0
    built: dict[int, Any] = {}

    def time_fn(c: Candidate) -> float:
        try:
            if id(c) not in built:  # built and verified once, timed in every round
                built[id(c)] = verified_build(c.payload, target, threads, arrays,
                                              reference(c.schedule["candidate"]))
            return _sample_us(built[id(c)], arrays)
        except Exception as e:  # a crash of the JIT or a wrong answer: the search skips the candidate
            errors.append(f"candidate {c.schedule['candidate']}: {type(e).__name__}: {e}")
            raise

    cands = [Candidate({"candidate": n, "fused": fused, "layout": pixels,
                        "attention": any(as_attention(k) is not None for k in program.kernels)},
                       estimate, program) for estimate, n, fused, program, pixels in programs]
    offered = cands if mode == "full" else _spread(cands, RACED[mode])
    stats = CandidateStats(len(candidates), failed=errors)
    try:
        if not cands:
            raise TuningError("no candidate could be grouped into kernels")
        found = search(offered, time_fn=time_fn, mode="full" if mode == "full" else "fast",
                       limit=None if mode == "full" else len(offered), rounds=tuning.ROUNDS, quiet=bars,
                       desc="candidates")
    except TuningError:
        raise EclatError("no candidate compiled and verified:\n  " + "\n  ".join(errors)) from None
    stats.pruned = found.stats.pruned + ungrouped + len(cands) - len(offered)
    stats.timed, stats.chosen = found.stats.timed, found.winner.schedule["candidate"]
    stats.fused, stats.channels_last = found.winner.schedule["fused"], found.winner.schedule.get("layout", 0)
    return found.measured_us / 1e6, built[id(found.winner)], found.winner.payload, stats


def _spread(cands: list[Candidate], n: int) -> list[Candidate]:
    """The n candidates a fast search times: the best estimate of each grouping (attention in one
    kernel or not asked for, and found or not) first, then the next best estimates. An estimate can
    miss what a grouping does (a cache's update inlined into an attention that then ran as plain
    loops, 100x slower than estimated), so each grouping is measured at least once: asked for, the
    attention may not be found (GPT-2 over run-time lengths: only the candidate that stores its
    causal mask has one to fuse, and it was never timed)."""
    ordered = sorted(cands, key=lambda c: c.estimate_us)
    grouping = lambda c: (c.schedule["fused"], c.schedule.get("attention", False),  # noqa: E731
                          c.schedule.get("layout", 0))
    firsts = {id(next(c for c in ordered if grouping(c) == f)): None
              for f in dict.fromkeys(grouping(c) for c in ordered)}
    rest = [c for c in ordered if id(c) not in firsts]
    keep = set(firsts) | {id(c) for c in rest[:max(0, n - len(firsts))]}
    return [c for c in ordered if id(c) in keep]


def _rounded_most(candidates: list[Graph], mode: str, made: dict) -> tuple[list[Graph], list[int]]:
    """The candidates with their weights rounded to mode, keeping only those that round the most
    weight elements (and their numbers): a candidate that reads a weight in a form the format cannot
    follow (e.g. a product materialised before its sum) would keep it float32, which is not what
    `weights=` asked for."""
    rounded = [quantize(c, mode, made) for c in candidates]
    sizes = [sum(c.weights[name].size for name in c.formats) for c in rounded]
    keep = [j for j, size in enumerate(sizes) if size == max(sizes)]
    return [rounded[j] for j in keep], keep


def _references(graph: Graph, candidates: Sequence[Graph], arrays: list[np.ndarray], rounded: bool
                ) -> Callable[[int], list[np.ndarray]]:
    """What candidate n is verified against: the model's outputs by the interpreter; with rounded
    weights (compiler.quantize) the candidate's own outputs, as the model with those weights
    computes them, once per distinct set of rounded weights."""
    if not rounded:
        fixed = interpret(reference_graph(graph, candidates), arrays)
        return lambda n: fixed
    made: dict[tuple, list[np.ndarray]] = {}

    def of(n: int) -> list[np.ndarray]:
        c = candidates[n]
        key = tuple(id(c.weights[name]) for name in sorted(c.formats))
        if key not in made:
            made[key] = interpret(c, arrays)
        return made[key]
    return of


def _refuse_error(quantization: dict[str, Any], max_error: float | None) -> None:
    worst = max(quantization["outputs"], default=0.0)
    if max_error is not None and worst > max_error:
        raise EclatError(f"weights={quantization['weights']}: an output's relative error on the "
                         f"example inputs is {worst:.3g}, over max_error={max_error:g}")


def _sample_us(exe: Any, arrays: list[np.ndarray]) -> float:
    """One timing of a whole program: the least of a few runs."""
    inputs = [np.ascontiguousarray(a) for a in arrays]
    with phase("timing"):
        timing = measure(lambda: exe.run(inputs), warmup=0, repeats=SAMPLE_RUNS, max_seconds=SAMPLE_SECONDS,
                         at_least=SAMPLE_LEAST)
    return timing.min_us


def _build_remembered(program: Program, target: Any, device: Any, mode: str, threads: int, db: Any,
                      arrays: list[np.ndarray], reference: list[np.ndarray] | None, tuned: bool,
                      bars: bool | None) -> tuple[Any, Program] | None:
    """A remembered winner built once and verified: with the database's schedules if it won tuned
    (tuning those absent), else with its own; None when it no longer builds or verifies (then the
    caller searches)."""
    if tuned:
        exe, _ = _tuned(program, target, device, mode, threads, db, arrays, reference, [], bars)
        return None if exe is None else (exe, program)
    try:
        return verified_build(program, target, threads, arrays, reference), program
    except Exception:
        return None


def _tuned(program: Program, target: Any, device: Any, mode: str, threads: int, db: Any,
           arrays: list[np.ndarray], reference: list[np.ndarray] | None, untuned: list[Any],
           bars: bool | None) -> tuple[Any, bool]:
    """Tune the chosen program's schedules: (executable, whether it runs the tuned ones). The untuned
    build (the one item of `untuned`, taken from it so that it can be let go; none: nothing built) is
    kept when tuning fails, or when it runs the whole program faster: kernels tuned one at a time do
    not see what they cost each other (data moving between cores, caches they evict)."""
    defaults = [k.schedule for k in program.kernels]
    before = untuned.pop() if untuned else None
    had_before, before_us = before is not None, None
    try:
        with phase("tuning"):
            tuning.tune(program, target, device, db, mode, threads, arrays, quiet=bars)
            # the trials' builds, in reference cycles, hold the copies they packed until collected:
            # GPT-2's tuned build stacked on 0.2 GB of them (a collection here: 0.4 s)
            gc.collect()
        if before is not None and [k.schedule for k in program.kernels] == defaults:
            return before, True  # the defaults won every kernel: nothing else to build
        if before is not None and _rescheduled_weight_bytes(program, defaults) >= HOLD_BOTH_BYTES:
            before_us = _median_us(before, arrays)
            before = None  # its packed weights go before the tuned build packs them at other widths
            gc.collect()
        tuned = verified_build(program, target, threads, arrays, reference)
        keep_tuned = _faster_first(tuned, before, arrays) if before is not None else \
            before_us is None or _median_us(tuned, arrays) < before_us
    except Exception:  # never a fast wrong answer: fall back to the verified default schedules
        keep_tuned = False
    if keep_tuned:
        return tuned, True
    for k, s in zip(program.kernels, defaults):  # the program describes what runs
        k.schedule = s
    if before is None and had_before:  # let go above: built again, once the tuned build is gone
        tuned = None
        gc.collect()
        return verified_build(program, target, threads, arrays, reference), False
    return before, False


def _rescheduled_weight_bytes(program: Program, defaults: list[Any]) -> int:
    """Bytes of the weights read by the kernels whose schedules are no longer `defaults` (a backend
    packs a weight per schedule: its panels' width)."""
    names = {x.buffer for k, d in zip(program.kernels, defaults) if k.schedule != d for x in loads(k.body)}
    return sum(program.buffers[n].nbytes for n in names if program.buffers[n].role == "weight")


def _median_us(exe: Any, arrays: list[np.ndarray]) -> float:
    """A whole program's time: the median of tuning.ROUNDS samples."""
    return float(np.median([_sample_us(exe, arrays) for _ in range(tuning.ROUNDS)]))


def _faster_first(a: Any, b: Any, arrays: list[np.ndarray]) -> bool:
    """Whether executable a runs arrays faster than b, by the search (timed in turns)."""
    race = [Candidate({"program": "first"}, 0.0, a), Candidate({"program": "second"}, 0.0, b)]
    try:
        found = search(race, time_fn=lambda c: _sample_us(c.payload, arrays), mode="full",
                       rounds=tuning.ROUNDS, quiet=True, desc="tuned or not")
    except TuningError:
        return False
    return found.winner.payload is a


def _open_db(db: Any, cache_dir: str | os.PathLike | None) -> tuple[Any, bool]:
    """(TuningDB, whether this compile opened it and must close it)."""
    from ..autotune.db import TuningDB

    if isinstance(db, TuningDB):
        return db, False
    if db is not None and not isinstance(db, (str, os.PathLike)):
        raise TypeError(f"db must be a path or a TuningDB, given {type(db).__name__}")
    return TuningDB(db, cache=cache_dir, on_error="warn"), True


def _from_program_cache(path: Path, graph: Graph, in_structure: Any, model: Any, example_inputs: tuple,
                        arrays: list[np.ndarray], target: str, threads: int, mode: str, cache_dir: Any,
                        db: Any, quiet: bool, start: float) -> CompiledModel | None:
    """The remembered candidate built with the database's schedules and verified against the model
    as torch runs it; None when there is none, it is damaged or it does not verify (then compile
    afresh). The inputs and outputs are the graph's, lowered from the model now."""
    backend = get_target(target)
    kept = program_cache.read(path, backend.schedule_from)
    if kept is None or backend.missing():
        return None
    program, tuned, searched, buckets = kept
    if program.input_shapes != [s.shape for s in _specs(graph)]:
        return None
    device = _device(target, threads, cache_dir)
    if device is None:
        return None
    reference = _eager_reference(model, example_inputs)
    if reference is None:
        return None
    tdb, owned = _open_db(db, cache_dir)
    bars = True if quiet else None
    try:
        hits, misses = tdb.hits, tdb.misses
        built = _build_remembered(program, backend, device, mode, threads, tdb, arrays, reference, tuned,
                                  bars)
        others = []
        for sizes, other, other_tuned, exact in buckets if built is not None else ():
            # checked against the example's program, itself checked against torch
            at = inputs_at([dims(s) for s in program.input_shapes], arrays, sizes)
            made = at and _build_remembered(other, backend, device, mode, threads, tdb, at, built[0].run(at),
                                            other_tuned, bars)
            if made:
                others.append(Bucket(sizes, made[0], exact))
        counts = {"hits": tdb.hits - hits + 1, "misses": tdb.misses - misses}  # + the program itself
    finally:
        if owned:
            tdb.close()
    if built is None:
        return None
    exe, program = built
    if others:
        exe = SizeBuckets([Bucket(sizes_of(program.input_shapes, arrays), exe), *others])
    report = _report(target, threads, device, program, exe, start)
    # the search's own figures (e-graph, candidates, buckets) from the compile that chose this program
    searched = CompileReport.from_dict(searched)
    report.egraph, report.candidates, report.tuning_cache = searched.egraph, searched.candidates, counts
    report.buckets = searched.buckets
    report.candidates.cached = True
    # each kernel's time as the compile that chose the program measured it (profiling it again took
    # 0.23 of resnet18's 3.2 s from the cache)
    kept_times = [r.measured_us for r in searched.kernels]
    same = [r.name for r in searched.kernels] == [r.name for r in report.kernels] and None not in kept_times
    report.add_measured(kept_times if same else _kernel_times_us(exe, program, arrays))
    return CompiledModel(exe, _specs(graph), graph.out_spec, report, in_structure, graph.states)


def _eager_reference(model: Any, example_inputs: tuple) -> list[np.ndarray] | None:
    """The model's outputs as torch runs it (None where it cannot: then no check, so no cache). A
    model's buffers are cloned for the call: one it updates in place (a cache) is the user's, and
    stays as it was. The state updates eclat returns after the outputs are not checked here; the
    outputs read them."""
    import torch

    try:
        args, kwargs = tuple(example_inputs), {}
        if isinstance(model, torch.export.ExportedProgram):  # called as it was exported (keywords too)
            flat = torch.utils._pytree.tree_leaves(args)
            args, kwargs = torch.utils._pytree.tree_unflatten(flat, model.call_spec.in_spec)
            model = model.module()
        buffers = {name: b.clone() for name, b in model.named_buffers()}
        with torch.no_grad():
            out = torch.func.functional_call(model, buffers, args, kwargs, strict=False)
        return [to_numpy(t) for t in torch.utils._pytree.tree_leaves(out)]
    except Exception:  # a model torch cannot run eagerly here
        return None


def _choice_key(graph: Graph, mode: str, k: int, target: str, device: Any) -> Any:
    """The database key of a graph's chosen candidate: its structure and shapes (not its weight
    values, which do not change which program is fastest), the search mode, k, target and device."""
    weights = sorted((name, w.shape, str(w.dtype)) for name, w in graph.weights.items())
    text = f"{graph}|{weights}|{mode}|k={k}"
    return tuning.tuning_key("program:" + hashlib.sha256(text.encode()).hexdigest()[:24], [], "", target,
                             device)


def _known_choice(db: Any, key: Any, count: int) -> tuple[int | None, bool, int, bool]:
    """The remembered candidate number (None if none), whether it was grouped with the target's fused
    kernels, its channels-last layout (0: none) and whether it won with tuned schedules."""
    entry = db.get(key) if db is not None else None
    schedule = entry.schedule if entry is not None else {}
    n, pixels = schedule.get("candidate"), schedule.get("layout", 0)
    return (n if isinstance(n, int) and 0 <= n < count else None), bool(schedule.get("fused", True)), \
        (pixels if isinstance(pixels, int) else 0), bool(schedule.get("tuned", True))


def _estimate_us(program: Program, device: Any) -> float:
    """Roofline estimate of a whole program: on the measured device, else on the rewrites' default
    roofline (so that a candidate many times costlier than one timed is not timed, and cannot win
    by the noise of a loaded machine); 0 without the rewrites."""
    if device is None:
        try:
            roof = _rewrites().extract.CPU
        except ImportError:
            return 0.0
        return sum(roof.time(flops(k), bytes_moved(k, program.buffers)) for k in program.kernels) / 1e3
    return sum(estimate_us(flops(k), bytes_moved(k, program.buffers), device) for k in program.kernels)


def _device(target: str, threads: int, cache_dir: str | os.PathLike | None) -> Any:
    from ..autotune.device import get_device

    try:
        return get_device(target, threads=threads, cache_dir=cache_dir)
    except (ImportError, EclatError, NotImplementedError):
        return None


def device_missing(target: str) -> str | None:
    """Why target's device cannot run programs here; None when it can (or may: OpenCL, CPU)."""
    return get_target(target).missing()


def _deferred(graph: Graph, candidates: list[Graph], backend: Any, target: str, threads: int, egraph: dict,
              reason: str, start: float, in_structure: Any) -> CompiledModel:
    """The first candidate with default schedules, for a device absent here: saveable, not runnable."""
    errors: list[str] = []
    programs = _programs(candidates, None, threads, backend, errors, fused=True, layout=0)
    if not programs:
        raise EclatError("no candidate could be grouped into kernels:\n  " + "\n  ".join(errors))
    _, n, _, program, _ = programs[0]
    exe = backend.deferred(program, reason)
    report = _report(target, threads, None, program, exe, start)
    report.egraph = _egraph_stats(egraph)
    report.candidates = CandidateStats(len(candidates), failed=errors, chosen=n,
                                       differences=list(egraph.get("differs", [])))
    report.notes = [f"{reason}: kept candidate {n} with default schedules, unverified and untimed; "
                    f"tune it on the hardware (`eclat autotune`)"]
    return CompiledModel(exe, _specs(graph), graph.out_spec, report, in_structure, graph.states)


def _kernel_times_us(exe: Any, program: Program, arrays: list[np.ndarray]) -> list[float] | None:
    """Microseconds of each kernel alone: the CPU's profile, or a GPU's per-kernel timer."""
    inputs = [np.ascontiguousarray(a) for a in arrays]
    if hasattr(exe, "profile"):
        return exe.profile(inputs)
    if hasattr(exe, "time_kernel"):
        exe.run(inputs)  # every buffer holds real values
        return [exe.time_kernel(k.name) * 1e6 for k in program.kernels]
    return None


def _report(target: str, threads: int, device: Any, program: Program, exe: Any,
            start: float) -> CompileReport:
    plan = getattr(exe, "plan", None)
    memory = plan and {"arena_bytes": plan.arena_bytes, "without_reuse_bytes": plan.naive_bytes}
    report = CompileReport(target, threads, DeviceSummary.of(device), memory=memory,
                           compile_seconds=round(time.perf_counter() - start, 3))
    report.add_kernels(program, device)
    return report
