"""The scoped expression memo of the kernel emitters (GPU C source, CPU LLVM IR).

An emitter walks a kernel expression and writes each subexpression once: the value it wrote
(a C variable name, an llvmlite Value) is remembered under the expression and reused where the
same expression comes up again. A value is only visible in the block that computed it and the
blocks nested in it (a loop body, an `if`, a lane of a vector): leaving the block forgets it.
Index variables (`i0`, a reduce variable `r3`, ...) follow the same rule: a block binds them,
and a reduction may be computed (hoisted) where all its free variables are bound.

    scope = Scope[str]()
    scope.bind("i0", "i0")
    with scope.nested():           # a loop body
        scope.bind("r1", "r1")
        scope.remember(expr, "v7")
        scope.cached(expr)          # "v7"
    scope.cached(expr)              # None: the loop's values are gone
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

V = TypeVar("V")


class Scope(Generic[V]):
    """A stack of layers, each with the index variables bound in it (name -> value) and the
    memo of expressions computed in it (key -> value). Lookups search innermost first; `pop`
    drops the innermost layer with everything bound and remembered in it. The outermost layer
    (the function body) is there from the start and cannot be popped."""

    def __init__(self) -> None:
        self._layers: list[tuple[dict[str, V], dict[Hashable, V]]] = [({}, {})]

    @property
    def depth(self) -> int:
        """The number of layers pushed above the outermost."""
        return len(self._layers) - 1

    def push(self) -> None:
        """Enter a nested block."""
        self._layers.append(({}, {}))

    def pop(self) -> None:
        """Leave the innermost block, forgetting what it bound and remembered."""
        if len(self._layers) == 1:
            raise IndexError("pop of the outermost scope")
        self._layers.pop()

    @contextmanager
    def nested(self) -> Iterator[None]:
        """push(), then pop() when the block ends (also on an exception)."""
        self.push()
        try:
            yield
        finally:
            self.pop()

    def bind(self, name: str, value: V) -> None:
        """Bind the index variable name to value in the innermost block. Rebinding it there
        forgets what the block remembered: those values may have been computed from the old one
        (a GEMV's unrolled steps of k read the right operand at each step)."""
        vars_, memo = self._layers[-1]
        if name in vars_ and vars_[name] != value:
            memo.clear()
        vars_[name] = value

    def var(self, name: str) -> V:
        """The value of index variable name (the innermost binding); KeyError if unbound."""
        for vars_, _ in reversed(self._layers):
            if name in vars_:
                return vars_[name]
        raise KeyError(name)

    def bound(self) -> set[str]:
        """The names of every index variable bound in any open block."""
        return set().union(*(vars_.keys() for vars_, _ in self._layers))

    def cached(self, key: Hashable) -> V | None:
        """The value remembered for key in an open block (the innermost), or None."""
        for _, memo in reversed(self._layers):
            if key in memo:
                return memo[key]
        return None

    def remember(self, key: Hashable, value: V) -> V:
        """Remember value for key in the innermost block; returns value."""
        self._layers[-1][1][key] = value
        return value


__all__ = ["Scope"]
