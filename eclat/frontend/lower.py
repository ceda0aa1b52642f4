"""torch.nn.Module -> primitive Graph: torch.export, core ATen decompositions, then one
walk over the FX graph that applies the lowering table in `ops.py` node by node."""

from __future__ import annotations

import math
import operator
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sympy
import torch
from torch.export.graph_signature import InputKind, OutputKind

from eclat.errors import ExportError, UnsupportedOpError
from eclat.ir import graph as g
from eclat.ir.dtypes import DType
from eclat.ir.graph import Graph, Node
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


def source_line(node: torch.fx.Node) -> str | None:
    """'file.py:LINE in fn: code' for the innermost frame outside torch itself."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)', trace)
    if not frames:
        return None
    user = [f for f in frames if f"{os.sep}torch{os.sep}" not in f[0]] or frames
    path, line, fn, code = user[-1]
    return f"{os.path.basename(path)}:{line} in {fn}: {code.strip()}"


def export(model: torch.nn.Module, example_inputs: tuple, dynamic_shapes: Any = None
           ) -> torch.export.ExportedProgram:
    try:
        with warnings.catch_warnings():
            # torch.export trips over its own deprecated pytree API; not the user's concern
            warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
            ep = torch.export.export(model, tuple(example_inputs), dynamic_shapes=dynamic_shapes)
            return ep.run_decompositions()
    except Exception as e:  # torch raises many types; all mean "could not export"
        raise ExportError(f"torch.export failed for {type(model).__name__}: {type(e).__name__}: {e}") from e


def _bound(end: Any, unbounded: int) -> int:
    """An export range's end as an int within int32, `unbounded` where it has none. torch spells
    "no bound" as sympy's oo or its own int_oo, which int() does not take (int_oo raises
    AttributeError from sympy), so only a true integer is converted."""
    if isinstance(end, int) or getattr(end, "is_Integer", False):
        return max(-INT_MAX - 1, min(int(end), INT_MAX))
    return unbounded


def lower(model: torch.nn.Module, example_inputs: tuple, *, dynamic_shapes: Any = None) -> Graph:
    """Lower model's forward pass on example_inputs to a primitive Graph."""
    from .ops import LOWERINGS, convert_output

    if not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs must be a tuple, got {type(example_inputs).__name__}")
    ep = export(model, example_inputs, dynamic_shapes)
    weights: dict[str, np.ndarray] = {}
    ctx = Ctx(weights)
    for name, r in ep.range_constraints.items():
        ctx.symbols[str(name)] = Var(str(name), _bound(r.lower, -INT_MAX - 1), _bound(r.upper, INT_MAX))
    specs = {s.arg.name: s for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")}
    env: dict[torch.fx.Node, Any] = {}
    inputs: list[Node] = []
    outputs: list[Node] = []
    tied: dict[tuple, Node] = {}
    for node in ep.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder":
            env[node] = _placeholder(ep, ctx, node, specs[node.name], val, inputs, tied)
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            fn = LOWERINGS.get(node.target)
            if fn is None:
                raise UnsupportedOpError(_op_name(node.target), source_line(node))
            try:
                for a in torch.utils._pytree.tree_leaves((args, kwargs)):
                    if isinstance(a, Unavailable) and node.target is not operator.getitem:
                        raise NotImplementedError(f"uses {a.what}, which eclat does not compute")
                first = val[0] if isinstance(val, (tuple, list)) and val else val
                if isinstance(first, torch.Tensor):
                    ctx.out_shape = tuple(ctx.sym(d) for d in first.shape)
                    ctx.out_dtype = ir_dtype(first.dtype, f"the result of {_op_name(node.target)}")
                env[node] = fn(ctx, *args, **kwargs)
            except (ValueError, TypeError, NotImplementedError) as e:
                raise UnsupportedOpError(_op_name(node.target), source_line(node), str(e)) from e
            if isinstance(val, torch.Tensor) and not isinstance(env[node], Unavailable):
                _check(node, env[node], ctx)
        elif node.op == "output":
            outputs = [convert_output(ctx, env[o] if isinstance(o, torch.fx.Node) else o)
                       for o, spec in zip(node.args[0], ep.graph_signature.output_specs)
                       if _user_output(spec)]
    return Graph(inputs, outputs, weights, ep.call_spec.out_spec, ctx.index_ranges, ctx.divisors)


def _placeholder(ep, ctx: Ctx, node: torch.fx.Node, spec, val: Any, inputs: list[Node],
                 tied: dict[tuple, Node]) -> Any:
    if spec.kind == InputKind.USER_INPUT:
        if not isinstance(val, torch.Tensor):
            return val  # a non-tensor input is specialised to its example value by torch.export
        shape = tuple(ctx.sym(d) for d in val.shape)
        x = g.input_(node.name, shape, _dtype_or_raise(val.dtype, f"input {node.name!r}"))
        inputs.append(x)
        return x
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
        tensor = ep.state_dict[spec.target] if spec.target in ep.state_dict else ep.constants[spec.target]
        # tied parameters (an LM head sharing the embedding) are one weight under its first name
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
               tuple(tensor.stride()), tensor.dtype)
        if key in tied:
            return tied[key]
        dtype = _dtype_or_raise(tensor.dtype, f"weight {spec.target!r}")
        t = tensor.detach()
        array = (t.float() if dtype is DType.bfloat16 else t).contiguous().numpy().copy()
        ctx.weights[spec.target] = array
        tied[key] = g.weight(spec.target, array, dtype)
        return tied[key]
    raise UnsupportedOpError(f"graph input of kind {spec.kind.name}", detail=node.name)


def _user_output(spec) -> bool:
    if spec.kind != OutputKind.USER_OUTPUT:
        what = spec.kind.name.lower().replace("_", " ") + (f" of {spec.target!r}" if spec.target else "")
        raise UnsupportedOpError("state mutation", detail=f"the model's forward performs a {what}; eclat "
                                 "compiles pure inference (keep state such as caches outside the model)")
    return True


def _dtype_or_raise(dtype: torch.dtype, what: str) -> DType:
    try:
        return ir_dtype(dtype, what)
    except TypeError as e:
        raise UnsupportedOpError(f"dtype {dtype}", detail=str(e)) from None


class Unavailable:
    """A result eclat does not compute (pooling indices, batch-norm saved statistics):
    harmless unless something uses it."""

    def __init__(self, what: str):
        self.what = what


def _check(node: torch.fx.Node, out: Any, ctx: Ctx) -> None:
    """A lowering must produce exactly torch's shape and dtype: catching it here names the op."""
    if not isinstance(out, Node):
        raise AssertionError(f"lowering of {_op_name(node.target)} returned {type(out).__name__}")
    # symbolic sizes may be spelled differently; constant ones must agree
    same = len(out.shape) == len(ctx.out_shape) and all(
        as_int(a) == as_int(b) for a, b in zip(out.shape, ctx.out_shape))
    if not same or out.dtype is not ctx.out_dtype:
        raise AssertionError(f"lowering of {_op_name(node.target)} gave {out.dtype.short}{list(out.shape)}, "
                             f"torch says {ctx.out_dtype.short}{list(ctx.out_shape)}")


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))
