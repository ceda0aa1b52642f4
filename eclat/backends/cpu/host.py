"""The host CPU as LLVM names it, in one place: its name, triple and enabled features, and what
code generation reads from them (the widest usable vector unit, its lanes and registers).

Every function that takes `features` reads the host's when given None, so that code can be
generated (and tested) for another CPU than the one it runs on:

    vector_lanes(frozenset({"avx512f"}))   # 16 float32 lanes
    vector_unit(frozenset({"avx2", "fma"}))  # "AVX2+FMA"
"""

from __future__ import annotations

from functools import cache

import llvmlite.binding as llvm

# the widest vector register each unit has, in bytes, widest first: the first enabled one wins
_WIDTHS = (("avx512f", 64), ("avx", 32), ("avx2", 32), ("neon", 16), ("sse", 16), ("sse2", 16))


@cache
def _llvm() -> None:
    llvm.initialize_native_target()


@cache
def features() -> frozenset[str]:
    """The host's enabled CPU features, as LLVM names them (the `+` ones of its feature string).
    Where LLVM cannot read them (some ARM hosts), the features every CPU of the triple has."""
    _llvm()
    try:
        text = llvm.get_host_cpu_features().flatten()
    except RuntimeError:
        arch = triple().split("-")[0]
        return frozenset({"neon"} if arch in ("aarch64", "arm64") else
                         {"sse", "sse2"} if arch == "x86_64" else set())
    return frozenset(f[1:] for f in text.split(",") if f.startswith("+"))


@cache
def cpu_name() -> str:
    """LLVM's name for the host CPU (e.g. "znver3", "skylake-avx512", "apple-m1")."""
    _llvm()
    return llvm.get_host_cpu_name()


@cache
def triple() -> str:
    """The target triple of this process (e.g. "x86_64-unknown-linux-gnu")."""
    _llvm()
    return llvm.get_process_triple()


def _given(feats: frozenset[str] | None) -> frozenset[str]:
    return features() if feats is None else frozenset(feats)


def vector_bytes(features: frozenset[str] | None = None) -> int:
    """The width of the widest usable vector register in bytes (0: no vector unit)."""
    feats = _given(features)
    return next((width for name, width in _WIDTHS if name in feats), 0)


def vector_lanes(features: frozenset[str] | None = None, itemsize: int = 4) -> int:
    """Lanes of itemsize bytes in the widest usable vector register: float32 lanes are 16 with
    AVX-512, 8 with AVX or AVX2, 4 with SSE or NEON, 1 without a vector unit."""
    if itemsize < 1:
        raise ValueError(f"itemsize must be positive, given {itemsize}")
    return max(1, vector_bytes(features) // itemsize)


def vector_registers(features: frozenset[str] | None = None) -> int:
    """Architectural vector registers of that unit: 32 with AVX-512 (zmm0-31) and on AArch64
    (v0-31), 16 with AVX/SSE (ymm/xmm0-15)."""
    feats = _given(features)
    return 32 if "avx512f" in feats or "neon" in feats else 16


def vector_unit(features: frozenset[str] | None = None) -> str:
    """The widest usable vector unit in words: "AVX-512", "AVX2+FMA", "AVX2", "AVX", "NEON",
    "SSE" or "scalar"."""
    feats = _given(features)
    if "avx512f" in feats:
        return "AVX-512"
    if "avx2" in feats:
        return "AVX2+FMA" if "fma" in feats else "AVX2"
    if "avx" in feats:
        return "AVX+FMA" if "fma" in feats else "AVX"
    if "neon" in feats:
        return "NEON"
    if "sse" in feats or "sse2" in feats:
        return "SSE"
    return "scalar"


CACHE_FALLBACK = {1: 32 << 10, 2: 1 << 20}  # where the OS does not say: the smallest of the x86 cores in use


@cache
def cache_bytes(level: int) -> int:
    """The per-core data (or unified) cache of that level in bytes, as the OS describes cpu0's caches
    (Linux sysfs); CACHE_FALLBACK's where it does not."""
    from pathlib import Path

    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (index / "type").read_text().strip()
            if int((index / "level").read_text()) != level or kind == "Instruction":
                continue
            size = (index / "size").read_text().strip().upper()
            return int(size.rstrip("KM")) * {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
        except (OSError, ValueError):
            break
    return CACHE_FALLBACK[level]


def description() -> dict:
    """The host for reports and benchmark headers: LLVM's CPU name, the triple, the enabled
    features (sorted), the float32 lanes and vector registers code is generated for, and the
    vector unit."""
    return {"cpu": cpu_name(), "triple": triple(), "features": sorted(features()),
            "lanes": vector_lanes(), "registers": vector_registers(), "vector_unit": vector_unit(),
            "l1_bytes": cache_bytes(1), "l2_bytes": cache_bytes(2)}


__all__ = ["cache_bytes", "cpu_name", "description", "features", "triple", "vector_bytes", "vector_lanes",
           "vector_registers", "vector_unit"]
