"""Extraction of K candidate programs from a frozen e-graph.

The e-graph is read once (`read_egraph`), every e-class gets its shape and dtype, and
every e-node a cost: a roofline time on a `Roofline` (peak FLOP/s, bandwidth, launch), so a
product's cost sees its FLOPs and the bytes it moves, a kernel boundary its launch, and the
order of a matmul chain or a merge of products shows in the cost. Values no input reaches
cost nothing where eclat.rewrites.fold computes them at compile time (`folds`: by fold.py's own
size bound), and neither do the values only a folded one reads; a computed operand of a product
pays for the buffer grouping makes of it. `extract` is a greedy DAG extraction: the
cost of choosing a node is its own cost plus the union of its children's chosen sub-DAGs, so
a value used twice is paid once. That is only true of a value materialised in a buffer:
`dag_cost`, the cost a whole program is ranked by, charges an elementwise value once per
kernel that evaluates it (a backend recomputes what is fused into several kernels).

`candidates` forces, one at a time, the plausible other choices of the greedy program's
classes and keeps what dag_cost ranks best (which also repairs the greedy's blindness to
sharing), then materialises recomputed values; programs that differ only in the order of
commutative operands count as one. `differences` says in a few words what each candidate
does differently from the first.
"""
from __future__ import annotations

import math
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import egglog.bindings as eb
import numpy as np

from ..ir.dtypes import DType
from ..ir.graph import Node
from ..ir.symbolic import Expr, as_int
from ..ir.view import View
from .fold import EVAL_LIMIT, worth_storing
from .lang import CTORS, SAME_SHAPE

# per-element work of the ops that are not products, in peak-FLOP equivalents: a product
# runs at the FMA peak, an elementwise op or a reduction step reaches a fraction of it
OP_FLOPS = 4.0
LOAD_FLOPS = 0.5  # per element and operand read (not a constant) by an elementwise op or a norm
# per output of a product, in multiply-adds: loading, storing and packing around its register
# tile; a shallow product runs below the FMA peak (measured on AVX-512: 91 GFLOP/s at a depth of
# 16, 125 at 32, 181 at 512), which decides Winograd (a depth of the input channels) against a
# direct convolution (nine times as deep) for few channels
ACCUMULATOR_FLOPS = 16.0
TRANSCENDENTAL_FLOPS = 20.0
# a product's output past the cache goes to memory, each line read before it is written
# (write-allocate): twice its bytes. Measured on an AVX-512 Xeon, a Winograd product of 32 input
# channels writing 22 MB took 2-3x its estimate, where a direct convolution of the same layer ran
# in 0.9x the Winograd program's time
CACHE_BYTES = 2.0 * 2**20
FUSED_REDUCTIONS = {"Softmax": 6.0, "RmsNorm": 3.0, "LayerNorm": 6.0}  # one kernel, ops per element
# Winograd's transforms (rewrites.winograd): one kernel each, terms summed per output element,
# and the attribute of the convolution that gives the output's shape
TRANSFORMS = {"WinogradIn": (4.0, "v_shape"), "WinogradOut": (9.0, "y_shape")}
TRANSCENDENTAL = {"Exp2", "Log2", "Sin", "Sqrt", "Recip", "Rsqrt", "Div"}
SYMBOLIC_HINT = 64  # size assumed for a symbolic dimension when estimating
COPY = 1e12  # a runtime copy of a buffer that already exists
# nodes computed once in a kernel of their own, whose result is a buffer; all others are fused
# into (and recomputed by) every kernel that reads them
BOUNDARY = {"Contiguous", "Sum", "MaxReduce", "Matmul", "Softmax", "RmsNorm", "LayerNorm", "Attend",
            *TRANSFORMS}
COMMUTATIVE = {"Add", "Mul", "Max"}
ELEMENTWISE = set(SAME_SHAPE) - set(FUSED_REDUCTIONS)
QUIET = {"View", "Leaf", "Fill", "Contiguous"}  # not named in the op counts of `describe`


@dataclass
class EGraphData:
    nodes: list[tuple]            # (ctor, *args) with T args as class ids
    node_class: list[int]
    children: list[list[int]]
    roots: list[int]
    info: dict[int, tuple[tuple, DType]]  # class -> (shape, dtype)
    folded: set[int] = field(default_factory=set)  # nodes fold.py computes at compile time (`folds`)
    rereads: dict[int, float] = field(default_factory=dict)  # View node -> reads per element (> 1)


def read_egraph(egraph: eb.EGraph, attrs: list) -> EGraphData:
    frozen = egraph.freeze()
    ids: dict = {}
    cls = lambda v: ids.setdefault(v, len(ids))
    nodes, node_class, children, roots = [], [], [], {}
    for name, fn in frozen.functions.items():
        if name == "Out":
            for row in fn.rows:
                roots[egraph.value_to_i64(row.inputs[0])] = cls(row.inputs[1])
        if name not in CTORS:
            continue
        kinds = CTORS[name][1]
        for row in fn.rows:
            if row.subsumed:
                continue
            args = [cls(v) if k == "T" else egraph.value_to_f64(v) if k == "f64" else egraph.value_to_i64(v)
                    for k, v in zip(kinds, row.inputs)]
            nodes.append((name, *args))
            node_class.append(cls(row.output))
            children.append([a for k, a in zip(kinds, args) if k == "T"])
    data = EGraphData(nodes, node_class, children, [roots[i] for i in range(len(roots))], {})
    _infer_types(data, attrs)
    data.folded = folds(data, attrs)
    data.rereads = {n: f for n, node in enumerate(nodes) if node[0] == "View"
                    for f in [attrs[node[2]].overlap()] if f > 1.0}
    return data


def _infer_types(data: EGraphData, attrs: list) -> None:
    """Shape and dtype of every class reachable from leaves, by a worklist over users."""
    users = _users(data)
    work = deque(n for n, kids in enumerate(data.children) if not kids)
    while work:
        n = work.popleft()
        c = data.node_class[n]
        if c in data.info or any(k not in data.info for k in data.children[n]):
            continue
        data.info[c] = _type_of(data.nodes[n], [data.info[k] for k in data.children[n]], attrs)
        work.extend(users.get(c, ()))


def _users(data: EGraphData) -> dict[int, list[int]]:
    users: dict[int, list[int]] = {}
    for n, kids in enumerate(data.children):
        for k in set(kids):
            users.setdefault(k, []).append(n)
    return users


def _type_of(node: tuple, kids: list, attrs: list) -> tuple[tuple, DType]:
    ctor, *args = node
    if ctor == "Leaf":
        leaf: Node = attrs[args[0]]
        return tuple(leaf.shape), leaf.dtype
    if ctor == "Fill":
        return attrs[args[2]], attrs[args[1]]
    if ctor.startswith("Op"):
        _, _, shape, dtype = attrs[args[0]]
        return shape, dtype
    shape, dtype = kids[0]
    if ctor == "View":
        return tuple(attrs[args[1]].shape), dtype
    if ctor == "Cast":
        return shape, attrs[args[1]]
    if ctor == "Lt":
        return shape, DType.bool
    if ctor == "Where":
        return shape, kids[1][1]
    if ctor in ("Sum", "MaxReduce"):
        return shape[:args[1]] + shape[args[1] + 1:], dtype
    if ctor == "Gather":
        return kids[1][0] + shape[1:], dtype
    if ctor == "Matmul":
        return shape[:-1] + kids[1][0][-1:], dtype
    if ctor == "Attend":
        return tuple(attrs[args[3]].shape[:-1]) + kids[1][0][-1:], dtype
    if ctor in TRANSFORMS:
        return getattr(attrs[args[1]], TRANSFORMS[ctor][1]), dtype
    return shape, dtype


def folds(data: EGraphData, attrs: list) -> set[int]:
    """The nodes eclat.rewrites.fold would compute at compile time were they extracted: weight-only,
    not a leaf nor a view of one, and storing (broadcast axes once) no more than `fold.worth_storing`
    allows for the weights they read. Per class, the bytes of weights read and the values stored are
    the least any of its weight-only nodes needs (a lower bound for the stored values of elementwise ops)."""
    const = _constant_classes(data, attrs)
    reads: dict[int, float] = {}   # const class -> bytes of the weights it reads
    stored: dict[int, float] = {}  # const class -> elements it stores

    def own(n: int) -> tuple[float, float] | None:
        node, kids = data.nodes[n], data.children[n]
        c = data.node_class[n]
        if c not in data.info or any(k not in reads for k in kids):
            return None
        shape, dtype = data.info[c]
        size = numel(shape)
        if node[0] == "Leaf":
            weight = attrs[node[1]].op == "weight"
            return (size * dtype.itemsize if weight else 0.0), float(size)
        if node[0] == "Fill":
            return 0.0, 1.0
        # a view or an elementwise op repeats where its operands do (at most its widest one's values)
        spread = node[0] == "View" or node[0] in ELEMENTWISE
        distinct = max(stored[k] for k in kids) if spread else size
        if node[0] == "Matmul":  # distinct rows of a times distinct columns of b (a broadcast row: one)
            depth = numel(data.info[kids[0]][0][-1:])
            distinct = max(1.0, stored[kids[0]] / depth) * max(1.0, stored[kids[1]] / depth)
        return sum(reads[k] for k in set(kids)), min(float(size), distinct)

    users = _users(data)
    work = deque(n for n, kids in enumerate(data.children) if data.node_class[n] in const and not kids)
    while work:  # least fixpoint over the classes' weight-only nodes
        n = work.popleft()
        c = data.node_class[n]
        got = own(n)
        if got is None or (c in reads and got[0] >= reads[c] and got[1] >= stored[c]):
            continue
        reads[c], stored[c] = min(got[0], reads.get(c, math.inf)), min(got[1], stored.get(c, math.inf))
        work.extend(u for u in users.get(c, ()) if data.node_class[u] in const)
    leaves = {c for node, c in zip(data.nodes, data.node_class) if node[0] == "Leaf"}
    out = set()
    for n, (node, c, kids) in enumerate(zip(data.nodes, data.node_class, data.children)):
        if node[0] in ("Leaf", "Fill") or not kids:
            continue
        if node[0] == "View" and kids[0] in leaves:
            continue  # a layout of a weight: made at compile time, but not a fold (layout.py)
        got = own(n)  # None unless n is weight-only and typed
        if got is None:
            continue
        shape, dtype = data.info[c]
        if all(as_int(d) is not None for d in shape) and numel(shape) <= EVAL_LIMIT \
                and worth_storing(got[1] * dtype.itemsize, got[0]):
            out.add(n)
    return out


def numel(shape: tuple) -> int:
    return math.prod(as_int(d) if as_int(d) is not None else SYMBOLIC_HINT for d in shape)


@dataclass(frozen=True)
class Roofline:
    """The machine costs are estimated for: peak FLOP/s (FMA), memory bandwidth (bytes/s) and the
    fixed cost of a kernel. Defaults: a 2-core AVX2 CPU (this project's measured host: 100-150
    GFLOP/s, 18-20 GB/s). A driver may pass a measured device's: Roofline(gflops * 1e9, gbps * 1e9,
    launch_us * 1e-6)."""
    flops: float = 1e11
    bandwidth: float = 2e10
    launch: float = 1e-6
    # the target's products read an im2col's windows in place (the CPU packs each panel of patches
    # from the input as it goes): the patches are never written to memory and read back, only
    # gathered once (measured on an AVX-512 Xeon: 1x to 3x the memory bandwidth per byte of patches)
    windows_in_place: bool = False

    def time(self, flops: float, nbytes: float, kernel: bool = True) -> float:
        """Nanoseconds: max(compute, memory) plus a launch where the node is a kernel of its own."""
        return 1e9 * (max(flops / self.flops, nbytes / self.bandwidth) + (self.launch if kernel else 0.0))


CPU = Roofline()


def node_cost(node: tuple, out: tuple, kids: list, attrs: list, roof: Roofline = CPU) -> float:
    """Estimated time of one e-node in nanoseconds, on roof. A kernel (a BOUNDARY node) pays its
    launch and the larger of its FLOPs and the bytes it reads and writes; a node fused into a kernel
    pays its FLOPs (its operands and result stay in registers)."""
    ctor = node[0]
    n = numel(out[0])
    size = out[1].itemsize

    def nbytes(*shapes: tuple) -> float:
        return float(size * sum(numel(s) for s in shapes))

    if ctor in ("Leaf", "Fill"):
        return 0.0
    if ctor == "View":
        v: View = attrs[node[2]]
        last = v.strides[-1] if v.strides else 1
        strided = isinstance(last, Expr) or last not in (0, 1)
        return roof.time(0.0, nbytes(out[0]), kernel=False) if strided else 0.0  # wasted cache lines
    if ctor == "Contiguous":
        return roof.time(0.0, 2 * nbytes(out[0]))
    if ctor in ("Sum", "MaxReduce"):
        return roof.time(OP_FLOPS * numel(kids[0][0]), nbytes(kids[0][0], out[0]))
    if ctor == "Matmul":  # 2 M K N per batch, and each output's accumulator kept (ACCUMULATOR_FLOPS)
        depth = numel(kids[0][0][-1:])
        written = nbytes(out[0]) * (2 if nbytes(out[0]) > CACHE_BYTES else 1)
        return roof.time(2.0 * n * (depth + ACCUMULATOR_FLOPS), nbytes(kids[0][0], kids[1][0]) + written)
    if ctor == "Attend":  # the softmax and the product with v in one pass, the probabilities never stored
        scores = numel(kids[0][0])
        flops = 2.0 * scores * numel(kids[1][0][-1:])
        return roof.time(flops + OP_FLOPS * FUSED_REDUCTIONS["Softmax"] * scores, nbytes(kids[1][0], out[0]))
    if ctor in TRANSFORMS:
        return roof.time(OP_FLOPS * TRANSFORMS[ctor][0] * n, nbytes(kids[0][0], out[0]))
    if ctor in FUSED_REDUCTIONS:  # one pass: its output stands for the input its readers would read
        return roof.time(OP_FLOPS * FUSED_REDUCTIONS[ctor] * n, nbytes(out[0]))
    if ctor in TRANSCENDENTAL:
        return roof.time(TRANSCENDENTAL_FLOPS * n, 0.0, kernel=False)
    return roof.time(OP_FLOPS * n, 0.0, kernel=False)


def costs(data: EGraphData, attrs: list, copy_leaves: bool = False, roof: Roofline = CPU) -> list[float]:
    """Per-node costs; inf where a node cannot be typed. Copying a buffer that already exists
    (a leaf, or a value only computed by a kernel of its own) is never worth it (a layout is
    made at compile time): unless copy_leaves, it costs COPY, chosen only where the input
    program leaves no other way."""
    fused = {c for node, c in zip(data.nodes, data.node_class) if node[0] not in BOUNDARY}
    leaves = set() if copy_leaves else {c for node, c in zip(data.nodes, data.node_class)
                                        if node[0] in ("Leaf", "Fill") or c not in fused}
    # a weight read through a view is a compile-time constant too (layout makes such arrays)
    leaves |= {c for node, c, kids in zip(data.nodes, data.node_class, data.children)
               if not copy_leaves and node[0] == "View" and kids[0] in leaves}
    # an im2col (a copy of overlapping windows) is a new buffer, not a copy of one that exists
    windows = {data.node_class[n] for n in data.rereads}
    operands = _product_operands(data)
    fills = {c for node, c in zip(data.nodes, data.node_class) if node[0] == "Fill"}
    loaded = ELEMENTWISE | set(FUSED_REDUCTIONS)

    def one(n: int, node: tuple, c: int, kids: list[int]) -> float:
        if c not in data.info or any(k not in data.info for k in kids):
            return math.inf
        if node[0] == "Contiguous":
            if kids[0] in windows and roof.windows_in_place:
                return roof.time(0.0, numel(data.info[c][0]) * data.info[c][1].itemsize)
            copy = kids[0] in leaves and kids[0] not in windows
            return node_cost(node, data.info[c], [], attrs, roof) + (COPY if copy else 0.0)
        if n in data.folded:
            return 0.0
        shapes = [data.info[k] for k in kids]
        own = node_cost(node, data.info[c], shapes, attrs, roof)
        if node[0] in loaded:  # an FMA reading a scale and a shift costs more than an add reading one
            reads = sum(1 for k in kids if k not in fills)
            own += roof.time(LOAD_FLOPS * reads * numel(data.info[c][0]), 0.0, kernel=False)
        if c in operands and node[0] not in BOUNDARY and node[0] not in QUIET:
            # grouping materialises a computed operand of a product (else every tile recomputes it)
            own += node_cost(("Contiguous",), data.info[c], [], attrs, roof)
        return own

    return [one(n, node, c, kids)
            for n, (node, c, kids) in enumerate(zip(data.nodes, data.node_class, data.children))]


def _product_operands(data: EGraphData) -> set[int]:
    """Classes a Matmul reads, or an Attend as its values, directly or through a view (an Attend's
    scores are computed in its kernel)."""
    direct = {k for node, kids in zip(data.nodes, data.children) if node[0] in ("Matmul", "Attend")
              for k in (kids if node[0] == "Matmul" else kids[1:])}
    return direct | {kids[0] for node, c, kids in zip(data.nodes, data.node_class, data.children)
                     if node[0] == "View" and c in direct}


def _constant_classes(data: EGraphData, attrs: list) -> set[int]:
    """Classes that no input reaches: weights, constants and what is computed from them only."""
    users = _users(data)
    pending = [len(set(kids)) for kids in data.children]
    work = deque(n for n, node in enumerate(data.nodes)
                 if node[0] == "Fill" or node[0] == "Leaf" and attrs[node[1]].op != "input")
    const: set[int] = set()
    while work:
        c = data.node_class[work.popleft()]
        if c in const:
            continue
        const.add(c)
        for u in users.get(c, ()):
            pending[u] -= 1
            if pending[u] == 0:
                work.append(u)
    return const


def extract(data: EGraphData, cost: list[float], max_visits: int = 4,
            users: dict[int, list[int]] | None = None, totals: dict[int, float] | None = None
            ) -> dict[int, int]:
    """Greedy DAG extraction: class -> chosen node. Sub-DAGs are bitsets of classes (Python
    ints); a worklist revisits the users of a class whenever its choice improves. A folded node
    (computed at compile time) pays for nothing below it; what it reads still counts in the
    classes it reaches, which keep a choice acyclic. totals, when given, receives each class's
    sub-DAG cost."""
    users = _users(data) if users is None else users
    best: dict[int, int] = {}
    best_cost: dict[int, float] = {} if totals is None else totals
    sets: dict[int, int] = {}   # the classes a class's choice pays for
    reach: dict[int, int] = {}  # the classes it reads, folded or not
    own = np.zeros(max(data.node_class, default=-1) + 1)  # the cost of each class's chosen node alone
    visits = [0] * len(data.nodes)
    work = deque(n for n, kids in enumerate(data.children) if not kids)
    while work:
        n = work.popleft()
        c, kids = data.node_class[n], data.children[n]
        if cost[n] == math.inf or visits[n] >= max_visits or any(k not in sets for k in kids):
            continue
        visits[n] += 1
        total, union, seen = cost[n], 0, 0
        for k in kids:
            seen |= reach[k]
        if seen >> c & 1:
            continue  # a cycle through this class
        if kids and n not in data.folded:
            # the largest child sub-DAG is paid as a whole; the others only for what they add
            big = max(kids, key=lambda k: best_cost[k])
            union = sets[big]
            extra = 0
            for k in kids:
                extra |= sets[k]
            extra &= ~union
            union |= extra
            total = _paid(extra, own, total + best_cost[big])
        if total < best_cost.get(c, math.inf) - 1e-9:
            best[c], best_cost[c], sets[c], reach[c] = n, total, union | (1 << c), seen | (1 << c)
            own[c] = cost[n]
            work.extend(users.get(c, ()))
    return best


def _paid(classes: int, own: np.ndarray, total: float) -> float:
    """total plus own's sum over a set of classes (bits): bit by bit for a few, by numpy for many
    (where two operands' sub-DAGs differ by thousands of classes, as a recurrence's steps do)."""
    if classes.bit_count() <= 32:
        while classes:
            low = classes & -classes
            total += float(own[low.bit_length() - 1])
            classes ^= low
        return total
    raw = np.frombuffer(classes.to_bytes((classes.bit_length() + 7) // 8, "little"), np.uint8)
    return total + float(own[np.flatnonzero(np.unpackbits(raw, bitorder="little"))].sum())


def reachable(data: EGraphData, best: dict[int, int]) -> dict[int, int] | None:
    """The chosen node of every class the roots reach, or None if the choice is cyclic."""
    out: dict[int, int] = {}
    state: dict[int, int] = {}  # 1 visiting, 2 done
    stack = [(r, False) for r in data.roots]
    while stack:
        c, done = stack.pop()
        if done:
            state[c] = 2
            continue
        if state.get(c) == 2:
            continue
        if state.get(c) == 1 or c not in best:
            return None
        state[c] = 1
        out[c] = best[c]
        stack.append((c, True))
        stack.extend((k, False) for k in data.children[best[c]] if state.get(k) != 2)
    return out


def _order(data: EGraphData, choice: dict[int, int]) -> list[int]:
    """The chosen classes computed at run time, users before their operands (what only a folded
    node reads is not)."""
    out, seen = [], set()
    stack = [(r, False) for r in data.roots]
    while stack:
        c, done = stack.pop()
        if done:
            out.append(c)
        elif c not in seen:
            seen.add(c)
            stack.append((c, True))
            if choice[c] not in data.folded:
                stack.extend((k, False) for k in data.children[choice[c]])
    return out[::-1]


def evaluations(data: EGraphData, choice: dict[int, int]) -> dict[int, float]:
    """How often each chosen class is computed, per element: 1 for a boundary or an output; for a
    fused value the number of distinct kernels that reach it through fused users, times how often
    a kernel reads each element (a view reading overlapping windows, such as a 3x3 im2col, reads
    each 9 times: an activation fused into it is computed 9 times); 0 for what only a folded value
    reads."""
    kernels: dict[int, int] = {}  # class -> bitset of the kernels it is evaluated in
    reads: dict[int, float] = {}  # class -> evaluations per element within a kernel
    roots = set(data.roots)
    bit = {c: 1 << i for i, c in enumerate(choice)}
    order = _order(data, choice)
    for c in order:
        node = data.nodes[choice[c]]
        if node[0] in BOUNDARY or c in roots or not kernels.get(c):
            kernels[c] = bit[c]
        if node[0] in BOUNDARY or c in roots:
            reads[c] = 1.0
        if choice[c] not in data.folded:
            for k in data.children[choice[c]]:
                kernels[k] = kernels.get(k, 0) | kernels[c]
                again = reads.get(c, 1.0) * data.rereads.get(choice[c], 1.0)
                reads[k] = max(reads.get(k, 1.0), again)
    once = {c for c in order if data.nodes[choice[c]][0] in BOUNDARY or c in roots}
    return {c: 1.0 if c in once else bin(kernels[c]).count("1") * reads.get(c, 1.0) if c in kernels else 0.0
            for c in choice}


def dag_cost(data: EGraphData, cost: list[float], choice: dict[int, int]) -> float:
    """The program's cost: every chosen node once per kernel that evaluates it."""
    return sum(cost[choice[c]] * n for c, n in evaluations(data, choice).items())


def _signature(data: EGraphData, choice: dict[int, int]) -> frozenset:
    """The program up to the order of commutative operands."""
    def key(n: int) -> tuple:
        ctor, *args = data.nodes[n]
        return (ctor, *sorted(args)) if ctor in COMMUTATIVE else (ctor, *args)
    return frozenset((c, key(n)) for c, n in choice.items())


def _recomputed(data: EGraphData, cost: list[float], choice: dict[int, int],
                contiguous: dict[int, int]) -> list[int]:
    """Fused classes evaluated by several kernels that could be materialised, the most
    recomputed work first."""
    waste = {c: (n - 1) * cost[choice[c]] for c, n in evaluations(data, choice).items()
             if n > 1 and c in contiguous and cost[choice[c]] > 0 and cost[contiguous[c]] < COPY}
    return sorted(waste, key=lambda c: -waste[c])


def _alternatives(data: EGraphData, cost: list[float], first: dict[int, int], totals: dict[int, float],
                  factor: float) -> list[tuple[int, int]]:
    """(class, node): the other nodes of the first program's classes whose own cost plus their
    operands' best sub-DAGs is within factor of the chosen one's. Commutative swaps of the chosen
    node are left out (the same program). Ordered kind by kind (old and new constructor), each
    kind's closest first, so that a few tries cover different kinds of choice."""
    members: dict[int, list[int]] = {}
    for n, c in enumerate(data.node_class):
        if c in first:
            members.setdefault(c, []).append(n)
    run = _run_time(data, first)
    kinds: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
    for c, chosen in first.items():
        if c not in run:  # computed at compile time (or only for such a value): the same program
            continue
        base = max(totals.get(c, 0.0), 1e-3)
        same = _key(data, chosen)
        for n in members[c]:
            if n == chosen or cost[n] == math.inf or _key(data, n) == same \
                    or any(k not in totals for k in data.children[n]):
                continue
            est = cost[n] + sum(totals[k] for k in set(data.children[n]))
            if est <= factor * base:
                kinds.setdefault((data.nodes[chosen][0], data.nodes[n][0]), []).append((est / base, c, n))
    queues = sorted((sorted(q) for q in kinds.values()), key=lambda q: q[0][0])
    out = []
    for rank in range(max((len(q) for q in queues), default=0)):
        out += [(c, n) for q in queues if rank < len(q) for _, c, n in [q[rank]]]
    return out


def _substantial(data: EGraphData, n: int, m: int) -> bool:
    """Whether choosing node n for m's class changes more than an elementwise expression."""
    return not {data.nodes[n][0], data.nodes[m][0]} <= ELEMENTWISE


def _run_time(data: EGraphData, choice: dict[int, int]) -> set[int]:
    """The classes choice computes at run time (not folded at compile time, nor read only by
    what is)."""
    return {c for c in _order(data, choice) if choice[c] not in data.folded}


def _substance(data: EGraphData, choice: dict[int, int], ids: dict[tuple, int]) -> frozenset:
    """What a program runs, up to its elementwise expressions (Fma or Mul and Add) and the weights
    it reads (a BatchNorm's scale folded one way or another): the structure of its products,
    reductions, composites, views and kernel boundaries, each numbered by its structure, not its
    e-class (two classes may hold one product of two foldings of a weight). Candidates equal in
    substance time alike. ids: structure -> its number, shared by the programs compared."""
    order = _order(data, choice)
    run = {c for c in order if choice[c] not in data.folded}  # as _run_time
    key: dict[int, object] = {}  # class -> "w" (a weight), a frozenset (elementwise), or a number
    for c in reversed(order):
        n = choice[c]
        ctor = data.nodes[n][0]
        if c not in run or ctor in ("Leaf", "Fill"):
            key[c] = "w"
        elif ctor in ELEMENTWISE:  # the structures it combines, through any elementwise ops
            parts: set = set()
            for k in data.children[n]:
                parts |= key[k] if isinstance(key[k], frozenset) else {key[k]} - {"w"}
            key[c] = frozenset(parts)
        else:
            kinds = CTORS[ctor][1]
            shape = (ctor, *(key[a] if kind == "T" else a for kind, a in zip(kinds, data.nodes[n][1:])))
            key[c] = ids.setdefault(shape, len(ids))
    return frozenset(Counter(k for k in key.values() if isinstance(k, int)).items())


def _key(data: EGraphData, n: int) -> tuple:
    ctor, *args = data.nodes[n]
    return (ctor, *sorted(args)) if ctor in COMMUTATIVE else (ctor, *args)


def candidates(data: EGraphData, cost: list[float], k: int, seed: int = 0, spread: float = 0.8,
               deadline: Callable[[], bool] = lambda: False, factor: float = 4.0,
               tries: int | None = None) -> list[dict[int, int]]:
    """Up to k distinct extractions, cheapest (by dag_cost) first.

    After the greedy extraction, each plausible other choice of its classes (`_alternatives`:
    within factor of the greedy's estimate) is forced in turn, at most `tries` (3 k, at least 6) of
    them: its class may pick only that node, the rest is extracted again. A forced choice that
    lowers dag_cost stays forced for the following tries (the greedy misses sharing: it may pick a
    node whose operands are cheap alone where another's are computed anyway). Then the values the
    first program recomputes most are materialised; random penalties only fill up what is still
    missing."""
    rng = random.Random(seed)
    found: dict[frozenset, tuple[float, dict[int, int]]] = {}
    contiguous = {data.children[n][0]: n for n, node in enumerate(data.nodes) if node[0] == "Contiguous"}
    users = _users(data)
    by_class: dict[int, list[int]] = {}
    for n, c in enumerate(data.node_class):
        by_class.setdefault(c, []).append(n)

    def add(costs_used: list[float], visits: int, totals: dict | None = None) -> dict[int, int] | None:
        choice = reachable(data, extract(data, costs_used, visits, users, totals))
        if choice is not None:
            found.setdefault(_signature(data, choice), (dag_cost(data, cost, choice), choice))
        return choice

    def forcing(fixed: dict[int, int]) -> list[float]:
        out = list(cost)
        for c, n in fixed.items():
            for m in by_class[c]:
                if m != n:
                    out[m] = math.inf
        return out

    totals: dict[int, float] = {}
    first = add(cost, 4, totals)
    if first is None:
        return []
    fixed: dict[int, int] = {}
    best = dag_cost(data, cost, first)
    alternatives = _alternatives(data, cost, first, totals, factor)
    for c, n in alternatives[:3 * max(k, 2) if tries is None else tries]:
        if deadline():
            break
        choice = add(forcing({**fixed, c: n}), 4)
        if choice is not None and dag_cost(data, cost, choice) < best - 1e-9:
            fixed[c], best = n, dag_cost(data, cost, choice)
    # each kind of substantial choice taken everywhere at once (every 3x3 convolution direct
    # rather than Winograd): one flip at a time, a program of many layers barely differs
    kinds: dict[tuple[str, str], dict[int, int]] = {}
    for c, n in alternatives:
        if _substantial(data, n, first[c]):
            kinds.setdefault((data.nodes[first[c]][0], data.nodes[n][0]), {}).setdefault(c, n)
    for together in [group for group in kinds.values() if len(group) > 1][:k]:
        if deadline():
            break
        add(forcing({**fixed, **together}), 4)
    # materialise the values the first program recomputes most: one at a time, then together
    shared = _recomputed(data, cost, first, contiguous)[:max(1, k // 2)] if k > 1 else []
    for group in [[c] for c in shared] + ([shared] if len(shared) > 1 else []):
        if deadline():
            break
        forced = forcing(fixed)
        for c in group:
            forced[contiguous[c]] = -1.0
        add(forced, 4)
    for _ in range(4 * k):
        if len(found) >= k or deadline():
            break
        add([c * math.exp(rng.gauss(0.0, spread)) for c in forcing(fixed)], 2)
    # the cheapest program of each substance first: programs that differ only in elementwise
    # expressions would spend the search's timings on one program
    distinct, rest, seen, ids = [], [], set(), {}
    for _, choice in sorted(found.values(), key=lambda t: t[0]):
        sub = _substance(data, choice, ids)
        (rest if sub in seen else distinct).append(choice)
        seen.add(sub)
    return (distinct + rest)[:k]


def describe(data: EGraphData, first: dict[int, int], choice: dict[int, int], limit: int = 4) -> str:
    """What choice does differently from first, in a few words: the ops it has more or fewer of,
    then each class both compute with different nodes (the topmost differences), e.g.
    "+1 Exp2; -1 Matmul; Matmul order f32[4096,16]; materialised Exp2 f32[256,256]"."""
    def what(c: int, nodes: dict[int, int]) -> str:
        shape, dtype = data.info[c]
        n = nodes[c]
        if data.nodes[n][0] == "Contiguous":
            n = nodes[data.children[n][0]]
        return f"{data.nodes[n][0]} {dtype.short}[{','.join(str(d) for d in shape)}]"

    def boundary(c: int, nodes: dict[int, int]) -> bool:
        return data.nodes[nodes[c]][0] == "Contiguous"

    ops = Counter(data.nodes[n][0] for n in choice.values())
    ops.subtract(data.nodes[n][0] for n in first.values())
    parts = [f"{d:+d} {ctor}" for ctor, d in sorted(ops.items()) if d and ctor not in QUIET]
    places = set()
    for c, n in choice.items():
        m = first.get(c)
        if m is None or _key(data, m) == _key(data, n):
            continue
        old, new = data.nodes[m][0], data.nodes[n][0]
        moved = [k for k in data.children[n] if k not in data.children[m] and boundary(k, choice)]
        kept = [k for k in data.children[m] if k not in data.children[n] and boundary(k, first)]
        if new == "Contiguous" or old == "Contiguous" or moved or kept:
            places.update(f"materialised {what(k, choice)}" for k in ([c] if new == "Contiguous" else moved))
            places.update(f"fused {what(k, first)}" for k in ([c] if old == "Contiguous" else kept))
        elif {old, new} == {"Leaf", "View"}:
            places.add(f"weight layout {what(c, choice)}")
        elif old == new:
            places.add(f"{'Matmul order' if new == 'Matmul' else 'operands of'} {what(c, choice)}")
        elif old in QUIET or new in QUIET:
            places.add(f"{old} -> {new} {what(c, choice).split(' ', 1)[1]}")
    items = parts[:limit] + sorted(places)[:limit]
    more = len(parts) + len(places) - len(items)
    return "; ".join(items) + (f" and {more} more" if more > 0 else "") if items else "same program"


def differences(data: EGraphData, choices: list[dict[int, int]]) -> list[str]:
    """For each candidate, what it differs in from the first ("first" for the first)."""
    return ["first"] + [describe(data, choices[0], ch) for ch in choices[1:]]


# --- groups of classes taken together (horizontal merges) -----------------------------------------

def _merged(data: EGraphData, leaf: int, vb: int) -> set[int]:
    """The classes of the merged product Sum(Mul(View x vaJ, View (Leaf J) vbJ), r)."""
    def users(ctor: str, kids: set[int], attr: int | None = None) -> set[int]:
        return {c for node, c, ch in zip(data.nodes, data.node_class, data.children)
                if node[0] == ctor and kids & set(ch) and (attr is None or node[-1] == attr)}

    leaves = {c for node, c in zip(data.nodes, data.node_class) if node == ("Leaf", leaf)}
    return users("Sum", users("Mul", users("View", leaves, vb)))


def prefer(data: EGraphData, cost: list[float], groups: dict[int, tuple[int, set[int]]],
           choices: list[dict[int, int]], k: int) -> tuple[list[dict[int, int]], int]:
    """choices with, first, the extraction that takes every merge group lowering the program's
    cost, and how many groups it takes. Groups are tried one after another, each by leaving its
    members' classes no choice but their slice (a bonus would spread through every class above):
    in the best program so far, every other class kept as it is, and extracted afresh (where
    another class computes a member's product some other way)."""
    if not choices or not groups:
        return choices, 0
    by_class: dict[int, list[int]] = {}
    for n, c in enumerate(data.node_class):
        by_class.setdefault(c, []).append(n)
    best, best_cost = choices[0], dag_cost(data, cost, choices[0])
    members: dict[int, set[int]] = {}  # class -> its slices, of the groups taken
    every: list[dict[int, set[int]]] = []  # each group's slices by class
    for leaf, (vb, views) in groups.items():
        merged = _merged(data, leaf, vb)
        sliced: dict[int, set[int]] = {}
        for n, (node, kids) in enumerate(zip(data.nodes, data.children)):
            if node[0] == "View" and node[2] in views and kids[0] in merged and cost[n] < math.inf:
                sliced.setdefault(data.node_class[n], set()).add(n)
        every.append(sliced)
        # the best program with these members sliced, or only the members fixed
        for keep in ({c: {n} for c, n in best.items()}, members):
            forced = list(cost)
            for c, nodes in {**keep, **sliced}.items():
                for n in by_class[c]:
                    if n not in nodes:
                        forced[n] = math.inf
            choice = reachable(data, extract(data, forced))
            if choice is not None and dag_cost(data, cost, choice) < best_cost - 1e-9:
                best, best_cost = choice, dag_cost(data, cost, choice)
                members.update(sliced)
                break
    # the groups the program takes (the candidates' own search may have found some already)
    taken = sum(bool(sliced) and all(best.get(c) in nodes for c, nodes in sliced.items()) for sliced in every)
    if best is choices[0]:
        return choices, taken
    return [best, *(c for c in choices if c != best)][:k], taken
