"""Artifacts: one zip file holding a compiled model as data, never as pickled code.

    manifest.json        format and eclat versions, target, device fingerprint, the kernel
                         program (buffers, kernels as expression DAGs, schedules), the memory
                         plan, input/output names, shapes and dtypes, output structure, report
    weights.safetensors  every weight buffer (packed panels included), flat
    kernels.ll/.cl/.cu/.metal  the backend's kernel source (LLVM IR for the CPU, OpenCL C, CUDA, Metal)
    kernels.o            compiled object code where the backend has it (CPU: the host's)

Loading reads the object code straight into an MCJIT engine, so nothing is optimised
again; when the object was built for another CPU (missing features, other triple) or
cannot be loaded, the stored IR is compiled instead. GPU artifacts (OpenCL, CUDA, Metal)
hold the source, the GPU schedules and launch sizes; the driver builds them at load. A
CUDA or Metal artifact loads where its device is absent, and running it says why it cannot.
Loading imports neither torch nor egglog. Expression DAGs are stored as a node table:
children before parents, a node's children referenced by their index, so shared subtrees
are stored once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import zipfile
from typing import Any

import numpy as np

from ..errors import EclatError
from ..ir.dtypes import DType
from ..ir.symbolic import BinOp, Num, Var
from .kernel import Buffer, Const, Gather, Index, Kernel, Load, Op, Program, Reduce, Schedule
from .memplan import MemoryPlan
from .model import CompiledModel, InputSpec

FORMAT = "eclat-artifact"
FORMAT_VERSION = 1
MANIFEST, WEIGHTS, SOURCE, OBJECT = "manifest.json", "weights.safetensors", "kernels.ll", "kernels.o"
SOURCE_CL, SOURCE_CU, SOURCE_METAL = "kernels.cl", "kernels.cu", "kernels.metal"


class ArtifactError(EclatError):
    """An artifact cannot be read or run here; the message names the file and the reason."""


# --- expression DAGs as node tables -------------------------------------------------------------

# class -> fields that hold child nodes (a tuple field holds a tuple of them)
NODES: dict[type, tuple[str, ...]] = {
    Num: (), Var: (), BinOp: ("a", "b"),
    Const: (), Index: ("expr",), Load: ("index", "valid"), Gather: ("idx", "inner"),
    Op: ("srcs",), Reduce: ("var", "body"),
}
_BY_NAME = {cls.__name__: cls for cls in NODES}


class _Encoder:
    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self._ids: dict[int, tuple[Any, int]] = {}  # id(node) -> (node kept alive, index)

    def __call__(self, node: Any) -> int:
        hit = self._ids.get(id(node))
        if hit is not None:
            return hit[1]
        cls = type(node)
        if cls not in NODES:
            raise ArtifactError(f"cannot store a {cls.__name__} in an artifact")
        entry: dict[str, Any] = {"t": cls.__name__}
        for f in dataclasses.fields(node):
            v = getattr(node, f.name)
            if f.name in NODES[cls]:
                v = [self(x) for x in v] if isinstance(v, tuple) else self(v)
            elif isinstance(v, DType):
                v = v.name
            elif isinstance(v, np.generic):
                v = v.item()
            entry[f.name] = v
        self.nodes.append(entry)
        self._ids[id(node)] = (node, len(self.nodes) - 1)
        return len(self.nodes) - 1


def decode_nodes(table: list[dict[str, Any]]) -> list[Any]:
    """The node table back to expression objects (index i is node i)."""
    out: list[Any] = []
    for entry in table:
        cls = _BY_NAME[entry["t"]]
        kwargs = {}
        for f in dataclasses.fields(cls):
            v = entry[f.name]
            if f.name in NODES[cls]:
                v = tuple(out[i] for i in v) if isinstance(v, list) else out[v]
            elif f.name == "dtype":
                v = DType[v]
            kwargs[f.name] = v
        out.append(cls(**kwargs))
    return out


def encode_program(program: Program) -> dict[str, Any]:
    enc = _Encoder()
    kernels = [{"name": k.name, "out": k.out, "shape": [int(n) for n in k.shape], "body": enc(k.body),
                "schedule": dataclasses.asdict(k.schedule), "ops": list(k.ops)} for k in program.kernels]
    return {
        "buffers": [{"name": b.name, "numel": int(b.numel), "dtype": b.dtype.name, "role": b.role}
                    for b in program.buffers.values()],
        "kernels": kernels,
        "nodes": enc.nodes,
        "inputs": list(program.inputs), "outputs": list(program.outputs),
        "input_shapes": [[int(n) for n in s] for s in program.input_shapes],
        "output_shapes": [[int(n) for n in s] for s in program.output_shapes],
    }


def decode_program(data: dict[str, Any], weights: dict[str, np.ndarray]) -> Program:
    nodes = decode_nodes(data["nodes"])
    buffers = {b["name"]: Buffer(b["name"], b["numel"], DType[b["dtype"]], b["role"], weights.get(b["name"]))
               for b in data["buffers"]}
    def schedule(d: dict[str, Any]) -> Schedule:
        return Schedule(**{f: tuple(v) if isinstance(v, list) else v for f, v in d.items()})

    kernels = [Kernel(k["name"], k["out"], tuple(k["shape"]), nodes[k["body"]], schedule(k["schedule"]),
                      list(k["ops"])) for k in data["kernels"]]
    return Program(buffers, kernels, list(data["inputs"]), list(data["outputs"]),
                   [tuple(s) for s in data["input_shapes"]], [tuple(s) for s in data["output_shapes"]])


# --- saving ----------------------------------------------------------------------------------------

def save_artifact(model: CompiledModel, path: str | os.PathLike) -> None:
    """Write model to path (one zip file), atomically: a reader never sees half a file."""
    exe = model.executable
    program: Program | None = getattr(exe, "program", None)
    target = model.report().get("target", "cpu")
    kind = str(target).partition(":")[0]
    if kind not in CODECS or program is None:
        raise ArtifactError(f"saving artifacts for target {target!r} is not supported yet "
                            f"(supported: {', '.join(sorted(CODECS))})")
    native, files = CODECS[kind][0](exe)
    unused = set(native.get("unused_weights", ()))  # e.g. a weight the code reads only packed
    weights = {name: np.ascontiguousarray(b.data, dtype=b.dtype.np).reshape(-1)
               for name, b in program.buffers.items() if b.role == "weight" and name not in unused}
    from safetensors.numpy import save as st_save

    files[WEIGHTS] = st_save(weights) if weights else b""
    plan: MemoryPlan | None = getattr(exe, "plan", None)  # GPU executables keep their own buffers
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "eclat_version": eclat_version(),
        "created": time.time(), "target": target, "device": native["device"],
        "program": encode_program(program),
        "memory_plan": plan and {"offsets": plan.offsets, "arena_bytes": plan.arena_bytes,
                                 "naive_bytes": plan.naive_bytes},
        "native": native,
        "inputs": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype.name} for s in model.inputs],
        "out_spec": _out_spec_text(model.out_spec),
        "report": model.report(),
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
    }
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with zipfile.ZipFile(tmp, "w") as z:
        z.writestr(MANIFEST, json.dumps(manifest, indent=1), zipfile.ZIP_DEFLATED)
        for name, data in files.items():
            # sources compress well; binaries are read in place
            text = name in (SOURCE, SOURCE_CL, SOURCE_CU, SOURCE_METAL)
            z.writestr(name, data, zipfile.ZIP_DEFLATED if text else zipfile.ZIP_STORED)
    os.replace(tmp, path)


def _out_spec_text(spec: Any) -> str | None:
    """The output structure as torch's pytree JSON (read back only when torch is in use)."""
    if spec is None or isinstance(spec, str):
        return spec
    import warnings

    from torch.utils._pytree import treespec_dumps

    try:
        with warnings.catch_warnings():  # torch's own deprecation notice about LeafSpec
            warnings.simplefilter("ignore", FutureWarning)
            return treespec_dumps(spec)
    except Exception:  # an output type torch cannot serialise: outputs come back flat
        return None


def eclat_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("eclat")
    except PackageNotFoundError:
        return "0+source"


# --- loading ---------------------------------------------------------------------------------------

def read_artifact(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The checked manifest and the member files of an artifact (no code is loaded)."""
    where = os.fspath(path)
    if not os.path.isfile(where):
        raise ArtifactError(f"artifact {where} does not exist")
    try:
        with zipfile.ZipFile(where) as z:
            names = set(z.namelist())
            if MANIFEST not in names:
                raise ArtifactError(f"{where} is not an eclat artifact (no {MANIFEST})")
            manifest = json.loads(z.read(MANIFEST))
            files = {n: z.read(n) for n in names - {MANIFEST}}
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, ValueError, KeyError) as e:
        raise ArtifactError(f"{where} is truncated or corrupt ({type(e).__name__}: {e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{where} is not an eclat artifact (manifest format {manifest.get('format')!r})"
                            if isinstance(manifest, dict) else f"{where} has a malformed manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ArtifactError(f"{where} has artifact format version {version!r}, written by eclat "
                            f"{manifest.get('eclat_version')}; this eclat ({eclat_version()}) reads up to "
                            f"version {FORMAT_VERSION}: upgrade eclat or recompile the model")
    for name, digest in manifest.get("sha256", {}).items():
        if name not in files or hashlib.sha256(files[name]).hexdigest() != digest:
            raise ArtifactError(f"{where} is corrupt: member {name} is missing or fails its checksum")
    return manifest, files


def load_artifact(path: str | os.PathLike) -> CompiledModel:
    """A runnable CompiledModel from an artifact; outputs are numpy arrays unless called with torch."""
    start = time.perf_counter()
    manifest, files = read_artifact(path)
    target = manifest["target"]
    kind = str(target).partition(":")[0]
    if kind not in CODECS:
        raise ArtifactError(f"{os.fspath(path)} was compiled for target {target!r}; this eclat can load "
                            f"artifacts for {', '.join(sorted(CODECS))} only")
    try:
        from safetensors.numpy import load as st_load

        weights = st_load(files[WEIGHTS]) if files[WEIGHTS] else {}
        program = decode_program(manifest["program"], weights)
        unused = set(manifest["native"].get("unused_weights", ()))
        missing = [n for n, b in program.buffers.items()
                   if b.role == "weight" and b.data is None and n not in unused]
        if missing:
            raise ArtifactError(f"{os.fspath(path)} lacks the data of weights {missing[:3]}")
        mp = manifest["memory_plan"]
        plan = mp and MemoryPlan(dict(mp["offsets"]), mp["arena_bytes"], mp["naive_bytes"])
        specs = [InputSpec(s["name"], tuple(s["shape"]), DType[s["dtype"]]) for s in manifest["inputs"]]
    except ArtifactError:
        raise
    except Exception as e:  # a malformed manifest must not surface as a KeyError deep inside
        raise ArtifactError(f"{os.fspath(path)} has a malformed manifest ({type(e).__name__}: {e})") from None
    exe = CODECS[kind][1](program, plan, manifest, files, os.fspath(path))
    report = dict(manifest.get("report") or {})
    report["artifact"] = {"path": os.fspath(path), "format_version": manifest["format_version"],
                          "loaded_from": exe.loaded_from,
                          "load_seconds": round(time.perf_counter() - start, 4)}
    return CompiledModel(exe, specs, manifest.get("out_spec"), report)


# --- CPU: LLVM IR text and host object code ----------------------------------------------------------

def _cpu_host() -> dict[str, Any]:
    import llvmlite.binding as llvm

    from ..backends.cpu.jit import target_machine

    target_machine()  # initialises LLVM's native target
    host = {"kind": "cpu", "triple": llvm.get_process_triple(), "cpu": llvm.get_host_cpu_name(),
            "features": llvm.get_host_cpu_features().flatten()}
    # what decides whether the object code runs here (the autotuner's device fingerprint, which
    # also covers threads and measured peaks, is in report.device)
    host["fingerprint"] = hashlib.sha256(json.dumps(host, sort_keys=True).encode()).hexdigest()[:16]
    return host


def _pack_cpu(exe: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    from ..backends.cpu.jit import target_machine

    source = str(exe.module.ir)
    obj = target_machine().emit_object(exe.jit.llvm_module)
    unused = sorted(n for n, b in exe.program.buffers.items()
                    if b.role == "weight" and n not in exe.module.used)
    native = {"device": _cpu_host(), "slot_names": list(exe.module.slot_names),
              "entry": "eclat_run", "unused_weights": unused}
    return native, {SOURCE: source.encode(), OBJECT: bytes(obj)}


def _enabled(features: str) -> set[str]:
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def _native_program(program: Program, plan: MemoryPlan, slot_names: list[str], engine: Any, entry: str,
                    loaded_from: str) -> Any:
    """A loaded CPU program, run as the CPU backend runs its own (backends.cpu.runtime.NativeRun)."""
    from ..backends.cpu.runtime import NativeRun

    address = engine.get_function_address(entry)
    if not address:
        raise ArtifactError(f"the compiled code has no entry point {entry!r}")
    native = NativeRun(program, plan, slot_names, address, owner=engine)
    native.loaded_from = loaded_from
    return native


def _load_cpu(program: Program, plan: MemoryPlan, manifest: dict[str, Any], files: dict[str, bytes],
              where: str) -> Any:
    import llvmlite.binding as llvm

    from ..backends.cpu.jit import target_machine

    native = manifest["native"]
    host, built = _cpu_host(), manifest.get("device") or {}
    same_cpu = built.get("triple") == host["triple"] and _enabled(built.get("features", "")) <= _enabled(
        host["features"])
    engine, loaded_from = None, "object"
    if same_cpu and OBJECT in files:
        try:
            engine = llvm.create_mcjit_compiler(_empty_module(), target_machine())
            engine.add_object_file(llvm.ObjectFileRef.from_data(files[OBJECT]))
            engine.finalize_object()
        except Exception:  # an object this LLVM cannot link: rebuild from the IR below
            engine = None
    if engine is None:
        if SOURCE not in files:
            raise ArtifactError(f"{where} was compiled for another CPU ({built.get('cpu')}, "
                                f"{built.get('triple')}) and holds no kernel source to rebuild from")
        engine, loaded_from = _compile_source(files[SOURCE].decode(), where), "source"
    return _native_program(program, plan, native["slot_names"], engine, native.get("entry", "eclat_run"),
                           loaded_from)


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
    from ..backends.cpu.jit import Jitted

    try:
        return Jitted(_Source(source)).engine
    except RuntimeError as e:
        raise ArtifactError(f"{where}: the stored kernel source does not compile here: {e}") from None


# --- GPUs: the rendered source, the schedules and launch sizes; the driver builds it at load ------------

# target kind -> (kernel source member, "module:Executable" that renders and builds it)
GPU_SOURCES = {"opencl": (SOURCE_CL, "eclat.backends.opencl.runtime:OpenCLExecutable"),
               "cuda": (SOURCE_CU, "eclat.backends.cuda.runtime:CudaExecutable"),
               "metal": (SOURCE_METAL, "eclat.backends.metal.runtime:MetalExecutable")}


def _pack_gpu(exe: Any) -> tuple[dict[str, Any], dict[str, bytes]]:
    kind = exe.rendered.dialect
    schedules = {k.name: dataclasses.asdict(k.schedule) for k in exe.rendered.kernels}
    launches = {k.name: {"groups": k.groups, "threads": k.threads, "args": list(k.args)}
                for k in exe.rendered.kernels}
    device: dict[str, Any] = {"kind": kind}
    queue = getattr(exe, "queue", None)
    if queue is not None:  # OpenCL: the device it was built and tuned on
        device.update(name=queue.device.name.strip(), platform=queue.device.platform.name.strip())
    native = {"device": device, "schedules": schedules, "launches": launches}
    return native, {GPU_SOURCES[kind][0]: exe.rendered.source.encode()}


def _load_gpu(program: Program, plan: MemoryPlan | None, manifest: dict[str, Any], files: dict[str, bytes],
              where: str) -> Any:
    """Render the stored schedules again (the driver compiles them); where the target's device is
    absent, an executable whose run says so."""
    from importlib import import_module

    from ..backends.gpu_c import GpuSchedule
    from .pipeline import DeferredExecutable, device_missing

    kind = str(manifest["target"]).partition(":")[0]
    member, made_by = GPU_SOURCES[kind]
    schedules = {name: GpuSchedule(**{f: tuple(v) if isinstance(v, list) else v for f, v in d.items()})
                 for name, d in manifest["native"]["schedules"].items()}
    missing = device_missing(kind)
    if missing:
        exe = DeferredExecutable(program, kind, missing, schedules)
    else:
        module, _, cls = made_by.partition(":")
        exe = getattr(import_module(module), cls)(program, schedules)
    if exe.rendered.source.encode() != files.get(member):
        raise ArtifactError(f"{where}: this eclat renders the stored kernels differently from the eclat "
                            f"that wrote it ({manifest.get('eclat_version')}); recompile the model")
    exe.loaded_from = "source"
    return exe


# target kind -> (pack: executable -> (native manifest part, files), load)
CODECS = {"cpu": (_pack_cpu, _load_cpu), **{kind: (_pack_gpu, _load_gpu) for kind in GPU_SOURCES}}


def artifact_bytes(path: str | os.PathLike) -> dict[str, int]:
    """Size of each member of an artifact (for `eclat inspect`)."""
    with zipfile.ZipFile(path) as z:
        return {i.filename: i.file_size for i in z.infolist()}


__all__ = ["ArtifactError", "FORMAT_VERSION", "artifact_bytes", "decode_program", "encode_program",
           "load_artifact", "read_artifact", "save_artifact"]
