"""Arrays as a safetensors member of a zip file, streamed when written and read in place: a
model's weights are never held a second time as one bytes object (the peak of a compile that keeps
its result, and of a load). Any safetensors reader loads the member."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import struct
import zipfile
from typing import Any

import numpy as np

CODES = {np.dtype(t): code for t, code in [
    ("float64", "F64"), ("float32", "F32"), ("float16", "F16"), ("int64", "I64"), ("int32", "I32"),
    ("int16", "I16"), ("int8", "I8"), ("uint64", "U64"), ("uint32", "U32"), ("uint16", "U16"),
    ("uint8", "U8"), ("bool", "BOOL")]}


def write_tensors(z: zipfile.ZipFile, member: str, arrays: dict[str, np.ndarray],
                  digest: Any = None) -> str:
    """Write arrays (any shape, C order on disk) as the safetensors member `member` of z, stored
    uncompressed (read in place); returns the sha256 of the member's bytes (digest: a hashlib
    sha256 already fed what precedes them, to hash both)."""
    header, offset = {}, 0
    for name, a in arrays.items():
        if a.dtype not in CODES:
            raise TypeError(f"{name}: dtype {a.dtype} has no safetensors code")
        header[name] = {"dtype": CODES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    h = hashlib.sha256() if digest is None else digest
    info = zipfile.ZipInfo(member)
    info.compress_type = zipfile.ZIP_STORED
    with z.open(info, "w", force_zip64=True) as f:
        for chunk in (struct.pack("<Q", len(text)), text):
            f.write(chunk)
            h.update(chunk)
        for a in arrays.values():
            data = memoryview(np.ascontiguousarray(a)).cast("B")  # one array's copy at most, if strided
            f.write(data)
            h.update(data)
    return h.hexdigest()


DTYPES = {code: t for t, code in CODES.items()}


def buffer(size: int) -> np.ndarray:
    """size bytes (uint8), page-aligned and zeroed, in memory of its own (anonymous pages): numpy
    asks the kernel for huge pages for a large array, and where the kernel then compacts memory to
    find them (transparent_hugepage/defrag "madvise"), first touching 650 MB took 4.6 s, not 0.4."""
    return np.frombuffer(mmap.mmap(-1, max(size, 1)), np.uint8)[:size]


def read_tensors(image: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays of a safetensors image (uint8), as writable views of it (a copy where one would be
    misaligned for its dtype). Raises ValueError when the image is malformed."""
    if image.size < 8:
        raise ValueError("shorter than the length of its header")
    n = int(image[:8].view("<u8")[0])
    if n > image.size - 8:
        raise ValueError(f"its header's length ({n}) runs past its end")
    header = json.loads(image[8:8 + n].tobytes())
    data = image[8 + n:]
    arrays = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (begin, end) = DTYPES[t["dtype"]], [int(d) for d in t["shape"]], t["data_offsets"]
        if not 0 <= begin <= end <= data.size or end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r}: offsets {begin}..{end} do not hold {dtype}{shape}")
        a = data[begin:end].view(dtype).reshape(shape)
        arrays[name] = a if a.flags.aligned else a.copy()
    return arrays


__all__ = ["read_tensors", "write_tensors"]
