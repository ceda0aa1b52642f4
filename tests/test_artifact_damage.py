"""Damaged and hand-edited artifacts: each is refused with an ArtifactError naming the file and the
problem, or (where the damage touches nothing the load uses) runs and gives the right answer;
never a wrong answer, a crash or a raw Python error. Every load runs in one child process, so a
crash there fails the cases it reached instead of the test run."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
import tracemalloc
import zipfile

import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

import eclat
from eclat.backends.cpu.artifact import cpu_layout
from eclat.compiler.artifact import (
    MANIFEST,
    MANIFEST_DIGEST,
    ArtifactError,
)
from eclat.compiler.encoding import decode_program
from eclat.compiler.model import load as load_artifact
from tests.test_artifact import TwoOut

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WEIGHTS = "weights.safetensors"


def _members(path: str) -> tuple[dict, dict[str, bytes]]:
    with zipfile.ZipFile(path) as z:
        files = {n: z.read(n) for n in z.namelist()}
    return json.loads(files.pop(MANIFEST)), files


def _write(path: str, manifest: dict | bytes, files: dict[str, bytes], rehash: bool = True) -> None:
    """An artifact of these members, the manifest's own checksum made to match it; rehash: the
    manifest's checksums of the others too (so that what is tested is the check behind them)."""
    if rehash:
        manifest["sha256"] = {n: hashlib.sha256(files[n]).hexdigest() for n in manifest["sha256"]}
    text = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
    files = {**files, MANIFEST_DIGEST: hashlib.sha256(text).hexdigest().encode()}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(MANIFEST, text, zipfile.ZIP_DEFLATED)
        for n, d in files.items():
            z.writestr(n, d, zipfile.ZIP_DEFLATED if n.endswith(".ll") else zipfile.ZIP_STORED)


# --- the cases: each edits the manifest and members of a good artifact ---------------------------

def _buffer(m: dict, role: str, index: int = 0) -> dict:
    return [b for b in m["program"]["buffers"] if b["role"] == role][index]


def _shrink_temp_with_its_plan(m: dict, files: dict) -> None:
    """A temporary halved and the memory plan made to agree: consistent, but not with its kernel."""
    _buffer(m, "temp")["numel"] //= 2
    plan, _ = cpu_layout(decode_program(m["program"], {}))
    m["memory_plan"] = dataclasses.asdict(plan)


def _read_a_missing_buffer(m: dict, files: dict) -> None:
    next(n for n in m["program"]["nodes"] if n["t"] == "Load")["buffer"] = "nowhere"


def _deep_expression(m: dict, files: dict) -> None:
    nodes, body = m["program"]["nodes"], m["program"]["kernels"][-1]["body"]
    for _ in range(20000):
        nodes.append({"t": "Op", "op": "neg", "srcs": [body], "dtype": "float32"})
        body = len(nodes) - 1
    m["program"]["kernels"][-1]["body"] = body


def _edit_weights(edit):
    def apply(m: dict, files: dict) -> None:
        weights = dict(st_load(files[WEIGHTS]))
        edit(weights)
        files[WEIGHTS] = st_save(weights)
    return apply


def _first(prefix: str):
    return lambda weights: next(n for n in sorted(weights) if n.startswith(prefix))


def _drop(pick):
    return _edit_weights(lambda w: w.pop(pick(w)))


def _change(pick, change):
    return _edit_weights(lambda w: w.update({pick(w): change(w[pick(w)])}))


def _manifest_only(edit):
    return lambda m, files: edit(m)


# name -> (edit(manifest, members), what the refusal says; None: refused or right, either will do)
CASES = {
    "arena smaller than its program's": (_manifest_only(lambda m: m["memory_plan"].update(arena_bytes=64)),
                                        "memory plan or argument slots disagree"),
    "temporary moved in the arena": (_manifest_only(lambda m: m["memory_plan"].update(
        offsets={k: v + 64 for k, v in m["memory_plan"]["offsets"].items()})), "memory plan"),
    "argument slots swapped": (_manifest_only(lambda m: m["native"]["slot_names"].insert(
        1, m["native"]["slot_names"].pop(2))), "argument slots disagree"),
    "argument slot dropped": (_manifest_only(lambda m: m["native"]["slot_names"].pop(0)), "argument slots"),
    "input declared smaller": (_manifest_only(lambda m: m["inputs"][0].update(shape=[1, 16])),
                               r"input 'x' is declared float32\[1, 16\], but the program takes "
                               r"float32\[3, 16\]"),
    "input declared as another dtype": (_manifest_only(lambda m: m["inputs"][0].update(dtype="int32")),
                                        r"declared int32\[3, 16\], but the program takes float32"),
    "input shapes agree, its buffer does not": (_manifest_only(lambda m: (
        m["inputs"][0].update(shape=[1, 16]), m["program"].update(input_shapes=[[1, 16]]))),
        r"has shape \[1, 16\] but 48 elements"),
    "output shape larger": (_manifest_only(lambda m: m["program"]["output_shapes"][0].__setitem__(0, 300)),
                            r"output 'out0' has shape \[300, 4\]"),
    "output buffer made bool": (_manifest_only(lambda m: _buffer(m, "output").update(dtype="bool")),
                                "writes float32"),
    "buffer of 10^12 elements": (_manifest_only(lambda m: _buffer(m, "input").update(numel=10**12)),
                                 "elements"),
    "negative elements": (_manifest_only(lambda m: _buffer(m, "temp").update(numel=-1)), "-1 elements"),
    "temporary shrunk with its plan": (_shrink_temp_with_its_plan, r"writes float32\[3, 32\]"),
    "kernel reads no such buffer": (_read_a_missing_buffer, "reads 'nowhere', which is no such buffer"),
    "forward node reference": (_manifest_only(lambda m: m["program"]["kernels"][0].update(
        body=len(m["program"]["nodes"]))), "malformed manifest.*not an earlier node"),
    "negative node reference": (_manifest_only(lambda m: m["program"]["kernels"][0].update(body=-1)),
                                "not an earlier node"),
    "two buffers of one name": (_manifest_only(lambda m: m["program"]["buffers"].append(
        dict(_buffer(m, "temp"), numel=1))), "share a name"),
    "an expression 20000 deep": (_deep_expression, None),
    "input structure of two arrays": (_manifest_only(lambda m: m.update(in_structure=[None, None])),
                                      "passes 2 arrays to a program of 1 inputs"),
    "index range not numbers": (_manifest_only(lambda m: m["inputs"][0].update(index_range="ab")),
                                "malformed manifest"),
    "output structure not text": (_manifest_only(lambda m: m.update(out_spec=5)), "malformed manifest"),
    "entry point elsewhere": (_manifest_only(lambda m: m["native"].update(entry="eclat_parallel")), None),
    "target a list": (_manifest_only(lambda m: m.update(target=["cpu"])), "compiled for target"),
    "slots not a list": (_manifest_only(lambda m: m["native"].update(slot_names=7)), "argument slots"),
    "device features a number": (_manifest_only(lambda m: m["device"].update(features=7)),
                                 "cannot be loaded here .AttributeError"),
    "no checksum of the object code": (_manifest_only(lambda m: m["sha256"].pop("kernels.o")),
                                       "no checksum for kernels.o"),
    # weights: each buffer the code reads must be stored whole, in its dtype
    "a weight missing": (_drop(_first("w_fc1.bias")), "lacks the data of weight 'w_fc1.bias'"),
    "a packed weight missing": (_drop(_first("pack:")), "lacks the data of weight 'pack:"),
    "a weight truncated": (_change(_first("w_fc1.bias"), lambda a: a[:-1]),
                           r"'w_fc1.bias' holds float32\[31\], but its code reads float32\[32\]"),
    "a weight in float64": (_change(_first("w_fc1.bias"), lambda a: a.astype(np.float64)), "holds float64"),
    "weights not safetensors": (lambda m, files: files.update({WEIGHTS: b"\xff" * 64}), "is malformed"),
}


def _build(good: str, folder, name: str) -> str:
    edit, _ = CASES[name]
    manifest, files = _members(good)
    edit(manifest, files)
    path = str(folder / f"case{list(CASES).index(name)}.eclat")
    _write(path, manifest, files)
    return path


def _flips(src: str, folder, tag: str, member: str | None, count: int = 40) -> list[str]:
    """count copies of src, each with one bit flipped: spread over member's stored bytes, or over
    the whole file."""
    data = open(src, "rb").read()
    lo, hi = 0, len(data)
    if member is not None:
        with zipfile.ZipFile(src) as z:
            info = z.getinfo(member)
        at = info.header_offset  # the local header: 30 bytes, the name, the extra field, then the data
        lo = at + 30 + sum(int.from_bytes(data[at + k:at + k + 2], "little") for k in (26, 28))
        hi = lo + info.compress_size
    paths = []
    for j in range(count):
        at = lo + (hi - lo) * j // count
        damaged = bytearray(data)
        damaged[at] ^= 1 << (j % 8)
        paths.append(str(folder / f"{tag}{j}.eclat"))
        open(paths[-1], "wb").write(bytes(damaged))
    return paths


LOAD_EACH = textwrap.dedent("""
    import json, sys
    import numpy as np
    import eclat
    from eclat.compiler.artifact import ArtifactError
    x, want = np.load(sys.argv[1]), np.load(sys.argv[2])
    for path in sys.argv[3:]:
        try:
            outs = eclat.load(path)(x)
            right = all(np.allclose(o, want[f"arr_{j}"], rtol=1e-4, atol=1e-5) for j, o in enumerate(outs))
            result = {"outcome": "right" if right else "wrong"}
        except ArtifactError as e:
            result = {"outcome": "refused", "message": str(e)}
        except Exception as e:
            result = {"outcome": "raised", "message": f"{type(e).__name__}: {e}"}
        print(json.dumps({"path": path, **result}), flush=True)
""")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    torch.manual_seed(0)
    model, x = TwoOut().eval(), torch.randn(3, 16)
    compiled = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    folder = tmp_path_factory.mktemp("damage")
    path = str(folder / "good.eclat")
    compiled.save(path)
    with torch.no_grad():
        want = model(x)
    np.save(folder / "x.npy", x.numpy())
    np.savez(folder / "want.npz", want["logits"].numpy(), want["norm"].numpy())
    return {"path": path, "folder": folder, "compiled": compiled, "x": x.numpy(),
            "want": [want["logits"].numpy()]}


@pytest.fixture(scope="module")
def outcomes(good):
    """Every damaged artifact loaded and run in one child process: path -> outcome."""
    folder = good["folder"]
    paths = {name: _build(good["path"], folder, name) for name in CASES}
    manifest, files = _members(good["path"])
    manifest["device"]["features"] += ",+made-up-feature"  # another CPU's: the stored IR is read
    foreign = str(folder / "foreign.eclat")
    _write(foreign, manifest, files)
    flips = {"kernels.ll": _flips(foreign, folder, "ll", "kernels.ll"),
             "file": _flips(good["path"], folder, "any", None)}
    every = [*paths.values(), *flips["kernels.ll"], *flips["file"]]
    argv = [sys.executable, "-c", LOAD_EACH, str(folder / "x.npy"), str(folder / "want.npz"), *every]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    results = {}
    for line in r.stdout.splitlines():
        row = json.loads(line)
        results[row.pop("path")] = row
    crash = f"the child process ended with {r.returncode}: {r.stderr[-2000:]}"
    return {"paths": paths, "flips": flips, "results": results, "crash": crash}


@pytest.mark.parametrize("name", list(CASES))
def test_an_edited_manifest_is_refused(outcomes, name):
    got = outcomes["results"].get(outcomes["paths"][name])
    assert got is not None, outcomes["crash"]
    message = CASES[name][1]
    if message is None:
        assert got["outcome"] in ("refused", "right"), got
    else:
        assert got["outcome"] == "refused", got
        assert got["message"].startswith(outcomes["paths"][name]), got  # names the file
        assert re.search(message, got["message"]), got


@pytest.mark.parametrize("where", ["kernels.ll", "file"])
def test_single_bit_flips_are_refused_or_harmless(outcomes, where):
    got = [outcomes["results"].get(p) for p in outcomes["flips"][where]]
    assert None not in got, outcomes["crash"]
    assert all(g["outcome"] in ("refused", "right") for g in got), got
    refused = [g["message"] for g in got if g["outcome"] == "refused"]
    assert refused and all("corrupt" in m or "not an eclat artifact" in m for m in refused), refused
    if where == "kernels.ll":  # read to rebuild for this CPU: only a flip whose bytes come out whole passes
        assert len(refused) >= 35, got


# --- members read lazily and within bounds ---------------------------------------------------------

def _with_member(good, tmp_path, name: str, chunks: int, fill: bytes = b"\0") -> str:
    """good with member name replaced by (or added as) chunks of 16 MiB of fill, deflated; the
    checksums are left as they were."""
    manifest, files = _members(good["path"])
    text = json.dumps(manifest).encode()
    files = {MANIFEST: text, **files, MANIFEST_DIGEST: hashlib.sha256(text).hexdigest().encode()}
    path = str(tmp_path / "big.eclat")
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            if n != name:
                z.writestr(n, d)
        info = zipfile.ZipInfo(name)
        info.compress_type = zipfile.ZIP_DEFLATED
        with z.open(info, "w", force_zip64=True) as f:
            for _ in range(chunks):
                f.write(fill * (16 << 20))
    return path


def _peak_bytes(fn) -> int:
    """The most memory Python and numpy held while fn ran."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_an_unused_member_is_never_read(good, tmp_path):
    path = _with_member(good, tmp_path, "extra.bin", 16)  # 256 MiB, 250 kB in the file
    loaded = []
    assert _peak_bytes(lambda: loaded.append(load_artifact(path))) < 16 << 20
    np.testing.assert_allclose(loaded[0](good["x"])[0], good["want"][0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("member,chunks,message", [
    (MANIFEST, 5, "member manifest.json holds 83886080 bytes, more than the 67108864 it may"),
    (WEIGHTS, 1, r"member weights.safetensors holds 16777216 bytes, more than the \d+ it may"),
])
def test_a_member_larger_than_its_cap_is_refused_unread(good, tmp_path, member, chunks, message):
    path = _with_member(good, tmp_path, member, chunks, b" ")
    with pytest.raises(ArtifactError, match=message):
        load_artifact(path)


def test_a_size_header_that_lies_reads_no_more_than_it_says(good, tmp_path):
    """The zip's directory says kernels.o holds 1000 bytes; its deflated stream holds 64 MiB: no
    more than 1000 are read, and the zip's CRC refuses them."""
    path = _with_member(good, tmp_path, "kernels.o", 4)
    data = bytearray(open(path, "rb").read())
    with zipfile.ZipFile(path) as z:
        at = z.start_dir
    while data[at + 46:at + 46 + int.from_bytes(data[at + 28:at + 30], "little")] != b"kernels.o":
        at = data.index(b"PK\x01\x02", at + 46)  # the next central directory entry
    data[at + 24:at + 28] = (1000).to_bytes(4, "little")  # its uncompressed size
    open(path, "wb").write(bytes(data))
    with zipfile.ZipFile(path) as z:
        assert z.getinfo("kernels.o").file_size == 1000

    def load() -> None:
        with pytest.raises(ArtifactError, match="truncated or corrupt"):
            load_artifact(path)
    assert _peak_bytes(load) < 16 << 20


def test_a_deeply_nested_manifest_is_refused(good, tmp_path):
    _, files = _members(good["path"])
    path = str(tmp_path / "deep.eclat")
    deep = b'{"format": "eclat-artifact", "format_version": 1, "sha256": {}, "x": ' + b"[" * 100000 + \
        b"]" * 100000 + b"}"
    _write(path, deep, files, rehash=False)
    with pytest.raises(ArtifactError, match="malformed manifest .RecursionError"):
        load_artifact(path)


def test_saving_refuses_code_built_from_another_program(good, tmp_path):
    """The CLI once wrote artifacts lacking weights their code read: a later build had changed the
    program the executable kept. What is saved is derived from the program and checked against
    the code built from it; a mismatch is refused and nothing is written."""
    exe = good["compiled"].executable
    pack = next(n for n in exe.program.buffers if n.startswith("pack:"))
    drifted = copy.copy(exe)
    drifted.program = dataclasses.replace(exe.program, buffers={n: b for n, b in exe.program.buffers.items()
                                                                if n != pack})
    model = eclat.CompiledModel(drifted, good["compiled"].inputs, None, good["compiled"].report())
    with pytest.raises(ArtifactError, match="differ from its program's"):
        model.save(str(tmp_path / "drifted.eclat"))
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("make,message", [
    (lambda p: p.mkdir(), "is a folder"),
    (lambda p: p.write_bytes(b""), "truncated or corrupt"),
    (lambda p: None, "does not exist"),
])
def test_what_is_not_an_artifact_file(tmp_path, make, message):
    path = tmp_path / "x.eclat"
    make(path)
    with pytest.raises(ArtifactError, match=f"{path}.*{message}"):
        load_artifact(path)
