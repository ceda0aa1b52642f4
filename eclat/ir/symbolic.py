"""Symbolic integers: dimensions that are only known at run time, and index math.

An `Expr` is an immutable tree over integer variables with bounds. Constructors
simplify as they build (constant folding, identities, bounds), which keeps index
expressions produced from views small enough to read and cheap to compile.
Every place that takes a size accepts `sint` = int | Expr.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


class Expr:
    """Base of symbolic integer expressions. Operators build simplified trees."""

    def __add__(self, o: sint) -> Expr: return add(self, o)
    def __radd__(self, o: sint) -> Expr: return add(o, self)
    def __sub__(self, o: sint) -> Expr: return add(self, mul(o, -1))
    def __rsub__(self, o: sint) -> Expr: return add(o, mul(self, -1))
    def __mul__(self, o: sint) -> Expr: return mul(self, o)
    def __rmul__(self, o: sint) -> Expr: return mul(o, self)
    def __floordiv__(self, o: sint) -> Expr: return floordiv(self, o)
    def __mod__(self, o: sint) -> Expr: return mod(self, o)
    def __neg__(self) -> Expr: return mul(self, -1)

    @property
    def vmin(self) -> int: return bounds(self)[0]

    @property
    def vmax(self) -> int: return bounds(self)[1]

    def __str__(self) -> str: return render(self)


@dataclass(frozen=True, repr=False)
class Num(Expr):
    v: int

    def __repr__(self) -> str: return str(self.v)


@dataclass(frozen=True, repr=False)
class Var(Expr):
    """A named integer in [lo, hi] (inclusive). An index over a size known only at run time also
    knows that size (extent): it is below it, which bounds alone cannot say."""

    name: str
    lo: int = 0
    hi: int = 2**31 - 1
    extent: Expr | None = None

    def __repr__(self) -> str: return self.name


@dataclass(frozen=True, repr=False)
class BinOp(Expr):
    op: str  # one of + * // % < and
    a: Expr
    b: Expr

    def __repr__(self) -> str: return render(self)


sint = int | Expr


def _memo(e: Expr, key: str, compute: Callable[[], Any]) -> Any:
    """A fact about e computed once: expressions are immutable and shared, and index expressions of
    run-time shapes grow deep, so recomputing their hash or bounds on each use is quadratic."""
    hit = e.__dict__.get(key)
    if hit is None:
        hit = compute()
        object.__setattr__(e, key, hit)
    return hit


for _cls in (Num, Var, BinOp):
    _cls.__hash__ = (lambda structural: lambda self: _memo(self, "_hash", lambda: structural(self)))(
        _cls.__hash__)

_PY: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "*": lambda a, b: a * b,
    "//": lambda a, b: a // b,
    "%": lambda a, b: a % b,
    "<": lambda a, b: int(a < b),
    "and": lambda a, b: int(bool(a) and bool(b)),
}


_SMALL = {v: Num(v) for v in range(-256, 4097)}  # shared (immutable): grouping makes millions


def to_expr(x: sint) -> Expr:
    if isinstance(x, Expr):
        return x
    if isinstance(x, int) or hasattr(x, "__index__"):
        x = int(x)
        return _SMALL.get(x) or Num(x)
    raise TypeError(f"not a symbolic int: {x!r}")


def _is(x: Expr, v: int) -> bool:
    """Whether x is the constant v (without building one to compare with)."""
    return isinstance(x, Num) and x.v == v


def as_int(x: sint) -> int | None:
    """The value of x if it is a known constant, else None."""
    if isinstance(x, Expr):
        return x.v if isinstance(x, Num) else None
    return int(x)


def upper(x: sint) -> int:
    """The largest value x takes: itself when constant, else its bound (a size known at run time)."""
    v = as_int(x)
    return bounds(x)[1] if v is None else v


def is_loop_var(name: str) -> bool:
    """Whether a variable is an index a kernel loops over: an axis i<k> or a reduction's r<k>. Any
    other variable is a size known at run time (a torch.export symbol, s<k>), read, not looped."""
    return name[:1] in ("i", "r") and name[1:].isdigit()


def index_var(name: str, size: sint) -> Var:
    """The variable indexing an axis of size elements."""
    n = as_int(size)
    if n is not None:
        return Var(name, 0, max(n - 1, 0))
    return Var(name, 0, max(upper(size) - 1, 0), to_expr(size))


def dims(shape) -> tuple[sint, ...]:
    """shape with its constant sizes as ints and its symbolic ones as expressions."""
    return tuple(d if as_int(d) is None else as_int(d) for d in shape)


def bounds(e: Expr) -> tuple[int, int]:
    if isinstance(e, Num):
        return e.v, e.v
    if isinstance(e, Var):
        return e.lo, e.hi
    assert isinstance(e, BinOp)
    return _memo(e, "_bounds", lambda: _op_bounds(e))


def _op_bounds(e: BinOp) -> tuple[int, int]:
    (a0, a1), (b0, b1) = bounds(e.a), bounds(e.b)
    if e.op == "+":
        return a0 + b0, a1 + b1
    if e.op == "*":
        c = [a0 * b0, a0 * b1, a1 * b0, a1 * b1]
        return min(c), max(c)
    if e.op == "//" and b0 == b1 and b0 > 0:
        return a0 // b0, a1 // b0
    if e.op == "%" and b0 == b1 and b0 > 0:
        return (a0, a1) if 0 <= a0 and a1 < b0 else (0, b0 - 1)
    if e.op in ("<", "and"):
        return 0, 1
    if e.op in ("//", "%") and a0 >= 0 and b0 > 0:  # by a run-time size
        return (a0 // b1, a1 // b0) if e.op == "//" else (0, min(a1, b1 - 1))
    return -(2**62), 2**62


def add(a: sint, b: sint) -> Expr:
    a, b = to_expr(a), to_expr(b)
    if isinstance(a, Num) and isinstance(b, Num):
        return Num(a.v + b.v)
    if isinstance(a, Num):
        a, b = b, a
    if _is(b, 0):
        return a
    # fold constants to the right: (x + c1) + c2 -> x + (c1 + c2)
    if isinstance(a, BinOp) and a.op == "+" and isinstance(a.b, Num):
        return add(a.a, a.b.v + b.v) if isinstance(b, Num) else add(add(a.a, b), a.b)
    return BinOp("+", a, b)


def mul(a: sint, b: sint) -> Expr:
    a, b = to_expr(a), to_expr(b)
    if isinstance(a, Num) and isinstance(b, Num):
        return Num(a.v * b.v)
    if isinstance(a, Num):
        a, b = b, a
    if _is(b, 0):
        return Num(0)
    if _is(b, 1):
        return a
    if isinstance(b, Num) and isinstance(a, BinOp) and a.op == "*" and isinstance(a.b, Num):
        return mul(a.a, a.b.v * b.v)
    if isinstance(b, Num) and isinstance(a, BinOp) and a.op == "+":
        return add(mul(a.a, b), mul(a.b, b))
    return BinOp("*", a, b)


def floordiv(a: sint, b: sint) -> Expr:
    a, b = to_expr(a), to_expr(b)
    if isinstance(a, Num) and isinstance(b, Num):
        return Num(a.v // b.v)
    if _is(b, 1):
        return a
    if isinstance(b, Num) and b.v > 0:
        lo, hi = bounds(a)
        if lo // b.v == hi // b.v:
            return Num(lo // b.v)
        # (x*c) // c -> x and (x*c + y) // c -> x + y // c when 0 <= y (x*(c/d) when y < c)
        if isinstance(a, BinOp) and a.op == "*" and isinstance(a.b, Num) and a.b.v % b.v == 0:
            return mul(a.a, a.b.v // b.v)
        split = _multiples(a, b.v)
        if split is not None:
            whole, rest = split
            return whole if bounds(rest)[1] < b.v else add(whole, floordiv(rest, b))
    if involves_sizes(a, b):
        split = _divided(a, b)
        if split is not None:
            whole, rest, below = split
            return whole if below else add(whole, BinOp("//", rest, b))
    return BinOp("//", a, b)


def _multiples(a: Expr, d: int) -> tuple[Expr, Expr] | None:
    """(w, r) with a = w * d + r, w gathering the terms of a sum (however nested) whose
    coefficients d divides, when there are such terms and w and r are non-negative (so that
    a // d = w + r // d and a % d = r % d); None otherwise."""
    p = _poly(a)
    if len(p) < 2 or not any(c % d == 0 for c in p.values()):
        return None
    whole = _expr({m: c // d for m, c in p.items() if c % d == 0})
    rest = _expr({m: c for m, c in p.items() if c % d})
    return (whole, rest) if bounds(whole)[0] >= 0 and bounds(rest)[0] >= 0 else None


def mod(a: sint, b: sint) -> Expr:
    a, b = to_expr(a), to_expr(b)
    if isinstance(a, Num) and isinstance(b, Num):
        return Num(a.v % b.v)
    if _is(b, 1) or _is(a, 0):
        return Num(0)
    if isinstance(b, Num) and b.v > 0:
        lo, hi = bounds(a)
        if 0 <= lo and hi < b.v:
            return a
        if isinstance(a, BinOp) and a.op == "*" and isinstance(a.b, Num) and a.b.v % b.v == 0:
            return Num(0)
        if isinstance(a, BinOp) and a.op == "+":
            for x, y in ((a.a, a.b), (a.b, a.a)):
                if isinstance(x, BinOp) and x.op == "*" and isinstance(x.b, Num) and x.b.v % b.v == 0:
                    return mod(y, b)
        split = _multiples(a, b.v)
        if split is not None:
            return mod(split[1], b)
    if involves_sizes(a, b):
        split = _divided(a, b)
        if split is not None:
            _, rest, below = split
            return rest if below or _is(rest, 0) else BinOp("%", rest, b)
    return BinOp("%", a, b)


def lt(a: sint, b: sint) -> Expr:
    a, b = to_expr(a), to_expr(b)
    (a0, a1), (b0, b1) = bounds(a), bounds(b)
    if a1 < b0:
        return Num(1)
    if a0 >= b1:
        return Num(0)
    if involves_sizes(a, b) and _below(_poly(a), _poly(b)):
        return Num(1)
    return BinOp("<", a, b)


# --- run-time sizes: index arithmetic as polynomials over sizes and indices ---------------------
# Bounds cannot say that an index over a run-time size s is below s; these can, which is what
# dividing a flat index by a stride such as 64 * s needs: (i1 * (64 * s) + i0 * 64 + i2) // (64 * s)
# is i1 when i0 < s and i2 < 64.

Poly = dict  # monomial (a sorted tuple of atoms: variables or opaque operations) -> coefficient


def involves_sizes(*xs: Expr) -> bool:
    """Whether any of xs involves a run-time size (or an index over one)."""
    return any(v.extent is not None or not is_loop_var(v.name) for x in xs for v in var_list(x))


def _poly(e: Expr) -> Poly:
    if isinstance(e, Num):
        return {(): e.v} if e.v else {}
    if isinstance(e, BinOp) and e.op == "+":
        return _padd(_poly(e.a), _poly(e.b))
    if isinstance(e, BinOp) and e.op == "*":
        out: Poly = {}
        for ma, ca in _poly(e.a).items():
            for mb, cb in _poly(e.b).items():
                out = _padd(out, {tuple(sorted(ma + mb, key=render)): ca * cb})
        return out
    return {(e,): 1}


def _padd(p: Poly, q: Poly, sign: int = 1) -> Poly:
    out = dict(p)
    for m, c in q.items():
        out[m] = out.get(m, 0) + sign * c
        if not out[m]:
            del out[m]
    return out


def _expr(p: Poly) -> Expr:
    out: Expr = Num(0)
    for m in sorted(p, key=lambda m: [render(a) for a in m]):
        term: Expr = Num(p[m])
        for atom in m:
            term = mul(term, atom)
        out = add(out, term)
    return out


def _atom_max(atom: Expr) -> Poly | None:
    """The largest value of a non-negative atom as a polynomial (a size stands for itself)."""
    lo, hi = bounds(atom)
    if lo < 0:
        return None
    if isinstance(atom, Var) and atom.extent is not None:
        return _padd(_poly(atom.extent), {(): 1}, -1)
    if all(not is_loop_var(v.name) for v in var_list(atom)):  # a size, or a function of sizes
        return {(atom,): 1}
    return {(): hi} if hi else {}


def _most(p: Poly) -> Poly | None:
    """An upper bound of p as a polynomial over sizes; None unless every term is non-negative."""
    out: Poly = {}
    for m, c in p.items():
        if c < 0:
            return None
        term: Poly = {(): c}
        for atom in m:
            top = _atom_max(atom)
            if top is None:
                return None
            term = _poly(mul(_expr(term), _expr(top)))
        out = _padd(out, term)
    return out


def _nonnegative(p: Poly) -> bool:
    return all(c >= 0 for c in p.values()) and all(bounds(a)[0] >= 0 for m in p for a in m)


def at_most(a: sint, b: sint) -> bool:
    """Whether a <= b is provable, by bounds or (sizes that vary at run time) because b - a is a
    polynomial without a negative coefficient over non-negative atoms."""
    a, b = to_expr(a), to_expr(b)
    return bounds(a)[1] <= bounds(b)[0] or _nonnegative(_loosened(_padd(_poly(b), _poly(a), -1)))


def _below(a: Poly, b: Poly) -> bool:
    """Whether 0 <= a < b is provable: b - 1 - max(a), loosened, has no negative coefficient."""
    top = _most(a)
    return top is not None and _nonnegative(_loosened(_padd(_padd(b, {(): 1}, -1), top, -1)))


def _loosened(p: Poly) -> Poly:
    """A lower bound of p (its atoms non-negative): c * (x // c) <= x, so a negative multiple of
    k * (x // c) with c dividing k is at least -(k / c) * x (a stride-2 layer's output size s // 2
    against its input's s)."""
    out: Poly = {}
    for m, k in p.items():
        half = next((x for x in m if k < 0 and isinstance(x, BinOp) and x.op == "//" and
                     isinstance(x.b, Num) and x.b.v > 0 and k % x.b.v == 0), None)
        if half is None:
            out = _padd(out, {m: k})
            continue
        others = list(m)
        others.remove(half)
        out = _padd(out, _poly(mul(mul(Num(k // half.b.v), half.a), _expr({tuple(others): 1}))))
    return out


def _divided(a: Expr, b: Expr) -> tuple[Expr, Expr, bool] | None:
    """a as whole * b + rest, by dividing by b's leading term (a divisor such as (s - 1) // 8 + 1
    has two terms): (whole, rest, whether rest < b), rest never negative (// and % are rendered as
    C's, which truncate); None when nothing of a divides, or rest may be negative."""
    pb = _poly(b)
    if not pb or any(c <= 0 for c in pb.values()) or any(bounds(x)[0] < 0 for m in pb for x in m) or \
            bounds(b)[0] < 1:
        return None
    lead = max(pb, key=lambda m: (len(m), [render(x) for x in m]))  # the term of most factors
    whole: Poly = {}
    rest = _poly(a)
    for _ in range(64):  # each step lowers the degree of what is left to divide
        step = next(((m, q) for m, c in rest.items() if c % pb[lead] == 0
                     for q in [_cofactor(m, lead)] if q is not None), None)
        if step is None:
            break
        m, q = step
        times = {q: rest[m] // pb[lead]}
        whole = _padd(whole, times)
        rest = _padd(rest, _poly(mul(_expr(times), b)), -1)
    below = _below(rest, pb)
    if not _nonnegative(rest) or not (whole or below):
        return None
    return _expr(whole), _expr(rest), below


def _cofactor(m: tuple, lead: tuple) -> tuple | None:
    """m / lead as a monomial, or None where lead's factors are not all in m."""
    left = list(m)
    for x in lead:
        if x not in left:
            return None
        left.remove(x)
    return tuple(left)


def logical_and(a: sint, b: sint) -> Expr:
    a, b = to_expr(a), to_expr(b)
    if _is(a, 1):
        return b
    if _is(b, 1):
        return a
    if Num(0) in (a, b):
        return Num(0)
    return BinOp("and", a, b)


def conjuncts(cond: Expr) -> list[Expr]:
    """The terms of a conjunction (`and`) of conditions."""
    if isinstance(cond, BinOp) and cond.op == "and":
        return conjuncts(cond.a) + conjuncts(cond.b)
    return [cond]


def _range(atom: Expr) -> tuple[str, int, int] | None:
    """(variable, lo, hi) for an atom `c < v` or `v < c`; None for any other condition."""
    if isinstance(atom, BinOp) and atom.op == "<":
        if isinstance(atom.a, Num) and isinstance(atom.b, Var):
            return atom.b.name, max(atom.b.lo, atom.a.v + 1), atom.b.hi
        if isinstance(atom.a, Var) and isinstance(atom.b, Num):
            return atom.a.name, atom.a.lo, min(atom.a.hi, atom.b.v - 1)
    return None


def ranges(cond: sint) -> dict[str, tuple[int, int]]:
    """Variable ranges [lo, hi] implied by the `c < v` and `v < c` terms of a conjunction."""
    out: dict[str, tuple[int, int]] = {}
    for r in filter(None, map(_range, conjuncts(to_expr(cond)))):
        name, lo, hi = r
        old = out.get(name, (lo, hi))
        out[name] = (max(lo, old[0]), min(hi, old[1]))
    return out


def is_range(atom: Expr) -> bool:
    return _range(atom) is not None


_BUILD: dict[str, Callable[[Expr, Expr], Expr]] = {"+": add, "*": mul, "//": floordiv, "%": mod, "<": lt,
                                                   "and": logical_and}


def map_vars(x: sint, f: Callable[[Var], Expr]) -> Expr:
    """x rebuilt through the simplifying constructors with each variable v replaced by f(v)."""
    def go(e: Expr) -> Expr:
        if isinstance(e, Var):
            return f(e)
        if isinstance(e, BinOp):
            return _BUILD[e.op](go(e.a), go(e.b))
        return e
    return go(to_expr(x))


def assume(x: sint, cond: sint) -> Expr:
    """x rebuilt with each variable narrowed to the range cond implies, so that the simplifying
    constructors can use it: an index read only where a padding mask holds divides exactly.
    Equal to x wherever cond holds; use it only for values that are masked where it does not."""
    narrowed = ranges(cond)
    if not narrowed:
        return to_expr(x)

    def narrow(v: Var) -> Expr:
        lo, hi = narrowed.get(v.name, (1, 0))
        return Var(v.name, lo, hi) if lo <= hi else v  # an empty range (or none) leaves v as it is
    return map_vars(x, narrow)


def rename(x: sint, old: str, new: Var) -> Expr:
    """x with the variable named old replaced by new."""
    return map_vars(x, lambda v: new if v.name == old else v)


def evaluate(x: sint, env: Mapping[str, int] | None = None):
    """Value of x with variables taken from env. Works on numpy arrays of ints too."""
    if not isinstance(x, Expr):
        return x
    if isinstance(x, Num):
        return x.v
    if isinstance(x, Var):
        if env is None or x.name not in env:
            raise KeyError(f"symbolic dimension {x.name!r} has no value")
        return env[x.name]
    a, b = evaluate(x.a, env), evaluate(x.b, env)
    if x.op == "<":
        return a < b
    if x.op == "and":
        return a & b if hasattr(a, "__and__") and not isinstance(a, int) else int(bool(a) and bool(b))
    return _PY[x.op](a, b)


def var_list(x: sint) -> tuple[Var, ...]:
    """The variables of x (as objects, with their bounds), each once, in order of occurrence."""
    if isinstance(x, Var):
        return (x,)
    if not isinstance(x, BinOp):
        return ()
    return _memo(x, "_vars", lambda: tuple(dict.fromkeys(var_list(x.a) + var_list(x.b))))


def variables(x: sint) -> set[str]:
    if isinstance(x, Var):
        return {x.name}
    if isinstance(x, BinOp):
        return variables(x.a) | variables(x.b)
    return set()


_C_OPS = {"+": "+", "*": "*", "//": "/", "%": "%", "<": "<", "and": "&&"}


def render(x: sint, name: Callable[[Var], str] = lambda v: v.name) -> str:
    """C syntax (also valid for CUDA, OpenCL and Metal). `//` and `%` are only
    produced on non-negative operands, where C's truncation equals floor."""
    if not isinstance(x, Expr):
        return str(x)
    if isinstance(x, Num):
        return str(x.v)
    if isinstance(x, Var):
        return name(x)
    return f"({render(x.a, name)} {_C_OPS[x.op]} {render(x.b, name)})"


def terms(e: Expr) -> list[tuple[int, Expr | None]]:
    """e as a sum of coef * atom (atom None for the constant)."""
    if isinstance(e, Num):
        return [(e.v, None)]
    if isinstance(e, BinOp) and e.op == "+":
        return terms(e.a) + terms(e.b)
    if isinstance(e, BinOp) and e.op == "*" and isinstance(e.b, Num):
        return [(c * e.b.v, a) for c, a in terms(e.a)]
    return [(1, e)]


def prod(xs) -> sint:
    out: sint = 1
    for x in xs:
        out = out * x if isinstance(out, Expr) or isinstance(x, Expr) else out * int(x)
    return out


def size_to_json(x: sint) -> int | dict:
    """A size as JSON data: an int, or a variable or operation as a dict (size_from_json reads it)."""
    x = to_expr(x)
    if isinstance(x, Num):
        return x.v
    if isinstance(x, Var):
        return {"var": x.name, "lo": x.lo, "hi": x.hi}
    return {"op": x.op, "a": size_to_json(x.a), "b": size_to_json(x.b)}


def size_from_json(data: Any) -> sint:
    """The size size_to_json wrote (ValueError on anything else)."""
    if type(data) is int:
        return data
    if isinstance(data, dict) and set(data) == {"var", "lo", "hi"} and isinstance(data["var"], str) \
            and type(data["lo"]) is int and type(data["hi"]) is int:
        return Var(data["var"], data["lo"], data["hi"])
    if isinstance(data, dict) and set(data) == {"op", "a", "b"} and data["op"] in _PY:
        return BinOp(data["op"], to_expr(size_from_json(data["a"])), to_expr(size_from_json(data["b"])))
    raise ValueError(f"not a size: {data!r}")


def sym_eq(a: sint, b: sint) -> bool:
    """Structural equality of sizes (int 3 == Num(3))."""
    return to_expr(a) == to_expr(b)


def describe_shape(shape: tuple[sint, ...]) -> str:
    """shape as a user reads it: [s0 in 1..512, 64]."""
    return "[" + ", ".join(f"{n} in {n.lo}..{n.hi}" if isinstance(n, Var) else str(n) for n in shape) + "]"


def bind_sizes(shapes: list[tuple[sint, ...]], given: list[tuple[int, ...]],
               names: list[str] | None = None) -> dict[str, int]:
    """The values of the run-time sizes in shapes, read off the given shapes of a call; ValueError
    naming the input when a shape does not fit (a constant size differs, a size is outside its
    bounds, or two inputs disagree on one)."""
    env: dict[str, int] = {}
    later = []
    for k, (shape, got) in enumerate(zip(shapes, given)):
        where = f"input {k}" if names is None else names[k]
        if len(shape) != len(got):
            raise _misfit(where, shape, got)
        for d, n in zip(shape, got):
            if isinstance(d, int):
                if d != n:
                    raise _misfit(where, shape, got)
            elif isinstance(d, Var) and d.name not in env:
                if not d.lo <= n <= d.hi:
                    raise _misfit(where, shape, got, f" ({d.name} must be in {d.lo}..{d.hi})")
                env[d.name] = n
            else:
                later.append((where, shape, got, d, n))
    for where, shape, got, d, n in later:  # a size another input's size determines, or an expression of sizes
        unknown = variables(d) - env.keys()
        if len(unknown) == 1:  # an affine size a*v + b = n, v read off it
            name = unknown.pop()
            base = evaluate(d, {**env, name: 0})
            slope = evaluate(d, {**env, name: 1}) - base
            if slope and (n - base) % slope == 0:
                env[name] = (n - base) // slope
        if variables(d) - env.keys() or evaluate(d, env) != n:
            raise _misfit(where, shape, got, f" (the sizes {env} do not give it)")
        for v in var_list(d):
            if not v.lo <= env[v.name] <= v.hi:
                raise _misfit(where, shape, got, f" ({v.name} = {env[v.name]} must be in {v.lo}..{v.hi})")
    return env


def _misfit(where: str, shape: tuple[sint, ...], got: tuple[int, ...], why: str = "") -> ValueError:
    return ValueError(f"{where}: expected shape {describe_shape(shape)}, given {list(got)}{why}")
