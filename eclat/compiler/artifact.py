"""Artifacts: one zip file holding a compiled model as data, never as pickled code.

    manifest.json        format and eclat versions, target, device fingerprint, the kernel
                         program (buffers, kernels as expression DAGs, schedules), the memory
                         plan, input/output names, shapes and dtypes, output structure, report,
                         a checksum per member
    weights.safetensors  the weights the code reads (packed panels included), flat
    states.safetensors   where the model updates buffers in place (a KV cache): their initial values
    native (in the manifest) and the target's members: what its `Target.save` writes and its
                         `Target.load` reads (the kernel source, e.g. kernels.ll; object code
                         where the target has it); see each backend's artifact.py
    buckets (in the manifest, a model with programs per size bucket, compiler.buckets): each other
                         program with its sizes, memory plan and native section; its target's
                         members under bucket<j>/; `sizes` the example's program's

Loading imports neither torch nor egglog. The program is stored as encoding.py writes it.

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
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

import numpy as np

from ..errors import ArtifactError, EclatError
from ..ir.graph import Returned, State
from ..ir.symbolic import Expr, evaluate
from .buckets import Bucket, SizeBuckets, merge_weights
from .encoding import decode_program, encode_program
from .kernel import Buffer, Program, loads, numel_bound
from .memplan import MemoryPlan
from .report import CompileReport
from .specs import InputSpec, structure_tensors
from .tensorfile import buffer, read_tensors, write_tensors

FORMAT = "eclat-artifact"
FORMAT_VERSION = 1
SHARED = "weights_beside"  # manifest: this weight's name -> its name in the artifact saved beside it
MANIFEST, WEIGHTS, STATES = "manifest.json", "weights.safetensors", "states.safetensors"
MANIFEST_DIGEST = "manifest.sha256"  # the manifest's own checksum (it holds every other member's)
BINARY = (".o", ".bin", ".safetensors")  # members stored as they are (read in place); others deflated
# Most bytes a member may hold: far above what any model needs (a small LLM's manifest is a few
# MB), low enough that a damaged or hostile header cannot make loading take the machine's memory.
# The weights' cap is derived from the program instead (see _weight_limit).
MANIFEST_LIMIT = 64 << 20
READ_CHUNK = 1 << 20  # bytes of a member read at a time into its buffer (larger: slower, 64 MB 2x)
CODE_LIMIT = 512 << 20
MAX_NUMEL = 1 << 40  # elements in one buffer


# --- a program checked against itself -----------------------------------------------------------

def _is_shape(shape: Any) -> bool:
    """A list of sizes: non-negative ints, or run-time sizes (expressions) that are never negative."""
    return isinstance(shape, (list, tuple)) and all(
        type(n) is int and n >= 0 or isinstance(n, Expr) and n.vmin >= 0 for n in shape)


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
            if numel_bound(shape) != b.numel:
                refuse(f"{role} {name!r} has shape {list(shape)} but {b.numel} elements")
    for k in program.kernels:
        out = bufs.get(k.out)
        if out is None or out.role not in ("temp", "output"):
            refuse(f"kernel {k.name!r} writes {k.out!r}, which is no temporary or output buffer")
        if numel_bound(k.shape) != out.numel or k.body.dtype is not out.dtype:
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
        digest = self._checksum(name)
        data = self._read(name, limit)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ArtifactError(f"{self.path} is corrupt: member {name} fails its checksum")
        return data

    def read_tensors(self, name: str, limit: int) -> dict[str, np.ndarray]:
        """The arrays of safetensors member name, read in place into one buffer (checked as read)."""
        digest = self._checksum(name)
        info = self._member(name, limit)
        image, h = buffer(info.file_size), hashlib.sha256()
        try:
            with self._zip.open(info) as f:
                at = 0
                while at < image.size:
                    chunk = f.read(min(READ_CHUNK, image.size - at))
                    if not chunk:
                        raise EOFError(f"{at} of {image.size} bytes")
                    image[at:at + len(chunk)] = np.frombuffer(chunk, np.uint8)
                    h.update(chunk)
                    at += len(chunk)
        except Exception as e:  # bad CRC, bad deflate stream (zlib.error), truncated file, ...
            raise ArtifactError(f"{self.path} is truncated or corrupt ({name}: {type(e).__name__}: {e})") \
                from None
        if h.hexdigest() != digest:
            raise ArtifactError(f"{self.path} is corrupt: member {name} fails its checksum")
        try:
            return read_tensors(image) if image.size else {}
        except Exception as e:
            raise ArtifactError(f"{self.path}: {name} is malformed ({type(e).__name__}: {e})") from None

    def _checksum(self, name: str) -> str:
        digest = self.manifest["sha256"].get(name)
        if not isinstance(digest, str):
            raise ArtifactError(f"{self.path} is corrupt: its manifest has no checksum for {name}")
        return digest

    def _member(self, name: str, limit: int) -> zipfile.ZipInfo:
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
        return info

    def _read(self, name: str, limit: int) -> bytes:
        info = self._member(name, limit)
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

def save_artifact(model: Any, path: str | os.PathLike,
                  beside: Mapping[str, np.ndarray] | None = None) -> None:
    """Write a CompiledModel to path (one zip file), atomically: a reader never sees half a file.
    Everything stored is taken from the program the executable runs, so what is saved is what loads.
    A model with programs per size bucket (compiler.buckets) keeps each: the example's as the
    artifact's program, the others under `buckets` with their members in a folder each. beside:
    another artifact's weights by name (a language model's prefill beside its decode): a weight
    whose memory is one of them is not stored, its manifest names it (`SHARED`), and load_artifact
    takes it from that artifact's."""
    where = os.fspath(path)
    parts = model.executable.buckets if isinstance(model.executable, SizeBuckets) else \
        [Bucket({}, model.executable)]
    exe = parts[0].executable
    program: Program | None = getattr(exe, "program", None)
    report = model.report()
    target_name = str(report.get("target", "cpu"))
    backend = _target(target_name, f"cannot save {where}: saving artifacts for target {target_name!r} is not "
                                   f"supported yet")
    if program is None:
        raise ArtifactError(f"cannot save {where}: its executable keeps no program")
    folder = os.path.dirname(os.path.abspath(where))
    if not os.path.isdir(folder):
        raise ArtifactError(f"cannot write {where}: there is no folder {folder}")
    files: dict[str, bytes] = {}
    weights: dict[str, np.ndarray] = {}
    sections = []
    for j, part in enumerate(parts):
        prefix = f"bucket{j}/" if j else ""
        bucket_program = part.executable.program
        check_program(bucket_program, _specs_at(model.program_inputs, part), f"cannot save {where}")
        try:
            section = backend.save(part.executable)
        except NotImplementedError as e:
            raise ArtifactError(f"cannot save {where}: {e}") from None
        mine = _stored_weights(bucket_program, section.reads, backend.optional_weights(bucket_program), where)
        if not merge_weights(weights, mine):
            continue  # the example's program serves its sizes
        files |= {prefix + name: data for name, data in section.files.items()}
        sections.append((part, prefix, section.native))
    shared = _stored_beside(weights, beside or {})
    weights = {name: a for name, a in weights.items() if name not in shared}
    states = model.state_specs
    # their values as compiled (a cache's zeros), not as the last call left them
    tensors = {WEIGHTS: weights, **({STATES: {s.name: s.initial for s in states}} if states else {})}
    tmp = f"{where}.tmp{os.getpid()}"
    try:
        with zipfile.ZipFile(tmp, "w") as z:
            for name, data in files.items():
                # sources compress well; binaries are read in place
                z.writestr(name, data, zipfile.ZIP_STORED if name.endswith(BINARY) else zipfile.ZIP_DEFLATED)
            digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
            digests |= {name: write_tensors(z, name, arrays) for name, arrays in tensors.items()}
            manifest = _manifest_of(model, program, exe, target_name, sections[0][2], report, digests)
            if shared:
                manifest[SHARED] = shared
            if len(sections) > 1:
                manifest["sizes"] = parts[0].sizes
                manifest["buckets"] = [
                    {"sizes": part.sizes, "exact": part.exact, "prefix": prefix, "native": native,
                     "program": encode_program(part.executable.program),
                     "memory_plan": _plan_json(getattr(part.executable, "plan", None))}
                    for part, prefix, native in sections[1:]]
            text = json.dumps(manifest, indent=1).encode()
            z.writestr(MANIFEST, text, zipfile.ZIP_DEFLATED)
            z.writestr(MANIFEST_DIGEST, hashlib.sha256(text).hexdigest())
        os.replace(tmp, where)
    except OSError as e:
        raise ArtifactError(f"cannot write {where}: {e.strerror or e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _stored_beside(weights: dict[str, np.ndarray], beside: Mapping[str, np.ndarray]) -> dict[str, str]:
    """name -> the name in beside of each weight whose memory is that array's (same bytes, same place)."""
    def place(a: np.ndarray) -> tuple:
        return a.__array_interface__["data"][0], a.nbytes, a.dtype.str
    theirs = {place(np.asarray(a).reshape(-1)): name for name, a in beside.items()}
    return {name: theirs[place(a)] for name, a in weights.items() if place(a) in theirs}


def _stored_weights(program: Program, reads: set[str], optional: set[str],
                    where: str) -> dict[str, np.ndarray]:
    """The weights the code reads, and any the loader cannot do without, flat, by name."""
    kept = [b for n, b in program.buffers.items() if b.role == "weight" and (n in reads or n not in optional)]
    for b in kept:
        if b.data is None:
            raise ArtifactError(f"cannot save {where}: weight {b.name!r} has no data")
    return {b.name: np.asarray(b.data, dtype=b.dtype.np).reshape(-1) for b in kept}


def _manifest_of(model: Any, program: Program, exe: Any, target_name: str, native: dict[str, Any],
                 report: dict[str, Any], digests: dict[str, str]) -> dict[str, Any]:
    states = model.state_specs
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "eclat_version": eclat_version(),
        "created": time.time(), "target": target_name, "device": native.get("device"),
        "program": encode_program(program),
        "memory_plan": _plan_json(getattr(exe, "plan", None)),  # GPU executables keep their own buffers
        "native": native,
        "inputs": [s.to_json() for s in model.program_inputs],
        "states": [{"name": s.name, "axis": s.axis} for s in states],
        "in_structure": model.in_structure,
        "out_spec": _out_spec_text(model.out_spec),
        "report": report,
        "sha256": digests,
    }


def _out_spec_text(spec: Any) -> str | None:
    """The output structure as torch's pytree JSON (read back only when torch is in use); with
    outputs that are constants, {"tree": that JSON, "constants": [[position, value], ...]}."""
    if spec is None or isinstance(spec, str):
        return spec
    if isinstance(spec, Returned):
        tree = _out_spec_text(spec.tree)
        constants = sorted(spec.constants.items())
        return None if tree is None else json.dumps({"tree": tree, "constants": constants})
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

@dataclasses.dataclass
class Loaded:
    """What an artifact holds, ready to run (eclat.load makes a CompiledModel of it)."""

    executable: Any
    inputs: list[InputSpec]
    out_spec: Any
    report: CompileReport
    in_structure: Any
    states: list[State] = dataclasses.field(default_factory=list)


def _target(name: str, where: str) -> Any:
    from ..backends import get_target, target_names

    try:
        return get_target(name)
    except EclatError:
        raise ArtifactError(f"{where} (this eclat has targets {', '.join(target_names())})") from None


def load_artifact(path: str | os.PathLike, beside: Mapping[str, np.ndarray] | None = None) -> Loaded:
    """An artifact's executable and what calling it takes (see Loaded). Any problem with the file
    is an ArtifactError naming it, raised before the first call. beside: the weights by name of the
    artifact it was saved beside (save_artifact), where it stores only its own."""
    start = time.perf_counter()
    with Artifact(path) as art:
        manifest, where = art.manifest, art.path
        target = manifest.get("target")
        backend = _target(str(target), f"{where} was compiled for target {target!r}, which this eclat "
                                       f"cannot load")
        with _refused(where, "has a malformed manifest"):  # not a KeyError from deep inside
            program = decode_program(manifest["program"], {}, backend.schedule_from)
            specs = [InputSpec.from_json(s) for s in manifest["inputs"]]
            in_structure, out_spec = manifest.get("in_structure"), manifest.get("out_spec")
            if out_spec is not None:
                json.loads(out_spec)  # torch's pytree JSON, read when a call brings torch tensors
            report = CompileReport.from_dict(manifest.get("report") or {})
            check_program(program, specs, where)
            buckets = [(Bucket(_sizes(b["sizes"]), None, b.get("exact") is True),
                        decode_program(b["program"], {}, backend.schedule_from), _Part(art, b))
                       for b in manifest.get("buckets") or ()]
            for bucket, other, _ in buckets:
                check_program(other, _specs_at(specs, bucket), where)
            _attach_weights([program, *(other for _, other, _ in buckets)], art, backend.optional_weights,
                            _beside(manifest.get(SHARED) or {}, beside, where))
            states = _states(manifest.get("states") or [], specs, art)
            if in_structure is not None and structure_tensors(in_structure) != len(specs) - len(states):
                raise ArtifactError(f"{where}: its input structure passes {structure_tensors(in_structure)} "
                                    f"arrays to a program of {len(specs) - len(states)} inputs")
        with _refused(where, "cannot be loaded here"):
            exe = backend.load(program, manifest["native"], art)
            if buckets:
                loaded = [dataclasses.replace(bucket, executable=backend.load(other, part.manifest["native"],
                                                                              part))
                          for bucket, other, part in buckets]
                exe = SizeBuckets([Bucket(_sizes(manifest["sizes"]), exe), *loaded])
    seconds = round(time.perf_counter() - start, 4)
    report.artifact = {"path": where, "format_version": manifest["format_version"],
                       "loaded_from": exe.loaded_from, "load_seconds": seconds}
    return Loaded(exe, specs, out_spec, report, in_structure, states)


def _states(entries: list, specs: list[InputSpec], art: Artifact) -> list[State]:
    """The states the manifest names, each the program input of its name among the last inputs,
    with its initial value from the states member, checked against that input."""
    if not entries:
        return []
    tail = specs[len(specs) - len(entries):]
    if len(entries) > len(specs) or [e["name"] for e in entries] != [s.name for s in tail]:
        names = [e.get("name") for e in entries]
        raise ArtifactError(f"{art.path}: its states {names} are not its last inputs")
    limit = sum(math.prod(s.shape) * s.dtype.np.itemsize + 256 for s in tail) + 4096
    stored = art.read_tensors(STATES, limit)
    out = []
    for e, spec in zip(entries, tail):
        value, axis = stored.get(spec.name), e.get("axis")
        if value is None or value.shape != spec.shape or value.dtype != spec.dtype.np:
            raise ArtifactError(f"{art.path}: state {spec.name!r} has no value of "
                                f"{spec.dtype.np}{list(spec.shape)}")
        if axis is not None and (type(axis) is not int or not 0 <= axis < len(spec.shape)):
            raise ArtifactError(f"{art.path}: state {spec.name!r} is updated along axis {axis!r}")
        out.append(State(spec.name, value, axis))
    return out


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


def _beside(shared: Any, beside: Mapping[str, np.ndarray] | None, where: str) -> dict[str, np.ndarray]:
    """The weights an artifact stores in the one it was saved beside (its manifest's SHARED), by name."""
    if not isinstance(shared, dict) or not all(isinstance(v, str) for v in shared.values()):
        raise ArtifactError(f"{where}: its manifest's {SHARED!r} is not a table of weight names")
    missing = sorted(set(shared.values()) - set(beside or {}))
    if missing:
        raise ArtifactError(f"{where} stores {len(missing)} of its weights ({missing[0]!r}, ...) in the "
                            f"artifact it was saved beside (a language model's folder): load that folder")
    return {name: np.asarray(beside[other]).reshape(-1) for name, other in shared.items()}


def _attach_weights(programs: list[Program], art: Artifact, optional_of: Any,
                    beside: dict[str, np.ndarray]) -> None:
    """Each weight's data from the weights member (read once for every program), or from the
    artifact it was saved beside, checked against its buffer; only a weight the code reads through
    a packed copy (optional_of(program)) may be absent (left without data, its slot never read)."""
    union = {b.name: b for p in programs for b in p.buffers.values() if b.role == "weight"}
    stored = art.read_tensors(WEIGHTS, _weight_limit([b for n, b in union.items() if n not in beside]))
    stored.update(beside)
    for program in programs:
        optional = optional_of(program)
        for b in (b for b in program.buffers.values() if b.role == "weight"):
            data = stored.get(b.name)
            if data is None:
                if b.name in optional:
                    continue
                raise ArtifactError(f"{art.path} lacks the data of weight {b.name!r}, which its code reads")
            if data.dtype != b.dtype.np or data.size != b.numel:
                raise ArtifactError(f"{art.path}: weight {b.name!r} holds {data.dtype}[{data.size}], but its "
                                    f"code reads {b.dtype.np}[{b.numel}]")
            b.data = data.reshape(-1)


def _specs_at(specs: list[InputSpec], bucket: Bucket) -> list[InputSpec]:
    """What a bucket's program takes: the model's inputs, at the bucket's sizes if it runs them alone."""
    if not bucket.exact:
        return specs
    return [dataclasses.replace(s, shape=tuple(int(evaluate(n, bucket.sizes)) for n in s.shape))
            for s in specs]


def _sizes(data: Any) -> dict[str, int]:
    """A bucket's sizes as the manifest holds them: names to non-negative ints."""
    if not isinstance(data, dict) or not all(type(n) is int and n >= 0 for n in data.values()):
        raise ValueError(f"bucket sizes {data!r}")
    return {str(name): n for name, n in data.items()}


class _Part:
    """One size bucket's view of an artifact, as its target's loader reads it: its own manifest
    entries (memory plan, device) and members (in its folder)."""

    def __init__(self, art: Artifact, entry: dict[str, Any]):
        prefix = entry["prefix"]
        if not isinstance(prefix, str) or not prefix.startswith("bucket") or not prefix.endswith("/"):
            raise ValueError(f"bucket folder {prefix!r}")
        self.path, self._art, self._prefix = art.path, art, prefix
        self.manifest = {**art.manifest, **entry, "device": entry["native"].get("device")}

    def has(self, name: str) -> bool:
        return self._art.has(self._prefix + name)

    def read(self, name: str, limit: int) -> bytes:
        return self._art.read(self._prefix + name, limit)


__all__ = ["Artifact", "ArtifactError", "FORMAT_VERSION", "Loaded", "check_program", "load_artifact",
           "read_artifact", "save_artifact"]
