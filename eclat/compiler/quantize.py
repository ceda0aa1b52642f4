"""Weight-only quantization: an opt-in compile option (`weights=`), never a rewrite, since it changes
the numbers.

    quantize(graph, mode, made) -> graph with its contraction weights rounded to the mode's format

The graph keeps float32 weights whose values the format represents exactly (fake quantization), and
names each one's format and the axis it is rounded along in `graph.formats`. So the reference
interpreter, verification and every backend see one model, and a backend that packs a weight stores
it in its format: the CPU packs bf16, int8 and int4 panels and dequantises them in its GEMM/GEMV
micro-kernel, the GPU targets store each weight packed and decode it where a kernel reads it
(backends/gpu/packing.py). `storage` derives the packed form and refuses one that would not give
back the same values.

Formats (FORMATS), symmetric, scales in float32:
  bf16      rounded to bfloat16 (nearest, ties to even)
  int8      q in [-127, 127], one scale per output channel: w = q * s
  int4      q in [-7, 7], one scale per group of 32 along the input dimension
  int4-128  the same with groups of 128

Which weights: a float32 matrix (a weight with two axes longer than 1) of at least MIN_ELEMENTS
that products read whole, along one axis (its input dimension K, which the groups follow). In the
int4 formats, a weight that an embedding lookup also reads (a tied output head: its rows are looked
up one by one, and the head is the largest product of a decode step) and one whose K is not a
whole number of groups get int8.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import EclatError
from ..ir.dtypes import round_bfloat16
from ..ir.graph import Graph, Node
from ..ir.interpreter import run
from ..ir.view import contiguous_strides

MIN_ELEMENTS = 4096  # smaller weights stay float32: their bytes do not matter
EXACT = 1e-4  # storage must give back every value within this fraction of its quantization step


@dataclass(frozen=True)
class Format:
    name: str
    bits: int
    group: int | None = None  # values per scale along K (None: all of K, one scale per channel)

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def stored_bytes(self, numel: int) -> int:
        """Bytes of numel values packed (a float32 scale per group; per-channel scales are few)."""
        return numel * self.bits // 8 + (4 * numel // self.group if self.group else 0)


FORMATS = {f.name: f for f in (Format("bf16", 16), Format("int8", 8), Format("int4", 4, 32),
                               Format("int4-128", 4, 128))}
MODES = ("fp32", *FORMATS)


def quantize(graph: Graph, mode: str, made: dict[tuple, tuple[np.ndarray, np.ndarray]] | None = None
             ) -> Graph:
    """graph with the weights its matmuls read rounded to mode's format (see the module's rule).
    made: the rounded weights by source array, shared by the candidates of one compile."""
    if mode == "fp32":
        return graph
    fmt = FORMATS[mode]
    made = {} if made is None else made
    weights, formats = dict(graph.weights), dict(graph.formats)
    gathered = {n.srcs[0].arg for n in graph.nodes() if n.op == "gather" and n.srcs[0].op == "weight"}
    for name, axis in _contraction_weights(graph).items():
        w = graph.weights[name]
        if axis is None or w.dtype != np.float32 or w.size < MIN_ELEMENTS:
            continue
        f = fmt
        if f.group and (name in gathered or w.shape[axis] % f.group):
            f = FORMATS["int8"]
        key = (id(w), f.name, axis)
        if key not in made:  # the source is kept so that its id stays its own
            matrix = [a for a in range(w.ndim) if w.shape[a] != 1]
            rounded = fake(w.reshape([w.shape[a] for a in matrix]), f, matrix.index(axis))
            made[key] = (w, rounded.reshape(w.shape))
        weights[name], formats[name] = made[key][1], (f.name, axis)
    return dataclasses.replace(graph, weights=weights, formats=formats)


def accuracy(exact: Graph, rounded: Graph, arrays: list[np.ndarray]) -> dict[str, Any]:
    """What rounding the weights does on the example inputs: the relative error (L2) of each
    output and of each layer (a matmul reading a rounded weight, named after the weight; errors
    carry over from the layers before it), and the bytes of the weights it reads, in float32 and
    stored."""
    layers = {}
    for n, name, _ in _contractions(exact):
        if name in rounded.formats:
            layers.setdefault(name, n)
    probe = [*layers.values(), *exact.outputs]
    want = dataclasses.replace(exact, outputs=probe)
    before, after = run(want, arrays), run(dataclasses.replace(want, weights=rounded.weights), arrays)
    errors = [_relative(a, b) for a, b in zip(after, before)]
    used = {n.arg: rounded.weights[n.arg] for n in exact.nodes() if n.op == "weight"}
    names = {n: f for n, (f, _) in rounded.formats.items()}
    stored = sum(FORMATS[names[n]].stored_bytes(w.size) if n in names else w.nbytes for n, w in used.items())
    kinds = sorted(set(names.values()))
    counts = {f: sum(v == f for v in names.values()) for f in kinds}
    return {"weights": "+".join(kinds) or "none large enough", "formats": counts,
            "float32_bytes": int(sum(w.nbytes for w in used.values())), "stored_bytes": int(stored),
            "layers": dict(zip(layers, errors)), "outputs": errors[len(layers):]}


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, np.float64)
    if not np.issubdtype(want.dtype, np.floating):
        return 0.0
    norm = float(np.linalg.norm(want))
    return round(float(np.linalg.norm(np.asarray(got, np.float64) - want)) / (norm or 1.0), 6)


def fake(w: np.ndarray, fmt: Format, axis: int) -> np.ndarray:
    """w rounded to fmt along axis (its K): float32 values the format holds exactly."""
    if fmt.name == "bf16":
        return round_bfloat16(w)
    q, s, _ = _quantized(w, fmt, axis)
    moved = list(w.shape)
    moved.append(moved.pop(axis))
    return np.ascontiguousarray(np.moveaxis((q * s).astype(np.float32).reshape(moved), -1, axis))


def storage(panels: np.ndarray, fmt: Format) -> list[np.ndarray] | None:
    """Packed [P, K, NR] float32 panels (K the reduction) in fmt, or None when fmt does not hold
    every value exactly (a weight changed after it was quantized):
      bf16: [P, K, NR] int16, the high halves of the floats;
      int8: [P, K, NR] int8 and [P, NR] float32 scales;
      int4: [P, K/2, NR] uint8 (k even in the low nibble, k odd in the high, each q + 8) and
            [P, K/group, NR] float32 scales."""
    if fmt.name == "bf16":
        bits = np.ascontiguousarray(panels, np.float32).view(np.uint32)
        return [(bits >> 16).astype(np.uint16).view(np.int16)] if not np.any(bits & 0xFFFF) else None
    p, k, nr = panels.shape
    if fmt.group and (k % fmt.group or fmt.group % 2):
        return None
    q, s, x = _quantized(panels, fmt, 1)
    if np.any(np.abs(q * s - x) > EXACT * s):
        return None
    q = q.reshape(p, nr, k).transpose(0, 2, 1)  # back to [P, K, NR]
    scales = np.ascontiguousarray(s.reshape(p, nr, -1).transpose(0, 2, 1), np.float32)
    if fmt.bits == 8:
        return [np.ascontiguousarray(q, np.int8), scales.reshape(p, nr)]
    nib = (q + (fmt.qmax + 1)).astype(np.uint8)
    return [np.ascontiguousarray(nib[:, 0::2] | (nib[:, 1::2] << 4)), scales]


def _quantized(w: np.ndarray, fmt: Format, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, s, x): x is w with axis moved last and split into [..., groups, group], q its integers
    and s their scales [..., groups, 1]."""
    x = np.moveaxis(np.asarray(w, np.float32), axis, -1)
    k = x.shape[-1]
    x = x.reshape(*x.shape[:-1], k // (fmt.group or k), fmt.group or k)
    s = np.max(np.abs(x), axis=-1, keepdims=True) / np.float32(fmt.qmax)
    s = np.where(s > 0, s, np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(x / s), -fmt.qmax, fmt.qmax)
    return q, s, x


def _contraction_weights(graph: Graph) -> dict[str, int | None]:
    """Weight name -> the axis along which products reduce it (None where they disagree or read it
    through a view that is not a transpose or a broadcast of the whole matrix)."""
    axes: dict[str, int | None] = {}
    for _, name, axis in _contractions(graph):
        axes[name] = axis if axes.get(name, axis) == axis else None
    return axes


def _contractions(graph: Graph) -> list[tuple[Node, str, int | None]]:
    """(product, weight, the weight's axis it reduces) for each weight a product reads: a matmul
    or a sum over a product of views, as the e-graph's candidates hold them."""
    found = []
    for n in graph.nodes():
        if n.op == "matmul":
            reads = [(x, len(x.shape) - 1 - j) for j, x in enumerate(n.srcs)]
        elif n.op == "sum" and n.srcs[0].op == "mul":
            reads = [(x, n.arg) for x in n.srcs[0].srcs]
        else:
            continue
        for x, axis in reads:
            src = x.srcs[0] if x.op == "view" else x
            if src.op == "weight":
                found.append((n, src.arg, _weight_axis(x, axis)))
    return found


def _weight_axis(x: Node, axis: int) -> int | None:
    """The axis of the weight that x (the weight, or a view of it) reads along its own axis `axis`,
    when the weight is a matrix (two axes longer than 1) and x reads all of it, transposed or not,
    broadcast along other axes."""
    src = x.srcs[0] if x.op == "view" else x
    dims = [(n, s, a) for a, (n, s) in enumerate(zip(src.shape, contiguous_strides(src.shape))) if n != 1]
    if len(dims) != 2:
        return None
    if x.op != "view":
        return axis if src.shape[axis] != 1 else None
    v = x.arg
    read = [(n, s) for j, (n, s) in enumerate(zip(v.shape, v.strides)) if s != 0 and j != axis]
    if v.mask is not None or v.offset != 0 or len(read) != 1:
        return None
    along = (v.shape[axis], v.strides[axis])
    for (n, s, a), (other, so, _) in (dims, dims[::-1]):
        if along == (n, s) and read[0] == (other, so):
            return a
    return None


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise EclatError(f"weights must be one of {MODES}, given {mode!r}")
    return mode
