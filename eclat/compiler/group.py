"""Grouping: a primitive Graph becomes a Program of fused kernels.

Views never copy: they fold into the index expressions of loads (through fused
producers too, by unravelling the flat index). Everything that is not materialised is
inlined into the kernel of its consumer, so elementwise chains fuse and a reduction
fuses with its prologue and epilogue. A value is materialised (gets a buffer and a
kernel of its own) when it is an output, a `contiguous` (the e-graph's way of asking
for a kernel boundary; not the copy of a broadcast, which readers read through), a gather
table, or when inlining would recompute real work:

  * redundant: it sits inside a loop it does not depend on and cannot be hoisted out
    of (an operand of a matmul computed per output column; a column sum read per row),
    and it is in a reduce body, a reduce itself, or costly (outermost first);
  * shared: it is evaluated at several different points (in one kernel or several)
    and it is a reduce or costs at least SHARE_COST operations. A shared value goes
    with a user that is evaluated at least as often; of the rest, the innermost go
    first, since materialising them may make their users cheap, and, once nothing is
    redundant, those costly with every other shared value loaded go with them (so a
    recurrence's steps take one attempt, not one each);
  * a contraction (sum of a product of differently indexed factors) that shares its
    kernel with another reduction: alone it is register-blocked by the backend;
  * a matmul, with the elementwise ops after it, that a masked view reads (zero padding
    for the next convolution or a pooling): `_products_before_masks`.

For a target whose contractions read a windowed operand in place (`fused` has "windows": the CPU
copies each panel of a product's right operand as it runs), an im2col's `contiguous` is not written:
the product reads the padded input through the windows (an implicit GEMM).

An `attend` the e-graph chose (a softmax contracted with values in one pass: rewrites/online.py)
is one kernel (kernel.attention_body) that never writes the scores, for a target that runs it so
(`fused` has "attention") where its scores are one contraction and elementwise ops (scale, mask,
bias, soft-capping); otherwise its decomposition, separate kernels.

These rules are applied until nothing changes. Weights become constant buffers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Sequence

import numpy as np

from ..errors import EclatError
from ..ir.dtypes import DType
from ..ir.graph import OPS, Graph, Node, decompose_composites, input_, movement
from ..ir.symbolic import (
    Expr,
    Num,
    as_int,
    assume,
    bounds,
    dims,
    floordiv,
    index_var,
    involves_sizes,
    logical_and,
    mod,
    prod,
    sint,
    sym_eq,
    terms,
    to_expr,
    upper,
    variables,
)
from ..ir.view import contiguous_strides, product_operands
from .kernel import (
    OP_COST,
    Buffer,
    Const,
    Gather,
    Index,
    Kernel,
    KExpr,
    Load,
    Op,
    Program,
    Reduce,
    attention_body,
    axis_vars,
    children,
    coalesce,
    flatten_rows,
    free_vars,
    numel_bound,
    reduces,
    size_vars,
    split_groups,
    walk,
)
from .layout import channels_last

DEEP_RECURSION = 20000  # Python frames grouping may nest (3.11 keeps them off the C stack)
SHARE_COST = 12  # recompute a shared elementwise value below this many operations
NATIVE_COMPOSITES = {"fma"}  # composite ops the kernel IR has natively
# the kernel IR's costly operations (OP_COST), and rsqrt, a composite until it is decomposed
TRANSCENDENTAL_OPS = {op for op, cost in OP_COST.items() if cost > OP_COST["fma"]} | {"rsqrt"}
CHAIN = 16  # values read twice inlined beneath one another before the first attempt is cut (_long_chains)
_COMPUTE_KINDS = {"unary", "binary", "ternary", "reduce", "gather", "composite"}


def group(graph: Graph, fused: frozenset[str] = frozenset(), channels_last_pixels: int = 0) -> Program:
    """Lower a primitive graph (composites allowed) to kernels over flat buffers. fused: the
    composites the target runs as one kernel of their own ("attention"); channels_last_pixels:
    feature maps of at most this many positions are computed channels-last (compiler/layout.py)."""
    graph = _attend_kernels(graph, "attention" in fused)
    keep = {op for op, d in OPS.items() if op in NATIVE_COMPOSITES | {"attend"} or d.alone}
    graph = decompose_composites(_products_before_masks(graph), keep=keep)
    if channels_last_pixels:
        graph = channels_last(graph, channels_last_pixels) or graph
    graph = _one_copy_per_value(graph)
    nodes = graph.nodes()
    forced = {id(_table(n)) for n in nodes if n.op == "gather"}
    forced |= {id(x) for n in nodes if n.kind == "composite" and OPS[n.op].alone for x in (n, *n.srcs)}
    in_place = "windows" in fused
    forced |= {id(n) for n in nodes if n.op == "attend" or n.op == "contiguous" and not _broadcast_copy(n)
               and not (in_place and copies_windows(n))}
    forced |= {id(o) for o in graph.outputs}
    twice = _read_twice(nodes)
    chosen = _contractions_under_reduces(graph, nodes, forced, twice)
    chosen |= _broadcast_operands(nodes, forced | chosen, twice)
    chosen |= _long_chains(nodes, forced | chosen, twice)
    # the first attempt fuses all it can: through a deep model (a 12-layer decode step) its
    # expressions nest a few frames per node, before `offenders` cuts them into kernels
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, DEEP_RECURSION))
    try:
        grouping = None
        for _ in range(64):
            grouping = _Grouping(graph, nodes, forced | chosen, grouping)
            extra = grouping.offenders()
            if not extra:
                return grouping.program()
            chosen |= extra
    finally:
        sys.setrecursionlimit(limit)
    raise EclatError("kernel grouping did not converge")  # pragma: no cover


def _table(gather: Node) -> Node:
    """The node whose buffer a gather reads: its table, or what the table reshapes (the same
    elements in the same order: a reshaped input or value is read in place, not copied)."""
    table = gather.srcs[0]
    if table.op == "view" and table.srcs[0].op != "view" and table.arg.is_contiguous \
            and sym_eq(table.arg.numel, prod(table.srcs[0].shape)):
        return table.srcs[0]
    return table


_ALONE: dict[tuple, tuple[Kernel, list[str]]] = {}


def _alone(n: Node) -> tuple[Kernel, list[str]]:
    """The kernel of composite n that groups alone (`OpDef.alone`), and the buffer names its body
    reads its operands by: its decomposition grouped on its own, once per op, argument and operand
    shapes (a model's convolutions of one shape share it; so do the candidates of a compile)."""
    key = (n.op, n.arg, tuple((tuple(s.shape), s.dtype) for s in n.srcs))
    if key not in _ALONE:
        ins = [input_(f"x{k}", s.shape, s.dtype) for k, s in enumerate(n.srcs)]
        sub = decompose_composites(Graph(ins, [Node(n.op, tuple(ins), n.arg, n.shape, n.dtype)], {}))
        root = sub.outputs[0]
        value = root.srcs[0] if root.op == "view" else root
        if value.op != "contiguous":
            raise EclatError(f"composite {n.op} groups alone but does not decompose to one value")
        grouping = _Grouping(sub, sub.nodes(), {id(value), id(root)})
        (kernel,) = [coalesce(k) for k in grouping.kernels if k.out == grouping.buf_of[id(value)]]
        _ALONE[key] = kernel, [grouping.buf_of[id(x)] for x in ins]
    return _ALONE[key]


def _renamed(e: KExpr, names: dict[str, str]) -> KExpr:
    """e reading buffer names[b] where it reads b (loads only: an alone kernel gathers nothing)."""
    memo: dict[int, KExpr] = {}

    def go(x: KExpr) -> KExpr:
        if id(x) not in memo:
            if isinstance(x, Load):
                memo[id(x)] = dataclasses.replace(x, buffer=names.get(x.buffer, x.buffer))
            elif isinstance(x, Op):
                memo[id(x)] = Op(x.op, tuple(go(s) for s in x.srcs), x.dtype)
            elif isinstance(x, Reduce):
                memo[id(x)] = Reduce(x.op, x.size, x.var, go(x.body), x.dtype)
            else:
                memo[id(x)] = x
        return memo[id(x)]
    return go(e)


def _broadcast_copy(n: Node) -> bool:
    """Whether contiguous node n copies a broadcast (a view repeating its source along an axis):
    the frontend's way to reshape one (a grouped-query attention's keys repeated per query
    head), which no strided view expresses. Its readers read the source through the index
    instead (h // repeats): a copy would write every repeat, a cache's worth per decode step. Not
    when the innermost axis repeats (a repeat_interleave): its readers would lose contiguous rows."""
    src = n.srcs[0]
    if src.op != "view":
        return False
    axes = [(as_int(st), as_int(d)) for st, d in zip(src.arg.strides, src.arg.shape) if as_int(d) != 1]
    return any(st == 0 for st, _ in axes) and axes[-1][0] != 0


def copies_windows(n: Node) -> bool:
    """Whether n is a `contiguous` that copies overlapping windows of its source (an im2col's
    patches: each element of the source read several times)."""
    return n.op == "contiguous" and n.srcs[0].op == "view" and n.srcs[0].arg.overlap() > 1.0


def _contractions_under_reduces(graph: Graph, nodes: list[Node], forced: set[int], twice: set[int]
                                ) -> set[int]:
    """The contractions that the first, fully fused attempt would inline into a kernel with a
    reduce reading them (through elementwise ops and views): it materialises every one of them
    (a contraction sharing its kernel with another reduction), so the fixpoint starts from them.
    Without them the first attempt inlines a whole model into each output, and its cost grows
    with the square of the depth."""
    reduce_nodes = [n for n in nodes if n.kind == "reduce"]
    # values read twice are materialised here too: a recurrence's state, read by its step's product
    # and by the next state, would otherwise inline the whole chain of steps into each product
    # (that a reduce is a contraction does not depend on whether its operands are loaded)
    shallow = _Grouping(graph, nodes, forced | {id(n) for n in reduce_nodes} | twice)
    body = {k.out: k.body for k in shallow.kernels}
    fv_memo: dict = {}
    contraction = {id(n) for n in reduce_nodes if isinstance(r := body.get(shallow.buf_of.get(id(n))), Reduce)
                   and _is_contraction(r, fv_memo)}
    seed: set[int] = set()
    seen: set[int] = set()  # one walk for all: what a node reaches is in seed once it is seen
    for r in reduce_nodes:
        inner = r.srcs[0]
        while inner.op == r.op:  # a sum over several axes is one reduction: seen from its outermost
            inner = inner.srcs[0]
        stack = [inner]
        while stack:
            n = stack.pop()
            if id(n) in seen or id(n) in forced:
                continue
            seen.add(id(n))
            if n.kind == "reduce":
                seed |= {id(n)} & contraction
            elif n.kind in ("unary", "binary", "ternary", "composite", "view") and n.op != "attend":
                stack.extend(n.srcs)
    return seed


def _broadcast_operands(nodes: list[Node], materialised: set[int], twice: set[int]) -> set[int]:
    """The computed operands, read twice, of the materialised contractions that some output axis of
    theirs does not index: each kernel would recompute them for every position along that axis, so
    the first attempt's `offenders` would materialise them anyway (redundant values). Taken now, a
    recurrence's state is not inlined, with every step before it, into the next step's product
    by that first attempt (the square of the steps, in a 100-step GRU's grouping). Operands only
    the product reads are left to `offenders`: taken too, they changed mambaout's and mobilevit's
    programs (more buffers), where the rest change none of the vision and timm programs."""
    out: set[int] = set()
    for n in nodes:
        if id(n) not in materialised or n.op != "sum" or n.srcs[0].op != "mul":
            continue
        product = n.srcs[0]
        for operand in product.srcs:
            if operand.op != "view" or operand.arg.mask is not None:
                continue
            x, strides = operand.srcs[0], [as_int(st) for st in operand.arg.strides]
            if id(x) not in twice or x.kind not in _COMPUTE_KINDS or id(x) in materialised \
                    or strides[n.arg] == 0:
                continue
            if any(st == 0 and as_int(size) != 1 for k, (st, size) in enumerate(zip(strides, product.shape))
                   if k != n.arg):
                out.add(id(x))
    return out


def _long_chains(nodes: list[Node], materialised: set[int], twice: set[int]) -> set[int]:
    """The values read twice that the first attempt would inline with more than CHAIN others read
    twice beneath them: an LSTM's cell state, read by the next state and by its step's output, and
    holding every step before it. `offenders` materialises them as costly shared values; found
    after the first attempt, each had cost that attempt the whole chain beneath it."""
    chain: dict[int, int] = {}
    out: set[int] = set()
    for n in nodes:
        if id(n) in materialised or n.kind == "leaf":
            chain[id(n)] = 0
            continue
        depth = max((chain[id(s)] for s in n.srcs), default=0) + (id(n) in twice)
        if depth > CHAIN and id(n) in twice and n.kind in _COMPUTE_KINDS:
            out.add(id(n))
            depth = 0
        chain[id(n)] = depth
    return out


def _read_twice(nodes: list[Node]) -> set[int]:
    """The computed values (not views, not leaves) that two or more nodes read, through views."""
    readers: dict[int, int] = {}
    for n in nodes:
        if n.op == "view":
            continue
        for s in n.srcs:
            s = s.srcs[0] if s.op == "view" else s
            readers[id(s)] = readers.get(id(s), 0) + 1
    return {id(n) for n in nodes if n.kind not in ("leaf", "view") and readers.get(id(n), 0) > 1}


def _attend_kernels(graph: Graph, fused: bool) -> Graph:
    """graph with every `attend` as its kernel reads it (fused: the target runs attention as one
    kernel) where its scores x are one contraction (or none) under elementwise ops, gathers and
    plain views: the contraction's operands and v become buffers (`contiguous`) where they are
    computed. Any other attend, and every attend where not fused, is its decomposition."""
    new: dict[int, Node] = {}
    for n in graph.nodes():
        srcs = [new[id(s)] for s in n.srcs]
        out = n if all(a is b for a, b in zip(srcs, n.srcs)) else Node(n.op, srcs, n.arg, n.shape, n.dtype)
        if n.op == "attend":
            found = _score_products(srcs[0]) if fused else None
            if found is None:
                out = OPS["attend"].decompose(out)
            else:
                products, stored = found
                swap = {id(r): _buffered(r) for r in stored}
                swap.update({id(p): _buffered_operands(p) for p in products})
                x = _substituted(srcs[0], swap)
                out = Node("attend", (x, _buffered(srcs[1])), n.arg, n.shape, n.dtype)
        new[id(n)] = out
    return dataclasses.replace(graph, outputs=[new[id(o)] for o in graph.outputs])


def _score_products(x: Node) -> tuple[list[Node], list[Node]] | None:
    """The products x computes (at most one: a matmul or the sum it decomposes into), through
    elementwise ops, gathers and unmasked views down to leaves and buffers, and the reductions it
    reads that read no product (a causal mask's positions summed over an arange, as transformers
    builds them over run-time lengths) or that compute a transcendental (`_costly_term`), which are
    stored before the attention, computed once rather than per score; None where x is anything else
    (another reduction, a padded view). A gather builds masks: transformers takes a causal mask's
    positions from an arange by index, wrapped where negative."""
    products, stored, stack, seen = [], [], [x], set()
    while stack:
        n = stack.pop()
        if id(n) in seen or n.op in ("input", "weight", "const", "iota", "contiguous"):
            continue
        seen.add(id(n))
        if _is_product(n):
            products.append(n)
        elif n is not x and _costly_term(n):
            stored.append(n)
        elif n.kind in ("unary", "binary", "ternary") or n.op in ("fma", "gather") or \
                n.kind == "view" and n.arg.mask is None:
            stack.extend(n.srcs)
        elif n.kind == "reduce" and not _count(n) and not any(_is_product(m) for m in _cone(n)):
            stored.append(n)
        elif not _count(n):
            return None
    return (products, stored) if len(products) <= 1 else None


def _costly_term(n: Node) -> bool:
    """Whether n, a term of attention scores, reads no product and computes a transcendental
    (T5's relative-position buckets take a logarithm of each distance): the attention kernel would
    evaluate it per score, in every layer reading it (T5 at 512 tokens: 13 ms an attention, against
    1 ms with the bias read from a buffer), where a buffer of it is computed once."""
    if n.kind not in ("unary", "binary", "ternary") and n.op not in ("fma", "gather"):
        return False
    costly, stack, seen = False, [n], set()
    while stack:  # down to buffers: what lies behind one is computed already
        m = stack.pop()
        if id(m) in seen or m.op == "contiguous":
            continue
        seen.add(id(m))
        if _is_product(m):
            return False
        costly |= m.op in TRANSCENDENTAL_OPS
        stack.extend(m.srcs)
    return costly


def _is_product(n: Node) -> bool:
    """A matmul, or the sum of a product it decomposes into (`product_operands`)."""
    if n.op == "matmul":
        return True
    if n.op != "sum" or n.srcs[0].op != "mul" or any(s.op != "view" for s in n.srcs[0].srcs):
        return False
    return product_operands(*(s.arg for s in n.srcs[0].srcs), n.arg) is not None


def _count(n: Node) -> bool:
    """Whether n sums a constant over a run-time size (a length as a tensor: `_build` makes it the
    size itself, times the constant)."""
    return n.op == "sum" and not isinstance(dims(n.srcs[0].shape)[n.arg], int) and \
        all(m.op in ("const", "view") for m in _cone(n.srcs[0]))


def _cone(n: Node) -> list[Node]:
    """n and every node it reads."""
    out, stack, seen = [], [n], set()
    while stack:
        m = stack.pop()
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
            stack.extend(m.srcs)
    return out


def _buffered_operands(p: Node) -> Node:
    """The product p (a matmul, or a sum of a product of two views) reading its operands from buffers."""
    if p.op == "matmul":
        return Node("matmul", tuple(_buffered(s) for s in p.srcs), p.arg, p.shape, p.dtype)
    prod = p.srcs[0]
    prod = Node("mul", tuple(_buffered(s) for s in prod.srcs), prod.arg, prod.shape, prod.dtype)
    return Node("sum", (prod,), p.arg, p.shape, p.dtype)


def _buffered(n: Node) -> Node:
    """n read from a buffer: a leaf, a buffer, or a view of one as it is; else through `contiguous`.
    A copy of a broadcast is read through (`_broadcast_copy`), so the broadcast's own source is
    made a buffer (a cache's keys repeated per query head: else its update, a gather over the
    new rows, would run inside the attention's inner loop)."""
    src = n.srcs[0] if n.op == "view" else n
    if src.op == "contiguous" and _broadcast_copy(src):
        copy = Node("contiguous", (_buffered(src.srcs[0]),), src.arg, src.shape, src.dtype)
        return Node("view", (copy,), n.arg, n.shape, n.dtype) if n.op == "view" else copy
    if src.op in ("input", "weight", "const", "contiguous"):
        return n
    copy = Node("contiguous", (src,), None, src.shape, src.dtype)
    return Node("view", (copy,), n.arg, n.shape, n.dtype) if n.op == "view" else copy


def _substituted(root: Node, swap: dict[int, Node]) -> Node:
    """root with the nodes in swap (by id) replaced, rebuilding what reads them."""
    memo: dict[int, Node] = {}

    def go(n: Node) -> Node:
        if id(n) in swap:
            return swap[id(n)]
        if id(n) not in memo:
            srcs = [go(s) for s in n.srcs]
            same = all(a is b for a, b in zip(srcs, n.srcs))
            memo[id(n)] = n if same else Node(n.op, tuple(srcs), n.arg, n.shape, n.dtype)
        return memo[id(n)]
    return go(root)


def _one_copy_per_value(graph: Graph) -> Graph:
    """graph with the `contiguous` copies of one computed value made one, each reader reading it
    through its own reshape (the value's elements in their order): a squeeze convolution's ReLU,
    copied as a 1x1 convolution's operand and again before the padding of a 3x3 one, was computed
    twice into two buffers (squeezenet at 2 threads 1.03x without the second, inception_v3 1.03x).
    Copies of program inputs and weights stay (a state is updated in place), as do outputs (written
    where the caller reads them)."""
    outputs = {id(o) for o in graph.outputs}
    copies: dict[int, Node] = {}  # id(value) -> its one copy
    new: dict[int, Node] = {}
    for n in graph.nodes():
        srcs = [new[id(s)] for s in n.srcs]
        out = n if all(a is b for a, b in zip(srcs, n.srcs)) else Node(n.op, srcs, n.arg, n.shape, n.dtype)
        if n.op == "contiguous" and id(n) not in outputs:
            value = srcs[0]  # what it copies, under the reshapes
            while value.op == "view" and value.arg.is_contiguous \
                    and sym_eq(prod(value.shape), prod(value.srcs[0].shape)):
                value = value.srcs[0]
            if value.kind != "leaf":
                copy = value if value.op == "contiguous" else copies.setdefault(
                    id(value), out if value is srcs[0] else Node("contiguous", (value,), None, value.shape,
                                                                 value.dtype))
                out = copy if tuple(copy.shape) == tuple(n.shape) else \
                    movement(copy, lambda v, shape=n.shape: v.reshape(shape))
        new[id(n)] = out
    return dataclasses.replace(graph, outputs=[new[id(o)] for o in graph.outputs])


def _products_before_masks(graph: Graph) -> Graph:
    """graph with a `contiguous` between a matmul or a sum of a product (with the elementwise ops
    fused after it) and a masked view that pads it: a convolution's output padded for the next
    one, or pooled with padding. Inlined there, the product's index is unravelled through the mask
    and the backend can no longer register-block it (a scalar loop, 20x slower); the padded copy
    costs one pass. The same before a view that reads elements more than once (the next
    convolution's overlapping windows, unpadded: wav2vec2's strided 1-d ones): inlined there, the
    product would be computed once per read (1.5x its work for kernel 3, stride 2), where the
    e-graph's cost (`extract.evaluations`) counts a product as a kernel of its own. A product
    read by several values (RoPE's q, sliced and rotated, then concatenated) is materialised by
    grouping's own rules, so it needs no copy after its readers."""
    nodes = graph.nodes()
    users: dict[int, list[Node]] = {}
    for n in nodes:
        for s in n.srcs:
            users.setdefault(id(s), []).append(n)

    carries: dict[int, bool] = {}  # node -> its fused value computes a product read once
    computes: dict[int, bool] = {}  # node -> its fused value computes a product
    new: dict[int, Node] = {}
    for n in nodes:
        srcs = [new[id(s)] for s in n.srcs]
        masked = n.op == "view" and n.arg.mask is not None
        rereads = n.op == "view" and n.arg.overlap() > 1.0
        if masked and carries[id(n.srcs[0])] or rereads and computes[id(n.srcs[0])]:
            srcs = [Node("contiguous", (srcs[0],), None, srcs[0].shape, srcs[0].dtype)]
        elementwise = n.kind in ("unary", "binary", "ternary") or n.op in ("fma", "cast")
        fused = elementwise or (n.op == "view" and not masked and not rereads)
        # a product read once (a shared one gets a kernel of its own anyway: `offenders`)
        product = n.op == "matmul" or (n.op == "sum" and n.srcs[0].op == "mul")  # or the frontend's form
        read_once = len(users.get(id(n), ())) == 1
        carries[id(n)] = (product and read_once) or fused and any(carries[id(s)] for s in n.srcs)
        computes[id(n)] = product or fused and any(computes[id(s)] for s in n.srcs)
        same = all(a is b for a, b in zip(srcs, n.srcs))
        new[id(n)] = n if same else Node(n.op, srcs, n.arg, n.shape, n.dtype)
    return dataclasses.replace(graph, outputs=[new[id(o)] for o in graph.outputs])


def _sum(terms: list[tuple[int, Expr | None]]) -> Expr:
    out: Expr = Num(0)
    for c, a in terms:
        out = out + (Num(c) if a is None else a * c)
    return out


def _split(e: Expr, s: int) -> tuple[list, Expr, int | None]:
    """e = s * sum(whole) + rest; q = rest // s where that is the same over rest's whole range."""
    whole, rest = [], []
    for c, a in terms(e):
        if a is not None and c % s == 0:
            whole.append((c // s, a))
        else:
            rest.append((c, a))
    r = _sum(rest)
    lo, hi = bounds(r)
    return whole, r, (lo // s if lo // s == hi // s else None)


def _div(e: Expr, s: sint) -> Expr:
    """e // s, splitting off the terms that are multiples of s (a size known at run time: divided
    then)."""
    if s == 1:
        return e
    if not isinstance(s, int) or involves_sizes(e):
        return floordiv(e, s)
    whole, _, q = _split(e, s)
    if q is not None:
        return _sum(whole + [(q, None)])
    step = _step(e, s)
    return floordiv(e, s) if step is None else _div(step[1], s // step[0])


def _mod(e: Expr, n: sint) -> Expr:
    """e % n for e >= 0 (falls back to the whole e, never a possibly negative part)."""
    if not isinstance(n, int) or involves_sizes(e):
        return mod(e, n)
    _, rest, q = _split(e, n)
    if q is not None:
        return rest + (-q * n)
    step = _step(e, n)
    return mod(e, n) if step is None else _mod(step[1], n // step[0]) * step[0] + step[2]


def _step(e: Expr, s: int) -> tuple[int, Expr, Expr] | None:
    """(g, a, r) with e = g * a + r, g a divisor of s and 0 <= r < g: then e // s = a // (s / g)
    and e % s = g * (a % (s / g)) + r. A flat index of a grouped layer, (512*i1 + rest) // 8192
    with rest < 512, is then i1 // 16: a factor that reads only i1, as a contraction's does."""
    parts = terms(e)
    for g in sorted({c for c, a in parts if a is not None and 1 < c < s and s % c == 0}, reverse=True):
        r = _sum([(c, a) for c, a in parts if a is None or c % g])
        lo, hi = bounds(r)
        if 0 <= lo and hi < g:
            return g, _sum([(c // g, a) for c, a in parts if a is not None and c % g == 0]), r
    return None


def unravel(flat: Expr, shape: Sequence[sint]) -> tuple[Expr, ...]:
    """Row-major multi-index of a flat index into shape. The first axis of more than one element
    needs no remainder (a flat index is below the size): a size known only at run time would
    make it a division per element."""
    return _unravel(flat, tuple(shape))


@functools.lru_cache(maxsize=1 << 16)
def _unravel(flat: Expr, shape: tuple[sint, ...]) -> tuple[Expr, ...]:
    # grouping asks the same of each view in every attempt and candidate (a 20-step LSTM's compile:
    # 39,099 calls, 2,579 distinct; each a few divisions of symbolic expressions)
    out = []
    first = True
    for n, s in zip(shape, contiguous_strides(shape)):
        whole = first and not isinstance(n, int)
        first = first and n == 1
        out.append(Num(0) if n == 1 else _div(flat, s) if whole else _mod(_div(flat, s), n) if s else Num(0))
    return tuple(out)


def ravel(idxs: Sequence[Expr], shape: Sequence[sint]) -> Expr:
    flat: Expr = Num(0)
    for i, s in zip(idxs, contiguous_strides(shape)):
        flat = flat + to_expr(i) * s
    return flat


def _costly(e: KExpr, cut: frozenset[int] = frozenset()) -> bool:
    """Whether e has at least SHARE_COST elementwise operations, not counting reduces (they are
    hoisted and shared) nor the subexpressions whose ids are in cut (to be loaded from buffers);
    the walk stops once it has counted that many."""
    seen: set[int] = set(cut - {id(e)})
    stack, total = [e], 0
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, Reduce):
            continue
        seen.add(id(x))
        total += OP_COST.get(x.op, 1) if isinstance(x, Op) else 0
        if total >= SHARE_COST:
            return True
        stack.extend(children(x))
    return False


def _inside(exprs: list[KExpr]) -> list[int]:
    """For each of exprs, the set (bits, by position) of the others found strictly inside it: one
    pass over the DAG they span, not a walk per expression (a recurrence's first attempt nests
    every step's values in the next)."""
    own: dict[int, int] = {}
    for k, e in enumerate(exprs):
        own[id(e)] = own.get(id(e), 0) | 1 << k
    at: dict[int, int] = {}  # id of a subexpression -> bits of the exprs at or below it
    for root in exprs:
        stack = [(root, False)]
        while stack:
            x, done = stack.pop()
            if id(x) in at:
                continue
            if done:
                bits = own.get(id(x), 0)
                for c in children(x):
                    bits |= at[id(c)]
                at[id(x)] = bits
            else:
                stack.append((x, True))
                stack.extend((c, False) for c in children(x) if id(c) not in at)
    return [at[id(e)] & ~own[id(e)] for e in exprs]  # a DAG: no expr lies inside itself


def _is_contraction(r: Reduce, fv_memo: dict | None = None) -> bool:
    """A sum of a product whose factors read different output axes (a matmul's shape).
    fv_memo: free_vars' memo, shared across calls (deep bodies are walked once)."""
    if r.op != "sum" or not (isinstance(r.body, Op) and r.body.op == "mul"):
        return False
    a, b = (free_vars(s, fv_memo) - {r.var.name} for s in r.body.srcs)
    return bool(a ^ b)


class _Grouping:
    """One attempt: kernels for a given set of materialised nodes. Given the previous attempt (which
    materialised a subset of them), a kernel is taken from it as it was when nothing it inlined is
    materialised now: its body is a function of what it inlines and of the buffers at their edge."""

    def __init__(self, graph: Graph, nodes: list[Node], materialised: set[int],
                 previous: _Grouping | None = None):
        self.graph, self.nodes = graph, nodes
        self.topo = {id(n): k for k, n in enumerate(nodes)}
        self.buffers: dict[str, Buffer] = {}
        self.buf_of: dict[int, str] = {}
        self.kernels: list[Kernel] = []
        self.alone: set[int] = set()  # the kernels of composites that group alone (`_alone`), coalesced
        self.origin: dict[KExpr, Node] = {}
        self.occurrences: dict[int, set[tuple[int, KExpr]]] = {}
        self._memo: dict = {}
        # per materialised node: its kernel and what building it noted (node, value), for reuse
        self._built: dict[int, tuple[Kernel, list[tuple[Node, KExpr]]]] = {}
        self._quiet = False  # building an attend kernel's scores: never materialised, so not recorded
        for k, n in enumerate(graph.inputs):
            self._leaf_buffer(n, f"in{k}_{n.arg}" if isinstance(n.arg, str) else f"in{k}", "input")
        for n in nodes:
            if n.op == "weight":
                data = np.asarray(graph.weights[n.arg], dtype=n.dtype.np)  # a view stays one: no copies
                self._leaf_buffer(n, f"w_{n.arg}", "weight", data, graph.formats.get(n.arg))
            elif n.op == "input" and id(n) not in self.buf_of:
                raise EclatError(f"input {n.arg!r} is used but is not an input of the graph")
        outs = {id(o): k for k, o in reversed(list(enumerate(graph.outputs)))}
        self.materialised = [n for n in nodes if id(n) in materialised and n.op not in ("input", "weight")]
        for n in self.materialised:
            name = f"out{outs[id(n)]}" if id(n) in outs else f"t{self.topo[id(n)]}"
            self.buffers[name] = Buffer(name, numel_bound(n.shape), n.dtype,
                                        "output" if id(n) in outs else "temp")
            self.buf_of[id(n)] = name
        fresh = None if previous is None else set(self.buf_of) - set(previous.buf_of)
        for n in self.materialised:
            built = previous._built.get(id(n)) if previous is not None else None
            if built is not None and not self._inlines(n, fresh, previous.buf_of):
                self._reuse(n, *built)
            else:
                self._kernel(n, self.buf_of[id(n)])
        self.outputs: list[str] = []
        for k, o in enumerate(graph.outputs):
            name = f"out{k}"
            if name not in self.buffers:  # a leaf or a repeated output: copy it
                self.buffers[name] = Buffer(name, numel_bound(o.shape), o.dtype, "output")
                self._kernel(o, name, copy=True)
            self.outputs.append(name)

    def _leaf_buffer(self, n: Node, name: str, role: str, data: np.ndarray | None = None,
                     rounded: tuple[str, int] | None = None) -> None:
        if id(n) in self.buf_of:
            return
        while name in self.buffers:
            name += "_"
        fmt, along = None, None
        if rounded is not None:
            fmt, axis = rounded
            along = (n.shape[axis], math.prod(n.shape[axis + 1:]))
        self.buffers[name] = Buffer(name, numel_bound(n.shape), n.dtype, role, data, fmt, along)
        self.buf_of[id(n)] = name

    def _kernel(self, n: Node, out: str, copy: bool = False) -> None:
        idxs = tuple(axis_vars(tuple(n.shape)))
        kid = len(self.kernels)
        if n.kind == "composite" and OPS[n.op].alone:
            kernel, inputs = _alone(n)
            names = {a: self.buf_of[id(s)] for a, s in zip(inputs, n.srcs)}
            self.alone.add(kid)
            self.kernels.append(dataclasses.replace(kernel, name=f"k{kid}_{n.op}", out=out,
                                                    body=_renamed(kernel.body, names)))
            self._built[id(n)] = (self.kernels[-1], [])
            return
        self._kid, self._ops, self._noted = kid, set(), []
        body = self._load(n, idxs, Num(1)) if copy else self._compute(n, idxs, Num(1))
        self.kernels.append(Kernel(f"k{kid}_{n.op}", out, dims(n.shape), body,
                                   ops=sorted(self._ops)))
        if not copy:
            self._built[id(n)] = (self.kernels[-1], self._noted)

    @staticmethod
    def _inlines(n: Node, fresh: set[int], buffered: dict[int, str]) -> bool:
        """Whether n's kernel, as the previous attempt built it (`buffered`: its buffers), inlines a
        node in `fresh` (materialised since)."""
        stack, seen = list(n.srcs), set()
        while stack:
            x = stack.pop()
            if id(x) in seen or id(x) in buffered:
                continue
            if id(x) in fresh:
                return True
            seen.add(id(x))
            stack.extend(x.srcs)
        return False

    def _reuse(self, n: Node, kernel: Kernel, noted: list[tuple[Node, KExpr]]) -> None:
        """The previous attempt's kernel for n, numbered here, with what it noted."""
        self._kid = len(self.kernels)
        if n.kind == "composite" and OPS[n.op].alone:
            self.alone.add(self._kid)
        self.kernels.append(dataclasses.replace(kernel, name=f"k{self._kid}_{n.op}"))
        for m, out in noted:
            self._note(m, out)
        self._built[id(n)] = (kernel, noted)

    def _note(self, n: Node, out: KExpr) -> None:
        """n's value `out` is evaluated in the current kernel (for the materialisation rules)."""
        self.origin.setdefault(out, n)
        self.occurrences.setdefault(id(n), set()).add((self._kid, out))

    # --- values ------------------------------------------------------------------------
    def value(self, n: Node, idxs: tuple[Expr, ...], guard: Expr) -> KExpr:
        """The element of n at idxs; loads are guarded by `guard` (a mask above us)."""
        if id(n) in self.buf_of:
            return self._load(n, idxs, guard)
        return self._compute(n, idxs, guard)

    def _load(self, n: Node, idxs: tuple[Expr, ...], guard: Expr) -> KExpr:
        if n.op in ("input", "weight") or id(n) in self.buf_of:
            return Load(self.buf_of[id(n)], ravel(idxs, n.shape), guard, n.dtype)
        return self._compute(n, idxs, guard)

    def _compute(self, n: Node, idxs: tuple[Expr, ...], guard: Expr) -> KExpr:
        key = (id(n), idxs, guard)
        if key in self._memo:
            out = self._memo[key]
        else:
            out = self._memo[key] = self._build(n, idxs, guard)
        self._ops.add(n.op)
        if n.kind in _COMPUTE_KINDS and not self._quiet:
            self._note(n, out)
            self._noted.append((n, out))
        return out

    def _build(self, n: Node, idxs: tuple[Expr, ...], guard: Expr) -> KExpr:
        kind = n.kind
        if n.op in ("input", "weight"):
            return self._load(n, idxs, guard)
        if n.op == "const":
            return Const(n.arg[0], n.dtype)
        if n.op == "iota":
            return Index(idxs[0], n.dtype)
        if n.op == "attend":
            return self._attend(n, idxs, guard)
        if kind == "view":
            v = n.arg
            flat, valid = v.index(idxs)
            src = n.srcs[0]
            inner = logical_and(guard, valid)
            flat = assume(flat, inner)  # read only where inner holds: padding's offsets divide exactly
            if src.op in ("input", "weight") or id(src) in self.buf_of:
                return Load(self.buf_of[id(src)], flat, inner, n.dtype)
            x = self.value(src, unravel(flat, list(dims(src.shape))), inner)
            if to_expr(valid) == Num(1) or isinstance(x, Load):
                return x
            return Op("where", (Index(valid, DType.bool), x, Const(0, n.dtype)), n.dtype)
        if kind in ("unary", "binary", "ternary", "composite"):
            srcs = tuple(self.value(s, idxs, guard) for s in n.srcs)
            return Op(n.op, srcs, n.dtype)
        if kind == "reduce" and _count(n):
            return Op("mul", (self.value(n.srcs[0], idxs[:n.arg] + (Num(0),) + idxs[n.arg:], guard),
                              Index(to_expr(dims(n.srcs[0].shape)[n.arg]), n.dtype)), n.dtype)
        if kind == "reduce":
            axis = n.arg
            size = dims(n.srcs[0].shape)[axis]
            var = index_var(f"r{self.topo[id(n)]}", size)
            # a mask over positions the reduction's indexes do not read (a padded copy of a
            # GroupNorm's output: its statistics cover the whole group) does not guard its loads,
            # which would then depend on those positions, and the reduction run once per position
            if not variables(to_expr(guard)) & set().union(*(variables(to_expr(i)) for i in idxs)):
                guard = Num(1)
            body = self.value(n.srcs[0], idxs[:axis] + (var,) + idxs[axis:], guard)
            return Reduce(n.op, size, var, body, n.dtype)
        if kind == "gather":
            table, idx = n.srcs
            k = len(idx.shape)
            rows = upper(table.shape[0])
            row_shape = list(dims(table.shape[1:]))
            inner = ravel(idxs[k:], row_shape)
            return Gather(self.buf_of[id(_table(n))], self.value(idx, idxs[:k], guard), rows,
                          prod(row_shape), inner if guard == Num(1) else inner * guard, n.dtype)
        if kind == "contiguous":
            return self.value(n.srcs[0], idxs, guard)
        raise EclatError(f"no kernel lowering for op {n.op!r} (kind {kind})")

    def _attend(self, n: Node, idxs: tuple[Expr, ...], guard: Expr) -> KExpr:
        (x, v), (_, vp, safe) = n.srcs, n.arg
        size = dims(v.shape)[-2]
        first = len(self.nodes) + 3 * self.topo[id(n)]  # reduce variables no graph node names
        j = index_var(f"r{first}", size)
        flat, _ = vp.index(idxs[:-1] + (j,))
        self._quiet = True
        try:
            score = self.value(x, unravel(flat, list(dims(x.shape))), guard)
        finally:
            self._quiet = False
        value = self.value(v, idxs[:-2] + (j, idxs[-1]), guard)
        return attention_body(score, value, j, size, safe, (f"r{first + 1}", f"r{first + 2}"))

    # --- materialisation decisions -----------------------------------------------------------
    def offenders(self) -> set[int]:
        """Graph nodes to materialise next: the outermost redundant values, and costly
        shared ones (see below)."""
        shared = {nid for nid, occ in self.occurrences.items() if len(occ) > 1}
        redundant: set[int] = set()
        hits: dict[int, KExpr] = {}
        sizes: dict[str, int] = {}
        fv_memo: dict = {}
        for k in (k for j, k in enumerate(self.kernels) if j not in self.alone):  # alone: no graph nodes
            rs = reduces(k.body)
            axes = {r.body for r in rs if isinstance(r.body, Reduce) and r.body.op == r.op}  # multi-axis
            if len(rs) - len(axes) > 1:  # a contraction gets a kernel of its own, to be register-blocked
                redundant |= {id(self.origin[r]) for r in rs if r in self.origin and r not in axes
                              and id(self.origin[r]) not in self.buf_of and _is_contraction(r, fv_memo)}
            sizes.update({f"i{a}": d for a, d in enumerate(k.shape)})
            self._offenders(k.body, tuple(f"i{a}" for a in range(len(k.shape))), False,
                            sizes, shared, redundant, hits, set(), fv_memo)
        # a shared value whose user is evaluated at least as often goes with that user; of the
        # rest, materialise the innermost first (their users then cost less). Once no value is
        # redundant (materialising one changes what is shared), a value goes with its user only
        # where it is evaluated in no other kernel, and those costly even with every other value
        # loaded from a buffer go too: a later attempt would take them (one attempt for a
        # recurrence's steps, not one per step)
        settled = not redundant
        ids = list(hits)
        count = [len(self.occurrences[nid]) for nid in ids]
        kernels = [{kid for kid, _ in self.occurrences[nid]} for nid in ids]
        inside = _inside([hits[nid] for nid in ids])  # bit a of inside[b]: hit a inside hit b
        goes_with = [[b for b in range(len(ids)) if b != a and inside[b] >> a & 1 and count[b] >= count[a]]
                     for a in range(len(ids))]
        kept = [a for a in range(len(ids))
                if not any(not settled or kernels[a] <= kernels[b] for b in goes_with[a])]
        kept_bits = sum(1 << a for a in kept)
        loaded = frozenset(id(hits[ids[a]]) for a in kept)
        inner = {ids[a] for a in kept
                 if not inside[a] & kept_bits or settled and _costly(hits[ids[a]], loaded)}
        return redundant | inner

    def _offenders(self, x: KExpr, loops: tuple[str, ...], in_reduce: bool, sizes: dict[str, int],
                   shared: set[int], redundant: set[int], hits: dict[int, KExpr], seen: set,
                   fv_memo: dict) -> None:
        if (x, loops) in seen:
            return
        seen.add((x, loops))
        n = self.origin.get(x)
        fv = free_vars(x, fv_memo)
        deepest = max((p for p, v in enumerate(loops) if v in fv), default=-1)
        if n is not None and id(n) not in self.buf_of:
            factor = math.prod(upper(sizes[v]) for v in loops[:deepest] if v not in fv)
            costly = isinstance(x, Reduce) or _costly(x)
            if factor > 1 and (in_reduce or costly):
                redundant.add(id(n))
                return
            if id(n) in shared and costly:
                hits.setdefault(id(n), x)
        args = (sizes, shared, redundant, hits, seen, fv_memo)
        if isinstance(x, Reduce):
            sizes[x.var.name] = x.size
            hoisted = loops[:deepest + 1]  # a reduce runs where its last variable is bound
            self._offenders(x.body, hoisted + (x.var.name,), True, *args)
        else:
            for c in children(x):
                self._offenders(c, loops, in_reduce, *args)

    def program(self) -> Program:
        ins = [self.buf_of[id(n)] for n in self.graph.inputs]
        kernels = [k if j in self.alone else flatten_rows(split_groups(coalesce(k)))
                   for j, k in enumerate(self.kernels)]
        kernels = _without_copies(kernels, self.buffers)
        return Program(self.buffers, kernels, ins, self.outputs,
                       [dims(n.shape) for n in self.graph.inputs],
                       [dims(n.shape) for n in self.graph.outputs],
                       size_vars([n.shape for n in self.graph.inputs]))


def _without_copies(kernels: list[Kernel], buffers: dict[str, Buffer]) -> list[Kernel]:
    """kernels without those that copy a temporary, element for element, into an output that nothing
    else reads it for: its writer writes the output instead (an output that is a reshape of an
    attention's or a product's result). buffers loses the temporaries."""
    readers: dict[str, int] = {}
    for k in kernels:
        for b in {x.buffer for x in walk(k.body) if isinstance(x, (Load, Gather))}:
            readers[b] = readers.get(b, 0) + 1
    writer = {k.out: j for j, k in enumerate(kernels)}
    renamed: dict[int, str] = {}  # writer position -> the output it writes instead
    for k in kernels:
        x = k.body
        if len(k.shape) == 1 and isinstance(x, Load) and x.index == axis_vars(k.shape)[0] \
                and x.valid == Num(1) and buffers[k.out].role == "output" and x.buffer in writer \
                and buffers[x.buffer].role == "temp" and readers[x.buffer] == 1 \
                and sym_eq(prod(kernels[writer[x.buffer]].shape), k.shape[0]) \
                and buffers[x.buffer].dtype is x.dtype:
            renamed[writer[x.buffer]] = k.out
    if not renamed:
        return kernels
    dropped = {kernels[j].out for j in renamed}
    out = []
    for j, k in enumerate(kernels):
        if isinstance(k.body, Load) and k.body.buffer in dropped and len(k.shape) == 1:
            continue  # the copy
        out.append(dataclasses.replace(k, out=renamed[j]) if j in renamed else k)
    for name in dropped:
        del buffers[name]
    return out
