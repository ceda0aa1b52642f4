"""Values stored in fewer bits on a GPU: weights rounded to a low-precision format
(compiler.quantize), and bfloat16 buffers.

    pack_weights(program) -> program with a packed copy of each formatted weight

A weight with a format and its geometry (`Buffer.along`: K and inner) gets a copy in the format's
storage (quantize.storage, over the weight seen as [outer, K, inner]): `name:q` holds the values
(bf16: int16 high halves; int8: int8; int4: two k per byte, q + 8, k even in the low nibble) and
`name:s` the float32 scales (int8: [outer, inner]; int4: [outer, K / group, inner]). Kernels still
load the weight by element; the renderer reads the copy instead (`decode`), so every strategy and
every gather reads the packed bytes, and the float32 weight itself is never uploaded. A weight
that its format does not hold exactly keeps float32.

A bfloat16 buffer (held widened in float32 on the host: numpy has no bfloat16) is stored as its 16
bits on the device: `device_dtype`, `to_device` and `from_device` convert at the runtimes' copies."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np

from ...compiler.derived import derived
from ...compiler.kernel import Buffer, Program
from ...compiler.quantize import FORMATS, storage
from ...ir.dtypes import DType, from_numpy, round_bfloat16

PARTS = (":q", ":s")  # the packed values and their scales, named after the weight


def _flat_storage(data: np.ndarray, fmt) -> list[np.ndarray] | None:
    """storage(data, fmt)'s parts, flat (the arrays the buffers hold, as derived remembers them)."""
    parts = storage(data, fmt)
    return None if parts is None else [p.reshape(-1) for p in parts]


def pack_weights(program: Program) -> Program:
    """program plus the packed copies of its formatted weights (idempotent: a program that has them,
    e.g. loaded from an artifact, comes back as it is)."""
    buffers = dict(program.buffers)
    for name, b in program.buffers.items():
        if b.format is None or b.along is None or b.data is None or name + PARTS[0] in buffers:
            continue
        k, inner = b.along
        data, fmt = np.asarray(b.data, np.float32), FORMATS[b.format]
        whole = data.reshape(-1, k, inner)
        parts = derived(data, ("whole", fmt.name, b.along), partial(_flat_storage, whole, fmt))
        for suffix, flat in zip(PARTS, parts or ()):
            buffers[name + suffix] = Buffer(name + suffix, flat.size, from_numpy(flat.dtype), "weight", flat)
    return program if len(buffers) == len(program.buffers) else dataclasses.replace(program, buffers=buffers)


def packed_reads(program: Program) -> set[str]:
    """The formatted weights that kernels read through a packed copy: their float32 data is never read."""
    return {n for n, b in program.buffers.items() if b.role == "weight" and n + PARTS[0] in program.buffers}


def resident(program: Program) -> dict[str, Buffer]:
    """The buffers a device holds: all but the weights read through a packed copy."""
    skip = packed_reads(program)
    return {n: b for n, b in program.buffers.items() if n not in skip}


def device_dtype(dt: DType) -> np.dtype:
    """The numpy type of dt's elements on a GPU."""
    return np.dtype(np.uint16) if dt is DType.bfloat16 else dt.np


def to_device(dt: DType, values: np.ndarray) -> np.ndarray:
    """values of type dt (bfloat16 widened) as the flat array a GPU buffer of dt holds."""
    flat = np.ascontiguousarray(values, dtype=dt.np).reshape(-1)
    if dt is not DType.bfloat16:
        return flat
    return (round_bfloat16(flat).view(np.uint32) >> 16).astype(np.uint16)


def from_device(dt: DType, raw: np.ndarray) -> np.ndarray:
    """A GPU buffer of dt read back (raw, in device_dtype) as the host holds dt."""
    return (raw.astype(np.uint32) << 16).view(np.float32) if dt is DType.bfloat16 else raw


def decode(fmt: str, along: tuple[int, int], q: str, s: str, i: str, bits_to_float: str) -> str:
    """The C expression of element i (an int variable) of a weight packed in fmt, read from the
    arrays q and s; bits_to_float: the dialect's uint -> float bit cast, with {}."""
    if fmt == "bf16":
        return bits_to_float.format(f"((unsigned int)(unsigned short){q}[{i}] << 16)")
    k, inner = along
    group = FORMATS[fmt].group or k
    n = f"{i} % {inner}" if inner > 1 else "0"
    kk = f"({i} / {inner})" if inner > 1 else i
    kk = f"({kk} % {k})"
    outer = f"({i} / {k * inner})"
    scale = f"{s}[{outer} * {k // group * inner} + {kk} / {group} * {inner} + {n}]"
    if FORMATS[fmt].bits == 8:
        return f"((float){q}[{i}] * {scale})"
    byte = f"{q}[{outer} * {k // 2 * inner} + {kk} / 2 * {inner} + {n}]"
    return f"((float)((({byte} >> (({kk} & 1) * 4)) & 15) - 8) * {scale})"


__all__ = ["PARTS", "decode", "device_dtype", "from_device", "pack_weights", "packed_reads", "resident",
           "to_device"]
