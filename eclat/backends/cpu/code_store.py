"""Kernel code kept on disk (<cache_dir>/code), so that another process compiling the same kernels
(a second compile from the program cache, the next run of a benchmark or a test suite) neither
emits nor optimises them again. Two kinds of entry, one file each, named by a digest of its key:

  function  a kernel function's name (which its emitter's key and the vector width decide), this
            eclat's sources and LLVM's host (jit.code_environment) -> the length of its outer loop
            and its LLVM IR text as codegen emits it
  object    jit's key of a kernel's IR text (the text and LLVM's host) -> its object code and its
            optimised IR

A file is written whole (a temporary, renamed) behind a digest of its contents; one that is
damaged, truncated or foreign is a miss, compiled afresh and written again. Every build that wrote
something trims the folder to CODE_STORE_BYTES, least recently used first. What is read is still
verified as everything built is (compiler/verify.py). ECLAT_CODE_STORE=0 keeps code in the process."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any

from ...autotune.cache import cache_dir
from ...compiler.program_cache import trim as lru_trim

CODE_STORE_BYTES = 512 << 20
ENV_VAR = "ECLAT_CODE_STORE"
_MAGIC = b"eclat-code-1\n"


def _folder() -> Path | None:
    return None if os.environ.get(ENV_VAR, "1") == "0" else cache_dir() / "code"


def _path(folder: Path, kind: str, key: str) -> Path:
    return folder / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:40]}.bin"


def read(kind: str, key: str, parts: int) -> tuple[Any, list[bytes]] | None:
    """(header, its parts blobs) kept for key, or None."""
    folder = _folder()
    if folder is None:
        return None
    path = _path(folder, kind, key)
    try:
        data = path.read_bytes()
        if not data.startswith(_MAGIC):
            return None
        digest, body = data[len(_MAGIC):len(_MAGIC) + 32], data[len(_MAGIC) + 32:]
        if hashlib.sha256(body).digest() != digest:
            return None
        raw = zlib.decompress(body)
        head, _, rest = raw.partition(b"\n")
        entry = json.loads(head)
        if entry["key"] != key or len(entry["sizes"]) != parts:  # two keys with one file name
            return None
        blobs, at = [], 0
        for n in entry["sizes"]:
            blobs.append(rest[at:at + n])
            at += n
        if at != len(rest):
            return None
        os.utime(path)  # used now: the last to be trimmed
        return entry["header"], blobs
    except (OSError, ValueError, KeyError, TypeError, RecursionError, zlib.error):  # none yet, or damaged
        return None


def write(kind: str, key: str, header: Any, blobs: list[bytes]) -> bool:
    """Keep (header, blobs) for key; whether it was written (a store that cannot be written is
    only slower)."""
    folder = _folder()
    if folder is None:
        return False
    head = json.dumps({"key": key, "header": header, "sizes": [len(b) for b in blobs]}).encode()
    body = zlib.compress(b"\n".join([head, b"".join(blobs)]), 1)
    path = _path(folder, kind, key)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_bytes(_MAGIC + hashlib.sha256(body).digest() + body)
        os.replace(tmp, path)
        return True
    except (OSError, TypeError, ValueError):
        return False


def trim() -> None:
    """The folder cut to CODE_STORE_BYTES, least recently used first."""
    folder = _folder()
    if folder is not None and folder.is_dir():
        lru_trim(folder, CODE_STORE_BYTES, "*.bin")
