"""Element types of the IR. float32 is first class; the others are representable. int8, uint8 and
int16 only store weights packed by a backend in a low-precision format (compiler.quantize): no
graph value has them."""

from __future__ import annotations

from enum import Enum

import numpy as np


class DType(Enum):
    # value: (numpy storage dtype, bytes per element, is floating point, C name)
    float32 = ("float32", 4, True, "float")
    float16 = ("float16", 2, True, "half")
    bfloat16 = ("float32", 2, True, "bfloat16")  # numpy has no bfloat16: stored widened
    int32 = ("int32", 4, False, "int")
    int64 = ("int64", 8, False, "long")
    bool = ("bool", 1, False, "bool")
    int8 = ("int8", 1, False, "char")
    uint8 = ("uint8", 1, False, "uchar")
    int16 = ("int16", 2, False, "short")

    @property
    def np(self) -> np.dtype:
        return np.dtype(self.value[0])

    @property
    def itemsize(self) -> int:
        return self.value[1]

    @property
    def is_float(self) -> bool:
        return self.value[2]

    @property
    def short(self) -> str:
        return {"float32": "f32", "float16": "f16", "bfloat16": "bf16",
                "int32": "i32", "int64": "i64", "bool": "bool", "int8": "i8", "uint8": "u8",
                "int16": "i16"}[self.name]

    def __repr__(self) -> str:
        return self.short


_FROM_NUMPY = {np.dtype(d.value[0]): d for d in DType if d is not DType.bfloat16}


def from_numpy(dtype: np.dtype) -> DType:
    try:
        return _FROM_NUMPY[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"eclat has no dtype for numpy {np.dtype(dtype)}") from None


def accumulator(dt: DType) -> np.dtype:
    """The numpy type sums and products of dt accumulate in: float32 for the half types (as torch
    does on the CPU), else dt's own."""
    return np.dtype(np.float32) if dt in (DType.float16, DType.bfloat16) else dt.np


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), kept as float32."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return rounded.astype(np.uint32).view(np.float32)
