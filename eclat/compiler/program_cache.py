"""The program cache: a second compile of the same model skips the e-graph, grouping and the search.

One zip per model under <cache_dir>/programs/: the chosen program's kernels as data (the artifact's
encoding), its weights, the report of the search that chose it, and a digest of both. The key is the
lowered graph (ops, constants, shapes and dtypes: what the model's code and arguments decide), its
weights' values, the options and eclat's own sources. A hit is still verified by the caller."""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..ir.graph import Graph
from .buckets import merge_weights
from .encoding import decode_program, encode_program
from .kernel import Program
from .tensorfile import write_tensors

PROGRAM_CACHE_BYTES = 2 << 30  # chosen programs kept on disk (with their weights), least recently used out


def cache_path(graph: Graph, target: str, mode: str, k: int, threads: int,
               cache_dir: str | os.PathLike | None) -> Path:
    """Where the chosen program of graph compiled with these options is kept."""
    from ..autotune.cache import cache_dir as root
    from ..autotune.cache import source_version

    h = hashlib.sha256(f"{target}|{mode}|{k}|{threads}|{source_version()}|{graph}".encode())
    for name, w in sorted(graph.weights.items()):
        w = np.ascontiguousarray(w)
        h.update(f"{name}|{w.shape}|{w.dtype}".encode())
        h.update(w.view(np.uint8).reshape(-1).data if w.size else b"")
    return root(cache_dir) / "programs" / f"{h.hexdigest()[:32]}.zip"


def write(path: Path, program: Program, tuned: bool, report: dict[str, Any],
          buckets: list[tuple[dict[str, int], Program, bool, bool]] = ()) -> None:
    """Keep the chosen program with the report of the search that chose it (atomically; a cache that
    cannot be written is only slower), and the programs chosen at other sizes (compiler.buckets:
    (sizes, program, tuned, exact) each). The inputs' and outputs' structure is not kept: the next compile
    lowers the model again."""
    weights = {b.name: b.data for b in program.buffers.values() if b.data is not None}
    kept = [b for b in buckets if merge_weights(weights, {w.name: w.data for w in b[1].buffers.values()
                                                          if w.data is not None})]
    meta = json.dumps({"program": encode_program(program), "tuned": tuned, "report": report,
                       "buckets": [{"sizes": sizes, "program": encode_program(p), "tuned": t, "exact": e}
                                   for sizes, p, t, e in kept]}).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        with zipfile.ZipFile(tmp, "w") as z:
            z.writestr("program.json", meta)
            digest = write_tensors(z, "weights.safetensors", weights, hashlib.sha256(meta))
            z.writestr("sha256", digest)
        os.replace(tmp, path)
        trim(path.parent)
    except (OSError, TypeError, ValueError):
        pass


def read(path: Path, schedule_from: Any) -> tuple[Program, bool, dict[str, Any], list] | None:
    """(program, whether it won with tuned schedules, the search's report, the programs chosen at
    other sizes as (sizes, program, tuned, exact)) kept at path; None when there is none or it is damaged
    (its digest), truncated or foreign."""
    from safetensors.numpy import load

    try:
        with zipfile.ZipFile(path) as z:
            meta, raw, digest = (z.read(name) for name in ("program.json", "weights.safetensors", "sha256"))
        check = hashlib.sha256(meta)
        check.update(raw)  # not meta + raw: a copy of the weights
        if check.hexdigest() != digest.decode():
            return None
        os.utime(path)  # used now: the last to be trimmed
        meta = json.loads(meta)
        weights = load(raw) if raw else {}
        program = decode_program(meta["program"], weights, schedule_from)
        buckets = [({str(k): int(n) for k, n in b["sizes"].items()},
                    decode_program(b["program"], weights, schedule_from), bool(b["tuned"]), bool(b["exact"]))
                   for b in meta.get("buckets", ())]
        return program, bool(meta["tuned"]), dict(meta["report"]), buckets
    except Exception:  # none yet, or a truncated or foreign file: compile afresh (and overwrite it)
        return None


def trim(folder: Path, limit: int = PROGRAM_CACHE_BYTES, pattern: str = "*.zip") -> None:
    """Delete the least recently used files matching pattern (programs) until the folder holds at
    most limit bytes (each holds its model's weights, and every eclat version and model makes new
    ones). A file is used when written or read (reading touches it)."""
    files = []
    for f in folder.glob(pattern):
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
