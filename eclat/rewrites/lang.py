"""The term language the e-graph holds, and rules as data.

Every IR op is one egglog constructor of sort `T`. Attributes egglog cannot reason
about (a View, a dtype, a leaf node, a shape) are interned into Python tables and
carried as `i64` ids; rules that need their meaning read Python-computed "oracle"
functions (e.g. `mm_a`), filled for every attribute tuple of the graph at insertion.

A `Rule` is an s-expression rewrite `lhs => rhs` (plus optional extra query facts
`when`). The same data produces the egglog rule and the soundness test's example:
`example` binds the rule's variables to small concrete values (tensor shapes, floats,
shapes, dtypes, axes), or is a function returning a Graph whose output matches lhs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# constructor -> (IR op, argument kinds). T: a child term; attr: an interned id; int: a raw
# integer (a reduce axis); f64: a float literal (a constant's value).
CTORS: dict[str, tuple[str, tuple[str, ...]]] = {
    "Leaf": ("leaf", ("attr",)),                 # input / weight / iota / unbroadcastable const
    "Fill": ("const", ("f64", "attr", "attr")),  # value, dtype, shape: a broadcast scalar
    "Exp2": ("exp2", ("T",)), "Log2": ("log2", ("T",)), "Sin": ("sin", ("T",)),
    "Sqrt": ("sqrt", ("T",)), "Recip": ("recip", ("T",)), "Neg": ("neg", ("T",)),
    "Cast": ("cast", ("T", "attr")),
    "Add": ("add", ("T", "T")), "Mul": ("mul", ("T", "T")), "Mod": ("mod", ("T", "T")),
    "Div": ("div", ("T", "T")),
    "Lt": ("lt", ("T", "T")), "Max": ("max", ("T", "T")),
    "Where": ("where", ("T", "T", "T")),
    "Sum": ("sum", ("T", "int")), "MaxReduce": ("max_reduce", ("T", "int")),
    "Contiguous": ("contiguous", ("T",)),
    "Gather": ("gather", ("T", "T")),
    "View": ("view", ("T", "attr")),
    # composites of eclat.rewrites.composites
    "Matmul": ("matmul", ("T", "T")), "Fma": ("fma", ("T", "T", "T")), "Rsqrt": ("rsqrt", ("T",)),
    "Softmax": ("softmax", ("T", "int", "int")), "RmsNorm": ("rmsnorm", ("T", "int", "f64", "f64")),
    "LayerNorm": ("layernorm", ("T", "T", "T", "int", "f64", "f64")),
    # a softmax contracted with values along its own axis (x, v, axis, view of the softmax, safe)
    "Attend": ("attend", ("T", "T", "int", "attr", "int")),
    "WinogradIn": ("winograd_in", ("T", "attr")), "WinogradOut": ("winograd_out", ("T", "attr")),
    # any other registered op, carried opaquely: attr = (op, arg, shape, dtype)
    "Op1": ("", ("attr", "T")), "Op2": ("", ("attr", "T", "T")), "Op3": ("", ("attr", "T", "T", "T")),
}
CTOR_OF_OP = {op: c for c, (op, _) in CTORS.items() if op}
# oracle functions: name -> number of i64 keys (all values are i64 attribute ids)
ORACLES = {"mm_a": 3, "mm_b": 3, "mm_o": 3, "laid": 2, "drop": 2, "keep": 2, "spread": 2,
           "vshape": 1, "contig": 1, "leafshape": 1, "bsum": 4, "unmasked": 1, "unexplored": 1,
           "cat": 4, "catx": 3, "catw": 1, "part": 3,  # horizontal merges (merge.py)
           "mmid": 4, "ub_a": 2, "ub_b": 2, "ub_o": 2,  # contraction.py
           "mm_ow": 4, "scale_a": 5, "scale_b": 5, "vcomp": 2, "kscale_a": 3, "kscale_b": 3,  # affine.py
           "kscale_copied_a": 4, "kscale_copied_b": 4,
           "rereads": 1,  # fusion.py
           "known": 1,  # a leaf whose value is known when compiling (a weight, iota, a constant)
           "wconv": 3, "wgg": 3, "wfilter": 3, "wu": 3, "wout": 3,  # winograd.py
           "late_o": 6, "late_row": 6,  # recognition.py: a product normalised after it
           "rows_whole": 3, "att_p": 3, "att_v": 3,  # online.py
           **{name: 8 for name in ("g_idx", "g_out", "g_cond", "g_ishape", "g_gshape", "g_idt", "g_n")}}


def declarations() -> str:
    """egglog text declaring the sort, constructors, oracle tables and output relation."""
    sort = {"T": "T", "attr": "i64", "int": "i64", "f64": "f64"}
    ctors = " ".join(f"({c} {' '.join(sort[k] for k in kinds)})" for c, (_, kinds) in CTORS.items())
    oracles = "\n".join(f"(function {name} ({' '.join(['i64'] * n)}) i64 :merge old)"
                        for name, n in ORACLES.items())
    return (f"(datatype T {ctors})\n{oracles}\n(relation Out (i64 T))\n(relation FloatDT (i64))\n"
            f"(function shp (T) i64 :merge old)\n(relation Static (T))\n{_shape_analysis()}\n"
            f"{_static_analysis()}\n")


# constructors whose result has the shape of their first operand
SAME_SHAPE = ("Exp2", "Log2", "Sin", "Sqrt", "Recip", "Neg", "Cast", "Add", "Mul", "Div", "Mod", "Lt", "Max",
              "Where", "Contiguous", "Fma", "Rsqrt", "Softmax", "RmsNorm", "LayerNorm")


def _shape_analysis() -> str:
    """Rules of the `types` rule set: shp(e) = the shape id of e's class, where rules need a shape
    egglog cannot otherwise see (a constant of the operand's shape). Classes are well typed, so
    the first shape found is the shape."""
    facts = {"View": "(= e (View x v)) (= s (vshape v))", "Fill": "(= e (Fill a d s))",
             "Leaf": "(= e (Leaf l)) (= s (leafshape l))",
             **{c: f"(= e ({c} x r)) (= s (drop (shp x) r))" for c in ("Sum", "MaxReduce")}}
    for c in SAME_SHAPE:
        args = " ".join(f"a{k}" for k in range(1, len(CTORS[c][1])))
        facts[c] = f"(= e ({c} x {args})) (= s (shp x))"
    rules = "\n".join(f'(rule ({f}) ((set (shp e) s)) :ruleset types :name "shape-{c}")'
                      for c, f in facts.items())
    return f"(ruleset types)\n{rules}"


def _static_analysis() -> str:
    """Rules of the `types` rule set: (Static e) for a class whose value depends on no input (known
    leaves and constants, and any op of static operands), the values the e-graph may regroup freely:
    regrouping them folds constants; regrouping run-time values changes what cancels first."""
    rules = ['(rule ((= e (Leaf l)) (= 1 (known l))) ((Static e)) :ruleset types :name "static-Leaf")',
             '(rule ((= e (Fill a d s))) ((Static e)) :ruleset types :name "static-Fill")']
    for c, (_, kinds) in CTORS.items():
        if c in ("Leaf", "Fill"):
            continue
        args = [f"a{k}" for k in range(len(kinds))]
        static = " ".join(f"(Static {a})" for a, kind in zip(args, kinds) if kind == "T")
        rules.append(f'(rule ((= e ({c} {" ".join(args)})) {static}) ((Static e)) :ruleset types '
                     f':name "static-{c}")')
    return "\n".join(rules)


# --- s-expressions ------------------------------------------------------------------------

Sexp = str | float | int | tuple  # a symbol, a literal, or (head, *args)


def parse(text: str) -> Sexp:
    tokens = text.replace("(", " ( ").replace(")", " ) ").split()
    pos = 0

    def read() -> Sexp:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            items = []
            while tokens[pos] != ")":
                items.append(read())
            pos += 1
            return tuple(items)
        for conv in (int, float):
            try:
                return conv(tok)
            except ValueError:
                pass
        return tok

    out = read()
    if pos != len(tokens):
        raise ValueError(f"trailing text in s-expression {text!r}")
    return out


# --- rules --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    name: str
    lhs: str
    rhs: str
    when: tuple[str, ...] = ()
    # variable -> value, by the position it takes in lhs: a tensor (T) a shape or (shape, dtype),
    # default float32 [2, 3]; an f64 a float; an attr a DType or a shape; an int an axis.
    # Or a function returning a Graph whose single output has the form of lhs.
    example: dict[str, Any] | Callable[[], Any] = field(default_factory=dict)

    def egglog(self, ruleset: str) -> str:
        facts = f"(= __e {self.lhs}) " + " ".join(self.when)
        return f'(rule ({facts}) ((union __e {self.rhs})) :ruleset {ruleset} :name "{self.name}")'


@dataclass(frozen=True)
class RuleSet:
    name: str
    rules: tuple[Rule, ...]
    explosive: bool = False  # run under the back-off scheduler

    def egglog(self) -> str:
        return f"(ruleset {self.name})\n" + "\n".join(r.egglog(self.name) for r in self.rules)
