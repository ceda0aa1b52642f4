"""Device model: measured peaks are positive and plausible, cached by fingerprint, errors are clear."""

import json
import shutil
import subprocess

import pytest

from eclat.autotune import device as dev_mod
from eclat.autotune.device import DeviceError, describe_devices, get_device, parse_target
from eclat.backends import get_target
from eclat.backends.cpu.probe import CpuProbe
from eclat.backends.cuda.probe import MACROS as CUDA_MACROS
from eclat.backends.gpu.probe import gpu_source
from eclat.backends.opencl.probe import OpenCLProbe


def _plausible(d):
    assert 0.5 < d.peak_gflops["float32"] < 1e6  # GFLOP/s: from an old laptop core to a GPU
    assert 0.5 < d.peak_gbps < 2e4  # GB/s
    assert 0.0 < d.launch_overhead_us < 1e4
    assert d.threads >= 1 and len(d.fingerprint) == 16


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """One CPU measurement shared by the tests below: (cache folder, device)."""
    folder = tmp_path_factory.mktemp("cache")
    return folder, get_device("cpu", threads=1, cache_dir=folder)


def _copy_cache(src, dst):
    shutil.copytree(src / "devices", dst / "devices")
    (path,) = (dst / "devices").glob("cpu-*.json")
    return path


def test_cpu_measured_then_cached(measured, monkeypatch):
    folder, d = measured
    _plausible(d)
    assert d.kind == "cpu" and d.threads == 1
    (cached,) = (folder / "devices").glob("cpu-*.json")
    assert d.fingerprint in cached.name
    monkeypatch.setattr(dev_mod, "load_average", lambda: 1e9)  # never quieter than when measured: not redone
    monkeypatch.setattr(CpuProbe, "measure", lambda *a: pytest.fail("measured again"))
    assert get_device("cpu", threads=1, cache_dir=folder) == d


def test_cache_is_read_not_remeasured(measured, tmp_path):
    path = _copy_cache(measured[0], tmp_path)
    data = json.loads(path.read_text())
    data["device"]["peak_gflops"] = {"float32": 1234.5}
    data["device"]["info"]["load_during_measurement"] = 0.0
    path.write_text(json.dumps(data))
    assert get_device("cpu", threads=1, cache_dir=tmp_path).peak_gflops == {"float32": 1234.5}


@pytest.mark.parametrize("load_now, remeasured", [(0.3, True), (20.0, False)])
def test_peaks_measured_on_a_busy_machine_are_measured_again_when_it_is_quiet(measured, tmp_path,
                                                                             monkeypatch, load_now,
                                                                             remeasured):
    path = _copy_cache(measured[0], tmp_path)
    data = json.loads(path.read_text())
    data["device"]["peak_gflops"] = {"float32": 1234.5}
    data["device"]["info"]["load_during_measurement"] = 9.0  # a test suite ran beside it
    path.write_text(json.dumps(data))
    monkeypatch.setattr(dev_mod, "load_average", lambda: load_now)
    again = get_device("cpu", threads=1, cache_dir=tmp_path)
    assert (again.peak_gflops != {"float32": 1234.5}) == remeasured


def test_corrupt_cache_warns_and_remeasures(measured, tmp_path):
    path = _copy_cache(measured[0], tmp_path)
    path.write_bytes(b"\x00garbage{")
    with pytest.warns(UserWarning, match="unreadable device cache"):
        again = get_device("cpu", threads=1, cache_dir=tmp_path)
    _plausible(again)
    assert again.fingerprint == measured[1].fingerprint
    assert json.loads(path.read_text())["device"]["fingerprint"] == again.fingerprint  # rewritten


def test_fingerprint_depends_on_threads_and_is_stable():
    probe = get_target("cpu").probe()
    assert probe.identify(0, 1)["fingerprint"] == probe.identify(0, 1)["fingerprint"]
    assert probe.identify(0, 1)["fingerprint"] != probe.identify(0, 2)["fingerprint"]


@pytest.mark.parametrize("target, match", [
    ("tpu", "unknown target"), ("opencl:x", "bad device index"), ("cpu:1", "one CPU target"),
    ("opencl:99", "no OpenCL device 99"), ("metal", "Metal"),
])
def test_bad_targets(target, match, tmp_path):
    with pytest.raises(DeviceError, match=match):
        get_device(target, cache_dir=tmp_path)


def test_bad_threads(tmp_path):
    with pytest.raises(DeviceError, match="threads must be a positive integer"):
        get_device("cpu", threads=0, cache_dir=tmp_path)


def test_parse_target():
    assert parse_target("cpu") == ("cpu", 0)
    assert parse_target("opencl:2") == ("opencl", 2)


def test_describe_devices_lists_cpu_first(tmp_path):
    rows = describe_devices(cache_dir=tmp_path, measure=False)
    assert rows[0]["target"] == "cpu" and rows[0]["name"]
    assert "peak_gbps" not in rows[0]  # not measured when asked not to


def _opencl_available():
    return bool(OpenCLProbe().names())


@pytest.mark.skipif(not _opencl_available(), reason="no OpenCL device (install pocl-opencl-icd)")
def test_opencl_measured(tmp_path):
    d = get_device("opencl", cache_dir=tmp_path)
    _plausible(d)
    assert d.kind == "opencl" and d.info["compute_units"] == d.threads
    assert get_device("opencl:0", cache_dir=tmp_path) == d  # same device, from the cache


_CUDA_SHIM = """
#define __global__
struct dim3_ { unsigned x, y, z; };
static dim3_ blockIdx, blockDim, threadIdx;
static inline float fmaf(float a, float b, float c) { return a * b + c; }
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_cuda_benchmark_source_is_valid_cpp(tmp_path):
    # no GPU here: at least the CUDA dialect of the benchmark kernels must parse (against a tiny shim)
    src = tmp_path / "bench.cu"
    src.write_text(_CUDA_SHIM + gpu_source(CUDA_MACROS))
    proc = subprocess.run(["g++", "-fsyntax-only", "-x", "c++", str(src)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
