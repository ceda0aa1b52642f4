"""CompiledModel: validated calls into a compiled program, and its report."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ir.dtypes import DType


@dataclass(frozen=True)
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: DType


def _flatten(args: Any) -> list[Any]:
    if isinstance(args, (list, tuple)):
        return [leaf for a in args for leaf in _flatten(a)]
    if isinstance(args, dict):
        return [leaf for a in args.values() for leaf in _flatten(a)]
    return [args]


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


class CompiledModel:
    """Call with torch tensors or numpy arrays (positional, as the example inputs);
    get the same kind back: torch outputs in the model's own structure, numpy outputs
    as one array or a list."""

    def __init__(self, executable: Any, inputs: list[InputSpec], out_spec: Any, report: dict):
        self.executable = executable
        self.inputs = inputs
        self.out_spec = out_spec
        self._report = report
        self._expected = [(s.shape, np.dtype(s.dtype.np)) for s in inputs]
        self._torch_dtypes: list[Any] | None = None  # each input's torch dtype, once torch is seen

    def __call__(self, *args: Any) -> Any:
        if self._plain(args):  # the common call, checked in one pass: a tenth of a small model's time
            outs = self.executable.run(list(args))
            return outs[0] if len(outs) == 1 else outs
        arrays = self._plain_torch(args)
        if arrays is not None:  # the common torch call: 8 us where the general path below takes 25
            return self._as_torch(self.executable.run(arrays))
        flat = _flatten(args)
        if len(flat) != len(self.inputs):
            raise ValueError(f"expected {len(self.inputs)} inputs "
                             f"({', '.join(_describe(s) for s in self.inputs)}), given {len(flat)}")
        use_torch = any(_is_torch(x) for x in flat)
        arrays = [self._array(k, spec, x) for k, (spec, x) in enumerate(zip(self.inputs, flat))]
        outs = self.executable.run(arrays)
        if not use_torch:
            return outs[0] if len(outs) == 1 else outs
        return self._as_torch(outs)

    def _as_torch(self, outs: list[np.ndarray]) -> Any:
        """outs as tensors, in the model's own output structure."""
        import torch

        tensors = [torch.from_numpy(o) for o in outs]
        if isinstance(self.out_spec, str):  # as an artifact stores it: torch's pytree JSON
            self.out_spec = torch.utils._pytree.treespec_loads(self.out_spec)
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
    return f"{spec.dtype.name}{list(spec.shape)}"
