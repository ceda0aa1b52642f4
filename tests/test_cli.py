"""The `eclat` command, driven through main(argv) on a tiny model: every command, its output
files and its exit status (0 ok, 1 failure with one line on stderr, 2 usage)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from eclat.autotune.db import TuningDB, TuningKey
from eclat.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTORY = """
import torch


def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).eval()
    return model, (torch.randn(2, 8),)


def broken():
    return "not a pair"


def marked():
    open(__file__ + ".called", "w").close()
    return make()
"""
FAST = ["--autotune", "none", "--candidates", "1", "--quiet"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    (folder / "tiny.py").write_text(FACTORY)
    namespace: dict = {}
    exec(FACTORY, namespace)
    model, (x,) = namespace["make"]()
    np.save(folder / "x.npy", x.numpy())
    with torch.no_grad():
        want = model(x).numpy()
    artifact = folder / "tiny.eclat"
    assert main(["compile", f"{folder / 'tiny.py'}:make", "--target", "cpu", "-o", str(artifact), *FAST]) == 0
    return {"folder": folder, "artifact": artifact, "want": want, "spec": str(folder / "tiny.py")}


def test_compile_writes_an_artifact(work):
    assert work["artifact"].stat().st_size > 1000


def test_run_prints_a_summary_and_writes_npz(work, capsys):
    out = work["folder"] / "out.npz"
    x = str(work["folder"] / "x.npy")
    assert main(["run", str(work["artifact"]), "--inputs", x, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "output 0: float32[2, 3]" in printed
    np.testing.assert_allclose(np.load(out)["output0"], work["want"], rtol=1e-4, atol=1e-5)


def test_inspect_table_json_and_html(work, capsys):
    page = work["folder"] / "roofline.html"
    assert main(["inspect", str(work["artifact"]), "--html", str(page)]) == 0
    text = capsys.readouterr().out
    assert "kernel" in text and "e-graph:" in text and "whole model: estimated" in text
    assert re.search(r"compiled in [\d.]+ s \(.*build [\d.]+.*\)", text)
    assert "not measured (--measure runs it here)" in text
    html = page.read_text()
    assert "<svg" in html and "arithmetic intensity" in html and "GFLOP/s" in html
    assert main(["inspect", str(work["artifact"]), "--json", "--measure"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target"] == "cpu" and data["inputs"][0]["shape"] == [2, 8]
    fields = {"flops", "bytes", "schedule", "estimated_us", "measured_us"}
    assert data["kernels"] and all(fields <= set(k) for k in data["kernels"])
    assert data["measured_us"] > 0 and data["egraph"]["enodes"] > 0
    assert set(data["files"]) == {"manifest.json", "manifest.sha256", "weights.safetensors", "kernels.ll",
                                  "kernels.o"}


def test_inspect_reads_only_the_manifest(work, tmp_path, capsys):
    """An artifact whose object code and weights are damaged is still inspected (nothing but the
    manifest is read); running it is refused."""
    import zipfile

    damaged = tmp_path / "damaged.eclat"
    with zipfile.ZipFile(work["artifact"]) as z, zipfile.ZipFile(damaged, "w") as out:
        for name in z.namelist():
            data = z.read(name)
            out.writestr(name, data if name.startswith("manifest.") else b"\0" * len(data))
    assert main(["inspect", str(damaged), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["target"] == "cpu"
    assert main(["run", str(damaged), "--inputs", str(work["folder"] / "x.npy")]) == 1
    assert "fails its checksum" in capsys.readouterr().err


def test_db_merge(tmp_path, capsys):
    key = TuningKey.make("k0", [(4, 4)], "float32", "cpu", "dev")
    other = TuningKey.make("k1", [(4, 4)], "float32", "cpu", "dev")
    for name, entries in (("a.db", [(key, 5.0)]), ("b.db", [(key, 3.0), (other, 1.0)])):
        with TuningDB(tmp_path / name) as db:
            for k, us in entries:
                db.put(k, {"tile": [4, 4]}, us)
    out = tmp_path / "c.db"
    assert main(["db", "merge", str(tmp_path / "a.db"), str(tmp_path / "b.db"), "-o", str(out)]) == 0
    assert "2 entries" in capsys.readouterr().out
    with TuningDB(out, readonly=True) as db:
        assert db.get(key).measured_us == 3.0 and db.get(other) is not None


def test_autotune_records_into_the_database(work, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path / "cache"))  # no program cache from elsewhere
    db = tmp_path / "tuning.db"
    argv = ["autotune", work["spec"], "--target", "cpu", "--db", str(db), "--autotune", "fast",
            "--candidates", "1", "--quiet"]
    assert main(argv) == 0
    with TuningDB(db, readonly=True) as opened:
        recorded = len(opened)
    assert recorded >= 1  # the chosen candidate at least
    assert main(argv) == 0
    second = capsys.readouterr().out.splitlines()[-1]
    assert " 0 misses" in second and " 0 DB hits" not in second
    with TuningDB(db, readonly=True) as opened:
        assert len(opened) == recorded  # read back, nothing new


def test_a_foreign_database_warns_and_compiles(work, tmp_path, monkeypatch):
    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path / "cache"))
    foreign = tmp_path / "foreign.db"
    foreign.write_bytes(b"this is not sqlite at all" * 100)
    with pytest.warns(UserWarning, match="not a usable tuning database"):
        code = main(["compile", work["spec"], "-o", str(tmp_path / "m.eclat"), "--db", str(foreign),
                     "--autotune", "fast", "--candidates", "1", "--quiet"])
    assert code == 0 and (tmp_path / "m.eclat").exists()
    assert foreign.read_bytes() == b"this is not sqlite at all" * 100  # left as it was


def test_bench_prints_a_side_by_side_table(work, capsys):
    assert main(["bench", work["spec"], "--no-torch-compile", "--budget", "0.05", *FAST]) == 0
    table = capsys.readouterr().out
    assert "eclat" in table and "torch eager" in table and "1.00x" in table


def test_devices_lists_the_cpu(capsys):
    assert main(["devices", "--no-measure", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert any(r["kind"] == "cpu" for r in rows)


@pytest.mark.parametrize("argv,code,message", [
    (["compile", "missing.py:make", "-o", "x.eclat"], 1, "no such file"),
    (["run", "missing.eclat"], 1, "does not exist"),
    (["inspect", "missing.eclat"], 1, "does not exist"),
    (["db", "merge", "missing.db", "-o", "out.db"], 1, "tuning database missing.db does not exist"),
    ([], 2, "COMMAND"),
    (["compile", "model.py"], 2, "--output"),
    (["compile", "model.py", "-o", "x", "--target", "tpu"], 2, "invalid choice: 'tpu'"),
    (["compile", "model.py", "-o", "x", "--target", "cpu:3"], 2, "invalid choice: 'cpu:3'"),
    (["bench", "model.py", "--target", "opencl:0"], 2, "invalid choice: 'opencl:0'"),
    (["autotune", "model.py", "--db", "t.db", "--autotune", "none"], 2, "invalid choice: 'none'"),
    (["compile", "model.py", "-o", "no/such/folder/x.eclat"], 2, "there is no folder"),
    (["run", "x.eclat", "-o", "no/such/folder/out.npz"], 2, "there is no folder"),
    (["inspect", "x.eclat", "--html", "no/such/folder/r.html"], 2, "there is no folder"),
    (["inspect", "x.eclat", "--plot", "r.png"], 2, "unrecognized arguments: --plot"),
    (["inspect", "x.eclat", "--frobnicate"], 2, "unrecognized"),
])
def test_failures_exit_1_and_usage_errors_exit_2(tmp_path, monkeypatch, capsys, argv, code, message):
    monkeypatch.chdir(tmp_path)
    if code == 2:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    else:
        assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err
    if code == 1:
        assert err.count("\n") == 1 and err.startswith("eclat: error:")


@pytest.mark.slow
def test_a_tuned_artifact_holds_every_weight_its_code_reads(work, tmp_path, monkeypatch):
    """Tuning builds the program again and again; the artifact must hold what the chosen code reads
    (it once lacked a weight, and running it crashed: so it runs in a child process here)."""
    monkeypatch.setenv("ECLAT_CACHE_DIR", str(tmp_path / "cache"))
    artifact, out = tmp_path / "tuned.eclat", tmp_path / "out.npz"
    assert main(["compile", work["spec"], "-o", str(artifact), "--autotune", "fast", "--candidates", "2",
                 "--quiet"]) == 0
    r = subprocess.run([sys.executable, "-m", "eclat.cli", "run", str(artifact), "--inputs",
                        str(work["folder"] / "x.npy"), "-o", str(out)], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    np.testing.assert_allclose(np.load(out)["output0"], work["want"], rtol=1e-4, atol=1e-5)


def test_db_merge_of_a_missing_file_writes_nothing(tmp_path, capsys):
    with TuningDB(tmp_path / "a.db") as db:
        db.put(TuningKey.make("k0", [(4, 4)], "float32", "cpu", "dev"), {"tile": [4, 4]}, 5.0)
    out = tmp_path / "out.db"
    assert main(["db", "merge", str(tmp_path / "a.db"), str(tmp_path / "b.db"), "-o", str(out)]) == 1
    assert f"tuning database {tmp_path / 'b.db'} does not exist" in capsys.readouterr().err
    assert not out.exists()


def test_an_output_folder_that_does_not_exist_is_refused_before_compiling(work, capsys):
    called = work["folder"] / "tiny.py.called"
    with pytest.raises(SystemExit) as e:
        main(["compile", f"{work['spec']}:marked", "-o", str(work["folder"] / "none" / "m.eclat"), *FAST])
    assert e.value.code == 2 and not called.exists()  # the factory never ran
    err = capsys.readouterr().err
    assert f"there is no folder {work['folder'] / 'none'}" in err and ".tmp" not in err


def test_autotune_help_lists_only_the_modes_it_takes(capsys):
    with pytest.raises(SystemExit):
        main(["autotune", "--help"])
    text = capsys.readouterr().out
    assert "{fast,full}" in text and "none" not in text


def test_bad_factory_and_bad_inputs(work, capsys):
    assert main(["compile", f"{work['spec']}:broken", "-o", str(work["folder"] / "b.eclat"), *FAST]) == 1
    assert "must return (model, example_inputs[, dynamic_shapes])" in capsys.readouterr().err
    np.save(work["folder"] / "wrong.npy", np.zeros((5, 8), np.float32))
    assert main(["run", str(work["artifact"]), "--inputs", str(work["folder"] / "wrong.npy")]) == 1
    assert "expected shape [2, 8]" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["compile"], ["run"], ["inspect"], ["autotune"], ["db", "merge"], ["bench"],
                                  ["devices"]])
def test_every_command_has_help(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0 and f"usage: eclat {' '.join(argv)}" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("eclat ")


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "eclat.cli", "--help"], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0 and all(c in r.stdout for c in ("compile", "autotune", "devices"))


def test_a_reader_that_stops_early_is_not_an_error(work):
    """`eclat inspect --json | head`: the closed pipe ends the command quietly (it printed
    "eclat: error: BrokenPipeError" and exited 1)."""
    with subprocess.Popen([sys.executable, "-m", "eclat.cli", "inspect", str(work["artifact"]), "--json"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT) as p:
        p.stdout.read(1)
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=60) == 0 and "error" not in err, err


def test_cuda_artifact_without_a_cuda_device(work, tmp_path, capsys):
    from eclat.compiler.pipeline import device_missing

    if not device_missing("cuda"):
        pytest.skip("a CUDA device is here")
    artifact = tmp_path / "tiny_cuda.eclat"
    assert main(["compile", work["spec"], "--target", "cuda", "-o", str(artifact), *FAST]) == 0
    assert "no CUDA device found" in capsys.readouterr().err
    code = main(["run", str(artifact), "--inputs", str(work["folder"] / "x.npy")])
    assert code == 1 and "no CUDA device found" in capsys.readouterr().err
    assert main(["inspect", str(artifact)]) == 0  # reading needs no GPU
    text = capsys.readouterr().out
    assert "target cuda" in text and "k0" in text and "kernels.cu" in text
    assert main(["inspect", str(artifact), "--measure"]) == 1  # running does
    assert "no CUDA device found" in capsys.readouterr().err


def test_compile_with_rounded_weights_reports_their_error(tmp_path, capsys):
    factory = tmp_path / "wide.py"
    factory.write_text("import torch\n"
                       "def make():\n"
                       "    torch.manual_seed(0)\n"
                       "    return torch.nn.Linear(128, 64).eval(), (torch.randn(1, 128),)\n")
    out = tmp_path / "wide.eclat"
    assert main(["compile", f"{factory}:make", "--weights", "int8", "--max-error", "0.5", "-o", str(out),
                 *FAST]) == 0
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "weights: int8 (1 int8), " in capsys.readouterr().out
    assert main(["compile", f"{factory}:make", "--weights", "int4", "--max-error", "1e-9", "-o", str(out),
                 *FAST]) == 1
    assert "over max_error=1e-09" in capsys.readouterr().err
