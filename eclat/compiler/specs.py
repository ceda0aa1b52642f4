"""What a compiled model takes: each input's name, shape and dtype (with the value checks torch would
make), and how the inputs nest (tuples, lists, dicts, constants), as JSON data an artifact keeps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir.dtypes import DType
from ..ir.symbolic import Var, evaluate, sint, size_from_json, size_to_json, var_list, variables


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


def describe_shape(shape: tuple[sint, ...]) -> str:
    """shape as a user reads it: [s0 in 1..512, 64]."""
    return "[" + ", ".join(f"{n} in {n.lo}..{n.hi}" if isinstance(n, Var) else str(n) for n in shape) + "]"


def bind_sizes(shapes: list[tuple[sint, ...]], given: list[tuple[int, ...]],
               names: list[str] | None = None) -> dict[str, int]:
    """The values of the run-time sizes in shapes, read off the given shapes of a call; ValueError
    naming the input when a shape does not fit (a constant size differs, a size is outside its
    bounds, or two inputs disagree on one)."""
    env: dict[str, int] = {}
    later = []
    for k, (shape, got) in enumerate(zip(shapes, given)):
        where = f"input {k}" if names is None else names[k]
        if len(shape) != len(got):
            raise _misfit(where, shape, got)
        for d, n in zip(shape, got):
            if isinstance(d, int):
                if d != n:
                    raise _misfit(where, shape, got)
            elif isinstance(d, Var) and d.name not in env:
                if not d.lo <= n <= d.hi:
                    raise _misfit(where, shape, got, f" ({d.name} must be in {d.lo}..{d.hi})")
                env[d.name] = n
            else:
                later.append((where, shape, got, d, n))
    for where, shape, got, d, n in later:  # a size another input's size determines, or an expression of sizes
        unknown = variables(d) - env.keys()
        if len(unknown) == 1:  # an affine size a*v + b = n, v read off it
            name = unknown.pop()
            base = evaluate(d, {**env, name: 0})
            slope = evaluate(d, {**env, name: 1}) - base
            if slope and (n - base) % slope == 0:
                env[name] = (n - base) // slope
        if variables(d) - env.keys() or evaluate(d, env) != n:
            raise _misfit(where, shape, got, f" (the sizes {env} do not give it)")
        for v in var_list(d):
            if not v.lo <= env[v.name] <= v.hi:
                raise _misfit(where, shape, got, f" ({v.name} = {env[v.name]} must be in {v.lo}..{v.hi})")
    return env


def _misfit(where: str, shape: tuple[sint, ...], got: tuple[int, ...], why: str = "") -> ValueError:
    return ValueError(f"{where}: expected shape {describe_shape(shape)}, given {list(got)}{why}")


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_torch(x)


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
