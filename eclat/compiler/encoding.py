"""Programs as JSON data (the artifact's manifest and the program cache store them this way).

Expression DAGs are stored as a node table: children before parents, a node's children referenced
by their index, so shared subtrees are stored once."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from ..ir.dtypes import DType
from ..ir.symbolic import BinOp, Expr, Num, Var, size_from_json, size_to_json
from .kernel import Buffer, Const, Gather, Index, Kernel, Load, Op, Program, Reduce, Schedule, Side

# class -> fields that hold child nodes (a tuple field holds a tuple of them)
NODES: dict[type, tuple[str, ...]] = {
    Num: (), Var: (), BinOp: ("a", "b"),
    Const: (), Index: ("expr",), Load: ("index", "valid"), Gather: ("idx", "inner"),
    Op: ("srcs",), Reduce: ("var", "body"),
}
_BY_NAME = {cls.__name__: cls for cls in NODES}


class _Encoder:
    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self._ids: dict[int, tuple[Any, int]] = {}  # id(node) -> (node kept alive, index)

    def __call__(self, node: Any) -> int:
        hit = self._ids.get(id(node))
        if hit is not None:
            return hit[1]
        cls = type(node)
        if cls not in NODES:
            raise ValueError(f"cannot encode a {cls.__name__}")
        entry: dict[str, Any] = {"t": cls.__name__}
        for f in dataclasses.fields(node):
            v = getattr(node, f.name)
            if f.name in NODES[cls]:
                v = [self(x) for x in v] if isinstance(v, tuple) else self(v)
            elif isinstance(v, DType):
                v = v.name
            elif isinstance(v, Expr):  # a run-time size (a reduction's, an index's extent)
                v = {"size": size_to_json(v)}
            elif isinstance(v, np.generic):
                v = v.item()
            entry[f.name] = v
        self.nodes.append(entry)
        self._ids[id(node)] = (node, len(self.nodes) - 1)
        return len(self.nodes) - 1


def _earlier(nodes: list[Any], i: Any) -> Any:
    """nodes[i] for a reference to an already decoded node (no negative or forward index)."""
    if type(i) is not int or not 0 <= i < len(nodes):
        raise ValueError(f"node reference {i!r} is not an earlier node")
    return nodes[i]


def decode_nodes(table: list[dict[str, Any]]) -> list[Any]:
    """The node table back to expression objects (index i is node i)."""
    out: list[Any] = []
    for entry in table:
        cls = _BY_NAME[entry["t"]]
        kwargs = {}
        for f in dataclasses.fields(cls):
            v = entry[f.name]
            if f.name in NODES[cls]:
                v = tuple(_earlier(out, i) for i in v) if isinstance(v, list) else _earlier(out, v)
            elif f.name == "dtype":
                v = DType[v]
            elif isinstance(v, dict) and set(v) == {"size"}:
                v = size_from_json(v["size"])
            kwargs[f.name] = v
        out.append(cls(**kwargs))
    return out


def encode_program(program: Program) -> dict[str, Any]:
    enc = _Encoder()
    kernels = [{"name": k.name, "out": k.out, "shape": [size_to_json(n) for n in k.shape],
                "body": enc(k.body),
                "schedule": k.schedule and dataclasses.asdict(k.schedule), "ops": list(k.ops),
                "sides": [{"out": s.out, "body": enc(s.body)} for s in k.sides]} for k in program.kernels]
    return {
        "buffers": [{"name": b.name, "numel": int(b.numel), "dtype": b.dtype.name, "role": b.role,
                     **({"format": b.format} if b.format else {}),
                     **({"along": list(b.along)} if b.along else {})} for b in program.buffers.values()],
        "kernels": kernels,
        "nodes": enc.nodes,
        "inputs": list(program.inputs), "outputs": list(program.outputs),
        "input_shapes": [[size_to_json(n) for n in s] for s in program.input_shapes],
        "output_shapes": [[size_to_json(n) for n in s] for s in program.output_shapes],
        **({"sizes": [size_to_json(v) for v in program.sizes]} if program.sizes else {}),
    }


def decode_program(data: dict[str, Any], weights: dict[str, np.ndarray],
                   schedule_from: Callable[[dict[str, Any]], Any] | None = None) -> Program:
    """encode_program's data back to a Program, weights attached by name; schedule_from: the target's
    decoder of a kernel's schedule (default: the CPU's Schedule)."""
    nodes = decode_nodes(data["nodes"])
    buffers = {b["name"]: Buffer(b["name"], b["numel"], DType[b["dtype"]], b["role"], weights.get(b["name"]),
                                 b.get("format"), tuple(b["along"]) if "along" in b else None)
               for b in data["buffers"]}
    if len(buffers) != len(data["buffers"]):
        raise ValueError("two buffers share a name")

    from_json = schedule_from or Schedule.from_json

    def schedule(d: dict[str, Any] | None) -> Any:
        return None if d is None else from_json(d)

    def kernel(k: dict[str, Any]) -> Kernel:
        sides = tuple(Side(s["out"], _earlier(nodes, s["body"])) for s in k.get("sides", ()))
        shape = tuple(size_from_json(n) for n in k["shape"])
        return Kernel(k["name"], k["out"], shape, _earlier(nodes, k["body"]),
                      schedule(k["schedule"]), list(k["ops"]), sides)

    kernels = [kernel(k) for k in data["kernels"]]
    shapes = lambda key: [tuple(size_from_json(n) for n in s) for s in data[key]]
    sizes = tuple(size_from_json(v) for v in data.get("sizes", ()))
    if not all(isinstance(v, Var) for v in sizes):
        raise ValueError(f"the run-time sizes {list(sizes)} are not variables")
    return Program(buffers, kernels, list(data["inputs"]), list(data["outputs"]), shapes("input_shapes"),
                   shapes("output_shapes"), sizes)
