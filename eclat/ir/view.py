"""View: how a tensor of some shape is read from a contiguous buffer, without copying.

A view maps an index (i_0, ..., i_n) of its shape to the flat element
`offset + sum(i_k * strides[k])` of its source. Where a `mask` is present, an index
outside [lo_k, hi_k) on any axis reads as zero (padding). Permute, expand, slice
with any step, pad and flip are always expressible; a reshape is when the strides
allow it and otherwise returns None, so that the caller materialises a Contiguous.
Size-1 axes always carry stride 0, so equal views compare equal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .symbolic import Expr, Var, as_int, index_var, logical_and, lt, prod, sint, sym_eq, terms, to_expr


def contiguous_strides(shape: Sequence[sint]) -> tuple[sint, ...]:
    strides: list[sint] = []
    acc: sint = 1
    for n in reversed(shape):
        strides.append(0 if as_int(n) == 1 else acc)
        acc = acc * n
    return tuple(reversed(strides))


def _min(a: sint, b: sint) -> sint:
    return _pick(a, b, lambda x, y: x <= y)


def _max(a: sint, b: sint) -> sint:
    return _pick(a, b, lambda x, y: x >= y)


def _pick(a: sint, b: sint, first_wins) -> sint:
    ia, ib = as_int(a), as_int(b)
    if ia is not None and ib is not None:
        return a if first_wins(ia, ib) else b
    ea, eb = to_expr(a), to_expr(b)
    if ea == eb:
        return a
    gap: dict = {}  # a - b as coefficients per atom: sizes a constant apart (n - 1, n) are ordered
    for c, atom in terms(ea - eb):
        gap[atom] = gap.get(atom, 0) + c
    if all(c == 0 for atom, c in gap.items() if atom is not None):
        return a if first_wins(gap.get(None, 0), 0) else b
    (a0, a1), (b0, b1) = (ea.vmin, ea.vmax), (eb.vmin, eb.vmax)
    if first_wins(a1, b0) and first_wins(a0, b1) and first_wins(a0, b0) and first_wins(a1, b1):
        return a
    if first_wins(b1, a0) and first_wins(b0, a1) and first_wins(b0, a0) and first_wins(b1, a1):
        return b
    raise NotImplementedError(f"cannot order symbolic sizes {a} and {b}")


@dataclass(frozen=True)
class View:
    shape: tuple[sint, ...]
    strides: tuple[sint, ...]
    offset: sint = 0
    mask: tuple[tuple[sint, sint], ...] | None = None

    @staticmethod
    def contiguous(shape: Sequence[sint]) -> View:
        shape = tuple(shape)
        return View(shape, contiguous_strides(shape))

    @staticmethod
    def make(shape, strides, offset: sint = 0, mask=None) -> View:
        """Canonical form: stride 0 on size-1 axes, no mask when it covers everything."""
        shape = tuple(shape)
        strides = tuple(0 if as_int(n) == 1 else s for n, s in zip(shape, strides))
        if mask is not None:
            mask = tuple(mask)
            if any(as_int(hi) is not None and as_int(lo) is not None and as_int(hi) <= as_int(lo)
                   for lo, hi in mask):
                # nothing is valid: every element reads as zero
                mask = tuple((0, 0) for _ in shape)
                strides, offset = tuple(0 for _ in shape), 0
            elif all(as_int(lo) == 0 and sym_eq(hi, n) for (lo, hi), n in zip(mask, shape)):
                mask = None
        return View(shape, strides, offset, mask)

    # --- properties -----------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> sint:
        return prod(self.shape)

    @property
    def is_contiguous(self) -> bool:
        return (self.mask is None and as_int(self.offset) == 0
                and all(sym_eq(a, b) for a, b in zip(self.strides, contiguous_strides(self.shape))))

    def overlap(self) -> float:
        """How many times the view reads each element it reaches, on average, along the axes it
        steps (a 3x3 im2col's windows: 9; a broadcast axis does not count: grouping hoists what
        it repeats). 1 for a masked view, an empty one or one with run-time strides."""
        steps = [(as_int(n), as_int(s)) for n, s in zip(self.shape, self.strides) if as_int(s) != 0]
        if self.mask is not None or any(n is None or s is None or n == 0 for n, s in steps):
            return 1.0
        span = 1 + sum((n - 1) * abs(s) for n, s in steps)
        return max(1.0, math.prod(n for n, _ in steps) / span)

    def _mask(self) -> tuple[tuple[sint, sint], ...]:
        return self.mask if self.mask is not None else tuple((0, n) for n in self.shape)

    # --- movement ---------------------------------------------------------------------
    def permute(self, order: Sequence[int]) -> View:
        order = [o % self.ndim for o in order] if self.ndim else []
        if sorted(order) != list(range(self.ndim)):
            raise ValueError(f"permute order {tuple(order)} is not a permutation of {self.ndim} axes")
        mask = None if self.mask is None else [self.mask[o] for o in order]
        return View.make([self.shape[o] for o in order], [self.strides[o] for o in order],
                         self.offset, mask)

    def expand(self, shape: Sequence[sint]) -> View:
        shape = tuple(shape)
        if len(shape) != self.ndim:
            raise ValueError(f"expand to {shape} needs {self.ndim} axes")
        for old, new in zip(self.shape, shape):
            if not sym_eq(old, new) and as_int(old) != 1:
                raise ValueError(f"cannot expand axis of size {old} to {new}")
        mask = None
        if self.mask is not None:
            mask = [(lo, hi) if sym_eq(old, new) else ((0, new) if as_int(hi) == 1 and as_int(lo) == 0
                                                         else (0, 0))
                    for (lo, hi), old, new in zip(self.mask, self.shape, shape)]
        return View.make(shape, self.strides, self.offset, mask)

    def shrink(self, bounds: Sequence[tuple[sint, sint]]) -> View:
        """Keep [start, stop) on every axis."""
        offset = self.offset
        for (start, _), s in zip(bounds, self.strides):
            offset = offset + start * s
        mask = None
        if self.mask is not None:
            mask = [(_max(0, _sub(lo, start)), _min(_sub(stop, start), _sub(hi, start)))
                    for (lo, hi), (start, stop) in zip(self.mask, bounds)]
        return View.make([_sub(stop, start) for start, stop in bounds], self.strides, offset, mask)

    def flip(self, axes: Sequence[int]) -> View:
        axes = {a % self.ndim for a in axes}
        offset, strides, mask = self.offset, list(self.strides), list(self._mask())
        for a in axes:
            n = self.shape[a]
            offset = offset + (n - 1) * strides[a]
            strides[a] = -strides[a]
            lo, hi = mask[a]
            mask[a] = (_sub(n, hi), _sub(n, lo))
        return View.make(self.shape, strides, offset, mask if self.mask is not None else None)

    def step(self, steps: Sequence[int]) -> View:
        """Every steps[k]-th element on axis k (steps > 0)."""
        shape, strides, mask = [], [], []
        for n, s, (lo, hi), st in zip(self.shape, self.strides, self._mask(), steps):
            if st <= 0:
                raise ValueError(f"step must be positive, got {st}")
            shape.append(_ceildiv(n, st))
            strides.append(s * st)
            mask.append((_ceildiv(lo, st), _ceildiv(hi, st)))
        return View.make(shape, strides, self.offset, mask if self.mask is not None else None)

    def slice(self, axis: int, start: sint, stop: sint, step: int = 1) -> View:
        """Python slicing semantics on one axis, with already-normalised start/stop."""
        axis %= self.ndim
        if step < 0:
            n = self.shape[axis]
            flipped = self.flip([axis])
            # x[start:stop:-k] == flip(x)[n-1-start : n-1-stop : k]
            return flipped.slice(axis, _sub(_sub(n, 1), start), _sub(_sub(n, 1), stop), -step)
        bounds = [(0, n) for n in self.shape]
        bounds[axis] = (start, _max(start, stop))
        v = self.shrink(bounds)
        if step != 1:
            steps = [1] * self.ndim
            steps[axis] = step
            v = v.step(steps)
        return v

    def pad(self, pads: Sequence[tuple[sint, sint]]) -> View:
        """Add `before` and `after` zero elements on every axis."""
        offset, mask = self.offset, []
        for (before, _after), s, (lo, hi) in zip(pads, self.strides, self._mask()):
            offset = offset - before * s
            mask.append((lo + before, hi + before))
        shape = [n + b + a for n, (b, a) in zip(self.shape, pads)]
        return View.make(shape, self.strides, offset, mask)

    def reshape(self, shape: Sequence[sint]) -> View | None:
        """The same elements in row-major order under a new shape, or None when the
        strides cannot express it without copying."""
        shape = tuple(shape)
        old_n, new_n = as_int(self.numel), as_int(prod(shape))
        if old_n is not None and new_n is not None and old_n != new_n:
            raise ValueError(f"cannot reshape {self.shape} ({old_n} elements) to {shape} ({new_n})")
        if old_n == 0:
            return View.contiguous(shape)
        if len(shape) == self.ndim and all(sym_eq(a, b) for a, b in zip(shape, self.shape)):
            return self
        if self.mask is not None:
            return self._reshape_unit_axes(shape)
        if self.is_contiguous:  # any reshape of row-major data, symbolic sizes included
            return View.contiguous(shape)
        return self._reshape_strided(shape)

    def _reshape_unit_axes(self, shape: tuple[sint, ...]) -> View | None:
        """A masked view reshapes only by adding or removing size-1 axes."""
        old = [(n, s, m) for n, s, m in zip(self.shape, self.strides, self.mask) if as_int(n) != 1]
        if [n for n, _, _ in old] != [n for n in shape if as_int(n) != 1]:
            return None
        if any(as_int(n) == 1 and m != (0, 1) for n, m in zip(self.shape, self.mask)):
            return None  # a fully masked unit axis would be lost
        it = iter(old)
        strides, mask = [], []
        for n in shape:
            if as_int(n) == 1:
                strides.append(0)
                mask.append((0, 1))
            else:
                _, s, m = next(it)
                strides.append(s)
                mask.append(m)
        return View.make(shape, strides, self.offset, mask)

    def _reshape_strided(self, shape: tuple[sint, ...]) -> View | None:
        old = [(n, s) for n, s in zip(self.shape, self.strides) if as_int(n) != 1]
        strides: list[sint] = [0] * len(shape)
        i = j = 0
        while j < len(shape):
            if as_int(shape[j]) == 1:
                j += 1
                continue
            if i >= len(old):
                return None
            group, dims = [old[i]], [j]
            po, pn = old[i][0], shape[j]
            i, j = i + 1, j + 1
            if as_int(po) is None or as_int(pn) is None:
                if not sym_eq(po, pn):
                    return None
            else:
                po, pn = as_int(po), as_int(pn)
                while po != pn:
                    if po < pn:
                        if i >= len(old) or as_int(old[i][0]) is None:
                            return None
                        group.append(old[i])
                        po *= as_int(old[i][0])
                        i += 1
                    else:
                        if j >= len(shape) or as_int(shape[j]) is None:
                            return None
                        dims.append(j)
                        pn *= as_int(shape[j])
                        j += 1
            for (_, s_outer), (n_inner, s_inner) in zip(group, group[1:]):
                if not sym_eq(s_outer, s_inner * n_inner):
                    return None
            acc = group[-1][1]
            for d in reversed(dims):
                strides[d] = acc
                acc = acc * shape[d]
        if i != len(old):
            return None
        return View.make(shape, strides, self.offset)

    # --- index math -------------------------------------------------------------------
    def index(self, idxs: Sequence[sint]) -> tuple[Expr, Expr]:
        """(flat source index, validity) for the element at idxs."""
        flat = to_expr(self.offset)
        for i, s in zip(idxs, self.strides):
            flat = flat + to_expr(i) * s
        valid = to_expr(1)
        if self.mask is not None:
            for i, (lo, hi) in zip(idxs, self.mask):
                valid = logical_and(valid, logical_and(lt(to_expr(lo) - 1, i), lt(i, hi)))
        return flat, valid

    def index_vars(self, prefix: str = "i") -> list[Var]:
        """One bounded variable per axis, for generating index expressions."""
        return [index_var(f"{prefix}{k}", n) for k, n in enumerate(self.shape)]

    def __str__(self) -> str:
        parts = [f"shape={tuple(self.shape)}", f"strides={tuple(self.strides)}"]
        if as_int(self.offset) != 0:
            parts.append(f"offset={self.offset}")
        if self.mask is not None:
            parts.append(f"mask={tuple(self.mask)}")
        return "View(" + ", ".join(str(p) for p in parts) + ")"


def _sub(a: sint, b: sint) -> sint:
    if isinstance(a, Expr) or isinstance(b, Expr):
        return to_expr(a) - b
    return a - b


def _ceildiv(a: sint, b: int) -> sint:
    if isinstance(a, Expr):
        return (a + (b - 1)) // b
    return -(-a // b)


def compose(inner: View, outer: View) -> View | None:
    """One view of inner's source reading what outer reads of inner's elements (in row-major
    order), or None where that needs a copy: outer runs across axes inner does not store
    contiguously, inner is masked, or a size is symbolic. Inner's axes stored contiguously are
    merged; each of outer's axes must then step along one of them, never past its end, so the
    row-major index has no carries and maps axis by axis."""
    ints = lambda xs: [as_int(x) for x in xs]
    shape, strides = ints(inner.shape), ints(inner.strides)
    oshape, ostrides = ints(outer.shape), ints(outer.strides)
    box = [ints(b) for b in outer.mask] if outer.mask is not None else [[0, n] for n in oshape]
    flat = [*shape, *strides, *oshape, *ostrides, *(b for lo_hi in box for b in lo_hi)]
    if inner.mask is not None or None in (*flat, as_int(inner.offset), as_int(outer.offset)):
        return None
    if any(hi <= lo for lo, hi in box):  # reads nothing but zeros
        return View.make(oshape, [0] * len(oshape), 0, outer.mask)
    axes: list[list[int]] = []  # [size, stride] of inner's axes, merged where stored contiguously
    for n, s in zip(shape, strides):
        if n != 1:
            if axes and axes[-1][1] == s * n:
                axes[-1] = [axes[-1][0] * n, s]
            else:
                axes.append([n, s])
    row = [math.prod(n for n, _ in axes[j + 1:]) for j in range(len(axes))]  # row-major strides
    base = as_int(outer.offset) + sum(lo * s for (lo, _), s in zip(box, ostrides))
    if not 0 <= base < math.prod(n for n, _ in axes):
        return None
    digit = [base // row[j] % axes[j][0] for j in range(len(axes))]
    low, high = list(digit), list(digit)
    new = [0] * len(oshape)
    for k, ((lo, hi), s) in enumerate(zip(box, ostrides)):
        if hi - lo == 1 or s == 0:
            continue
        j = next((j for j, r in enumerate(row) if r <= abs(s) and s % r == 0), None)
        if j is None:
            return None
        step = s // row[j]
        low[j] += min(0, (hi - lo - 1) * step)
        high[j] += max(0, (hi - lo - 1) * step)
        new[k] = step * axes[j][1]
    if any(lo < 0 or hi >= n for lo, hi, (n, _) in zip(low, high, axes)):
        return None
    offset = (as_int(inner.offset) + sum(d * s for d, (_, s) in zip(digit, axes))
              - sum(lo * s for (lo, _), s in zip(box, new)))
    return View.make(oshape, new, offset, outer.mask)


def product_operands(va: View, vb: View, k: int) -> tuple[View, View] | None:
    """(a2, b2) with sum_k(view(a, va) * view(b, vb)) == matmul(view(a, a2), view(b, b2)), for a
    product as the frontend writes one: [*B, M, N, K] with K last, va broadcast along N and vb along M
    (either of one row or column, as decode's one query is). None for any other product."""
    if va.mask is not None or vb.mask is not None or k != len(va.shape) - 1 or len(va.shape) < 3:
        return None
    *batch, m, n, depth = va.shape
    sa, sb = va.strides, vb.strides
    if not ((as_int(n) == 1 or as_int(sa[-2]) == 0) and (as_int(m) == 1 or as_int(sb[-3]) == 0)):
        return None
    nb = len(batch)
    return (View.make((*batch, m, depth), (*sa[:nb], sa[-3], sa[-1]), va.offset),
            View.make((*batch, depth, n), (*sb[:nb], sb[-1], sb[-2]), vb.offset))
