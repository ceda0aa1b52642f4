"""CUDA C -> PTX with nvcc, cached on disk by (source, arch)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ...autotune.cache import cache_dir
from ...errors import EclatError


def nvcc_path() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME (or /usr/local/cuda)."""
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    cand = Path(home) / "bin" / "nvcc"
    return str(cand) if cand.exists() else None


def compile_ptx(source: str, arch: str = "sm_80", timeout: float = 300.0) -> str:
    """PTX text for source on arch (e.g. "sm_80", "sm_90")."""
    nvcc = nvcc_path()
    if nvcc is None:
        raise EclatError("the CUDA backend needs nvcc (the CUDA toolkit) to compile kernels: none on PATH "
                         "or in $CUDA_HOME")
    key = hashlib.sha256(f"{arch}\n{source}".encode()).hexdigest()[:32]
    cached = cache_dir() / "ptx" / f"{key}.ptx"
    if cached.exists():
        return cached.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.cu", Path(tmp) / "k.ptx"
        src.write_text(source)
        proc = subprocess.run([nvcc, "--ptx", f"-arch={arch}", "-O3", "-o", str(out), str(src)],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise EclatError(f"nvcc failed for {arch}:\n{proc.stderr[-4000:]}")
        ptx = out.read_text()
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(ptx)
    except OSError:
        pass  # a read-only cache only costs a recompile
    return ptx
