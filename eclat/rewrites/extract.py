"""Extraction of K candidate programs from a frozen e-graph.

The e-graph is read once (`read_egraph`), every e-class gets its shape and dtype, and
every e-node a cost estimate. `extract` is a greedy DAG extraction: the cost of choosing
a node is its own cost plus the union of its children's chosen sub-DAGs, so a value used
twice is paid once. That is only true of a value materialised in a buffer: `dag_cost`, the
cost a whole program is ranked by, charges an elementwise value once per kernel that
evaluates it (a backend recomputes what is fused into several kernels). Further
candidates come from materialising the values recomputed most (their `Contiguous` made
attractive) and from re-running the extraction with per-node random penalties; programs
that differ only in the order of commutative operands count as one.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import egglog.bindings as eb

from ..ir.dtypes import DType
from ..ir.graph import Node
from ..ir.symbolic import Expr, as_int
from ..ir.view import View
from .lang import CTORS

LAUNCH = 2000.0  # a kernel boundary, in units of one elementwise op
FUSED_REDUCTIONS = {"Softmax": 6.0, "RmsNorm": 3.0, "LayerNorm": 6.0}  # one kernel, per-element work
TRANSCENDENTAL = {"Exp2", "Log2", "Sin", "Sqrt", "Recip", "Rsqrt"}
SYMBOLIC_HINT = 64  # size assumed for a symbolic dimension when estimating
COPY = 1e12  # a runtime copy of a buffer that already exists
# nodes computed once in a kernel of their own, whose result is a buffer; all others are fused
# into (and recomputed by) every kernel that reads them
BOUNDARY = {"Contiguous", "Sum", "MaxReduce", "Matmul", "Softmax", "RmsNorm", "LayerNorm", "Attention"}
COMMUTATIVE = {"Add", "Mul", "Max"}


@dataclass
class EGraphData:
    nodes: list[tuple]            # (ctor, *args) with T args as class ids
    node_class: list[int]
    children: list[list[int]]
    roots: list[int]
    info: dict[int, tuple[tuple, DType]]  # class -> (shape, dtype)


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
    if ctor == "Attention":
        return tuple(attrs[args[7]].shape[:-1]) + kids[2][0][-1:], dtype
    return shape, dtype


def numel(shape: tuple) -> int:
    return math.prod(as_int(d) if as_int(d) is not None else SYMBOLIC_HINT for d in shape)


def node_cost(node: tuple, out: tuple, kids: list, attrs: list) -> float:
    """Estimated time of one e-node, in elementwise-op units."""
    ctor = node[0]
    n = numel(out[0])
    if ctor in ("Leaf", "Fill"):
        return 0.0
    if ctor == "View":
        v: View = attrs[node[2]]
        last = v.strides[-1] if v.strides else 1
        strided = isinstance(last, Expr) or last not in (0, 1)
        return 0.5 * n if strided else 0.0  # a strided innermost read wastes cache lines
    if ctor == "Contiguous":
        return LAUNCH + 2.0 * n
    if ctor in ("Sum", "MaxReduce"):
        return LAUNCH + numel(kids[0][0])
    if ctor == "Matmul":
        return LAUNCH + 0.25 * numel(kids[0][0]) * numel(kids[1][0][-1:])
    if ctor == "Attention":  # both products and the softmax in one kernel
        scores = numel(kids[3][0])
        return LAUNCH + 0.25 * scores * (numel(kids[0][0][-1:]) + numel(kids[2][0][-1:])) \
            + FUSED_REDUCTIONS["Softmax"] * scores
    if ctor in FUSED_REDUCTIONS:
        return LAUNCH + FUSED_REDUCTIONS[ctor] * n
    if ctor in TRANSCENDENTAL:
        return 4.0 * n
    return float(n)


def costs(data: EGraphData, attrs: list, copy_leaves: bool = False) -> list[float]:
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
    return [node_cost(node, data.info[c], [data.info[k] for k in kids], attrs)
            + (COPY if node[0] == "Contiguous" and kids[0] in leaves else 0.0)
            if c in data.info and all(k in data.info for k in kids) else math.inf
            for node, c, kids in zip(data.nodes, data.node_class, data.children)]


def extract(data: EGraphData, cost: list[float], max_visits: int = 4,
            users: dict[int, list[int]] | None = None) -> dict[int, int]:
    """Greedy DAG extraction: class -> chosen node. Sub-DAGs are bitsets of classes (Python
    ints); a worklist revisits the users of a class whenever its choice improves."""
    users = _users(data) if users is None else users
    best: dict[int, int] = {}
    best_cost: dict[int, float] = {}
    sets: dict[int, int] = {}
    visits = [0] * len(data.nodes)
    work = deque(n for n, kids in enumerate(data.children) if not kids)
    while work:
        n = work.popleft()
        c, kids = data.node_class[n], data.children[n]
        if cost[n] == math.inf or visits[n] >= max_visits or any(k not in sets for k in kids):
            continue
        visits[n] += 1
        total, union = cost[n], 0
        if kids:
            # the largest child sub-DAG is paid as a whole; the others only for what they add
            big = max(kids, key=lambda k: best_cost[k])
            union = sets[big]
            extra = 0
            for k in kids:
                extra |= sets[k]
            extra &= ~union
            union |= extra
            total += best_cost[big]
            while extra:
                low = extra & -extra
                total += cost[best[low.bit_length() - 1]]
                extra ^= low
        if union >> c & 1:
            continue  # a cycle through this class
        if total < best_cost.get(c, math.inf) - 1e-9:
            best[c], best_cost[c], sets[c] = n, total, union | (1 << c)
            work.extend(users.get(c, ()))
    return best


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
    """The chosen classes, users before their operands."""
    out, seen = [], set()
    stack = [(r, False) for r in data.roots]
    while stack:
        c, done = stack.pop()
        if done:
            out.append(c)
        elif c not in seen:
            seen.add(c)
            stack.append((c, True))
            stack.extend((k, False) for k in data.children[choice[c]])
    return out[::-1]


def evaluations(data: EGraphData, choice: dict[int, int]) -> dict[int, int]:
    """How many kernels evaluate each chosen class: 1 for a boundary or an output, for a fused
    value the number of distinct kernels that reach it through fused users."""
    kernels: dict[int, int] = {}  # class -> bitset of the kernels it is evaluated in
    roots = set(data.roots)
    bit = {c: 1 << i for i, c in enumerate(choice)}
    for c in _order(data, choice):
        node = data.nodes[choice[c]]
        if node[0] in BOUNDARY or c in roots or not kernels.get(c):
            kernels[c] = bit[c]
        for k in data.children[choice[c]]:
            kernels[k] = kernels.get(k, 0) | kernels[c]
    return {c: 1 if data.nodes[choice[c]][0] in BOUNDARY or c in roots else bin(kernels[c]).count("1")
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


def candidates(data: EGraphData, cost: list[float], k: int, seed: int = 0,
               spread: float = 0.8, deadline: Callable[[], bool] = lambda: False) -> list[dict[int, int]]:
    """Up to k distinct extractions, cheapest (by dag_cost) first."""
    rng = random.Random(seed)
    found: dict[frozenset, tuple[float, dict[int, int]]] = {}
    contiguous = {data.children[n][0]: n for n, node in enumerate(data.nodes) if node[0] == "Contiguous"}
    users = _users(data)

    def add(costs_used: list[float], visits: int) -> dict[int, int] | None:
        choice = reachable(data, extract(data, costs_used, visits, users))
        if choice is not None:
            found.setdefault(_signature(data, choice), (dag_cost(data, cost, choice), choice))
        return choice

    first = add(cost, 4)
    if first is not None and k > 1:
        # materialise the values the first program recomputes most: one at a time, then together
        shared = _recomputed(data, cost, first, contiguous)[:max(1, k // 2)]
        for group in [[c] for c in shared] + ([shared] if len(shared) > 1 else []):
            if deadline():
                break
            forced = list(cost)
            for c in group:
                forced[contiguous[c]] = -1.0
            add(forced, 4)
    for _ in range(4 * k):
        if len(found) >= k or deadline():
            break
        add([c * math.exp(rng.gauss(0.0, spread)) for c in cost], 2)
    return [choice for _, choice in sorted(found.values(), key=lambda t: t[0])][:k]
