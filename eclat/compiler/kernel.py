"""The kernel IR: what every backend renders. Backend neutral, small, documented.

A `Program` is a list of `Buffer`s and a list of `Kernel`s run in order.

Buffer
    name, numel, dtype and role: "input" (a runtime argument), "weight" (a constant
    owned by the compiled model, with its data), "temp" (placed by the memory planner)
    or "output" (handed back to the caller). Every buffer is a flat, dense array.

Kernel
    writes ONE output buffer, element by element, over an iteration space `shape`
    (row-major, output element (i0..in) goes to flat index sum(i_k * stride_k) of a
    contiguous layout of `shape`). The axis variables are `axis_vars(kernel)`: Var
    "i0".."in" with bounds. The element value is the expression tree `body`:

    Const(value, dtype)                 a scalar
    Index(expr, dtype)                  the integer value of a symbolic index expression
    Load(buffer, index, valid, dtype)   buffer[index] where `valid` != 0, else 0. `index`
                                        and `valid` are symbolic expressions (eclat.ir.symbolic)
                                        over the axis and reduce variables; they are what
                                        View.index produced, composed through fused producers.
    Gather(buffer, idx, rows, row_size, inner, dtype)
                                        buffer[clamp(idx, 0, rows-1) * row_size + inner]:
                                        an indexed load whose row is a computed value.
    Op(op, srcs, dtype)                 a primitive of eclat.ir.graph.OPS (unary, binary,
                                        ternary) or "fma" (a*b+c), applied elementwise
    Reduce(op, size, var, body, dtype)  op ("sum" | "max_reduce") of `body` over
                                        var = 0..size-1; the identity for size 0

    A Reduce whose free variables do not include the inner output axes is hoisted: it is
    evaluated once, as soon as every variable it depends on is bound (so a softmax or
    layer-norm row is one kernel: per row, its reductions once, then the elementwise
    output). Equal subtrees are equal values (dataclasses compare structurally), which
    is how a backend shares them.

Schedules are data (`Schedule`, or a target's own kind); each target says which is its default
and which alternatives the search times (Target.default_schedule, Target.schedule_space).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ir.dtypes import DType
from ..ir.graph import LOG2E
from ..ir.symbolic import (
    BinOp,
    Expr,
    Num,
    Var,
    as_int,
    assume,
    evaluate,
    index_var,
    is_loop_var,
    map_vars,
    sint,
    terms,
    to_expr,
    upper,
    var_list,
    variables,
)
from .quantize import FORMATS

# --- buffers ----------------------------------------------------------------------------

ROLES = ("input", "weight", "temp", "output")


@dataclass
class Buffer:
    name: str
    numel: int
    dtype: DType
    role: str
    data: np.ndarray | None = None  # weights only: the constant contents, in C order (any shape; may be a
    # strided read-only view, e.g. a laid-out weight, which a backend copies or packs when it binds it)
    format: str | None = None  # weights only: the low-precision format the values are exact in
    # a formatted weight's (K, inner): its values are rounded along an axis of K elements, inner
    # apart, so flat element i is at k = (i // inner) % K (None: unknown, e.g. a backend's copy)
    along: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"buffer {self.name}: role {self.role!r} is not one of {ROLES}")

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.np.itemsize

    @property
    def stored_bytes(self) -> int:
        """What reading it all moves: a weight with a low-precision format is read packed in it."""
        return self.nbytes if self.format is None else FORMATS[self.format].stored_bytes(self.numel)


# --- expressions --------------------------------------------------------------------------

def _node(cls):
    """A frozen dataclass whose hash is computed once: kernel trees are DAGs with much
    sharing, and recursive hashing would revisit every shared subtree."""
    cls = dataclass(frozen=True)(cls)
    structural = cls.__hash__

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = structural(self)
            object.__setattr__(self, "_hash", h)
        return h
    cls.__hash__ = __hash__
    return cls


@_node
class Const:
    value: Any
    dtype: DType


@_node
class Index:
    expr: Expr
    dtype: DType


@_node
class Load:
    buffer: str
    index: Expr
    valid: Expr
    dtype: DType


@_node
class Gather:
    buffer: str
    idx: KExpr
    rows: int
    row_size: sint
    inner: Expr
    dtype: DType


@_node
class Op:
    op: str
    srcs: tuple[KExpr, ...]
    dtype: DType


@_node
class Reduce:
    op: str
    size: int
    var: Var
    body: KExpr
    dtype: DType


KExpr = Const | Index | Load | Gather | Op | Reduce

# Rough costs in scalar operations, for fusion decisions and flop counts.
OP_COST = {"exp2": 12, "log2": 12, "sin": 12, "sqrt": 4, "recip": 4, "div": 4, "fma": 2, "cast": 0}


def children(e: KExpr) -> tuple[KExpr, ...]:
    if isinstance(e, Op):
        return e.srcs
    if isinstance(e, Reduce):
        return (e.body,)
    if isinstance(e, Gather):
        return (e.idx,)
    return ()


def _loop_vars(e: Expr) -> frozenset[str]:
    return frozenset(v for v in variables(e) if is_loop_var(v))


def free_vars(e: KExpr, _memo: dict | None = None) -> frozenset[str]:
    """Names of the index variables e depends on (its own reduce variables excluded; run-time sizes
    are no index variables)."""
    memo = {} if _memo is None else _memo
    key = id(e)
    if key in memo:
        return memo[key][1]
    if isinstance(e, Load):
        out = _loop_vars(e.index) | _loop_vars(e.valid)
    elif isinstance(e, Index):
        out = _loop_vars(e.expr)
    elif isinstance(e, Gather):
        out = free_vars(e.idx, memo) | _loop_vars(e.inner)
    elif isinstance(e, Reduce):
        out = free_vars(e.body, memo) - {e.var.name}
    else:
        out = frozenset().union(*(free_vars(s, memo) for s in children(e))) if children(e) else frozenset()
    memo[key] = (e, out)  # keep e alive so its id stays unique
    return out


_SIZED = {Load: ("index", "valid"), Index: ("expr",), Gather: ("inner", "row_size"), Reduce: ("size",)}


def mentioned_sizes(kernel: Kernel) -> set[str]:
    """Names of the run-time sizes kernel's shape, reduction sizes and indices mention."""
    exprs = list(kernel.shape)
    for body in (kernel.body, *(sd.body for sd in kernel.sides)):
        exprs += [getattr(x, f) for x in walk(body) for f in _SIZED.get(type(x), ())]
    return {v.name for e in exprs for v in var_list(e) if not is_loop_var(v.name)}


def walk(e: KExpr) -> list[KExpr]:
    """Distinct subexpressions of e, children before parents."""
    seen: set[KExpr] = set()
    order: list[KExpr] = []

    def go(x: KExpr) -> None:
        if x in seen:
            return
        seen.add(x)
        for c in children(x):
            go(c)
        order.append(x)
    go(e)
    return order


def _kept(e: KExpr, name: str, kinds: tuple[type, ...]) -> list:
    """The subexpressions of e of kinds, found once per node (nodes are immutable; grouping and
    code generation ask for a kernel's reductions and loads thousands of times)."""
    found = e.__dict__.get(name)
    if found is None:
        found = tuple(x for x in walk(e) if isinstance(x, kinds))
        object.__setattr__(e, name, found)
    return list(found)


def reduces(e: KExpr) -> list[Reduce]:
    return _kept(e, "_reduces", (Reduce,))


def loads(e: KExpr) -> list[Load | Gather]:
    return _kept(e, "_loads", (Load, Gather))


def pruned(e: KExpr) -> KExpr:
    """e without the terms its masks make zero: a load valid nowhere reads 0, and an add of 0 (or of
    a negated 0) is its other operand. A concatenation split into its parts (a loop in pieces) keeps
    each part's own terms only."""
    memo: dict[int, KExpr] = {}

    def zero(x: KExpr) -> bool:
        return isinstance(x, Const) and x.value == 0

    def go(x: KExpr) -> KExpr:
        if id(x) in memo:
            return memo[id(x)]
        out = x
        if isinstance(x, Load) and x.valid == Num(0):
            out = Const(0, x.dtype)
        elif isinstance(x, Op) and x.op in ("add", "neg") and x.dtype.is_float:
            srcs = tuple(go(s) for s in x.srcs)
            live = [s for s in srcs if not zero(s)]
            if not live:
                out = Const(0, x.dtype)
            elif x.op == "add" and len(live) == 1:
                out = live[0]
            elif any(a is not b for a, b in zip(srcs, x.srcs)):
                out = Op(x.op, srcs, x.dtype)
        elif isinstance(x, Op):
            srcs = tuple(go(s) for s in x.srcs)
            out = Op(x.op, srcs, x.dtype) if any(a is not b for a, b in zip(srcs, x.srcs)) else x
        memo[id(x)] = out
        return out
    return go(e)


def rewrite(e: KExpr, nodes: dict[KExpr, KExpr] | None = None,
            index: Callable[[Expr], Expr] | None = None) -> KExpr:
    """e rebuilt with each subexpression found in nodes replaced by its value, and index applied
    to every index, validity and mask expression (and to run-time sizes: of reductions, of rows)."""
    nodes = nodes or {}
    f = index or (lambda x: x)
    memo: dict[KExpr, KExpr] = {}

    def size(n: sint) -> sint:
        if isinstance(n, int):
            return n
        out = f(n)
        return out.v if isinstance(out, Num) else out

    def go(x: KExpr) -> KExpr:
        if x in nodes:
            return nodes[x]
        if x in memo:
            return memo[x]
        if isinstance(x, Load):
            out: KExpr = Load(x.buffer, f(x.index), f(x.valid), x.dtype)
        elif isinstance(x, Index):
            out = Index(f(x.expr), x.dtype)
        elif isinstance(x, Gather):
            out = Gather(x.buffer, go(x.idx), x.rows, size(x.row_size), f(x.inner), x.dtype)
        elif isinstance(x, Op):
            out = Op(x.op, tuple(go(s) for s in x.srcs), x.dtype)
        elif isinstance(x, Reduce):
            out = Reduce(x.op, size(x.size), x.var, go(x.body), x.dtype)
        else:
            out = x
        memo[x] = out
        return out
    return go(e)


def _indices(e: KExpr) -> list[Expr]:
    """Every index, validity and mask expression of e."""
    out: list[Expr] = []
    for x in walk(e):
        if isinstance(x, Load):
            out += [x.index, x.valid]
        elif isinstance(x, Index):
            out.append(x.expr)
        elif isinstance(x, Gather):
            out.append(x.inner)
    return out


def _mergeable(exprs: list[Expr], outer: str, inner: str, span: int) -> bool:
    """Whether every expression reads outer only as c * span * outer beside c * inner (and neither
    in any other way): outer then continues inner's run of merged axes, span elements long."""
    for e in exprs:
        coef = {outer: 0, inner: 0}
        for c, atom in terms(e):
            if isinstance(atom, Var) and atom.name in coef:
                coef[atom.name] += c
            elif atom is not None and variables(atom) & coef.keys():
                return False
        if coef[outer] != span * coef[inner]:
            return False
    return True


def coalesce(kernel: Kernel) -> Kernel:
    """kernel with neighbouring output axes merged wherever every index reads them as one flat
    axis (a convolution's output rows and columns, unit axes): longer rows for vector loops and
    contractions (a 1x1 convolution over 7x7 pixels is a GEMM with 49 columns, not 7 of 7)."""
    shape = list(kernel.shape)
    if len(shape) < 2 or kernel.sides:
        return kernel
    exprs = _indices(kernel.body)
    kept = [d for d, n in enumerate(shape) if n != 1] or [len(shape) - 1]  # unit axes read as 0
    groups = [[kept[-1]]]  # runs of merged axes, innermost last
    for d in reversed(kept[:-1]):
        run = groups[0]
        if _mergeable(exprs, f"i{d}", f"i{run[-1]}", math.prod(shape[a] for a in run)):
            run.insert(0, d)
        else:
            groups.insert(0, [d])
    if len(groups) == len(shape):
        return kernel
    new_shape = tuple(math.prod(shape[a] for a in run) for run in groups)
    new_vars = axis_vars(new_shape)
    # the run's last axis becomes the merged one, the others vanish: c_d * i_d + ... + c_l * i_l
    # with c_d = size_after_d * c_l is c_l * j for j the merged index
    to = {f"i{run[-1]}": new_vars[g] for g, run in enumerate(groups)}
    gone = {f"i{d}" for d in range(len(shape))} - to.keys()
    return _reindexed(kernel, new_shape, lambda v: Num(0) if v.name in gone else to.get(v.name, v))


def _reindexed(kernel: Kernel, shape: tuple[sint, ...], sub: Callable[[Var], Expr]) -> Kernel:
    """kernel over a new output shape, each index variable of its body replaced by sub(variable)."""
    body = rewrite(kernel.body, index=lambda x: map_vars(x, sub))
    return dataclasses.replace(kernel, shape=shape, body=body)


def split_last(kernel: Kernel, size: int) -> Kernel:
    """kernel with its last axis split into rows of `size` (a multiple of it): coalesce undone
    where a pass needs the rows."""
    *lead, last = kernel.shape
    new_shape = (*lead, last // size, size)
    outer, inner = axis_vars(new_shape)[-2:]
    return _reindexed(kernel, new_shape, lambda v: outer * size + inner if v.name == f"i{len(lead)}" else v)


def split_groups(kernel: Kernel) -> Kernel:
    """kernel with an output axis split in two where its indexes read it as i // c (the group, and
    the channel within it), when that makes it a contraction with rows, or, in a kernel that is no
    contraction, a reduction inside it then reads the group alone. A grouped convolution's product
    is then a register-blocked GEMM per group, where unsplit it is a matrix-vector product per
    output channel (the group's operand read again for every channel of the group); a GroupNorm's
    statistics, inside the kernel that normalises every channel, run once per group, where unsplit
    they ran once per channel (BiT's ResNet-v2 7x slower than torch eager)."""
    c = as_contraction(kernel)
    if c is not None and c.m_axis is not None or c is None and not reduces(kernel.body):
        return kernel
    divisors = {(x.a.name, x.b.v) for e in _indices(kernel.body) for x in _subexprs(e)
                if isinstance(x, BinOp) and x.op == "//" and isinstance(x.a, Var) and isinstance(x.b, Num)}
    for a, n in enumerate(kernel.shape):
        for size in sorted(d for name, d in divisors if name == f"i{a}" and isinstance(n, int)
                           and 1 < d < n and n % d == 0):
            shape = (*kernel.shape[:a], n // size, size, *kernel.shape[a + 1:])
            new = axis_vars(shape)
            moved = {f"i{b}": new[b + (b > a)] for b in range(len(kernel.shape)) if b != a}
            split = _reindexed(kernel, shape, lambda v, a=a, size=size, new=new, moved=moved:
                               new[a] * size + new[a + 1] if v.name == f"i{a}" else moved.get(v.name, v))
            if c is None and _per_group(split, a) or c is not None and _with_rows(split):
                return split
    return kernel


def _with_rows(kernel: Kernel) -> bool:
    turned = as_contraction(kernel)
    return turned is not None and turned.m_axis is not None


def _per_group(kernel: Kernel, a: int) -> bool:
    """Whether a reduction in kernel reads axis a and not the axis after it (the split channel's
    group and not the channel within it)."""
    memo: dict = {}
    found = (free_vars(r, memo) for r in reduces(kernel.body))
    return any(f"i{a}" in fv and f"i{a + 1}" not in fv for fv in found)


# a contraction's output rows of at most this many columns run as one flat axis: a row that fills
# no whole number of register blocks leaves its last columns to edge tiles run element by element
# (squeezenet's stem, rows of 111: 15 of each; 553 -> 323 us flat; resnext50 1.05x, resnet18 and
# DeepLabV3 1.02-1.03x, others level; the rows' limit was 16)
SHORT_ROW = 128


def flatten_rows(kernel: Kernel) -> Kernel:
    """A contraction kernel whose columns are short rows of a longer output (a convolution that
    reads its input's windows in place, so that coalesce cannot merge its rows) with its last two
    axes run as one: its register blocks' vectors fill over the rows, each position's place in
    the input found by dividing the flat index."""
    c = as_contraction(kernel)
    shape = kernel.shape
    if c is None or kernel.sides or len(shape) < 2 or c.n_axis != len(shape) - 1 or \
            c.m_axis == len(shape) - 2 or not all(isinstance(d, int) for d in shape[-2:]) or \
            not 1 < shape[-1] <= SHORT_ROW or shape[-2] == 1:
        return kernel
    rows, cols = shape[-2:]
    new_shape = (*shape[:-2], rows * cols)
    flat = axis_vars(new_shape)[-1]
    sub = {f"i{len(shape) - 2}": flat // cols, f"i{len(shape) - 1}": flat % cols}
    merged = _reindexed(kernel, new_shape, lambda v: sub.get(v.name, v))
    turned = as_contraction(merged)
    same = turned is not None and turned.n_axis == len(new_shape) - 1 and turned.m_axis == c.m_axis
    return merged if same else kernel


def _subexprs(e: Expr) -> list[Expr]:
    """e and every expression inside it."""
    out, stack = [], [e]
    while stack:
        x = stack.pop()
        out.append(x)
        if isinstance(x, BinOp):
            stack += [x.a, x.b]
    return out


def assume_in(e: KExpr, cond: Expr) -> KExpr:
    """e with its index, validity and mask expressions simplified under cond (symbolic.assume):
    for code that runs only where cond holds, e.g. the interior of a padded output."""
    return rewrite(e, index=lambda x: assume(x, cond))


# --- schedules ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Schedule:
    """How a kernel's loops run on a CPU (a target may carry its own kind of schedule instead: see
    its Target.default_schedule). tile: register block for contraction kernels (MR rows x NR
    columns of the output); unroll: vectors in flight in vectorised inner loops (1 = the
    backend's default); threads: how many threads split the outermost parallel loop; transposed:
    a contraction's vectors run along its rows instead (`transposed`), its tile counted that way;
    depth: a contraction's reduction runs in chunks of this many steps, each over every row block
    of a panel before the next (0: the whole reduction at once), so that the panel's chunk stays in
    the L1 cache while the row blocks read it; a decode attention's keys run in parts of about this
    many, each a slice of the outer loop, combined at the end (backends/cpu/attention.py); jam: a
    kernel that is no contraction runs this many of its next-to-last axis's indices together in
    its innermost loop (a channels-last depthwise convolution: each tap's filter vector loaded once
    for several pixels, and the inputs those pixels share once)."""

    tile: tuple[int, int] = (1, 1)
    unroll: int = 1
    threads: int = 1
    transposed: bool = False
    depth: int = 0
    jam: int = 1

    @staticmethod
    def from_json(data: dict[str, Any]) -> Schedule:
        """The schedule dataclasses.asdict wrote (fields this eclat does not know are ignored)."""
        known = {"tile", "unroll", "threads", "transposed", "depth", "jam"}
        return Schedule(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Side:
    """A row sum a kernel computes beside its output: out[row] = the sum over the kernel's last
    axis of body, where body reads the kernel's own output at the current element (the value just
    computed)."""

    out: str
    body: KExpr


@dataclass
class Kernel:
    name: str
    out: str
    shape: tuple[int, ...]
    body: KExpr
    schedule: Any = None  # the target's (a Schedule on the CPU); None until the search schedules it
    ops: list[str] = field(default_factory=list)  # the graph ops fused into it, for reports
    sides: tuple[Side, ...] = ()  # row reductions of its output it also writes (CPU backend)
    # a temporary its threads share, zeroed before each call (CPU: an attention's parts along its keys)
    scratch: str | None = None

    @property
    def numel(self) -> int:
        """Elements it writes (at most: a run-time size counts at its bound)."""
        return numel_bound(self.shape)


@dataclass
class Program:
    buffers: dict[str, Buffer]
    kernels: list[Kernel]
    inputs: list[str]
    outputs: list[str]
    input_shapes: list[tuple[sint, ...]] = field(default_factory=list)
    output_shapes: list[tuple[sint, ...]] = field(default_factory=list)
    # the sizes known only at run time (read off the inputs' shapes at each call), in the order
    # of the sizes array kernels read them from
    sizes: tuple[Var, ...] = ()

    @property
    def weights(self) -> dict[str, Buffer]:
        """The weight buffers by name (what a target's schedules may read of them)."""
        return {name: b for name, b in self.buffers.items() if b.role == "weight"}

    def __str__(self) -> str:
        lines = [f"buffer {b.name}: {b.role} {b.dtype.short}[{b.numel}]" for b in self.buffers.values()]
        lines += [f"kernel {k.name} -> {k.out} over {list(k.shape)}: {k.body}" for k in self.kernels]
        return "\n".join(lines)


def axis_vars(shape: tuple[sint, ...]) -> list[Var]:
    return [index_var(f"i{k}", n) for k, n in enumerate(shape)]


def size_vars(shapes: list[tuple[sint, ...]]) -> tuple[Var, ...]:
    """The variables of shapes' symbolic sizes, by name."""
    found: dict[str, Var] = {}
    for shape in shapes:
        for d in shape:
            for v in var_list(d):
                found.setdefault(v.name, v)
    return tuple(found[n] for n in sorted(found))


def specialised(kernel: Kernel, sizes: dict[str, int]) -> Kernel:
    """kernel with its run-time sizes replaced by values (to time it at those sizes, or to run only
    them): an index over a run-time size (`index_var`) becomes one over its value, so that no code
    reads the size at run time."""
    def var(v: Var) -> Expr:
        if v.name in sizes:
            return Num(sizes[v.name])
        if v.extent is not None and variables(v.extent) & sizes.keys():
            return index_var(v.name, map_vars(v.extent, var))
        return v
    f = lambda e: map_vars(e, var)  # noqa: E731
    shape = tuple(as_int(f(to_expr(n))) for n in kernel.shape)
    sides = tuple(Side(sd.out, rewrite(sd.body, index=f)) for sd in kernel.sides)
    return dataclasses.replace(kernel, shape=shape, body=rewrite(kernel.body, index=f), sides=sides)


def at_sizes(program: Program, sizes: dict[str, int]) -> Program:
    """program with its run-time sizes replaced by values, its buffers holding what they hold then:
    for estimates at those sizes, and a program that runs those sizes alone (compiler.buckets)."""
    if not sizes:
        return program
    kernels = [specialised(k, sizes) for k in program.kernels]
    at = lambda shape: tuple(int(evaluate(n, sizes)) for n in shape)  # noqa: E731
    numel = {k.out: math.prod(k.shape) for k in kernels}
    numel |= {name: math.prod(at(shape)) for name, shape in zip(program.inputs, program.input_shapes)}
    buffers = {name: dataclasses.replace(b, numel=numel.get(name, b.numel))
               for name, b in program.buffers.items()}
    return dataclasses.replace(program, buffers=buffers, kernels=kernels, sizes=(),
                               input_shapes=[at(s) for s in program.input_shapes],
                               output_shapes=[at(s) for s in program.output_shapes])


def numel_bound(shape: tuple[sint, ...]) -> int:
    """Elements of a dense array of shape at its largest: what a buffer of a symbolic shape holds
    room for (its elements are laid out densely for the sizes of each call)."""
    return math.prod(upper(n) for n in shape)


@dataclass(frozen=True)
class Contraction:
    """A kernel whose body is epilogue(sum_k a * b): a is the operand without the
    column axis n (the last output axis), b the one without the row axis m."""

    reduce: Reduce
    a: KExpr
    b: KExpr
    m_axis: int | None  # None: no row axis (a matrix-vector product)
    n_axis: int


def as_contraction(kernel: Kernel) -> Contraction | None:
    """Recognise a register-blockable contraction: exactly one Reduce, a sum whose body
    is a product, the last output axis read only by one factor, and no other reduce."""
    rs = reduces(kernel.body)
    if len(rs) != 1 or rs[0].op != "sum" or not kernel.shape:
        return None
    r = rs[0]
    body = r.body
    if not (isinstance(body, Op) and body.op == "mul") or not body.dtype.is_float:
        return None
    n_axis = len(kernel.shape) - 1
    n = f"i{n_axis}"
    f0, f1 = free_vars(body.srcs[0]), free_vars(body.srcs[1])
    if n in f0 and n not in f1:
        b, a = body.srcs
        fa, fb = f1, f0
    elif n in f1 and n not in f0:
        a, b = body.srcs
        fa, fb = f0, f1
    else:
        return None
    if any(reduces(x) for x in (a, b)) or r.var.name not in fa | fb:
        return None
    m_axis = None
    for k in reversed(range(n_axis)):
        if f"i{k}" in fa and f"i{k}" not in fb and as_int(kernel.shape[k]) != 1:
            m_axis = k
            break
    return Contraction(r, a, b, m_axis, n_axis)


def transposed(c: Contraction) -> Contraction | None:
    """c with its rows and columns swapped (out[m, n] = sum_k b a), so that a register block's
    vectors run along the rows: a product with few columns and many rows (a convolution over a few
    pixels) fills its vectors that way. None for a product without rows."""
    if c.m_axis is None:
        return None
    return Contraction(c.reduce, c.b, c.a, c.n_axis, c.m_axis)


def oriented(kernel: Kernel) -> Contraction | None:
    """The contraction as kernel's schedule runs it (`Schedule.transposed`)."""
    c = as_contraction(kernel)
    if c is not None and getattr(kernel.schedule, "transposed", False):
        return transposed(c) or c
    return c


@dataclass(frozen=True)
class Attention:
    """A softmax along a reduce axis contracted with values along the same axis, in one kernel:
    out = sum_j exp(x_j - max x) * v_j / sum_j exp(x_j - max x) (0 for a row of -inf when safe).
    x is the score at var (any elementwise function of one contraction and loads: scale, mask,
    bias, soft-capping); v the value at var, read along the kernel's last axis; score the
    contraction inside x (None when x only loads). Built by `attention_body`, recognised by
    `as_attention`: the form a backend runs in one pass over the keys (online softmax)."""

    x: KExpr
    v: KExpr
    var: Var
    size: int
    score: Reduce | None
    safe: bool
    scale: float = LOG2E


def attention_body(x: KExpr, v: KExpr, var: Var, size: sint, safe: bool, names: tuple[str, str]) -> KExpr:
    """The kernel body of an Attention: x and v read at var (0..size-1); names: the variables of the
    row sum and the weighted sum (the max runs over var itself)."""
    dt = x.dtype
    m = Reduce("max_reduce", size, var, x, dt)

    def at(e: KExpr, name: str) -> KExpr:
        to = index_var(name, size)  # the max inside e stays over var
        return rewrite(e, {m: m}, index=lambda i: map_vars(i, lambda w: to if w.name == var.name else w))

    shifted = Op("add", (x, Op("neg", (m,), dt)), dt)
    e = Op("exp2", (Op("mul", (shifted, Const(LOG2E, dt)), dt),), dt)
    total = Reduce("sum", size, index_var(names[0], size), at(e, names[0]), dt)
    term = Op("mul", (at(e, names[1]), at(v, names[1])), dt)
    weighted = Reduce("sum", size, index_var(names[1], size), term, dt)
    out = Op("mul", (weighted, Op("recip", (total,), dt)), dt)
    if not safe:
        return out
    # a row of -inf throughout (max -inf: not above -inf, below +inf) gives 0, as a safe softmax does
    below = lambda a, b: Op("lt", (a, b), DType.bool)
    dead = Op("where", (below(Const(-math.inf, dt), m), Const(False, DType.bool),
                        below(m, Const(math.inf, dt))), DType.bool)
    return Op("where", (dead, Const(0.0, dt), out), dt)


def as_attention(kernel: Kernel) -> Attention | None:
    """The Attention kernel.body is, as attention_body builds it; None for any other body."""
    body, safe = kernel.body, False
    if isinstance(body, Op) and body.op == "where" and isinstance(body.srcs[2], Op):
        body, safe = body.srcs[2], True
    if not (isinstance(body, Op) and body.op == "mul" and isinstance(body.srcs[0], Reduce)
            and isinstance(body.srcs[1], Op) and body.srcs[1].op == "recip"):
        return None
    weighted, total = body.srcs[0], body.srcs[1].srcs[0]
    if not (isinstance(weighted.body, Op) and weighted.body.op == "mul" and isinstance(total, Reduce)):
        return None
    e, v = weighted.body.srcs
    shift = e.srcs[0].srcs[0] if isinstance(e, Op) and e.op == "exp2" and isinstance(e.srcs[0], Op) else None
    if not (isinstance(shift, Op) and shift.op == "add" and isinstance(shift.srcs[1], Op)
            and isinstance(shift.srcs[1].srcs[0], Reduce)):
        return None
    m = shift.srcs[1].srcs[0]
    name = weighted.var.name
    back = lambda e: rewrite(e, index=lambda i: map_vars(i, lambda w: m.var if w.name == name else w))
    x, v = back(shift.srcs[0]), back(v)
    candidate = attention_body(x, v, m.var, m.size, safe, (total.var.name, weighted.var.name))
    if candidate != kernel.body or kernel.shape[-1:] and f"i{len(kernel.shape) - 1}" in free_vars(x):
        return None
    inner = reduces(x)
    if len(inner) > 1 or (inner and inner[0].op != "sum"):
        return None
    return Attention(x, v, m.var, m.size, inner[0] if inner else None, safe)


# --- estimates --------------------------------------------------------------------------------

def _runs(kernel: Kernel) -> Callable[[KExpr], int]:
    """How often a node of kernel runs: once per value of its free variables, which is exactly
    what hoisting achieves."""
    sizes = {f"i{k}": upper(n) for k, n in enumerate(kernel.shape)}  # run-time sizes at their bound
    sizes.update({r.var.name: upper(r.size) for r in reduces(kernel.body)})
    memo: dict = {}
    # a run-time size is a free variable that is read, not looped over
    return lambda x: math.prod(sizes.get(v, 1) for v in free_vars(x, memo))


def flops(kernel: Kernel) -> int:
    """Scalar operations per run. An Attention counts as its backends run it, in one pass over the
    keys: each score and its exponential once per query row, then the value row it weights."""
    att = as_attention(kernel)
    if att is not None:
        *rows, dv = (upper(n) for n in kernel.shape)
        size = upper(att.size)
        last = Var(f"i{len(rows)}", 0, size - 1)
        scores = rewrite(att.x, index=lambda i: map_vars(i, lambda w: last if w.name == att.var.name else w))
        per_key = OP_COST["exp2"] + 4 + 2 * dv  # the shifted exponential, the running sum, the values
        scored = flops(Kernel(kernel.name, kernel.out, (*rows, size), scores))
        return scored + math.prod(rows) * size * per_key
    runs = _runs(kernel)
    total = 0
    for x in walk(kernel.body):
        if isinstance(x, Op):
            total += OP_COST.get(x.op, 1) * runs(x)
        elif isinstance(x, Reduce):
            total += upper(x.size) * runs(x)
    return total


def bytes_moved(kernel: Kernel, buffers: dict[str, Buffer]) -> int:
    """Bytes of every distinct buffer read once plus the output written. A table read only by
    gathers counts no more than the values they fetch: an embedding row, not the vocabulary."""
    runs = _runs(kernel)
    fetched: dict[str, int | None] = {}  # buffer -> values gathered, None when read whole
    for x in loads(kernel.body):
        gathered = fetched.get(x.buffer, 0)
        fetched[x.buffer] = gathered + runs(x) if isinstance(x, Gather) and gathered is not None else None
    total = buffers[kernel.out].nbytes
    for name, values in fetched.items():
        buf = buffers[name]
        row = buf.nbytes // max(buf.numel, 1)
        total += buf.stored_bytes if values is None else min(buf.nbytes, values * row)
    return total
