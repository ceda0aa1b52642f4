"""Winograd F(2x2, 3x3): a 3x3 stride-1 convolution as an alternative the search can take.

A convolution reaches the e-graph as an im2col and a product, `W[O, 9C] @ patches[9C, pixels]`.
Winograd's minimal filtering computes each 2x2 block of outputs from the 4x4 input tile under it
with 16 multiplications per channel pair instead of 36 (Lavin & Gray, 2015):

    Y = A^T [ (G g G^T) (.) (B^T d B) ] A

per tile d and filter g ((.): the elementwise product), which summed over input channels is 16
products `U[ab] (O x C) @ V[ab] (C x tiles)`, one batched Matmul. The rule rewrites the im2col
product into

    view(winograd_out(matmul(U, winograd_in(padded input))))

- `winograd_in` (the input transform, a composite): V [16, C, N*th*tw], each of the 16 rows a
  signed sum of four strided views of the padded input (tiles past its edge read zeros);
- U = (G (x) G) @ the filter's 9 taps, weight-only: compile-time folding computes it (16 taps
  stored for 9, within `fold.FOLD_GROWTH`);
- `winograd_out` (the output transform, a composite): 4 signed sums of nine of the products per
  tile, laid out [N, O, th, 2, tw, 2], which is [N, O, 2 th, 2 tw]; a view cuts it to the output
  where that is odd.

The transforms are composites so that the e-graph holds each as one node (their sums of views
would give the explorer's commutativity and the fusion stage hundreds of nodes per convolution
to work on); their decompositions, run after extraction, are what the backends compile: each a
concatenation the CPU runs a part at a time (`emitter._pieces`, `TINY_ROW`).

Numerical error: the coefficients are 0, +-1 and +-1/2, exact in float32; each output sums 16
products per input channel where the direct form sums 9, after transforms that add 4 inputs and
up to 9 filter taps. On unit-normal data its largest error against torch's convolution was 3-6e-7
of the output's largest magnitude (the im2col form's: 6e-7 to 3e-6, at 7x7 to 56x56 and 64 to
512 channels); tests/test_winograd.py bounds it at 2e-6 against float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir import graph as g
from ..ir.graph import Graph, Node
from ..ir.symbolic import as_int
from ..ir.view import View, compose
from . import composites
from .composites import matmul
from .lang import Rule, RuleSet

BT = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], np.float32)
G = np.array([[1, 0, 0], [.5, .5, .5], [.5, -.5, .5], [0, 0, 1]], np.float32)
AT = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], np.float32)
FILTER = "winograd.f2x2_3x3.G"  # the constant (G (x) G) [16, 9], one leaf for every convolution
MIN_CHANNELS = 8  # fewer input or output channels: the transforms cost more than they save
# fewer 2x2 tiles than this (an output under 7x7): each of the 16 products is a matrix-vector
# product (measured: densenet121's 4x4 and 2x2 stages made the model 4% slower)
MIN_TILES = 16


@dataclass(frozen=True)
class Conv:
    """A 3x3 stride-1 convolution's sizes, read from its im2col and product views."""
    n: int
    c: int
    o: int
    ho: int
    wo: int
    hp: int  # the padded input's height and width
    wp: int

    @property
    def tiles(self) -> tuple[int, int]:
        return -(-self.ho // 2), -(-self.wo // 2)

    @property
    def t(self) -> int:
        th, tw = self.tiles
        return self.n * th * tw

    @property
    def v_shape(self) -> tuple[int, int, int]:
        return 16, self.c, self.t

    @property
    def y_shape(self) -> tuple[int, int, int, int]:
        th, tw = self.tiles
        return self.n, self.o, 2 * th, 2 * tw


def _ints(xs) -> list[int] | None:
    out = [as_int(x) for x in xs]
    return None if None in out else out


def conv_of(vwin: View, vb: View, vo: View) -> Conv | None:
    """The convolution whose im2col reads its padded input through vwin ([1, C, 3, 3, N, Ho, Wo]),
    whose product reads the patches through vb ([1, 9C, N*Ho*Wo]) and is read as [N, O, Ho, Wo]
    through vo; None for anything else (a stride, a dilation, groups, a mask)."""
    shape, strides = _ints(vwin.shape), _ints(vwin.strides)
    if shape is None or strides is None or len(shape) != 7 or vwin.mask is not None or \
            as_int(vwin.offset) != 0 or shape[0] != 1 or shape[2:4] != [3, 3]:
        return None
    _, c, _, _, n, ho, wo = shape
    _, sc, skh, skw, sn, sh, sw = strides
    wp = sh
    if skw != 1 or sw != 1 or skh != wp or wp < wo + 2 or sc % wp or sc // wp < ho + 2 or \
            (n > 1 and sn != c * sc):
        return None
    rows = n * ho * wo
    if _ints(vb.shape) != [1, 9 * c, rows] or View.make(vb.shape, View.contiguous(vb.shape).strides) != vb:
        return None
    oshape = _ints(vo.shape)
    if oshape is None or len(oshape) != 4 or oshape[0] != n or oshape[2:] != [ho, wo] or vo.mask is not None:
        return None
    o = oshape[1]
    conv = Conv(n, c, o, ho, wo, sc // wp, wp)
    if vo != View.make((n, o, ho, wo), (ho * wo, rows, wo, 1)) or min(c, o) < MIN_CHANNELS or \
            conv.t < MIN_TILES:
        return None
    return conv


# --- the transforms, as composites ---------------------------------------------------------

def winograd_in(xp: Node, k: Conv) -> Node:
    """V [16, C, N*th*tw] of the padded input xp [N, C, Hp, Wp]."""
    if tuple(xp.shape) != (k.n, k.c, k.hp, k.wp):
        raise ValueError(f"winograd_in: padded input {list(xp.shape)} for {k}")
    return Node("winograd_in", (xp,), k, k.v_shape, xp.dtype)


def winograd_out(m: Node, k: Conv) -> Node:
    """Y [N, O, 2 th, 2 tw] of the products m [16, O, N*th*tw]."""
    if tuple(m.shape) != (16, k.o, k.t):
        raise ValueError(f"winograd_out: products {list(m.shape)} for {k}")
    return Node("winograd_out", (m,), k, k.y_shape, m.dtype)


def _stacked(terms: list[Node], coefs: np.ndarray, shape: tuple, axes: tuple[int, ...],
             index: list[tuple[int, ...]]) -> Node:
    """The concatenation over `axes` of shape whose part at index[r] is sum_k coefs[r, k] * terms[k]
    (coefficients in {-1, 0, 1}; terms shaped as shape without axes): each term placed by a padded
    view of its own, so that every load is one view of a source (no view of a computed sum)."""
    out = None
    for at, row in zip(index, coefs):
        where = dict(zip(axes, at))
        flat = tuple(1 if a in where else d for a, d in enumerate(shape))
        pads = [(where[a], d - 1 - where[a]) if a in where else (0, 0) for a, d in enumerate(shape)]
        for t, c in zip(terms, row):
            if c:
                piece = g.movement(t, lambda v, flat=flat, pads=pads: v.reshape(flat).pad(pads))
                piece = piece if c > 0 else g.unary("neg", piece)
                out = piece if out is None else g.binary("add", out, piece)
    assert out is not None
    return out


def _decompose_in(node: Node) -> Node:
    (xp,), k = node.srcs, node.arg
    th, tw = k.tiles
    plane = k.hp * k.wp

    def tap(i: int, j: int) -> Node:  # input tile element (i, j) of every tile: [C, N, th, tw]
        rows, cols = (k.hp - 1 - i) // 2 + 1, (k.wp - 1 - j) // 2 + 1  # tiles inside the padding
        mask = ((0, k.c), (0, k.n), (0, min(th, rows)), (0, min(tw, cols)))
        v = View.make((k.c, k.n, th, tw), (plane, k.c * plane, 2 * k.wp, 2), i * k.wp + j, mask)
        return g.view(xp, v)
    taps = [tap(i, j) for i in range(4) for j in range(4)]
    v = _stacked(taps, np.kron(BT, BT), (16, k.c, k.n, th, tw), (0,), [(r,) for r in range(16)])
    return g.movement(g.contiguous(v), lambda x: x.reshape(k.v_shape))


def _decompose_out(node: Node) -> Node:
    (m,), k = node.srcs, node.arg
    th, tw = k.tiles
    ms = [g.view(m, View.make((k.n, k.o, th, tw), (th * tw, k.t, tw, 1), r * k.o * k.t)) for r in range(16)]
    y = _stacked(ms, np.kron(AT, AT), (k.n, k.o, th, 2, tw, 2), (3, 5),
                 [(p, q) for p in range(2) for q in range(2)])
    return g.movement(g.contiguous(y), lambda x: x.reshape(k.y_shape))


def _tiles(xp: np.ndarray, k: Conv) -> np.ndarray:
    """[N, C, th, tw, 4, 4]: the input tiles, zeros past the padded input."""
    th, tw = k.tiles
    full = np.zeros((k.n, k.c, 2 * th + 2, 2 * tw + 2), xp.dtype)
    full[:, :, :k.hp, :k.wp] = xp[:, :, :2 * th + 2, :2 * tw + 2]
    return np.stack([np.stack([full[:, :, i:i + 2 * th:2, j:j + 2 * tw:2] for j in range(4)], -1)
                     for i in range(4)], -2)


def _in_numpy(node: Node, xp: np.ndarray) -> np.ndarray:
    k = node.arg
    v = np.einsum("ai,bj,ncyxij->abcnyx", BT, BT, _tiles(xp, k))
    return v.reshape(k.v_shape).astype(node.dtype.np)


def _out_numpy(node: Node, m: np.ndarray) -> np.ndarray:
    k = node.arg
    th, tw = k.tiles
    y = np.einsum("pa,qb,abonyx->noypxq", AT, AT, m.reshape(4, 4, k.o, k.n, th, tw))
    return y.reshape(k.y_shape).astype(node.dtype.np)


g.register("winograd_in", "composite", _in_numpy, decompose=_decompose_in, alone=True)
g.register("winograd_out", "composite", _out_numpy, decompose=_decompose_out, alone=True)
composites.COMPOSITE_ARGS.update(winograd_in=lambda k: (k,), winograd_out=lambda k: (k,))
composites.BUILDERS.update(winograd_in=winograd_in, winograd_out=winograd_out)


# --- the rule ------------------------------------------------------------------------------

def fill_winograd(enc) -> list[tuple[str, tuple[int, ...], int]]:
    """The oracles of every im2col product read as a 3x3 stride-1 convolution's output, keyed by
    (window view, the product's view of the patches, the view of its output): the convolution
    (`wconv`), the constant G (x) G (`wgg`), the views of the filter as [9, O*C] (`wfilter`), of
    U as [16, O, C] (`wu`) and of the transform's output as the convolution's (`wout`). Runs
    after fill_matmul and before the fillers that cover every view."""
    from .contraction import product_plans

    terms, attrs, out = enc.terms, enc.attrs, []
    reads: dict[int, set[int]] = {}
    for t in terms:
        if t[0] == "View":
            reads.setdefault(t[1], set()).add(t[2])
    # (product term, its right operand's source, the view it reads that through, the view of
    # the product's [.., M, N] its term holds; None: as it is): the frontend's sums, and Matmuls
    products: list[tuple[int, int, View, View | None]] = []
    for k, plans in product_plans(enc).items():
        _, i, j = terms[terms[k][1]]
        for va, _vb, _r, _a2, b2, o in plans:
            products.append((k, terms[j if va == terms[i][2] else i][1], b2, o))
    for k, t in enumerate(terms):
        if t[0] == "Matmul" and terms[t[2]][0] == "View":
            products.append((k, terms[t[2]][1], attrs[terms[t[2]][2]], None))
    leaf = None
    for k, y, b2, o in products:
        if terms[y][0] != "Contiguous" or terms[terms[y][1]][0] != "View":
            continue
        vwin = terms[terms[y][1]][2]
        for w in reads.get(k, ()):
            ow = attrs[w] if o is None else compose(o, attrs[w])
            conv = None if ow is None else conv_of(attrs[vwin], b2, ow)
            if conv is None:
                continue
            if leaf is None:
                leaf = enc.constant(FILTER, np.kron(G, G))
            key = (vwin, enc.view_id(b2), enc.view_id(ow))
            full = View.contiguous(conv.y_shape)
            out += [("wconv", key, enc.arg_id(conv)), ("wgg", key, leaf),
                    ("wfilter", key, enc.view_id(View.make((9, conv.o * conv.c), (1, 9)))),
                    ("wu", key, enc.view_id(View.contiguous((16, conv.o * conv.c)).reshape(
                        (16, conv.o, conv.c)))),
                    ("wout", key, enc.view_id(full.slice(2, 0, conv.ho).slice(3, 0, conv.wo)))]
    return out


def _example() -> Graph:
    """A 3x3 convolution of a [2, 8, 5, 7] input (odd sizes: the last tiles reach past the
    padding) to 9 channels, written as the frontend writes it: an im2col and a product."""
    n, c, o, h, w = 2, 8, 9, 5, 7
    x, wa = g.input_("x", (n, c, h, w)), g.input_("w", (1, o, 9 * c))
    hp, wp = h + 2, w + 2
    xp = g.contiguous(g.movement(x, lambda v: v.pad([(0, 0), (0, 0), (1, 1), (1, 1)])))
    plane = hp * wp
    win = g.view(xp, View.make((1, c, 3, 3, n, h, w), (0, plane, wp, 1, c * plane, wp, 1)))
    patches = g.view(g.contiguous(win), View.contiguous((1, 9 * c, n * h * w)))
    prod_ = matmul(g.view(wa, View.contiguous(wa.shape)), patches)
    out = g.view(prod_, View.make((n, o, h, w), (h * w, n * h * w, w, 1)))
    return Graph([x, wa], [out], {})


def _rule(name: str, lhs: str, filter_: str, when: tuple[str, ...], key: str, example) -> Rule:
    """The rewrite of lhs, whose filter operand (as a product's left operand [1, O, 9C]) is
    filter_ and whose oracles are keyed by key (window view, patches view, output view)."""
    oracles = (("k", "wconv"), ("gg", "wgg"), ("wf", "wfilter"), ("vu", "wu"), ("wo", "wout"))
    return Rule(name, lhs, f"(View (WinogradOut (Matmul (View (Matmul (Leaf gg) (View {filter_} wf)) vu) "
                           f"(WinogradIn xp k)) k) wo)",
                (*when, *(f"(= {var} ({oracle} {key}))" for var, oracle in oracles)), example=example)


_PATCHES = "(View (Contiguous (View xp vwin)) vb)"
RULES = RuleSet("winograd", (
    # the frontend's product, read as the convolution's output
    _rule("winograd-f2x2-3x3", f"(View (Sum (Mul (View wa va) {_PATCHES}) r) w)", "(View wa a2)",
          ("(= a2 (mm_a va vb r))", "(= b2 (mm_b va vb r))", "(= vo (mm_ow va vb r w))"), "vwin b2 vo",
          lambda: g.decompose_composites(_example())),
    # a product a rule made (a BatchNorm's scale moved into the filter)
    _rule("winograd-f2x2-3x3-matmul", f"(View (Matmul wa {_PATCHES}) vo)", "wa", (), "vwin vb vo", _example),
))
