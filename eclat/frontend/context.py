"""What a lowering sees besides its arguments (Ctx), and the dtypes the frontend takes: shared by
the driver of the lowering (lower.py) and the lowering table (ops.py)."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import torch

from eclat.errors import UnsupportedOpError
from eclat.ir import graph as g
from eclat.ir.dtypes import DType
from eclat.ir.graph import Node
from eclat.ir.symbolic import Expr, Var, as_int, evaluate, sint, to_expr
from eclat.ir.view import View

TORCH_DTYPES = {torch.float32: DType.float32, torch.float16: DType.float16,
                torch.bfloat16: DType.bfloat16, torch.int32: DType.int32, torch.int64: DType.int64,
                torch.bool: DType.bool}

INT_MAX = 2**31 - 1  # sizes and bounds stay within int32


def ir_dtype(dtype: torch.dtype, what: str = "tensor") -> DType:
    if dtype not in TORCH_DTYPES:
        raise TypeError(f"{what} has dtype {dtype}, which eclat does not support "
                        f"(supported: {', '.join(str(d) for d in TORCH_DTYPES)})")
    return TORCH_DTYPES[dtype]


@dataclass
class Ctx:
    """What a lowering may need beyond its arguments: the output FX node's meta
    (shape and dtype as the IR spells them) and a way to add constant tensors."""
    weights: dict[str, np.ndarray]
    symbols: dict[str, Var] = field(default_factory=dict)
    out_shape: tuple[sint, ...] = ()  # of the node's (first) tensor result
    out_dtype: DType | None = None
    index_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    divisors: set[str] = field(default_factory=set)
    # torch's values of the node's positional arguments (fake tensors where they are tensors), for the
    # few lowerings whose meaning depends on how torch lays a tensor out (as_strided reads storage)
    arg_vals: tuple[Any, ...] = ()

    def constant(self, array: np.ndarray) -> Node:
        """A constant tensor made by the frontend (e.g. adaptive pooling weights)."""
        name = f"_frontend_const{len([k for k in self.weights if k.startswith('_frontend_const')])}"
        self.weights[name] = array
        return g.weight(name, array, TORCH_DTYPES[torch.from_numpy(array).dtype])

    def index_range(self, idx: Node, low: int, size: sint) -> None:
        """idx indexes a dimension of size `size`, valid from low (0, or -size where negatives wrap).
        Where its values come straight from a graph input, each call checks them: the kernels clamp an
        index, where torch raises."""
        source, n = _index_source(idx), as_int(size)
        if source is not None and n is not None and idx.dtype in (DType.int32, DType.int64):
            was_low, was_high = self.index_ranges.get(source.arg, (low, n))
            self.index_ranges[source.arg] = (max(was_low, low), min(was_high, n))

    def divisor(self, b: Any) -> None:
        """b divides integers: where its values come straight from a graph input, each call checks that
        none is zero (the kernels give 0, where torch raises)."""
        source = _index_source(b) if isinstance(b, Node) and not b.dtype.is_float else None
        if source is not None:
            self.divisors.add(source.arg)

    def torch_layout(self, k: int) -> tuple[tuple[sint, ...], sint] | None:
        """The strides and storage offset torch gives the k-th positional argument, or None where
        unknown (a lowering called directly, outside torch.export)."""
        val = self.arg_vals[k] if k < len(self.arg_vals) else None
        if not isinstance(val, torch.Tensor):
            return None
        return tuple(self.sym(s) for s in val.stride()), self.sym(val.storage_offset())

    def sym(self, x: Any) -> sint:
        """A torch SymInt / sympy expression / int as an IR size."""
        if isinstance(x, torch.SymInt):
            x = x.node.expr
        if isinstance(x, (int, np.integer)):
            return int(x)
        return _from_sympy(x, self.symbols)


def _index_source(idx: Node) -> Node | None:
    """The graph input whose every value reaches idx unchanged (through casts and views that keep all
    of its elements), or None."""
    while idx.op != "input":
        if idx.op in ("cast", "contiguous") or (idx.op == "view" and _keeps_all(idx.arg, idx.srcs[0].shape)):
            idx = idx.srcs[0]
        else:
            return None
    return idx


def _keeps_all(view: View, shape: tuple[sint, ...]) -> bool:
    """Whether view reads every element of a source of this shape (a reshape, permute or broadcast
    does; a slice or a step does not)."""
    sizes = [as_int(n) for n in (*view.shape, *shape)]
    if None in sizes or math.prod(sizes[len(view.shape):]) > 1 << 20 or math.prod(view.shape) > 1 << 22:
        return False  # symbolic or too large to enumerate: not checked
    grid = np.meshgrid(*(np.arange(n) for n in view.shape), indexing="ij")
    flat, valid = view.index(view.index_vars())
    env = {v.name: axis for v, axis in zip(view.index_vars(), grid)}
    where, valid = (np.broadcast_to(evaluate(e, env), view.shape) for e in (flat, valid))
    return np.unique(where[valid != 0]).size == math.prod(shape)


class Unavailable:
    """A result eclat does not compute (pooling indices, batch-norm saved statistics):
    harmless unless something uses it."""

    def __init__(self, what: str):
        self.what = what


def _from_sympy(e: sympy.Expr, symbols: dict[str, Var]) -> sint:
    if e.is_Integer:
        return int(e)
    if e.is_Symbol:
        if e.name not in symbols:
            symbols[e.name] = Var(e.name, 0, INT_MAX)
        return symbols[e.name]
    args = [to_expr(_from_sympy(a, symbols)) for a in e.args]
    name = type(e).__name__
    combine: dict[str, Callable[[Expr, Expr], Expr]] = {
        "Add": operator.add, "Mul": operator.mul, "FloorDiv": operator.floordiv,
        "Mod": operator.mod, "PythonMod": operator.mod}
    if name not in combine:
        raise UnsupportedOpError(f"symbolic size {e}", detail=f"sympy {name} is not supported")
    out = args[0]
    for a in args[1:]:
        out = combine[name](out, a)
    return as_int(out) if as_int(out) is not None else out
