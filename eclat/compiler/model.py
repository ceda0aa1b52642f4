"""CompiledModel: validated calls into a compiled program, and its report."""

from __future__ import annotations

import copy
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir.dtypes import DType


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: DType
    index_range: tuple[int, int] | None = None  # [low, high): an input used to index checks its values
    divisor: bool = False  # an integer input that divides: a zero in it raises, as in torch

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype.name,
                "index_range": None if self.index_range is None else list(self.index_range),
                "divisor": self.divisor}

    @staticmethod
    def from_json(data: dict[str, Any]) -> InputSpec:
        """The spec to_json wrote (raises ValueError, KeyError or TypeError on anything else)."""
        r = data.get("index_range")
        if r is not None and (len(r) != 2 or any(type(v) is not int for v in r)):
            raise ValueError(f"index range {r!r} is not two integers")
        return InputSpec(str(data["name"]), tuple(int(n) for n in data["shape"]), DType[data["dtype"]],
                         None if r is None else (r[0], r[1]), data.get("divisor") is True)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or _is_torch(x)


def input_structure(example: Any) -> Any:
    """How the example inputs nest, as JSON data: a list for a tuple or list, {"dict": [[key, child],
    ...]} for a dict (in its order, which is the order torch.export flattens it in), null for a
    tensor, {"const": value} for a number, string or None that export baked into the program (any
    other object as {"opaque": its type}, not checked)."""
    if isinstance(example, (list, tuple)):
        return [input_structure(x) for x in example]
    if isinstance(example, dict):
        return {"dict": [[k, input_structure(v)] for k, v in example.items()]}
    if _is_array(example):
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


def _leaves(x: Any, structure: Any, where: str) -> list[Any]:
    """x's tensors in the order of the program's inputs, x checked against structure."""
    if structure is None:
        return [x]
    if isinstance(structure, list):
        if not isinstance(x, (list, tuple)) or len(x) != len(structure):
            given = f"{type(x).__name__} of {len(x)}" if isinstance(x, (list, tuple)) else type(x).__name__
            raise ValueError(f"{where}: expected a tuple or list of {len(structure)}, given a {given}")
        return [leaf for k, (a, s) in enumerate(zip(x, structure)) for leaf in _leaves(a, s, f"{where}[{k}]")]
    if "opaque" in structure:
        return []
    if "const" in structure:
        if _is_array(x) or x != structure["const"]:
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
    return [leaf for k, s in structure["dict"] for leaf in _leaves(x[k], s, f"{where}[{k!r}]")]


class CompiledModel:
    """Call with torch tensors or numpy arrays nested as the example inputs were (dicts matched by
    key), or with the flat list of `inputs` as positional arrays; get the same kind back: torch
    outputs in the model's own structure, numpy outputs as one array or a list. Calls from several
    threads at once are safe: a CPU program gives each call its own memory, others take turns."""

    def __init__(self, executable: Any, inputs: list[InputSpec], out_spec: Any, report: dict,
                 in_structure: Any = None):
        self.executable = executable
        self.inputs = inputs
        self.out_spec = out_spec
        self.in_structure = [None] * len(inputs) if in_structure is None else in_structure
        self._report = report
        self._expected = [(s.shape, np.dtype(s.dtype.np)) for s in inputs]
        self._torch_dtypes: list[Any] | None = None  # each input's torch dtype, once torch is seen
        # GPU programs keep their buffers on the device: their calls take turns
        reentrant = getattr(executable, "reentrant", False)
        self._execute = executable.run if reentrant else _one_at_a_time(executable)
        if any(s.index_range or s.divisor for s in inputs):  # kernels clamp an index, torch raises
            self._execute = _values_checked(inputs, self._execute)

    def __call__(self, *args: Any) -> Any:
        if self._plain(args):  # the common call, checked in one pass: a tenth of a small model's time
            outs = self._execute(list(args))
            return outs[0] if len(outs) == 1 else outs
        arrays = self._plain_torch(args)
        if arrays is not None:  # the common torch call: 8 us where the general path below takes 25
            return self._as_torch(self._execute(arrays))
        flat = self._flat(args)
        use_torch = any(_is_torch(x) for x in flat)
        arrays = [self._array(k, spec, x) for k, (spec, x) in enumerate(zip(self.inputs, flat))]
        outs = self._execute(arrays)
        if not use_torch:
            return outs[0] if len(outs) == 1 else outs
        return self._as_torch(outs)

    def _flat(self, args: tuple) -> list[Any]:
        """The call's tensors in the order of self.inputs: nested as the example inputs were, or flat."""
        if len(args) == len(self.inputs) and all(_is_array(a) for a in args):
            return list(args)
        if len(args) != len(self.in_structure):
            raise ValueError(f"expected {len(self.in_structure)} arguments, given {len(args)}; the inputs "
                             f"are {', '.join(_describe(s) for s in self.inputs)}")
        leaves = _leaves(args, self.in_structure, "arguments")
        if len(leaves) != len(self.inputs):  # a structure that disagrees with the program: never run it
            want = len(self.inputs)
            raise ValueError(f"the arguments hold {len(leaves)} tensors, not the program's {want}")
        return leaves

    def _as_torch(self, outs: list[np.ndarray]) -> Any:
        """outs as tensors, in the model's own output structure."""
        import torch

        tensors = [torch.from_numpy(o) for o in outs]
        program = getattr(self.executable, "program", None)
        if program is not None:  # bfloat16 outputs are computed widened (numpy has no bfloat16)
            wide = [program.buffers[n].dtype is DType.bfloat16 for n in program.outputs]
            tensors = [t.to(torch.bfloat16) if w else t for t, w in zip(tensors, wide)]
        if isinstance(self.out_spec, str):  # as an artifact stores it: torch's pytree JSON
            try:
                self.out_spec = torch.utils._pytree.treespec_loads(self.out_spec)
            except Exception as e:  # torch's own errors for a spec it cannot read
                why = f"{type(e).__name__}: {e}"
                raise ValueError(f"the stored output structure cannot be read: {why}") from None
        if hasattr(self.out_spec, "num_leaves") and not self.out_spec.is_leaf():
            return torch.utils._pytree.tree_unflatten(tensors, self.out_spec)
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def _plain(self, args: tuple) -> bool:
        """Whether args are exactly the expected contiguous numpy arrays (a plain loop: a generator
        under all() costs a microsecond more, a tenth of a small model's call)."""
        if len(args) != len(self._expected):
            return False
        for a, (shape, dtype) in zip(args, self._expected):
            if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype or not a.flags.c_contiguous:
                return False
        return True

    def _plain_torch(self, args: tuple) -> list[np.ndarray] | None:
        """args as arrays when they are exactly the expected contiguous CPU tensors, needing no
        grad, conversion or copy; else None."""
        torch = sys.modules.get("torch")
        if torch is None or len(args) != len(self._expected):
            return None
        if self._torch_dtypes is None:  # bfloat16 is converted, so never plain
            self._torch_dtypes = [None if s.dtype is DType.bfloat16 else getattr(torch, s.dtype.name, None)
                                  for s in self.inputs]
        arrays = []
        for a, (shape, _), dtype in zip(args, self._expected, self._torch_dtypes):
            if type(a) is not torch.Tensor or a.dtype is not dtype or a.shape != shape or \
                    a.requires_grad or not a.is_cpu or not a.is_contiguous():
                return None
            arrays.append(a.numpy())
        return arrays

    @staticmethod
    def _array(k: int, spec: InputSpec, x: Any) -> np.ndarray:
        where = f"input {k} ({spec.name})"
        if _is_torch(x):
            got = str(x.dtype).removeprefix("torch.")
            if got != spec.dtype.name:
                raise ValueError(f"{where}: expected dtype {spec.dtype.name}, given {got}")
            if x.device.type != "cpu":
                raise ValueError(f"{where}: expected a CPU tensor, given one on {x.device}")
            x = x.detach()
            a = x.float().numpy() if spec.dtype is DType.bfloat16 else x.numpy()
        elif isinstance(x, np.ndarray):
            a = x
            if a.dtype != spec.dtype.np:
                raise ValueError(f"{where}: expected dtype {spec.dtype.np}, given {a.dtype}")
        else:
            raise ValueError(f"{where}: expected a torch.Tensor or numpy.ndarray, given {type(x).__name__}")
        if tuple(a.shape) != spec.shape:
            raise ValueError(f"{where}: expected shape {list(spec.shape)}, given {list(a.shape)}")
        return np.ascontiguousarray(a)

    def save(self, path: str) -> None:
        """Write an artifact that `eclat.load` runs without torch, egglog or a new search."""
        from .artifact import save_artifact

        save_artifact(self, path)

    def report(self) -> dict:
        """What was chosen and why: JSON-serialisable."""
        return copy.deepcopy(self._report)


def _describe(spec: InputSpec) -> str:
    return f"{spec.name}: {spec.dtype.name}{list(spec.shape)}"


def _values_checked(specs: list[InputSpec], run: Callable[[list[np.ndarray]], list[np.ndarray]]) -> Callable:
    """run, after checking what torch would raise on: an index out of its range, an integer divisor 0."""
    ranges = [(k, s, *s.index_range) for k, s in enumerate(specs) if s.index_range]
    divisors = [(k, s) for k, s in enumerate(specs) if s.divisor]

    def checked(arrays: list[np.ndarray]) -> list[np.ndarray]:
        for k, spec, low, high in ranges:
            a = arrays[k]
            if a.size and (a.min() < low or a.max() >= high):
                bad = a[(a < low) | (a >= high)].flat[0]
                raise IndexError(f"input {k} ({spec.name}): index {bad} is out of range: this input indexes "
                                 f"a dimension of size {high}, valid indices are {low} to {high - 1}")
        for k, spec in divisors:
            if not arrays[k].all():
                raise ZeroDivisionError(f"input {k} ({spec.name}) divides integers and holds a zero")
        return run(arrays)
    return checked


def _one_at_a_time(executable: Any) -> Callable[[list[np.ndarray]], list[np.ndarray]]:
    lock = threading.Lock()

    def locked(arrays: list[np.ndarray]) -> list[np.ndarray]:
        with lock:
            return executable.run(arrays)
    return locked
