"""compile_model: frontend -> e-graph candidates -> kernels -> backend -> time -> verify -> tune.

The e-graph's candidates are grouped into kernels and ordered by their roofline estimate on
the measured device model. "full" compiles, verifies and times every candidate; "fast" at
most FAST_CANDIDATES of them, skipping any whose estimate cannot beat the best time so far
(roofline pruning). The fastest verified one is kept, then its kernel schedules are tuned.
A candidate that fails to compile or to verify is skipped (and reported), never kept; if
none survives, the first error is raised.

The tuning database remembers, per graph and device, which candidate won and each kernel's
schedule, so a second compile of the same model builds only that candidate and reads its
schedules: the final program is still verified against the reference.

A GPU target whose device is absent here (CUDA without a CUDA device, Metal off macOS) keeps
the first candidate with default schedules, unverified and untimed, so that an artifact can
be written now and run (or tuned) on the hardware later.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import statistics
import sys
import threading
import time
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ..autotune.progress import progress
from ..backends import get_backend
from ..errors import EclatError
from ..ir.graph import Graph, numel
from ..ir.interpreter import run as interpret
from .group import group
from .kernel import Program, bytes_moved, flops
from .model import CompiledModel, InputSpec, _leaves, input_structure
from .tune import in_turns

RTOL, ATOL = 1e-3, 1e-4
AUTOTUNE_MODES = ("none", "fast", "full")
FAST_CANDIDATES = 4  # programs timed at most in "fast" mode, best roofline estimates first
REFERENCE_BUDGET = 20_000_000  # elements the reference interpreter may touch on the lowered graph
PROGRAM_CACHE_BYTES = 2 << 30  # chosen programs kept on disk (with their weights), least recently used out


def compile_model(model: Any, example_inputs: Any, target: str = "cpu", *, threads: int | None = None,
                  autotune: str = "fast", cache_dir: str | os.PathLike | None = None,
                  db: Any = None, k: int = 8, verify: bool = True, quiet: bool = False) -> CompiledModel:
    """Compile model for target. threads: CPU threads per kernel (default 1: predictable, and
    no oversubscription when the caller runs several models); autotune: "none" keeps the
    default schedules and skips device measurement (candidates are still timed: the e-graph's
    first can be several times slower than another); db: the tuning database (a path or a
    TuningDB; default <cache_dir>/tuning.db) to read and record choices in."""
    start = time.perf_counter()
    if autotune not in AUTOTUNE_MODES:
        raise ValueError(f"autotune must be one of {AUTOTUNE_MODES}, given {autotune!r}")
    threads = 1 if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be at least 1, given {threads}")
    if not isinstance(example_inputs, tuple):
        example_inputs = tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,)
    from ..frontend import lower

    structure = input_structure(example_inputs)
    arrays = [_numpy(x) for x in _leaves(example_inputs, structure, "example_inputs")]
    graph = lower(model, example_inputs)
    remember = None
    if autotune != "none" and verify:
        remember = _program_cache(graph, target, autotune, k, threads, cache_dir)
        cached = _from_program_cache(remember, graph, structure, model, example_inputs, arrays, target,
                                     threads, autotune, cache_dir, db, quiet, start)
        if cached is not None:
            return cached
    return compile_graph(graph, arrays, target, threads=threads, autotune=autotune, cache_dir=cache_dir,
                         db=db, k=k, verify=verify, quiet=quiet, start=start, remember=remember,
                         in_structure=structure)


def compile_graph(graph: Graph, arrays: list[np.ndarray], target: str = "cpu", *, threads: int = 1,
                  autotune: str = "fast", cache_dir: str | os.PathLike | None = None, db: Any = None,
                  k: int = 8, verify: bool = True, quiet: bool = False, start: float | None = None,
                  remember: Path | None = None, in_structure: Any = None) -> CompiledModel:
    """The pipeline from a primitive graph and example input arrays. remember: where to keep the
    chosen candidate for the next compile of the same model (see _program_cache); in_structure: how
    a call's inputs nest (model.input_structure; default flat)."""
    start = time.perf_counter() if start is None else start
    backend = get_backend(target)
    bars = True if quiet else None  # progress bars: on a terminal, unless quiet
    with progress(total=1, desc="e-graph", quiet=bars) as bar:
        candidates, egraph = _candidates(graph, target, k)
        bar.update()
    missing = device_missing(target)
    if missing:
        return _deferred(graph, candidates, backend, target, threads, egraph, missing, start, in_structure)
    device = _device(target, threads, cache_dir) if autotune != "none" else None
    tdb, owned = _open_db(db, cache_dir) if device is not None else (None, False)
    try:
        reference = interpret(_reference_graph(graph, candidates), arrays) if verify else None
        hits, misses = (tdb.hits, tdb.misses) if tdb is not None else (0, 0)
        chosen_key = _choice_key(graph, autotune, k, backend.name, device) if tdb is not None else None
        known, tuned = _known_choice(tdb, chosen_key, len(candidates))
        built = None
        grouped = _programs([candidates[known]], device, threads, []) if known is not None else []
        if grouped:  # the database's winner, built with its schedules, verified
            built = _build_remembered(grouped[0][2], backend, device, autotune, threads, tdb, arrays,
                                      reference, tuned, bars)
        if built is not None:
            exe, program = built
            picked = {"errors": [], "timed": 0, "pruned": len(candidates) - 1}
            n = known
        else:
            picked = _pick(candidates, backend, device, autotune, threads, arrays, reference, bars)
            seconds, exe, program, n = picked["best"]
            tuned = False
            if tdb is not None:
                exe, tuned = _tuned(program, backend, device, autotune, threads, tdb, arrays, reference, exe,
                                    bars)
                tdb.put(chosen_key, {"candidate": n, "tuned": tuned}, seconds * 1e6)
        errors = picked["errors"]
        for line in errors if not quiet else ():
            print(f"eclat: skipped {line}")
        counts = {"hits": tdb.hits - hits, "misses": tdb.misses - misses} if tdb is not None else {
            "hits": 0, "misses": 0}
    finally:
        if owned:
            tdb.close()
    report = _report(target, threads, device, egraph, len(candidates), picked["timed"], program, exe, start,
                     errors)
    report["candidates"]["pruned"] = picked["pruned"]
    report["candidates"]["chosen"] = n
    report["tuning_cache"] = counts
    if remember is not None:
        _write_program_cache(remember, program, tuned, report)
    if autotune != "none":
        _measure(report, exe, program, arrays, device)
    return CompiledModel(exe, _specs(graph), graph.out_spec, report, in_structure)


def _specs(graph: Graph) -> list[InputSpec]:
    return [InputSpec(str(n.arg), tuple(int(d) for d in n.shape), n.dtype, graph.index_ranges.get(n.arg),
                      n.arg in graph.divisors) for n in graph.inputs]


def _candidates(graph: Graph, target: str, k: int) -> tuple[list[Graph], dict]:
    try:
        optimize = _rewrites().optimize
    except ImportError:
        return [graph], {}
    opt = optimize(graph, target, k)
    return (opt.candidates or [graph]), dict(opt.stats)


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


def _programs(candidates: list[Graph], device: Any, threads: int,
              errors: list[str]) -> list[tuple[float, int, Program]]:
    """(roofline estimate, candidate number, program), most promising first."""
    programs = []
    for n, cand in enumerate(candidates):
        try:
            program = group(cand)
        except Exception as e:  # a broken candidate must not take the compile down
            errors.append(f"candidate {n}: {type(e).__name__}: {e}")
            continue
        for kern in program.kernels:
            kern.schedule = replace(kern.schedule, threads=threads)
        programs.append((_estimate_us(program, device), n, program))
    return sorted(programs, key=lambda p: (p[0], p[1]))  # then the e-graph's own order


def _pick(candidates: list[Graph], backend: Any, device: Any, mode: str, threads: int,
          arrays: list[np.ndarray], reference: list[np.ndarray] | None, bars: bool | None) -> dict:
    """The fastest verified candidate: {"best": (seconds, exe, program, n), "errors", "timed", "pruned"}."""
    errors: list[str] = []
    programs = _programs(candidates, device, threads, errors)
    limit = FAST_CANDIDATES if mode == "fast" else len(programs)
    race = len(programs) > 1
    built: list[tuple[float, Any, Program, int]] = []
    timed = pruned = 0
    for estimate, n, program in progress(programs, desc="candidates", quiet=bars, unit="program"):
        if len(built) >= limit or (built and mode != "full" and device is not None
                                   and _prune(estimate, min(built, key=_seconds)[0] * 1e6)):
            pruned += 1
            continue
        try:
            exe = _verified_build(program, backend, threads, arrays, reference)
            seconds = _time(exe, arrays) if race else 0.0
            timed += race
        except Exception as e:  # a crash of the JIT or a wrong answer: skip the candidate
            errors.append(f"candidate {n}: {type(e).__name__}: {e}")
            continue
        built.append((seconds, exe, program, n))
    if not built:
        raise EclatError("no candidate compiled and verified:\n  " + "\n  ".join(errors))
    if len(built) > 1:  # the first timings decided what to prune; the survivors race in turns
        again = in_turns([_race_timer(b[1], arrays) for b in built], combine=statistics.median)
        if any(t is not None for t in again):
            built = [(t, *b[1:]) for t, b in zip(again, built) if t is not None]
    return {"best": min(built, key=_seconds), "errors": errors, "timed": timed, "pruned": pruned}


def _seconds(built: tuple) -> float:
    return built[0]


def _build_remembered(program: Program, backend: Any, device: Any, mode: str, threads: int, db: Any,
                      arrays: list[np.ndarray], reference: list[np.ndarray] | None, tuned: bool,
                      bars: bool | None) -> tuple[Any, Program] | None:
    """A remembered winner built once and verified: with the database's schedules if it won tuned
    (tuning those absent), else with its own; None when it no longer builds or verifies (then the
    caller searches)."""
    if tuned:
        exe, _ = _tuned(program, backend, device, mode, threads, db, arrays, reference, None, bars)
        return None if exe is None else (exe, program)
    try:
        return _verified_build(program, backend, threads, arrays, reference), program
    except Exception:
        return None


def _tuned(program: Program, backend: Any, device: Any, mode: str, threads: int, db: Any,
           arrays: list[np.ndarray], reference: list[np.ndarray] | None, untuned: Any,
           bars: bool | None) -> tuple[Any, bool]:
    """Tune the chosen program's schedules: (executable, whether it runs the tuned ones). The untuned
    build is kept when tuning fails, or when it runs the whole program faster: kernels tuned one at
    a time do not see what they cost each other (data moving between cores, caches they evict)."""
    defaults = [k.schedule for k in program.kernels]
    try:
        if hasattr(backend, "tune"):  # GPU backends search their own schedule space
            schedules = backend.tune(program, [np.ascontiguousarray(a) for a in arrays], mode, db,
                                     device.fingerprint)
            tuned = _verified_build(program, backend, threads, arrays, reference, schedules=schedules)
        else:
            from .tune import tune

            tune(program, backend, device, db, mode, threads, quiet=bars)
            tuned = _verified_build(program, backend, threads, arrays, reference)
        keep_tuned = untuned is None or _faster_first(tuned, untuned, arrays)
    except Exception:  # never a fast wrong answer: fall back to the verified default schedules
        keep_tuned = False
    if keep_tuned:
        return tuned, True
    for k, s in zip(program.kernels, defaults):  # the program describes what runs
        k.schedule = s
    return untuned, False


def _faster_first(a: Any, b: Any, arrays: list[np.ndarray]) -> bool:
    """Whether a runs arrays faster than b, timed in turns so that drift falls on both."""
    ta, tb = in_turns([_race_timer(a, arrays), _race_timer(b, arrays)], combine=statistics.median)
    return tb is None or (ta is not None and ta <= tb)


def _race_timer(exe: Any, arrays: list[np.ndarray]) -> Callable[[], float]:
    """One turn of a race between whole programs: a short timing (one run if a run is longer)."""
    return lambda: _time(exe, arrays, budget=0.05, most=10, least=1)


def _open_db(db: Any, cache_dir: str | os.PathLike | None) -> tuple[Any, bool]:
    """(TuningDB, whether this compile opened it and must close it)."""
    from ..autotune import TuningDB

    if isinstance(db, TuningDB):
        return db, False
    if db is not None and not isinstance(db, (str, os.PathLike)):
        raise TypeError(f"db must be a path or a TuningDB, given {type(db).__name__}")
    return TuningDB(db, cache=cache_dir, on_error="warn"), True


# --- the program cache: a second compile of the same model skips export, e-graph and grouping -------

def _program_cache(graph: Graph, target: str, mode: str, k: int, threads: int,
                   cache_dir: str | os.PathLike | None) -> Path:
    """Where the chosen candidate's kernels for this graph are kept: keyed by the lowered graph (its
    ops, constants, shapes and dtypes: everything the model's code and arguments decide), its weights'
    values, the options and eclat's own sources. A hit is still checked against the model run by torch."""
    from ..autotune.cache import cache_dir as root
    from ..autotune.cache import source_version

    h = hashlib.sha256(f"{target}|{mode}|{k}|{threads}|{source_version()}|{graph}".encode())
    for name, w in sorted(graph.weights.items()):
        w = np.ascontiguousarray(w)
        h.update(f"{name}|{w.shape}|{w.dtype}".encode())
        h.update(w.view(np.uint8).reshape(-1).data if w.size else b"")
    return root(cache_dir) / "programs" / f"{h.hexdigest()[:32]}.zip"


def _write_program_cache(path: Path, program: Program, tuned: bool, report: dict) -> None:
    """Keep the chosen candidate's kernels as data, in the artifact's encoding, with the report of the
    search that chose it and a digest of both (atomically; a cache that cannot be written is only
    slower). The inputs' and outputs' structure is not kept: the next compile lowers the model again."""
    from safetensors.numpy import save

    from .artifact import encode_program

    weights = {b.name: np.ascontiguousarray(b.data) for b in program.buffers.values() if b.data is not None}
    meta = json.dumps({"program": encode_program(program), "tuned": tuned, "report": report}).encode()
    data = save(weights) if weights else b""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with zipfile.ZipFile(tmp, "w") as z:
            z.writestr("program.json", meta)
            z.writestr("weights.safetensors", data)
            z.writestr("sha256", hashlib.sha256(meta + data).hexdigest())
        os.replace(tmp, path)
        _trim_program_cache(path.parent)
    except (OSError, TypeError, ValueError):
        pass


def _trim_program_cache(folder: Path, limit: int = PROGRAM_CACHE_BYTES) -> None:
    """Delete the least recently used programs until the folder holds at most limit bytes (each
    holds its model's weights, and every eclat version and model makes new ones). A program is
    used when written or read (reading touches it)."""
    files = []
    for f in folder.glob("*.zip"):
        try:
            st = f.stat()
        except OSError:  # another process trimmed it
            continue
        files.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in files)
    for _, size, f in sorted(files, key=lambda t: t[0]):
        if total <= limit:
            break
        f.unlink(missing_ok=True)
        total -= size


def _from_program_cache(path: Path, graph: Graph, in_structure: Any, model: Any, example_inputs: tuple,
                        arrays: list[np.ndarray], target: str, threads: int, mode: str, cache_dir: Any,
                        db: Any, quiet: bool, start: float) -> CompiledModel | None:
    """The remembered candidate built with the database's schedules and verified against the model
    as torch runs it; None when there is none, it is damaged (its digest) or it does not verify (then
    compile afresh). The inputs and outputs are the graph's, lowered from the model now."""
    from safetensors.numpy import load

    from .artifact import decode_program

    try:
        with zipfile.ZipFile(path) as z:
            meta, raw, digest = (z.read(name) for name in ("program.json", "weights.safetensors", "sha256"))
        if hashlib.sha256(meta + raw).hexdigest() != digest.decode():
            return None
        os.utime(path)  # used now: the last to be trimmed
        meta = json.loads(meta)
        program = decode_program(meta["program"], load(raw) if raw else {})
        tuned, searched = bool(meta["tuned"]), meta["report"]
        searched = {"egraph": dict(searched["egraph"]), "candidates": dict(searched["candidates"])}
        if program.input_shapes != [s.shape for s in _specs(graph)]:
            return None
    except Exception:  # none yet, or a truncated or foreign file: compile afresh (and overwrite it)
        return None
    backend = get_backend(target)
    device = _device(target, threads, cache_dir)
    if device is None or device_missing(target):
        return None
    import torch

    try:
        with torch.no_grad():
            reference = [_numpy(t) for t in torch.utils._pytree.tree_leaves(model(*example_inputs))]
    except Exception:  # a model torch cannot run eagerly here: no check, so no cache
        return None
    tdb, owned = _open_db(db, cache_dir)
    try:
        hits, misses = tdb.hits, tdb.misses
        built = _build_remembered(program, backend, device, mode, threads, tdb, arrays, reference, tuned,
                                  True if quiet else None)
        counts = {"hits": tdb.hits - hits + 1, "misses": tdb.misses - misses}  # + the program itself
    finally:
        if owned:
            tdb.close()
    if built is None:
        return None
    exe, program = built
    report = _report(target, threads, device, {}, 1, 0, program, exe, start, [])
    # the search's own figures (e-graph, candidates) from the compile that chose this program
    report.update(egraph=searched["egraph"], candidates={**searched["candidates"], "cached": True},
                  tuning_cache=counts)
    _measure(report, exe, program, arrays, device)
    return CompiledModel(exe, _specs(graph), graph.out_spec, report, in_structure)


def _choice_key(graph: Graph, mode: str, k: int, backend: str, device: Any) -> Any:
    """The database key of a graph's chosen candidate: its structure and shapes (not its weight
    values, which do not change which program is fastest), the search mode, k, backend and device."""
    from ..autotune import TuningKey
    from ..autotune.cache import versioned

    weights = sorted((name, w.shape, str(w.dtype)) for name, w in graph.weights.items())
    text = f"{graph}|{weights}|{mode}|k={k}"
    return TuningKey.make("program:" + hashlib.sha256(text.encode()).hexdigest()[:24], [], "",
                          versioned(backend), device.fingerprint)


def _known_choice(db: Any, key: Any, count: int) -> tuple[int | None, bool]:
    """The remembered candidate number (None if none) and whether it won with tuned schedules."""
    entry = db.get(key) if db is not None else None
    n = entry.schedule.get("candidate") if entry is not None else None
    tuned = entry.schedule.get("tuned", True) if entry is not None else True
    return (n if isinstance(n, int) and 0 <= n < count else None), bool(tuned)


def _estimate_us(program: Program, device: Any) -> float:
    """Roofline estimate of a whole program (0 without a device model: no pruning)."""
    if device is None:
        return 0.0
    from ..autotune import estimate_us

    return sum(estimate_us(flops(k), bytes_moved(k, program.buffers), device) for k in program.kernels)


def _prune(estimate_us: float, best_measured_us: float) -> bool:
    from ..autotune import should_prune

    return should_prune(estimate_us, best_measured_us)


def _reference_graph(graph: Graph, candidates: list[Graph]) -> Graph:
    """The graph whose interpretation is the reference: the model as lowered, unless
    interpreting it would materialise huge broadcast products (a matmul as sum(mul(expand,
    expand)) costs M*K*N memory in numpy); then the e-graph's first candidate, which keeps
    recognised contractions as composites that numpy runs directly. Rewrites are
    checked for soundness on their own, so either is a faithful reference."""
    work = sum(numel(n.shape) or 0 for n in graph.nodes())
    return graph if work <= REFERENCE_BUDGET or not candidates else candidates[0]


def _device(target: str, threads: int, cache_dir: str | os.PathLike | None) -> Any:
    try:
        from ..autotune import get_device

        return get_device(target, threads=threads, cache_dir=cache_dir)
    except (ImportError, EclatError):
        return None


# --- GPU targets without their device here ---------------------------------------------------------

def _cuda_missing() -> str | None:
    from ..backends.cuda.runtime import driver

    try:
        driver()
    except EclatError as e:
        return str(e)
    return None


def _metal_missing() -> str | None:
    from ..backends.metal.runtime import _metal

    try:
        metal = _metal()
    except EclatError as e:
        return str(e)
    return None if metal.MTLCreateSystemDefaultDevice() is not None else "no Metal device found"


# target kind -> () -> why its device cannot run here (None: it can); others always can try
DEVICE_PROBES = {"cuda": _cuda_missing, "metal": _metal_missing}


def device_missing(target: str) -> str | None:
    """Why target's device cannot run programs here; None when it can (or may: OpenCL, CPU)."""
    probe = DEVICE_PROBES.get(target.partition(":")[0])
    return probe() if probe is not None else None


class DeferredExecutable:
    """A GPU program rendered for a device absent here: it can be saved as an artifact (source,
    schedules, launch sizes); running it raises why it cannot run."""

    def __init__(self, program: Program, dialect: str, reason: str, schedules: dict | None = None):
        from ..backends.gpu_c import render_program

        self.program, self.reason = program, reason
        self.rendered = render_program(program, dialect, schedules)
        self.loaded_from = "source"

    def run(self, inputs: list[np.ndarray]) -> list[np.ndarray]:
        raise EclatError(f"cannot run this {self.rendered.dialect} program here: {self.reason}")


def _deferred(graph: Graph, candidates: list[Graph], backend: Any, target: str, threads: int, egraph: dict,
              reason: str, start: float, in_structure: Any) -> CompiledModel:
    errors: list[str] = []
    programs = _programs(candidates, None, threads, errors)
    if not programs:
        raise EclatError("no candidate could be grouped into kernels:\n  " + "\n  ".join(errors))
    _, n, program = programs[0]
    exe = DeferredExecutable(program, backend.name, reason)
    report = _report(target, threads, None, egraph, len(candidates), 0, program, exe, start, errors)
    report["candidates"]["chosen"] = n
    report["notes"] = [f"{reason}: kept candidate {n} with default schedules, unverified and untimed; "
                       f"tune it on the hardware (`eclat autotune`)"]
    return CompiledModel(exe, _specs(graph), graph.out_spec, report, in_structure)


# --- verification, timing, report ------------------------------------------------------------------

def _numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        return x.float().numpy() if str(x.dtype) == "torch.bfloat16" else x.numpy()
    return np.asarray(x)


def _verified_build(program: Program, backend: Any, threads: int, arrays: list[np.ndarray],
                    reference: list[np.ndarray] | None, **options: Any) -> Any:
    """program compiled, run once on arrays and its outputs checked against reference (raises
    when wrong): no executable leaves the pipeline unchecked."""
    exe = backend.compile(program, threads, **options)
    outs = exe.run([np.ascontiguousarray(a) for a in arrays])
    if reference is not None:
        _verify(outs, reference)
    return exe


def _verify(outs: list[np.ndarray], reference: list[np.ndarray]) -> None:
    for j, (o, r) in enumerate(zip(outs, reference)):
        r = np.asarray(r)
        if o.shape != r.shape:
            raise EclatError(f"output {j}: shape {o.shape}, reference {r.shape}")
        if r.dtype.kind in "biu":
            ok = np.array_equal(o, r)
        else:
            scale = max(1.0, float(np.max(np.abs(r[np.isfinite(r)]), initial=0.0)))
            ok = np.allclose(o, r, rtol=RTOL, atol=ATOL * scale, equal_nan=True)
        if not ok:
            err = np.max(np.abs(o.astype(np.float64) - r.astype(np.float64)), initial=0.0)
            raise EclatError(f"output {j} differs from the reference (max abs error {err:.3g})")


def _time(exe: Any, arrays: list[np.ndarray], budget: float = 0.2, most: int = 25, least: int = 3) -> float:
    """Median seconds of exe's runs: at least `least`, then more until `budget` or `most`."""
    inputs = [np.ascontiguousarray(a) for a in arrays]
    samples: list[float] = []
    spent = time.perf_counter()
    while len(samples) < most and (len(samples) < least or time.perf_counter() - spent < budget):
        t = time.perf_counter()
        exe.run(inputs)
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def _kernel_times_us(exe: Any, program: Program, arrays: list[np.ndarray]) -> list[float] | None:
    """Microseconds of each kernel alone: the CPU's profile, or a GPU's per-kernel timer."""
    inputs = [np.ascontiguousarray(a) for a in arrays]
    if hasattr(exe, "profile"):
        return exe.profile(inputs)
    if hasattr(exe, "time_kernel"):
        exe.run(inputs)  # every buffer holds real values
        return [exe.time_kernel(k.name) * 1e6 for k in program.kernels]
    return None


def _measure(report: dict, exe: Any, program: Program, arrays: list[np.ndarray], device: Any) -> None:
    """Fill each kernel's measured_us and the share of the roofline it achieves."""
    measured = _kernel_times_us(exe, program, arrays)
    for row, us in zip(report["kernels"], measured or ()):
        row["measured_us"] = round(us, 3)
        if device is not None and us > 0:
            row["roofline_share"] = round(row["estimated_us"] / us, 4)


def _report(target: str, threads: int, device: Any, egraph: dict, extracted: int, timed: int,
            program: Program, exe: Any, start: float, errors: list[str]) -> dict:
    dev = {"name": None, "fingerprint": None, "peak_gflops": None, "peak_gbps": None}
    if device is not None:
        dev = {"name": device.name, "fingerprint": device.fingerprint,
               "peak_gflops": device.gflops("float32"), "peak_gbps": device.peak_gbps}
    kernels = []
    for kern in program.kernels:
        f, b = flops(kern), bytes_moved(kern, program.buffers)
        est = None
        if device is not None:
            from ..autotune import estimate_us

            est = round(estimate_us(f, b, device), 3)
        kernels.append({"name": kern.name, "ops": kern.ops, "flops": f, "bytes": b,
                        "estimated_us": est, "measured_us": None, "roofline_share": None})
    plan = getattr(exe, "plan", None)
    return {
        "target": target,
        "device": dev,
        "egraph": {key: egraph.get(key) for key in ("enodes", "eclasses", "iterations", "seconds", "rules")},
        "candidates": {"extracted": extracted, "pruned": 0, "timed": timed, "failed": errors},
        "kernels": kernels,
        "memory": plan and {"arena_bytes": plan.arena_bytes, "without_reuse_bytes": plan.naive_bytes},
        "threads": threads,
        "compile_seconds": round(time.perf_counter() - start, 3),
        "tuning_cache": {"hits": 0, "misses": 0},
    }
