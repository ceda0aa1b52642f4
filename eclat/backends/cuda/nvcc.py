"""CUDA C -> PTX or a cubin with nvcc, cached on disk by (source, arch, output); and the resources
ptxas reports for each kernel, which say whether a schedule can launch at all."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...autotune.cache import cache_dir
from ...errors import EclatError

# per multiprocessor (and per block for shared memory) on every arch from sm_80 on
REGISTERS_PER_SM = 65536
STATIC_SHARED_BYTES = 48 * 1024  # a block's static __shared__ arrays: more needs dynamic memory
REGISTER_UNIT = 256  # registers are allocated per warp in units of this many

_REFUSED = re.compile(r"Entry function '(\w+)' uses too much")  # ptxas's error for a resource
_FUNCTION = re.compile(r"Compiling entry function '(\w+)'")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")
_SPILL = re.compile(r"(\d+) bytes spill stores")


@dataclass(frozen=True)
class Resources:
    """What ptxas gave one kernel."""

    registers: int
    shared_bytes: int
    spill_bytes: int  # stores spilled to local memory: slow, but it launches

    def unlaunchable(self, threads: int) -> str | None:
        """Why a block of `threads` threads cannot launch with these resources; None if it can."""
        per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        if per_warp * -(-threads // 32) > REGISTERS_PER_SM:
            return f"{self.registers} registers x {threads} threads exceed the {REGISTERS_PER_SM} of an SM"
        if self.shared_bytes > STATIC_SHARED_BYTES:
            return f"{self.shared_bytes} bytes of shared memory exceed the {STATIC_SHARED_BYTES} of a block"
        return None


def nvcc_path() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME (or /usr/local/cuda)."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = Path(home) / "bin" / "nvcc"
    return str(cand) if cand.exists() else None


def _nvcc(source: str, arch: str, kind: str, timeout: float = 300.0) -> tuple[bytes | None, str]:
    """(the output, nvcc's messages) of nvcc --{kind} for arch, cached on disk; the output is None
    where ptxas refused a kernel its resources (the messages name it), any other failure raises."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise EclatError("the CUDA backend needs nvcc (the CUDA toolkit) to compile kernels: none on PATH "
                         "or in $CUDA_HOME")
    key = hashlib.sha256(f"{arch}\n{kind}\n{source}".encode()).hexdigest()[:32]
    cached, report = cache_dir() / kind / f"{key}.{kind}", cache_dir() / kind / f"{key}.txt"
    if report.exists():
        return (cached.read_bytes() if cached.exists() else None), report.read_text()
    verbose = ["-Xptxas", "-v"] if kind == "cubin" else []
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.cu", Path(tmp) / f"k.{kind}"
        src.write_text(source)
        proc = subprocess.run([nvcc, f"--{kind}", f"-arch={arch}", "-O3", *verbose, "-o", str(out), str(src)],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 and not _REFUSED.search(proc.stderr):
            raise EclatError(f"nvcc failed for {arch}:\n{proc.stderr[-4000:]}")
        data = out.read_bytes() if proc.returncode == 0 else None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            cached.write_bytes(data)
        report.write_text(proc.stderr)
    except OSError:
        pass  # a read-only cache only costs a recompile
    return data, proc.stderr


def compile_ptx(source: str, arch: str = "sm_80", timeout: float = 300.0) -> str:
    """PTX text for source on arch (e.g. "sm_80", "sm_90")."""
    return _nvcc(source, arch, "ptx", timeout)[0].decode()


def compile_cubin(source: str, arch: str, timeout: float = 300.0) -> bytes:
    """Machine code for arch; raises, naming the kernels, where ptxas refuses their resources."""
    cubin, report = _nvcc(source, arch, "cubin", timeout)
    if cubin is None:
        raise EclatError(f"ptxas refused kernels for {arch}: {', '.join(_REFUSED.findall(report))}")
    return cubin


def parse_resources(report: str) -> dict[str, Resources]:
    """Each kernel's registers, static shared memory and spills from ptxas -v's report."""
    out: dict[str, Resources] = {}
    name, spill = None, 0
    for line in report.splitlines():
        if m := _FUNCTION.search(line):
            name, spill = m.group(1), 0
        elif (m := _SPILL.search(line)) and name:
            spill = int(m.group(1))
        elif (m := _USED.search(line)) and name:
            out[name] = Resources(int(m.group(1)), int(m.group(2) or 0), spill)
            name = None
    return out


def unlaunchable(source: str, threads: dict[str, int], arch: str) -> dict[str, str]:
    """The kernels of source (name -> block size) that cannot launch on arch, each with why."""
    _, report = _nvcc(source, arch, "cubin")
    refused = {name: "ptxas refused it: too much shared memory" for name in _REFUSED.findall(report)}
    resources = parse_resources(report)
    limited = {name: why for name, n in threads.items()
               if name in resources and (why := resources[name].unlaunchable(n))}
    return limited | refused


__all__ = ["Resources", "compile_cubin", "compile_ptx", "nvcc_path", "parse_resources", "unlaunchable"]
