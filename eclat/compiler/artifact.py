"""Artifacts: one zip file holding a compiled model as data, never as pickled code.

    manifest.json        format and eclat versions, target, device fingerprint, the kernel
                         program (buffers, kernels as expression DAGs, schedules), the memory
                         plan, input/output names, shapes and dtypes, output structure, report,
                         a checksum per member
    weights.safetensors  the weights the code reads (packed panels included), flat
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

An artifact holds native code and is trusted as a shared library is. What loading checks is
that the file is whole and agrees with itself, so that damage or a hand-edited manifest is
refused before the first call rather than run out of bounds: members are read only when
needed, each with a size cap and its checksum; every size the runtime allocates or binds
(inputs, outputs, weights, the arena, the argument slots) is derived from the decoded
program or checked against it. Code that disagrees with a consistent manifest is not caught.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
import zipfile
from collections.abc import Iterator
from typing import Any, NoReturn

import numpy as np

from ..errors import EclatError
from ..ir.dtypes import DType
from ..ir.symbolic import BinOp, Num, Var
from .kernel import Buffer, Const, Gather, Index, Kernel, Load, Op, Program, Reduce, Schedule, Side, loads
from .memplan import MemoryPlan
from .model import CompiledModel, InputSpec, structure_tensors

FORMAT = "eclat-artifact"
FORMAT_VERSION = 1
MANIFEST, WEIGHTS, SOURCE, OBJECT = "manifest.json", "weights.safetensors", "kernels.ll", "kernels.o"
MANIFEST_DIGEST = "manifest.sha256"  # the manifest's own checksum (it holds every other member's)
SOURCE_CL, SOURCE_CU, SOURCE_METAL = "kernels.cl", "kernels.cu", "kernels.metal"
# Most bytes a member may hold: far above what any model needs (a small LLM's manifest is a few
# MB), low enough that a damaged or hostile header cannot make loading take the machine's memory.
# The weights' cap is derived from the program instead (see _weight_limit).
MANIFEST_LIMIT = 64 << 20
CODE_LIMIT = 512 << 20
MAX_NUMEL = 1 << 40  # elements in one buffer


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


def _earlier(nodes: list[Any], i: Any) -> Any:
    """nodes[i] for a reference to an already decoded node (no negative or forward index)."""
    if type(i) is not int or not 0 <= i < len(nodes):
        raise ValueError(f"node reference {i!r} is not an earlier node")
    return nodes[i]


def decode_nodes(table: list[dict[str, Any]]) -> list[Any]:
    """The node table back to expression objects (index i is node i)."""
    out: list[Any] = []
    for entry in table:
        cls = _BY_NAME[entry["t"]]
        kwargs = {}
        for f in dataclasses.fields(cls):
            v = entry[f.name]
            if f.name in NODES[cls]:
                v = tuple(_earlier(out, i) for i in v) if isinstance(v, list) else _earlier(out, v)
            elif f.name == "dtype":
                v = DType[v]
            kwargs[f.name] = v
        out.append(cls(**kwargs))
    return out


def encode_program(program: Program) -> dict[str, Any]:
    enc = _Encoder()
    kernels = [{"name": k.name, "out": k.out, "shape": [int(n) for n in k.shape], "body": enc(k.body),
                "schedule": dataclasses.asdict(k.schedule), "ops": list(k.ops),
                "sides": [{"out": s.out, "body": enc(s.body)} for s in k.sides]} for k in program.kernels]
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
    if len(buffers) != len(data["buffers"]):
        raise ValueError("two buffers share a name")

    def schedule(d: dict[str, Any]) -> Schedule:
        return Schedule(**{f: tuple(v) if isinstance(v, list) else v for f, v in d.items()})

    def kernel(k: dict[str, Any]) -> Kernel:
        sides = tuple(Side(s["out"], _earlier(nodes, s["body"])) for s in k.get("sides", ()))
        return Kernel(k["name"], k["out"], tuple(k["shape"]), _earlier(nodes, k["body"]),
                      schedule(k["schedule"]), list(k["ops"]), sides)

    kernels = [kernel(k) for k in data["kernels"]]
    return Program(buffers, kernels, list(data["inputs"]), list(data["outputs"]),
                   [tuple(s) for s in data["input_shapes"]], [tuple(s) for s in data["output_shapes"]])


# --- a program checked against itself -----------------------------------------------------------

def _is_shape(shape: Any) -> bool:
    return isinstance(shape, (list, tuple)) and all(type(n) is int and n >= 0 for n in shape)


def check_program(program: Program, specs: list[InputSpec], where: str) -> None:
    """Refuse a program whose parts disagree (ArtifactError naming where and what): the runtime
    allocates and binds by these sizes and dtypes while the compiled code uses its own, so each
    is checked against the kernels that read or write the buffer."""
    def refuse(problem: str) -> NoReturn:
        raise ArtifactError(f"{where}: {problem}")

    bufs = program.buffers
    shapes = [*program.input_shapes, *program.output_shapes, *(k.shape for k in program.kernels),
              *(s.shape for s in specs)]
    if not all(_is_shape(s) for s in shapes):
        refuse(f"{next(s for s in shapes if not _is_shape(s))!r} is not a shape")
    for b in bufs.values():
        if type(b.numel) is not int or not 0 <= b.numel <= MAX_NUMEL:
            refuse(f"buffer {b.name!r} has {b.numel!r} elements")
    for role, names, shapes in (("input", program.inputs, program.input_shapes),
                                ("output", program.outputs, program.output_shapes)):
        if len(names) != len(shapes):
            refuse(f"{len(names)} {role}s but {len(shapes)} {role} shapes")
        for name, shape in zip(names, shapes):
            b = bufs.get(name)
            if b is None or b.role != role:
                refuse(f"{role} {name!r} is not an {role} buffer")
            if math.prod(shape) != b.numel:
                refuse(f"{role} {name!r} has shape {list(shape)} but {b.numel} elements")
    for k in program.kernels:
        out = bufs.get(k.out)
        if out is None or out.role not in ("temp", "output"):
            refuse(f"kernel {k.name!r} writes {k.out!r}, which is no temporary or output buffer")
        if math.prod(k.shape) != out.numel or k.body.dtype is not out.dtype:
            refuse(f"kernel {k.name!r} writes {k.body.dtype.name}{list(k.shape)} to {k.out!r}, "
                   f"a {out.dtype.name} buffer of {out.numel} elements")
        for s in k.sides:
            if s.out not in bufs or bufs[s.out].role != "temp":
                refuse(f"kernel {k.name!r} writes a row sum to {s.out!r}, which is no temporary buffer")
        for x in [x for body in (k.body, *(s.body for s in k.sides)) for x in loads(body)]:
            if x.buffer not in bufs:
                refuse(f"kernel {k.name!r} reads {x.buffer!r}, which is no such buffer")
            if bufs[x.buffer].dtype is not x.dtype:
                refuse(f"kernel {k.name!r} reads {x.dtype.name} from {x.buffer!r}, a "
                       f"{bufs[x.buffer].dtype.name} buffer")
    if len(specs) != len(program.inputs):
        refuse(f"{len(specs)} input specs for a program of {len(program.inputs)} inputs")
    for spec, name, shape in zip(specs, program.inputs, program.input_shapes):
        if tuple(spec.shape) != tuple(shape) or spec.dtype is not bufs[name].dtype:
            refuse(f"input {spec.name!r} is declared {spec.dtype.name}{list(spec.shape)}, but the program "
                   f"takes {bufs[name].dtype.name}{list(shape)}")


def packed_copies(program: Program) -> set[str]:
    """Weights the program also holds packed (the CPU backend packs a matmul's constant operand
    into panels): the code may read only the packed copy, so their own data may be left out."""
    from ..backends.cpu.codegen import PACKED

    return {n.removeprefix(PACKED).rsplit("_", 2)[0] for n, b in program.buffers.items()
            if n.startswith(PACKED) and b.role == "weight"}


def cpu_layout(program: Program) -> tuple[MemoryPlan, list[str]]:
    """The memory plan and the argument slots the CPU backend builds program's code with: derived at
    load, never taken on trust."""
    from dataclasses import replace

    from ..backends.cpu.codegen import slots_of
    from ..backends.cpu.runtime import layout

    code, plan = layout(replace(program, buffers=dict(program.buffers)))  # folding adds side buffers
    return plan, slots_of(code.buffers)


def _plan_json(plan: MemoryPlan | None) -> dict[str, Any] | None:
    return plan and dataclasses.asdict(plan)


# --- reading ---------------------------------------------------------------------------------------

class Artifact:
    """An artifact file open for reading: its manifest, checked for format and version, and its
    members, each read only when asked for, at most limit bytes and checked against its checksum."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ArtifactError(f"artifact {self.path} " + ("is a folder" if os.path.isdir(self.path) else
                                                            "does not exist"))
        try:
            self._zip = zipfile.ZipFile(self.path)
        except OSError as e:
            raise ArtifactError(f"artifact {self.path} cannot be read ({e.strerror or e})") from None
        except Exception as e:  # not a zip, truncated
            raise ArtifactError(f"{self.path} is truncated or corrupt ({type(e).__name__}: {e})") from None
        try:
            self.manifest = self._manifest()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Artifact:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self._zip.close()

    def sizes(self) -> dict[str, int]:
        """Bytes of each member, as the zip's directory states them."""
        return {i.filename: i.file_size for i in self._zip.infolist()}

    def has(self, name: str) -> bool:
        return name in self._zip.NameToInfo

    def read(self, name: str, limit: int) -> bytes:
        """Member name, refused when larger than limit or when it fails its checksum."""
        digest = self.manifest["sha256"].get(name)
        if not isinstance(digest, str):
            raise ArtifactError(f"{self.path} is corrupt: its manifest has no checksum for {name}")
        data = self._read(name, limit)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ArtifactError(f"{self.path} is corrupt: member {name} fails its checksum")
        return data

    def _read(self, name: str, limit: int) -> bytes:
        info = self._zip.NameToInfo.get(name)
        if info is None:
            raise ArtifactError(f"{self.path} is corrupt: member {name} is missing")
        # eclat writes only these; the others decompress without a bound on what one read yields
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise ArtifactError(f"{self.path}: member {name} uses compression method {info.compress_type}, "
                                f"which eclat does not write")
        if info.file_size > limit:
            raise ArtifactError(f"{self.path}: member {name} holds {info.file_size} bytes, more than the "
                                f"{limit} it may")
        try:
            with self._zip.open(info) as f:
                # no more than the size checked above is inflated, whatever the stream holds (zipfile
                # stops at it and then finds the CRC wrong when the header lied)
                return f.read(info.file_size)
        except Exception as e:  # bad CRC, bad deflate stream (zlib.error), truncated file, ...
            raise ArtifactError(f"{self.path} is truncated or corrupt ({name}: {type(e).__name__}: {e})") \
                from None

    def _manifest(self) -> dict[str, Any]:
        if not self.has(MANIFEST):
            raise ArtifactError(f"{self.path} is not an eclat artifact (no {MANIFEST})")
        text = self._read(MANIFEST, MANIFEST_LIMIT)
        if not self.has(MANIFEST_DIGEST):
            raise ArtifactError(f"{self.path} has no {MANIFEST_DIGEST}: damaged, or written by an older "
                                f"eclat; recompile the model")
        if self._read(MANIFEST_DIGEST, 64) != hashlib.sha256(text).hexdigest().encode():
            raise ArtifactError(f"{self.path} is corrupt or edited: its manifest fails its checksum")
        try:
            manifest = json.loads(text)
        except (ValueError, RecursionError) as e:  # not JSON, or nested beyond what json decodes
            raise ArtifactError(f"{self.path} has a malformed manifest ({type(e).__name__}: {e})") from None
        if not isinstance(manifest, dict):
            raise ArtifactError(f"{self.path} has a malformed manifest")
        if manifest.get("format") != FORMAT:
            raise ArtifactError(f"{self.path} is not an eclat artifact "
                                f"(manifest format {manifest.get('format')!r})")
        version = manifest.get("format_version")
        if type(version) is not int or version > FORMAT_VERSION:
            raise ArtifactError(f"{self.path} has artifact format version {version!r}, written by eclat "
                                f"{manifest.get('eclat_version')}; this eclat ({eclat_version()}) reads up "
                                f"to version {FORMAT_VERSION}: upgrade eclat or recompile the model")
        if not isinstance(manifest.get("sha256"), dict):
            raise ArtifactError(f"{self.path} has a malformed manifest (no member checksums)")
        return manifest


def read_artifact(path: str | os.PathLike) -> dict[str, Any]:
    """The checked manifest of an artifact; nothing else is read and no code is loaded."""
    with Artifact(path) as art:
        return art.manifest


# --- saving ----------------------------------------------------------------------------------------

def save_artifact(model: CompiledModel, path: str | os.PathLike) -> None:
    """Write model to path (one zip file), atomically: a reader never sees half a file. Everything
    stored is taken from the program the executable runs, so what is saved is what loads."""
    exe, where = model.executable, os.fspath(path)
    program: Program | None = getattr(exe, "program", None)
    target = model.report().get("target", "cpu")
    kind = str(target).partition(":")[0]
    if kind not in CODECS or program is None:
        raise ArtifactError(f"saving artifacts for target {target!r} is not supported yet "
                            f"(supported: {', '.join(sorted(CODECS))})")
    folder = os.path.dirname(os.path.abspath(where))
    if not os.path.isdir(folder):
        raise ArtifactError(f"cannot write {where}: there is no folder {folder}")
    check_program(program, model.inputs, f"cannot save {where}")
    native, files, reads = CODECS[kind][0](exe)
    # the weights the code reads, and any the loader cannot do without (all but packed-only ones)
    optional = packed_copies(program)
    kept = [b for n, b in program.buffers.items() if b.role == "weight" and (n in reads or n not in optional)]
    for b in kept:
        if b.data is None:
            raise ArtifactError(f"cannot save {where}: weight {b.name!r} has no data")
    from safetensors.numpy import save as st_save

    weights = {b.name: np.ascontiguousarray(b.data, dtype=b.dtype.np).reshape(-1) for b in kept}
    files[WEIGHTS] = st_save(weights) if weights else b""
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "eclat_version": eclat_version(),
        "created": time.time(), "target": target, "device": native["device"],
        "program": encode_program(program),
        "memory_plan": _plan_json(getattr(exe, "plan", None)),  # GPU executables keep their own buffers
        "native": native,
        "inputs": [s.to_json() for s in model.inputs],
        "in_structure": model.in_structure,
        "out_spec": _out_spec_text(model.out_spec),
        "report": model.report(),
        "sha256": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
    }
    tmp = f"{where}.tmp{os.getpid()}"
    try:
        with zipfile.ZipFile(tmp, "w") as z:
            text = json.dumps(manifest, indent=1).encode()
            z.writestr(MANIFEST, text, zipfile.ZIP_DEFLATED)
            z.writestr(MANIFEST_DIGEST, hashlib.sha256(text).hexdigest())
            for name, data in files.items():
                # sources compress well; binaries are read in place
                text = name in (SOURCE, SOURCE_CL, SOURCE_CU, SOURCE_METAL)
                z.writestr(name, data, zipfile.ZIP_DEFLATED if text else zipfile.ZIP_STORED)
        os.replace(tmp, where)
    except OSError as e:
        raise ArtifactError(f"cannot write {where}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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

def load_artifact(path: str | os.PathLike) -> CompiledModel:
    """A runnable CompiledModel from an artifact; outputs are numpy arrays unless called with torch.
    Any problem with the file is an ArtifactError naming it, raised before the first call."""
    start = time.perf_counter()
    with Artifact(path) as art:
        manifest, where = art.manifest, art.path
        target = manifest.get("target")
        kind = str(target).partition(":")[0]
        if kind not in CODECS:
            raise ArtifactError(f"{where} was compiled for target {target!r}; this eclat can load "
                                f"artifacts for {', '.join(sorted(CODECS))} only")
        with _refused(where, "has a malformed manifest"):  # not a KeyError from deep inside
            program = decode_program(manifest["program"], {})
            specs = [InputSpec.from_json(s) for s in manifest["inputs"]]
            in_structure, out_spec = manifest.get("in_structure"), manifest.get("out_spec")
            if in_structure is not None and structure_tensors(in_structure) != len(specs):
                raise ArtifactError(f"{where}: its input structure passes {structure_tensors(in_structure)} "
                                    f"arrays to a program of {len(specs)} inputs")
            if out_spec is not None:
                json.loads(out_spec)  # torch's pytree JSON, read when a call brings torch tensors
            report = dict(manifest.get("report") or {})
            check_program(program, specs, where)
            _attach_weights(program, art)
        with _refused(where, "cannot be loaded here"):
            exe = CODECS[kind][1](program, manifest, art)
    seconds = round(time.perf_counter() - start, 4)
    report["artifact"] = {"path": where, "format_version": manifest["format_version"],
                          "loaded_from": exe.loaded_from, "load_seconds": seconds}
    return CompiledModel(exe, specs, out_spec, report, in_structure)


@contextlib.contextmanager
def _refused(where: str, problem: str) -> Iterator[None]:
    """Any failure inside as an ArtifactError naming where and problem."""
    try:
        yield
    except ArtifactError:
        raise
    except MemoryError:
        raise ArtifactError(f"{where} needs more memory than this process can have") from None
    except Exception as e:
        raise ArtifactError(f"{where} {problem} ({type(e).__name__}: {e})") from None


def _weight_limit(weights: list[Buffer]) -> int:
    """Most bytes the weights member may hold: the data plus a generous safetensors header."""
    return sum(b.nbytes + len(b.name.encode()) + 256 for b in weights) + 4096


def _attach_weights(program: Program, art: Artifact) -> None:
    """Each weight's data from the weights member, checked against its buffer; only a weight the
    code reads through a packed copy may be absent (left without data, its slot never read)."""
    from safetensors.numpy import load as st_load

    weights = [b for b in program.buffers.values() if b.role == "weight"]
    raw = art.read(WEIGHTS, _weight_limit(weights))
    try:
        stored = st_load(raw) if raw else {}
    except Exception as e:
        raise ArtifactError(f"{art.path}: {WEIGHTS} is malformed ({type(e).__name__}: {e})") from None
    del raw
    optional = packed_copies(program)
    for b in weights:
        data = stored.get(b.name)
        if data is None:
            if b.name in optional:
                continue
            raise ArtifactError(f"{art.path} lacks the data of weight {b.name!r}, which its code reads")
        if data.dtype != b.dtype.np or data.size != b.numel:
            raise ArtifactError(f"{art.path}: weight {b.name!r} holds {data.dtype}[{data.size}], but its "
                                f"code reads {b.dtype.np}[{b.numel}]")
        b.data = data.reshape(-1)


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


def _pack_cpu(exe: Any) -> tuple[dict[str, Any], dict[str, bytes], set[str]]:
    from ..backends.cpu.jit import target_machine

    plan, slots = cpu_layout(exe.program)
    if slots != list(exe.module.slot_names) or plan != exe.plan:
        # what the loader will derive must be what this code was built with
        raise ArtifactError("cannot save: the executable's memory plan or argument slots differ from its "
                            "program's (an eclat bug; please report it)")
    source = str(exe.module.ir)
    obj = target_machine().emit_object(exe.jit.llvm_module)
    native = {"device": _cpu_host(), "slot_names": slots}
    return native, {SOURCE: source.encode(), OBJECT: bytes(obj)}, set(exe.module.used)


def _enabled(features: str) -> set[str]:
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def _load_cpu(program: Program, manifest: dict[str, Any], art: Artifact) -> Any:
    import llvmlite.binding as llvm

    from ..backends.cpu.jit import one_thread_warning, target_machine
    from ..backends.cpu.runtime import NativeRun

    threads = (manifest.get("report") or {}).get("threads")
    one_thread_warning(threads if type(threads) is int else 1)
    plan, slots = cpu_layout(program)
    if manifest["memory_plan"] != _plan_json(plan) or manifest["native"]["slot_names"] != slots:
        raise ArtifactError(f"{art.path}: its memory plan or argument slots disagree with its program "
                            f"(damaged or edited, or written by an eclat that plans differently: recompile)")
    host, built = _cpu_host(), manifest.get("device") or {}
    same_cpu = built.get("triple") == host["triple"] and _enabled(built.get("features", "")) <= _enabled(
        host["features"])
    engine, loaded_from = None, "object"
    if same_cpu and art.has(OBJECT):
        obj = art.read(OBJECT, CODE_LIMIT)
        try:
            engine = llvm.create_mcjit_compiler(_empty_module(), target_machine())
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
    native = NativeRun(program, plan, slots, address, owner=engine)
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


def _pack_gpu(exe: Any) -> tuple[dict[str, Any], dict[str, bytes], set[str]]:
    kind = exe.rendered.dialect
    schedules = {k.name: dataclasses.asdict(k.schedule) for k in exe.rendered.kernels}
    launches = {k.name: {"groups": k.groups, "threads": k.threads, "args": list(k.args)}
                for k in exe.rendered.kernels}
    device: dict[str, Any] = {"kind": kind}
    queue = getattr(exe, "queue", None)
    if queue is not None:  # OpenCL: the device it was built and tuned on
        device.update(name=queue.device.name.strip(), platform=queue.device.platform.name.strip())
    native = {"device": device, "schedules": schedules, "launches": launches}
    return native, {GPU_SOURCES[kind][0]: exe.rendered.source.encode()}, set(exe.program.buffers)


def _load_gpu(program: Program, manifest: dict[str, Any], art: Artifact) -> Any:
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
    if exe.rendered.source.encode() != art.read(member, CODE_LIMIT):
        raise ArtifactError(f"{art.path}: this eclat renders the stored kernels differently from the eclat "
                            f"that wrote it ({manifest.get('eclat_version')}); recompile the model")
    exe.loaded_from = "source"
    return exe


# target kind -> (pack: executable -> (native manifest part, files, buffers its code reads), load)
CODECS = {"cpu": (_pack_cpu, _load_cpu), **{kind: (_pack_gpu, _load_gpu) for kind in GPU_SOURCES}}


__all__ = ["Artifact", "ArtifactError", "FORMAT_VERSION", "check_program", "decode_program", "encode_program",
           "load_artifact", "read_artifact", "save_artifact"]
