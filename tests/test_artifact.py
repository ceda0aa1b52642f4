"""Artifacts: compile -> save -> load in a process where torch and egglog cannot be imported
-> run matches PyTorch; damaged, newer, foreign-target and foreign-CPU artifacts."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch

import eclat
from eclat.compiler.artifact import (
    FORMAT_VERSION,
    MANIFEST,
    MANIFEST_DIGEST,
    ArtifactError,
    save_artifact,
)
from eclat.compiler.encoding import decode_program, encode_program
from eclat.compiler.model import load as load_artifact
from tests.gpu_cases import opencl_or_skip

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TwoOut(torch.nn.Module):
    """Two outputs in a dict, a matmul, an elementwise chain and a reduction."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.relu(self.fc1(x))
        return {"logits": self.fc2(h), "norm": h.pow(2).sum(-1)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model, x = TwoOut().eval(), torch.randn(3, 16)
    compiled = eclat.compile(model, (x,), autotune="none", k=1, quiet=True)
    folder = tmp_path_factory.mktemp("artifact")
    path = str(folder / "model.eclat")
    save_artifact(compiled, path)
    with torch.no_grad():
        want = model(x)
    np.save(folder / "x.npy", x.numpy())
    return {"path": path, "folder": folder, "compiled": compiled, "x": x,
            "want": [want["logits"].numpy(), want["norm"].numpy()]}


def _edit_manifest(src: str, dst: str, edit) -> None:
    with zipfile.ZipFile(src) as z:
        files = {n: z.read(n) for n in z.namelist()}
    manifest = json.loads(files[MANIFEST])
    edit(manifest)
    files[MANIFEST] = json.dumps(manifest).encode()
    files[MANIFEST_DIGEST] = hashlib.sha256(files[MANIFEST]).hexdigest().encode()
    with zipfile.ZipFile(dst, "w") as z:
        for n, data in files.items():
            z.writestr(n, data)


# Run in a fresh interpreter where `import torch` and `import egglog` raise ImportError.
LOAD_WITHOUT_TORCH = textwrap.dedent("""
    import json, sys
    sys.modules["torch"] = None
    sys.modules["egglog"] = None
    import numpy as np
    import eclat
    model = eclat.load(sys.argv[1])
    outs = model(np.load(sys.argv[2]))
    outs = outs if isinstance(outs, list) else [outs]
    np.savez(sys.argv[3], *outs)
    print(json.dumps({"artifact": model.report()["artifact"],
                      "types": [type(o).__name__ for o in outs],
                      "torch": "torch" in sys.modules and sys.modules["torch"] is not None}))
""")


def test_round_trip_without_torch_matches_pytorch(saved):
    out = saved["folder"] / "outs.npz"
    argv = [sys.executable, "-c", LOAD_WITHOUT_TORCH, saved["path"], str(saved["folder"] / "x.npy"), str(out)]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["types"] == ["ndarray", "ndarray"] and not info["torch"]
    assert info["artifact"]["loaded_from"] == "object"  # machine code, not recompiled
    got = np.load(out)
    for j, want in enumerate(saved["want"]):
        np.testing.assert_allclose(got[f"arr_{j}"], want, rtol=1e-4, atol=1e-5)


def test_loaded_model_with_torch_inputs_keeps_the_output_structure(saved):
    loaded = load_artifact(saved["path"])
    out = loaded(saved["x"])
    assert set(out) == {"logits", "norm"} and isinstance(out["logits"], torch.Tensor)
    np.testing.assert_allclose(out["logits"].numpy(), saved["want"][0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="expected shape"):
        loaded(np.zeros((2, 16), np.float32))


def test_manifest_holds_the_kernel_program_as_data(saved):
    with zipfile.ZipFile(saved["path"]) as z:
        names = set(z.namelist())
        manifest = json.loads(z.read(MANIFEST))
    assert names == {"manifest.json", "manifest.sha256", "weights.safetensors", "kernels.ll", "kernels.o"}
    assert manifest["format_version"] == FORMAT_VERSION and manifest["target"] == "cpu"
    assert [(i["shape"], i["dtype"]) for i in manifest["inputs"]] == [([3, 16], "float32")]
    program = saved["compiled"].executable.program
    assert [k["name"] for k in manifest["program"]["kernels"]] == [k.name for k in program.kernels]
    weights = {n: b.data for n, b in program.buffers.items() if b.role == "weight"}
    back = decode_program(manifest["program"], weights)
    assert [k.body for k in back.kernels] == [k.body for k in program.kernels]  # structural equality
    assert [k.schedule for k in back.kernels] == [k.schedule for k in program.kernels]
    assert json.loads(json.dumps(encode_program(back))) == manifest["program"]


def test_the_object_code_is_the_files_the_process_ran(saved, monkeypatch):
    """Saving compiles nothing again: the stored object code is the entry points' object and each
    kernel's as compiled (cpu.artifact.bundle). A bundle cut short or padded is refused, so a
    damaged one is rebuilt from the stored IR instead."""
    from eclat.backends.cpu import artifact as cpu_artifact

    with zipfile.ZipFile(saved["path"]) as z:
        data = z.read("kernels.o")
    objects = cpu_artifact.unbundle(data)
    jit = saved["compiled"].executable.jit
    assert objects[1:] == [obj for obj, _ in jit.kernel_code] and len(objects) >= 2
    assert cpu_artifact.unbundle(cpu_artifact.bundle(objects)) == objects
    for bad in (data[:-1], data + b"x", data[:10], b"\x7fELF" + data[4:]):
        with pytest.raises(ValueError):
            cpu_artifact.unbundle(bad)


def test_weights_read_only_packed_are_stored_once(saved):
    """A Linear weight the matmul reads from its packed copy is stored packed, not twice; the
    round trip above runs from exactly these bytes."""
    from safetensors.numpy import load as st_load

    with zipfile.ZipFile(saved["path"]) as z:
        manifest = json.loads(z.read(MANIFEST))
        stored = set(st_load(z.read("weights.safetensors")))
    exe = saved["compiled"].executable
    weights = {n for n, b in exe.program.buffers.items() if b.role == "weight"}
    packed_only = weights - exe.module.used
    assert packed_only and "unused_weights" not in manifest["native"]  # derived at load, not listed
    assert stored == weights & exe.module.used and any(n.startswith("pack:") for n in stored)


def test_input_structure_and_index_ranges_are_kept(saved, tmp_path):
    import dataclasses

    c = saved["compiled"]
    spec = dataclasses.replace(c.inputs[0], index_range=(-100, 100))
    path = str(tmp_path / "dict.eclat")
    eclat.CompiledModel(c.executable, [spec], c.out_spec, c.report(), [{"dict": [["x", None]]}]).save(path)
    loaded = load_artifact(path)
    assert loaded.inputs[0].index_range == (-100, 100)
    out = loaded({"x": saved["x"]})  # called as the example was: a dict
    np.testing.assert_allclose(out["logits"].numpy(), saved["want"][0], rtol=1e-4, atol=1e-5)


def test_foreign_cpu_rebuilds_from_the_stored_ir(saved, tmp_path):
    path = str(tmp_path / "foreign.eclat")

    def foreign(m):
        m["device"]["features"] += ",+made-up-feature"
    _edit_manifest(saved["path"], path, foreign)
    loaded = load_artifact(path)
    assert loaded.report()["artifact"]["loaded_from"] == "source"
    np.testing.assert_allclose(loaded(saved["x"].numpy())[0], saved["want"][0], rtol=1e-4, atol=1e-5)


def _truncated(src: bytes) -> bytes:
    return src[: len(src) // 2]


def _flipped(src: bytes) -> bytes:
    data = bytearray(src)
    at = data.find(b"eclat_run")  # inside the stored (uncompressed) object code
    data[at] ^= 0xFF
    return bytes(data)


@pytest.mark.parametrize("damage,message", [
    (_truncated, "truncated or corrupt"),
    (_flipped, "corrupt"),
    (lambda src: b"not a zip at all", "truncated or corrupt"),
])
def test_damaged_artifacts_give_a_clear_error(saved, tmp_path, damage, message):
    path = tmp_path / "bad.eclat"
    path.write_bytes(damage(open(saved["path"], "rb").read()))
    with pytest.raises(ArtifactError, match=message):
        eclat.load(str(path))


@pytest.mark.parametrize("edit,message", [
    (lambda m: m.update(format_version=FORMAT_VERSION + 1), "format version 2.*upgrade eclat"),
    (lambda m: m.update(target="tpu"), "compiled for target 'tpu'"),
    (lambda m: m.update(format="something-else"), "not an eclat artifact"),
    (lambda m: m["program"].pop("kernels"), "malformed manifest"),
])
def test_newer_foreign_and_malformed_manifests_are_refused(saved, tmp_path, edit, message):
    path = str(tmp_path / "edited.eclat")
    _edit_manifest(saved["path"], path, edit)
    with pytest.raises(ArtifactError, match=message):
        eclat.load(path)


def test_missing_file_and_unsaveable_targets(tmp_path, saved):
    with pytest.raises(ArtifactError, match="does not exist"):
        eclat.load(str(tmp_path / "nope.eclat"))

    class Other:
        program = None

        def run(self, inputs):
            return []
    model = eclat.CompiledModel(Other(), [], None, {"target": "tpu"})
    with pytest.raises(ArtifactError, match="not supported yet"):
        save_artifact(model, str(tmp_path / "x.eclat"))
    assert not (tmp_path / "x.eclat").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "cnn", "llama", "hf_gpt2"])
def test_zoo_round_trip_without_torch(name, tmp_path):
    from tests.zoo import ZOO

    model, inputs = ZOO[name]()
    compiled = eclat.compile(model, inputs, autotune="none", k=1, quiet=True)
    path = str(tmp_path / f"{name}.eclat")
    compiled.save(path)
    np.save(tmp_path / "x.npy", inputs[0].numpy())
    with torch.no_grad():
        want = model(*inputs)
    want = want["logits"] if hasattr(want, "keys") else want
    argv = [sys.executable, "-c", LOAD_WITHOUT_TORCH, path, str(tmp_path / "x.npy"), str(tmp_path / "o.npz")]
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["artifact"]["loaded_from"] == "object"
    np.testing.assert_allclose(np.load(tmp_path / "o.npz")["arr_0"], want.numpy(), rtol=1e-3, atol=1e-4)


def test_opencl_round_trip(saved, tmp_path):
    opencl_or_skip()
    torch.manual_seed(0)
    model, x = TwoOut().eval(), saved["x"]
    compiled = eclat.compile(model, (x,), target="opencl", autotune="none", k=1, quiet=True)
    path = str(tmp_path / "model_cl.eclat")
    compiled.save(path)
    with zipfile.ZipFile(path) as z:
        assert "kernels.cl" in z.namelist() and "kernels.o" not in z.namelist()
    loaded = eclat.load(path)
    assert loaded.report()["target"] == "opencl"
    outs = loaded(x.numpy())
    for got, want in zip(outs, saved["want"]):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


class ReturnsConstants(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple:
        return x * 2, None, x.shape[0], 2.5, {"flag": True, "y": x + 1}


def test_outputs_that_are_constants_come_back_as_python_values(tmp_path):
    """None, Python numbers and bools among the outputs are returned as torch returns them, not as
    0-d tensors (a None crashed the compile), from the compiled model and from its artifact."""
    model, x = ReturnsConstants(), torch.randn(3, 4)
    compiled = eclat.compile(model, (x,), autotune="none", quiet=True)
    compiled.save(tmp_path / "c.eclat")
    for m in (compiled, eclat.load(tmp_path / "c.eclat")):
        y, none, rows, scale, rest = m(x)
        torch.testing.assert_close(y, x * 2)
        assert none is None and rows == 3 and type(rows) is int and scale == 2.5 and rest["flag"] is True
        torch.testing.assert_close(rest["y"], x + 1)
