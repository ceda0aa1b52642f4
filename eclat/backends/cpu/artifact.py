"""The CPU's part of an artifact: the LLVM IR text and the host's object code.

The object code is the object files the process ran, bundled in one member (`bundle`): the entry
points' and each kernel's, as compiled. Loading reads them straight into an MCJIT engine, so
nothing is optimised or compiled again; when
the object was built for another CPU (missing features, other triple) or cannot be loaded, the
stored IR is compiled instead. The memory plan and argument slots are derived from the program
at load, and must equal what the code was built with."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from typing import Any

from ...compiler.artifact import CODE_LIMIT
from ...compiler.kernel import Program
from ...compiler.memplan import MemoryPlan
from ...errors import ArtifactError
from ..target import Section
from .codegen import slots_of
from .host import cpu_name, features, triple
from .jit import Jitted, one_thread_warning, target_machine
from .runtime import NativeRun, layout

SOURCE, OBJECT = "kernels.ll", "kernels.o"
BUNDLE = b"eclat object files\n"  # what the object member starts with: then a count, sizes, the files


def bundle(objects: list[bytes]) -> bytes:
    """Object files as one byte string (`unbundle` reads it back)."""
    return BUNDLE + struct.pack(f"<I{len(objects)}Q", len(objects), *map(len, objects)) + b"".join(objects)


def unbundle(data: bytes) -> list[bytes]:
    """The object files of a bundle; ValueError where data is not one, whole."""
    if not data.startswith(BUNDLE) or len(data) < len(BUNDLE) + 4:
        raise ValueError("not a bundle of object files")
    at = len(BUNDLE)
    (count,) = struct.unpack_from("<I", data, at)
    if len(data) < at + 4 + 8 * count:
        raise ValueError("a bundle of object files cut short")
    sizes = struct.unpack_from(f"<{count}Q", data, at + 4)
    at += 4 + 8 * count
    if at + sum(sizes) != len(data):
        raise ValueError("a bundle of object files whose sizes do not add up")
    out = []
    for size in sizes:
        out.append(data[at:at + size])
        at += size
    return out


def cpu_layout(program: Program) -> tuple[MemoryPlan, list[str]]:
    """The memory plan and the argument slots the CPU backend builds program's code with: derived at
    load, never taken on trust."""
    code, plan = layout(dataclasses.replace(program, buffers=dict(program.buffers)))  # folding adds buffers
    return plan, slots_of(code)


def _cpu_host() -> dict[str, Any]:
    host = {"kind": "cpu", "triple": triple(), "cpu": cpu_name(),
            "features": ",".join(f"+{f}" for f in sorted(features()))}
    # what decides whether the object code runs here (the autotuner's device fingerprint, which
    # also covers threads and measured peaks, is in report.device)
    host["fingerprint"] = hashlib.sha256(json.dumps(host, sort_keys=True).encode()).hexdigest()[:16]
    return host


def save(exe: Any) -> Section:
    plan, slots = cpu_layout(exe.program)
    if slots != list(exe.module.slot_names) or plan != exe.plan:
        # what the loader will derive must be what this code was built with
        raise ArtifactError("cannot save: the executable's memory plan or argument slots differ from its "
                            "program's (an eclat bug; please report it)")
    source = exe.module.text()
    native = {"device": _cpu_host(), "slot_names": slots}
    return Section(native, {SOURCE: source.encode(), OBJECT: bundle(exe.jit.objects())}, set(exe.module.used))


def _enabled(features: str) -> set[str]:
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def load(program: Program, native: dict[str, Any], art: Any) -> Any:
    import llvmlite.binding as llvm

    threads = (art.manifest.get("report") or {}).get("threads")
    one_thread_warning(threads if type(threads) is int else 1)
    plan, slots = cpu_layout(program)
    if art.manifest["memory_plan"] != dataclasses.asdict(plan) or native["slot_names"] != slots:
        raise ArtifactError(f"{art.path}: its memory plan or argument slots disagree with its program "
                            f"(damaged or edited, or written by an eclat that plans differently: recompile)")
    host, built = _cpu_host(), art.manifest.get("device") or {}
    same_cpu = built.get("triple") == host["triple"] and _enabled(built.get("features", "")) <= _enabled(
        host["features"])
    engine, loaded_from = None, "object"
    if same_cpu and art.has(OBJECT):
        objects = art.read(OBJECT, CODE_LIMIT)
        try:
            engine = llvm.create_mcjit_compiler(_empty_module(), target_machine())
            for obj in unbundle(objects):
                engine.add_object_file(llvm.ObjectFileRef.from_data(obj))
            engine.finalize_object()
        except Exception:  # an object this LLVM cannot link: rebuild from the IR below
            engine = None
    if engine is None:
        if not art.has(SOURCE):
            raise ArtifactError(f"{art.path} was compiled for another CPU ({built.get('cpu')}, "
                                f"{built.get('triple')}) and holds no kernel source to rebuild from")
        engine, loaded_from = _compile_source(art.read(SOURCE, CODE_LIMIT).decode(), art.path), "source"
    address = engine.get_function_address("eclat_run")
    if not address:
        raise ArtifactError(f"{art.path}: the compiled code has no entry point eclat_run")
    native = NativeRun(program, plan, slots, address, owner=engine, address_of=engine.get_function_address)
    native.loaded_from = loaded_from
    return native


def _empty_module() -> Any:
    import llvmlite.binding as llvm

    mod = llvm.parse_assembly("")
    mod.triple = llvm.get_process_triple()
    return mod


class _Source:
    """Stored LLVM IR in place of an llvmlite.ir.Module, so that the CPU backend's own JIT
    (one optimisation pipeline) compiles it: Jitted sets triple and data layout, then reads str()."""

    def __init__(self, text: str):
        self.text, self.triple, self.data_layout = text, "", ""

    def __str__(self) -> str:
        header = [f'target triple = "{self.triple}"', f'target datalayout = "{self.data_layout}"']
        body = [ln for ln in self.text.splitlines() if not ln.startswith(("target triple", "target data"))]
        return "\n".join(header + body)


def _compile_source(source: str, where: str) -> Any:
    """The stored kernel source optimised and compiled for this host."""
    try:
        return Jitted(_Source(source)).engine
    except RuntimeError as e:
        raise ArtifactError(f"{where}: the stored kernel source does not compile here: {e}") from None
