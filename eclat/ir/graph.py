"""The primitive IR: a DAG of nodes over a small table of ops.

Every op is one row of `OPS`: its kind (which fixes arity and shape rule) and its
numpy meaning, which the reference interpreter runs. Binary and ternary ops need
operands of one shape; broadcasting is spelled out with `View` nodes (expand), so
every broadcast, transpose, slice or pad is a free index change, never a copy.
Later stages may register further ops (e.g. a recognised matmul) with `register`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .dtypes import DType, accumulator, round_bfloat16
from .symbolic import as_int, sint, sym_eq
from .view import View

LOG2E = 1.4426950408889634  # exp(x) is exp2(x * LOG2E) in this IR, which has no exp


@dataclass(frozen=True)
class OpDef:
    name: str
    kind: str  # leaf | unary | binary | ternary | reduce | gather | view | contiguous | composite
    numpy: Callable[..., np.ndarray] | None  # (node, *source arrays) -> array
    # composites only: the same value built from primitives, for backends without a native form
    decompose: Callable[[Node], Node] | None = None
    # a composite whose decomposition is one materialised value read through a view (a Winograd
    # transform): grouping makes it a kernel of its own, built once per argument and shapes
    alone: bool = False


OPS: dict[str, OpDef] = {}


def register(name: str, kind: str, numpy_fn: Callable[..., np.ndarray] | None,
             decompose: Callable[[Node], Node] | None = None, alone: bool = False) -> None:
    if kind == "composite" and decompose is None:
        raise ValueError(f"composite op {name!r} needs a decomposition into primitives")
    OPS[name] = OpDef(name, kind, numpy_fn, decompose, alone)


def _cast(node: Node, x: np.ndarray) -> np.ndarray:
    out = x.astype(node.dtype.np)
    return round_bfloat16(out) if node.dtype is DType.bfloat16 else out


def _max_reduce(node: Node, x: np.ndarray) -> np.ndarray:
    low = -np.inf if node.dtype.is_float else (False if node.dtype is DType.bool
                                               else np.iinfo(node.dtype.np).min)
    return np.max(x, axis=node.arg, initial=low).astype(node.dtype.np)


def _float_op(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def run(node: Node, x: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return fn(x).astype(node.dtype.np, copy=False)  # fn's result is new
    return run


def _arith(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def run(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):  # inf - inf, 0 * inf and integer wrap-around are meant
            return fn(a, b).astype(node.dtype.np, copy=False)
    return run


def _mod(node: Node, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    # C semantics (sign of the dividend), as every backend's native remainder
    with np.errstate(all="ignore"):
        if node.dtype.is_float:
            return np.fmod(a, b)
        return np.where(b == 0, 0, np.fmod(a, np.where(b == 0, 1, b))).astype(node.dtype.np)


def _gather(node: Node, table: np.ndarray, idx: np.ndarray) -> np.ndarray:
    # out-of-range indices are clamped: no backend may read out of bounds
    return np.take(table, np.clip(idx, 0, table.shape[0] - 1), axis=0)


for _name, _kind, _fn in [
    ("input", "leaf", None),
    ("weight", "leaf", None),
    ("const", "leaf", lambda node: np.array(node.arg[0], dtype=node.dtype.np)),
    ("iota", "leaf", None),  # evaluated by the interpreter (its length may be symbolic)
    ("exp2", "unary", _float_op(np.exp2)),
    ("log2", "unary", _float_op(np.log2)),
    ("sin", "unary", _float_op(np.sin)),
    ("sqrt", "unary", _float_op(np.sqrt)),
    ("recip", "unary", _float_op(np.reciprocal)),
    ("neg", "unary", lambda node, x: np.negative(x)),
    ("cast", "unary", _cast),
    ("add", "binary", _arith(np.add)),
    ("mul", "binary", _arith(np.multiply)),
    ("div", "binary", _arith(np.divide)),  # true division, correctly rounded (floats only)
    ("mod", "binary", _mod),
    ("lt", "binary", lambda node, a, b: np.less(a, b)),
    ("max", "binary", lambda node, a, b: np.maximum(a, b)),
    ("where", "ternary", lambda node, c, a, b: np.where(c, a, b)),
    ("sum", "reduce", lambda node, x: _cast(node, np.sum(x, axis=node.arg, dtype=accumulator(node.dtype)))),
    ("max_reduce", "reduce", _max_reduce),
    ("contiguous", "contiguous", lambda node, x: np.array(x, order="C")),  # ascontiguousarray: 0-d -> 1-d
    ("gather", "gather", _gather),
    ("view", "view", None),  # evaluated by the interpreter from node.arg (a View)
]:
    register(_name, _kind, _fn)


class Node:
    """One value of the program. Nodes are compared by identity."""

    __slots__ = ("op", "srcs", "arg", "shape", "dtype")

    def __init__(self, op: str, srcs: Sequence[Node], arg: Any, shape: Sequence[sint], dtype: DType):
        if op not in OPS:
            raise KeyError(f"unknown op {op!r}")
        self.op, self.srcs, self.arg = op, tuple(srcs), arg
        self.shape, self.dtype = tuple(shape), dtype

    @property
    def kind(self) -> str:
        return OPS[self.op].kind

    def __repr__(self) -> str:
        return f"<{self.op} {self.dtype.short}{list(self.shape)}>"


# --- constructors with shape and dtype rules --------------------------------------------

def input_(name: str, shape: Sequence[sint], dtype: DType = DType.float32) -> Node:
    return Node("input", (), name, shape, dtype)


def weight(name: str, array: np.ndarray, dtype: DType) -> Node:
    return Node("weight", (), name, array.shape, dtype)


def const(value: float | int | bool, dtype: DType = DType.float32) -> Node:
    return Node("const", (), (value, dtype), (), dtype)


def iota(n: sint, dtype: DType = DType.int32) -> Node:
    return Node("iota", (), (n, dtype), (n,), dtype)


def unary(op: str, x: Node) -> Node:
    if op not in ("neg", "cast") and not x.dtype.is_float:
        raise TypeError(f"{op} needs a floating-point operand, got {x.dtype.short}")
    return Node(op, (x,), None, x.shape, x.dtype)


def cast(x: Node, dtype: DType) -> Node:
    return x if x.dtype is dtype else Node("cast", (x,), dtype, x.shape, dtype)


def _same_shape(op: str, *xs: Node) -> None:
    a = xs[0].shape
    for x in xs[1:]:
        if len(x.shape) != len(a) or not all(sym_eq(p, q) for p, q in zip(a, x.shape)):
            raise ValueError(f"{op}: operand shapes differ: {[list(x.shape) for x in xs]} "
                             f"(broadcast with an expand view first)")


def binary(op: str, a: Node, b: Node) -> Node:
    _same_shape(op, a, b)
    if a.dtype is not b.dtype:
        raise TypeError(f"{op}: operand dtypes differ: {a.dtype.short} and {b.dtype.short}")
    return Node(op, (a, b), None, a.shape, DType.bool if op == "lt" else a.dtype)


def where(cond: Node, a: Node, b: Node) -> Node:
    _same_shape("where", cond, a, b)
    if cond.dtype is not DType.bool or a.dtype is not b.dtype:
        got = ", ".join(x.dtype.short for x in (cond, a, b))
        raise TypeError(f"where needs (bool, T, T), got ({got})")
    return Node("where", (cond, a, b), None, a.shape, a.dtype)


def reduce(op: str, x: Node, axis: int) -> Node:
    if not -len(x.shape) <= axis < len(x.shape):
        raise ValueError(f"{op}: axis {axis} out of range for shape {list(x.shape)}")
    axis %= len(x.shape)
    return Node(op, (x,), axis, x.shape[:axis] + x.shape[axis + 1:], x.dtype)


def contiguous(x: Node) -> Node:
    return Node("contiguous", (x,), None, x.shape, x.dtype)


def gather(table: Node, idx: Node) -> Node:
    if idx.dtype not in (DType.int32, DType.int64):
        raise TypeError(f"gather indices must be integers, got {idx.dtype.short}")
    return Node("gather", (table, idx), None, idx.shape + table.shape[1:], table.dtype)


def view(x: Node, v: View) -> Node:
    """Read x through v. A view of a view composes into one node on the same source."""
    if x.op == "view":
        raise ValueError("compose views with movement(): a view's source is never a view")
    return Node("view", (x,), v, v.shape, x.dtype)


def movement(x: Node, fn: Callable[[View], View | None]) -> Node:
    """Apply a view transformation to x; fall back to a Contiguous copy when the
    result cannot be expressed on x's source (a reshape of a permuted tensor)."""
    src, v = (x.srcs[0], x.arg) if x.op == "view" else (x, View.contiguous(x.shape))
    out = fn(v)
    if out is None:
        src, out = contiguous(x), fn(View.contiguous(x.shape))
        assert out is not None
    if out.is_contiguous and len(out.shape) == len(src.shape) and all(
            sym_eq(a, b) for a, b in zip(out.shape, src.shape)):
        return src
    return view(src, out)


def expand_to(x: Node, shape: Sequence[sint]) -> Node:
    """numpy-style broadcast of x to shape (left-pads x's shape with ones)."""
    shape = tuple(shape)
    if len(x.shape) > len(shape):
        raise ValueError(f"cannot broadcast {list(x.shape)} to {list(shape)}")
    padded = (1,) * (len(shape) - len(x.shape)) + x.shape
    if padded == shape or (len(padded) == len(shape) and all(sym_eq(a, b) for a, b in zip(padded, shape))):
        return x if padded == x.shape else movement(x, lambda v: v.reshape(padded))
    return movement(x, lambda v: v.reshape(padded).expand(shape))


# --- graphs -------------------------------------------------------------------------------

@dataclass
class State:
    """A buffer the model updates in place (a KV cache): an input of the program whose value lasts
    from call to call. The program does not write it; it returns the update, which the caller
    applies after the call. axis None: the update is the whole new value (one output); an int:
    the update is (index, values) along that axis (two outputs), written as
    state[(slice(None),) * axis + (index,)] = values, so a cache costs only the rows it gains."""
    name: str
    initial: np.ndarray
    axis: int | None = None

    @property
    def outputs(self) -> int:
        """How many of the program's outputs its update takes."""
        return 1 if self.axis is None else 2


@dataclass(frozen=True)
class Returned:
    """How a model's outputs nest when some are constants: `tree`, torch's pytree spec of every
    output, and `constants`, flat position -> a value known when compiling (None, a Python number)
    that the program does not compute. Its flat outputs are the others, in order."""

    tree: Any
    constants: dict[int, Any]

    def merged(self, computed: list[Any]) -> list[Any]:
        """Every flat output: the computed ones with the constants put back in their places."""
        out, it = [], iter(computed)
        for k in range(len(self.constants) + len(computed)):
            out.append(self.constants[k] if k in self.constants else next(it))
        return out


@dataclass
class Graph:
    inputs: list[Node]
    outputs: list[Node]
    weights: dict[str, np.ndarray]
    out_spec: Any = None  # how the flat outputs nest (a torch pytree spec), kept by the frontend
    # input name -> [low, high): the values an input that indexes a tensor may take (checked per call)
    index_ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    divisors: set[str] = field(default_factory=set)  # integer inputs that divide: zero raises, as in torch
    # the last len(states) inputs are these buffers; their updates follow the user's outputs
    states: list[State] = field(default_factory=list)
    # weight name -> (the low-precision format its float32 values are exact in, the axis they are
    # rounded along) (compiler.quantize)
    formats: dict[str, tuple[str, int]] = field(default_factory=dict)

    def nodes(self) -> list[Node]:
        """All nodes reachable from the outputs, sources before users."""
        order: list[Node] = []
        seen: set[int] = set()
        stack: list[tuple[Node, bool]] = [(n, False) for n in reversed(self.outputs)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if id(node) in seen:
                continue
            seen.add(id(node))
            stack.append((node, True))
            stack.extend((s, False) for s in reversed(node.srcs) if id(s) not in seen)
        return order

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for n in self.nodes():
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    def __str__(self) -> str:
        names: dict[int, str] = {}
        lines = []
        for k, n in enumerate(self.nodes()):
            names[id(n)] = f"%{k}"
            lines.append(f"%{k} = {n.op}{_describe_arg(n)}"
                         f"{''.join(' ' + names[id(s)] for s in n.srcs)} : {n.dtype.short}{_shape(n.shape)}")
        lines.append("return " + ", ".join(names[id(o)] for o in self.outputs))
        return "\n".join(lines)


def _shape(shape: Iterable[sint]) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _describe_arg(n: Node) -> str:
    if n.op in ("input", "weight"):
        return f" {n.arg}"
    if n.op in ("const",):
        return f" {n.arg[0]!r}"
    if n.op == "view":
        return f" {n.arg}"
    if n.kind == "reduce":
        return f" axis={n.arg}"
    if n.op == "cast":
        return f" to {n.arg.short}"
    return ""


def decompose_composites(graph: Graph, keep: set[str] = frozenset()) -> Graph:
    """The same graph with every composite op not in `keep` replaced by primitives."""
    new: dict[int, tuple[Node, Node]] = {}  # id -> (node, its rebuilt self): holding both keeps ids unique

    def rebuilt(root: Node) -> Node:
        """root with the composites below it expanded, not walking below what is rebuilt already (a
        composite's expansion is walked alone, not the graph under its operands again)."""
        order: list[Node] = []
        seen: set[int] = set()
        stack: list[tuple[Node, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
            elif id(node) not in seen and id(node) not in new:
                seen.add(id(node))
                stack.append((node, True))
                stack.extend((s, False) for s in reversed(node.srcs))
        for n in order:
            srcs = [new[id(s)][1] for s in n.srcs]
            if n.kind == "composite" and n.op not in keep:
                out = rebuilt(OPS[n.op].decompose(Node(n.op, srcs, n.arg, n.shape, n.dtype)))
            elif any(a is not b for a, b in zip(srcs, n.srcs)):
                out = Node(n.op, srcs, n.arg, n.shape, n.dtype)
            else:
                out = n
            new[id(n)] = (n, out)
            new.setdefault(id(out), (out, out))  # an expansion's own nodes are final
        return new[id(root)][1]

    return replace(graph, outputs=[rebuilt(o) for o in graph.outputs])


def numel(shape: Sequence[sint]) -> int | None:
    total = 1
    for d in shape:
        v = as_int(d)
        if v is None:
            return None
        total *= v
    return total
