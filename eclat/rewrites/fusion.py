"""Fusion: where values are materialised. `Contiguous` is a kernel boundary and equal to its
operand, so wrapping an operand in it (materialise: the producer becomes its own kernel)
or unwrapping it (fuse: the producer is computed inside the consumer's kernel) gives the
candidate groupings. Views are excluded, but for one that reads its operand's elements more than
once through overlapping windows (`materialise-rereads`: an im2col): fused there, the operand's
computation is repeated for every read (the extraction counts it, `extract.evaluations`)."""

from __future__ import annotations

from ..ir.dtypes import DType
from ..ir.view import View
from .lang import CTORS, Rule, RuleSet

_VAR = {"attr": ("d", DType.float16), "int": ("r", 1), "f64": ("a", 0.5)}  # name, example value
# example operands where the default float32 [2, 3] tensors do not fit
_EXAMPLES = {
    "Where": {"x0": ((2, 3), DType.bool)},
    "Gather": {"x0": (5, 3), "x1": ((2,), DType.int32)},
    "Matmul": {"x0": (2, 3), "x1": (3, 4)},
    "Attend": {"x0": (2, 3, 5), "x1": (2, 5, 6), "r2": 2, "d3": View.contiguous((2, 3, 5)), "r4": 0},
}
# a Winograd transform is a kernel of its own whatever reads it (its decomposition ends in a copy)
FUSIBLE = [c for c, (op, kinds) in CTORS.items()
           if "T" in kinds and op and c not in ("View", "Contiguous", "WinogradIn", "WinogradOut")]


def _rules(ctor: str) -> list[Rule]:
    kinds = CTORS[ctor][1]
    args = [f"x{k}" if kind == "T" else f"{_VAR[kind][0]}{k}" for k, kind in enumerate(kinds)]
    example = {f"{_VAR[kind][0]}{k}": _VAR[kind][1] for k, kind in enumerate(kinds) if kind != "T"}
    example.update(_EXAMPLES.get(ctor, {}))
    out = []
    for k, kind in enumerate(kinds):
        if kind == "T":
            wrapped = [f"(Contiguous {a})" if j == k else a for j, a in enumerate(args)]
            plain, boundary = f"({ctor} {' '.join(args)})", f"({ctor} {' '.join(wrapped)})"
            out.append(Rule(f"materialise-{ctor}-{k}", plain, boundary, example=example))
            out.append(Rule(f"fuse-{ctor}-{k}", boundary, plain, example=example))
    return out


def rereads(v: View) -> bool:
    """Whether v reads some element of its operand more than once through overlapping windows."""
    return v.overlap() > 1.0


def fill_rereads(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """rereads(v) = 1 for every view of the graph that reads an element more than once."""
    return [("rereads", (i,), 1) for i, a in enumerate(enc.attrs) if isinstance(a, View) and rereads(a)]


_WINDOWS = View.make((2, 2), (1, 1))  # [a, b, c] read as [[a, b], [b, c]]

RULES = RuleSet("fusion", (
    Rule("contiguous-contiguous", "(Contiguous (Contiguous x0))", "(Contiguous x0)"),
    Rule("materialise-rereads", "(View x0 v)", "(View (Contiguous x0) v)", ("(= 1 (rereads v))",),
         example={"x0": (3,), "v": _WINDOWS}),
    *(r for c in FUSIBLE for r in _rules(c)),
))
