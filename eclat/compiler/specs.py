"""What a compiled model takes: each input's name, shape and dtype (with the value checks torch would
make), and how the inputs nest (tuples, lists, dicts, constants), as JSON data an artifact keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir.dtypes import DType
from ..ir.symbolic import sint, size_from_json, size_to_json


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[sint, ...]  # a symbolic size is any value in its variable's bounds (dynamic_shapes)
    dtype: DType
    index_range: tuple[int, int] | None = None  # [low, high): an input used to index checks its values
    divisor: bool = False  # an integer input that divides: a zero in it raises, as in torch

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": [size_to_json(n) for n in self.shape], "dtype": self.dtype.name,
                "index_range": None if self.index_range is None else list(self.index_range),
                "divisor": self.divisor}

    @staticmethod
    def from_json(data: dict[str, Any]) -> InputSpec:
        """The spec to_json wrote (raises ValueError, KeyError or TypeError on anything else)."""
        r = data.get("index_range")
        if r is not None and (len(r) != 2 or any(type(v) is not int for v in r)):
            raise ValueError(f"index range {r!r} is not two integers")
        shape = tuple(size_from_json(n) for n in data["shape"])
        return InputSpec(str(data["name"]), shape, DType[data["dtype"]],
                         None if r is None else (r[0], r[1]), data.get("divisor") is True)


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_torch(x) or hasattr(x, "__cuda_array_interface__")


def in_gpu_memory(x: Any) -> bool:
    """x is a tensor in GPU memory: a torch CUDA tensor, or anything with __cuda_array_interface__."""
    return bool(getattr(x, "is_cuda", False)) if is_torch(x) else hasattr(x, "__cuda_array_interface__")


def input_structure(example: Any) -> Any:
    """How the example inputs nest, as JSON data: a list for a tuple or list, {"dict": [[key, child],
    ...]} for a dict (in its order, which is the order torch.export flattens it in), null for a
    tensor, {"const": value} for a number, string or None that export baked into the program (any
    other object as {"opaque": its type}, not checked)."""
    if isinstance(example, (list, tuple)):
        return [input_structure(x) for x in example]
    if isinstance(example, dict):
        return {"dict": [[k, input_structure(v)] for k, v in example.items()]}
    if is_array(example):
        return None
    if example is None or isinstance(example, (bool, int, float, str)):
        return {"const": example}
    return {"opaque": type(example).__name__}


def structure_tensors(structure: Any) -> int:
    """How many tensors a call nested as structure passes."""
    if structure is None:
        return 1
    if isinstance(structure, list):
        return sum(structure_tensors(s) for s in structure)
    return sum(structure_tensors(s) for _, s in structure.get("dict", ()))


def leaves(x: Any, structure: Any, where: str) -> list[Any]:
    """x's tensors in the order of the program's inputs, x checked against structure."""
    if structure is None:
        return [x]
    if isinstance(structure, list):
        if not isinstance(x, (list, tuple)) or len(x) != len(structure):
            given = f"{type(x).__name__} of {len(x)}" if isinstance(x, (list, tuple)) else type(x).__name__
            raise ValueError(f"{where}: expected a tuple or list of {len(structure)}, given a {given}")
        return [leaf for k, (a, s) in enumerate(zip(x, structure)) for leaf in leaves(a, s, f"{where}[{k}]")]
    if "opaque" in structure:
        return []
    if "const" in structure:
        if is_array(x) or x != structure["const"]:
            raise ValueError(f"{where}: the model was compiled for the constant {structure['const']!r}, "
                             f"given {x!r}")
        return []
    keys = [k for k, _ in structure["dict"]]
    if not isinstance(x, dict):
        raise ValueError(f"{where}: expected a dict with keys {keys}, given a {type(x).__name__}")
    if set(x) != set(keys):
        wrong = {"missing": [k for k in keys if k not in x], "unknown": [k for k in x if k not in keys]}
        raise ValueError(f"{where}: expected the keys {keys}; " +
                         "; ".join(f"{what} {ks}" for what, ks in wrong.items() if ks))
    return [leaf for k, s in structure["dict"] for leaf in leaves(x[k], s, f"{where}[{k!r}]")]
