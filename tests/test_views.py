"""Views against numpy, and the symbolic integers under them.

Property tests draw random chains of movement ops (permute, expand, reshape, slice with
any step, pad, flip) on a small array and require the view to read, at every index,
exactly what numpy's own view (or np.pad) holds; `View.index` must agree element by
element. A reshape the strides cannot express materialises, as `graph.movement` does.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eclat.ir import symbolic as S
from eclat.ir.interpreter import read_view
from eclat.ir.symbolic import Var, evaluate
from eclat.ir.view import View

shapes = st.lists(st.integers(1, 4), min_size=1, max_size=4).map(tuple)


def _factorisations(n: int, parts: int) -> list[tuple[int, ...]]:
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in _factorisations(n // d, parts - 1)]


def _step(data: st.DataObject, src: np.ndarray, v: View, ref: np.ndarray
          ) -> tuple[np.ndarray, View, np.ndarray]:
    """Apply one random movement to (view v on flat src) and to numpy's ref alike."""
    nd = ref.ndim
    kind = data.draw(st.sampled_from(["permute", "expand", "reshape", "slice", "pad", "flip"]))
    if kind == "permute":
        order = data.draw(st.permutations(range(nd)))
        return src, v.permute(order), ref.transpose(order)
    if kind == "expand":
        new = tuple(data.draw(st.integers(1, 3)) if n == 1 else n for n in ref.shape)
        return src, v.expand(new), np.broadcast_to(ref, new)
    if kind == "reshape":
        parts = data.draw(st.integers(1, 4))
        new = data.draw(st.sampled_from(_factorisations(ref.size, parts))) if ref.size else (0,)
        out = v.reshape(new)
        if out is None:  # not expressible on these strides: materialise, as graph.movement does
            src, out = read_view(src, v).reshape(-1), View.contiguous(ref.shape).reshape(new)
        return src, out, ref.reshape(new)
    if kind == "slice":
        axis = data.draw(st.integers(0, nd - 1))
        n = ref.shape[axis]
        step = data.draw(st.sampled_from([1, 1, 2, 3, -1, -2, -3]))
        start, stop = data.draw(st.integers(-n - 1, n + 1)), data.draw(st.integers(-n - 1, n + 1))
        sl = slice(start, stop, step)
        a, b, _ = sl.indices(n)
        key = tuple(sl if k == axis else slice(None) for k in range(nd))
        return src, v.slice(axis, a, b, step), ref[key]
    if kind == "pad":
        pads = [(data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))) for _ in range(nd)]
        return src, v.pad(pads), np.pad(ref, pads)
    axes = data.draw(st.lists(st.integers(0, nd - 1), unique=True, max_size=nd))
    return src, v.flip(axes), np.flip(ref, axes) if axes else ref


def _check_index(v: View, src: np.ndarray, ref: np.ndarray) -> None:
    """View.index, symbolic over one bounded variable per axis, agrees with ref everywhere."""
    idx = v.index_vars()
    flat, valid = v.index(idx)
    for point in itertools.islice(itertools.product(*(range(n) for n in ref.shape)), 200):
        env = {var.name: p for var, p in zip(idx, point)}
        ok = bool(evaluate(valid, env))
        got = src[evaluate(flat, env)] if ok else 0
        assert got == ref[point], (v, point)


@settings(max_examples=300, deadline=None)
@given(shape=shapes, data=st.data())
def test_view_chains_read_what_numpy_holds(shape: tuple[int, ...], data: st.DataObject) -> None:
    src = np.arange(1, int(np.prod(shape)) + 1, dtype=np.float32)  # no zeros: padding shows
    v, ref = View.contiguous(shape), src.reshape(shape)
    for _ in range(data.draw(st.integers(1, 6))):
        src, v, ref = _step(data, src, v, ref)
        assert tuple(v.shape) == ref.shape
        np.testing.assert_array_equal(read_view(src, v), ref)
    _check_index(v, src, ref)


def test_size_one_axes_have_stride_zero_so_equal_views_compare_equal() -> None:
    assert View.contiguous((3, 1, 4)).strides == (4, 0, 1)
    assert View.contiguous((4, 3)).permute([1, 0]).permute([1, 0]) == View.contiguous((4, 3))


def test_reshape_reports_what_strides_cannot_express() -> None:
    t = View.contiguous((2, 3)).permute([1, 0])
    assert t.reshape((6,)) is None
    assert t.reshape((3, 1, 2)) is not None  # adding unit axes is always fine
    with pytest.raises(ValueError, match="cannot reshape"):
        View.contiguous((2, 3)).reshape((4,))


def test_masked_views_reshape_only_by_unit_axes() -> None:
    padded = View.contiguous((2, 3)).pad([(1, 0), (0, 0)])
    assert padded.reshape((9,)) is None
    unit = padded.reshape((3, 1, 3))
    assert unit.mask == ((1, 3), (0, 1), (0, 3))
    src = np.arange(1, 7, dtype=np.float32)
    np.testing.assert_array_equal(read_view(src, unit), np.pad(src.reshape(2, 3), [(1, 0), (0, 0)])[:, None])


def test_fully_padded_region_reads_zero_and_is_canonical() -> None:
    v = View.contiguous((3,)).pad([(2, 2)]).slice(0, 0, 2)
    assert v.mask == ((0, 0),) and read_view(np.arange(1, 4, dtype=np.float32), v).tolist() == [0, 0]


def test_bad_movements_raise() -> None:
    with pytest.raises(ValueError, match="not a permutation"):
        View.contiguous((2, 3)).permute([0, 0])
    with pytest.raises(ValueError, match="cannot expand"):
        View.contiguous((2, 3)).expand((4, 3))
    with pytest.raises(ValueError, match="step must be positive"):
        View.contiguous((4,)).step([0])


# --- symbolic shapes ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 5])
def test_symbolic_view_evaluates_like_numpy(n: int) -> None:
    s = Var("s", 1, 64)
    src = np.arange(1, n * 4 + 1, dtype=np.float32)
    v = View.contiguous((s, 4)).permute([1, 0]).pad([(1, 0), (0, 2)])
    v = v.reshape((5, 1, s + 2)).expand((5, 3, s + 2)).flip([2])
    ref = np.flip(np.broadcast_to(np.pad(src.reshape(n, 4).T, [(1, 0), (0, 2)])[:, None], (5, 3, n + 2)), 2)
    np.testing.assert_array_equal(read_view(src, v, {"s": n}), ref)


def test_contiguous_symbolic_reshape_splits_and_merges() -> None:
    s = Var("s", 1, 64)
    v = View.contiguous((s * 2, 3)).reshape((s, 6))
    assert v is not None and v.is_contiguous
    src = np.arange(12, dtype=np.float32)
    np.testing.assert_array_equal(read_view(src, v, {"s": 2}), src.reshape(2, 6))


# --- symbolic integers -------------------------------------------------------------------------

x, y = Var("x", 0, 10), Var("y", 0, 3)


@pytest.mark.parametrize("expr, want", [
    (x + 0, x), (x * 1, x), (x * 0, S.Num(0)), (S.add(2, 3), S.Num(5)),
    ((x + 2) + 3, x + 5), ((x * 2) * 3, x * 6), ((x + 1) * 2, x * 2 + 2),
    ((x * 4 + y) // 4, x), ((x * 4) // 2, x * 2), (y // 4, S.Num(0)), (y % 4, y), ((x * 4 + y) % 4, y),
    ((x * 6) % 3, S.Num(0)), (x // 1, x), (x % 1, S.Num(0)),
    (S.lt(y, 4), S.Num(1)), (S.lt(x, 0), S.Num(0)), (S.logical_and(1, S.lt(x, 5)), S.lt(x, 5)),
    (S.logical_and(S.lt(x, 5), 0), S.Num(0)),
])
def test_simplification(expr: S.Expr, want: S.Expr) -> None:
    assert expr == want


def test_bounds_render_and_helpers() -> None:
    assert (x * 2 + y).vmin == 0 and (x * 2 + y).vmax == 23
    assert ((x * 4 + 3) // 4).vmax == 10 and (x % 7).vmax == 6
    assert S.render((x * 4 + y) // 3) == "(((x * 4) + y) / 3)"
    assert S.as_int(S.Num(3)) == 3 and S.as_int(x) is None and S.sym_eq(3, S.Num(3))
    assert S.variables(x * y + 1) == {"x", "y"}
    assert S.prod([2, x, 3]) == x * 6
    with pytest.raises(KeyError, match="no value"):
        evaluate(x + 1, {})


_OPS = {"+": operator.add, "*": operator.mul, "//": operator.floordiv, "%": operator.mod}


@st.composite
def _exprs(draw: st.DrawFn, depth: int = 3) -> tuple[S.Expr | int, object]:
    """(simplified Expr, the same tree as a Python function of the variables)."""
    if depth == 0 or draw(st.booleans()):
        if draw(st.booleans()):
            c = draw(st.integers(-6, 6))
            return c, lambda env, c=c: c
        var = draw(st.sampled_from([x, y, Var("z", -4, 4)]))
        return var, lambda env, n=var.name: env[n]
    op = draw(st.sampled_from(list(_OPS)))
    a, fa = draw(_exprs(depth - 1))
    if op in ("//", "%"):
        c = draw(st.integers(1, 5))  # the IR divides by positive constants only
        return _OPS[op](S.to_expr(a), c), lambda env: _OPS[op](fa(env), c)
    b, fb = draw(_exprs(depth - 1))
    return _OPS[op](S.to_expr(a), b), lambda env: _OPS[op](fa(env), fb(env))


@settings(max_examples=300, deadline=None)
@given(_exprs(), st.integers(0, 10), st.integers(0, 3), st.integers(-4, 4))
def test_simplified_expressions_keep_their_value(e, xv: int, yv: int, zv: int) -> None:
    expr, python = e
    env = {"x": xv, "y": yv, "z": zv}
    value = python(env)
    assert evaluate(expr, env) == value
    lo, hi = S.bounds(S.to_expr(expr))
    assert lo <= value <= hi


def test_assume_narrows_to_a_padding_mask_and_unravel_divides_exactly() -> None:
    """A 1-padded 16x16 plane read through its mask: the flat offset's division and remainder
    by the plane's sizes become plain index arithmetic, equal to the original wherever the mask
    holds (checked at every such point)."""
    from eclat.compiler.group import unravel

    n, c, h, w = Var("i0", 0, 1), Var("i1", 0, 2), Var("i2", 0, 17), Var("i3", 0, 17)
    flat = n * 768 + c * 256 + (h - 1) * 16 + (w - 1)
    mask = S.logical_and(S.logical_and(S.lt(0, h), S.lt(h, 17)), S.logical_and(S.lt(0, w), S.lt(w, 17)))
    plain = unravel(flat, [2, 3, 16, 16])
    narrowed = unravel(S.assume(flat, mask), [2, 3, 16, 16])
    assert [S.render(e) for e in narrowed] == ["i0", "i1", "(i2 + -1)", "(i3 + -1)"]
    assert any("/" in S.render(e) for e in plain)  # without the mask the offsets may be negative
    inside = itertools.product(range(2), range(3), range(1, 17), range(1, 17))
    for env in (dict(zip(["i0", "i1", "i2", "i3"], p)) for p in inside):
        assert [evaluate(e, env) for e in narrowed] == [evaluate(e, env) for e in plain]
    assert S.assume(flat, S.lt(h, 99)) == flat  # a condition that narrows nothing changes nothing


def test_flat_index_divided_by_a_multiple_of_a_coefficient_keeps_only_its_axis() -> None:
    """A grouped layer's group from a flat index: (64*i0 + 512*i1 + 8*r + q) // 8192 is i1 // 16
    when the rest stays below 512, so the weight's factor reads i1 alone (the grouping then sees
    a contraction). Checked against Python's // and % over every value of the variables."""
    from eclat.compiler.group import _div, _mod

    i0, i1, r, q = Var("i0", 0, 7), Var("i1", 0, 63), Var("r0", 0, 7), Var("r1", 0, 7)
    flat = i0 * 64 + i1 * 512 + r * 8 + q
    assert _div(flat, 8192) == i1 // 16
    assert S.variables(_mod(flat, 8192)) == {"i0", "i1", "r0", "r1"}
    cases = [(flat, 8192), (flat, 1024), (flat, 16), (i0 * 6 + q, 12), (i1 * 4 + q, 8),
             (i1 * 512 + q * 3, 1024)]
    for e, s in cases:
        names = sorted(S.variables(e))
        ranges = {v.name: range(v.lo, v.hi + 1) for v in (i0, i1, r, q) if v.name in names}
        for values in itertools.product(*ranges.values()):
            env = dict(zip(ranges, values))
            value = evaluate(e, env)
            assert evaluate(_div(e, s), env) == value // s, (e, s, env)
            assert evaluate(_mod(e, s), env) == value % s, (e, s, env)
