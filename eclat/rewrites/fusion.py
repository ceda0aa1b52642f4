"""Fusion: where values are materialised. `Contiguous` is a kernel boundary and equal to its
operand, so wrapping an operand in it (materialise: the producer becomes its own kernel)
or unwrapping it (fuse: the producer is computed inside the consumer's kernel) gives the
candidate groupings. Views are excluded: the operand of a view must stay a buffer."""

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
    "Attention": {"x0": (2, 3, 4), "x1": (2, 4, 5), "x2": (2, 5, 6), "x3": (2, 3, 5), "r4": 2,
                  "d6": View.contiguous((2, 3, 5)), "d7": View.contiguous((2, 3, 5))},
}
FUSIBLE = [c for c, (op, kinds) in CTORS.items()
           if "T" in kinds and op and c not in ("View", "Contiguous")]


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


RULES = RuleSet("fusion", (
    Rule("contiguous-contiguous", "(Contiguous (Contiguous x0))", "(Contiguous x0)"),
    *(r for c in FUSIBLE for r in _rules(c)),
))
